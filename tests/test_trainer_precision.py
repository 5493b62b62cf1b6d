"""The trainer trains the way megatron-core does (glue.trainer.optim): megatron's DDP and optimizer, bf16 weights with
fp32 main weights, the optimizer state sharded over data-parallel ranks, megatron's learning-rate schedule. Config
checks run here; the training ones in spawned ranks on gloo."""
from __future__ import annotations

import pytest
import torch

from glue.embedded_engine.tiny_model import save_tiny_model
from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import make_batch, run_trainer_ranks
from helpers.trainer_process import run_in_trainer_process, start_worker, stop_worker
from helpers.forkserver import rank_context


# ---- config: what is refused before any rank starts ----
def test_bf16_weights_without_fp32_main_weights_are_refused():
    with pytest.raises(ValueError, match="bf16 weights without fp32 main weights"):
        TrainerConfig(precision="fp32", megatron={"params_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="bf16 weights without fp32 main weights"):
        TrainerConfig(megatron={"params_dtype": "bfloat16", "bf16": False})
    with pytest.raises(ValueError, match="main weights must stay float32"):
        TrainerConfig(precision="bf16", megatron={"main_params_dtype": "bfloat16"})
    assert TrainerConfig(megatron={"params_dtype": "bfloat16"}).requests_bf16()  # auto: trains bf16 + fp32 main


@pytest.mark.parametrize("fields, message", [
    ({"precision": "fp16"}, "trainer.precision must be"),
    ({"lr_decay_style": "cosine"}, "needs trainer.lr_decay_steps"),
    ({"lr_decay_style": "linear", "lr_warmup_steps": 5, "lr_decay_steps": 5}, "needs trainer.lr_decay_steps"),
    ({"lr_warmup_steps": -1}, "lr_warmup_steps must be"),
    ({"min_lr": 1.0, "lr": 0.1}, "min_lr must be in"),
    ({"megatron": {"fp16": True}}, "--fp16"),
    ({"bf16_rounding": "stochastic"}, "trainer.bf16_rounding must be"),
])
def test_bad_precision_and_schedule_settings_name_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**fields)


def test_auto_precision_follows_the_checkpoints_dtype():
    from types import SimpleNamespace

    from glue.trainer.optim import precision_line, resolve_precision

    bf16_ckpt, fp32_ckpt = SimpleNamespace(dtype=torch.bfloat16), SimpleNamespace(torch_dtype="float32")
    assert resolve_precision(TrainerConfig(), bf16_ckpt) == "bf16"
    assert resolve_precision(TrainerConfig(), fp32_ckpt) == "fp32"
    assert resolve_precision(TrainerConfig(megatron={"bf16": True}), fp32_ckpt) == "bf16"
    assert resolve_precision(TrainerConfig(precision="fp32"), bf16_ckpt) == "fp32"
    # widening a bf16 checkpoint is said in the start-up line, never silently
    assert "widened from the checkpoint" in precision_line("fp32", TrainerConfig(precision="fp32"), bf16_ckpt, 1)
    line = precision_line("bf16", TrainerConfig(), bf16_ckpt, 2)
    assert "model weights bfloat16" in line and "float32 main weights" in line and "DP=2" in line
    assert line.endswith("the weight bridge sends bfloat16")
    assert "the weights are the optimizer's main weights" in precision_line("fp32", TrainerConfig(), fp32_ckpt, 1)


def test_megatron_optimizer_flags_reach_the_trainer_and_unsupported_ones_are_refused():
    from launch.args.megatron import check_megatron, route

    assert route({"use_distributed_optimizer": False}) == {"trainer": {"use_distributed_optimizer": False}}
    assert route({"min_lr": 1e-7}) == {"trainer": {"min_lr": 1e-7}}
    runs = {"optimizer": "adam", "bucket_size": 1 << 20}
    assert check_megatron(runs) == runs
    with pytest.raises(ValueError, match=r"trainer.megatron.overlap_param_gather \(--overlap-param-gather\) is not "
                                         "run by this trainer"):
        check_megatron({"overlap_param_gather": True, "optimizer": "adam"})


# ---- training, in spawned ranks ----
def _bf16_steps_scenario(model_dir: str, lr: float, steps: int, fields: dict | None = None) -> dict:
    """bf16 weights and fp32 main weights through `steps` train steps at a small lr (`fields`: more trainer keys)."""
    worker = start_worker(model_dir, LossConfig(), lr=lr, precision="bf16", grad_clip=0.0, **(fields or {}))
    try:
        batch = make_batch()
        part = worker.training.optimizer.chained_optimizers[0]
        main = [p.detach().clone() for g in part.optimizer.param_groups for p in g["params"]]
        weights = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        before = {id(p): p.detach().clone() for p in worker.model.parameters()}
        metrics = [worker.train_step(batch) for _ in range(steps)]
        main_after = [p.detach().clone() for g in part.optimizer.param_groups for p in g["params"]]
        return {"dtypes": sorted({str(p.dtype) for p in worker.model.parameters()}),
                "main_dtypes": sorted({str(p.dtype) for p in main_after}),
                "main_changed": sum(int((a != b).sum()) for a, b in zip(main, main_after)),
                "main_numel": sum(p.numel() for p in main),
                "weights_changed": sum(int((p.detach() != weights[n]).sum())
                                       for n, p in worker.model.named_parameters()),
                "weights_equal_rounded_main": _weights_are_rounded_main(worker),
                "weights_equal_dithered_main": _weights_are_rounded_main(worker, dithered=True),
                "follow": _follow_ratio(worker, before),
                "metrics": metrics}
    finally:
        stop_worker(worker)


def _owned(part, model_param) -> tuple[int, int]:
    if hasattr(part, "shard_fp32_from_float16_groups"):
        owned = part._get_model_param_range_map(model_param)["param"]
        return owned.start, owned.end
    return 0, model_param.numel()


def _follow_ratio(worker, before: dict) -> float:
    """How much of the main weights' drift the bf16 weights followed: sum(bf16 move * drift) / sum(drift^2)."""
    part = worker.training.optimizer.chained_optimizers[0]
    distributed = hasattr(part, "shard_fp32_from_float16_groups")
    models, mains = ((part.model_float16_groups, part.shard_fp32_from_float16_groups) if distributed
                     else (part.float16_groups, part.fp32_from_float16_groups))
    along, norm = 0.0, 0.0
    for model_group, main_group in zip(models, mains):
        for model_param, main_param in zip(model_group, main_group):
            start, end = _owned(part, model_param)
            start_weights = before[id(model_param)].view(-1)[start:end].float()
            drift = main_param.detach().view(-1).float() - start_weights
            along += float((model_param.detach().view(-1)[start:end].float() - start_weights).mul(drift).sum())
            norm += float(drift.square().sum())
    return along / norm


def _weights_are_rounded_main(worker, dithered: bool = False) -> bool:
    """Every bf16 weight equals its fp32 main weight rounded to bf16, to nearest or with the dither of
    `trainer.bf16_rounding: dithered` (the distributed optimizer's shard of the main weights maps onto a range of
    DDP's flat parameter buffer; the non-distributed optimizer holds whole parameters)."""
    from glue.trainer.optim import _salt, dithered_bf16

    part = worker.training.optimizer.chained_optimizers[0]
    distributed = hasattr(part, "shard_fp32_from_float16_groups")
    models, mains = ((part.model_float16_groups, part.shard_fp32_from_float16_groups) if distributed
                     else (part.float16_groups, part.fp32_from_float16_groups))
    for g, (model_group, main_group) in enumerate(zip(models, mains)):
        for i, (model_param, main_param) in enumerate(zip(model_group, main_group)):
            start, end = _owned(part, model_param)
            rounded = dithered_bf16(main_param, start, _salt(0, g, i)) if dithered else \
                main_param.detach().to(torch.bfloat16).view(-1)
            if not torch.equal(model_param.detach().view(-1)[start:end], rounded):
                return False
    return True


@pytest.mark.slow
def test_bf16_trains_bf16_weights_from_fp32_main_weights_that_keep_updates_below_bf16_rounding(tmp_path):
    model = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    out = run_in_trainer_process(_bf16_steps_scenario, model, 1e-6, 3)
    assert out["dtypes"] == ["torch.bfloat16"] and out["main_dtypes"] == ["torch.float32"]
    # Adam moves every weight by about lr per step: far below bf16's spacing near the weights' magnitude, so the
    # bf16 weights barely move, while the main weights keep every update
    assert out["main_changed"] > 0.9 * out["main_numel"]
    assert out["weights_changed"] < 0.1 * out["main_numel"]
    assert out["weights_equal_rounded_main"]
    assert [m["train/lr"] for m in out["metrics"]] == [pytest.approx(1e-6)] * 3


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [True, pytest.param(False, marks=pytest.mark.long)])  # CI time
def test_dithered_bf16_rounding_lets_the_bf16_weights_follow_updates_below_their_spacing(tmp_path, distributed):
    """`trainer.bf16_rounding: dithered`: after each step the bf16 weights are the main weights rounded with the
    fixed dither, bit for bit, and far more of them move than with megatron's round to nearest, which holds almost
    all still at this lr (docs/precision.md: on SmolLM2 this is what lets bf16 learn as fast as fp32)."""
    model = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    fields = {"use_distributed_optimizer": distributed}
    nearest = run_in_trainer_process(_bf16_steps_scenario, model, 1e-6, 3, fields)
    dithered = run_in_trainer_process(_bf16_steps_scenario, model, 1e-6, 3, {**fields, "bf16_rounding": "dithered"})
    assert dithered["weights_equal_dithered_main"] and not dithered["weights_equal_rounded_main"]
    assert nearest["weights_equal_rounded_main"]
    assert dithered["main_changed"] > 0.9 * dithered["main_numel"]
    # projected on the main weights' drift, the dithered bf16 weights move by about the drift; nearest far less
    assert dithered["follow"] == pytest.approx(1.0, abs=0.15) and nearest["follow"] < 0.5, \
        (dithered["follow"], nearest["follow"])
    assert dithered["weights_changed"] > 2 * nearest["weights_changed"]


def test_dithered_bf16_keeps_grid_values_and_moves_weights_in_proportion_to_the_drift():
    from glue.trainer.optim import dithered_bf16

    torch.manual_seed(0)
    grid = (torch.randn(200_000) * 0.05).to(torch.bfloat16).float()
    assert torch.equal(dithered_bf16(grid, 0, 7).float(), grid)  # a weight on the bf16 grid stays
    drift = 2e-5 * torch.randn(grid.numel()).sign()  # far below the spacing (~2e-4 at 0.05): nearest moves few
    moved = dithered_bf16(grid + drift, 0, 7).float() - grid
    nearest = (grid + drift).to(torch.bfloat16).float() - grid
    # projected on the drift, the dithered bf16 change is the drift itself on average (round to nearest: 0.15)
    assert (moved * drift).sum() / (drift * drift).sum() == pytest.approx(1.0, abs=0.05)
    assert (nearest * drift).sum() / (drift * drift).sum() < 0.6
    target = grid + drift
    assert ((grid + moved - target).abs() <= target.abs() * 2 ** -7).all()  # within one ulp of the main weight
    other = dithered_bf16(grid + drift, 0, 8).float() - grid  # another salt, another pattern
    assert not torch.equal(other, moved)
    special = torch.tensor([float("inf"), -float("inf"), -1.0, 0.0])
    assert torch.equal(dithered_bf16(special, 0, 1).float(), special)
    assert dithered_bf16(torch.tensor([float("nan")]), 0, 1).isnan().all()


@pytest.mark.slow
def test_the_learning_rate_follows_megatrons_warmup_and_cosine_schedule(tmp_path):
    model = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    run = run_trainer_ranks(model, 1, make_batch(), steps=5, lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                            lr_decay_style="cosine", lr_decay_steps=4)
    import math

    lrs = [m["train/lr"] for m in run["all_metrics"]]
    expected = [5e-3, 1e-2, 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)), 1e-3, 1e-3]
    assert lrs == pytest.approx(expected)


def test_a_bf16_trainer_gets_bf16_engines_unless_sglang_dtype_is_set():
    from launch.config import load_config
    from launch.plan.run_plan import resolve

    _, plan = resolve(load_config(None, ["trainer.precision=bf16"]))
    assert plan.engine_args[plan.engine_args.index("--dtype") + 1] == "bfloat16"
    _, plan = resolve(load_config(None, ["trainer.precision=bf16", "sglang.dtype=float32"]))
    assert plan.engine_args.count("--dtype") == 1 and "float32" in plan.engine_args
    _, plan = resolve(load_config(None, []))  # auto: engines' own auto follows the same checkpoint
    assert "--dtype" not in plan.engine_args


def test_dry_run_refuses_bf16_weights_without_main_weights_in_one_line(capsys):
    from launch.cli import main

    assert main(["--dry-run", "--params-dtype", "bfloat16", "trainer.precision=fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "bf16 weights without fp32 main weights" in err and "\n" not in err


def _resume_main(rank: int, world: int, ports: tuple[int, int], model: str, cfg: TrainerConfig, root: str,
                 results) -> None:
    """Train 1 step, checkpoint, train 2 more (run A); a fresh worker loads the checkpoint and trains the same 2
    steps (run B). Both report their weights and main weights."""
    import pickle

    from glue.trainer.worker import TrainerWorker
    from helpers.trainer import make_batch

    def state(w) -> dict:
        part = w.training.optimizer.chained_optimizers[0]
        return {"weights": {n: p.detach().clone() for n, p in w.model.named_parameters()},
                "main": [p.detach().clone() for g in part.optimizer.param_groups for p in g["params"]],
                "lr": [m["train/lr"] for m in w.steps]}

    out = {}
    for run in ("A", "B"):
        worker = TrainerWorker(model_path=model, cfg=cfg, loss_cfg=LossConfig(), rank=rank, world_size=world)
        worker.initialize("127.0.0.1", ports[run == "B"])
        if run == "A":
            worker.train_step(make_batch())
            worker.save_checkpoint(root)
        else:
            assert worker.load_checkpoint(root) == 1
        worker.steps = [worker.train_step(make_batch()) for _ in range(2)]
        out[run] = state(worker)
        worker.shutdown()
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    results.put(pickle.dumps((rank, out)))


@pytest.mark.slow
def test_a_bf16_run_resumes_exactly_with_its_sharded_main_weights_adam_state_and_schedule(tmp_path):
    """Issue 29 item 4: fp32 main weights and the distributed optimizer's shards (DP=2) are checkpointed per rank,
    so a resumed bf16 run continues bit for bit (weights, main weights, warm-up position)."""
    from helpers.trainer import _free_port, results_of_ranks

    model = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    cfg = TrainerConfig(lr=1e-2, precision="bf16", data_parallel_size=2, micro_batch_size=3, lr_warmup_steps=3,
                        num_cpus_per_worker=1)
    ctx = rank_context()
    results = ctx.Queue()
    ports = (_free_port(), _free_port())
    procs = [ctx.Process(target=_resume_main, args=(r, 2, ports, model, cfg, str(tmp_path / "ckpt"), results))
             for r in range(2)]
    outs = results_of_ranks(procs, results)
    for rank, (out,) in outs.items():
        a, b = out["A"], out["B"]
        assert a["lr"] == b["lr"] == pytest.approx([2 / 3 * 1e-2, 1e-2])  # the schedule resumed at step 2
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"]), f"rank {rank} weights"
        assert all(torch.equal(x, y) for x, y in zip(a["main"], b["main"])), f"rank {rank} main weights"
        assert any(not torch.equal(x.to(torch.bfloat16).float(), x) for x in a["main"])  # fp32 bits beyond bf16
