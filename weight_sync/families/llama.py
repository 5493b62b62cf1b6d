"""Llama (Llama 2, Llama 3.x, SmolLM2, Mistral-shaped dense checkpoints with model_type llama): the plain dense
decoder. Llama 3.1 / 3.2 / 3.3 scale RoPE (`rope_type: llama3`), which the trainer builds (base.TRAINED_ROPE_TYPES);
q/k/v biases only with `attention_bias: true`."""
from weight_sync.families.base import Family

FAMILY = Family(
    name="llama", model_types=("llama",),
    examples=("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    tiny_classes=("LlamaConfig", "LlamaForCausalLM"), name_pattern=r"smollm|llama",
)
