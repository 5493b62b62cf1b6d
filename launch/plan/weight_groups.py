"""What every weight sync moves and through which groups, planned before anything starts from config.json and the
placement: the bytes and buckets, each weight group's source (the trainer rank that sends), the trainer ranks
producing its tensors, and every member with the device it stands on. The sources come from the trainer's own rule
(glue.trainer.weight_stream.weight_sources) and the members' ranks from the bridge's (weight_sync.transports,
weight_sync.parallel), so `--dry-run` lists what a run builds; NCCL's rule that no communicator holds two ranks on
one device is checked over them, for every run (`check_weight_groups`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from glue.embedded_engine.checkpoint_names import checkpoint_tensors
from glue.trainer.optim import resolve_precision
from glue.trainer.pipeline import planned_stage_layers
from glue.trainer.weight_stream import SOURCE_RANK, Coords, SourcePart, weight_sources
from launch.config import ConfigError, SluiceConfig
from launch.plan.fleets import node_parts
from launch.plan.ipc_sources import copy_ranks, describe_sources
from launch.plan.model_check import format_bytes, hf_parameters, model_config
from launch.plan.run_plan import RunPlan, rank_coords
from weight_sync.buckets import pipeline_bucket_bytes
from weight_sync.convert import ParallelLayout, rules
from weight_sync.families import family_of
from weight_sync.parallel import parallel_sources, source_group_prefix
from weight_sync.transports import GROUP_PREFIX, engine_rank_offset


@dataclass(frozen=True)
class Member:
    """One rank of a weight group: its rank there, who it is and the plan bundle (device) it runs on."""

    rank: int
    who: str  # "trainer rank 0", "engine 1 TP rank 3"
    bundle: int


@dataclass(frozen=True)
class PlannedGroup:
    """A weight group as the bridge builds it: names `<prefix>_<driver pid>_<n>`, `source` sends (its members take
    part in gathering its tensors), `members` in group-rank order (the source is rank 0)."""

    prefix: str
    source: SourcePart
    members: list[Member]

    @property
    def world_size(self) -> int:
        return len(self.members)


def trainer_sources(hf_config: Any, trainer: Any) -> list[SourcePart]:
    """Every source the trainer's layout has (a glue.trainer.config.TrainerConfig): one per pipeline stage and
    expert group whose ranks do not overlap, as `WeightStream.source_plan` finds them on the running trainer."""
    coords = [Coords(**{k: v for k, v in rank_coords(trainer, r).items() if k != "cp"})
              for r in range(trainer.world_size)]
    stages = planned_stage_layers(hf_config, trainer)
    pp, ep = trainer.pipeline_model_parallel_size, trainer.expert_model_parallel_size

    def stage_layout(stage: int, ep_rank: int) -> ParallelLayout:
        layers = {} if pp == 1 else {"first_layer": stages[stage][0], "num_layers": stages[stage][1]}
        return ParallelLayout(pp_rank=stage, pp_size=pp, ep_rank=ep_rank, ep_size=ep, **layers)

    return weight_sources(hf_config, coords, stage_layout)


def plan_weight_groups(cfg: SluiceConfig, plan: RunPlan, hf_config: Any) -> list[PlannedGroup]:
    """The broadcast weight groups of the run (none for the ipc and disk transports, or without engines): one from
    trainer rank 0, or one per parallel source (`sync.sources`), every engine TP rank in each."""
    if cfg.sync.transport != "broadcast" or not plan.engines:
        return []
    parts = parallel_sources(cfg.sync.sources, trainer_sources(hf_config, cfg.trainer))
    if parts is None:
        names = tuple(name for rule in rules(hf_config) for name in rule.hf)
        parts = [SourcePart(rank=SOURCE_RANK, members=tuple(range(cfg.trainer.world_size)), names=names)]
        prefixes = [GROUP_PREFIX]
    else:
        prefixes = [source_group_prefix(k) for k in range(len(parts))]
    tp = cfg.cluster.engine_tensor_parallel_size
    engines = [Member(rank=engine_rank_offset(e.index, tp) + t, who=f"engine {e.index} TP rank {t}", bundle=bundle)
               for e in plan.engines for t, bundle in enumerate(e.bundles)]
    return [PlannedGroup(prefix=prefix, source=part, members=[
                Member(rank=0, who=f"trainer rank {part.rank}", bundle=plan.trainer[part.rank].bundle), *engines])
            for prefix, part in zip(prefixes, parts)]


def shared_devices(group: PlannedGroup) -> list[tuple[Member, Member]]:
    """Pairs of members on one device (bundle): (the first member there, another), in group-rank order."""
    first: dict[int, Member] = {}
    pairs = []
    for member in group.members:
        if member.bundle in first:
            pairs.append((first[member.bundle], member))
        first.setdefault(member.bundle, member)
    return pairs


def check_devices(cfg: SluiceConfig, plan: RunPlan, groups: list[PlannedGroup]) -> str:
    """NCCL refuses a communicator with two ranks on one device ("Duplicate GPU detected"), on every rank, once the
    run is up: refused here, in one line naming the ranks, the device and the way out, for a weight group over nccl.
    gloo allows it; where the plan models devices (strict engines on CPU) the engines and the trainer's channel refuse
    it when the group forms, as NCCL would (weight_sync.process_group). Returns the dry run's line."""
    clashes = [(group, pair) for group in groups for pair in shared_devices(group)]
    if not clashes:
        return (f"weight groups: {len(groups)} ({cfg.sync.backend}), no two members on one device" if groups else
                f"weight groups: none ({cfg.sync.transport} transport)" if plan.engines else "weight groups: none")
    group, (a, b) = clashes[0]
    where = (f"rank {a.rank} ({a.who}) and rank {b.rank} ({b.who}) of weight group {group.prefix} share one device, "
             f"{plan.device_of(a.bundle)}")
    if cfg.sync.backend == "nccl":
        raise ConfigError(f"{where}: NCCL refuses a communicator with two ranks on one device (\"Duplicate GPU "
                          f"detected\"); {_way_out(cfg)}")
    if plan.models_devices:
        return (f"weight groups: {where}, which gloo allows, but the strict engines stand for SGLang over NCCL and "
                "refuse the group when it forms, as NCCL would (start-up fails there); " + _way_out(cfg))
    return f"weight groups: {len(groups)} (gloo); {where}, which gloo allows"


def _way_out(cfg: SluiceConfig) -> str:
    if cfg.cluster.placement != "colocated":
        return "give the trainer ranks and the engines devices of their own"
    return ("use sync.transport=ipc (colocated engines map the trainer's buffers; the default with SGLang "
            "engines) or disk, or cluster.placement=disaggregated")


def check_weight_groups(cfg: SluiceConfig, plan: RunPlan) -> str:
    """`check_devices` over the run's weight groups (preflight: every run and `--dry-run`)."""
    return check_devices(cfg, plan, plan_weight_groups(cfg, plan, model_config(cfg)))


def sent_numels(hf_config: Any) -> tuple[dict[str, int], int]:
    """Elements of every tensor a sync sends, by HF checkpoint name (each routed expert apart, as the converter
    names them; persistent buffers such as an expert bias too), and the model's parameter count as transformers
    counts it (no buffers), both on the meta device from the HF model `hf_config` describes: no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    numel = {name: t.numel() for name, t in checkpoint_tensors(model, with_tied_copies=False).items()}
    return numel, sum(p.numel() for p in model.parameters())


def frozen_parameters(hf_config: Any) -> str:
    """`; + N in K multi-token-prediction layer(s) ...` for a family whose checkpoints carry MTP layers (transformers
    builds none, so its count leaves them out): each is the last decoder layer's parameters plus what the family
    adds; '' otherwise."""
    family = family_of(hf_config)
    frozen = family.frozen_layers(hf_config)
    if not frozen:
        return ""
    last = f"model.layers.{frozen.start - 1}."
    per_layer = (sum(n for name, n in hf_parameters(hf_config).items() if name.startswith(last))
                 + family.frozen_layer_extra(hf_config))
    return (f"; + {len(frozen) * per_layer:,} in {len(frozen)} multi-token-prediction layer(s), kept frozen and "
            "never synced")


def weight_sync_plan(cfg: SluiceConfig, plan: RunPlan) -> dict[str, Any]:
    """What every weight sync moves, from config.json alone: the bytes (every parameter in the dtype the trainer's
    weights have, `trainer.precision` resolved against the checkpoint as the trainer resolves it, which is what the
    sources send), the bucket size and, over broadcast, every weight group (`describe_groups`)."""
    import torch

    s, hf_config = cfg.sync, model_config(cfg)
    numel, count = sent_numels(hf_config)
    wire = "bfloat16" if resolve_precision(cfg.trainer, hf_config) == "bf16" else "float32"
    itemsize = getattr(torch, wire).itemsize
    total = sum(numel.values()) * itemsize
    stored = getattr(hf_config, "dtype", None)  # config.json's torch_dtype: a torch.dtype, a name, "auto" or None
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    as_stored = (f"; {format_bytes(sum(numel.values()) * stored.itemsize)} at the checkpoint's "
                 f"{str(stored).removeprefix('torch.')}" if isinstance(stored, torch.dtype) else "")
    pipeline = s.backend == "nccl" if s.pipeline is None else s.pipeline
    bucket = pipeline_bucket_bytes(total, s.bucket_bytes) if pipeline else s.bucket_bytes
    shown = {"transport": {"broadcast": f"broadcast ({s.backend})", "disk": "disk"}.get(
                 s.transport, "ipc (/update_weights_from_tensor: CUDA IPC handles on GPU, shared memory on CPU)"),
             "parameters": f"{count:,} ({hf_config.model_type}, counted from "
                           f"{'config.json' if cfg.model.path else 'model.tiny'}{frozen_parameters(hf_config)})",
             "bytes_per_sync": f"{total:,} = {format_bytes(total)} ({itemsize} bytes per parameter: {wire}, the "
                               f"trainer's weights{as_stored})",
             "buckets": f"at least {math.ceil(total / bucket)} of at most {bucket / 2**20:.4g} MiB"
                        + (" (pipelined)" if pipeline and s.transport != "disk" else "")}
    if plan.transport_reason:
        shown["transport"] = plan.transport_reason
    if s.transport == "ipc":
        shown.update(ipc_plan(plan, total, pipeline, bucket))
    groups = plan_weight_groups(cfg, plan, hf_config)
    if groups:
        how = "one: trainer rank 0 sends every tensor" if len(groups) == 1 else (
            f"parallel: {len(groups)} sources, one per pipeline stage and expert group whose ranks do not overlap")
        shown["sources"] = f"{how} (sync.sources: {s.sources or 'null, parallel where the layout has several'})"
        shown["groups"] = describe_groups(plan, groups, numel, itemsize)
    return shown


def ipc_plan(plan: RunPlan, total: int, pipeline: bool, bucket: int) -> dict[str, Any]:
    """The ipc transport's sources (one per GPU), each engine rank's, and the bucket copies they hold."""
    copies = copy_ranks(plan)
    count = 2 if pipeline and math.ceil(total / bucket) > 1 else 1
    others = [r for r in copies if r != 0]
    fans = "trainer rank 0 gathers each bucket, "  # one GPU alone has no other copy to broadcast to
    if others:
        to = _ranks(tuple(others)).removeprefix("trainer ")
        fans = f"trainer rank 0 gathers each bucket and broadcasts it to {to}, "
    return {"sources": f"one per GPU: {fans}and every engine TP rank reads the copy on its own GPU through a CUDA IPC "
                       "handle made there (/update_weights_from_tensor, one entry per TP rank)",
            "ipc_handles": describe_sources(plan),
            "bucket_copies": f"{len(copies)} GPU(s) hold {count} bucket buffer(s) of at most "
                             f"{format_bytes(min(bucket, total))}, reused every sync (in plan.memory)"}


def describe_groups(plan: RunPlan, groups: list[PlannedGroup], numel: dict[str, int], itemsize: int
                    ) -> list[dict[str, Any]]:
    """Per group its name, source, producing ranks, tensors and bytes, and its members by rank with their devices
    (an engine's TP ranks on one line)."""
    shown = []
    for group in groups:
        nbytes = sum(numel[name] for name in group.source.names) * itemsize
        source = group.members[0]
        lines = [f"rank 0: {source.who} ({plan.device_of(source.bundle)})"]
        engines: dict[str, list[Member]] = {}
        for member in group.members[1:]:
            engines.setdefault(member.who.split(" TP ")[0], []).append(member)
        for engine, ranks in engines.items():
            span = f"rank {ranks[0].rank}" if len(ranks) == 1 else f"ranks {ranks[0].rank}-{ranks[-1].rank}"
            lines.append(f"{span}: {engine}, rank_offset {ranks[0].rank} ({_devices(plan, [m.bundle for m in ranks])})"
                         + _node_ranks_text(plan, engine))
        shown.append({"group": f"{group.prefix}_<pid>_<n>", "source": f"trainer rank {group.source.rank}",
                      "producers": _ranks(group.source.members),
                      "tensors": f"{len(group.source.names):,} ({format_bytes(nbytes)})",
                      "world_size": group.world_size, "members": lines})
    return shown


def _devices(plan: RunPlan, bundles: list[int]) -> str:
    """`node 0 gpus 0-7` for consecutive GPUs of one node (`cpu bundles 0-7` on CPU), `node 0 gpus 0-7, node 1
    gpus 0-7` over nodes, else each device."""
    parts = node_parts(plan, bundles)
    if len(parts) > 1:
        return ", ".join(_devices(plan, part) for part in parts)
    slots = [plan.bundle_slots[b] for b in bundles]
    if len(bundles) > 1 and bundles == list(range(bundles[0], bundles[-1] + 1)):
        if slots[0][1] is None:
            return f"cpu bundles {bundles[0]}-{bundles[-1]}"
        if len({node for node, _ in slots}) == 1 and slots[-1][1] - slots[0][1] == len(slots) - 1:
            return f"node {slots[0][0]} gpus {slots[0][1]}-{slots[-1][1]}"
    return ", ".join(plan.device_of(b) for b in bundles)


def _node_ranks_text(plan: RunPlan, engine: str) -> str:
    """For a policy engine that spans nodes, which of its TP ranks each node rank's server holds (SGLang gives node
    rank k the k-th tp_size / nnodes of them): `; TP ranks 0-7 in node rank 0's server, 8-15 in node rank 1's`."""
    if plan.engine_nodes == 1 or not engine.startswith("engine "):
        return ""
    ranks, at, parts = plan.engines[int(engine.split()[1])].node_ranks, 0, []
    for r in ranks:
        parts.append(f"{at}-{at + len(r.bundles) - 1}" if len(r.bundles) > 1 else f"{at}")
        at += len(r.bundles)
    return f"; TP rank{'s' if len(ranks[0].bundles) > 1 else ''} {parts[0]} in node rank 0's server, " + ", ".join(
        f"{p} in node rank {k}'s" for k, p in enumerate(parts) if k) + " (every one a member)"


def _ranks(ranks: tuple[int, ...]) -> str:
    """`trainer ranks 0-3` for a contiguous run, else the list."""
    if len(ranks) == 1:
        return f"trainer rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"trainer ranks {ranks[0]}-{ranks[-1]}"
    return "trainer ranks " + ", ".join(map(str, ranks))
