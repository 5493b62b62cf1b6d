"""The rollout fleet for real: two embedded engine processes behind the real sgl-router, driven through
glue.fleet.engine_client; start-up failures and stop() are checked by pid."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import is_gone
from glue.fleet.engine_client import EngineClient, EngineHTTPError
from glue.fleet.fleet import RolloutFleet

SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}


def server_state(engine_url: str) -> dict:
    with urllib.request.urlopen(f"{engine_url}/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())["internal_states"][0]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    fleet = RolloutFleet(model_path=tiny_model_dir, num_engines=2, engine_args=["--num-threads", "1"],
                         log_dir=tmp_path_factory.mktemp("fleet_logs"), engine_startup_timeout_s=120, seed=0)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def client(fleet):
    return EngineClient(fleet.router_url, fleet.engine_urls)


def test_the_router_lists_both_engines_as_healthy_workers(fleet):
    assert len(fleet.engine_urls) == 2
    assert fleet.registered_workers() == {url: True for url in fleet.engine_urls}


def test_sixteen_concurrent_generates_through_the_router_all_succeed_and_both_engines_serve_some(fleet, client):
    before = [server_state(u)["forward_count"] for u in fleet.engine_urls]

    async def run():
        try:
            return await asyncio.gather(*(client.generate([0, 4, 5, 6, 7], SAMPLING) for _ in range(16)))
        finally:
            await client.aclose()

    outputs = asyncio.run(run())
    for out in outputs:
        assert len(out["output_ids"]) == SAMPLING["max_new_tokens"]
        logprobs = out["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in logprobs] == out["output_ids"]
        assert all(lp <= 0.0 for lp, _, _ in logprobs)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    after = [server_state(u)["forward_count"] for u in fleet.engine_urls]
    assert all(a > b for a, b in zip(after, before)), f"forward counts before {before}, after {after}"
    assert client.connect_retries == 0
    # independent samples: the router alternates the requests over the engines, and two engines sharing a seed drew
    # the same numbers for their k-th requests (these 16 answers came in repeated pairs); for 8 tokens of a random
    # 32-token model a repeat by chance is below 1e-8
    answers = [tuple(out["output_ids"]) for out in outputs]
    assert len(set(answers)) == len(answers), sorted(answers)


def test_paused_engines_hold_generates_until_continue(fleet, client):
    async def run():
        client.pause_generation()
        try:
            tasks = [asyncio.ensure_future(client.generate([0, 4, 5], SAMPLING)) for _ in range(4)]
            await asyncio.sleep(1.0)
            held = sum(t.done() for t in tasks)
            queued = sum(server_state(u)["num_waiting_reqs"] + server_state(u)["num_running_reqs"]
                         for u in fleet.engine_urls)
        finally:
            client.continue_generation()
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        await client.aclose()
        return held, queued, outputs

    held, queued, outputs = asyncio.run(run())
    assert held == 0
    assert queued == 4
    assert [len(o["output_ids"]) for o in outputs] == [8] * 4


def test_weight_versions_health_and_flush_reach_every_engine(client):
    assert client.weight_versions() == ["0", "0"]
    assert client.health() == [True, True]
    client.flush_cache()


def test_a_rejected_request_raises_with_the_status_and_the_engine_message(client):
    async def run():
        try:
            await client.generate([0, 999], SAMPLING)  # token 999 is outside the tiny model's vocabulary of 32
        finally:
            await client.aclose()

    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(run())
    assert err.value.status == 400
    assert "input_ids" in err.value.body


def test_stop_ends_every_process_group_and_can_be_called_twice(fleet):
    pids = fleet.pids
    assert len(pids) == 3 and not any(is_gone(p) for p in pids)
    fleet.stop()
    fleet.stop()
    assert all(is_gone(p) for p in pids)
    assert fleet.pids == [] and fleet.router_url is None


def test_an_engine_that_never_becomes_healthy_raises_timeout_naming_it_and_leaves_nothing(tmp_path):
    sleeper = [sys.executable, "-c", "import sys, time; print('loading', sys.argv[1:3], flush=True); time.sleep(600)"]
    fleet = RolloutFleet(model_path="/nonexistent", num_engines=2, engine_command=sleeper,
                         engine_startup_timeout_s=1.5, log_dir=tmp_path)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        fleet.start()
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert re.search(r"engine at http://127\.0\.0\.1:\d+ did not answer GET /health within "
                     r"engine_startup_timeout_s=1\.5 s", message)
    assert "loading ['--model-path', '/nonexistent']" in message  # the log tail
    assert 1.5 <= elapsed < 6.0
    assert len(fleet.started_pids) == 2 and all(is_gone(p) for p in fleet.started_pids)


def test_an_engine_that_exits_during_start_up_reports_its_exit_code_and_log(tmp_path):
    crasher = [sys.executable, "-c", "import sys; print('cannot load the model', flush=True); sys.exit(3)"]
    fleet = RolloutFleet(model_path="/nonexistent", num_engines=1, engine_command=crasher, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 during start-up.*cannot load the model"):
        fleet.start()
    assert all(is_gone(p) for p in fleet.started_pids)


DRIVER = """
import json, sys, time
from glue.fleet.fleet import RolloutFleet
fleet = RolloutFleet(model_path=sys.argv[1], num_engines=1, log_dir=sys.argv[2])
fleet.start()
print(json.dumps(fleet.pids), flush=True)
time.sleep(600)
"""


def test_a_driver_killed_with_sigkill_takes_its_engines_and_router_with_it(tiny_model_dir, tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, tiny_model_dir, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        pids = json.loads(driver.stdout.readline())
        assert len(pids) == 2 and not any(is_gone(p) for p in pids)
        driver.send_signal(signal.SIGKILL)  # no atexit, no finally: only the children's parent-death signal
        driver.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(is_gone(p) for p in pids)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def sglang_request_fields(class_name: str) -> set[str]:
    """Field names of a request class in the installed sglang's io_struct.py, read with ast (import needs a GPU)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (make install adds it with --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_the_client_sends_only_fields_sglang_defines():
    assert {"input_ids", "sampling_params", "return_logprob"} <= sglang_request_fields("GenerateReqInput")
    assert {"mode"} <= sglang_request_fields("PauseGenerationReqInput")


def test_a_chatty_process_log_rotates_instead_of_growing_without_bound(tmp_path):
    """The router writes a line per request; its log (like every process log the fleet keeps) stays bounded."""
    from glue.fleet.processes import RotatingLog

    log = RotatingLog(tmp_path / "router.log", max_bytes=10_000, backups=2)
    script = "import sys\nfor i in range(5000): print(f'request {i:05d} routed to worker', flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log.write_fd, stderr=subprocess.STDOUT)
    os.close(log.write_fd)
    assert proc.wait(timeout=60) == 0
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["router.log", "router.log.1", "router.log.2"]  # 5000 x 34 bytes written, 3 x ~10 kB kept
    assert all((tmp_path / f).stat().st_size < 10_000 + (1 << 16) for f in files)
    assert log.tail(1) == "request 04999 routed to worker"  # the newest line is in the live file
    assert (tmp_path / "router.log.2").read_text().startswith("request ")
