"""Every block of docs/*.md headed `file=NAME` runs as written: a doc's files are written to a folder of their own
(its `/tmp/...` paths and the engine / router addresses moved to this test's), each `run` script runs one rollout
step through the real sgl-router in front of an embedded engine (one fleet for all of them), and, in
`make test-long`, each config trains a step with `python -m launch --config NAME` started in that folder, as a user
runs it: the modules next to the config import from there, and run_info.json records them."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, is_gone
from helpers.engines import call

FENCE = re.compile(r"^```(\w+) file=(\S+)( run)?\n(.*?)^```$", re.M | re.S)
DEFAULT_ROUTER, DEFAULT_ENGINE = "http://127.0.0.1:30001", "http://127.0.0.1:30000"


@dataclass(frozen=True)
class Block:
    doc: str
    name: str
    lang: str
    runs: bool
    text: str


def doc_blocks() -> list[Block]:
    blocks = []
    for doc in sorted((REPO_ROOT / "docs").glob("*.md")):
        for lang, name, runs, text in FENCE.findall(doc.read_text()):
            blocks.append(Block(doc.name, name, lang, bool(runs), text))
    return blocks


BLOCKS = doc_blocks()
SCRIPTS = [b for b in BLOCKS if b.runs]
CONFIGS = [b for b in BLOCKS if b.lang == "yaml"]


def localise(text: str, folder: Path, model_dir: str, router: str, engine: str) -> str:
    """The block with the doc's fixed places replaced by this test's: nothing else is changed."""
    text = text.replace("/tmp/tiny_text", "\0model").replace("/tmp/", f"{folder}/").replace("\0model", model_dir)
    text = text.replace(DEFAULT_ROUTER, router).replace(DEFAULT_ENGINE, engine)
    assert "127.0.0.1:3000" not in text, "a doc example names an address the test cannot move"
    return text


def write_doc_files(doc: str, folder: Path, model_dir: str, router: str = "", engine: str = "") -> Path:
    """Every `file=` block of `doc` written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for block in BLOCKS:
        if block.doc == doc:
            (folder / block.name).write_text(localise(block.text, folder, model_dir, router, engine))
    return folder


@contextlib.contextmanager
def user_folder(folder: Path):
    """Run in `folder` as `python script.py` would: it is the working directory and first on the import path; the
    modules imported from it are forgotten afterwards (other docs have modules of the same name)."""
    before, cwd = set(sys.modules), os.getcwd()
    sys.path.insert(0, str(folder))
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path.remove(str(folder))
        for name in set(sys.modules) - before:
            if getattr(sys.modules[name], "__file__", "") and str(folder) in (sys.modules[name].__file__ or ""):
                del sys.modules[name]


@pytest.fixture(scope="module")
def fleet(text_model_dir, tmp_path_factory):
    """One embedded engine behind the real sgl-router, shared by every doc script."""
    from glue.fleet.fleet import RolloutFleet

    fleet = RolloutFleet(model_path=text_model_dir, num_engines=1, engine_args=["--num-threads", "1"],
                         log_dir=tmp_path_factory.mktemp("doc_fleet_logs"), engine_startup_timeout_s=120)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
    assert all(is_gone(p) for p in fleet.started_pids)


def test_the_docs_mark_an_example_of_each_kind():
    names = {b.name for b in BLOCKS}
    # a rollout function, a reward, an environment, an agent; a script and a config for each way to train
    assert {"my_rollout.py", "my_reward.py", "guess_env.py", "my_agent.py"} <= names, names
    assert {"one_step_text.py", "one_step_env.py", "one_step_agent.py"} <= {b.name for b in SCRIPTS}
    assert {"my_rollout.yaml", "text_data.yaml", "guess.yaml", "my_agent.yaml"} <= {b.name for b in CONFIGS}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda b: b.name)
def test_each_doc_script_runs_a_rollout_step_through_sgl_router(script, fleet, text_model_dir, tmp_path, capsys):
    folder = write_doc_files(script.doc, tmp_path / "work", text_model_dir, fleet.router_url, fleet.engine_urls[0])
    out = io.StringIO()
    with user_folder(folder), contextlib.redirect_stdout(out):
        runpy.run_path(str(folder / script.name), run_name="__main__")
    lines = out.getvalue().splitlines()
    # one line per sample, each opening with its group id: 2 prompts' groups, every sample printed
    groups = [int(line.split()[0]) for line in lines]
    assert len(set(groups)) == 2 and len(lines) >= 4, out.getvalue()
    assert "failed" not in capsys.readouterr().err  # no group failed (the manager says so on stderr)


@pytest.mark.slow
def test_the_doc_rollout_function_and_reward_score_a_step_through_sgl_router(fleet, text_model_dir, tmp_path):
    from glue.fleet.engine_client import EngineClient
    from glue.rollout.manager import RolloutManager
    from launch.run.tasks import check_task_args, task_args_for
    from rollout_fns.arith_data import write_arith_jsonl

    folder = write_doc_files("rollout_functions.md", tmp_path / "work", text_model_dir)
    rollout = yaml.safe_load((folder / "my_rollout.yaml").read_text())["rollout"]
    write_arith_jsonl(folder / "arith.jsonl", 20, seed=0)

    async def one_step():
        client = EngineClient(fleet.router_url, fleet.engine_urls)
        try:
            check_task_args(rollout["task"], rollout["task_args"], key="rollout.task_args")
            manager = RolloutManager(
                function_path=rollout["function"], task_path=rollout["task"],
                task_args=task_args_for(rollout["task"], rollout["task_args"], text_model_dir), client=client,
                sampling_params=rollout["sampling"], prompts_per_step=2, samples_per_prompt=3, seed=0)
            return await manager.generate_step(), manager.task
        finally:
            await client.aclose()

    import asyncio

    with user_folder(folder):
        groups, task = asyncio.run(one_step())
        from my_reward import last_number
    assert [len(g.samples) for g in groups] == [3, 3] and [g.error for g in groups] == [None, None], groups
    for group in groups:
        for s in group.samples:
            text = task.tokenizer.decode(s.response_tokens, skip_special_tokens=True)
            assert s.reward == last_number(text, s.metadata["label"], s, partial_credit=0.1)  # the doc's reward
            assert len(s.response_tokens) == len(s.rollout_logprobs) == len(s.versions) > 0


@pytest.mark.slow
def test_sgl_router_refuses_a_tool_message_without_the_id_of_the_call_it_answers(fleet):
    ask = [{"role": "user", "content": "What is 1+1?"}]
    call_ = {"id": "check-0", "type": "function", "function": {"name": "check", "arguments": "{}"}}
    answered = ask + [{"role": "assistant", "content": "2", "tool_calls": [call_]}]
    status, body = call(fleet.router_url, "/v1/chat/completions",
                        {"model": "policy", "max_tokens": 1, "messages": answered + [{"role": "tool", "content": "ok"}]})
    assert status == 400 and "tool_call_id" in json.dumps(body), (status, body)
    status, body = call(fleet.router_url, "/v1/chat/completions", {
        "model": "policy", "max_tokens": 1,
        "messages": answered + [{"role": "tool", "tool_call_id": "check-0", "content": "ok"}]})
    assert status == 200, body
    # the engine itself accepts the first as SGLang does (its schema has tool_call_id optional): the router refuses
    status, _ = call(fleet.engine_urls[0], "/v1/chat/completions",
                     {"model": "policy", "max_tokens": 1, "messages": answered + [{"role": "tool", "content": "ok"}]})
    assert status == 200


@pytest.mark.long
@pytest.mark.parametrize("config", CONFIGS, ids=lambda b: b.name)
def test_each_doc_config_trains_a_step_from_its_folder(config, text_model_dir, tmp_path):
    from rollout_fns.arith_data import write_arith_jsonl

    folder = write_doc_files(config.doc, tmp_path / "work", text_model_dir)
    write_arith_jsonl(folder / "arith.jsonl", 20, seed=0)
    run_name = yaml.safe_load((folder / config.name).read_text())["run"]["name"]
    # PYTHONPATH holds sluice alone: the doc's modules import because the run starts in their folder
    done = subprocess.run(
        [sys.executable, "-m", "launch", "--config", config.name, f"run.output_dir={folder}/runs", "run.num_steps=1",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.num_engines=1"],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = folder / "runs" / run_name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["rollout/failed_groups"] == 0, records
    info = json.loads((run_dir / "run_info.json").read_text())
    local = {path: m for path, m in info["code"].items() if m["file"].startswith(str(folder))}
    named = {b.name[:-3] for b in BLOCKS if b.doc == config.doc and b.name.endswith(".py")
             and f"{b.name[:-3]}:" in config.text}
    assert {Path(m["file"]).stem for m in local.values()} == named, info["code"]
    for module in local.values():
        assert (run_dir / module["copy"]).read_bytes() == Path(module["file"]).read_bytes()
