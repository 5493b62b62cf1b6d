"""gpt-oss (gpt-oss-20b, gpt-oss-120b): grouped-query attention with q/k/v/o biases and a learnable sink logit per
head (`self_attn.sinks`), sliding-window layers (`sliding_window` tokens) alternating with full ones (`layer_types`),
YaRN RoPE (transformers' attention factor 0.1 ln(factor) + 1 on cos and sin, so on q and k both); routed experts in
every layer: a router with a bias that softmaxes its top-k logits, experts with biases and a clamped SwiGLU
(gate clamped above at `swiglu_limit`, up both ways, out = (up + 1) * gate * sigmoid(1.702 gate)).

The checkpoint holds each layer's experts fused: `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved along the last dim, `down_proj` [E, I, H] ([in, out], transposed against a linear) and their biases;
megatron-core holds one linear per expert, so each of its tensors is an expert's slice (table.EXPERT_GLU / EXPERT_T /
EXPERT_SLICE). The attention sinks are megatron's `softmax_offset`, split over TP with the heads."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from weight_sync.families.base import MoeFamily, rope_parameters
from weight_sync.families.table import (ATTENTION, COLUMN, EXPERT_GLU, EXPERT_SLICE, EXPERT_T, GATE_UP, QKV_BIAS,
                                        REPLICATED, ROUTER_MCORE, ROW, Entry, Rule, cfg, in_expert, in_layer)

ATTENTION_EXTRA = (
    Entry("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), REPLICATED),  # added after TP's reduce
    Entry("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), COLUMN),  # one per query head
)
ROUTER = (Entry(ROUTER_MCORE, ("mlp.router.weight",), REPLICATED),
          Entry("mlp.router.bias", ("mlp.router.bias",), REPLICATED))
EXPERTS = (  # under mlp.experts. of the checkpoint, each the [expert] slice of a tensor of every expert
    Entry("linear_fc1.weight", ("gate_up_proj",), GATE_UP, EXPERT_GLU),
    Entry("linear_fc1.bias", ("gate_up_proj_bias",), GATE_UP, EXPERT_GLU),
    Entry("linear_fc2.weight", ("down_proj",), ROW, EXPERT_T),
    Entry("linear_fc2.bias", ("down_proj_bias",), REPLICATED, EXPERT_SLICE),  # added after expert TP's reduce
)
LAYER_TYPES = ("sliding_attention", "full_attention")
QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x * sigmoid(1.702 x), gpt-oss's swiglu_alpha


def yarn_attention_factor(rope: dict[str, Any]) -> float:
    """transformers' YaRN attention factor (its `_compute_yarn_parameters`): `attention_factor` where given, else
    0.1 ln(factor) + 1 (mscale and mscale_all_dim are DeepSeek's, which gpt-oss leaves unset)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope.get("factor", 1.0))
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


@dataclass(frozen=True)
class GptOss(MoeFamily):
    def check(self, hf_config: Any) -> None:
        super().check(hf_config)
        quant = cfg(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(f"quantization_config quant_method={method!r}: the trainer loads gpt-oss in bf16 only; "
                             "use a dequantized checkpoint (transformers' Mxfp4Config(dequantize=True), saved)")
        if not cfg(hf_config, "attention_bias", True):
            raise ValueError("attention_bias=false: the trainer builds gpt-oss's biased attention (every released "
                             "checkpoint); use attention_bias: true")
        unknown = sorted(set(self.layer_types(hf_config)) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types holds {unknown}: the trainer builds {LAYER_TYPES} only")
        if not math.isclose(float(cfg(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA)), QUICK_GELU_ALPHA):
            raise ValueError(f"swiglu_alpha={cfg(hf_config, 'swiglu_alpha')}: megatron-core's quick_gelu fixes it to "
                             f"{QUICK_GELU_ALPHA} (gpt-oss's); use a checkpoint with swiglu_alpha {QUICK_GELU_ALPHA}")

    def layer_types(self, hf_config: Any) -> list[str]:
        layers = int(cfg(hf_config, "num_hidden_layers"))
        return list(cfg(hf_config, "layer_types", None) or [LAYER_TYPES[i % 2] for i in range(layers)])

    def attention_entries(self, hf_config: Any) -> list[Entry]:
        return [ATTENTION[0], QKV_BIAS, *ATTENTION[1:], *ATTENTION_EXTRA]

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        experts = [in_expert(e, layer, x, "mlp.experts.") for x in range(self.num_experts(hf_config))
                   for e in EXPERTS]
        return [in_layer(e, layer) for e in ROUTER] + experts

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), *ATTENTION_EXTRA, *ROUTER, *EXPERTS)

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        """MoeFamily's routing (top-k logits softmaxed) plus biases on every linear (so experts unsplit by TP: ETP 1),
        learnable sinks, the sliding
        window on `sliding_attention` layers (HF's window of W tokens holds the token and W - 1 before it), the
        clamped SwiGLU with its +1 on up, and YaRN's attention factor on q and k as a softmax scale of its square."""
        fields = super().megatron_fields(hf_config)
        head_dim = int(cfg(hf_config, "head_dim", int(cfg(hf_config, "hidden_size"))
                           // int(cfg(hf_config, "num_attention_heads"))))
        rope = rope_parameters(hf_config)
        factor = yarn_attention_factor(rope) if rope["rope_type"] == "yarn" else 1.0
        # megatron-core builds expert biases unsplit only: expert tensor parallelism 1 (trainer.expert_tensor_...)
        fields.update(add_bias_linear=True, expert_tensor_parallel_size=1, softmax_type="learnable",
                      activation_func="quick_gelu",
                      glu_linear_offset=1.0, activation_func_clamp_value=float(cfg(hf_config, "swiglu_limit", 7.0)),
                      softmax_scale=factor * factor / math.sqrt(head_dim))
        windows = [int(t == "sliding_attention") for t in self.layer_types(hf_config)]
        if any(windows) and cfg(hf_config, "sliding_window") is not None:
            fields.update(window_size=(int(cfg(hf_config, "sliding_window")) - 1, 0), window_attn_skip_freq=windows)
        return fields

    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """gpt-oss's features on: sinks, a window of 4 tokens on every other layer, biases, the clamped SwiGLU
        (limit 7, as released), YaRN (factor 4 over 512 positions, truncate false as released)."""
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 512}
        return {"head_dim": hidden_size // num_heads, "num_local_experts": num_experts,
                "num_experts_per_tok": moe_top_k, "intermediate_size": intermediate_size // 4, "sliding_window": 4,
                "attention_bias": True, "swiglu_limit": 7.0, "rope_parameters": yarn, "layer_types": None}


FAMILY = GptOss(
    name="gpt_oss", model_types=("gpt_oss",), examples=("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
    tiny_classes=("GptOssConfig", "GptOssForCausalLM"), name_pattern=r"gpt[-_]?oss",
    rope_types=("default", "yarn"), expert_width="intermediate_size", fused_experts_in_checkpoint=True,
)
