"""What sluice knows of a model family, as one object: which config.json `model_type`s it takes, its HF <-> megatron
name table, which layers are dense or MoE, the megatron-core config fields it sets, what the trainer cannot build
yet, and how a tiny random one is made. `Family` is a dense decoder (Llama's shape); `MoeFamily` adds routed
experts. Each family module (weight_sync.families.<name>) defines `FAMILY`, setting fields and overriding methods
where it differs. Pure data and arithmetic: no torch, no transformers."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from weight_sync.families.table import (ATTENTION, DENSE_MLP, EMBEDDING, EXPERT_FC1, EXPERT_FC2, FINAL_NORM, GATE_UP,
                                        LAYER_NORMS, OUTPUT, QK_NORM, QKV_BIAS, REPLICATED, ROUTER_BIAS, ROUTER_MCORE,
                                        ROW, SHARED_EXPERTS, Entry, Rule, cfg, in_expert, in_layer)

# RoPE types the trainer builds: it takes transformers' own inverse frequencies for them, and YaRN's attention factor
# (on cos and sin, so on every score when RoPE turns the whole head) as the softmax scale. Dynamic NTK's and
# LongRoPE's length-dependent tables are not built yet.
TRAINED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings: `rope_parameters` (transformers >= 5) or the older `rope_scaling`, with `rope_type` set."""
    params = dict(cfg(hf_config, "rope_parameters", None) or cfg(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_theta(hf_config: Any) -> float:
    """RoPE base from `rope_parameters` (transformers >= 5) or the older `rope_theta` field."""
    return float(rope_parameters(hf_config).get("rope_theta", cfg(hf_config, "rope_theta", 10000.0)))


def is_tied(hf_config: Any) -> bool:
    """True when the output layer shares the embedding (then neither side carries lm_head/output_layer)."""
    return bool(cfg(hf_config, "tie_word_embeddings", False))


@dataclass(frozen=True)
class Family:
    """A dense decoder family: RMSNorm, RoPE, grouped-query attention, a SwiGLU MLP."""

    name: str  # sluice's name of the family (model.tiny.family, docs/models.md)
    model_types: tuple[str, ...]  # config.json model_type values it takes
    examples: tuple[str, ...]  # released checkpoints of the family
    tiny_classes: tuple[str, str]  # transformers' config and causal-LM class names, for a tiny random model
    name_pattern: str  # regex over a checkpoint's path or a recipe's name, where config.json is not at hand
    qkv_bias: bool = False  # q/k/v biases whatever `attention_bias` says (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)
    explicit_head_dim: bool = False  # the HF config's head_dim defaults to a fixed number, not hidden / heads (Qwen3)
    rope_types: tuple[str, ...] = TRAINED_ROPE_TYPES  # config.json rope_types the trainer builds for this family
    post_norms: bool = False  # a norm after the attention and after the MLP, before each residual add (GLM-4)
    fused_experts_in_checkpoint: bool = False  # checkpoints hold every expert of a layer in one tensor (gpt-oss)

    # --- what the trainer builds
    def check(self, hf_config: Any) -> None:
        """Raise ValueError, in one line naming the field and what to do, for what the trainer cannot build yet."""
        rope_type = rope_parameters(hf_config)["rope_type"]
        if rope_type not in self.rope_types:
            raise ValueError(f"rope_type {rope_type!r} is not supported by the megatron trainer yet (it builds "
                             f"{', '.join(self.rope_types)} for {self.name}); use a checkpoint with one of those")
        if rope_type == "yarn" and self.rotary_percent(hf_config) != 1.0:
            raise ValueError(f"rope_type 'yarn' with partial_rotary_factor={self.rotary_percent(hf_config)}: YaRN's "
                             "attention factor scales the turned dims only, which the trainer does not build")
        if cfg(hf_config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported; set use_sliding_window=false")
        if cfg(hf_config, "mlp_bias", False):
            raise ValueError(f"{self.name} checkpoints with mlp_bias=true are not supported by the megatron trainer "
                             "yet")

    def has_qkv_bias(self, hf_config: Any) -> bool:
        return self.qkv_bias or bool(cfg(hf_config, "attention_bias", False))

    def has_qk_norm(self, hf_config: Any) -> bool:
        return self.qk_norm

    def rotary_percent(self, hf_config: Any) -> float:
        """The share of each head's dims RoPE turns (megatron's rotary_percent; HF's partial_rotary_factor)."""
        return float(rope_parameters(hf_config).get("partial_rotary_factor",
                                                    cfg(hf_config, "partial_rotary_factor", 1.0)))

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        """megatron-core TransformerConfig fields that differ by family, each a fact of config.json (the shared shape
        is the trainer's): a pass-through flag that sets one to another value is refused (launch.plan.model_check),
        since the engines serve config.json's model."""
        return {"qk_layernorm": self.has_qk_norm(hf_config), "add_qkv_bias": self.has_qkv_bias(hf_config)}

    # --- layers
    def num_experts(self, hf_config: Any) -> int:
        """Routed experts per MoE layer (0 for a dense family)."""
        return 0

    def is_moe_layer(self, hf_config: Any, layer: int) -> bool:
        return False

    # --- the name table
    def rules(self, hf_config: Any) -> list[Rule]:
        """Every tensor of the model in HF module order: embedding, layers, final norm, output layer."""
        out = [Rule(EMBEDDING.megatron, EMBEDDING.hf, EMBEDDING.kind)]
        for i in range(int(cfg(hf_config, "num_hidden_layers"))):
            out += self.layer_rules(hf_config, i)
        out.append(Rule(FINAL_NORM.megatron, FINAL_NORM.hf, FINAL_NORM.kind))
        if not is_tied(hf_config):
            out.append(Rule(OUTPUT.megatron, OUTPUT.hf, OUTPUT.kind))
        return out

    def layer_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        return ([in_layer(e, layer) for e in self.attention_entries(hf_config)] + self.mlp_rules(hf_config, layer)
                + [in_layer(e, layer) for e in LAYER_NORMS])

    def attention_entries(self, hf_config: Any) -> list[Entry]:
        """A layer's attention tensors, in HF module order."""
        return [ATTENTION[0], *([QKV_BIAS] if self.has_qkv_bias(hf_config) else []), *ATTENTION[1:],
                *(QK_NORM if self.has_qk_norm(hf_config) else ())]

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        return [in_layer(e, layer) for e in DENSE_MLP]

    def entries(self) -> tuple[Entry, ...]:
        """Every entry this family's tables may hold (the megatron side's layout kinds are read from them)."""
        return (EMBEDDING, FINAL_NORM, OUTPUT, *ATTENTION, QKV_BIAS, *QK_NORM, *DENSE_MLP, *LAYER_NORMS)

    def frozen_layers(self, hf_config: Any) -> range:
        """Checkpoint layers the trainer does not build (multi-token prediction, after the decoder's): kept frozen,
        never trained or synced, copied unchanged into every export (glue.trainer.checkpointing)."""
        return range(0)

    def frozen_layer_extra(self, hf_config: Any) -> int:
        """Parameters a frozen (MTP) layer holds beyond a decoder layer's: none unless the family has such layers."""
        return 0

    def is_frozen(self, hf_config: Any, checkpoint_name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", checkpoint_name)
        return m is not None and int(m.group(1)) in self.frozen_layers(hf_config)

    def loaded_name(self, checkpoint_name: str) -> str:
        """The HF model's own parameter name for a checkpoint tensor (transformers renames some on load)."""
        return checkpoint_name

    def checkpoint_name(self, loaded_name: str) -> str:
        """The checkpoint's name for a parameter of the loaded HF model: the inverse of `loaded_name`."""
        return loaded_name

    # --- a tiny random model
    def tiny_fields(self, *, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                    moe_top_k: int) -> dict[str, Any]:
        """HF config fields of a tiny model beyond the shared ones (glue.embedded_engine.tiny_model)."""
        return {"head_dim": hidden_size // num_heads} if self.explicit_head_dim else {}


@dataclass(frozen=True)
class MoeFamily(Family):
    """A decoder whose MLPs are (some or all) routed experts: a softmax top-k router, no shared experts.

    Names: the checkpoint (and SGLang) keep a layer's MoE block under `moe_block` with the router at `gate` and
    each expert's projections under `experts.{expert}.`; transformers 5 loads the block as `mlp` with the experts
    fused, which sluice names per expert as `mlp.experts.{expert}.gate_proj / up_proj / down_proj` (the loaded
    form, glue.embedded_engine.checkpoint_names)."""

    moe_block: str = "mlp"  # the MoE block's name in a checkpoint's layer
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up and down
    expert_width: str = "moe_intermediate_size"  # config.json's width of one expert

    def loaded_name(self, checkpoint_name: str) -> str:
        gate, up, down = self.expert_names
        loaded = {gate: "gate_proj", up: "up_proj", down: "down_proj"}
        m = re.fullmatch(rf"(.*\.){re.escape(self.moe_block)}\.(gate\.weight|experts\.\d+\.)(\w+)?(\.weight)?",
                         checkpoint_name)
        if m is None:
            return checkpoint_name
        layer, part, proj, suffix = m.groups()
        return f"{layer}mlp.{part}" + (f"{loaded[proj]}{suffix}" if proj in loaded and suffix else "")

    def checkpoint_name(self, loaded_name: str) -> str:
        """The inverse of `loaded_name`: a checkpoint name for a parameter of the loaded HF model (per expert)."""
        gate, up, down = self.expert_names
        named = {"gate_proj": gate, "up_proj": up, "down_proj": down}
        m = re.fullmatch(r"(.*\.)mlp\.(gate\.weight|experts\.\d+\.)(gate_proj|up_proj|down_proj)?(\.weight)?",
                         loaded_name)
        if m is None:
            return loaded_name
        layer, part, proj, suffix = m.groups()
        return f"{layer}{self.moe_block}.{part}" + (f"{named[proj]}{suffix}" if proj and suffix else "")

    def num_experts(self, hf_config: Any) -> int:
        """transformers 5 names the field num_experts in some families and num_local_experts in others."""
        return int(cfg(hf_config, "num_experts", cfg(hf_config, "num_local_experts", 0)))

    def is_moe_layer(self, hf_config: Any, layer: int) -> bool:
        return self.num_experts(hf_config) > 0

    def renormalises_top_k(self, hf_config: Any) -> bool:
        """Whether the top-k routing weights are renormalised to sum to one."""
        return True

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        if not self.is_moe_layer(hf_config, layer):
            return super().mlp_rules(hf_config, layer)
        prefix = f"{self.moe_block}.experts.{{expert}}."
        experts = [in_expert(e, layer, x, prefix) for x in range(self.num_experts(hf_config))
                   for e in self.expert_entries()]
        return experts + [in_layer(self.router_entry(), layer)]

    def expert_entries(self) -> tuple[Entry, Entry]:
        gate, up, down = (f"{name}.weight" for name in self.expert_names)
        return Entry(EXPERT_FC1, (gate, up), GATE_UP), Entry(EXPERT_FC2, (down,), ROW)

    def router_entry(self) -> Entry:
        return Entry(ROUTER_MCORE, (f"{self.moe_block}.gate.weight",), REPLICATED)

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), *self.expert_entries(), self.router_entry())

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        fields = super().megatron_fields(hf_config)
        if not self.num_experts(hf_config):
            return fields
        layers = int(cfg(hf_config, "num_hidden_layers"))
        return {**fields,
                "num_moe_experts": self.num_experts(hf_config), "moe_router_topk": int(hf_config.num_experts_per_tok),
                "moe_ffn_hidden_size": int(cfg(hf_config, self.expert_width)),
                "moe_layer_freq": [int(self.is_moe_layer(hf_config, i)) for i in range(layers)],
                # HF: softmax over all experts, then top-k, renormalised or not. Megatron without pre-softmax
                # softmaxes the top-k logits, which is exactly the renormalised form.
                "moe_router_pre_softmax": not self.renormalises_top_k(hf_config),
                "moe_router_score_function": "softmax"}


@dataclass(frozen=True)
class SigmoidRouterMoe(MoeFamily):
    """DeepSeek-V3's MoE layers (GLM-4.5 took them as they are): the first `first_k_dense_replace` layers dense, the
    rest `n_routed_experts` routed experts with `n_shared_experts` shared ones beside them; a sigmoid router whose
    expert bias `e_score_correction_bias` is added only to choose experts, group-limited top-k (`n_group`,
    `topk_group`), the chosen scores renormalised and scaled by `routed_scaling_factor`. The multi-token-prediction
    layers after the decoder's (`num_nextn_predict_layers`) are in neither the HF model transformers builds nor the
    trainer's: kept frozen and copied unchanged into every export.

    The expert bias is frozen in training by default (the trainer sets megatron's bias update rate to 0): an RL run
    keeps the engines' routing rule."""

    def check(self, hf_config: Any) -> None:
        super().check(hf_config)
        groups, chosen, top_k = (int(cfg(hf_config, name, 1)) for name in ("n_group", "topk_group",
                                                                          "num_experts_per_tok"))
        if groups > 1 and top_k != 2 * chosen:  # megatron sums a group's top topk/topk_group scores, HF its top 2
            raise ValueError(f"n_group={groups}, topk_group={chosen}, num_experts_per_tok={top_k}: megatron-core "
                             "scores a group by its top num_experts_per_tok / topk_group experts and HF by its top 2, "
                             "which agree only when num_experts_per_tok = 2 x topk_group")
        if not cfg(hf_config, "norm_topk_prob", True) and top_k > 1:
            raise ValueError("norm_topk_prob=false: megatron-core always renormalises the chosen sigmoid scores; "
                             "the trainer builds norm_topk_prob=true only")

    def num_experts(self, hf_config: Any) -> int:
        return int(cfg(hf_config, "n_routed_experts", 0))

    def frozen_layers(self, hf_config: Any) -> range:
        layers = int(cfg(hf_config, "num_hidden_layers"))
        return range(layers, layers + int(cfg(hf_config, "num_nextn_predict_layers", 0)))

    def is_moe_layer(self, hf_config: Any, layer: int) -> bool:
        return self.num_experts(hf_config) > 0 and layer >= int(cfg(hf_config, "first_k_dense_replace", 0))

    def frozen_layer_extra(self, hf_config: Any) -> int:
        """An MTP layer is a MoE decoder layer plus its own embedding and output head copies, the projection of
        [normed embedding; normed hidden] (`eh_proj`) and three norms (`enorm`, `hnorm`, `shared_head.norm`), as the
        released checkpoints store them (SGLang's nextn models load the same)."""
        hidden, vocab = int(cfg(hf_config, "hidden_size")), int(cfg(hf_config, "vocab_size"))
        return 2 * vocab * hidden + 2 * hidden * hidden + 3 * hidden

    def mlp_rules(self, hf_config: Any, layer: int) -> list[Rule]:
        rules = super().mlp_rules(hf_config, layer)
        if not self.is_moe_layer(hf_config, layer):
            return rules
        return rules + [in_layer(e, layer) for e in (ROUTER_BIAS, *SHARED_EXPERTS)]

    def entries(self) -> tuple[Entry, ...]:
        return (*super().entries(), ROUTER_BIAS, *SHARED_EXPERTS)

    def megatron_fields(self, hf_config: Any) -> dict[str, Any]:
        fields = super().megatron_fields(hf_config)
        if not self.num_experts(hf_config):
            return fields
        fields.pop("moe_router_pre_softmax")  # megatron reads it for softmax scores only
        fields.update(
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(cfg(hf_config, "routed_scaling_factor", 1.0)),
            moe_shared_expert_intermediate_size=int(cfg(hf_config, "moe_intermediate_size"))
            * int(cfg(hf_config, "n_shared_experts", 0)) or None)
        if int(cfg(hf_config, "n_group", 1)) > 1:
            fields.update(moe_router_num_groups=int(cfg(hf_config, "n_group")),
                          moe_router_group_topk=int(cfg(hf_config, "topk_group")))
        return fields
