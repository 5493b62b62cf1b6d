"""`make chaos`: an async run, R3 off and on, in which at random steps an engine is SIGKILLed, an engine is SIGSTOPped
(hung) and the whole run is SIGTERMed and then resumed by the same command. What the run trained is read back from
its own record (metrics.jsonl and the saved rollouts, run.save_rollouts), not from what it says about itself:
nothing lost, no token trained beyond sync.max_staleness, every step's weights version equal to its step. Writes
bench-results/chaos.json (`{"seed": ..., "runs": [...]}`). Not in `make test` (marker `chaos`)."""
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

from conftest import REPO_ROOT, is_alive
from helpers.run_session import Session, logged_steps, trained_figures, wait_until

pytestmark = pytest.mark.chaos

STEPS, GROUPS, MAX_STALENESS = 14, 4, 2
RUNS = {"r3_off": [],
        "r3_on": ["model.tiny.family=qwen3_moe", "rollout.return_routed_experts=true", "trainer.routing_replay=true"]}
FAULTS = ("engine_kill", "engine_hang", "run_sigterm")
OUT = REPO_ROOT / "bench-results" / "chaos.json"


def command(out_dir: Path, name: str, extra: list[str]) -> list[str]:
    """The run: demo_async (slow-tool echo task, 2 engines, broadcast sync), small and quick to repair. stale_policy
    keep: an over-stale sample is trained, so it shows in the saved rollouts instead of being withheld."""
    return [sys.executable, "-m", "launch", "--config", "examples/configs/demo_async.yaml", f"run.output_dir={out_dir}",
            f"run.name={name}", f"run.num_steps={STEPS}", f"rollout.prompts_per_step={GROUPS}",
            "rollout.sampling.max_new_tokens=32", f"sync.max_staleness={MAX_STALENESS}", "sync.stale_policy=keep",
            "run.save_rollouts=true", "run.save_interval=4", "rollout.health_check_interval_s=1",
            "rollout.health_check_timeout_s=3", "rollout.max_engine_restarts=4", "sync.timeout_s=30", *extra]


def inject(fault: str, session: Session, rng: random.Random, stopped: set[int]) -> Session | None:
    """Inject `fault` into the running `session` and wait until the run has dealt with it: an engine fault until a
    replacement serves, a SIGTERM until the run stopped with exit 0. Returns the resumed session for a SIGTERM."""
    if fault == "run_sigterm":
        session.proc.send_signal(signal.SIGTERM)
        code = session.wait(timeout_s=180)
        assert code == 0 and session.count("sluice: stopped at step"), \
            f"SIGTERM: exit {code}, last lines:\n" + "\n".join(session.lines[-15:])
        return None
    engines = session.engine_pids()
    assert len(engines) == 2, f"expected 2 engine processes below the run, found {engines}"
    victim, repaired = rng.choice(engines), session.count("serves again")
    if fault == "engine_kill":
        os.kill(victim, signal.SIGKILL)
    else:
        stopped.add(victim)
        os.kill(victim, signal.SIGSTOP)
    wait_until(lambda: session.count("serves again") > repaired, session, 180, f"repair after {fault}")
    return None


def chaos_run(tmp_path: Path, name: str, extra: list[str], rng: random.Random, injected: dict) -> dict:
    """One run with each fault once, at random distinct steps (in the order of their steps); returns its figures.
    `injected` holds the draw and the faults injected so far, also when the run fails."""
    argv, run_dir, log = command(tmp_path, name, extra), tmp_path / name, tmp_path / f"{name}.log"
    at = dict(zip(FAULTS, rng.sample(range(2, STEPS - 3), len(FAULTS))))
    faults, stopped, repairs = dict.fromkeys(FAULTS, 0), set(), []
    injected.update(fault_steps=at, faults=faults)
    session = Session(argv, log)
    started = time.monotonic()
    try:
        for fault in sorted(FAULTS, key=at.get):
            wait_until(lambda: logged_steps(run_dir) >= at[fault], session, 300, f"step {at[fault]}")
            inject(fault, session, rng, stopped)
            faults[fault] += 1
            if fault == "run_sigterm":
                repairs += session.repairs()
                session = Session(argv, log)  # the same command resumes it
                wait_until(lambda: session.count("sluice: resuming from"), session, 180, "the resume")
        code = session.wait(timeout_s=300)
        assert code == 0, f"exit {code}; last lines:\n" + "\n".join(session.lines[-15:])
        repairs += session.repairs()
    finally:
        for pid in stopped:  # a hung engine is SIGKILLed by the watch; one that is still here is continued
            if is_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        if session.proc.poll() is None:
            session.kill()
    return {"name": name, "r3": bool(extra), "steps": STEPS, "max_staleness": MAX_STALENESS,
            "fault_steps": at, "faults": faults, "engine_repairs": repairs,
            **figures(run_dir), "wall_s": round(time.monotonic() - started, 1)}


def figures(run_dir: Path) -> dict:
    return trained_figures(run_dir, groups=GROUPS, max_staleness=MAX_STALENESS)


@pytest.fixture(scope="module")
def chaos_record():
    """The draw (CHAOS_SEED, or a fresh one) and the runs' figures, written to bench-results/chaos.json once every
    run is done, failed ones included."""
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 100_000))
    record = {"seed": seed, "runs": [], "rng": random.Random(seed)}
    yield record
    out = {"seed": seed, "runs": record["runs"]}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


@pytest.mark.parametrize("name", list(RUNS))  # one test per run: each stays within pytest.ini's 600 s
def test_a_chaos_run_loses_nothing_trains_nothing_over_stale_and_labels_every_version(tmp_path, name, chaos_record):
    seed, extra, injected = chaos_record["seed"], RUNS[name], {}
    try:
        run = chaos_run(tmp_path, name, extra, chaos_record["rng"], injected)
    except (AssertionError, RuntimeError) as err:
        read = figures(tmp_path / name) if (tmp_path / name / "metrics.jsonl").exists() else {}
        run = {"name": name, "r3": bool(extra), "steps": STEPS, **injected, "error": str(err)[-2000:],
               "log": str(tmp_path / f"{name}.log"), **read}
    chaos_record["runs"].append(run)
    assert "error" not in run, f"{name} (CHAOS_SEED={seed}): {run['error']}"
    assert all(n >= 1 for n in run["faults"].values()), run["faults"]
    assert run["steps_completed"] == run["steps"] and run["logged_steps"] == list(range(1, STEPS + 1)), run
    for key in ("lost_groups", "repeated_groups", "over_stale_tokens", "version_mismatches", "lost_samples"):
        assert run[key] == 0, f"{name} (CHAOS_SEED={seed}): {key} = {run[key]}"
    if run["r3"]:  # routing replay really ran: the trainer compared its routing with the engines'
        assert run["routing_agreement_mean"] is not None and run["aborts_without_routing"] == 0, run
