"""trainer.ref_load (slime's --ref-load): the KL term's reference policy comes from the given checkpoint, an HF
directory or one of sluice's own, not from the initial policy; a missing or wrong folder is refused in one line."""
from __future__ import annotations

import json
import os

import pytest
import torch

from glue.trainer.reference import check_same_shapes, resolve_ref_load
from helpers.trainer import hf_teacher_forced_logprobs, make_batch
from helpers.trainer_process import run_in_trainer_process, start_worker, stop_worker
from loss import LossConfig

KL = LossConfig(kl_loss_coef=0.1)


def _reference_scenario(policy_dir: str, other_hf_dir: str, work: str) -> dict:
    """In one trainer process: a sluice checkpoint of a policy trained 2 steps, then workers whose reference comes from
    the initial policy, from another HF model and from that checkpoint."""
    from glue.loop.checkpoint import Checkpoints
    from glue.trainer.checkpointing import save_rank

    batch = make_batch()
    trained = start_worker(policy_dir, LossConfig())
    for _ in range(2):
        trained.train_step(batch)
    trained_logprobs = trained.compute_logprobs(batch)
    Checkpoints(os.path.join(work, "run", "checkpoints")).save(2, lambda d: save_rank(trained, d), {"version": 2})
    stop_worker(trained)
    out = {"trained": trained_logprobs}
    for name, ref_load in (("initial", None), ("hf", other_hf_dir), ("sluice", os.path.join(work, "run"))):
        worker = start_worker(policy_dir, KL, ref_load=ref_load)
        out[name] = worker.compute_logprobs(batch, reference=True)
        out[f"{name}_policy"] = worker.compute_logprobs(batch)
        stop_worker(worker)
    return out


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen2 of `tiny_model_dir` with other random weights (seed 1)."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_seed1"), seed=1)


def test_the_reference_policy_is_the_checkpoint_trainer_ref_load_names(tiny_model_dir, other_model_dir, tmp_path):
    out = run_in_trainer_process(_reference_scenario, tiny_model_dir, other_model_dir, str(tmp_path))
    mask = make_batch().logprob_mask.bool()
    policy = hf_teacher_forced_logprobs(tiny_model_dir, make_batch().tokens)[mask]
    other = hf_teacher_forced_logprobs(other_model_dir, make_batch().tokens)[mask]
    torch.testing.assert_close(out["initial"][mask], policy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["hf"][mask], other, atol=1e-4, rtol=1e-4)  # the other model's, not the policy's
    torch.testing.assert_close(out["sluice"][mask], out["trained"][mask], atol=1e-5, rtol=1e-5)
    for name in ("hf", "sluice"):
        assert (out[name][mask] - policy).abs().max() > 1e-2, f"the {name} reference gave the initial policy's logprobs"
        torch.testing.assert_close(out[f"{name}_policy"][mask], policy, atol=1e-4, rtol=1e-4)  # the policy is untouched


def test_a_missing_or_wrong_reference_folder_is_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"trainer.ref_load='/no/such/dir' does not exist; give an HF"):
        resolve_ref_load("/no/such/dir")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"is neither an HF checkpoint nor a sluice checkpoint \(found notes.txt\)"):
        resolve_ref_load(str(tmp_path))
    with pytest.raises(ValueError, match="is a file, not a directory"):
        resolve_ref_load(str(tmp_path / "notes.txt"))
    megatron = tmp_path / "megatron"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(ValueError, match="is a Megatron-LM checkpoint .* convert it to HF"):
        resolve_ref_load(str(megatron))
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has config.json but no \\*.safetensors"):
        resolve_ref_load(str(no_weights))
    wider = tmp_path / "wider"
    wider.mkdir()
    config = json.loads((open(os.path.join(tiny_model_dir, "config.json"))).read())
    (wider / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    (wider / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="hidden_size is 128 there and 64 in model.path"):
        check_same_shapes(resolve_ref_load(str(wider)), tiny_model_dir)
    assert resolve_ref_load(tiny_model_dir).kind == "hf"


def test_dry_run_names_the_reference_and_refuses_a_missing_one(capsys, tiny_model_dir, tmp_path):
    from launch.cli import main

    base = ["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={tiny_model_dir}",
            "loss.kl_loss_coef=0.05"]
    assert main([*base, f"trainer.ref_load={tmp_path / 'gone'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"trainer.ref_load='{tmp_path / 'gone'}' does not exist" in err[0], err
    assert main([*base, f"trainer.ref_load={tiny_model_dir}"]) == 0
    assert f"reference: hf checkpoint {tiny_model_dir} (trainer.ref_load)" in capsys.readouterr().out
