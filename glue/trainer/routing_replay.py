"""MoE routing replay (R3) in the trainer: every MoE layer routes each token through the experts the engine chose
for it (`TrainBatch.routed_experts`), in the forward and in any recompute during backward, with megatron-core's
`RouterReplay` (`moe_enable_routing_replay`). While replaying, each layer also computes its own top-k from the
same scores, so `moe/routing_agreement` says how often the trainer alone would have picked the same experts. It is
counted in one forward per step, the pre-update one with replay (`logprob_gaps`), split by the tokens' staleness.

megatron-core keeps one `RouterReplay` per router in a process-wide list; sluice sets each router's own instance
(a process may hold several models, e.g. in tests) and finds the decoder layer a router serves from its
`layer_number`, so pipeline stages and dense layers need no bookkeeping here.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

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
        # per token label (TOKEN_KINDS) [agree, total] token-layers of the step's counted forward
        self.counts: torch.Tensor | None = None
        self.token_labels: torch.Tensor | None = None  # [B, T] labels of the batch being counted; None: not counting
        for router in self.routers:
            replay = router.router_replay
            replay.get_replay_topk = functools.partial(self._replay_topk, replay, replay.get_replay_topk)
            replay.valid = None  # tokens whose routing came from the engine (not padding), for the agreement count
            replay.labels = None  # their TOKEN_KINDS labels while counting

    @contextlib.contextmanager
    def counting(self, token_labels: torch.Tensor) -> Iterator[None]:
        """Count agreement in the forwards run inside, per token label ([B, T], an index of TOKEN_KINDS) of the
        batch they run on; `agreement_over_ranks` reads the counts."""
        self.token_labels, self.counts = token_labels, torch.zeros(len(TOKEN_KINDS), 2, dtype=torch.float64)
        try:
            yield
        finally:
            self.token_labels = None

    def labels_of(self, micro_batch: Any) -> torch.Tensor | None:
        """The counted batch's token labels for a micro-batch, [R, L] (-1 where it has no token); None if not
        counting."""
        return None if self.token_labels is None else micro_batch_rows(micro_batch, self.token_labels)

    def load(self, routing: torch.Tensor, *, labels: torch.Tensor | None = None, sequence_parallel: bool = False,
             tp_rank: int = 0, tp_size: int = 1) -> None:
        """Queue one forward's routing: `routing` [R, L, layers, top_k] for the micro-batch's [R, L] tokens (-1
        where the engine ran no router: padding, each sample's last token), and while counting their `labels`
        [R, L]. The router sees tokens s-major ([L, R] flattened), and with sequence parallelism only this TP
        rank's share of L."""
        if labels is None:
            labels = torch.full(routing.shape[:2], -1, dtype=torch.long)
        if sequence_parallel and tp_size > 1:  # glue.trainer.model.forward_logits pads L to a multiple of TP
            share = -(-routing.shape[1] // tp_size)
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, share * tp_size - routing.shape[1]), value=-1)
            routing = routing[:, tp_rank * share:(tp_rank + 1) * share]
            labels = torch.nn.functional.pad(labels, (0, share * tp_size - labels.shape[1]), value=-1)
            labels = labels[:, tp_rank * share:(tp_rank + 1) * share]
        token_labels = labels.transpose(0, 1).reshape(-1).long()
        for router in self.routers:
            layer = router.layer_number - 1  # megatron numbers decoder layers from 1, over all pipeline stages
            chosen = routing[:, :, layer].transpose(0, 1).reshape(-1, routing.shape[-1]).long()
            valid = chosen[:, 0] >= 0
            filler = torch.arange(chosen.shape[1]).expand_as(chosen)  # distinct valid ids: no expert counted twice
            router.router_replay.set_target_indices(torch.where(valid[:, None], chosen, filler))
            router.router_replay.valid = valid
            router.router_replay.labels = token_labels
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
            router.router_replay.labels = None

    def agreement_over_ranks(self) -> dict[str, float]:
        """Over every rank's counted forward (a collective): `moe/routing_agreement` over all routed tokens and
        `moe/routing_token_layers` (the token-layers counted, summed over ranks: without sequence parallelism each TP
        rank counts the same ones), and the agreement over the trained tokens of
        each staleness (`_fresh`: generated by the current version; `_stale`: by an older one) where there are any.
        Every rank calls it each step, counted or not."""
        counts = self.counts if self.counts is not None else torch.zeros(len(TOKEN_KINDS), 2, dtype=torch.float64)
        self.counts = None
        torch.distributed.all_reduce(counts)
        agree, total = counts.sum(dim=0)
        metrics = {"moe/routing_agreement": float(agree / total.clamp(min=1)), "moe/routing_token_layers": float(total)}
        for kind, (kind_agree, kind_total) in zip(TOKEN_KINDS, counts):
            if kind != "other" and kind_total > 0:
                metrics[f"moe/routing_agreement_{kind}"] = float(kind_agree / kind_total)
        return metrics

    def _replay_topk(self, replay: Any, original, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                     default_compute_topk=None):
        if (self.token_labels is not None and replay.router_replay_action == self.actions.REPLAY_FORWARD
                and replay.valid is not None):
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = replay.target_topk_idx.to(own.device)
                same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1).cpu()
                labels = torch.where(replay.labels < 0, TOKEN_KINDS.index("other"), replay.labels)  # unlabelled: other
                valid = replay.valid.cpu()
                self.counts[:, 0].index_add_(0, labels[valid], same[valid].double())
                self.counts[:, 1].index_add_(0, labels[valid], torch.ones(int(valid.sum()), dtype=torch.float64))
        return original(scores, topk, num_groups, group_topk, default_compute_topk)


def micro_batch_rows(micro_batch: Any, per_token: torch.Tensor, fill: int = -1) -> torch.Tensor:
    """A micro-batch's [R, L, ...] rows of a batch's per-token tensor [B, T, ...], gathered with the micro-batch's
    index map (glue.trainer.packing.MicroBatch.index); `fill` where it has no token."""
    batch, width = per_token.shape[:2]
    flat = per_token.reshape(batch * width, *per_token.shape[2:])
    index = micro_batch.index
    rows = flat[index.clamp(min=0)]
    present = (index >= 0).reshape(*index.shape, *[1] * (per_token.dim() - 2))
    return torch.where(present, rows, torch.full((), fill, dtype=rows.dtype))


def replay_args(replay: RoutingReplay | None, batch: Any) -> dict[str, Any]:
    """glue.trainer.pipeline.run_micro_batches' replay arguments for a TrainBatch (none without a replay)."""
    if replay is None:
        return {}
    if batch.routed_experts is None:
        raise ValueError("trainer.routing_replay is on but the batch carries no routed experts: set "
                         "rollout.return_routed_experts: true")
    return {"replay": replay, "routed_experts": batch.routed_experts}


TOKEN_KINDS = ("fresh", "stale", "other")  # trained tokens of the current version, of an older one; the rest


def token_kinds(batch: Any, version: int) -> torch.Tensor:
    """[B, T] index into TOKEN_KINDS: a trained token (logprob_mask) is fresh when its version is `version`, stale
    when older; prompt, padding and untrained tokens are other."""
    trained = batch.logprob_mask > 0
    stale = batch.versions.long() != version
    return torch.where(trained, stale.long(), TOKEN_KINDS.index("other"))


def logprob_gaps(batch: Any, compute_logprobs: Callable[..., torch.Tensor], replay: RoutingReplay, version: int,
                 at_version: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """The train-rollout logprob gap (token mean of |trainer - rollout logprob|) with and without routing replay,
    from `compute_logprobs(batch, replay=...)` at the current weights (two forward-only passes; the one with replay
    is where routing agreement is counted), over all trained tokens and split into fresh and stale ones (suffix
    `_fresh` / `_stale`, where there are any). At `s` versions behind, a stale token's gap is mostly the policy's
    own change, which no routing undoes. `at_version`, the logprobs of every token at the version that generated it
    (snapshots) with and without replay, gives `..._at_version` (split the same way): the gap R3 exists to close,
    under any staleness."""
    kinds = token_kinds(batch, version)
    rollout = batch.rollout_logprobs.float()
    with replay.counting(kinds):
        with_replay = compute_logprobs(batch, replay=True)
    passes = {"with_replay": with_replay, "without_replay": compute_logprobs(batch, replay=False)}
    masks = {"": kinds < TOKEN_KINDS.index("other"), "_fresh": kinds == 0, "_stale": kinds == 1}
    gaps = {}
    if at_version is not None:
        passes.update({"with_replay_at_version": at_version[0], "without_replay_at_version": at_version[1]})
    for name, logprobs in passes.items():
        diff = (logprobs - rollout).abs()
        for suffix, mask in masks.items():
            if mask.any() or not suffix:
                gaps[f"moe/logprob_gap_{name}{suffix}"] = float((diff * mask).sum() / mask.sum().clamp(min=1))
    return gaps
