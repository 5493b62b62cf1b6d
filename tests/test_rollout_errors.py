"""Errors from user code point at the line: a verifier that raises costs its sample (reward.on_error fail_sample)
and the group trains on the rest; the first failure of each kind is printed with its traceback and the user's
file:line, repeats collapse into counts, every one goes to rollout_errors.log; fail_group fails the whole group as
before; empty responses are counted and warned once. The rollout functions here build their samples themselves (an
environment-only rollout), so no engine is needed: what is under test is the manager around the user's code."""
import asyncio
import json
import re
from pathlib import Path

import pytest

from glue.loop.batch import build_train_batch, rollout_metrics
from glue.rewards.config import RewardConfig
from glue.rollout.errors import RolloutErrors, user_frame
from glue.rollout.manager import RolloutManager, score
from glue.types import Sample, SampleStatus
from loss import LossConfig
from helpers.managers import NumberedPrompts

HERE = Path(__file__).resolve()
RAISE_LINE = next(i for i, line in enumerate(HERE.read_text().splitlines(), 1) if line.endswith("# the verifier bug"))


class BuggyVerifierTask(NumberedPrompts):
    """Prompts [0, n]; the reward is the first response token, except that sample 1 of every group raises."""

    def reward(self, sample):
        if sample.index == 1:
            raise RuntimeError(f"verifier bug on sample {sample.group_id}/{sample.index}")  # the verifier bug
        return float(sample.response_tokens[0])


async def scripted_group(ctx, prompt, num_samples):
    """Sample i answers [i % 2, 7] (or nothing for an index in prompt["empty"]) and is scored by the task."""
    samples = []
    for i in range(num_samples):
        sample = Sample(prompt_tokens=list(prompt["prompt_tokens"]), group_id=ctx.group_id, index=i)
        if i not in prompt.get("empty", ()):
            sample.append_response([i % 2, 7], [-0.5, -0.5], version=0)
        await score(ctx, sample)
        samples.append(sample)
    return samples


class EmptyAnswersTask(BuggyVerifierTask):
    """Samples 0 and 2 answer nothing; every reward is 0.5."""

    def prompts(self, seed):
        for prompt in super().prompts(seed):
            yield {**prompt, "empty": [0, 2]}

    def reward(self, sample):
        return 0.5


def manager(tmp_path, *, task="BuggyVerifierTask", samples=3, groups=1, on_error="fail_sample", echo=None):
    errors = RolloutErrors(tmp_path / "logs" / "rollout_errors.log", echo=echo or (lambda line: None))
    return RolloutManager(function_path="test_rollout_errors:scripted_group", task_path=f"test_rollout_errors:{task}",
                          client=None, sampling_params={}, prompts_per_step=groups, samples_per_prompt=samples,
                          seed=0, reward_on_error=on_error, errors=errors)


def test_a_verifier_that_raises_on_one_sample_fails_that_sample_and_its_group_trains_on_the_rest(tmp_path):
    [group] = asyncio.run(manager(tmp_path).generate_step())
    assert group.error is None
    assert [s.status for s in group.samples] == [SampleStatus.COMPLETED,
                                                 SampleStatus.FAILED, SampleStatus.COMPLETED]
    assert "RuntimeError: verifier bug on sample 0/1" in group.samples[1].metadata["error"]
    batch, _ = build_train_batch([group], LossConfig(normalize_std=False))
    # samples 0 and 2 answer [0, 7] and rewards 0.0 and 0.0 -> a flat group; the failed one is not in the batch
    assert batch.tokens.tolist() == [[0, 1, 0, 7], [0, 1, 0, 7]] and batch.rewards == [0.0, 0.0]
    metrics = rollout_metrics([group])
    assert metrics["rollout/reward_errors"] == 1.0 and metrics["rollout/failed"] == 1.0


def test_the_rest_of_a_group_gets_advantages_among_themselves(tmp_path):
    [group] = asyncio.run(manager(tmp_path, samples=4).generate_step())
    # samples 0, 2, 3 answer [0, 7], [0, 7], [1, 7]: rewards 0, 0, 1, mean 1/3 -> advantages -1/3, -1/3, +2/3
    batch, _ = build_train_batch([group], LossConfig(normalize_std=False))
    assert batch.rewards == [0.0, 0.0, 1.0]
    assert batch.advantages[:, 2].tolist() == pytest.approx([-1 / 3, -1 / 3, 2 / 3])


def test_the_log_has_every_failure_with_its_traceback_group_and_the_file_line_of_the_raising_frame(tmp_path):
    asyncio.run(manager(tmp_path, groups=3).generate_step())
    log = (tmp_path / "logs" / "rollout_errors.log").read_text()
    for gid in range(3):
        assert f"group {gid} sample 1 failed: reward function test_rollout_errors:BuggyVerifierTask.reward: " \
               f"RuntimeError: verifier bug on sample {gid}/1" in log
    assert log.count(f"at {HERE}:{RAISE_LINE} in reward") == 3
    assert log.count("Traceback (most recent call last)") == 3


def test_the_console_shows_the_first_traceback_once_then_collapses_repeats_into_counts(tmp_path):
    lines = []
    asyncio.run(manager(tmp_path, groups=5, echo=lines.append).generate_step())
    console = "\n".join(lines)
    assert console.count("Traceback (most recent call last)") == 1
    assert f"at {HERE}:{RAISE_LINE} in reward" in lines[0] and "rollout_errors.log" in lines[0]
    assert 'raise RuntimeError(f"verifier bug on sample' in lines[0]  # the source line of the user's frame
    # failures 2 and 4 of the same kind each say their count; 3 and 5 add nothing
    counts = [int(m) for m in re.findall(r"RuntimeError in reward at .*: (\d+) times so far", console)]
    assert counts == [2, 4] and len(lines) == 3


def test_fail_group_keeps_failing_the_whole_group_with_the_traceback(tmp_path):
    lines = []
    [group] = asyncio.run(manager(tmp_path, on_error="fail_group", echo=lines.append).generate_step())
    assert [s.status for s in group.samples] == [SampleStatus.FAILED] * 3
    assert "RuntimeError: verifier bug on sample 0/1" in group.error
    assert f"{HERE}:{RAISE_LINE}" in lines[0] and "Traceback" in lines[0]


def test_a_group_left_with_one_sample_fails_as_a_whole(tmp_path):
    [group] = asyncio.run(manager(tmp_path, samples=2).generate_step())
    assert group.error is not None and "1 of its 2 rewards failed, leaving 1 sample(s)" in group.error
    assert [s.status for s in group.samples] == [SampleStatus.FAILED] * 2


def test_empty_responses_are_counted_and_warned_once(tmp_path):
    lines = []
    groups = asyncio.run(manager(tmp_path, task="EmptyAnswersTask", samples=3, groups=2,
                                 echo=lines.append).generate_step())
    assert rollout_metrics(groups)["rollout/empty_responses"] == 4.0  # samples 0 and 2 of both groups
    assert [line for line in lines if "empty responses" in line] == lines and len(lines) == 1
    assert "2 samples have empty responses" in lines[0]


def raises_in_json():
    return json.loads("{not json")


def test_the_users_frame_is_the_one_that_called_into_the_library():
    with pytest.raises(ValueError) as caught:
        raises_in_json()
    frame = user_frame(caught.value)
    assert (frame.filename, frame.name) == (str(HERE), "raises_in_json")


def test_reward_on_error_takes_only_the_two_policies():
    assert RewardConfig().on_error == "fail_sample"
    with pytest.raises(ValueError, match="reward.on_error must be 'fail_sample' or 'fail_group', got 'skip'"):
        RewardConfig(on_error="skip")


async def hangs(ctx, prompt, num_samples):
    await asyncio.Event().wait()


def test_groups_cut_by_their_timeout_are_each_logged_and_collapsed_on_the_console(tmp_path):
    lines = []
    errors = RolloutErrors(tmp_path / "rollout_errors.log", echo=lines.append)
    cut = RolloutManager(function_path="test_rollout_errors:hangs", task_path="test_rollout_errors:BuggyVerifierTask",
                         client=None, sampling_params={}, prompts_per_step=5, samples_per_prompt=2, seed=0,
                         group_timeout_s=0.1, errors=errors)
    asyncio.run(cut.generate_step())
    assert (tmp_path / "rollout_errors.log").read_text().count("timed out after rollout.group_timeout_s=0.1 s") == 5
    assert len(lines) == 3 and "(2 groups so far" in lines[1] and "(4 groups so far" in lines[2], lines
