"""The name tables: one per model family, HF checkpoint names <-> megatron-core GPTModel (local spec) names plus
the layout kind of each tensor. Both directions of the conversion read these tables and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_sync.convert.layout import GATE_UP, QKV, REPLICATED, ROW, VOCAB

LAYER_HF, LAYER_MCORE = "model.layers.{layer}.", "decoder.layers.{layer}."
EXPERT_HF, EXPERT_MCORE = "mlp.experts.{expert}.", "mlp.experts.local_experts.{expert}."


@dataclass(frozen=True)
class Entry:
    """One megatron tensor and the HF tensors it is made of (several when megatron fuses them, in fusion order)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str


# Whole-model tensors (full names).
EMBEDDING = Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)
FINAL_NORM = Entry("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED)
OUTPUT = Entry("output_layer.weight", ("lm_head.weight",), VOCAB)  # absent when the embeddings are tied

# Per-layer tensors, under decoder.layers.{layer}. / model.layers.{layer}.
ATTENTION = (
    Entry("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight"), QKV),
    Entry("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
)
QKV_BIAS = Entry("self_attention.linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                    "self_attn.v_proj.bias"), QKV)
QK_NORM = (  # Qwen3: RMSNorm over head_dim of each query / key head, before RoPE
    Entry("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED),
    Entry("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED),
)
DENSE_MLP = (
    Entry("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    Entry("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW),
)
ROUTER = Entry("mlp.router.weight", ("mlp.gate.weight",), REPLICATED)
# Per-expert tensors, under ...mlp.experts.local_experts.{expert}. / ...mlp.experts.{expert}. (megatron's
# SequentialMLP; experts are tensor-parallel over the expert-TP group like the dense MLP).
EXPERT_MLP = (
    Entry("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), GATE_UP),
    Entry("linear_fc2.weight", ("down_proj.weight",), ROW),
)
LAYER_NORMS = (
    Entry("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
    Entry("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED),
)

# model_type -> (qkv bias always on, per-head q/k norm, mixture of experts)
FAMILIES = {
    "llama": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, True, False),
    "qwen3_moe": (False, True, True),
}


@dataclass(frozen=True)
class Rule:
    """An Entry placed in the model: global HF names, the megatron name template (`{layer}` / `{expert}` filled
    with the stage-local layer and EP-local expert index), and the global layer / expert it belongs to."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None

    def megatron_name(self, local_layer: int | None = None, local_expert: int | None = None) -> str:
        return self.megatron.format(layer=local_layer, expert=local_expert)


def cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    """A field of an HF config object or config.json dict; None counts as missing."""
    value = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
    return default if value is None else value


def model_type(hf_config: Any) -> str:
    kind = cfg(hf_config, "model_type", "llama")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} has no HF <-> megatron name table; supported: {sorted(FAMILIES)}")
    return kind


def is_tied(hf_config: Any) -> bool:
    """True when the output layer shares the embedding (then neither side carries lm_head/output_layer)."""
    return bool(cfg(hf_config, "tie_word_embeddings", False))


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (0 for a dense family); transformers 5 renames the field num_local_experts."""
    if not FAMILIES[model_type(hf_config)][2]:
        return 0
    return int(cfg(hf_config, "num_experts", cfg(hf_config, "num_local_experts", 0)))


def is_moe_layer(hf_config: Any, layer: int) -> bool:
    """HF Qwen3-MoE's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    if num_experts(hf_config) == 0:
        return False
    step = int(cfg(hf_config, "decoder_sparse_step", 1))
    return layer not in (cfg(hf_config, "mlp_only_layers", []) or []) and (layer + 1) % step == 0


def rules(hf_config: Any) -> list[Rule]:
    """Every tensor of the model in HF module order: embedding, layers, final norm, output layer."""
    bias_always, qk_norm, _ = FAMILIES[model_type(hf_config)]
    has_bias = bias_always or bool(cfg(hf_config, "attention_bias", False))
    out = [Rule(EMBEDDING.megatron, EMBEDDING.hf, EMBEDDING.kind)]
    for i in range(int(cfg(hf_config, "num_hidden_layers"))):
        layer = [*ATTENTION[:1], *([QKV_BIAS] if has_bias else []), *ATTENTION[1:], *(QK_NORM if qk_norm else ())]
        out += [_in_layer(e, i) for e in layer]
        if is_moe_layer(hf_config, i):
            out += [_in_expert(e, i, x) for x in range(num_experts(hf_config)) for e in EXPERT_MLP]
            out.append(_in_layer(ROUTER, i))
        else:
            out += [_in_layer(e, i) for e in DENSE_MLP]
        out += [_in_layer(e, i) for e in LAYER_NORMS]
    out.append(Rule(FINAL_NORM.megatron, FINAL_NORM.hf, FINAL_NORM.kind))
    if not is_tied(hf_config):
        out.append(Rule(OUTPUT.megatron, OUTPUT.hf, OUTPUT.kind))
    return out


def _in_layer(e: Entry, layer: int) -> Rule:
    hf = tuple(LAYER_HF.format(layer=layer) + h for h in e.hf)
    return Rule(LAYER_MCORE + e.megatron, hf, e.kind, layer=layer)


def _in_expert(e: Entry, layer: int, expert: int) -> Rule:
    hf = tuple(LAYER_HF.format(layer=layer) + EXPERT_HF.format(expert=expert) + h for h in e.hf)
    return Rule(LAYER_MCORE + EXPERT_MCORE + e.megatron, hf, e.kind, layer=layer, expert=expert)


def _kinds_by_suffix() -> dict[str, str]:
    """megatron name suffix -> layout kind, over every family's table (for callers that only have a name)."""
    entries = [EMBEDDING, FINAL_NORM, OUTPUT, *ATTENTION, QKV_BIAS, *QK_NORM, *DENSE_MLP, ROUTER, *EXPERT_MLP,
               *LAYER_NORMS]
    table: dict[str, str] = {}
    for e in entries:
        suffix = ".".join(e.megatron.split(".")[-2:])
        assert table.setdefault(suffix, e.kind) == e.kind, f"suffix {suffix} has two layout kinds"
    return table


KIND_BY_SUFFIX = _kinds_by_suffix()
