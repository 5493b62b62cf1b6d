"""Host copies of one trainer rank's parameter shard for the last few policy versions, so the old logprobs of a
token can be computed with the exact weights that generated it (`trainer.old_logprobs: snapshot`). Memory stays
bounded because the staleness gate bounds how old a trained token can be.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from glue.types import TrainBatch


class PolicySnapshots:
    """Version -> {parameter name: host tensor} for the newest `keep` versions saved (oldest dropped first)."""

    def __init__(self, keep: int):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep_versions must be an integer >= 1 (the launcher passes sync.max_staleness + 1), "
                             f"got {keep!r}")
        self.keep = keep
        self._shards: dict[int, dict[str, torch.Tensor]] = {}

    def save(self, version: int, module: torch.nn.Module) -> None:
        """Copy `module`'s parameters (this rank's shard) to host memory as `version`; drop the oldest beyond `keep`."""
        self._shards[version] = {name: _host_copy(p) for name, p in module.named_parameters()}
        while len(self._shards) > self.keep:
            self._shards.pop(min(self._shards))

    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        return sorted(self._shards)

    def nbytes(self) -> int:
        """Host bytes the snapshots hold."""
        return sum(t.untyped_storage().nbytes() for shard in self._shards.values() for t in shard.values())

    @contextlib.contextmanager
    def load_into(self, version: int, module: torch.nn.Module) -> Iterator[None]:
        """Point `module`'s parameters at `version`'s weights for the duration of the block, then back at the live
        tensors. The live tensors are set aside, never written, so they come back bit-exact and the optimizer (keyed
        by the Parameter objects) sees no change; the cost is a second device copy of the shard during the block."""
        if version not in self._shards:
            raise KeyError(f"policy version {version} is not kept (kept: {self.versions()})")
        shard = self._shards[version]
        params = dict(module.named_parameters())
        if set(params) != set(shard):
            raise ValueError(f"the snapshot of version {version} does not match the module's parameters")
        live = {name: p.data for name, p in params.items()}
        try:
            for name, p in params.items():
                # read-only during the block (no-grad forwards), so on a CPU device the host copy is used in place
                p.data = shard[name].to(live[name].device, non_blocking=True)
            yield
        finally:
            for name, p in params.items():
                p.data = live[name]

    def old_logprobs(self, batch: TrainBatch, module: torch.nn.Module, current_version: int,
                     logprobs_of: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Each trained token's logprob under its own version's weights, [B, T] (0 where logprob_mask is 0), and the
        `old_logprobs/*` metrics. One pass (`logprobs_of(tokens, seq_lens=..., routed_experts=...)` under `module`'s
        present weights; routing replayed where the batch carries the engines' routing) per version held, over the
        rows with tokens of that version; `module`'s live weights serve `current_version` and, counted as missing,
        versions no longer held (possible only after a fault or with admission control off)."""
        valid = batch.logprob_mask > 0
        versions = batch.versions.long()
        kept = set(self._shards)
        # every rank holds the whole batch, so every rank walks the same sorted list: each forward is a collective
        present = sorted(set(versions[valid].tolist()))
        old = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        on_live = valid.clone()
        for version in present:
            if version != current_version and version in kept:
                take = valid & (versions == version)
                with self.load_into(version, module):
                    _fill(old, take, batch, logprobs_of)
                on_live &= ~take
        if on_live.any():
            _fill(old, on_live, batch, logprobs_of)
        return old, {
            "old_logprobs/missing_version_tokens": float((on_live & (versions != current_version)).sum()),
            "old_logprobs/versions_used": float(sum(v == current_version or v in kept for v in present)),
            "old_logprobs/snapshot_bytes": float(self.nbytes()),
        }


def _fill(out: torch.Tensor, take: torch.Tensor, batch: TrainBatch, logprobs_of: Callable[..., torch.Tensor]) -> None:
    """out[take] = logprobs_of(the rows holding a `take` token, with their lengths); the other rows do not run."""
    rows = take.any(dim=1).nonzero()[:, 0]
    seq_lens = [batch.seq_lens[r] for r in rows.tolist()]
    routed = None if batch.routed_experts is None else batch.routed_experts[rows]  # replayed with trainer R3 on
    out[rows] = torch.where(take[rows], logprobs_of(batch.tokens[rows], seq_lens=seq_lens, routed_experts=routed),
                            out[rows])


def _host_copy(param: torch.Tensor) -> torch.Tensor:
    """A host tensor with its own storage (also when the parameter already lives on the CPU); pinned when copied
    from a GPU so loading it back is an asynchronous DMA."""
    host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=param.is_cuda)
    host.copy_(param.detach())
    return host


def pre_update_metrics(batch: TrainBatch, old_logprobs: torch.Tensor | None, entropy: torch.Tensor | None
                       ) -> dict[str, float]:
    """Token means over the trained tokens of |old - rollout logprob| (the train-inference discrepancy, when old
    logprobs were computed) and of the current weights' entropy before the update (when it was computed)."""
    mask = batch.logprob_mask.float()
    num_tokens = mask.sum().clamp(min=1)
    metrics = {}
    if old_logprobs is not None:
        diff = (old_logprobs - batch.rollout_logprobs.float()).abs()
        metrics["train/train_rollout_logprob_abs_diff"] = float((diff * mask).sum() / num_tokens)
    if entropy is not None:
        metrics["train/entropy"] = float((entropy * mask).sum() / num_tokens)
    return metrics
