"""Where one trainer rank sits in megatron-core's parallel layout (TP x PP x EP x DP, experts folded into the dense
ranks) and what that means for its per-token results, which meet the other ranks' here (which samples it runs is
`glue.trainer.packing`'s; its gradients meet in megatron's DDP: `glue.trainer.optim`), and how its local shards
become the full HF-named weights.

Every function here is a collective or depends on `parallel_state` being initialised; the worker calls them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glue.trainer.model import model_tensors
from glue.trainer.pipeline import describe_stages, gather_stages
from weight_sync.convert import ParallelLayout, megatron_to_hf


def is_expert_param(name: str) -> bool:
    """Routed-expert weights live on their expert-parallel rank only (the router and shared experts are dense)."""
    return ".mlp.experts." in name


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates, plus every member of its expert group (ETP x EP ranks) as (ep_rank, etp_rank) and,
    under pipeline parallelism, every stage of its pipeline (glue.trainer.pipeline.Stage)."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    ep_size: int
    etp_size: int
    ep_rank: int
    etp_rank: int
    expert_members: tuple[tuple[int, int], ...]
    pp_rank: int = 0
    pp_size: int = 1
    stages: tuple[Any, ...] = ()  # one glue.trainer.pipeline.Stage per pipeline stage when pp_size > 1

    @classmethod
    def from_parallel_state(cls, model: torch.nn.Module) -> "RankPlace":
        """Read the coordinates megatron assigned and, with PP, the stages' layers and parameters of `model`
        (collective over the expert group and the PP group, once)."""
        from megatron.core import parallel_state as ps

        mine = (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
        group = ps.get_expert_tensor_and_model_parallel_group()
        members: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(members, mine, group=group)
        pp_size = ps.get_pipeline_model_parallel_world_size()
        return cls(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                   ep_size=ps.get_expert_model_parallel_world_size(),
                   etp_size=ps.get_expert_tensor_parallel_world_size(), ep_rank=mine[0], etp_rank=mine[1],
                   expert_members=tuple(tuple(m) for m in members), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   pp_size=pp_size, stages=describe_stages(model) if pp_size > 1 else ())

    def layout(self, tp_rank: int | None = None, member: tuple[int, int] | None = None, stage: int | None = None):
        """The converter's ParallelLayout of this rank, or of the rank holding dense TP shard `tp_rank` and the
        expert shard of expert-group `member` in pipeline stage `stage`."""
        ep_rank, etp_rank = member if member is not None else (self.ep_rank, self.etp_rank)
        stage = self.pp_rank if stage is None else stage
        layers = {} if self.pp_size == 1 else {"first_layer": self.stages[stage].first_layer,
                                                "num_layers": self.stages[stage].num_layers}
        return ParallelLayout(tp_rank=self.tp_rank if tp_rank is None else tp_rank, tp_size=self.tp_size,
                              ep_rank=ep_rank, ep_size=self.ep_size, etp_rank=etp_rank, etp_size=self.etp_size,
                              pp_rank=stage, pp_size=self.pp_size, **layers)

    def gather_layouts(self, stage: int | None = None) -> list[Any]:
        """Layouts that together cover every dense TP shard and every expert shard of a stage (default: this rank's).
        Layout i pairs dense shard i mod TP with expert member i mod M: any pairing works because the converter
        reads each shard once from whichever layout holds it, and max(TP, M) layouts cover both sets."""
        count = max(self.tp_size, len(self.expert_members))
        return [self.layout(i % self.tp_size, self.expert_members[i % len(self.expert_members)], stage)
                for i in range(count)]

    def shard_count(self, name: str) -> int:
        """How many shards of parameter `name` its gather group holds: the expert group's size for routed experts,
        TP for the rest."""
        return len(self.expert_members) if is_expert_param(name) else self.tp_size


def sum_over_dp(metrics: dict[str, float], place: RankPlace, device: torch.device) -> dict[str, float]:
    """Each DP rank's metric shares, summed over DP ranks (every rank has the same keys: one loss config)."""
    if place.dp_size == 1:
        return metrics
    from megatron.core import parallel_state as ps

    names = sorted(metrics)
    values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values, group=ps.get_data_parallel_group())
    return dict(zip(names, values.tolist()))


def sum_tensor_over_dp(part: torch.Tensor, place: RankPlace) -> torch.Tensor:
    """`part` summed over the DP ranks: each rank fills the entries of its own micro-batches and leaves the rest 0,
    so the sum is every rank's entries, exactly (x + 0 is x)."""
    if place.dp_size == 1:
        return part
    from megatron.core import parallel_state as ps

    torch.distributed.all_reduce(part, group=ps.get_data_parallel_group())
    return part


def full_hf_state(model: torch.nn.Module, hf_config: Any, place: RankPlace, *, keep: bool = True
                  ) -> dict[str, torch.Tensor]:
    """Every weight as a full HF-named CPU tensor (collective: every rank calls it). Dense shards are gathered over
    TP, expert shards over the ETP x EP group, the stages' shards to the keeping rank's stage, then the converter
    assembles them. Ranks with `keep=False` only take part and return {}, so one host copy of the model is made,
    not one per rank. Read it before the next optimizer step: unsharded tensors may be the parameters themselves."""
    by_stage = {place.pp_rank: _stage_shards(model, place)}
    if place.pp_size > 1:
        by_stage = gather_stages(by_stage[place.pp_rank], place, keep)
    if not keep:
        return {}
    states: list[dict[str, torch.Tensor]] = []
    layouts: list[Any] = []
    for stage, shards in sorted(by_stage.items()):
        shards = {name: [part.cpu() for part in parts] for name, parts in shards.items()}
        stage_layouts = place.gather_layouts(stage)
        states += [{name: parts[i % len(parts)] for name, parts in shards.items()} for i in range(len(stage_layouts))]
        layouts += stage_layouts
    return megatron_to_hf(states, hf_config, layouts)


def _stage_shards(model: torch.nn.Module, place: RankPlace) -> dict[str, list[torch.Tensor]]:
    """Parameter name -> every shard of it in this stage, in group-rank order (collective over TP and the expert
    group): the dense TP shards, or the expert group's shards of a routed expert."""
    from megatron.core import parallel_state as ps

    tp_group, expert_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_and_model_parallel_group()
    out = {}
    for name, param in model_tensors(model).items():
        size = place.shard_count(name)
        if size == 1:  # nothing to gather: no copy either (on CPU the state then aliases the parameters)
            out[name] = [param.data]
            continue
        out[name] = [torch.empty_like(param.data) for _ in range(size)]
        group = expert_group if is_expert_param(name) else tp_group
        torch.distributed.all_gather(out[name], param.data.contiguous(), group=group)
    return out


def hf_weight_specs(model: torch.nn.Module, hf_config: Any, place: RankPlace) -> list[tuple[str, Any, tuple]]:
    """(HF name, dtype, full shape) of every tensor `full_hf_state` returns, in its order; no communication
    (meta tensors: every rank's shard of a parameter has the same shape, and every rank knows every stage's)."""
    if place.pp_size == 1:
        params = {0: [(n, p.shape, p.dtype) for n, p in model_tensors(model).items()]}
    else:
        params = {stage: info.params for stage, info in enumerate(place.stages)}
    states, layouts = [], []
    for stage, stage_params in params.items():
        meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, shape, dtype in stage_params}
        stage_layouts = place.gather_layouts(stage if place.pp_size > 1 else None)
        states += [dict(meta) for _ in stage_layouts]
        layouts += stage_layouts
    full = megatron_to_hf(states, hf_config, layouts)
    return [(n, t.dtype, tuple(t.shape)) for n, t in full.items()]
