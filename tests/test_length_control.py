"""Length control (issue 28 item 6): DAPO's soft overlong punishment on the reward side and truncation masking on
the loss side, each with its metric and its config checks. The end-to-end run is in tests/test_replay.py."""
import pytest

from glue.loop.batch import build_train_batch, rollout_metrics
from glue.rewards.shaping import OverlongShaping, make_reward_shaping, overlong_penalty
from glue.types import Group, Sample, SampleStatus
from launch.config import ConfigError, load_config
from loss import LossConfig


def sample(index, response, reward, status=SampleStatus.COMPLETED, group=0):
    s = Sample(prompt_tokens=[1, 2], group_id=group, index=index, reward=reward, status=status)
    s.append_response(response, [-0.5] * len(response), version=0)
    return s


@pytest.mark.parametrize("length, expected", [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (13, -1.0)])
def test_the_overlong_punishment_falls_linearly_over_the_buffer_and_is_capped_at_the_penalty(length, expected):
    # max_len 10, buffer 4: free up to 6 tokens, then -penalty * (L - 6) / 4, all of the penalty from 10 on
    assert overlong_penalty(length, max_len=10, buffer=4, penalty=1.0) == pytest.approx(expected)
    assert overlong_penalty(length, max_len=10, buffer=4, penalty=0.5) == pytest.approx(expected / 2)


def test_shaping_adds_the_punishment_to_scalar_and_dict_rewards_and_records_it_but_spares_failed_samples():
    shaping = OverlongShaping(max_len=4, buffer=2, penalty=1.0)
    short, three, full = sample(0, [5, 6], 1.0), sample(1, [5, 6, 7], 1.0), sample(2, [5, 6, 7, 8], {"score": 1.0,
                                                                                                    "correct": 1.0})
    failed = Sample(prompt_tokens=[1], index=3, status=SampleStatus.FAILED)
    shaping([short, three, full, failed])
    assert short.reward == 1.0 and short.metadata["overlong_penalty"] == 0.0
    assert three.reward == pytest.approx(0.5) and three.metadata["overlong_penalty"] == pytest.approx(-0.5)
    assert full.reward == {"score": 0.0, "correct": 1.0}  # the task's other entries stay as they were
    assert failed.reward is None and "overlong_penalty" not in failed.metadata
    metrics = rollout_metrics([Group(group_id=0, samples=[short, three, full, failed])])
    assert metrics["reward/overlong_penalized_frac"] == pytest.approx(2 / 3)  # of the three scored samples
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)


def test_shaping_is_off_by_default_and_its_metrics_are_absent_then():
    cfg = load_config("examples/configs/demo.yaml")
    assert cfg.reward.overlong_buffer == 0
    assert make_reward_shaping(overlong_buffer=0, overlong_penalty=1.0, max_len=4) is None
    metrics = rollout_metrics([Group(group_id=0, samples=[sample(0, [5, 6, 7, 8], 1.0), sample(1, [5], 0.0)])])
    assert not any(key.startswith("reward/overlong") for key in metrics)


def test_mask_truncated_zeroes_a_truncated_samples_loss_mask_but_keeps_its_reward_in_the_baseline():
    groups = [Group(group_id=0, samples=[sample(0, [5, 6], 1.0), sample(1, [5, 6, 7], 0.0, SampleStatus.TRUNCATED),
                                         sample(2, [9], 0.5)])]
    plain, plain_metrics = build_train_batch(groups, LossConfig(normalize_std=False))
    masked, metrics = build_train_batch(groups, LossConfig(normalize_std=False, mask_truncated=True))
    assert plain.logprob_mask[1].sum().item() == 3 and "loss/truncated_masked_frac" not in plain_metrics
    assert masked.logprob_mask[1].sum().item() == 0 and masked.advantages[1].abs().sum().item() == 0
    assert metrics["loss/truncated_masked_frac"] == pytest.approx(1 / 3)
    # the group mean is still (1 + 0 + 0.5) / 3 = 0.5: the first sample's advantage is +0.5, the third's 0
    assert masked.advantages[0, 1:3].tolist() == [pytest.approx(0.5)] * 2
    assert masked.advantages[2, 1].item() == pytest.approx(0.0)
    assert masked.logprob_mask[0].tolist() == plain.logprob_mask[0].tolist()
    assert groups[0].samples[1].loss_mask == [1, 1, 1]  # the sample itself is untouched (it may be saved)


@pytest.mark.parametrize("override, message", [
    ("reward.overlong_buffer=-1", "reward.overlong_buffer must be >= 0"),
    ("reward.overlong_buffer=5", r"reward.overlong_buffer=5 must be <= max_len \(rollout.sampling.max_new_tokens=4\)"),
    ("reward.overlong_penalty=0", "reward.overlong_penalty must be > 0"),
    ("reward.overlong_max_len=0", "reward.overlong_max_len must be >= 1"),
    ("loss.mask_truncated=maybe", "loss.mask_truncated must be bool"),
])
def test_bad_length_control_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("examples/configs/demo.yaml", [override])


def test_overlong_max_len_replaces_the_sampling_limit():
    cfg = load_config("examples/configs/demo.yaml", ["reward.overlong_buffer=6", "reward.overlong_max_len=8"])
    assert cfg.reward.max_len(cfg.rollout.sampling.max_new_tokens) == 8
