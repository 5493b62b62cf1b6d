"""Megatron-LM launch flags in slime's scripts that are not megatron-core config fields: the training schedule ones
with their Megatron-LM meaning, and the model-shape ones (slime's MODEL_ARGS), which are kept in `model.shape` and
checked against the checkpoint's config.json before anything starts (a mismatch is refused naming both values)."""
from __future__ import annotations

import ast
from typing import Any, Callable

from launch.slime.spec import SlimeArg, Takes, no, same, switch, to
from weight_sync.families import family_of, is_moe_layer, is_tied, num_experts, rope_theta

SCHEDULE = [
    to("--micro-batch-size", "trainer.micro_batch_size", "megatron-lm", int,
       note="rows per forward / backward when micro-batches are not packed; slime's default 1"),
    to("--lr-decay-style", "trainer.lr_decay_style", "megatron-lm", note="constant, cosine or linear"),
    to("--lr-warmup-iters", "trainer.lr_warmup_steps", "megatron-lm", int, note="optimizer steps"),
    to("--lr-decay-iters", "trainer.lr_decay_steps", "megatron-lm", int, note="optimizer steps"),
    no("--lr-warmup-fraction", "megatron-lm", "--lr-warmup-iters (trainer.lr_warmup_steps)", scalar=float),
    no("--train-iters", "megatron-lm", "--num-rollout (run.num_steps)", scalar=int),
    to("--accumulate-allreduce-grads-in-fp32", "trainer.megatron.grad_reduce_in_fp32", "megatron-lm", takes="none",
       note="gradients reduced in fp32 (megatron-core's DDP grad_reduce_in_fp32)"),
    same("--make-vocab-size-divisible-by", "megatron-lm", "the vocabulary is config.json's, never padded", takes="one",
         scalar=int),
    same("--spec", "megatron-lm", "the layer spec is the model family's (weight_sync.families: GLM-4's post norms "
         "too); a spec module is not loaded", takes="many"),
    switch("--no-rope-fusion", {"trainer.megatron.apply_rope_fusion": False}, "megatron-lm",
           note="megatron-core's apply_rope_fusion off (Megatron-LM's spelling; slime's DeepSeek / Kimi scripts)"),
    to("--decoder-first-pipeline-num-layers", "trainer.megatron.num_layers_in_first_pipeline_stage", "megatron-lm",
       int, note="layers on the first pipeline stage; the stages between the first and the last split the rest evenly"),
    to("--decoder-last-pipeline-num-layers", "trainer.megatron.num_layers_in_last_pipeline_stage", "megatron-lm", int,
       note="layers on the last pipeline stage; the stages between the first and the last split the rest evenly"),
]


def layer_freq(text: str) -> int | list[int]:
    """Megatron-LM's --moe-layer-freq: N (every N-th layer is MoE) or a Python list of 0/1 per layer, as slime's
    scripts write it: "[1,1,...]" or "([0]*3+[1]*45)"."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = _list_expression(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        value = None
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):
        raise ValueError(f"--moe-layer-freq {text!r} must be an integer or a list of 0 / 1 per layer, e.g. "
                         "\"[1,1,1]\" or \"([0]*1+[1]*3)\"")
    return value


def _list_expression(node: ast.AST) -> Any:
    """Lists, integers, list * int and list + list: the form Megatron-LM evaluates, without eval()."""
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        return left * right if isinstance(node.op, ast.Mult) else left + right
    raise ValueError(ast.dump(node))


def _cfg(name: str, default: Any = None) -> Callable[[Any], Any]:
    return lambda hf: getattr(hf, name, default)


def _head_dim(hf: Any) -> int | None:
    """None where the family's attention does not read --kv-channels (multi-latent attention sizes its heads by
    --qk-head-dim / --v-head-dim; slime's DeepSeek-V3 script passes 128, its Kimi-K2 script 64)."""
    if family_of(hf).megatron_fields(hf).get("multi_latent_attention"):
        return None
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _moe_layers(hf: Any) -> list[int]:
    return [int(is_moe_layer(hf, i)) for i in range(hf.num_hidden_layers)]


def _qkv_bias(hf: Any) -> bool:
    return family_of(hf).has_qkv_bias(hf)


# flag -> (what config.json says, its value for a checkpoint's HF config, how the flag is given, type of one value)
SHAPE: dict[str, tuple[str, Callable[[Any], Any], Takes, type]] = {
    "--num-layers": ("num_hidden_layers", _cfg("num_hidden_layers"), "one", int),
    "--hidden-size": ("hidden_size", _cfg("hidden_size"), "one", int),
    "--ffn-hidden-size": ("intermediate_size", _cfg("intermediate_size"), "one", int),
    "--num-attention-heads": ("num_attention_heads", _cfg("num_attention_heads"), "one", int),
    "--num-query-groups": ("num_key_value_heads", lambda hf: getattr(hf, "num_key_value_heads", None)
                           or hf.num_attention_heads, "one", int),
    "--kv-channels": ("head_dim", _head_dim, "one", int),
    "--norm-epsilon": ("rms_norm_eps", _cfg("rms_norm_eps"), "one", float),
    "--layernorm-epsilon": ("rms_norm_eps", _cfg("rms_norm_eps"), "one", float),
    "--rotary-base": ("rope_theta", rope_theta, "one", float),
    "--rotary-percent": ("partial_rotary_factor", lambda hf: family_of(hf).rotary_percent(hf), "one", float),
    "--vocab-size": ("vocab_size", _cfg("vocab_size"), "one", int),
    "--max-position-embeddings": ("max_position_embeddings", _cfg("max_position_embeddings"), "one", int),
    "--num-experts": ("num_experts", num_experts, "one", int),
    "--num-moe-experts": ("num_experts", num_experts, "one", int),
    "--moe-router-topk": ("num_experts_per_tok", _cfg("num_experts_per_tok"), "one", int),
    "--moe-ffn-hidden-size": ("moe_intermediate_size", _cfg("moe_intermediate_size"), "one", int),
    "--moe-layer-freq": ("mlp_only_layers / decoder_sparse_step (MoE layers)", _moe_layers, "one", str),
    "--normalization": ("RMSNorm in every family the trainer builds", lambda hf: "RMSNorm", "one", str),
    "--position-embedding-type": ("rope in every family the trainer builds", lambda hf: "rope", "one", str),
    "--swiglu": ("hidden_act silu, gated", lambda hf: getattr(hf, "hidden_act", "silu") == "silu", "none", bool),
    "--gated-linear-unit": ("a gated MLP in every family", lambda hf: True, "negatable", bool),
    "--disable-bias-linear": ("mlp_bias", lambda hf: not getattr(hf, "mlp_bias", False), "none", bool),
    "--add-bias-linear": ("mlp_bias", lambda hf: bool(getattr(hf, "mlp_bias", False)), "negatable", bool),
    "--add-qkv-bias": ("attention_bias / model_type", _qkv_bias, "negatable", bool),
    "--qk-layernorm": ("model_type (qwen3 norms q and k)", lambda hf: family_of(hf).has_qk_norm(hf), "negatable",
                       bool),
    "--post-self-attn-layernorm": ("model_type (glm4 norms the attention's output)",
                                   lambda hf: family_of(hf).post_norms, "none", bool),
    "--post-mlp-layernorm": ("model_type (glm4 norms the MLP's output)", lambda hf: family_of(hf).post_norms, "none",
                             bool),
    "--untie-embeddings-and-output-weights": ("tie_word_embeddings", lambda hf: not is_tied(hf), "none", bool),
    "--group-query-attention": ("num_key_value_heads (any)", lambda hf: True, "none", bool),
    "--use-rotary-position-embeddings": ("rope in every family the trainer builds", lambda hf: True, "none", bool),
}


def _shape_row(flag: str) -> SlimeArg:
    attr, _, takes, scalar = SHAPE[flag]
    name = flag[2:].replace("-", "_")
    convert = layer_freq if flag == "--moe-layer-freq" else (lambda v: v)
    return SlimeArg(flag, "model shape", f"checked against config.json {attr}", takes, scalar,
                    lambda value, given: {f"model.shape.{name}": convert(value)}, "refused when config.json differs")


SHAPE_ARGS = [_shape_row(flag) for flag in SHAPE]


def check_shape(shape: dict[str, Any], hf_config: Any, where: str) -> None:
    """Each model-shape flag given (model.shape, by flag name) equals what `hf_config` (`where`: whose config.json)
    says; raises ValueError naming the flag, its value and config.json's."""
    for name, value in shape.items():
        flag = "--" + name.replace("_", "-")
        if flag not in SHAPE:
            raise ValueError(f"model.shape.{name}: not a model-shape flag; known: {', '.join(SHAPE)}")
        attr, expected_of, takes, scalar = SHAPE[flag]
        expected = expected_of(hf_config)
        if expected is None:  # a flag this family's model does not read
            continue
        if flag == "--moe-layer-freq" and isinstance(value, int):
            value = [int(i % value == 0) for i in range(hf_config.num_hidden_layers)]  # Megatron-LM's N form
        if not _same(value, expected):
            given = flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {_shown(value)}"
            says = f"{attr} is {_shown(expected)}" if not isinstance(expected, bool) else \
                f"{attr.split()[0]} is {getattr(hf_config, attr.split()[0], None)}"
            raise ValueError(f"{given} does not match {where}: {says}; the trainer builds the "
                             "model from config.json, so drop the flag or point model.path (--hf-checkpoint) at the "
                             "checkpoint it describes")


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, float) or isinstance(value, float):
        return expected is not None and abs(float(value) - float(expected)) <= 1e-9 * max(1.0, abs(float(expected)))
    return value == expected


def _shown(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(str, value[:4]))}, ... {len(value)} layers]"
    return str(value)
