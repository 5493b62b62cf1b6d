"""The loop's own logic: advantages packed at the right token positions, metrics, and the sync order."""
import pytest
import torch

from glue.loop.colocation import Disaggregated
from glue.loop.batch import build_train_batch, rollout_metrics
from glue.loop.controller import sync_weights
from glue.types import Group, Sample, SampleStatus
from loss import LossConfig


def sample(group, index, prompt, response, reward, status=SampleStatus.COMPLETED):
    s = Sample(prompt_tokens=prompt, group_id=group, index=index, reward=reward, status=status)
    s.append_response(response, [-0.5] * len(response), version=3)
    return s


def test_train_batch_puts_each_advantage_on_the_positions_that_predict_response_tokens():
    groups = [Group(group_id=0, samples=[sample(0, 0, [1, 2], [5, 6, 7], 1.0), sample(0, 1, [1, 2], [9], 0.0)])]
    batch, _ = build_train_batch(groups, LossConfig(normalize_std=False))
    # group mean 0.5 -> advantages +0.5 and -0.5; prompt length 2 -> first response token predicted at position 1
    assert batch.tokens.tolist() == [[1, 2, 5, 6, 7], [1, 2, 9, 0, 0]]
    assert batch.logprob_mask.tolist() == [[0, 1, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0.5, 0], [0, -0.5, 0, 0, 0]]
    assert batch.versions.tolist() == [[-1, 3, 3, 3, -1], [-1, 3, -1, -1, -1]]
    assert batch.rollout_logprobs[0, 1:4].tolist() == [-0.5, -0.5, -0.5]


def test_failed_samples_are_not_trained_on_and_are_counted():
    failed = sample(0, 2, [1], [4], 0.0, status=SampleStatus.FAILED)
    groups = [Group(group_id=0, samples=[sample(0, 0, [1], [4], 1.0), sample(0, 1, [1], [3], 0.0), failed])]
    batch, _ = build_train_batch(groups, LossConfig())
    assert batch.tokens.shape[0] == 2
    metrics = rollout_metrics(groups)
    assert metrics["rollout/failed"] == 1.0
    assert metrics["rollout/reward_mean"] == pytest.approx(0.5)
    assert metrics["rollout/response_len_mean"] == pytest.approx(1.0)


def test_a_group_with_equal_rewards_gets_zero_advantage_and_counts_as_flat():
    groups = [Group(group_id=0, samples=[sample(0, i, [1], [2, 3], 1.0) for i in range(4)]),
              Group(group_id=1, samples=[sample(1, 0, [1], [2], 1.0), sample(1, 1, [1], [2], 0.0)])]
    batch, _ = build_train_batch(groups, LossConfig())
    assert torch.isfinite(batch.advantages).all()
    assert batch.advantages[:4].abs().sum().item() == 0.0
    assert rollout_metrics(groups)["rollout/zero_std_group_frac"] == pytest.approx(0.5)


def test_a_nan_reward_is_refused_by_sample_validation():
    bad = sample(0, 0, [1], [2], float("nan"))
    with pytest.raises(ValueError, match="reward is nan"):
        bad.validate()


def test_a_failed_transfer_leaves_generation_paused_since_engines_may_hold_mixed_weights():
    calls = []

    class Fleet:
        def pause_generation(self, mode="retract"):
            calls.append(f"pause {mode}")

        def continue_generation(self):
            calls.append("continue")

    class FailingBridge:
        def sync(self, version):
            calls.append(f"sync {version}")
            raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        sync_weights(Fleet(), Disaggregated(FailingBridge()), 4, "abort")
    assert calls == ["pause abort", "sync 4"]  # no "continue": nothing samples from half-updated weights


def test_the_learning_summary_compares_the_first_and_last_five_steps():
    from glue.metrics.logger import learning_summary

    records = [{"rollout/reward_mean": r} for r in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]]
    # first five mean 0.2, last five mean 0.7
    assert learning_summary(records) == "reward_mean: first 5 steps 0.200 -> last 5 steps 0.700 (+0.500)"


def test_pause_reaches_every_engine_at_once_not_one_after_another():
    """Each fake engine answers /pause_generation only once both have been asked: one after another would time out."""
    import threading

    from conftest import fake_engine_server
    from glue.fleet.engine_client import EngineClient

    both_asked = threading.Barrier(2, timeout=10)
    bodies = []

    def on_post(body):
        bodies.append(body)
        both_asked.wait()

    with fake_engine_server(on_post) as first, fake_engine_server(on_post) as second:
        client = EngineClient("http://127.0.0.1:1", [first, second], control_timeout_s=20)
        client.pause_generation("retract")
        assert bodies == [b'{"mode": "retract"}'] * 2 and client.pauses == 1
