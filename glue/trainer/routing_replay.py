"""MoE routing replay (R3) in the trainer: every MoE layer routes each token through the experts the engine chose
for it (`TrainBatch.routed_experts`), in the forward and in any recompute during backward, with megatron-core's
`RouterReplay` (`moe_enable_routing_replay`). While replaying, each layer also computes its own top-k from the
same scores, so `moe/routing_agreement` says how often the trainer alone would have picked the same experts.

megatron-core keeps one `RouterReplay` per router in a process-wide list; sluice sets each router's own instance
(a process may hold several models, e.g. in tests) and finds the decoder layer a router serves from its
`layer_number`, so pipeline stages and dense layers need no bookkeeping here.
"""
from __future__ import annotations

import functools
from typing import Any

import torch


class RoutingReplay:
    """The routers of `model` (one per MoE layer on this rank's pipeline stage) and the replay of one step."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.actions = RouterReplayAction
        self.routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        if not self.routers:
            raise ValueError("trainer.routing_replay: the model has no MoE router with replay enabled (a dense model, "
                             "or moe_enable_routing_replay is off)")
        self.agree = self.total = 0
        for router in self.routers:
            replay = router.router_replay
            replay.get_replay_topk = functools.partial(self._replay_topk, replay, replay.get_replay_topk)
            replay.valid = None  # tokens whose routing came from the engine (not padding), for the agreement count

    def load(self, routing: torch.Tensor, *, sequence_parallel: bool = False, tp_rank: int = 0,
             tp_size: int = 1) -> None:
        """Queue one forward's routing: `routing` [R, L, layers, top_k] for the micro-batch's [R, L] tokens (-1
        where the engine ran no router: padding, each sample's last token). The router sees tokens s-major
        ([L, R] flattened), and with sequence parallelism only this TP rank's share of L."""
        if sequence_parallel and tp_size > 1:  # glue.trainer.model.forward_logits pads L to a multiple of TP
            share = -(-routing.shape[1] // tp_size)
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, share * tp_size - routing.shape[1]), value=-1)
            routing = routing[:, tp_rank * share:(tp_rank + 1) * share]
        for router in self.routers:
            layer = router.layer_number - 1  # megatron numbers decoder layers from 1, over all pipeline stages
            chosen = routing[:, :, layer].transpose(0, 1).reshape(-1, routing.shape[-1]).long()
            valid = chosen[:, 0] >= 0
            filler = torch.arange(chosen.shape[1]).expand_as(chosen)  # distinct valid ids: no expert counted twice
            router.router_replay.set_target_indices(torch.where(valid[:, None], chosen, filler))
            router.router_replay.valid = valid
            router.router_replay.set_router_replay_action(self.actions.REPLAY_FORWARD)

    def backward(self) -> None:
        """The forwards queued so far are done: a recompute in backward replays their routing, in order."""
        for router in self.routers:
            router.router_replay.set_router_replay_action(self.actions.REPLAY_BACKWARD)

    def clear(self) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
            router.router_replay.valid = None

    def agreement_over_ranks(self) -> dict[str, float]:
        """`moe/routing_agreement` over every rank's replayed forwards since the last call (a collective)."""
        counts = torch.tensor([self.agree, self.total], dtype=torch.float64)
        self.agree = self.total = 0
        torch.distributed.all_reduce(counts)
        return {"moe/routing_agreement": float(counts[0] / counts[1].clamp(min=1))}

    def _replay_topk(self, replay: Any, original, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                     default_compute_topk=None):
        if replay.router_replay_action == self.actions.REPLAY_FORWARD and replay.valid is not None:
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = replay.target_topk_idx.to(own.device)
                same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
                valid = replay.valid.to(own.device)
                self.agree += int(same[valid].sum())
                self.total += int(valid.sum())
        return original(scores, topk, num_groups, group_topk, default_compute_topk)


def routing_rows(micro_batch: Any, routed_experts: torch.Tensor) -> torch.Tensor:
    """A micro-batch's routing, [R, L, layers, top_k], gathered from the batch's [B, T, layers, top_k] with the
    micro-batch's index map (glue.trainer.packing.MicroBatch.index); -1 where it has no token."""
    batch, width = routed_experts.shape[:2]
    flat = routed_experts.reshape(batch * width, *routed_experts.shape[2:])
    index = micro_batch.index
    rows = flat[index.clamp(min=0)]
    return torch.where((index >= 0)[..., None, None], rows, torch.full((), -1, dtype=rows.dtype))


def replay_args(replay: RoutingReplay | None, batch: Any) -> dict[str, Any]:
    """glue.trainer.pipeline.run_micro_batches' replay arguments for a TrainBatch (none without a replay)."""
    if replay is None:
        return {}
    if batch.routed_experts is None:
        raise ValueError("trainer.routing_replay is on but the batch carries no routed experts: set "
                         "rollout.return_routed_experts: true")
    return {"replay": replay, "routed_experts": batch.routed_experts}


def logprob_gaps(batch: Any, compute_logprobs) -> dict[str, float]:
    """The train-rollout logprob gap (token mean of |trainer - rollout logprob| over trained tokens) with and
    without routing replay, from `compute_logprobs(batch, replay=...)`: two forward-only passes."""
    mask = batch.logprob_mask.float()
    gaps = {}
    for name, replay in (("with", True), ("without", False)):
        diff = (compute_logprobs(batch, replay=replay) - batch.rollout_logprobs.float()).abs()
        gaps[f"moe/logprob_gap_{name}_replay"] = float((diff * mask).sum() / mask.sum().clamp(min=1))
    return gaps
