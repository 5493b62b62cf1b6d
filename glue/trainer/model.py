"""The trainer's model: a megatron-core GPTModel (local layer spec) built from the HF config of a model family
(weight_sync.families: the family sets the fields that differ, the trainer the shared shape and precision), loaded
with the HF weights (weight_sync.convert + TP sharding), and the per-token logprobs the loss consumes.

Needs `torch.distributed` and megatron's `parallel_state` initialised (the worker does that) and, on CPU,
`cpu_compat.apply()` before building.
"""
from __future__ import annotations

import contextlib
import glob
import math
import os
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from glue.trainer import cpu_compat
from glue.trainer.attention import SluiceCoreAttention, core_attention_class, is_mask_free
from glue.trainer.layer_spec import layer_spec
from glue.trainer.te_spec import resolve_layer_spec
from glue.trainer.logprobs import token_logprobs_and_entropy
from glue.trainer.megatron_fields import to_megatron
from glue.trainer.optim import unwrap
from glue.trainer.te_spec import check_te_options
from weight_sync.convert import hf_to_megatron_local, in_names_of, is_tied, num_experts
from weight_sync.families import BY_MODEL_TYPE, family_of, rope_parameters, rope_theta
from weight_sync.fp8_blocks import block_fp8_of, read_block_fp8


def read_hf_config(model_dir: str) -> Any:
    """The HF config of a checkpoint directory, checked to be a model this trainer can build (its family's check)."""
    import json

    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    family = BY_MODEL_TYPE.get(raw.get("model_type"))
    if family is not None and raw["model_type"] not in transformers.CONFIG_MAPPING:
        # a model_type transformers has no class for (Kimi-K2's kimi_k2 ships its own code): its family's class
        raw.pop("model_type")
        config = getattr(transformers, family.tiny_classes[0]).from_dict(raw)
    else:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    check_buildable(config, model_dir)
    return config


def check_buildable(hf_config: Any, where: str) -> None:
    """What the trainer would refuse once its ranks start, said in one line naming `where` the config is from."""
    try:
        family_of(hf_config).check(hf_config)
        block_fp8_of(hf_config)  # a quantization the loader cannot dequantize
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    """TP splits the key/value heads and the vocabulary evenly (this trainer pads neither); launch.plan.model_check
    asks the same before anything starts."""
    num_groups = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if num_groups % tp_size or hf_config.vocab_size % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide num_key_value_heads={num_groups} and "
                         f"vocab_size={hf_config.vocab_size}; choose a smaller TP size")
    fields = family_of(hf_config).megatron_fields(hf_config)
    if fields.get("multi_latent_attention"):  # MLA's down projections are column-parallel, gathered back whole
        widths = {"q_lora_rank": fields["q_lora_rank"] or 0,
                  "kv_lora_rank + qk_rope_head_dim": fields["kv_lora_rank"] + fields["qk_pos_emb_head_dim"]}
        uneven = [f"{name}={width}" for name, width in widths.items() if width % tp_size]
        if uneven:
            raise ValueError(f"tensor_model_parallel_size={tp_size} must divide multi-latent attention's "
                             f"{' and '.join(uneven)}; choose a TP size that does")


def transformer_config(hf_config: Any, *, tp_size: int) -> Any:
    """megatron-core TransformerConfig equivalent to the HF config of a family (weight_sync.families), float32,
    fusions off: an MLATransformerConfig for multi-latent attention (DeepSeek-V3)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_tensor_parallel(hf_config, tp_size)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    num_groups = getattr(hf_config, "num_key_value_heads", None) or num_heads
    family_of(hf_config).check(hf_config)
    family_fields = family_config_kwargs(hf_config)
    if family_fields.get("multi_latent_attention"):
        head_dim = family_fields["v_head_dim"]  # what megatron's attention sizes its output by
    config_class = MLATransformerConfig if family_fields.get("multi_latent_attention") else TransformerConfig
    # SwiGLU without biases unless the family says otherwise (gpt-oss)
    family_fields = {"add_bias_linear": False, **family_fields,
                     "activation_func": activation_function(family_fields.get("activation_func", "silu"))}
    return config_class(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=num_heads,
        num_query_groups=num_groups, kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp_size,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # glue.trainer.pipeline runs megatron's schedules; losses arrive normalised by the batch's global counts, so
        # the schedule must backpropagate them as they are
        calculate_per_token_loss=True, **family_fields,
    )


def activation_function(name: str) -> Any:
    """The gated unit's activation a family names (weight_sync.families imports no torch): SwiGLU's silu, or
    gpt-oss's x * sigmoid(1.702 x), megatron's quick_gelu."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    functions = {"silu": F.silu, "quick_gelu": quick_gelu}
    if name not in functions:
        raise ValueError(f"activation_func {name!r} is not one the trainer builds; use one of {sorted(functions)}")
    return functions[name]


def family_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """TransformerConfig fields that differ by family (the family's own, weight_sync.families), plus the trainer's
    defaults for routed experts, which pass-through flags may change."""
    kwargs = family_of(hf_config).megatron_fields(hf_config)
    if num_experts(hf_config):
        # fp32 routing as HF routes, no auxiliary loss (RL trains on the reward alone), and a frozen expert bias: the
        # engines keep routing by the checkpoint's. SequentialMLP unless --moe-grouped-gemm (grouped experts: TE's on
        # the te spec, sluice's on the local one); the all-to-all dispatcher needs CUDA streams.
        kwargs.update(moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                      moe_grouped_gemm=False,
                      moe_token_dispatcher_type="allgather" if cpu_compat.is_cpu_only() else "alltoall")
        if kwargs.get("moe_router_enable_expert_bias"):
            kwargs["moe_router_bias_update_rate"] = 0.0
    scale = rope_softmax_scale(hf_config)
    if scale is not None:  # a family that sets it from config.json alone (gpt-oss) sets the same value
        kwargs.setdefault("softmax_scale", scale)
    return kwargs


def rope_softmax_scale(hf_config: Any) -> float | None:
    """The softmax scale of a RoPE scaling with an attention factor (YaRN): transformers multiplies cos and sin by it,
    so q and k by it wherever RoPE turns the whole head, so every score by its square (family checks refuse partial
    rotary with it). None for the scalings without one, and for multi-latent attention, whose YaRN megatron builds."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf_config)["rope_type"]
    if rope_type == "default" or family_of(hf_config).megatron_fields(hf_config).get("multi_latent_attention"):
        return None
    with torch.device("cpu"):
        _, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    if attention_factor == 1.0:
        return None
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return attention_factor ** 2 / math.sqrt(head_dim)


def megatron_config(hf_config: Any, *, tp_size: int, megatron_args: dict[str, Any] | None = None,
                    precision: str = "fp32", fused: bool = False) -> Any:
    """The megatron-core config `build_model` builds the model from: the family's fields, the pass-through values
    (TrainerConfig.megatron_values()), the precision's dtypes and, with `fused` (trainer.compile on sluice's spec),
    megatron's bias-activation and bias-dropout fusions. megatron's __post_init__ validates it (`--dry-run` builds it
    too, so what megatron refuses is refused before anything starts)."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    fusions = {"bias_activation_fusion": True, "bias_dropout_fusion": True} if fused else {}
    megatron_args = {**fusions, **(megatron_args or {}), "bf16": precision == "bf16", "params_dtype": dtype,
                     "pipeline_dtype": dtype}
    return with_passthrough(transformer_config(hf_config, tp_size=tp_size), megatron_args)


def with_passthrough(config: Any, megatron_args: dict[str, Any] | None) -> Any:
    """`config` with the passed-through megatron-core fields it declares set unchanged (they win over the derived
    ones; megatron's own __post_init__ validates the result)."""
    import dataclasses

    return dataclasses.replace(config, **to_megatron(type(config), megatron_args or {}))


def build_model(hf_config: Any, *, tp_size: int, megatron_args: dict[str, Any] | None = None,
                precision: str = "fp32", layer_spec_choice: str = "auto", compiled: bool = False) -> torch.nn.Module:
    """A megatron-core GPTModel (local spec) shaped like the HF model; this rank's TP shard of its pipeline stage
    (the embedding on the first, the output layer on the last), random weights, bf16 or fp32 per `precision`
    (glue.trainer.optim). `megatron_args` (TrainerConfig.megatron_values()) are passed-through TransformerConfig
    fields; `layer_spec_choice` is trainer.layer_spec (auto / local / te). `compiled` (trainer.compile; not on the
    unfused reference, `--attention-backend local`): the layer's elementwise work runs under torch.compile: the norms
    and RoPE (glue.trainer.layer_spec), the SwiGLU and the residual adds (megatron's bias_activation_fusion and
    bias_dropout_fusion, whose fused functions megatron compiles). Options that need Transformer Engine are
    refused in one line where it does not import (glue.trainer.te_spec)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    check_te_options(megatron_args or {})
    # only sluice's fast local spec: the unfused reference stays megatron's path as it was, and Transformer
    # Engine's spec fuses these itself
    compiled = (compiled and resolve_layer_spec(layer_spec_choice) == "local"
                and core_attention_class((megatron_args or {}).get("attention_backend", "auto")) is SluiceCoreAttention)
    config = megatron_config(hf_config, tp_size=tp_size, megatron_args=megatron_args, precision=precision,
                             fused=compiled)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, layer_spec_choice, compiled,
                                                         post_norms=family_of(hf_config).post_norms),
        vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=is_tied(hf_config), position_embedding_type="rope",
        rotary_base=rope_theta(hf_config), rotary_percent=family_of(hf_config).rotary_percent(hf_config),
        parallel_output=True, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    scale_rope(model, hf_config)
    return model


def scale_rope(model: torch.nn.Module, hf_config: Any) -> None:
    """A scaled RoPE (`rope_type` linear, llama3 or yarn, weight_sync.families.base.TRAINED_ROPE_TYPES) takes the
    inverse frequencies transformers computes for the HF model, so both rotate alike; megatron's own llama3 scaling
    fixes its factors to Llama 3.1's. YaRN's attention factor is the softmax scale (`rope_softmax_scale`). Default
    RoPE keeps megatron's table."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf_config)["rope_type"]
    if rope_type == "default" or model.config.multi_latent_attention:  # MLA builds YaRN in each layer itself
        return
    with torch.device("cpu"):  # real numbers even where the model is built on the meta device (sluice export-hf)
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    rope = model.rotary_pos_emb
    rope.inv_freq = inv_freq.to(rope.inv_freq.device, rope.inv_freq.dtype)


def read_hf_state(model_dir: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint (single or sharded files), on CPU; a block-FP8 checkpoint's
    quantized weights dequantized to `dtype` (the trainer's), their scales dropped (weight_sync.fp8_blocks)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files; save the model with save_pretrained "
                                "(safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path, device="cpu"))
    fp8 = read_block_fp8(model_dir)
    return state if fp8 is None else fp8.dequantize(state, dtype)


def load_hf_weights(model: torch.nn.Module, model_dir: str, hf_config: Any, layout: Any) -> None:
    """Copy the checkpoint's weights into this rank's part of `model`: its TP shard and, for MoE, its experts
    (`layout`: a weight_sync.convert.ParallelLayout), in the names of its layer spec (local or Transformer
    Engine's). Every parameter must be covered."""
    params = model_tensors(model)
    trainer_dtype = next(model.parameters()).dtype
    local = in_names_of(hf_to_megatron_local(read_hf_state(model_dir, trainer_dtype), hf_config, layout), params)
    missing = sorted(set(params) - set(local))
    unexpected = sorted(set(local) - set(params))
    if missing or unexpected:
        raise ValueError(f"HF -> megatron conversion does not cover the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; the converter table and the layer spec disagree")
    with torch.no_grad():
        for name, param in params.items():
            if local[name].shape != param.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(local[name].shape)} != parameter {tuple(param.shape)}")
            param.copy_(local[name].to(param.dtype))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of `model` holds, by name: its parameters and its persistent buffers (a sigmoid
    router's expert bias, which chooses experts and is never trained), not the buffers it recomputes."""
    held = model.state_dict(keep_vars=True)
    return {**{n: b for n, b in model.named_buffers() if n in held}, **dict(model.named_parameters())}


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu",
                          seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron's boolean mask, True where attention is blocked: [1, 1, T, T], upper triangle. With `seq_ids`
    [B, T] (packed rows) also blocked between different ids: block-diagonal causal, [B, 1, T, T]."""
    causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
    if seq_ids is None:
        return causal
    return causal | (seq_ids[:, None, :, None] != seq_ids[:, None, None, :])


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                   seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] token ids -> this rank's vocab shard of the logits, [B, T, V / TP] (right padding is harmless); on a
    pipeline stage before the last, its output hidden states [T (/ TP with sequence parallelism), B, H].

    Packed rows pass `seq_ids` [B, T] (which sample each token belongs to; attention never crosses samples) and
    `position_ids` [B, T] (restarting at 0 per sample). `model` may be wrapped for training (megatron's DDP,
    Float16Module): the forward runs through the wrappers, the GPTModel inside answers what it is."""
    inner = unwrap(model)
    batch, seq_len = tokens.shape
    if inner.config.sequence_parallel:  # the sequence is split over TP ranks: pad it to a multiple of TP
        tp = inner.config.tensor_model_parallel_size
        pad = -(-seq_len // tp) * tp - seq_len
        if pad:  # padding sits after every real token (in a block of its own), so no real token sees it
            out = forward_logits(model, F.pad(tokens, (0, pad)),
                                 None if position_ids is None else F.pad(position_ids, (0, pad)),
                                 None if seq_ids is None else F.pad(seq_ids, (0, pad), value=-1))
            return out[:, :seq_len] if inner.post_process else out
    if position_ids is None:
        position_ids = torch.arange(seq_len, dtype=torch.long, device=tokens.device).unsqueeze(0).expand(batch, seq_len)
    mask_free = is_mask_free(inner)
    if seq_ids is None:
        return model(tokens, position_ids, None if mask_free else causal_attention_mask(seq_len, tokens.device))
    with rope_at_positions(inner, position_ids):
        if mask_free:  # THD: cu_seqlens bound the attention, no [T, T] tensor anywhere
            return model(tokens, position_ids, None, packed_seq_params=thd_packed_seq_params(seq_ids))
        return model(tokens, position_ids, causal_attention_mask(seq_len, tokens.device, seq_ids))


@contextlib.contextmanager
def rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """Rotate each token by its own position id in the forwards inside the block. megatron's RoPE in the [S, B]
    layout ignores position_ids and rotates the token at s by angle s; the hook replaces its angle table
    [S, 1, 1, D] (positions 0..S-1) by each token's row of it, [S, B, 1, D] (a THD row: [T, 1, 1, D], which
    glue.trainer.rope applies in one pass). Position ids must be < S."""
    def per_token(module: torch.nn.Module, args: Any, angles: torch.Tensor) -> torch.Tensor:
        return angles[position_ids.t().to(angles.device)].squeeze(2)

    if model.config.multi_latent_attention:
        # MLA keeps its RoPE per layer and rotates a THD row span by span from position 0 (megatron's own THD path),
        # which is what packed rows' position ids say; padded rows take positions 0..S-1 as they stand
        yield
        return
    handle = model.rotary_pos_emb.register_forward_hook(per_token)
    try:
        yield
    finally:
        handle.remove()


def thd_packed_seq_params(seq_ids: torch.Tensor) -> Any:
    """megatron's PackedSeqParams (format "thd") for one packed row [1, T]: a sequence starts wherever the id
    changes (trailing padding is a sequence of its own). One host read per row: the longest span."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if seq_ids.shape[0] != 1:
        raise ValueError(f"THD packing takes one packed row per micro-batch, got {seq_ids.shape[0]} rows")
    ids = seq_ids[0]
    bounds = [0, *(torch.nonzero(ids[1:] != ids[:-1])[:, 0] + 1).tolist(), ids.numel()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=seq_ids.device)
    longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) at position t from vocab-parallel logits; last column is 0, and with
    `seq_ids` (packed rows) so is each sample's last token, whose next token belongs to another sample. [B, T].

    Differentiable, in row chunks without an fp32 copy of the logits (glue.trainer.logprobs)."""
    return token_logprobs_and_entropy(logits, tokens, temperature, seq_ids, with_entropy=False)[0]


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the temperature-scaled next-token distribution at each position, across TP vocab shards. [B, T].

    Differentiable (each TP rank's logits get their own shard's gradient), in row chunks without an fp32 copy of the
    logits; a caller that also wants the logprobs gets both from one pass with `token_logprobs_and_entropy`.
    """
    no_tokens = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)  # only the entropy is kept
    return token_logprobs_and_entropy(logits, no_tokens, temperature, with_entropy=True)[1]
