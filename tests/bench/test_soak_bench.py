"""`make soak`: one async run (R3 on, sync.max_staleness 2) on a Ray cluster the test starts (a head and a second
raylet), with a fault drawn every few steps (SOAK_GAP, 3-8 by default, from SOAK_SEED) among seven kinds, each at
least once: an engine SIGKILLed or SIGSTOPped, the router SIGKILLed, a trainer rank SIGKILLed, the second node lost
(its raylet's whole session SIGKILLed, then a fresh raylet started so the capacity comes back), the reward worker
processes SIGSTOPped, a checkpoint write that fails. No one restarts the run. What it trained is read back from its
own record, as `make chaos` does, beside a fault-free run of the same seed and steps on the same cluster. Writes
bench-results/soak.json. Not in `make test` (marker `soak`)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, free_port, is_alive
from helpers.ray_nodes import RayNode
from helpers.run_session import Session, logged_steps, trained_figures, wait_until

pytestmark = pytest.mark.soak

STEPS = int(os.environ.get("SOAK_STEPS", "200"))
GAP = tuple(int(n) for n in os.environ.get("SOAK_GAP", "3-8").split("-"))
DETERMINISTIC_STEPS = int(os.environ.get("SOAK_DETERMINISTIC_STEPS", "24"))  # 0: none; faults at steps 3, 6, .., 21
GROUPS, MAX_STALENESS, SAVE_INTERVAL = 4, 2, 4
ALL_KINDS = ("engine_kill", "engine_hang", "router_kill", "trainer_kill", "node_loss", "reward_hang", "checkpoint_fail")
KINDS = tuple(os.environ.get("SOAK_KINDS", ",".join(ALL_KINDS)).split(","))  # a subset: the others are not injected
assert set(KINDS) <= set(ALL_KINDS), f"SOAK_KINDS: {sorted(set(KINDS) - set(ALL_KINDS))} are not among {ALL_KINDS}"
HEAD_IP, WORKER_IP = "127.0.0.6", "127.0.0.7"
ROUTER = (b"sglang_router.launch_router", b"sglang::router")  # the router renames its process once started
OUT = REPO_ROOT / "bench-results" / "soak.json"
TRAINER_RESTARTED = "restarting the trainer group"
STEP_TIMEOUT_S = 420  # a hung engine costs the sync's 60 s pause timeout plus its repair; a lost node Ray's notice


def draw_schedule(rng: random.Random, steps: int, gap: tuple[int, int]) -> list[tuple[int, str]]:
    """(step, kind) pairs, a gap of `gap` steps apart (inclusive), none in the last two steps: every kind once in a
    shuffled order first, then kinds drawn at random. A checkpoint failure comes only where the checkpoint it blocks
    (the first one two steps on) is followed by a step to heal in: not in the last SAVE_INTERVAL + 2 steps."""
    first, at, step = list(KINDS), [], 0
    rng.shuffle(first)
    while (step := step + rng.randint(*gap)) <= steps - 2:
        fits = [k for k in KINDS if k != "checkpoint_fail" or step <= steps - SAVE_INTERVAL - 2] or list(KINDS)
        kind = next((k for k in first if k in fits), None) if first else rng.choice(fits)
        if kind is None:
            continue
        if first:
            first.remove(kind)
        at.append((step, kind))
    return at


def command(out_dir: Path, name: str, head: str, steps: int, faults: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The arithmetic text task (its reward, Math-Verify, runs in killable worker processes: the reward fault has a
    process to hang), tiny Qwen3-MoE with routing replay, async, attached to the test's cluster over two nodes.
    Every repair bound is above the faults drawn, so only a repair that fails ends the run."""
    bound = faults + 2
    return [sys.executable, "-m", "launch", "--config", "examples/configs/text_arith.yaml",
            f"run.output_dir={out_dir}", f"run.name={name}", f"run.num_steps={steps}", "run.mode=async",
            f"rollout.task_args.path={out_dir}/data/train.jsonl", "eval.interval=0", "eval.at_start=false",
            "model.tiny.family=qwen3_moe", "rollout.return_routed_experts=true", "trainer.routing_replay=true",
            f"rollout.prompts_per_step={GROUPS}", "rollout.samples_per_prompt=16", f"sync.max_staleness={MAX_STALENESS}",
            "sync.stale_policy=keep", "run.save_rollouts=true", f"run.save_interval={SAVE_INTERVAL}",
            "rollout.health_check_interval_s=1", "rollout.health_check_timeout_s=3", "sync.timeout_s=30",
            f"rollout.max_engine_restarts={bound}", f"rollout.max_router_restarts={bound}", f"run.max_restarts={bound}",
            f"run.max_checkpoint_failures={bound}",
            f"run.ray_address={head}", "cluster.num_nodes=2", f"cluster.node_ip={HEAD_IP}", *extra]


class Cluster:
    """A head with 1 CPU and a worker node with 2: the run's 3 one-CPU bundles are spread 1 + 2 (the driver's node
    sorts first and the engines take the first bundles), so the worker node holds engine 1 and the trainer rank and
    a node loss takes both. `replace_worker` kills the worker's whole session and starts a fresh one on the same
    address."""

    def __init__(self):
        port = free_port()
        self.address = f"{HEAD_IP}:{port}"
        self.head = RayNode(num_cpus=1, port=port, node_ip=HEAD_IP).up()
        self.nodes = [self.head]
        self.worker = self._join()

    def _join(self) -> RayNode:
        node = RayNode(num_cpus=2, head=self.address, node_ip=WORKER_IP)
        self.nodes.append(node)
        return node.up()

    def roots(self) -> tuple[int, ...]:
        return tuple(n.proc.pid for n in self.nodes if n.proc.poll() is None)

    def replace_worker(self) -> None:
        self.worker.die()
        self.worker = self._join()

    def stop(self) -> list[int]:
        return [pid for node in reversed(self.nodes) for pid in node.stop()]  # workers first, the head last


class Soak:
    """Injects the drawn faults into one running session and times each to the next completed step."""

    def __init__(self, session: Session, run_dir: Path, steps: int, cluster: Cluster, rng: random.Random):
        self.session, self.run_dir, self.steps, self.cluster, self.rng = session, run_dir, steps, cluster, rng
        self.placement = ""
        self.stopped: set[int] = set()
        self.recovery_s: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.notes: list[str] = []

    def inject(self, kind: str) -> None:
        getattr(self, kind)()

    def _lines(self) -> set[str]:
        path = self.run_dir / "metrics.jsonl"
        return set(path.read_text().splitlines()) if path.exists() else set()

    def _next_step(self, kind: str, since: float, before: set[str]) -> None:
        """Wait for a step record that was not in metrics.jsonl at the fault (a step trained again after a
        trainer restart has a record of its own), and note the seconds since `since`."""
        wait_until(lambda: bool(self._lines() - before), self.session, STEP_TIMEOUT_S, f"a step after {kind}")
        self.recovery_s[kind].append(round(time.monotonic() - since, 1))

    def _signal_one(self, kind: str, pids: list[int], sig: int, repaired_by: str) -> None:
        assert pids, f"{kind}: no process to signal"
        victim = self.rng.choice(pids)
        if sig == signal.SIGSTOP:
            self.stopped.add(victim)
        self._fault(kind, lambda: os.kill(victim, sig), [repaired_by])

    def _fault(self, kind: str, inject, repaired_by: list[str]) -> None:
        """Inject, then wait until each repair line (`repaired_by`) has come once more and a step has completed,
        timing the first step completed after the fault. A trainer restart takes the steps since its checkpoint
        back: its next step is one completed after the restart line."""
        counts = {line: self.session.count(line) for line in repaired_by}
        before, since, stepped_at = self._lines(), time.monotonic(), None
        inject()

        def is_healed() -> bool:
            nonlocal before, stepped_at
            waiting = [line for line, count in counts.items() if self.session.count(line) <= count]
            if TRAINER_RESTARTED in waiting:
                before = self._lines()
            elif stepped_at is None and self._lines() - before:
                stepped_at = time.monotonic()
            return not waiting and stepped_at is not None

        wait_until(is_healed, self.session, STEP_TIMEOUT_S, f"the repair ({', '.join(repaired_by)}) and a step "
                   f"after {kind}")
        self.recovery_s[kind].append(round(stepped_at - since, 1))

    def engine_kill(self) -> None:
        self._signal_one("engine_kill", self.session.engine_pids(self.cluster.roots()), signal.SIGKILL, "serves again")

    def engine_hang(self) -> None:
        self._signal_one("engine_hang", self.session.engine_pids(self.cluster.roots()), signal.SIGSTOP, "serves again")

    def router_kill(self) -> None:
        self._signal_one("router_kill", self.session.processes(ROUTER), signal.SIGKILL,
                         "router serves again")

    def trainer_kill(self) -> None:
        self._signal_one("trainer_kill", [trainer_pid(self.run_dir)], signal.SIGKILL, TRAINER_RESTARTED)

    def node_loss(self) -> None:
        """The worker node's whole session SIGKILLed and a fresh raylet started on its address: what it held (the
        run's placement line says) must be repaired in the run."""
        held = on_node(self.placement, WORKER_IP)
        assert held, f"node_loss: the run placed nothing on {WORKER_IP}: {self.placement}"
        repaired_by = [line for line, what in ((TRAINER_RESTARTED, "trainer rank"), ("serves again", "engine"))
                       if what in held]
        self._fault("node_loss", self.cluster.replace_worker, repaired_by)

    def reward_hang(self) -> None:
        """Every reward worker SIGSTOPped (a call goes to the most recently idle one: stopping one alone might meet
        no call); each must be killed by its call's deadline."""
        workers = self.session.processes((b"glue.rewards.isolated",))
        assert workers, "reward_hang: no reward worker process (python -m glue.rewards.isolated) below the run"
        before, since = self._lines(), time.monotonic()
        for pid in workers:
            self.stopped.add(pid)
            os.kill(pid, signal.SIGSTOP)
        self._next_step("reward_hang", since, before)
        with contextlib.suppress(RuntimeError):
            wait_until(lambda: not any(map(is_alive, workers)), self.session, 120, "the hung reward workers' ends")
        self.notes.append(f"reward_hang: {sum(not is_alive(p) for p in workers)} of {len(workers)} stopped reward "
                          "workers killed by their call's deadline")

    def checkpoint_fail(self) -> None:
        """A file where the next checkpoint's `.partial` folder must be made: its mkdir fails (an OSError, as a full
        disk gives). The file is removed once the run has said so, as freeing the disk would."""
        step = next_checkpoint(logged_steps(self.run_dir) + 2, self.steps)
        blocker = self.run_dir / "checkpoints" / f".step_{step:08d}.partial"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("in the way of the checkpoint's folder\n")
        said = f"checkpoint step_{step:08d} could not be written"
        try:
            wait_until(lambda: self.session.count(said), self.session, STEP_TIMEOUT_S, f"the failed write of {step}")
            before, since = self._lines(), time.monotonic()
            self._next_step("checkpoint_fail", since, before)
        finally:
            blocker.unlink(missing_ok=True)

    def continue_stopped(self) -> None:
        for pid in self.stopped:  # a hung process is SIGKILLed by the run; one still here is continued
            if is_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def next_checkpoint(after: int, steps: int) -> int:
    """The first checkpoint at or after step `after`: every SAVE_INTERVAL steps, and the last step."""
    return min(-(-after // SAVE_INTERVAL) * SAVE_INTERVAL, steps)


def on_node(placement: str, ip: str) -> str:
    """What the placement line (`sluice: placement ... 127.0.0.6: engine 0, engine 1; 127.0.0.7: trainer rank 0`)
    puts on node `ip`."""
    return placement.split(f"{ip}: ", 1)[1].split(";", 1)[0].strip() if f"{ip}: " in placement else ""


def trainer_pid(run_dir: Path) -> int:
    """The pid trainer rank 0 wrote last into its log (`sluice: trainer rank 0 of 1, pid P`; a restarted rank
    appends its own line)."""
    said = [line for line in (run_dir / "logs" / "trainer_0.log").read_text().splitlines()
            if line.startswith("sluice: trainer rank 0 of ")]
    return int(said[-1].rsplit("pid ", 1)[1])


def reward_curve(run_dir: Path) -> list[float]:
    from glue.metrics.logger import read_metrics

    return [round(r["rollout/reward_mean"], 4) for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 1]


def soak_run(out_dir: Path, name: str, cluster: Cluster, steps: int, schedule: list[tuple[int, str]], record: dict,
             extra: tuple[str, ...] = ()) -> None:
    """One run of `steps` steps with the faults of `schedule` injected in order (none: a fault-free run); its
    figures go into `record` as they come, so a run that fails still leaves what it did."""
    run_dir, rng = out_dir / name, random.Random(record["seed"])
    session = Session(command(out_dir, name, cluster.address, steps, len(schedule), extra), out_dir / f"{name}.log")
    soak, started = Soak(session, run_dir, steps, cluster, rng), time.monotonic()
    faults = record.setdefault("faults", dict.fromkeys(KINDS, 0)) if schedule else {}
    try:
        wait_until(lambda: session.count("sluice: placement"), session, 300, "the placement line")
        record["placement"] = soak.placement = next(line for line in session.lines if "sluice: placement" in line)
        for step, kind in schedule:
            wait_until(lambda: logged_steps(run_dir) >= step, session, STEP_TIMEOUT_S, f"step {step}")
            soak.inject(kind)
            faults[kind] += 1
        code = session.wait(timeout_s=STEP_TIMEOUT_S * 2)
        assert code == 0, f"exit {code}; last lines:\n" + "\n".join(session.lines[-15:])
    finally:
        soak.continue_stopped()
        if session.proc.poll() is None:
            session.kill()
        record.update(recovery_s={k: v for k, v in soak.recovery_s.items() if v} if schedule else {},
                      notes=soak.notes, engine_repairs=session.repairs(), wall_s=round(time.monotonic() - started, 1),
                      log=str(out_dir / f"{name}.log"), run_dir=str(run_dir))
        if (run_dir / "metrics.jsonl").exists():
            record.update(trained_figures(run_dir, groups=GROUPS, max_staleness=MAX_STALENESS),
                          reward_curve=reward_curve(run_dir))


def weights_differing(a: Path, b: Path) -> list[str]:
    """The tensors of two exported hf/ folders that are not equal bit for bit."""
    import torch
    from safetensors.torch import load_file

    def load(folder: Path) -> dict:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    x, y = load(a), load(b)
    assert x and x.keys() == y.keys(), f"{a} and {b} hold different tensors: {sorted(x.keys() ^ y.keys())[:5]}"
    return sorted(k for k in x if not torch.equal(x[k], y[k]))


@pytest.fixture(scope="module")
def soak_record(tmp_path_factory):
    """The draw (SOAK_SEED, or a fresh one), the cluster every run attaches to, and the figures, written to
    bench-results/soak.json once the runs are done, failed ones included."""
    seed = int(os.environ.get("SOAK_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    once = rng.sample(KINDS, len(KINDS))
    record = {"seed": seed, "runs": {}, "out": tmp_path_factory.mktemp("soak"),
              "schedule": draw_schedule(rng, STEPS, GAP),
              "deterministic_schedule": [(3 * (i + 1), kind) for i, kind in enumerate(once)]}
    cluster = Cluster()
    record["cluster"] = cluster
    try:
        yield record
    finally:
        left = cluster.stop()
        out = soak_json(record)
        out["ray_processes_left_after_stop"] = left
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))


def soak_json(record: dict) -> dict:
    runs = record["runs"]
    soak, free = runs.get("soak", {}), runs.get("fault_free", {})
    return {"seed": record["seed"], "steps_planned": STEPS, "fault_gap_steps": list(GAP), "kinds": list(KINDS),
            "fault_schedule": record["schedule"], "steps_completed": soak.get("steps_completed", 0),
            "faults": soak.get("faults", {}), "recovery_s": soak.get("recovery_s", {}),
            "groups_lost": soak.get("lost_groups"), "prompts_trained_twice": soak.get("repeated_groups"),
            "over_stale_tokens": soak.get("over_stale_tokens"), "version_mismatches": soak.get("version_mismatches"),
            "restarts_by_a_person": 0, "reward_curve": soak.get("reward_curve", []),
            "reward_curve_fault_free": free.get("reward_curve", []), "wall_s": soak.get("wall_s"),
            "wall_s_fault_free": free.get("wall_s"), "deterministic": record.get("deterministic", {}),
            "runs": {name: {k: v for k, v in run.items() if k not in ("reward_curve", "logged_steps")}
                     for name, run in runs.items()}}


def run_one(record: dict, name: str, steps: int, schedule: list, extra: tuple[str, ...] = ()) -> dict:
    run = record["runs"].setdefault(name, {"seed": record["seed"], "steps": steps})
    try:
        soak_run(record["out"], name, record["cluster"], steps, schedule, run, extra)
    except (AssertionError, RuntimeError) as err:
        run["error"] = str(err)[-2000:]
    return run


def assert_nothing_lost(run: dict, steps: int, seed: int) -> None:
    assert "error" not in run, f"SOAK_SEED={seed}: {run['error']}"
    assert run["steps_completed"] == steps and run["logged_steps"] == list(range(1, steps + 1)), run
    for key in ("lost_groups", "repeated_groups", "over_stale_tokens", "version_mismatches", "lost_samples"):
        assert run[key] == 0, f"SOAK_SEED={seed}: {key} = {run[key]}"
    assert run["routing_agreement_mean"] is not None and run["aborts_without_routing"] == 0, run


@pytest.mark.timeout(0)
def covers_every_kind(record: dict) -> None:
    """Fail before anything runs, not as a missing kind after the whole soak, when the draw is too short."""
    if len(record["schedule"]) < len(KINDS):
        pytest.fail(f"SOAK_STEPS={STEPS} with SOAK_GAP={GAP[0]}-{GAP[1]} drew {len(record['schedule'])} faults (seed "
                    f"{record['seed']}), fewer than the {len(KINDS)} kinds that must each come at least once: raise "
                    "SOAK_STEPS, narrow SOAK_GAP (e.g. 3-4) or pick kinds with SOAK_KINDS", pytrace=False)


def test_a_fault_free_run_of_the_same_seed_and_steps_finishes(soak_record):
    covers_every_kind(soak_record)
    assert_nothing_lost(run_one(soak_record, "fault_free", STEPS, []), STEPS, soak_record["seed"])


@pytest.mark.timeout(0)
def test_a_soak_run_heals_every_fault_in_the_run_and_loses_nothing(soak_record):
    covers_every_kind(soak_record)
    run = run_one(soak_record, "soak", STEPS, soak_record["schedule"])
    assert_nothing_lost(run, STEPS, soak_record["seed"])
    assert all(run["faults"][kind] >= 1 for kind in KINDS), run["faults"]


@pytest.mark.timeout(0)
@pytest.mark.skipif(not DETERMINISTIC_STEPS, reason="SOAK_DETERMINISTIC_STEPS=0")
def test_in_deterministic_mode_a_soak_ends_with_the_fault_free_runs_weights_bit_for_bit(soak_record):
    """One fault of each kind (the hung reward workers' judgements go again in fresh workers, so none is lost), in
    `run.deterministic` mode, against a fault-free deterministic run."""
    seed, extra = soak_record["seed"], ("run.deterministic=true",)
    free = run_one(soak_record, "deterministic_fault_free", DETERMINISTIC_STEPS, [], extra)
    healed = run_one(soak_record, "deterministic_soak", DETERMINISTIC_STEPS, soak_record["deterministic_schedule"],
                     extra)
    assert_nothing_lost(free, DETERMINISTIC_STEPS, seed)
    assert_nothing_lost(healed, DETERMINISTIC_STEPS, seed)
    differing = weights_differing(Path(free["run_dir"]) / "hf", Path(healed["run_dir"]) / "hf")
    soak_record["deterministic"] = {"steps": DETERMINISTIC_STEPS, "schedule": soak_record["deterministic_schedule"],
                                    "faults": healed["faults"], "tensors_differing": differing,
                                    "weights_bit_identical": not differing,
                                    "reward_curves_equal": free["reward_curve"] == healed["reward_curve"]}
    assert not differing, f"SOAK_SEED={seed}: {len(differing)} tensors differ, e.g. {differing[:3]}"
