"""The staleness gate: pure bookkeeping of policy versions that decides when a new group may start, when weights
move, and which finished groups a train step takes. The async loop asks it; nothing here waits or does I/O.

Versions count train steps: `v_train` is the version the trainer holds (0 = the initial weights, +1 per
train step), `v_engine` the version every engine holds after the last sync. A group admitted while the engines
hold `v` has tokens of version >= v, so it is at most `max_staleness` behind if it is trained by step
`v + max_staleness`: its *deadline*. Two rules keep every trained token within the bound:
- admission: the g-th group (counting from 0, groups that will never be trained given back) may start only if
  `g < (max_staleness + v_engine + 1) * groups_per_step` (AReaL's capacity form, with the engines' version);
  then at most `(k + 1) * groups_per_step` groups have a deadline <= k, so they all fit in steps 0..k;
- deadlines are kept: train step j takes finished groups such that every untrained group (finished or still
  generating) still fits into a step by its deadline: at most (k - j) x groups_per_step of them may be due by
  k after this step, for every k (Hall's condition). Admission keeps this satisfiable; earliest deadlines
  first satisfies it whenever any choice does; while it cannot yet (a group that is needed is still
  generating) the step waits. The remaining places go by `buffer_order` (`glue.loop.buffer`).
`mode: sync` is `max_staleness = 0`: exactly one step's groups per version, trained before the next sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StalePolicy = Literal["drop", "keep"]


@dataclass(kw_only=True)
class StalenessGate:
    groups_per_step: int  # groups one train step consumes (rollout.prompts_per_step)
    max_staleness: int  # versions a trained token may lag the trainer (0 = on-policy)
    interval: int = 1  # sync once the trainer is this many versions ahead of the engines
    admission: bool = True  # off: start groups without limit (the stale policy then decides)
    v_train: int = 0
    v_engine: int = 0
    admitted: int = 0  # groups admitted that will be trained (given-back ones subtracted)
    dropped_stale: int = 0  # samples withheld from training for being too stale (run total)
    syncs: int = 0

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.max_staleness < 0:
            raise ValueError(f"sync.max_staleness must be >= 0, got {self.max_staleness}")
        if not 1 <= self.interval <= self.max_staleness + 1:
            raise ValueError(
                f"sync.interval={self.interval} must be in [1, max_staleness + 1 = {self.max_staleness + 1}]: "
                "after max_staleness + 1 train steps without a sync nothing more may be admitted and the trainer "
                "would wait forever; raise sync.max_staleness or lower sync.interval")

    # ---- admission ----
    @property
    def capacity(self) -> int:
        """How many more groups may start now without any of them ending up trained beyond the bound."""
        if not self.admission:
            return 1 << 30
        return (self.max_staleness + self.v_engine + 1) * self.groups_per_step - self.admitted

    def can_admit(self) -> bool:
        return self.capacity > 0

    def admit(self) -> int:
        """Count one started group; returns its deadline (the last train step whose version keeps it in bounds)."""
        assert self.can_admit(), "StalenessGate.admit() called without capacity"
        self.admitted += 1
        return self.v_engine + self.max_staleness

    def give_back(self, groups: int = 1) -> None:
        """Groups that were admitted but will never be trained (failed, dropped) free their places."""
        self.admitted -= groups

    # ---- training and syncing ----
    def trained(self, version: int) -> None:
        """The trainer finished a step and now holds `version`."""
        if version != self.v_train + 1:
            raise AssertionError(f"trainer version went {self.v_train} -> {version}; expected +1 per train step")
        self.v_train = version

    def should_sync(self) -> bool:
        """Sync once the trainer is `interval` versions ahead of the engines."""
        return self.v_train - self.v_engine >= self.interval

    def synced(self, version: int) -> None:
        """Every engine now holds `version`."""
        self.v_engine = version
        self.syncs += 1

    @property
    def lag(self) -> int:
        """weights/lag: versions the engines are behind the trainer."""
        return self.v_train - self.v_engine

    # ---- what a train step sees ----
    def token_staleness(self, versions: list[int]) -> list[int]:
        """Staleness of each token if trained now."""
        return [self.v_train - v for v in versions]

    def is_too_stale(self, versions: list[int]) -> bool:
        return bool(versions) and self.v_train - min(versions) > self.max_staleness


@dataclass
class StalenessStats:
    """Token staleness of one train step's batch: max, mean and a histogram `staleness/hist_<s>`."""

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, staleness: list[int]) -> None:
        for s in staleness:
            self.counts[s] = self.counts.get(s, 0) + 1

    def metrics(self) -> dict[str, float]:
        total = sum(self.counts.values())
        if not total:
            return {"staleness/max": 0.0, "staleness/mean": 0.0}
        out = {"staleness/max": float(max(self.counts)),
               "staleness/mean": sum(s * n for s, n in self.counts.items()) / total}
        out.update({f"staleness/hist_{s}": n / total for s, n in sorted(self.counts.items())})
        return out
