"""Every forward and backward of the trainer runs through megatron-core's pipeline schedules
(`get_forward_backward_func`): one stage per pipeline rank, activations passed between stages point to point.
Without pipeline parallelism that is megatron's plain micro-batch loop. The last stage turns logits into logprobs
and losses; this module also brings its results and the stages' weights to the ranks that need them (the tied
embedding's gradient is megatron's finalize_model_grads' work: glue.trainer.optim), and reads which layers each stage
holds from the megatron-core fields that set the split (`PipelineSplit`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from glue.trainer import model as trainer_model
from glue.trainer.packing import MicroBatch
from glue.trainer.routing_replay import micro_batch_rows
from weight_sync.convert.layout import FIRST_STAGE, LAST_STAGE, SPLIT_FLAGS, stage_layer_ranges

# head(micro-batch, logits [R, L, V / TP]) -> (loss to backpropagate or None when forward-only, result to keep)
Head = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor | None, Any]]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage as every rank knows it: its global layer range and its parameters' (name, shard shape,
    dtype), the same on each of the stage's TP / EP ranks."""

    first_layer: int
    num_layers: int
    params: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


EMBEDDING_COUNTED, LOSS_COUNTED = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"


@dataclass(frozen=True)
class PipelineSplit:
    """How megatron-core splits the decoder layers over the pipeline stages, from the fields that set it: the first /
    last stage's layers (num_layers_in_first / last_pipeline_stage), or the embedding / loss counted as a layer of
    the even split (account_for_*_in_pipeline_split), which puts one layer fewer on the first / last stage."""

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> "PipelineSplit":
        """From megatron-core field values: `TrainerConfig.megatron_values()`, or a TransformerConfig's `vars()`."""
        if values.get("pipeline_model_parallel_layout") is not None:
            raise ValueError("trainer.megatron.pipeline_model_parallel_layout (--pipeline-model-parallel-layout) is "
                             "not planned: sluice places layers by megatron-core's first / last stage sizes; give "
                             f"{SPLIT_FLAGS} instead")
        return cls(first=values.get(FIRST_STAGE), last=values.get(LAST_STAGE),
                   embedding=bool(values.get(EMBEDDING_COUNTED)), loss=bool(values.get(LOSS_COUNTED)))

    def ranges(self, num_layers: int, pp_size: int) -> tuple[range, ...]:
        """Every stage's global layers (weight_sync.convert.stage_layer_ranges); a split megatron-core refuses is
        refused in one line."""
        if not (self.embedding or self.loss):
            return stage_layer_ranges(num_layers, pp_size, first=self.first, last=self.last)
        counted = [name for name, on in ((EMBEDDING_COUNTED, self.embedding), (LOSS_COUNTED, self.loss)) if on]
        if self.first is not None or self.last is not None:
            raise ValueError(f"{' and '.join(counted)} with {FIRST_STAGE} / {LAST_STAGE}: megatron-core refuses "
                             "both ways of sizing the end stages at once; give one of them")
        total = num_layers + len(counted)
        if total % pp_size:
            raise ValueError(f"num_layers={num_layers} + {len(counted)} with {' and '.join(counted)} is {total}, "
                             f"which does not split evenly over pipeline_model_parallel_size={pp_size}; choose a PP "
                             f"size that divides {total}")
        if pp_size == 1:
            return (range(num_layers),)
        short = total // pp_size - 1
        if short < 1:
            raise ValueError(f"{' and '.join(counted)} at pipeline_model_parallel_size={pp_size} leave an end stage "
                             f"no decoder layer ({total} // {pp_size} - 1 = 0), which sluice does not plan; choose a "
                             "smaller PP size")
        return stage_layer_ranges(num_layers, pp_size, first=short if self.embedding else None,
                                  last=short if self.loss else None)


def describe_stages(model: torch.nn.Module) -> tuple[Stage, ...]:
    """Every pipeline stage of this rank's pipeline, in stage order (collective over the PP group, once). Its layer
    range is the split's (`PipelineSplit`), checked against the layers megatron built here."""
    from megatron.core import parallel_state as ps

    config, layers = model.config, model.decoder.layers
    stage = ps.get_pipeline_model_parallel_rank()
    planned = PipelineSplit.of(vars(config)).ranges(config.num_layers, config.pipeline_model_parallel_size)[stage]
    built = range(layers[0].layer_number - 1, layers[-1].layer_number) if len(layers) else range(0)  # numbered from 1
    if built != planned:
        raise RuntimeError(f"pipeline stage {stage}: megatron-core built layers {built.start}-{built.stop - 1} where "
                           f"weight_sync.convert.stage_layer_ranges plans {planned.start}-{planned.stop - 1}; the "
                           "weight sync would misplace them: report this with the trainer's megatron flags")
    mine = Stage(planned.start, len(planned), tuple((n, tuple(p.shape), p.dtype)
                                                    for n, p in trainer_model.model_tensors(model).items()))
    group = ps.get_pipeline_model_parallel_group()
    stages: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(stages, mine, group=group)
    return tuple(stages)


def planned_stage_layers(hf_config: Any, trainer: Any) -> list[tuple[int, int]]:
    """(first layer, number of layers) of every pipeline stage of the model the trainer builds for `hf_config`
    under `trainer` (a glue.trainer.config.TrainerConfig), before any rank starts: the split its megatron values set
    (`PipelineSplit`), which is megatron-core's own."""
    ranges = PipelineSplit.of(trainer.megatron_values()).ranges(hf_config.num_hidden_layers,
                                                                trainer.pipeline_model_parallel_size)
    return [(r.start, len(r)) for r in ranges]


def run_micro_batches(module: torch.nn.Module, micro_batches: list[MicroBatch], tokens: torch.Tensor,
                      head: Head, *, forward_only: bool, replay: Any = None,
                      routed_experts: torch.Tensor | None = None) -> list[Any]:
    """Run `micro_batches` of the [B, T] `tokens` through this rank's stage of `module` with megatron's schedule
    (1F1B when PP > 1): forwards, and unless `forward_only` the backward of each head's loss, gradients accumulating
    in the parameters. Returns the heads' results in micro-batch order on the last stage, [] on the others.
    With `replay` (glue.trainer.routing_replay.RoutingReplay) and the batch's `routed_experts` [B, T, layers, k],
    every MoE layer routes each token through the engine's experts, in the forwards and in any recompute."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not module.config.calculate_per_token_loss:
        raise ValueError("the trainer's losses arrive normalised by the batch's global token counts, which megatron's "
                         "schedules keep only with calculate_per_token_loss=true; do not turn it off")
    device = next(module.parameters()).device

    def forward_step(data_iterator: Any, stage_module: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        mb = next(data_iterator)
        position_ids = None if mb.position_ids is None else mb.position_ids.to(device)
        seq_ids = None if mb.seq_ids is None else mb.seq_ids.to(device)
        if replaying:
            replay.load(micro_batch_rows(mb, routed_experts), labels=replay.labels_of(mb), **sequence_split)
        output = trainer_model.forward_logits(stage_module, mb.take(tokens).to(device), position_ids, seq_ids)
        if replaying and output.requires_grad:  # this micro-batch's backward begins: a recompute replays too
            output.register_hook(lambda grad: replay.backward())

        def last_stage(logits: torch.Tensor, non_loss_data: bool = False) -> Any:
            loss, result = head(mb, logits)
            if non_loss_data:
                return result
            # (loss, token count, kept result): with calculate_per_token_loss the schedule backpropagates the loss
            # as it is; the token count only feeds megatron's own gradient finalisation, which is not used
            return loss, torch.ones((), dtype=torch.int), result

        return output, last_stage

    replaying = replay is not None and routed_experts is not None
    if replaying:
        from megatron.core import parallel_state as ps

        sequence_split = dict(sequence_parallel=module.config.sequence_parallel,
                              tp_rank=ps.get_tensor_model_parallel_rank(),
                              tp_size=ps.get_tensor_model_parallel_world_size())
    groups, p2p = _communication(module.config)
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=module,
            num_microbatches=len(micro_batches), seq_length=tokens.shape[1], micro_batch_size=1,
            forward_only=forward_only, collect_non_loss_data=forward_only, p2p_communicator=p2p, pg_collection=groups)
    finally:
        if replaying:
            replay.clear()


def _communication(config: Any) -> tuple[Any, Any]:
    """The process groups megatron's schedules use, and a point-to-point communicator whose stages exchange each
    activation's shape before it (micro-batches differ in rows and width). The shape exchange is set on the
    communicator's copy of the config only: on the model's config megatron refuses it next to the allgather MoE
    dispatcher, whose EP ranks must see equal shapes (the trainer plans them so; glue.trainer.packing)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"])
    p2p_config = copy.copy(config)
    p2p_config.variable_seq_lengths = True
    return groups, P2PCommunicator(pp_group=groups.pp, config=p2p_config)


def share_tensor_from_last_stage(part: torch.Tensor) -> torch.Tensor:
    """The last stage's `part` on every stage: the other stages hold zeros, so a sum over the PP group is exact."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(part, group=ps.get_pipeline_model_parallel_group())
    return part


def share_from_last_stage(obj: Any) -> Any:
    """The last stage's `obj` (any picklable value) on every stage of the pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = ps.get_pipeline_model_parallel_group()
    last = torch.distributed.get_process_group_ranks(group)[-1]
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=last, group=group)
    return box[0]


def gather_stages(shards: dict[str, list[torch.Tensor]], place: Any, keep: bool
                  ) -> dict[int, dict[str, list[torch.Tensor]]]:
    """Collective over the PP group. Each stage brings its parameters' shards (name -> the TP / expert group's
    shards, gathered within the stage) to the member that passed `keep` (at most one per pipeline). Returns
    {stage: shards} for every stage on that member, {} on the others."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    flags: list[Any] = [None] * place.pp_size
    torch.distributed.all_gather_object(flags, keep, group=group)
    if not any(flags):
        return {}
    keeper = flags.index(True)
    ranks = torch.distributed.get_process_group_ranks(group)
    if place.pp_rank != keeper:
        requests = [torch.distributed.isend(part.contiguous(), dst=ranks[keeper], group=group)
                    for parts in shards.values() for part in parts]
        for request in requests:
            request.wait()
        return {}
    out = {keeper: shards}
    device = next(iter(shards.values()))[0].device
    for stage in range(place.pp_size):
        if stage == keeper:
            continue
        received, requests = {}, []
        for name, shape, dtype in place.stages[stage].params:
            received[name] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(place.shard_count(name))]
            requests += [torch.distributed.irecv(part, src=ranks[stage], group=group) for part in received[name]]
        for request in requests:
            request.wait()
        out[stage] = received
    return out
