"""The data that crosses every seam: a rollout produces `Sample`s, groups of them get advantages,
and a `TrainBatch` of padded tensors goes to the trainer."""
from __future__ import annotations

import base64
import dataclasses
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

    `routed_experts` (MoE routing replay, R3; None unless `rollout.return_routed_experts`): a numpy int8 array (int16
    when the model has more than 127 experts) `[len(prompt_tokens) + len(response_tokens) - 1, num_layers, top_k]`:
    row t holds the experts each decoder layer routed token t (prompt and response) to, in the engine forward that
    ran it, i.e. the one that sampled token t + 1; -1 in layers without experts. The last token has no row: it was
    never run. A partial rollout resumed after a sync concatenates the resumed request's rows (its own weights)
    onto the ones it had (glue.rollout.routed_experts).
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
    routed_experts: Any = None  # np.ndarray int8/int16 [prompt + response - 1, layers, top_k], or None
    teacher_logprobs: list[float] = field(default_factory=list)  # on-policy distillation: the teacher's logprob of each response token (glue.rewards.teacher), else empty

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
        if self.teacher_logprobs and len(self.teacher_logprobs) != n:
            raise ValueError(f"sample {self.group_id}/{self.index}: teacher_logprobs has {len(self.teacher_logprobs)} "
                             f"entries but there are {n} response tokens")
        if self.routed_experts is not None:
            rows = len(self.prompt_tokens) + n - 1
            shape = getattr(self.routed_experts, "shape", ())
            if len(shape) != 3 or shape[0] != rows or self.routed_experts.dtype.kind != "i":
                raise ValueError(f"sample {self.group_id}/{self.index}: routed_experts must be an integer array "
                                 f"[{rows}, layers, top_k] (prompt + response - 1 rows), got shape {shape}")
        if self.status is not SampleStatus.FAILED and not math.isfinite(self.scalar_reward):
            raise ValueError(
                f"sample {self.group_id}/{self.index}: reward is {self.scalar_reward!r}; rewards must be finite numbers "
                "(mark the sample status=FAILED if the verifier could not score it)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (for checkpoints); `Sample.from_dict` reverses it."""
        from dataclasses import asdict

        routing = self.routed_experts
        plain = asdict(dataclasses.replace(self, routed_experts=None))
        if routing is not None:  # compact in a JSON checkpoint: base64 of the array's bytes
            plain["routed_experts"] = {"dtype": routing.dtype.str, "shape": list(routing.shape),
                                       "data": base64.b64encode(routing.tobytes()).decode("ascii")}
        return {**plain, "status": self.status.value}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "Sample":
        import copy

        fields = copy.deepcopy(fields)  # the sample's lists grow as it is continued; the dict stays as it was
        routing = fields.get("routed_experts")
        if routing is not None:
            import numpy as np

            fields["routed_experts"] = np.frombuffer(base64.b64decode(routing["data"]), dtype=routing["dtype"]
                                                     ).reshape(routing["shape"]).copy()
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

    `routed_experts` (R3, None unless every sample carries routing): int8 / int16 `[B, T, L, K]` (L = the model's
    num_hidden_layers, K = num_experts_per_tok), aligned with `tokens`: `[b, t, l]` are the K experts layer l routed
    `tokens[b, t]` to when the engine ran it, i.e. in the forward that sampled `tokens[b, t + 1]` (prompt positions
    included: the trainer's forward runs them too). -1 marks what has no routing: padding (t >= seq_lens[b]), each
    row's last token (t = seq_lens[b] - 1, never run by the engine) and layers without experts. The -1 positions
    never influence a trained logprob (a token's routing reaches only itself and later tokens, and the last token
    predicts nothing), so a replay may fill them with any valid experts. For megatron-core's RouterReplay, the
    target of MoE layer l in a `[S, B]` (sequence-first) forward is
    `routed_experts[:, :, l].transpose(0, 1).reshape(-1, K).long()` with -1 entries replaced, split like the
    hidden states under sequence parallelism, in the order of the routers' creation (the layers of this stage).
    """

    tokens: Any  # LongTensor [B, T]
    logprob_mask: Any  # FloatTensor [B, T]: 1 where token t+1 is a trainable response token
    rollout_logprobs: Any  # FloatTensor [B, T]
    advantages: Any  # FloatTensor [B, T]
    versions: Any  # LongTensor [B, T]: policy version of token t+1 (-1 where masked)
    seq_lens: list[int]  # real (unpadded) length of each row
    rewards: list[float]
    routed_experts: Any = None  # int8/int16 Tensor [B, T, L, K] of experts per token and layer (-1: none), or None
    teacher_logprobs: Any = None  # FloatTensor [B, T]: the teacher's logprob of token t+1 (0 where masked), or None

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
            routed_experts=_routed_experts_tensor(samples, T),
            teacher_logprobs=_teacher_logprobs_tensor(samples, mask),
            tokens=tokens,
            logprob_mask=mask,
            rollout_logprobs=rollout_lp,
            advantages=adv,
            versions=versions,
            seq_lens=seq_lens,
            rewards=[s.scalar_reward for s in samples],
        )


def _teacher_logprobs_tensor(samples: list[Sample], mask: Any) -> Any:
    """`TrainBatch.teacher_logprobs` aligned like `rollout_logprobs` (0 where `mask` is 0); None when no sample was
    scored by a teacher."""
    import torch

    if not any(s.teacher_logprobs for s in samples):
        return None
    out = torch.zeros(mask.shape)
    for b, s in enumerate(samples):
        if len(s.teacher_logprobs) != len(s.response_tokens):
            raise ValueError(f"TrainBatch: sample {s.group_id}/{s.index} has {len(s.teacher_logprobs)} teacher "
                             f"logprobs for {len(s.response_tokens)} response tokens; every sample of a distillation "
                             "batch is scored by the teacher")
        p = len(s.prompt_tokens)
        out[b, p - 1: p - 1 + len(s.response_tokens)] = torch.tensor(s.teacher_logprobs, dtype=torch.float)
    return out * mask


def _routed_experts_tensor(samples: list[Sample], T: int) -> Any:
    """`TrainBatch.routed_experts` for `samples` padded to `T` positions; None when no sample carries routing."""
    import numpy as np
    import torch

    arrays = [s.routed_experts for s in samples]
    if all(a is None for a in arrays):
        return None
    if any(a is None for a in arrays) or len({(a.shape[1:], a.dtype) for a in arrays}) != 1:
        shapes = sorted({str(getattr(a, "shape", None)) for a in arrays})
        raise ValueError("TrainBatch: routed_experts must be present on every sample or none, with one "
                         f"[layers, top_k] shape and dtype; got shapes {shapes}")
    out = np.full((len(samples), T, *arrays[0].shape[1:]), -1, dtype=arrays[0].dtype)
    for b, a in enumerate(arrays):
        out[b, : len(a)] = a
    return torch.from_numpy(out)
