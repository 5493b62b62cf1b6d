"""Qwen2 / Qwen2.5: the dense decoder with q/k/v biases always on."""
from weight_sync.families.base import Family

FAMILY = Family(
    name="qwen2", model_types=("qwen2",), examples=("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-Math-1.5B"),
    tiny_classes=("Qwen2Config", "Qwen2ForCausalLM"), name_pattern=r"qwen2", qkv_bias=True,
)
