"""slime's long-lived rollout contract through a whole run: a fully-async rollout function in slime's
`--rollout-function-path` form (tests/helpers/slime_fully_async.py: a background worker with its own event loop
pulling groups from the data source and generating them with `generate_and_rm_group`, a queue of finished groups kept
across calls) trains on the tiny Qwen2 with its tokenizer (embedded engines behind the real sgl-router, megatron on
gloo), is called once per step, and the run stops on its own at its last step, or on SIGINT, with no thread of the
function left behind."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from glue.loop.replay import load_step
from glue.rollout.slime import shim
from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run
from rollout_fns.arith_data import write_arith_jsonl

FUNCTION = "helpers.slime_fully_async.generate_rollout_fully_async"  # slime's dotted form


def fully_async_config(tmp_path, num_steps: int):
    data = write_arith_jsonl(tmp_path / "arith.jsonl", 64, seed=3)
    return load_config("examples/configs/demo.yaml", [
        f"run.output_dir={tmp_path}", "run.name=fully_async", f"run.num_steps={num_steps}", "run.mode=async",
        "run.save_rollouts=true", "model.tiny.tokenizer=true", "model.tiny.vocab_size=272",
        "rollout.task=rollout_fns.text_data:TextDataTask", f"rollout.task_args.path={data}",
        "rollout.task_args.prompt_key=prompt", "rollout.task_args.label_key=answer",
        f"rollout.slime.rollout_function={FUNCTION}", "reward.slime.function=helpers.slime_fully_async.reward_func",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=6",
        "rollout.num_engines=1"])


def forget_earlier_runs() -> None:
    """The function's records start empty (a run earlier in this process imported its module: it is not imported
    here first, so that the run's loader sees the exit hook it registers)."""
    module = sys.modules.get("helpers.slime_fully_async")
    for records in () if module is None else (module.CALLS, module.STARTED, module.GIVEN_BACK, module.ERRORS,
                                              module.REWARDS):
        records.clear()


def left_behind() -> list[str]:
    names = ("fully-async-worker", "slime-rollout-calls", "slime-async-loop")
    return [t.name for t in threading.enumerate() if t.name in names]


def check_calls_and_samples(run_dir, records, module) -> None:
    assert all(r["rollout/failed"] == 0 and r["rollout/num_samples"] == 8 for r in records), records
    ids = [rollout_id for rollout_id, _ in module.CALLS]
    assert ids == list(range(len(ids))) and len(ids) >= len(records), module.CALLS  # one call per step's groups
    assert module.STARTED == [0] and module.ERRORS == []  # one worker for the whole run
    assert len(module.REWARDS) >= 8 * len(records) and all(r["label"] for r in module.REWARDS)
    for step in range(1, len(records) + 1):
        groups, _ = load_step(run_dir, step)
        for sample in (s for g in groups for s in g.samples):
            assert len(sample.versions) == len(sample.response_tokens) == len(sample.loss_mask) > 0
            assert "unrecorded_version_tokens" not in sample.metadata  # generate stamps each answer's version
            assert 0 <= step - 1 - min(sample.versions) <= 1, (step, sample.versions)
            text = sample.metadata["response_text"]
            assert sample.reward == pytest.approx(sum(c.isdigit() for c in text) / max(1, len(text))
                                                  + float(sample.metadata["label"] in text))


@pytest.mark.slow
def test_a_fully_async_worker_function_trains_two_steps_and_the_run_ends_with_no_thread_left(tmp_path):
    shim.install()  # generate_and_rm scores through slime.rollout.rm_hub's async_rm (args.custom_rm_path)
    forget_earlier_runs()
    run_dir = run(fully_async_config(tmp_path, num_steps=2))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and [r["weights/version"] for r in records] == [1, 2]
    import helpers.slime_fully_async as module  # imported by the run, through its path

    check_calls_and_samples(run_dir, records, module)
    assert left_behind() == []


@pytest.mark.slow
@pytest.mark.long  # a second whole run: the one above stays in make test
def test_sigint_stops_a_fully_async_worker_function_s_run_after_its_step_with_no_thread_left(tmp_path):
    shim.install()
    forget_earlier_runs()
    metrics = tmp_path / "fully_async" / "metrics.jsonl"

    def interrupt_after_the_first_step() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_the_first_step, daemon=True).start()
    run_dir = run(fully_async_config(tmp_path, num_steps=20))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert 1 <= len(records) < 20 and (run_dir / "checkpoints").is_dir()
    import helpers.slime_fully_async as module

    check_calls_and_samples(run_dir, records, module)
    assert left_behind() == []
