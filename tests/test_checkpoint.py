"""Checkpoints of the trainer: a run resumed from one continues exactly as the uninterrupted run would (weights,
optimizer moments, RNG, version), its HF weights load in transformers, and a layout change is refused by name."""
import multiprocessing as mp
import pickle
import queue

import pytest
import torch

from conftest import free_port
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from test_trainer_megatron import hf_teacher_forced_logprobs, make_batch, model_dir  # noqa: F401 (fixture)


def _rank(rank, world, port, model_path, tp, pp, script, results):
    from glue.trainer.worker import TrainerWorker

    cfg = TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=4, lr=1e-2)
    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    batch, out = make_batch(), []
    try:
        for action, arg in script:
            if action == "train":
                out.append(worker.train_step(batch)["train/loss"])
            elif action == "save":
                worker.save_checkpoint(arg)
            elif action == "load":
                out.append(worker.load_checkpoint(arg))
        out.append(worker.compute_logprobs(batch))
    except Exception as err:  # reported to the test, which asserts on it
        out.append(err)
    worker.shutdown()
    results.put(pickle.dumps((rank, out)))


def run_ranks(model_path, script, tp=1, pp=1):
    """Run `script` ([("train"|"save"|"load", arg)]) on `tp` x `pp` spawned ranks; rank 0's outputs."""
    ctx = mp.get_context("spawn")
    results, port, world = ctx.Queue(), free_port(), tp * pp
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_path, tp, pp, script, results))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        outs = {}
        while len(outs) < world:
            try:
                rank, out = pickle.loads(results.get(timeout=5))
                outs[rank] = out
            except queue.Empty:
                assert not [p for p in procs if p.exitcode not in (None, 0)], "a trainer rank died"
        return outs[0]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


def test_a_resumed_trainer_continues_exactly_like_the_uninterrupted_one(model_dir, tmp_path):
    ckpt = str(tmp_path / "step_2")
    straight = run_ranks(model_dir, [("train", None), ("train", None), ("save", ckpt), ("train", None),
                                     ("train", None)])
    resumed = run_ranks(model_dir, [("load", ckpt), ("train", None), ("train", None)])
    assert resumed[0] == 2  # the version the checkpoint was taken at
    assert resumed[1:3] == straight[2:4]  # same losses: weights and Adam moments came back exactly
    assert torch.equal(resumed[3], straight[4])


def test_the_checkpoints_hf_weights_load_in_transformers_and_give_the_trainers_logprobs(model_dir, tmp_path):
    ckpt = tmp_path / "step_1"
    out = run_ranks(model_dir, [("train", None), ("save", str(ckpt))])
    hf = hf_teacher_forced_logprobs(str(ckpt / "hf"), make_batch().tokens)
    mask = make_batch().logprob_mask > 0
    assert (hf[mask] - out[1][mask]).abs().max().item() < 1e-4
    assert (ckpt / "trainer" / "rank_00000.pt").exists()


def test_a_checkpoint_taken_at_tp2_reloads_its_weights_at_tp2_and_refuses_tp1_naming_both_layouts(model_dir,
                                                                                                 tmp_path):
    ckpt = str(tmp_path / "tp2")
    tp2 = run_ranks(model_dir, [("train", None), ("save", ckpt)], tp=2)
    again = run_ranks(model_dir, [("load", ckpt)], tp=2)
    assert again[0] == 1 and torch.allclose(again[1], tp2[1], atol=1e-6)
    refused = run_ranks(model_dir, [("load", ckpt)], tp=1)[0]
    assert isinstance(refused, ValueError)
    assert "taken at trainer layout {'world_size': 2, 'tp': 2," in str(refused)
    assert "this run is {'world_size': 1, 'tp': 1," in str(refused)


def test_a_checkpoint_interrupted_mid_write_leaves_the_previous_one_the_latest(tmp_path):
    from glue.checkpoint import Checkpoints

    def trainer_part(folder):
        (tmp_path / "written").write_text(folder)
        open(f"{folder}/weights", "w").write("w")

    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2, interval=2)
    first = checkpoints.save(2, trainer_part, {"version": 2})

    def crashes_half_way(folder):
        open(f"{folder}/weights", "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(4, crashes_half_way, {"version": 4})
    assert checkpoints.latest() == first and Checkpoints.read_state(first) == {"version": 2, "step": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == [".step_00000004.partial"]
    for step in (4, 6, 8):
        checkpoints.save(step, trainer_part, {"version": step})
    assert [p.name for p in checkpoints.all()] == ["step_00000006", "step_00000008"]  # keep=2, partial cleaned
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    assert [checkpoints.due(s, last=False) for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert Checkpoints(tmp_path / "none", interval=0).due(3, last=True)


@pytest.mark.slow
def test_a_two_stage_pipeline_checkpoint_resumes_exactly_and_is_refused_at_tp2_of_the_same_world_size(model_dir,
                                                                                                       tmp_path):
    # rank 0 writes every stage's weights (gathered from stage 1) into hf/; each stage reloads its own layers
    ckpt = str(tmp_path / "pp2")
    straight = run_ranks(model_dir, [("train", None), ("save", ckpt), ("train", None)], pp=2)
    resumed = run_ranks(model_dir, [("load", ckpt), ("train", None)], pp=2)
    assert resumed[0] == 1 and resumed[1] == straight[1]
    assert torch.equal(resumed[2], straight[2])
    refused = run_ranks(model_dir, [("load", ckpt)], tp=2)[0]
    assert isinstance(refused, ValueError) and "'tp': 1, 'pp': 2," in str(refused)
