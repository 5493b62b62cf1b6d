"""Replay debugging and length control end to end (issue 28 items 5 and 6), each run a real `python -m launch`
process: Ray, embedded engines behind sgl-router, the megatron-core trainer. One deterministic run saves its
rollouts with the overlong punishment and truncation masking on; a train_only replay of them, with no engines,
reproduces its training exactly; a rollout_only run, with no trainer, generates and saves the same first step."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glue.metrics.logger import read_metrics
from glue.loop.replay import load_step, saved_steps
from glue.rewards.shaping import overlong_penalty
from glue.types import SampleStatus
from rollout_fns.toy_tasks import EchoTask

REPO = Path(__file__).resolve().parents[1]
STEPS, GROUPS, MAX_NEW_TOKENS, BUFFER = 2, 4, 4, 2  # demo.yaml samples 4 new tokens; the punishment starts after 2
TIMING = ("time/", "sync/", "async/", "fault/", "staleness/in_flight", "staleness/in_queue", "weights/lag",
          "rollout/failed_groups", "rollout/filtered_groups", "rollout/lost_samples", "rollout/resume_limit_drops")
SHAPED = [f"reward.overlong_buffer={BUFFER}", "loss.mask_truncated=true"]


def sluice(output_dir: Path, name: str, *extra: str, steps: int = STEPS) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/demo.yaml", f"run.output_dir={output_dir}",
               f"run.name={name}", f"run.num_steps={steps}", f"rollout.prompts_per_step={GROUPS}",
               "run.deterministic=true", "run.loggers=[jsonl]", *extra]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def started(done: subprocess.CompletedProcess) -> list[str]:
    """The start-up phases the run reported (model, ray, engines, router, trainer, weights)."""
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("sluice: ") and
            len(line.split()) > 3 and line.split()[3] == "s"]


def learning_record(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A deterministic 2-step run that saves its rollouts, with overlong shaping and truncation masking."""
    out = tmp_path_factory.mktemp("replay")
    done = sluice(out, "saved", "run.save_rollouts=true", *SHAPED)
    assert started(done) == ["model", "ray", "placement", "engines", "router", "trainer", "weights"]
    return out / "saved"


@pytest.mark.slow
@pytest.mark.long  # a whole run replayed and compared step by step (~70 s); the saved steps' contents stay in CI
def test_a_train_only_replay_of_a_deterministic_run_reproduces_its_training_with_no_engines(saved_run, tmp_path):
    done = sluice(tmp_path, "replay", "run.debug=train_only", f"run.replay_from={saved_run}", *SHAPED)
    assert started(done) == ["model", "ray", "placement", "trainer"]  # no engines, no router, no weight bridge
    # engines and the router write their logs there, the trainer rank its own only
    assert sorted(p.name for p in (tmp_path / "replay/logs").iterdir()) == ["trainer_0.log"]
    expected, got = read_metrics(saved_run / "metrics.jsonl"), read_metrics(tmp_path / "replay/metrics.jsonl")
    assert got[0]["train/loss"] == expected[0]["train/loss"]  # exactly: same batch, same initial weights
    assert [learning_record(r) for r in got] == [learning_record(r) for r in expected]
    assert (tmp_path / "replay/hf").is_dir()  # its checkpoints export the policy as a normal run's do


@pytest.mark.slow
@pytest.mark.long  # 26 s; the overlong punishment and truncation mask stay in CI through tests/test_length_control.py
def test_the_saved_rewards_carry_the_overlong_punishment_and_truncated_samples_carry_no_loss(saved_run, tmp_path):
    assert saved_steps(saved_run) == [1, 2]
    task, records = EchoTask(), read_metrics(saved_run / "metrics.jsonl")
    for step, record in zip((1, 2), records):
        groups, withheld = load_step(saved_run, step)
        samples = [s for g in groups for s in g.samples]
        assert len(groups) == GROUPS and not withheld and all(s.versions == [step - 1] * len(s.versions)
                                                            for s in samples)
        for s in samples:  # the task's own reward, then DAPO's punishment for the length worked out here
            punishment = overlong_penalty(len(s.response_tokens), max_len=MAX_NEW_TOKENS, buffer=BUFFER, penalty=1.0)
            assert s.reward == pytest.approx(task.reward(s) + punishment)
        punished = sum(len(s.response_tokens) > MAX_NEW_TOKENS - BUFFER for s in samples) / len(samples)
        truncated = sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples)
        assert 0 < punished and 0 < truncated < 1  # both fired, and some samples were trained on
        assert record["reward/overlong_penalized_frac"] == pytest.approx(punished)
        assert record["loss/truncated_masked_frac"] == pytest.approx(truncated)
    # the masking reaches the trainer: the same step-1 batch trained without it gives another loss
    unmasked = sluice(tmp_path, "unmasked", "run.debug=train_only", f"run.replay_from={saved_run}",
                      f"reward.overlong_buffer={BUFFER}", steps=1)
    assert "loss/truncated_masked_frac" not in read_metrics(tmp_path / "unmasked/metrics.jsonl")[0]
    assert read_metrics(tmp_path / "unmasked/metrics.jsonl")[0]["train/loss"] != records[0]["train/loss"], \
        unmasked.stdout[-1000:]


@pytest.mark.slow
@pytest.mark.long  # 26 s; the saved steps' contents stay in CI through test_saved_steps_come_back_whole_...
def test_a_rollout_only_run_generates_and_saves_its_steps_with_no_trainer(saved_run, tmp_path):
    done = sluice(tmp_path, "gen", "run.debug=rollout_only")
    assert started(done) == ["model", "ray", "placement", "engines", "router"]  # no trainer, no weight bridge
    records = read_metrics(tmp_path / "gen/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert not [k for r in records for k in r if k.startswith("train/")]
    assert not (tmp_path / "gen/checkpoints").exists() and not (tmp_path / "gen/hf").exists()
    assert saved_steps(tmp_path / "gen") == [1, 2]
    # step 1 is what the training run generated (same seeds, same initial weights); step 2 still comes from the
    # initial weights, since nothing trained
    mine, theirs = load_step(tmp_path / "gen", 1)[0], load_step(saved_run, 1)[0]
    assert [s.response_tokens for g in mine for s in g.samples] == [s.response_tokens for g in theirs
                                                                    for s in g.samples]
    assert {v for g in load_step(tmp_path / "gen", 2)[0] for s in g.samples for v in s.versions} == {0}
    assert json.loads((tmp_path / "gen/rollouts/step_00000002.json").read_text())["step"] == 2


def test_saved_steps_come_back_whole_with_routing_and_withheld_samples(tmp_path):
    import numpy as np

    from glue.loop.replay import save_step
    from glue.types import Group, Sample

    sample = Sample(prompt_tokens=[0, 5], group_id=3, index=1, reward={"score": 0.5, "correct": 1.0},
                    status=SampleStatus.TRUNCATED, metadata={"overlong_penalty": -0.5},
                    routed_experts=np.arange(2 * 2 * 2, dtype=np.int8).reshape(2, 2, 2))
    sample.append_response([7], [-0.25], version=4)
    save_step(tmp_path, 2, [Group(group_id=3, samples=[sample])], withheld={(3, 1)})
    groups, withheld = load_step(tmp_path, 2)
    back = groups[0].samples[0]
    assert withheld == {(3, 1)} and saved_steps(tmp_path) == [2]
    assert (back.response_tokens, back.rollout_logprobs, back.versions, back.loss_mask) == ([7], [-0.25], [4], [1])
    assert back.reward == sample.reward and back.status is SampleStatus.TRUNCATED and back.metadata == sample.metadata
    assert np.array_equal(back.routed_experts, sample.routed_experts) and back.routed_experts.dtype == np.int8


def test_a_replay_needs_every_step_it_trains_saved_and_refuses_its_own_folder(tmp_path):
    from glue.loop.replay import save_step
    from glue.types import Group, Sample
    from launch.config import ConfigError, load_config
    from launch.run.runner import check_replay

    source = tmp_path / "source"
    for step in (1, 2):
        save_step(source, step, [Group(group_id=0, samples=[Sample(prompt_tokens=[0], reward=0.0)])], set())
    cfg = load_config("examples/configs/demo.yaml", [f"run.output_dir={tmp_path}", "run.name=r",
                                                     "run.debug=train_only", f"run.replay_from={source}",
                                                     "run.num_steps=3"])
    with pytest.raises(ConfigError, match=r"holds steps 1-2 in rollouts/ but this run trains steps 1-3"):
        check_replay(cfg)
    own = load_config("examples/configs/demo.yaml", [f"run.output_dir={tmp_path}", "run.name=source",
                                                     "run.debug=train_only", f"run.replay_from={source}",
                                                     "run.num_steps=2"])
    with pytest.raises(ConfigError, match="this run's own folder"):
        check_replay(own)


@pytest.mark.parametrize("overrides, message", [
    (["run.debug=train_only"], "run.debug=train_only needs run.replay_from"),
    (["run.replay_from=runs/demo"], "run.replay_from is read only with run.debug=train_only"),
    (["run.debug=replay"], r"run.debug must be one of \['off', 'rollout_only', 'train_only'\]"),
    (["run.debug=train_only", "run.replay_from=runs/demo", "eval.interval=5"], "eval.interval=5 needs engines"),
    (["run.debug=rollout_only", "run.resume=runs/demo/checkpoints/step_00000002"], "does not resume"),
])
def test_bad_replay_settings_are_refused_naming_the_key(overrides, message):
    from launch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config("examples/configs/demo.yaml", overrides)


def test_the_docs_example_config_saves_deterministic_rollouts():
    from launch.config import load_config

    cfg = load_config("examples/configs/replay_debug.yaml")
    assert cfg.run.save_rollouts and cfg.run.deterministic and cfg.run.debug == "off"
    replay = load_config("examples/configs/replay_debug.yaml", ["run.debug=train_only",
                                                                "run.replay_from=runs/replay_debug"])
    assert replay.run.replay_from == "runs/replay_debug"
    assert "examples/configs/replay_debug.yaml" in (Path(REPO) / "docs/debugging.md").read_text()
