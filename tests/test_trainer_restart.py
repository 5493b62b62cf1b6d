"""A trainer rank dies mid-run: the trainer group is restarted from the newest checkpoint, in the run, and the
engines are brought to that checkpoint's weights; `run.max_restarts` bounds it. Here the repair's order and its
bounds, with the trainer, bridge and fleet recorded by doubles (a Ray trainer group takes 15-30 s to start on two
cores); the whole run, with a trainer rank's process SIGKILLed, is tests/test_trainer_restart_runs.py."""
import re

import pytest

from glue.fleet.fleet import ProcessDied
from glue.loop.checkpoint import Checkpoints
from glue.loop.controller import sync_weights
from glue.trainer.group import ray_death_reason
from launch.config import RunConfig
from launch.run.trainer_restart import INITIAL_STATE, TrainerRestarts

# What Ray 2.x says of an actor whose process was SIGKILLed (ActorDiedError, as a probe of it raised it)
RAY_SAYS = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerWorker\n\tactor_id: "
            "629f341cf3215f8ab0e2ef6401000000\n\tpid: 3263\n\tnamespace: ee495dcb-6535-4afc-ac6c-5ffc6cf991ac\n\tip: "
            "192.0.2.2\nThe actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
            "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
            "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was "
            "called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


class Trainer:
    def __init__(self, calls, dead):
        self.calls, self.dead, self.version = calls, dead, 7

    def dead_ranks(self):
        return dict(self.dead)

    def restart(self):
        self.calls.append("trainer.restart")
        self.version = 0


class TrainerThatCannotStart(Trainer):
    def restart(self):
        raise RuntimeError("no bundle left\nsecond line")


class TrainerDyingAsItStartsOnce(Trainer):
    """A restart whose new rank lands on a bundle of a lost node not yet marked dead: it dies at once, the first
    time."""

    def restart(self):
        super().restart()
        if self.calls.count("trainer.restart") == 1:
            raise ProcessDied("trainer rank 0 on node 10.0.0.2 died (The actor died unexpectedly before finishing "
                              "this task.)")


class Recorder:
    """Bridge, fleet and colocation in one: each call is written down in order."""

    def __init__(self, calls):
        self.calls = calls

    def reconnect(self, leave_out=()):
        self.calls.append("bridge.reconnect" + (f" leaving out {leave_out}" if leave_out else ""))

    def faulty_engines(self):
        return []

    def pause_generation(self, mode="retract"):
        self.calls.append(f"pause {mode}")

    def continue_generation(self):
        self.calls.append("continue")

    def sync(self, version):
        self.calls.append(f"sync {version}")

    def before_rollout(self):
        pass


def restarts(tmp_path, calls, *, dead=None, steps=(), **options):
    """A TrainerRestarts over doubles that write each call into `calls`; rank 1 is dead unless `dead` says which
    are; checkpoints written at `steps`."""
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    for step in steps:
        checkpoints.save(step, lambda folder: None, {"version": step, "groups_drawn": 4 * step})

    def restore(checkpoint):
        calls.append(f"restore {checkpoint.name if checkpoint else None}")
        return Checkpoints.read_state(checkpoint) if checkpoint else None

    recorder = Recorder(calls)
    return TrainerRestarts(trainer=Trainer(calls, {1: "it was killed"} if dead is None else dead), bridge=recorder,
                           fleet=recorder, colocation=recorder, nodes=["10.0.0.1", "10.0.0.2"], restore=restore,
                           checkpoints=checkpoints, **options)


def test_a_dead_rank_is_named_with_its_node_and_rays_reason_in_one_line(tmp_path):
    assert ray_death_reason(RAY_SAYS) == ("The actor is dead because its worker process has died. Worker exit type: "
                                    "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
                                    "error code 2. End of file. (pid 3263)")
    assert ray_death_reason("some other shape\nsecond line") == "some other shape"
    assert restarts(tmp_path, [], dead={}).died() is None
    r = restarts(tmp_path, [], dead={1: "gone", 0: "gone too"})
    assert r.died() == "trainer rank 0 on node 10.0.0.1 died (gone too)"  # the lowest rank speaks for the group


def test_the_group_restarts_from_the_newest_checkpoint_with_generation_paused_then_goes_on_from_its_state(
        tmp_path, capsys):
    calls = []
    r = restarts(tmp_path, calls, steps=(2, 4))
    death = r.died()
    state = r.restart(death)
    # generation paused first; the bridge's channels are rebuilt only once the new ranks are up; the restore (the
    # resume path) loads step 4 and brings the engines to it
    assert calls == ["pause abort", "trainer.restart", "bridge.reconnect", "restore step_00000004"]
    assert state["step"] == 4 and state["groups_drawn"] == 16
    line = capsys.readouterr().out.strip()
    assert line == ("sluice: trainer rank 1 on node 10.0.0.2 died (it was killed); restarting the trainer group from "
                    "checkpoint step 4 (restart 1 of 3)")
    first, second = r.metrics(), r.metrics()
    assert first["fault/trainer_restarts"] == 1.0 and 0 <= first["fault/trainer_recovery_s"] < 5
    assert second == {"fault/trainer_restarts": 1.0}  # the recovery is the first completed step's alone


def test_with_no_checkpoint_yet_the_run_starts_again_from_the_initial_model_and_the_engines_go_back_to_it(tmp_path):
    calls = []
    r = restarts(tmp_path, calls)
    state = r.restart(r.died())
    assert calls == ["pause abort", "trainer.restart", "bridge.reconnect", "restore None",
                     "pause retract", "sync 0", "continue"]  # the initial weights, version 0, to every engine
    assert state == INITIAL_STATE and state is not INITIAL_STATE


class EngineDiesDuringTheRestart(Recorder):
    """The watch, as a trainer restart sees it: engine 1 is dead from the start (the loop's abort pause fails on it),
    so the restore's sync fails until `repair_now` has replaced it."""

    def __init__(self, calls):
        super().__init__(calls)
        self.engine_dead = True

    def pause_generation(self, mode="retract"):
        super().pause_generation(mode)
        if self.engine_dead:
            raise ConnectionRefusedError("engine 1 refused the connection")

    def engine_fault_seen(self):
        return self.engine_dead

    def faulty_engines(self):
        return ["http://127.0.0.1:3"] if self.engine_dead else []

    def repair_now(self):
        self.calls.append("repair_now")
        replaced, self.engine_dead = int(self.engine_dead), False
        return replaced


def test_an_engine_that_dies_while_the_trainer_group_restarts_is_replaced_and_the_engines_are_brought_to_the_checkpoint(
        tmp_path):
    calls = []
    r = restarts(tmp_path, calls, steps=(2,))
    r.fleet = EngineDiesDuringTheRestart(calls)
    r.restore = lambda checkpoint: (calls.append("restore"), sync_weights(r.fleet, r.colocation, 2),
                                    Checkpoints.read_state(checkpoint))[-1]
    state = r.restart(r.died())
    # the abort pause failed on the dead engine and the restart went on; the new ranks' channels leave it out; the
    # restore's sync failed on it, the engine was replaced (with the new ranks' weights), and the restore went again
    assert calls == ["pause abort", "trainer.restart", "bridge.reconnect leaving out ['http://127.0.0.1:3']",
                     "restore", "pause retract", "repair_now", "restore", "pause retract", "sync 2", "continue"]
    assert state["step"] == 2
    other = restarts(tmp_path, [], steps=(2,))  # a failure that is no engine's fault ends the restart as before
    other.fleet = EngineDiesDuringTheRestart([])
    other.fleet.engine_dead = False
    other.restore = lambda checkpoint: (_ for _ in ()).throw(OSError("the checkpoint cannot be read"))
    with pytest.raises(ProcessDied, match=r"its restart failed: the checkpoint cannot be read"):
        other.restart(other.died())


def test_a_checkpoint_the_run_resumed_from_is_used_until_the_run_writes_its_own(tmp_path):
    calls = []
    elsewhere = Checkpoints(tmp_path / "other").save(6, lambda folder: None, {"version": 6})
    r = restarts(tmp_path, calls, started_from=elsewhere)
    assert r.restart(r.died())["step"] == 6


def test_restarts_past_run_max_restarts_or_in_colocated_placement_end_the_run_with_one_line(tmp_path):
    r = restarts(tmp_path, [], steps=(2,), max_restarts=1)
    r.restart(r.died())
    with pytest.raises(ProcessDied) as ended:
        r.restart(r.died())
    assert str(ended.value) == ("trainer rank 1 on node 10.0.0.2 died (it was killed) (run.max_restarts=1 restarts "
                                "used up)")
    calls = []
    colocated = restarts(tmp_path, calls, colocated=True)
    with pytest.raises(ProcessDied, match=re.escape("(colocated placement: the trainer group is not restarted")):
        colocated.restart(colocated.died())
    assert calls == []  # nothing was touched
    broken = restarts(tmp_path, [], steps=(2,))
    broken.trainer = TrainerThatCannotStart([], {1: "it was killed"})
    with pytest.raises(ProcessDied) as failed:
        broken.restart(broken.died())
    assert str(failed.value) == "trainer rank 1 on node 10.0.0.2 died (it was killed); its restart failed: no bundle left"
    with pytest.raises(ValueError, match="run.max_restarts must be >= 0"):
        RunConfig(max_restarts=-1)


@pytest.mark.long  # 8-22 s, Ray's start; a failed restart's one line stays in CI (the test above)
def test_trainer_ranks_whose_bundles_never_come_back_fail_the_start_within_its_deadline_naming_them(tmp_path):
    """A restart after a node is gone waits for the lost ranks' bundles; that wait is bounded, so the run ends with
    one line instead of hanging (a real local Ray; the ranks ask for a resource no node has)."""
    import os
    import time

    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from glue.trainer.config import TrainerConfig
    from glue.trainer.group import TrainerGroup
    from loss import LossConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as failed:
            TrainerGroup(str(tmp_path), TrainerConfig(), LossConfig(),
                         actor_options=[{"num_cpus": 0.5, "resources": {"a_node_that_is_gone": 1}}],
                         placement_timeout_s=2)
        assert time.monotonic() - started < 30  # the 2 s wait, and the actors' submission on a busy machine
        assert str(failed.value) == ("trainer ranks [0] did not start on their placement-group bundles within 2 s "
                                     "(is their node gone?)")
    finally:
        ray.shutdown()


def test_a_broadcast_whose_source_died_is_not_aborted_through_its_store_and_prints_no_stack_trace(capfd):
    """A trainer rank killed mid-sync takes the weight group's store (its rank 0 hosts it) with it: the transfer's
    abort has nobody left to tell, and torch would print a C++ stack trace for the store it cannot reach."""
    import socket

    from weight_sync.transports import BroadcastTransport

    with socket.socket() as sock:  # a port nothing listens on: the dead source's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = BroadcastTransport(None, [], backend="gloo", master_address=None, with_checksum=False, timeout_s=5)
    try:
        transport._addresses["sluice_weights_1_0"] = ("127.0.0.1", port)
        transport._abort("sluice_weights_1_0")
    finally:
        transport.close()
    out, err = capfd.readouterr()
    assert "frame #" not in out + err and "TCPStore" not in out + err


def test_a_new_rank_that_dies_as_it_starts_is_started_again_until_its_bundle_is_placed(tmp_path, capsys):
    calls = []
    r = restarts(tmp_path, calls, steps=(2,), retry_pause_s=0.0)
    r.trainer = TrainerDyingAsItStartsOnce(calls, {1: "it was killed"})
    state = r.restart(r.died())
    assert state["step"] == 2 and calls.count("trainer.restart") == 2
    assert "a restarted trainer rank died as it started (trainer rank 0 on node 10.0.0.2 died" in capsys.readouterr().out
    never = restarts(tmp_path, [], steps=(2,), retry_pause_s=0.05, start_timeout_s=0.2)
    never.trainer = TrainerDyingAsItStartsOnce([], {1: "it was killed"})
    never.trainer.restart = lambda: (_ for _ in ()).throw(ProcessDied("trainer rank 0 died (again)"))
    with pytest.raises(ProcessDied, match=r"its restart failed: trainer rank 0 died \(again\)"):
        never.restart(never.died())
