"""The data that crosses every seam: a rollout produces `Sample`s, groups of them get advantages,
and a `TrainBatch` of padded tensors goes to the trainer."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the engine stopped on a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # generation was aborted (e.g. around a weight sync); may be resumed
    FAILED = "failed"  # the rollout function or environment failed; never trained on


@dataclass(kw_only=True)
class Sample:
    """One prompt and one response, everything the trainer needs about it.

    `response_tokens`, `loss_mask`, `rollout_logprobs` and `versions` all have one entry per response token.
    `versions[i]` is the policy version that produced response token i (a partial rollout resumed after a
    sync carries more than one version); tokens the policy did not produce (tool output) still get the
    version current when they were appended, and loss_mask 0.
    """

    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.COMPLETED
    group_id: int = 0
    index: int = 0  # position within the group
    metadata: dict[str, Any] = field(default_factory=dict)

    def append_response(self, tokens: list[int], logprobs: list[float], version: int, trainable: bool = True) -> None:
        """Append tokens produced (trainable) or injected (tool / env output) at one policy version."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"append_response: {len(tokens)} tokens but {len(logprobs)} logprobs")
        self.response_tokens.extend(tokens)
        self.rollout_logprobs.extend(logprobs)
        self.versions.extend([version] * len(tokens))
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))

    @property
    def scalar_reward(self) -> float:
        """The reward the advantage estimator sees: the scalar, or the dict's "score" entry."""
        if isinstance(self.reward, dict):
            if "score" not in self.reward:
                raise ValueError(f"sample {self.group_id}/{self.index}: a dict reward needs a 'score' key, got {sorted(self.reward)}")
            return float(self.reward["score"])
        if self.reward is None:
            raise ValueError(f"sample {self.group_id}/{self.index} has no reward: the rollout function must set one")
        return float(self.reward)

    def validate(self) -> None:
        """Check the per-token lists line up and the reward is a finite number; raise ValueError naming the field."""
        n = len(self.response_tokens)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"sample {self.group_id}/{self.index}: {name} has {len(getattr(self, name))} entries "
                    f"but there are {n} response tokens"
                )
        if self.status is not SampleStatus.FAILED and not math.isfinite(self.scalar_reward):
            raise ValueError(
                f"sample {self.group_id}/{self.index}: reward is {self.scalar_reward!r}; rewards must be finite numbers "
                "(mark the sample status=FAILED if the verifier could not score it)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (for checkpoints); `Sample.from_dict` reverses it."""
        from dataclasses import asdict

        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "Sample":
        import copy

        fields = copy.deepcopy(fields)  # the sample's lists grow as it is continued; the dict stays as it was
        return cls(**{**fields, "status": SampleStatus(fields["status"])})

    def staleness(self, current_version: int) -> int:
        """How many versions behind `current_version` the oldest token of this sample is."""
        return current_version - min(self.versions) if self.versions else 0


@dataclass(kw_only=True)
class Group:
    """The samples drawn for one prompt (GRPO's group); advantages are computed within it."""

    group_id: int
    samples: list[Sample]
    error: str | None = None  # why the rollout function failed for this group (its samples are then FAILED)
    lost: bool = False  # failed because the fleet could not serve it (engines gone), not because of the task

    @property
    def rewards(self) -> list[float]:
        return [s.scalar_reward for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "samples": [s.to_dict() for s in self.samples], "error": self.error,
                "lost": self.lost}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "Group":
        return cls(**{**fields, "samples": [Sample.from_dict(s) for s in fields["samples"]]})


@dataclass(kw_only=True)
class TrainBatch:
    """Right-padded tensors for the trainer, all `[B, T]` over the full sequence (prompt + response).

    Position t of `logprob_mask` / `rollout_logprobs` / `advantages` refers to predicting token t+1
    from tokens <= t, so the trainer's logprob at position t lines up with `tokens[:, t + 1]`.
    """

    tokens: Any  # LongTensor [B, T]
    logprob_mask: Any  # FloatTensor [B, T]: 1 where token t+1 is a trainable response token
    rollout_logprobs: Any  # FloatTensor [B, T]
    advantages: Any  # FloatTensor [B, T]
    versions: Any  # LongTensor [B, T]: policy version of token t+1 (-1 where masked)
    seq_lens: list[int]  # real (unpadded) length of each row
    rewards: list[float]

    @classmethod
    def from_samples(cls, samples: list[Sample], advantages: list[float] | Any) -> "TrainBatch":
        """Pack samples and their per-sample (or per-token `[B, T_resp]`) advantages into right-padded tensors."""
        import torch

        seq_lens = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
        B, T = len(samples), max(seq_lens)
        tokens = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T)
        rollout_lp = torch.zeros(B, T)
        adv = torch.zeros(B, T)
        versions = torch.full((B, T), -1, dtype=torch.long)
        for b, s in enumerate(samples):
            p, r = len(s.prompt_tokens), len(s.response_tokens)
            tokens[b, : p + r] = torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long)
            span = slice(p - 1, p - 1 + r)  # positions that predict the response tokens
            mask[b, span] = torch.tensor(s.loss_mask, dtype=torch.float)
            rollout_lp[b, span] = torch.tensor(s.rollout_logprobs, dtype=torch.float)
            versions[b, span] = torch.tensor(s.versions, dtype=torch.long)
            a = advantages[b]
            adv[b, span] = torch.as_tensor(a, dtype=torch.float) if not isinstance(a, (int, float)) else float(a)
        versions[mask == 0] = -1
        return cls(
            tokens=tokens,
            logprob_mask=mask,
            rollout_logprobs=rollout_lp,
            advantages=adv,
            versions=versions,
            seq_lens=seq_lens,
            rewards=[s.scalar_reward for s in samples],
        )
