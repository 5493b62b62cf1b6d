"""A trainer rank dies mid-run: the trainer group is restarted from the newest checkpoint, in the run, and the
engines are brought to that checkpoint's weights; `run.max_restarts` bounds it. Here the repair's order and its
bounds, with the trainer, bridge and fleet recorded by doubles (a Ray trainer group takes 15-30 s to start on two
cores), and in colocated placement the devices' hand-over with the run's own `Colocated` and an engine's memory
routes over loopback HTTP; the whole run, with a trainer rank's process SIGKILLed, is
tests/test_trainer_restart_runs.py."""
import http.server
import json
import threading
from pathlib import Path

import pytest

from glue.fleet.fleet import ProcessDied
from glue.loop.checkpoint import Checkpoints
from glue.loop.colocation import Colocated
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

    def before_trainer_restart(self):  # disaggregated placement: nothing to hand over
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

    def engine_fault_seen(self, err=None):
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


def test_restarts_past_run_max_restarts_end_the_run_with_one_line(tmp_path):
    r = restarts(tmp_path, [], steps=(2,), max_restarts=1)
    r.restart(r.died())
    with pytest.raises(ProcessDied) as ended:
        r.restart(r.died())
    assert str(ended.value) == ("trainer rank 1 on node 10.0.0.2 died (it was killed) (run.max_restarts=1 restarts "
                                "used up)")
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


class ColocatedTrainer(Trainer):
    """Also loads a checkpoint and moves its training state off the devices and back (colocated placement)."""

    def load_checkpoint(self, directory):
        self.calls.append(f"trainer.load_checkpoint {Path(directory).name}")
        self.version = Checkpoints.read_state(Path(directory))["version"]
        return self.version

    def offload(self):
        self.calls.append("trainer.offload")
        return 0

    def onload(self):
        self.calls.append("trainer.onload")
        return 1


class SourceThatDies(Recorder):
    """The bridge whose source (the trainer) is gone: a sync fails once `dead` holds."""

    dead = False

    def sync(self, version):
        super().sync(version)
        if self.dead:
            raise ConnectionError("the weight source's rank is gone")


class EngineMemory:
    """An engine's memory routes over loopback HTTP, kept as SGLang's scheduler keeps them: each release and resume
    written into `calls`; resuming a tag the engine holds is refused (SGLang's offload_tags.remove raises), and so is
    releasing a tag twice (its weights release stashes the model's buffers, from memory already given up)."""

    def __init__(self, calls):
        self.calls, self.released = calls, set()
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                tags = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["tags"]
                action = self.path.strip("/").split("_")[0]  # release / resume
                engine.calls.append(f"engine {action} {','.join(tags)}")
                twice = set(tags) & engine.released if action == "release" else set(tags) - engine.released
                if twice:
                    return self.answer(500, {"error": f"{action} of {sorted(twice)} twice"})
                engine.released = engine.released | set(tags) if action == "release" else engine.released - set(tags)
                self.answer(200, None)

            def do_GET(self):  # /get_server_info: no weight bytes reported
                self.answer(200, {"internal_states": [{}]})

            def answer(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine_memory():
    engine = EngineMemory([])
    yield engine
    engine.close()


def colocated_run_in(phase, tmp_path, engine):
    """The run's Colocated over a recording trainer, bridge and fleet and one engine, brought to the phase a
    trainer rank dies in, with checkpoints 2 and 4 written; returns the colocation and its TrainerRestarts."""
    calls = engine.calls
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    for step in (2, 4):
        checkpoints.save(step, lambda folder: None, {"version": step, "groups_drawn": 4 * step})
    trainer, bridge = ColocatedTrainer(calls, {0: "it was killed"}), SourceThatDies(calls)
    colocation = Colocated(trainer=trainer, bridge=bridge, engine_urls=[engine.url], timeout_s=10)

    def restore(checkpoint):  # what launch.run.runner.restore does: load, then sync through the colocation
        sync_weights(bridge, colocation, trainer.load_checkpoint(str(checkpoint)))
        return Checkpoints.read_state(checkpoint)

    colocation.before_rollout()  # the engines generate, the trainer is offloaded
    if phase != "generating":
        colocation.before_train()  # the engines released, the trainer resident
    if phase == "between before_rollout's resumes":  # the sync after training meets the dead source
        colocation.sync(5)
        bridge.dead = True
        with pytest.raises(ConnectionError):
            colocation.before_rollout()  # the weights are back on the engines, the KV cache not
        bridge.dead = False
    calls.clear()
    return colocation, TrainerRestarts(trainer=trainer, bridge=bridge, fleet=bridge, colocation=colocation,
                                       nodes=["10.0.0.1"], restore=restore, checkpoints=checkpoints)


@pytest.mark.parametrize("phase, released_first", [
    ("generating", ["engine release kv_cache,weights"]),
    ("training", []),  # the engines hold nothing already
    ("between before_rollout's resumes", ["engine release weights"]),
])
def test_a_colocated_restart_frees_the_devices_before_the_new_ranks_and_gives_the_engines_the_checkpoints_weights(
        phase, released_first, tmp_path, engine_memory, capsys):
    colocation, r = colocated_run_in(phase, tmp_path, engine_memory)
    state = r.restart(r.died())
    assert state["step"] == 4
    # the engines give up what they still hold before the new ranks load onto the devices; after the checkpoint is
    # loaded they take their weights back, receive its version from the still-resident trainer, then the trainer
    # offloads and the engines take their KV cache back
    assert engine_memory.calls == ["pause abort", *released_first, "trainer.restart", "bridge.reconnect",
                                   "trainer.load_checkpoint step_00000004", "pause retract", "engine resume weights",
                                   "sync 4", "trainer.offload", "engine resume kv_cache", "continue"]
    assert engine_memory.released == set()
    assert (colocation._released, colocation._trainer_offloaded, colocation._version) == (set(), True, 4)
    engine_memory.calls.clear()  # the rebuilt loop's next step swaps the devices as any step does
    colocation.before_train()
    colocation.sync(5)
    colocation.before_rollout()
    assert engine_memory.calls == ["engine release kv_cache,weights", "trainer.onload", "engine resume weights",
                                   "sync 5", "trainer.offload", "engine resume kv_cache"]
    assert "restarting the trainer group from checkpoint step 4 (restart 1 of 3)" in capsys.readouterr().out
