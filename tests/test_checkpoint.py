"""Checkpoints of the trainer: each rank writes its own shards (megatron's dist_checkpointing, no gather); a run
resumed from one continues exactly as the uninterrupted run would (weights, optimizer moments, RNG, version); a
checkpoint taken at one layout reloads at another with identical weights; `sluice export-hf` turns it into an HF
directory that loads in transformers."""
import pickle
import queue

import pytest
import torch

from conftest import free_port
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import hf_teacher_forced_logprobs, make_batch
from helpers.forkserver import rank_context


def _rank(rank, world, port, model_path, tp, pp, script, fields, results):
    from glue.trainer.worker import TrainerWorker

    cfg = TrainerConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=4, lr=1e-2,
                        **fields)
    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
    worker.initialize("127.0.0.1", port)
    batch, out = make_batch(), []
    try:
        for action, arg in script:
            if action == "train":
                out.append(worker.train_step(batch)["train/loss"])
            elif action == "train_reversed":  # the same samples with their advantages negated
                reversed_batch = make_batch()
                reversed_batch.advantages = -reversed_batch.advantages
                out.append(worker.train_step(reversed_batch)["train/loss"])
            elif action == "save":
                worker.save_checkpoint(arg)
            elif action == "load":
                out.append(worker.load_checkpoint(arg))
            elif action == "weights":
                out.append({n: t.clone() for n, t in worker.full_hf_state().items()})
        out.append(worker.compute_logprobs(batch))
    except Exception as err:  # reported to the test, which asserts on it
        out.append(err)
    worker.shutdown()
    results.put(pickle.dumps((rank, out)))


def run_ranks(model_path, script, tp=1, pp=1, **fields):
    """Run `script` ([("train"|"save"|"load", arg)]) on `tp` x `pp` spawned ranks (`fields`: more TrainerConfig
    fields); rank 0's outputs."""
    ctx = rank_context()
    results, port, world = ctx.Queue(), free_port(), tp * pp
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_path, tp, pp, script, fields, results))
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


OFFLOADED = {"precision": "bf16", "megatron": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}}


def test_a_trainer_with_its_optimizer_offloaded_resumes_exactly_and_the_device_optimizer_reads_its_checkpoint(
        model_dir, tmp_path):
    """--optimizer-cpu-offload: megatron's hybrid optimizer, half of the main weights and Adam moments in its host
    sub-optimizer, half in its device one; the checkpoint is the same sharded form as without offload."""
    ckpt = str(tmp_path / "step_1")
    straight = run_ranks(model_dir, [("train", None), ("save", ckpt), ("train", None)], **OFFLOADED)
    resumed = run_ranks(model_dir, [("load", ckpt), ("train", None)], **OFFLOADED)
    assert resumed[0] == 1
    assert torch.equal(resumed[2], straight[2])  # main weights and both sub-optimizers' moments came back exactly
    on_device = run_ranks(model_dir, [("load", ckpt), ("train", None)], precision="bf16")
    assert (on_device[2] - straight[2]).abs().max().item() < 1e-5  # the same state on megatron's device optimizer


def export_hf(checkpoint, out) -> None:
    """`sluice export-hf CHECKPOINT OUT` in a process of its own, as a user runs it."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    done = subprocess.run([sys.executable, "-m", "launch", "export-hf", str(checkpoint), str(out), "--shard-gb",
                           "0.00005"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "safetensors file(s)" in done.stdout


def test_export_hf_writes_the_checkpoints_weights_as_sharded_safetensors_that_transformers_loads(model_dir, tmp_path):
    ckpt = tmp_path / "step_1"
    out = run_ranks(model_dir, [("train", None), ("save", str(ckpt)), ("weights", None)])
    assert (ckpt / "dist").is_dir() and not (ckpt / "hf").exists()  # no gathered copy in the checkpoint
    export_hf(ckpt, tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").exists()  # tiny shards: several
    from safetensors.torch import load_file

    exported = {k: v for f in files for k, v in load_file(str(tmp_path / "hf" / f)).items()}
    assert sorted(exported) == sorted(out[1]) and all(torch.equal(exported[k], out[1][k]) for k in exported)
    hf = hf_teacher_forced_logprobs(str(tmp_path / "hf"), make_batch().tokens)
    mask = make_batch().logprob_mask > 0
    assert (hf[mask] - out[2][mask]).abs().max().item() < 1e-4
    assert (ckpt / "trainer" / "rank_00000.pt").exists()


@pytest.mark.slow
@pytest.mark.long  # 34 s; resharding a TP=2 checkpoint stays in CI through the TP=2 -> TP=1 resume with its Adam moments
def test_a_checkpoint_taken_at_tp2_reloads_at_tp2_and_reshards_to_tp1_and_pp2_with_identical_weights(model_dir,
                                                                                                    tmp_path):
    ckpt = str(tmp_path / "tp2")
    tp2 = run_ranks(model_dir, [("train", None), ("save", ckpt), ("weights", None)], tp=2)
    again = run_ranks(model_dir, [("load", ckpt)], tp=2)
    assert again[0] == 1 and torch.allclose(again[1], tp2[2], atol=1e-6)
    for layout in ({"tp": 1}, {"pp": 2}):
        moved = run_ranks(model_dir, [("load", ckpt), ("weights", None)], **layout)
        assert moved[0] == 1, moved[0]
        assert sorted(moved[1]) == sorted(tp2[1]), layout
        assert all(torch.equal(moved[1][k], tp2[1][k]) for k in tp2[1]), layout


@pytest.mark.slow
def test_a_checkpoint_taken_at_tp2_resumes_at_tp1_with_its_adam_moments_and_continues_like_the_tp2_run(model_dir,
                                                                                                     tmp_path):
    """The optimizer state reshards with the weights: the step after the resume reverses the advantages, so what it
    does depends on the first step's Adam moments (with moments restarted, Adam's first step moves every weight by
    about lr against the gradient; with them, by a small fraction of it)."""
    ckpt = str(tmp_path / "tp2")
    tp2 = run_ranks(model_dir, [("train", None), ("save", ckpt), ("train_reversed", None)], tp=2)
    tp1 = run_ranks(model_dir, [("load", ckpt), ("train_reversed", None)], tp=1)
    assert tp1[0] == 1
    gap = (tp1[2] - tp2[2]).abs().max().item()
    assert gap < 1e-4, f"the TP=1 resume's logprobs after its step differ from the TP=2 run's by {gap}"
    assert (ckpt_file := tmp_path / "tp2" / "trainer" / "rank_00000.pt").exists()
    assert "optimizer" not in torch.load(ckpt_file, weights_only=False)  # the moments live in dist/, sharded


def test_a_checkpoint_interrupted_mid_write_leaves_the_previous_one_the_latest(tmp_path):
    """A crash mid-write (the driver killed) leaves a .partial folder, never the latest; the next save removes it."""
    from glue.loop.checkpoint import Checkpoints

    def trainer_part(folder):
        (tmp_path / "written").write_text(folder)
        open(f"{folder}/weights", "w").write("w")

    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2, interval=2)
    first = checkpoints.save(2, trainer_part, {"version": 2})
    (tmp_path / "checkpoints" / ".step_00000004.partial").mkdir()  # what a driver killed mid-write leaves
    (tmp_path / "checkpoints" / ".step_00000004.partial" / "weights").write_text("half")
    assert checkpoints.latest() == first and Checkpoints.read_state(first) == {"version": 2, "step": 2}
    for step in (4, 6, 8):
        checkpoints.save(step, trainer_part, {"version": step})
    assert [p.name for p in checkpoints.all()] == ["step_00000006", "step_00000008"]  # keep=2, partial cleaned
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    assert [checkpoints.due(s, last=False) for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert Checkpoints(tmp_path / "none", interval=0).due(3, last=True)



def test_a_checkpoint_write_that_fails_is_said_the_previous_stays_the_latest_and_max_failures_in_a_row_stop_the_run(
        tmp_path, capsys):
    """Disk full, as a writer that fails half-way: the run is told in one line, the .partial folder goes, the
    previous checkpoint stays the latest and the next save works; `max_failures` failures in a row raise."""
    from glue.loop.checkpoint import CheckpointFailed, Checkpoints

    def trainer_part(folder):
        open(f"{folder}/weights", "w").write("w")

    def disk_full(folder):
        open(f"{folder}/weights", "w").write("half")
        raise OSError(28, "No space left on device")

    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2, interval=2, max_failures=2)
    first = checkpoints.save(2, trainer_part, {"version": 2})
    assert checkpoints.save(4, disk_full, {"version": 4}) is None
    assert capsys.readouterr().out == (
        "sluice: checkpoint step_00000004 could not be written (OSError: [Errno 28] No space left on device); "
        f"{first} stays the latest; the run goes on (1 of at most 2 failures in a row, run.max_checkpoint_failures)\n")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    assert checkpoints.latest() == first and checkpoints.metrics() == {"fault/checkpoint_failures": 1.0}
    second = checkpoints.save(6, trainer_part, {"version": 6})  # a success starts the count again
    assert checkpoints.latest() == second and checkpoints.save(8, disk_full, {"version": 8}) is None
    with pytest.raises(CheckpointFailed, match=r"^checkpoint step_00000010 could not be written \(OSError: \[Errno "
                                               r"28\] No space left on device\); \S+step_00000006 stays the latest; 2 "
                                               r"checkpoint writes in a row failed \(run.max_checkpoint_failures=2\)$"):
        checkpoints.save(10, disk_full, {"version": 10})
    assert checkpoints.metrics() == {"fault/checkpoint_failures": 3.0}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000006"]

@pytest.mark.slow
def test_a_two_stage_pipeline_checkpoint_resumes_exactly(model_dir, tmp_path):
    # each stage writes its own layers' shards; each stage reloads its own
    ckpt = str(tmp_path / "pp2")
    straight = run_ranks(model_dir, [("train", None), ("save", ckpt), ("train", None)], pp=2)
    resumed = run_ranks(model_dir, [("load", ckpt), ("train", None)], pp=2)
    assert resumed[0] == 1 and resumed[1] == straight[1]
    assert torch.equal(resumed[2], straight[2])


def test_a_checkpoint_of_an_earlier_sluice_with_optimizer_shards_in_its_rank_files_is_refused_with_one_line(tmp_path):
    from types import SimpleNamespace

    from glue.trainer.checkpointing import load_rank, rank_file

    (tmp_path / "trainer").mkdir()
    torch.save({"optimizer": {"optimizers": [], "scheduler": {}}, "precision": "fp32", "version": 3,
                "layout": {"tp": 1}, "torch_rng": torch.get_rng_state()}, rank_file(str(tmp_path), 0))
    worker = SimpleNamespace(rank=0, precision="fp32")
    with pytest.raises(ValueError, match="earlier sluice .* not in dist/"):
        load_rank(worker, str(tmp_path))


def test_the_loop_goes_on_past_a_checkpoint_that_could_not_be_written_and_counts_it(tmp_path):
    """The loop with a checkpoint every step, a trainer whose write at step 2 fails with the disk full: steps 3 and
    4 are trained and checkpointed, step 2 never appears, and the records count the failure."""
    import asyncio
    import json
    import os

    from glue.loop.buffer import RolloutBuffer
    from glue.loop.checkpoint import Checkpoints
    from glue.loop.colocation import Disaggregated
    from glue.loop.controller import LoopHooks, LoopParts, run_loop
    from glue.loop.staleness import StalenessGate
    from glue.loop.stream import RolloutStream
    from glue.metrics.logger import MetricsLogger
    from glue.rollout.manager import RolloutManager
    from helpers.fleet import ScriptedBridge, ScriptedFleet

    class Trainer:
        version = 0

        def train_step(self, batch):
            self.version += 1
            return {}

        def save_checkpoint(self, directory):
            if self.version == 2:
                raise OSError(28, "No space left on device")
            with open(os.path.join(directory, "trainer.txt"), "w") as handle:
                handle.write(f"v{self.version}")

    manager = RolloutManager(function_path="helpers.managers:two_token_group", task_path="helpers.managers:RewardOne",
                             client=None, sampling_params={}, prompts_per_step=2, samples_per_prompt=2, seed=0)
    stream = RolloutStream(manager=manager, gate=StalenessGate(groups_per_step=2, max_staleness=0),
                           buffer=RolloutBuffer(groups_per_step=2, stale_policy="keep"), max_groups=8)
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=5, interval=1)
    engine = Trainer()  # the scripted bridge records the engine's version on it
    parts = LoopParts(stream=stream, trainer=Trainer(), fleet=ScriptedFleet(), phases=Disaggregated(ScriptedBridge(engine)),
                      logger=MetricsLogger(tmp_path / "metrics.jsonl"), checkpoints=checkpoints,
                      hooks=LoopHooks(extra_metrics=checkpoints.metrics))
    assert asyncio.run(run_loop(parts, num_steps=4, loss_cfg=LossConfig())) == 4
    assert [p.name for p in checkpoints.all()] == ["step_00000001", "step_00000003", "step_00000004"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001", "step_00000003", "step_00000004"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fault/checkpoint_failures"]) for r in records] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]
