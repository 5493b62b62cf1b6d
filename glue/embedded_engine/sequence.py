"""One request while the engine generates it (`Sequence`), the generator of its next token in deterministic mode, and
the error a request meets while the engine has released its memory."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from glue.embedded_engine.request_schema import GenerationRequest


class MemoryReleasedError(RuntimeError):
    """A request arrived while the engine has released memory it needs to generate."""

    def __init__(self, tags: list[str]):
        super().__init__(f"the engine has released its memory ({', '.join(tags)}) with /release_memory_occupation "
                         "and cannot generate; call /resume_memory_occupation first")


@dataclass(eq=False)
class Sequence:
    """One request while it is generated, and its result once `finish_reason` is set."""

    request: GenerationRequest
    on_done: Callable[["Sequence"], None]
    generator: torch.Generator
    seed: int = 0  # the request's sampling seed (SGLang's sampling_seed, or drawn from the engine's --seed)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # logprob_start_len's input logprobs, once prefilled
    versions: list[str] = field(default_factory=list)  # weight version that produced each output token
    routing: list[torch.Tensor] = field(default_factory=list)  # return_routed_experts: int32 [n, layers, top_k]
    # chunks, the routed experts of positions 0, 1, ... in order (routed_experts.RoutingRecorder.record)
    finish_reason: dict[str, Any] | None = None
    final_version: str = ""  # the engine's weight version when the request finished
    abort_requested: bool = False
    aborted_in_queue: bool = False  # aborted from the waiting queue (never admitted, or retracted), not mid-batch
    retraction_count: int = 0  # times a "retract" pause took it out of the running batch
    created_at: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0

    @property
    def routed_len(self) -> int:
        """Positions whose routed experts are recorded (0 unless the request asked for them)."""
        return sum(chunk.shape[0] for chunk in self.routing)

    @property
    def context_ids(self) -> list[int]:
        """What a prefill runs over: the prompt, plus the output so far for a request retracted mid-generation."""
        return self.request.input_ids + self.output_ids


def position_generator(seq: Sequence) -> torch.Generator:
    """The generator for the next token of `seq` in deterministic mode: seeded by the request's seed and the
    token's position in the sequence, so a continued request draws what the uninterrupted one would have."""
    position = len(seq.request.input_ids) + len(seq.output_ids)
    return torch.Generator().manual_seed((seq.seed * 1_000_003 + position) % (2**63 - 1))
