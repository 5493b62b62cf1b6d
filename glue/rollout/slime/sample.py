"""slime's `Sample` as slime's rollout and reward functions see it (slime.utils.types.Sample: its fields, its nested
`Status`, `append_response_tokens`), what a whole-rollout function returns (slime.rollout.base_types'
`RolloutFnTrainOutput` / `RolloutFnEvalOutput`), and the two conversions at the seam: a sluice prompt into a slime
sample, and what a slime function returns back into sluice's `glue.types.Sample` with a policy version on every
response token.

`tokens` is the whole sequence (prompt then response) and `response_length` counts its response part, as in slime;
`loss_mask` and `rollout_log_probs` have one entry per response token. `token_versions` is sluice's own: the weight
version of each response token, filled by `append_response_tokens(meta_info=...)` and by the recorded /generate
answers (glue.rollout.slime.adapter); slime's `weight_versions` keeps one entry per answer, as slime does.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from glue.fleet.engine_client import weight_version_to_int
from glue.types import Sample as SluiceSample, SampleStatus

FINISH_TYPES = ("stop", "length", "abort")


@dataclass
class Sample:
    """One slime rollout sample (slime.utils.types.Sample's fields that rollout and reward functions use)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    token_versions: list[int] = field(default_factory=list)  # sluice: the weight version of each response token

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append response tokens as slime does: generated ones (`trainable`, with the engine's logprobs and
        `meta_info`) or tool / environment ones (loss_mask 0, logprob 0); `meta_info` also sets the status from its
        finish_reason and gives the new tokens their weight versions."""
        tokens = [int(t) for t in (tokens or [])]
        log_probs = None if log_probs is None else [float(p) for p in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:  # extended in place, as slime does: a function may hold on to these lists (retool does)
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
            if self.rollout_log_probs is None:
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        meta = meta_info or {}
        self._stamp_versions(before, len(tokens), meta, trainable)
        if update_terminal_info and "finish_reason" in meta:
            if "weight_version" in meta:
                self.weight_versions.append(meta["weight_version"])
            kind = meta["finish_reason"].get("type") if isinstance(meta["finish_reason"], dict) \
                else meta["finish_reason"]
            if kind in FINISH_TYPES:
                self.status = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED,
                               "abort": Sample.Status.ABORTED}[kind]

    def _stamp_versions(self, start: int, n: int, meta: dict, trainable: bool) -> None:
        """Versions of response tokens [start, start + n): the answer's when `meta` has them, else the last
        token's (tool output is appended at the version current when it is)."""
        del self.token_versions[start:]
        if trainable and (meta.get("weight_versions") or "weight_version" in meta):
            self.token_versions += versions_of(meta, n)
        elif self.token_versions:
            self.token_versions += [self.token_versions[-1]] * n


def versions_of(meta: dict, n: int) -> list[int]:
    """One version per token of an answer with `n` output tokens (SGLang's `weight_versions` spans, else its
    `weight_version`)."""
    spans = meta.get("weight_versions")
    if spans:
        versions = [weight_version_to_int(s["version"]) for s in spans for _ in range(int(s["start"]), int(s["end"]))]
        return versions[:n] + [versions[-1]] * (n - len(versions)) if versions else []
    return [weight_version_to_int(meta["weight_version"])] * n


def from_prompt(prompt: dict, *, text: str, group_id: int, index: int) -> Sample:
    """A fresh slime sample for one sluice prompt: `tokens` the prompt tokens, `prompt` its text, `label` the
    prompt's label, the other keys in `metadata`."""
    extras = {k: v for k, v in prompt.items() if k not in ("prompt_tokens", "label")}
    return Sample(group_index=group_id, index=index, prompt=text, tokens=list(prompt["prompt_tokens"]),
                  label=prompt.get("label"), metadata=extras)


def from_sluice(sample: SluiceSample, *, prompt_text: str, response_text: str) -> Sample:
    """A finished sluice sample as slime's reward functions read it."""
    status = Sample.Status(sample.status.value)
    return Sample(group_index=sample.group_id, index=sample.index, prompt=prompt_text,
                  tokens=sample.prompt_tokens + sample.response_tokens, response=response_text,
                  response_length=len(sample.response_tokens), label=sample.metadata.get("label"),
                  reward=sample.reward, loss_mask=list(sample.loss_mask),
                  rollout_log_probs=list(sample.rollout_logprobs), status=status,
                  metadata=dict(sample.metadata), token_versions=list(sample.versions))


def to_sluice(sample: Any, *, versions: list[int], group_id: int, index: int, where: str) -> SluiceSample:
    """What a slime generate function returned (this module's Sample or slime's own), as a sluice Sample whose
    response tokens carry `versions`. ValueError naming the field for a sample that does not line up."""
    tokens, n = list(sample.tokens or []), int(sample.response_length or 0)
    if not 0 <= n < len(tokens):
        raise ValueError(f"{where}: sample.response_length={n} but sample.tokens has {len(tokens)} entries; tokens "
                         "must hold the prompt and then the response_length response tokens")
    mask = [1] * n if sample.loss_mask is None else [int(m) for m in sample.loss_mask]
    logprobs = sample.rollout_log_probs
    if logprobs is None:
        raise ValueError(f"{where}: sample.rollout_log_probs is None; post /generate with \"return_logprob\": True "
                         "and keep the engine's logprob of every response token (0.0 for tool tokens)")
    for name, values in (("loss_mask", mask), ("rollout_log_probs", logprobs), ("versions", versions)):
        if len(values) != n:
            raise ValueError(f"{where}: sample.{name} has {len(values)} entries for response_length={n}")
    status = _status(sample, where)
    if getattr(sample, "remove_sample", False):
        mask = [0] * n  # slime: a removed sample stays in its group but adds nothing to the loss
    metadata = {**(sample.metadata if isinstance(sample.metadata, dict) else {})}
    metadata.update(response_text=sample.response, **({"label": sample.label} if sample.label is not None else {}))
    return SluiceSample(prompt_tokens=tokens[:len(tokens) - n], response_tokens=tokens[len(tokens) - n:],
                        loss_mask=mask, rollout_logprobs=[float(p) for p in logprobs], versions=list(versions),
                        reward=sample.reward, status=status, group_id=group_id, index=index, metadata=metadata)


def _status(sample: Any, where: str) -> SampleStatus:
    value = getattr(sample.status, "value", sample.status)
    if value == "pending":
        raise ValueError(f"{where}: the sample came back with status PENDING; set sample.status to COMPLETED, "
                         "TRUNCATED, ABORTED or FAILED (e.g. from the answer's meta_info.finish_reason)")
    try:
        return SampleStatus(value)
    except ValueError:
        raise ValueError(f"{where}: unknown sample.status {sample.status!r}; slime's Sample.Status has COMPLETED, "
                         "TRUNCATED, ABORTED and FAILED") from None


def checked_reward(reward: Any, where: str) -> float | dict:
    """A slime reward as sluice's: a finite number, or a dict with a finite "score"."""
    score = reward.get("score") if isinstance(reward, dict) else reward
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        keys = f" (its keys: {sorted(reward)})" if isinstance(reward, dict) else ""
        raise TypeError(f"{where} must return a finite number or a dict with a finite 'score', got "
                        f"{str(reward)[:200]}{keys}")
    return reward if isinstance(reward, dict) else float(reward)


@dataclass
class RolloutFnTrainOutput:
    """A whole-rollout function's training answer: its groups (and metrics, which sluice does not log)."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """A whole-rollout function's evaluation answer, by data set name (sluice evaluates per prompt instead)."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None
