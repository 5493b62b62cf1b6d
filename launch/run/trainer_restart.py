"""A trainer rank that dies mid-run (its process, or its Ray actor) is repaired in the run, as a resume in the same
process: generation paused, every rank of the trainer group killed and started again on its own placement-group
bundle (in colocated placement the engines release their memory first: the new ranks start resident), the newest
checkpoint loaded into it and the engines brought to that checkpoint's weights (the resume path,
`launch.run.runner.restore`), and the loop rebuilt from the checkpoint's driver state (cursor, finished groups,
groups in flight with their partial samples) exactly as a resumed run rebuilds it. Engines, router and Ray stay up;
an engine that dies or hangs while the group restarts (the fleet watch is not running then) is replaced here, with
the new ranks' weights, and the engines are brought to the checkpoint again. `run.max_restarts` bounds it; past that
the run ends with one line."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from glue.fleet.fleet import ProcessDied, first_line
from glue.fleet.placing import start_until_placed
from glue.loop.checkpoint import Checkpoints
from glue.loop.controller import sync_weights

# The driver state of a restart from the initial model (no checkpoint yet): step 0, nothing drawn, nothing waiting.
INITIAL_STATE = {"step": 0, "version": 0, "groups_drawn": 0, "finished": [], "reissue": [], "admitted": {},
                 "partial": {}}


class TrainerRestarts:
    """`died()` says whether a trainer rank is gone; `restart(death)` repairs the trainer group and returns the driver
    state the loop goes on from. `trainer`: the group (`restart`, `dead_ranks`, `version`); `bridge`: the weight bridge
    (`reconnect`); `fleet`: what pauses and continues generation (the fleet watch); `colocation`: who holds the
    devices (glue.loop.colocation: `before_trainer_restart`, and the restore's sync); `nodes[rank]`: where each rank
    runs; `restore(checkpoint)`: loads a checkpoint into the trainer, brings the engines to it, cuts the metrics
    record back to its step and returns its driver state (None: the initial model, the record cleared);
    `checkpoints`: the run's; `started_from`: the checkpoint the run resumed from, used while the run has written
    none of its own."""

    def __init__(self, *, trainer: Any, bridge: Any, fleet: Any, colocation: Any, nodes: Sequence[str],
                 restore: Callable[[Path | None], dict | None], checkpoints: Checkpoints,
                 started_from: Path | None = None, max_restarts: int = 3, pause_mode: str = "retract",
                 start_timeout_s: float | None = 300.0, retry_pause_s: float = 10.0):
        self.trainer, self.bridge, self.fleet, self.colocation = trainer, bridge, fleet, colocation
        self.nodes, self.restore, self.checkpoints, self.started_from = list(nodes), restore, checkpoints, started_from
        self.max_restarts, self.pause_mode = max_restarts, pause_mode
        # a new rank that dies as it starts (its bundle still on a lost node Ray has not yet marked dead) is started
        # again every retry_pause_s, until start_timeout_s after the restart began
        self.start_timeout_s, self.retry_pause_s = start_timeout_s, retry_pause_s
        self.restarts = 0
        self.recovery_s: list[float] = []  # seconds from each death seen to the next completed step
        self._seen_at: float | None = None  # when the death the next completed step is timed from was seen

    def died(self) -> str | None:
        """`trainer rank R on node N died (<Ray's reason>); its log: …` for the first rank that is gone (the line
        a dead rank ends a run with, glue.trainer.group.TrainerGroup.death_line), or None."""
        dead = self.trainer.dead_ranks()
        if not dead:
            return None
        rank = min(dead)
        logs = getattr(self.trainer, "logs", None) or []
        log = f"; its log: {logs[rank]}" if rank < len(logs) and logs[rank] is not None else ""
        return f"trainer rank {rank} on node {self.nodes[rank]} died ({dead[rank]}){log}"

    def restart(self, death: str) -> dict:
        """Blocking (run it in a worker thread). Raises ProcessDied with `death` when no restart is left."""
        self._seen_at = time.monotonic()
        if self.restarts >= self.max_restarts:
            raise ProcessDied(f"{death} (run.max_restarts={self.max_restarts} restarts used up)")
        self.restarts += 1
        checkpoint = self.checkpoints.latest() or self.started_from
        origin = (f"checkpoint step {Checkpoints.read_state(checkpoint)['step']}" if checkpoint is not None else
                  "the initial model (step 0: no checkpoint yet)")
        print(f"sluice: {death}; restarting the trainer group from {origin} (restart {self.restarts} of "
              f"{self.max_restarts})", flush=True)
        try:
            return self._restart_from(checkpoint)
        except Exception as err:
            raise ProcessDied(f"{death}; its restart failed: {first_line(err)}") from err

    def _restart_from(self, checkpoint: Path | None) -> dict:
        try:  # the loop's groups are cancelled: their requests are handed back now
            self.fleet.pause_generation("abort")
        except Exception as err:
            if not self.fleet.engine_fault_seen(err):
                raise  # an engine that died or hangs holds no request: it is replaced once the trainer is back
        self.colocation.before_trainer_restart()  # colocated: the engines free the devices the new ranks load onto
        self._start_again()
        self.bridge.reconnect(leave_out=self.fleet.faulty_engines())  # one on a lost node went with the ranks
        while True:  # the watch does not run meanwhile: an engine that died or hangs is replaced here
            try:
                return self._restore(checkpoint)
            except Exception:
                if not self.fleet.repair_now():  # bounded by rollout.max_engine_restarts (it raises past them)
                    raise

    def _restore(self, checkpoint: Path | None) -> dict:
        """The new ranks loaded with `checkpoint` and the engines brought to its weights; its driver state."""
        state = self.restore(checkpoint)
        if state is None:  # the new ranks hold the initial model: the engines go back to it too
            sync_weights(self.fleet, self.colocation, self.trainer.version, self.pause_mode)
            state = dict(INITIAL_STATE)
        return state

    def _start_again(self) -> None:
        """`trainer.restart()`, again while a new rank dies as it starts (its bundle still on a lost node that Ray
        has not yet marked dead: glue.fleet.placing)."""
        start_until_placed(self.trainer.restart, dies=(ProcessDied,), what="a restarted trainer rank",
                           timeout_s=self.start_timeout_s, pause_s=self.retry_pause_s)

    def metrics(self) -> dict[str, float]:
        """For each step's record: restarts so far, and on the first step completed after a restart the seconds
        since its death was seen (`fault/trainer_recovery_s`)."""
        out = {"fault/trainer_restarts": float(self.restarts)}
        if self._seen_at is not None:
            self.recovery_s.append(time.monotonic() - self._seen_at)
            self._seen_at = None
            out["fault/trainer_recovery_s"] = self.recovery_s[-1]
        return out
