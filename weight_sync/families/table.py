"""The vocabulary of a name table: a tensor's layout kind, an `Entry` (one megatron tensor and the HF tensors it is
made of), a `Rule` (an entry placed in the model), and the entries every decoder family shares. Each family module
(weight_sync.families.<family>) builds its table from these; the converters read the rules and nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Layout kinds of a megatron tensor: how tensor parallelism splits it (weight_sync.convert.layout).
REPLICATED = "replicated"  # every TP rank holds the whole tensor (norms, the MoE router)
COLUMN = "column"  # column-parallel linear: output rows split over TP ranks
ROW = "row"  # row-parallel linear: input columns split over TP ranks
VOCAB = "vocab"  # vocab-parallel embedding / output layer: rows split, after padding the vocab
QKV = "qkv"  # fused q/k/v, group-major, so a plain row chunk holds whole query groups
GATE_UP = "gate_up"  # fused [gate; up]: each TP rank holds [gate chunk; up chunk]
KINDS = (REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP)

# How an HF tensor holds a megatron tensor (weight_sync.convert.mapping): whole (fused by the layout kind), or as
# one expert's slice [expert] of a tensor of every expert (gpt-oss's checkpoints) - as it is, transposed (the HF side
# is [in, out] where megatron's linear is [out, in]), or transposed with gate / up interleaved along the last dim
# (HF gate = [..., ::2], up = [..., 1::2]; megatron's [gate; up]).
WHOLE, EXPERT_SLICE, EXPERT_T, EXPERT_GLU = "whole", "expert_slice", "expert_t", "expert_glu"
HF_FORMS = (WHOLE, EXPERT_SLICE, EXPERT_T, EXPERT_GLU)

LAYER_HF, LAYER_MCORE = "model.layers.{layer}.", "decoder.layers.{layer}."
EXPERT_MCORE = "mlp.experts.local_experts.{expert}."


@dataclass(frozen=True)
class Entry:
    """One megatron tensor and the HF tensors it is made of (several when megatron fuses them, in fusion order)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    hf_form: str = WHOLE


@dataclass(frozen=True)
class Rule:
    """An Entry placed in the model: global HF names, the megatron name template (`{layer}` / `{expert}` filled
    with the stage-local layer and EP-local expert index), and the global layer / expert it belongs to."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None
    hf_form: str = WHOLE

    @property
    def is_expert_slice(self) -> bool:
        """True when each HF tensor holds every expert and this rule's tensor is its [expert] slice."""
        return self.hf_form != WHOLE

    def megatron_name(self, local_layer: int | None = None, local_expert: int | None = None) -> str:
        return self.megatron.format(layer=local_layer, expert=local_expert)


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
QK_NORM = (  # RMSNorm over head_dim of each query / key head, before RoPE
    Entry("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED),
    Entry("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED),
)
DENSE_MLP = (
    Entry("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    Entry("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW),
)
# Multi-latent attention (DeepSeek-V2 / V3, Kimi-K2, Moonlight), megatron's MLASelfAttention on the local spec: the
# query either projected whole (no `q_lora_rank`) or down to a rank, normed and up again; keys and values down to
# `kv_lora_rank` (plus the shared RoPE key), normed, and up per head. Every projection is column-parallel (the down
# projections' outputs are gathered back whole inside the layer), the output projection row-parallel.
MLA_Q = (Entry("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), COLUMN),)
MLA_Q_LORA = (
    Entry("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), COLUMN),
    Entry("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), REPLICATED),
    Entry("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), COLUMN),
)
MLA_KV = (
    Entry("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), COLUMN),
    Entry("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), REPLICATED),
    Entry("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), COLUMN),
    Entry("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
)
# GLM-4's dense layers: the MLP's gate and up projections fused in the checkpoint as [gate; up], and a norm after the
# attention and after the MLP, before each residual add ("sandwich" norms; megatron's layer has none, so the trainer's
# output projections carry them: glue.trainer.post_norm)
FUSED_GATE_UP = Entry("mlp.linear_fc1.weight", ("mlp.gate_up_proj.weight",), GATE_UP)
POST_NORMS = (
    Entry("self_attention.linear_proj.post_layernorm.weight", ("post_self_attn_layernorm.weight",), REPLICATED),
    Entry("mlp.linear_fc2.post_layernorm.weight", ("post_mlp_layernorm.weight",), REPLICATED),
)
LAYER_NORMS = (
    Entry("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
    Entry("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED),
)
# A MoE layer's router and, under ...mlp.experts.local_experts.{expert}., each expert's MLP (megatron's SequentialMLP;
# experts are tensor-parallel over the expert-TP group like the dense MLP). The HF side is the family's.
ROUTER_MCORE = "mlp.router.weight"
EXPERT_FC1, EXPERT_FC2 = "linear_fc1.weight", "linear_fc2.weight"
# DeepSeek-V3-style MoE layers (GLM-4.5 too): the sigmoid router's expert bias (a buffer on both sides: it chooses
# experts, it does not weight them) and the shared experts beside the routed ones, split over TP like a dense MLP
ROUTER_BIAS = Entry("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), REPLICATED)
SHARED_EXPERTS = (
    Entry("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                   "mlp.shared_experts.up_proj.weight"), GATE_UP),
    Entry("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), ROW),
)


def cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    """A field of an HF config object or config.json dict; None counts as missing."""
    value = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
    return default if value is None else value


def in_layer(e: Entry, layer: int) -> Rule:
    hf = tuple(LAYER_HF.format(layer=layer) + h for h in e.hf)
    return Rule(LAYER_MCORE + e.megatron, hf, e.kind, layer=layer, hf_form=e.hf_form)


def in_expert(e: Entry, layer: int, expert: int, hf_prefix: str) -> Rule:
    """`e` for expert `expert` of layer `layer`; `hf_prefix` is the family's path of an expert in a layer
    (`mlp.experts.{expert}.`)."""
    hf = tuple(LAYER_HF.format(layer=layer) + hf_prefix.format(expert=expert) + h for h in e.hf)
    return Rule(LAYER_MCORE + EXPERT_MCORE + e.megatron, hf, e.kind, layer=layer, expert=expert, hf_form=e.hf_form)
