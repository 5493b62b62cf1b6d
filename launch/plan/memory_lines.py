"""The memory lines of `--dry-run`'s plan (`plan.memory`) and the check before every start (launch.run.preflight), from
launch.plan.memory's counts: per trainer rank its training state and an activation estimate, per engine its weights and
SGLang's KV pool; a trainer rank whose training state cannot fit `cluster.gpu_memory_gb` is refused with the layout
that would fit."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from glue.trainer.model import check_tensor_parallel
from glue.trainer.token_budget import activation_bytes_per_token, budget_from_memory
from launch.config import ConfigError, SluiceConfig
from launch.plan.memory import (IpcBuffers, Layout, RankMemory, Settings, fitting_layout, ipc_buffers, layout_change, model_params,
                                rank_memory)
from launch.plan.fleets import devices_text, fleet_sizes
from launch.plan.model_check import format_bytes, model_config, section_model_config
from weight_sync.families import family_of, num_experts

GiB = 2**30
# SGLang 0.5.23 with --mem-fraction-static unset keeps back at least this much of a GPU over 60 GiB for activations
# and CUDA graphs (sglang/srt/arg_groups/memory_hook.py), at least 512 MiB + 2048 tokens x 1.5 MiB on a smaller one
SGLANG_RESERVE = {True: 10 * GiB, False: (512 + 2048 * 1.5) * 2**20}


def gpu_bytes(cfg: SluiceConfig) -> float:
    return cfg.cluster.gpu_memory_gb * 1e9


def memory_plan(cfg: SluiceConfig) -> dict[str, Any]:
    """`plan.memory` of `--dry-run`: a line per pipeline stage's trainer rank, the activation estimate, the engines."""
    hf_config = model_config(cfg)
    params, layout, settings = model_params(hf_config), Layout.of(cfg.trainer), Settings.of(cfg, hf_config)
    ranks = rank_memory(params, layout, settings)
    limit = gpu_bytes(cfg) if cfg.cluster.uses_gpus else None
    plan = {"gpu": f"{cfg.cluster.gpu_memory_gb:g} GB per GPU (cluster.gpu_memory_gb)" if limit else
            "none: a CPU run (the figures are host memory per process, not checked)",
            "trainer": [rank_line(r, layout, settings, limit) for r in ranks],
            "activations": activation_line(cfg, activations(cfg, hf_config, layout, settings),
                                           (limit or 0) - max(r.total for r in ranks))}
    buffers = ipc_buffers(cfg, params.total * settings.weight_bytes)
    if cfg.run.mode != "sft":
        plan["engines"] = engine_line(cfg, params.total, buffers)
    if buffers is not None:
        plan["weight_sync"] = (f"ipc bucket buffers: {buffers.count} x {format_bytes(buffers.bucket)} = "
                               f"{format_bytes(buffers.total)} on each GPU with an engine rank, kept from the first sync "
                               "on and reused by every later one (counted with the trainer rank's state in the check "
                               "against the GPU, and taken from the engines' KV pool)")
    return plan


def rank_line(r: RankMemory, layout: Layout, s: Settings, limit: float | None) -> str:
    """`every rank: N parameters (layout): weights + gradients + main weights + Adam moments [+ critic] [+ reference]
    = total of the GPU[; in host memory besides: the offloaded optimizer state]`; under PP `stage 1 (layers 20-47)
    ranks 8-15` in place of `every rank`."""
    n = layout.world // layout.pp  # megatron's rank order puts PP slowest: a stage's ranks are consecutive
    who = "every rank" if layout.pp == 1 else (f"stage {r.stage} (layers {r.layers.start}-{r.layers.stop - 1}) ranks "
                                               f"{r.stage * n}-{(r.stage + 1) * n - 1}")
    p = r.policy
    sharded = ", not sharded (trainer.use_distributed_optimizer: false)"
    if s.distributed_optimizer:
        experts = f" and expert-DP = {layout.expert_dp}" if layout.ep > 1 or layout.etp != layout.tp else ""
        sharded = f", sharded over DP x CP = {layout.dp * layout.cp}{experts}"
    parts = [f"weights {format_bytes(p.weights)} ({'bf16' if s.bf16 else 'fp32'})",
             f"gradients {format_bytes(p.gradients)} ({'fp32' if s.grads_fp32 or not s.bf16 else 'bf16'})"]
    if s.bf16:
        parts.append(f"main weights {format_bytes(p.main_weights)}")
    parts.append(f"Adam moments {format_bytes(p.adam_moments)} (fp32{sharded})")
    if r.critic is not None:
        parts.append(f"critic {format_bytes(r.critic.total)} (its own weights, gradients and optimizer state)")
    if r.reference:
        parts.append(f"reference model {format_bytes(r.reference)}")
    of = f" of {format_bytes(limit)}" if limit else ""
    host = (f"; in host memory besides: {s.optimizer_offload:.0%} of the main weights and Adam moments, "
            f"{format_bytes(p.host)} (--optimizer-cpu-offload)") if s.optimizer_offload else ""
    return (f"{who}: {r.parameters:,} parameters ({layout.describe()}): {' + '.join(parts)} = {format_bytes(r.total)}{of}"
            f"{host}")


@dataclass(frozen=True)
class Activations:
    """One trainer rank's activation estimate: `per_token` bytes as megatron keeps them (recompute and precision
    counted), `plain` as the trainer sizes `auto` with (glue.trainer.token_budget), `how` in words, and how many
    micro-batches are in flight at once (`in_flight`: PP under 1F1B) over how many ranks a sample's tokens are split
    (`cp`)."""

    per_token: int
    plain: int
    how: str
    in_flight: int
    cp: int

    def of(self, tokens: int) -> int:
        """Bytes of the micro-batches in flight, each of `tokens` tokens."""
        return self.per_token * math.ceil(tokens / self.cp) * self.in_flight


def activations(cfg: SluiceConfig, hf_config: Any, layout: Layout, s: Settings, *, recompute: bool | None = None
                ) -> Activations:
    """glue.trainer.token_budget's activation estimate over the largest stage's layers (doubled in fp32); under
    megatron's full recompute (`recompute`, default: the trainer's setting) only each layer's input is kept, plus one
    layer while it is recomputed."""
    fields = family_of(hf_config).megatron_fields(hf_config)  # the expert width and top-k, as the trainer sets them
    config = SimpleNamespace(tensor_model_parallel_size=layout.tp, hidden_size=hf_config.hidden_size,
                             ffn_hidden_size=hf_config.intermediate_size, num_moe_experts=num_experts(hf_config),
                             moe_ffn_hidden_size=fields.get("moe_ffn_hidden_size"),
                             moe_router_topk=fields.get("moe_router_topk"))
    layers, vocab = max(map(len, layout.stages(hf_config.num_hidden_layers))), hf_config.vocab_size
    plain = activation_bytes_per_token(config, vocab, layers)  # what the trainer sizes `auto` with
    if recompute is None:
        recompute = cfg.trainer.megatron.get("recompute_granularity") == "full"
    if recompute:
        per_token = activation_bytes_per_token(config, vocab, 1) + layers * 2 * hf_config.hidden_size // layout.tp
        how = "--recompute-granularity full: each layer's input only, plus one layer while it is recomputed"
    else:
        per_token, how = plain, "no recompute: every layer's activations"
    if layout.pp > 1:
        how += f"; the largest stage's {layers} layers, up to {layout.pp} micro-batches in flight (1F1B)"
    return Activations(per_token=per_token * (1 if s.bf16 else 2), plain=plain, how=how, in_flight=layout.pp,
                       cp=layout.cp)


def activation_line(cfg: SluiceConfig, act: Activations, free: float) -> str:
    """`plan.memory.activations`: per 1k tokens and for the configured micro-batch. `free`: what the training state
    leaves of the GPU, for `auto`'s budget."""
    tokens, source = micro_batch_tokens(cfg)
    per_1k = f"{format_bytes(act.per_token * 1000)} per 1k tokens"
    if tokens is None:
        budget, (longest, _) = budget_from_memory(int(max(free, 0)), act.plain), longest_sample(cfg)
        own = f"; a longer sample (up to {longest:,} tokens) gets a row of its own" if longest > budget else ""
        return (f"about {per_1k} of a micro-batch ({act.how}); {source}: about {budget:,} tokens in the "
                f"{format_bytes(max(free, 0))} the training state leaves{own}")
    return f"about {format_bytes(act.of(tokens))} for a micro-batch of {tokens:,} tokens ({source}; {per_1k}, {act.how})"


def longest_sample(cfg: SluiceConfig) -> tuple[int, str]:
    """The most tokens one sample can have under the config, and from which keys: sft.max_seq_len; slime's
    prompt-plus-response budget; the task's prompt limit + rollout.sampling.max_new_tokens; or, with no prompt limit
    known, the response alone (a lower bound)."""
    if cfg.run.mode == "sft":
        return cfg.sft.max_seq_len, f"sft.max_seq_len {cfg.sft.max_seq_len}"
    if cfg.rollout.slime.max_context_len is not None:
        return cfg.rollout.slime.max_context_len, f"rollout.slime.max_context_len {cfg.rollout.slime.max_context_len}"
    prompt, response = cfg.rollout.task_args.get("max_prompt_tokens"), cfg.rollout.sampling.max_new_tokens
    if prompt:
        return prompt + response, (f"rollout.task_args.max_prompt_tokens {prompt} + rollout.sampling.max_new_tokens "
                                   f"{response}")
    return response, f"rollout.sampling.max_new_tokens {response}, the prompt not counted"


def micro_batch_tokens(cfg: SluiceConfig) -> tuple[int | None, str]:
    """The tokens of one micro-batch and where they come from; None for `auto` on GPUs (sized at start)."""
    t = cfg.trainer
    budget = t.max_tokens_per_micro_batch
    if budget == "auto" and cfg.cluster.uses_gpus:
        return None, "trainer.max_tokens_per_micro_batch auto: sized at start from the memory left"
    if isinstance(budget, int) and budget > 0:
        return budget, f"trainer.max_tokens_per_micro_batch={budget}"
    longest, counted = longest_sample(cfg)
    return t.micro_batch_size * longest, (f"padded rows: trainer.micro_batch_size {t.micro_batch_size} x {longest} "
                                          f"tokens of {counted}")


def engine_memory(cfg: SluiceConfig, count: int, tp: int | None = None, buffers: IpcBuffers | None = None
                  ) -> tuple[int, float, str]:
    """(weights, KV pool, where the pool's fraction comes from) per GPU of an SGLang engine of TP `tp` (default: the
    policy engines'): the parameters split over engine TP at the dtype the engines serve, and mem_fraction_static x
    the GPU - the weights (SGLang's meaning); with the fraction unset, the most SGLang's own choice can be. `buffers`:
    the ipc bucket buffers the colocated trainer rank keeps on the same GPU from the first sync on, after SGLang sized
    its pool at start, so the pool has that much less room."""
    gpu = gpu_bytes(cfg)
    wide = str(cfg.sglang.get("dtype", "")) in ("float32", "float")
    weights = count * (4 if wide else 2) // (tp or cfg.cluster.engine_tensor_parallel_size)
    kept = buffers.total if buffers else 0
    less = f" - ipc bucket buffers {format_bytes(kept)}" if kept else ""
    given = cfg.sglang.get("mem_fraction_static")
    if given is not None:
        return weights, float(given) * gpu - weights - kept, f"sglang.mem_fraction_static {float(given):g}{less}"
    fraction = 1 - SGLANG_RESERVE[gpu > 60 * GiB] / gpu
    reserve = format_bytes(SGLANG_RESERVE[gpu > 60 * GiB])
    return weights, fraction * gpu - weights - kept, (f"sglang.mem_fraction_static unset: SGLang sizes it at start, "
                                                      f"keeping at least {reserve} back, so at most {fraction:.3f}"
                                                      f"{less}")


def engine_line(cfg: SluiceConfig, count: int, buffers: IpcBuffers | None = None) -> str:
    c = cfg.cluster
    if c.engine_server != "sglang" or not c.uses_gpus:
        return f"{cfg.rollout.num_engines} embedded engines on CPU: no GPU memory"
    weights, kv, how = engine_memory(cfg, count, buffers=buffers)
    colocated = "; colocated: the trainer's state is offloaded while they run" if c.placement == "colocated" else ""
    nodes = c.engine_tensor_parallel_size // c.gpus_per_node
    over = f" ({nodes} nodes x {c.gpus_per_node}, a server per node)" if nodes > 1 else ""
    return (f"each of {cfg.rollout.num_engines} engines, on each of its {c.engine_tensor_parallel_size} GPUs{over}: "
            f"weights {format_bytes(weights)} ({count:,} parameters / TP {c.engine_tensor_parallel_size}) + KV pool "
            f"{format_bytes(max(kv, 0))} (mem_fraction_static x {c.gpu_memory_gb:g} GB - weights; {how}){colocated}")


def check_memory(cfg: SluiceConfig) -> str:
    """A GPU run's trainer ranks hold their training state within cluster.gpu_memory_gb (else a ConfigError naming
    the figures and a layout that fits) and its SGLang engines' weights leave a KV pool. One line."""
    hf_config = model_config(cfg)
    params, layout, settings = model_params(hf_config), Layout.of(cfg.trainer), Settings.of(cfg, hf_config)
    peak = max(rank_memory(params, layout, settings), key=lambda r: r.total)
    if not cfg.cluster.uses_gpus:
        return f"memory: a trainer rank holds {format_bytes(peak.total)} of training state (a CPU run: not checked)"
    buffers = ipc_buffers(cfg, params.total * settings.weight_bytes)
    limit = gpu_bytes(cfg) - (buffers.total if buffers else 0)  # a sync holds the trainer's state and a bucket copy
    if peak.total > limit:
        raise ConfigError(too_large(cfg, hf_config, params, layout, settings, peak, limit))
    check_activations(cfg, hf_config, layout, settings, peak.total, limit)
    if cfg.run.mode != "sft" and cfg.cluster.engine_server == "sglang":
        weights, kv, how = engine_memory(cfg, params.total, buffers=buffers)
        if kv <= 0:
            raise ConfigError(f"an engine's weights take {format_bytes(weights)} per GPU (engine TP "
                              f"{cfg.cluster.engine_tensor_parallel_size}), which leaves no KV pool ({how}, x "
                              f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}); raise "
                              "cluster.engine_tensor_parallel_size or sglang.mem_fraction_static")
    for name, (_, tp) in fleet_sizes(cfg).items():
        count = side_parameters(cfg, name)
        if count is not None and cfg.cluster.engine_server == "sglang":
            weights, kv, how = engine_memory(cfg, count, tp)
            if kv <= 0:
                raise ConfigError(f"a {name} engine's weights take {format_bytes(weights)} per GPU ({name}."
                                  f"tensor_parallel_size {tp}), which leaves no KV pool ({how}, x cluster."
                                  f"gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}); raise {name}."
                                  "tensor_parallel_size or sglang.mem_fraction_static")
    copies = f" + ipc bucket buffers {format_bytes(buffers.total)}" if buffers else ""
    tokens, _ = checked_micro_batch(cfg)
    act = activations(cfg, hf_config, layout, settings).of(tokens)
    return (f"memory: a trainer rank holds {format_bytes(peak.total)} of training state{copies} + about "
            f"{format_bytes(act)} of activations for a micro-batch of {tokens:,} tokens of "
            f"{cfg.cluster.gpu_memory_gb:g} GB per GPU (cluster.gpu_memory_gb; plan.memory has the figures)")


def checked_micro_batch(cfg: SluiceConfig) -> tuple[int, str]:
    """The widest micro-batch the trainer can form, for the check against the GPU: the configured one, or the
    longest sample where that is wider (a sample longer than the token budget gets a row of its own); under `auto`
    the longest sample (the budget is sized from what is left, so only a sample wider than that can overflow)."""
    longest, counted = longest_sample(cfg)
    tokens, source = micro_batch_tokens(cfg)
    if tokens is None or tokens < longest:
        return longest, f"the longest sample: {counted}"
    return tokens, source


def check_activations(cfg: SluiceConfig, hf_config: Any, layout: Layout, s: Settings, state: int, limit: float) -> None:
    """A GPU trainer rank holds its training state (`state` bytes, of `limit`) plus one micro-batch's activations
    (checked_micro_batch), else a ConfigError with the figures and what would make it fit."""
    tokens, source = checked_micro_batch(cfg)
    act = activations(cfg, hf_config, layout, s)
    need = act.of(tokens)
    if state + need <= limit:
        return
    auto = cfg.trainer.max_tokens_per_micro_batch == "auto"
    what = (f"trainer.max_tokens_per_micro_batch auto cannot fit the longest sample at all: {tokens:,} tokens "
            f"({source.removeprefix('the longest sample: ')})" if auto else f"a micro-batch of {tokens:,} tokens ({source})")
    fixes = []
    if not cfg.trainer.megatron.get("recompute_granularity"):
        recomputed = activations(cfg, hf_config, layout, s, recompute=True)
        if state + recomputed.of(tokens) <= limit:
            fixes.append(f"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 would fit (about "
                         f"{format_bytes(recomputed.of(tokens))} of activations)")
    if not auto:
        fixes.append("a smaller trainer.max_tokens_per_micro_batch or trainer.micro_batch_size")
    fixes.append("shorter samples, or a larger TP / PP (or --optimizer-cpu-offload) to leave more of the GPU")
    raise ConfigError(f"{what} needs about {format_bytes(need)} of activations on a trainer rank ({layout.describe()}; "
                      f"{format_bytes(act.per_token * 1000)} per 1k tokens, {act.how}), and its training state takes "
                      f"{format_bytes(state)}: {format_bytes(state + need)}, more than the "
                      f"{format_bytes(limit)} of cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}"
                      f"{' less the ipc bucket buffers' if limit < gpu_bytes(cfg) else ''}; {'; or '.join(fixes)}")


def too_large(cfg: SluiceConfig, hf_config: Any, params: Any, layout: Layout, settings: Settings, peak: RankMemory,
              limit: float) -> str:
    """The refusal: the rank's figures, and the nearest layout that fits."""
    def tp_ok(tp: int) -> bool:
        try:
            check_tensor_parallel(hf_config, tp)
            return True
        except ValueError:
            return False

    p = peak.policy
    parts = f"weights {format_bytes(p.weights)} + gradients {format_bytes(p.gradients)}" + (
        f" + main weights {format_bytes(p.main_weights)}" if settings.bf16 else "") + \
        f" + Adam moments {format_bytes(p.adam_moments)}" + (
        f" + critic {format_bytes(peak.critic.total)}" if peak.critic else "") + (
        f" + reference model {format_bytes(peak.reference)}" if peak.reference else "")
    where = "a trainer rank" if layout.pp == 1 else f"a trainer rank of pipeline stage {peak.stage}"
    found = fitting_layout(params, layout, settings, limit, tp_ok=tp_ok, experts=num_experts(hf_config))
    if found is None:
        fits = "no layout of up to 1024 GPUs fits"
    else:
        new, new_settings, bytes_ = found
        needs_sp = bool(num_experts(hf_config)) and not cfg.trainer.megatron.get("sequence_parallel")
        fits = (f"{layout_change(layout, new, settings, new_settings, needs_sp=needs_sp)} would fit "
                f"({new.describe()} on {new.world} GPUs: {format_bytes(bytes_)} per rank)")
    return (f"{where} ({layout.describe()}) would hold {format_bytes(peak.total)} of training state for its "
            f"{peak.parameters:,} parameters ({parts}), more than cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g} "
            f"before any activations; {fits}")


def side_parameters(cfg: SluiceConfig, name: str) -> int | None:
    """Parameters of the model the fleet of section `name` (teacher, judge) serves; None for a teacher that
    `teacher.build` writes at start-up (its size is known only then)."""
    if name == "judge":
        return model_params(section_model_config(cfg.judge.model, "judge.model")).total
    if cfg.teacher.path is None:
        return None
    return model_params(section_model_config(cfg.teacher, "teacher")).total


def fleet_lines(cfg: SluiceConfig, plan: Any) -> list[str]:
    """`plan.fleets` of `--dry-run`: one line per engine fleet (the policy's, then the teacher's and the judge's):
    its engines, the devices of their bundles, and what each engine holds per GPU."""
    lines = []
    if plan.engines:
        count = model_params(model_config(cfg)).total
        bundles = [b for e in plan.engines for b in e.bundles]
        lines.append(fleet_line(cfg, plan, "policy", len(plan.engines), cfg.cluster.engine_tensor_parallel_size,
                                bundles, count, nodes=plan.engine_nodes))
    for fleet in plan.side_fleets:
        lines.append(fleet_line(cfg, plan, fleet.name, len(fleet.engines), fleet.tp, fleet.bundles,
                                side_parameters(cfg, fleet.name), nodes=fleet.nodes))
    return lines


def fleet_line(cfg: SluiceConfig, plan: Any, name: str, engines: int, tp: int, bundles: list[int],
               count: int | None, nodes: int = 1) -> str:
    """`teacher: 1 engine x TP 2 on node 0 gpus 4-5 (bundles 4-5); per GPU: weights 8.2 GB + KV pool 60.1 GB`;
    engines over `nodes` nodes say so."""
    over = f" over {nodes} nodes (a server per node)" if nodes > 1 else ""
    where = f"{name}: {engines} engine{'s' if engines > 1 else ''} x TP {tp}{over} on {devices_text(plan, bundles)}"
    if count is None:
        return f"{where}; per GPU: the weights teacher.build writes at start-up (size known only then) + KV pool"
    if cfg.cluster.engine_server != "sglang" or not cfg.cluster.uses_gpus:
        return f"{where}; {count:,} parameters, embedded engines on CPU: no GPU memory"
    weights, kv, how = engine_memory(cfg, count, tp)
    return (f"{where}; per GPU: weights {format_bytes(weights)} ({count:,} parameters / TP {tp}) + KV pool "
            f"{format_bytes(max(kv, 0))} ({how})")
