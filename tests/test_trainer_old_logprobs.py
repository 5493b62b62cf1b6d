"""Where the trainer's old (proximal) logprobs come from, on CPU with megatron-core on gloo (one spawned rank):
`snapshot` gives each token its logprob under the exact weights of the version that generated it, `recompute` the
current weights', and a loss that takes them from the rollout or its EWMA gets no old-logprob forward at all (the
EWMA's per-sample state carries from epoch to epoch). Also the policy-version unit (one per train_step) and the
weight bridge's guard against a step between stage and send."""
from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import make_batch
from helpers.trainer_process import run_in_trainer_process, start_worker, stop_worker, with_versions

KEEP_VERSIONS = 3


def count_forwards(worker) -> list[int]:
    """Wrap the worker's forward; the returned list holds the batch size of every forward since."""
    calls, forward = [], worker._forward

    def counted(tokens, *args, **kwargs):
        calls.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    worker._forward = counted
    return calls


def save_checkpoint(worker, model_dir: str, path: str) -> str:
    """The worker's current weights as an HF checkpoint (the tiny model's config + one safetensors file)."""
    from safetensors.torch import save_file

    os.makedirs(path)
    shutil.copy(os.path.join(model_dir, "config.json"), path)
    # clones: gathered-free TP=1 tensors alias the parameters, and q/k/v may share one fused storage
    save_file({n: t.clone() for n, t in worker.full_hf_state().items()}, os.path.join(path, "model.safetensors"))
    return path


def fresh_model_logprobs(worker, checkpoint: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logprobs [B, T] of a new megatron model loaded from `checkpoint`, one row per forward (the worker's
    micro_batch_size is 1 too: bit-equality needs the same forward shapes, a GEMM's rounding can depend on them)."""
    from glue.trainer import model

    fresh = model.build_model(worker.hf_config, tp_size=1, megatron_args=worker.cfg.megatron_values())
    model.load_hf_weights(fresh, checkpoint, worker.hf_config, worker.place.layout())
    temperature = worker.cfg.temperature
    with torch.no_grad():
        rows = [model.token_logprobs(model.forward_logits(fresh, tokens[b:b + 1]), tokens[b:b + 1], temperature)
                for b in range(tokens.shape[0])]
    return torch.cat(rows)


def _snapshot_scenario(model_dir: str, root: str) -> dict:
    """Train three steps with snapshot old logprobs (two mini-batches each), checkpointing every version; then
    old logprobs for a batch mixing versions 0-2, a batch holding a version no longer kept, and the staging guard."""
    worker = start_worker(model_dir, LossConfig(), keep_versions=KEEP_VERSIONS, old_logprobs="snapshot",
                          num_mini_batches=2, micro_batch_size=1)
    out: dict[str, Any] = {"versions": [worker.version], "steps": [], "kept": [worker._snapshots.versions()]}
    checkpoints = [save_checkpoint(worker, model_dir, os.path.join(root, "v0"))]
    for step in (1, 2):
        out["steps"].append(worker.train_step(make_batch()))
        out["versions"].append(worker.version)
        out["kept"].append(worker._snapshots.versions())
        checkpoints.append(save_checkpoint(worker, model_dir, os.path.join(root, f"v{step}")))
    mixed = with_versions(make_batch(), lambda b, t: (b + t) % 3)
    live = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    forwards = count_forwards(worker)
    out.update(mixed=mixed, old=worker.compute_old_logprobs(mixed), forwards=list(forwards),
               fresh=[fresh_model_logprobs(worker, c, mixed.tokens) for c in checkpoints],
               live_unchanged=all(torch.equal(p, live[n]) for n, p in worker.model.named_parameters()),
               param_bytes=sum(p.numel() * p.element_size() for p in worker.model.parameters()))
    out["steps"].append(worker.train_step(make_batch()))  # version 3: version 0 is no longer kept
    out["kept"].append(worker._snapshots.versions())
    gone = with_versions(make_batch(), lambda b, t: 0 if b < 2 else 3)
    out.update(gone=gone, gone_old=worker.compute_old_logprobs(gone), gone_live=worker.compute_logprobs(gone),
               gone_step=worker.train_step(gone))
    out["guard"] = staging_guard_errors(worker)
    stop_worker(worker)
    return out


def staging_guard_errors(worker) -> list[str]:
    """The errors of send_weight_bucket into a channel never opened: right after staging (the guard lets it through
    to the channel check), after a train step since staging, and after staging again."""
    errors = []
    for action in ("stage", "train", "stage"):
        if action == "stage":
            worker.stage_weights()
        else:
            worker.train_step(make_batch())
        with pytest.raises(RuntimeError) as caught:
            worker.send_weight_bucket("never-opened", 0)
        errors.append(str(caught.value))
    return errors


@pytest.fixture(scope="module")
def snapshot_run(tiny_model_dir, tmp_path_factory) -> dict:
    return run_in_trainer_process(_snapshot_scenario, tiny_model_dir, str(tmp_path_factory.mktemp("versions")))


def test_one_train_step_moves_the_policy_version_by_one_whatever_the_number_of_mini_batches(snapshot_run):
    assert snapshot_run["versions"] == [0, 1, 2]  # num_mini_batches=2: two optimizer steps per train_step
    assert [m["weights/version"] for m in snapshot_run["steps"]] == [1.0, 2.0, 3.0]


def test_snapshots_keep_the_newest_versions_from_the_initial_weights_on(snapshot_run):
    assert snapshot_run["kept"] == [[0], [0, 1], [0, 1, 2], [1, 2, 3]]


def test_snapshot_old_logprobs_equal_a_fresh_model_at_each_tokens_own_version_bit_for_bit(snapshot_run):
    mixed, old, fresh = snapshot_run["mixed"], snapshot_run["old"], snapshot_run["fresh"]
    trained = mixed.logprob_mask > 0
    for version in range(3):
        at = trained & (mixed.versions == version)
        assert at.any(dim=1).sum() == mixed.tokens.shape[0], f"every row should hold version {version} tokens"
        assert torch.equal(old[at], fresh[version][at]), f"version {version} tokens"
    assert (old[~trained] == 0).all()
    # the three versions really differ, so matching each token's own version is a real check
    assert (fresh[0] - fresh[2])[trained].abs().max() > 1e-3
    # one forward per row per version (micro_batch_size 1), the current version 2 on the live weights
    assert snapshot_run["forwards"] == [1] * (3 * mixed.tokens.shape[0])


def test_loading_a_snapshot_leaves_the_live_weights_bit_identical(snapshot_run):
    assert snapshot_run["live_unchanged"]


def test_a_version_no_longer_kept_falls_back_to_the_current_weights_and_is_counted(snapshot_run):
    gone, old, live = snapshot_run["gone"], snapshot_run["gone_old"], snapshot_run["gone_live"]
    trained = gone.logprob_mask > 0
    assert torch.equal(old[trained], live[trained])
    metrics = snapshot_run["gone_step"]
    version_0_tokens = int((trained & (gone.versions == 0)).sum())
    assert version_0_tokens == 2 * 7  # two rows of seven response tokens
    assert metrics["old_logprobs/missing_version_tokens"] == version_0_tokens
    assert metrics["old_logprobs/versions_used"] == 1.0  # version 3, the live weights


def test_snapshot_metrics_report_versions_used_and_the_host_bytes_of_the_kept_versions(snapshot_run):
    first, second = snapshot_run["steps"][:2]
    assert first["old_logprobs/versions_used"] == second["old_logprobs/versions_used"] == 1.0
    assert first["old_logprobs/missing_version_tokens"] == second["old_logprobs/missing_version_tokens"] == 0.0
    assert first["old_logprobs/snapshot_bytes"] == snapshot_run["param_bytes"]  # version 0 only
    assert second["old_logprobs/snapshot_bytes"] == 2 * snapshot_run["param_bytes"]
    assert snapshot_run["gone_step"]["old_logprobs/snapshot_bytes"] == KEEP_VERSIONS * snapshot_run["param_bytes"]
    assert "train/train_rollout_logprob_abs_diff" in second


def test_sending_a_bucket_after_a_train_step_since_staging_is_refused_naming_both_versions(snapshot_run):
    fresh_stage, after_step, restaged = snapshot_run["guard"]
    assert "is not open" in fresh_stage  # staged at the current version: through to the channel lookup
    assert "version 4 was staged but the trainer is at version 5" in after_step
    assert "is not open" in restaged


def _source_scenario(model_dir: str) -> dict:
    """One train step and its forwards for each old-logprob source: recomputed by the trainer, or none (the
    loss takes the rollout's or its EWMA's); and recompute's old logprobs after that step."""
    out: dict[str, Any] = {}
    for source in ("given", "rollout", "ewma"):
        worker = start_worker(model_dir, LossConfig(old_logprobs_from=source), old_logprobs="recompute")
        forwards = count_forwards(worker)
        out[source] = {"metrics": worker.train_step(make_batch()), "forwards": list(forwards)}
        if source == "given":
            mixed = with_versions(make_batch(), lambda b, t: t % 2)
            out["recomputed"] = (worker.compute_old_logprobs(mixed), worker.compute_logprobs(mixed))
        stop_worker(worker)
    out["ewma_epochs"] = _ewma_states_over_three_epochs(model_dir)
    return out


def _ewma_states_over_three_epochs(model_dir: str) -> list[tuple]:
    """(logprobs, rollout logprobs, mask, PPO-EWMA state passed in) of each loss call of one train_step with three
    epochs, read by wrapping loss.compute.compute_policy_loss (compute_loss looks it up there at each call)."""
    from loss import compute as loss

    def recorded(cfg, **kwargs):
        state = kwargs.get("ewma_logprobs")
        calls.append((kwargs["logprobs"].detach().clone(), kwargs["rollout_logprobs"].clone(), kwargs["mask"].clone(),
                      None if state is None else state.clone()))
        return real(cfg, **kwargs)

    calls, real = [], loss.compute_policy_loss
    loss.compute_policy_loss = recorded
    try:
        worker = start_worker(model_dir, LossConfig(old_logprobs_from="ewma", ewma_beta=0.5, correction="icepop"),
                              num_epochs=3)
        worker.train_step(make_batch(rollout_logprobs_from=model_dir))  # near the policy: the clip lets it move
        stop_worker(worker)
    finally:
        loss.compute_policy_loss = real
    return calls


@pytest.fixture(scope="module")
def source_runs(tiny_model_dir) -> dict:
    return run_in_trainer_process(_source_scenario, tiny_model_dir)


def test_old_logprobs_taken_from_the_rollout_or_the_ewma_run_no_old_logprob_forward(source_runs):
    # six rows in one micro-batch (micro_batch_size 8): the training forward is the only one, one more to recompute
    assert source_runs["given"]["forwards"] == [6, 6]
    for source in ("rollout", "ewma"):
        assert source_runs[source]["forwards"] == [6], source
        assert "train/train_rollout_logprob_abs_diff" not in source_runs[source]["metrics"], source
        assert source_runs[source]["metrics"]["weights/version"] == 1.0
    assert "train/train_rollout_logprob_abs_diff" in source_runs["given"]["metrics"]


def test_ppo_ewma_state_of_each_sample_carries_from_one_epoch_to_the_next(source_runs):
    # one micro-batch per epoch; the state starts at the rollout logprobs and takes each epoch's policy at decay 0.5
    (l1, rollout, mask, s0), (l2, rollout_2, _, s1), (_, rollout_3, _, s2) = source_runs["ewma_epochs"]
    valid = mask > 0
    assert torch.equal(rollout_2, rollout) and torch.equal(rollout_3, rollout)  # the state is a copy, not the batch's
    assert not torch.allclose(l1[valid], l2[valid])  # the policy moved between epochs
    assert s0 is not None and s1 is not None and s2 is not None, "the trainer passed no PPO-EWMA state to the loss"
    assert torch.equal(s0[valid], rollout[valid])
    assert torch.allclose(s1[valid], (0.5 * rollout + 0.5 * l1)[valid])
    assert torch.allclose(s2[valid], (0.25 * rollout + 0.25 * l1 + 0.5 * l2)[valid])


def test_recomputed_old_logprobs_are_the_current_weights_whatever_the_token_versions(source_runs):
    old, current = source_runs["recomputed"]
    assert torch.equal(old, current)


def test_trainer_config_refuses_an_unknown_old_logprob_source_naming_the_field():
    with pytest.raises(ValueError, match="trainer.old_logprobs must be 'recompute' or 'snapshot', got 'exact'"):
        TrainerConfig(old_logprobs="exact")


def test_a_worker_refuses_to_keep_fewer_than_one_version():
    from glue.trainer.worker import TrainerWorker

    with pytest.raises(ValueError, match="keep_versions must be an integer >= 1"):
        TrainerWorker(model_path="unused", cfg=TrainerConfig(old_logprobs="snapshot"), loss_cfg=LossConfig(), rank=0,
                      world_size=1, keep_versions=0)


def test_with_snapshots_the_clip_is_against_the_weights_before_the_update(snapshot_run):
    """Decoupled PPO (issue 27 item 2): beside the snapshot (behaviour) logprobs the trainer passes the current
    weights' logprobs as the proximal policy, so the loss reports its staleness weight pi_prox / pi_snapshot."""
    assert LossConfig().needs_proximal_logprobs
    for step in snapshot_run["steps"]:
        assert "train/stale_weight/clipped_frac" in step, sorted(step)


def _resumed_snapshot_scenario(model_dir: str, root: str) -> dict:
    """Two steps with snapshots, a trainer checkpoint, and a fresh worker resumed from it: what it holds and what
    its old logprobs of tokens from a version before the checkpoint say."""
    worker = start_worker(model_dir, LossConfig(), keep_versions=KEEP_VERSIONS, old_logprobs="snapshot")
    for _ in range(2):
        worker.train_step(make_batch())
    worker.save_checkpoint(root)
    stop_worker(worker)
    resumed = start_worker(model_dir, LossConfig(), keep_versions=KEEP_VERSIONS, old_logprobs="snapshot")
    try:
        version = resumed.load_checkpoint(root)
        batch = with_versions(make_batch(), lambda b, t: 1 if b < 2 else 2)  # rows 0-1 from version 1
        _, metrics = resumed._snapshots.old_logprobs(batch, resumed.model, resumed.version, resumed.compute_logprobs)
        return {"version": version, "kept": resumed._snapshots.versions(), "metrics": metrics,
                "old_tokens": int(((batch.versions == 1) & (batch.logprob_mask > 0)).sum())}
    finally:
        stop_worker(resumed)


def test_after_a_resume_tokens_of_versions_before_the_checkpoint_are_counted_as_missing(tiny_model_dir, tmp_path):
    """Issue 26 item 9: a checkpoint keeps the trainer's current version only; after a resume the tokens of older
    versions get the current weights' logprob, and the step says how many in old_logprobs/missing_version_tokens."""
    out = run_in_trainer_process(_resumed_snapshot_scenario, tiny_model_dir, str(tmp_path / "ckpt"))
    assert out["version"] == 2 and 2 in out["kept"] and 1 not in out["kept"]  # (0: the initial weights)
    assert out["metrics"]["old_logprobs/missing_version_tokens"] == out["old_tokens"] > 0
