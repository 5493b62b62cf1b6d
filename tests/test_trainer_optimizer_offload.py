"""`--optimizer-cpu-offload`: megatron-core's hybrid CPU/device optimizer (HybridDeviceOptimizer) on the distributed
optimizer's precision-aware path. On CPU (glue.trainer.cpu_compat) the model's weight shards stand for the device
tensors and the optimizer's host copies for the host ones, so its split by `--optimizer-offload-fraction`, the
gradient copies, the host sub-optimizer and the copy back into the model all run. It updates the main weights as the
device optimizer does within fp32 rounding, keeps the offloaded share of the main weights and Adam moments in its
host sub-optimizer, outside the device state; the settings it cannot run are refused first. Checkpoint and exact
resume: tests/test_checkpoint.py; the plan's figures: tests/test_memory_plan.py."""
from __future__ import annotations

import pytest
import torch

from glue.trainer.config import TrainerConfig
from loss import LossConfig
from helpers.trainer import make_batch, run_trainer_ranks
from helpers.trainer_process import run_in_trainer_process, start_worker, stop_worker

OFFLOAD = {"optimizer_cpu_offload": True}


# ---- config: what is refused before any rank starts ----
@pytest.mark.parametrize("fields, message", [
    ({"megatron": {"optimizer_offload_fraction": 0.5}}, "needs --optimizer-cpu-offload"),
    ({"megatron": {**OFFLOAD, "optimizer_offload_fraction": 1.5}}, r"must be in \[0, 1\]"),
    ({"precision": "fp32", "megatron": OFFLOAD}, "set trainer.precision: bf16"),
    ({"use_distributed_optimizer": False, "megatron": OFFLOAD}, "set trainer.use_distributed_optimizer: true"),
    ({"bf16_rounding": "dithered", "megatron": OFFLOAD}, "set trainer.bf16_rounding: nearest"),
])
def test_an_offloaded_optimizer_the_trainer_cannot_run_is_refused_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**fields)


def test_the_offloaded_share_is_all_of_the_optimizer_state_unless_a_fraction_is_given():
    assert TrainerConfig().optimizer_offload_fraction() == 0.0
    assert TrainerConfig(megatron=OFFLOAD).optimizer_offload_fraction() == 1.0  # megatron-core's own default is 0
    assert TrainerConfig(megatron={**OFFLOAD, "optimizer_offload_fraction": 0.25}).optimizer_offload_fraction() == 0.25


def test_the_offload_flags_reach_the_trainers_megatron_settings_and_are_not_refused():
    from launch.args.megatron import check_megatron, route

    values = {**OFFLOAD, "optimizer_offload_fraction": 0.5, "overlap_cpu_optimizer_d2h_h2d": True}
    assert route(values) == {"trainer": {"megatron": values}}
    assert check_megatron(values) == values  # not refused as never run


# ---- training, in a spawned process ----
def _main_weights(part) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fp32 main weights, the model's bf16 shards they belong to) of a DistributedOptimizer, in the same order with
    and without offload: the hybrid optimizer holds the main weight of each shard (a host copy when offloaded)."""
    hybrid = getattr(part.optimizer, "param_to_fp32_param", None)
    mains, shards = [], []
    for shard_group, main_group in zip(part.shard_float16_groups, part.shard_fp32_from_float16_groups):
        for shard, main in zip(shard_group, main_group):
            mains.append((hybrid[shard] if hybrid is not None else main).detach().clone())
            shards.append(shard.detach().clone())
    return mains, shards


def _host_side(worker, part) -> dict:
    """Where the hybrid optimizer keeps its state: elements per sub-optimizer, and whether any host tensor shares
    storage with the model's weights or DDP's buffers."""
    hybrid = part.optimizer
    host = [p for inner in hybrid.cpu_optimizers for group in inner.param_groups for p in group["params"]]
    host_state = [v for inner in hybrid.cpu_optimizers for p in host if p in inner.state
                  for v in inner.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
    device = [p for group in (hybrid.gpu_optimizer.param_groups if hybrid.gpu_optimizer else [])
              for p in group["params"]]
    module = worker.training.module
    model_storages = {t.untyped_storage().data_ptr() for b in module.buffers for t in (b.param_data, b.grad_data)}
    model_storages |= {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
    return {"host_numel": sum(p.numel() for p in host), "device_numel": sum(p.numel() for p in device),
            "host_state_keys": sorted({k for inner in hybrid.cpu_optimizers for s in inner.state.values() for k in s}),
            "host_devices": sorted({t.device.type for t in host + host_state}),
            "host_in_model_storage": any(t.untyped_storage().data_ptr() in model_storages for t in host + host_state),
            "master_is_host_copy": all(hybrid.state[hybrid.cpu_copys_map_gpu_param[p]]["master_param"] is p
                                       for p in host)}


def _offload_scenario(model_dir: str, fractions: tuple[float, ...]) -> dict:
    """Two bf16 train steps (clipped: the gradient norm exceeds grad_clip 1) with megatron's device optimizer, then
    with each offload fraction (overlapped host copies below 1, as slime's recipes run it)."""
    out = {}
    for fraction in (0.0, *fractions):
        megatron = {**OFFLOAD, "optimizer_offload_fraction": fraction,
                    "overlap_cpu_optimizer_d2h_h2d": fraction < 1} if fraction else {}
        worker = start_worker(model_dir, LossConfig(), precision="bf16", adam_eps=1e-5, megatron=megatron)
        try:
            batch = make_batch()
            norms = [worker.train_step(batch)["train/grad_norm"] for _ in range(2)]
            part = worker.training.optimizer.chained_optimizers[0]
            mains, shards = _main_weights(part)
            out[fraction] = {"norms": norms, "mains": mains, "shards": shards,
                             "device_bytes": worker.training_state_bytes(),
                             "host": _host_side(worker, part) if fraction else None}
        finally:
            stop_worker(worker)
    return out


def test_an_offloaded_optimizer_updates_the_main_weights_like_the_device_optimizer_and_keeps_them_on_the_host(
        tiny_model_dir):
    runs = run_in_trainer_process(_offload_scenario, tiny_model_dir, (1.0, 0.5))
    device = runs[0.0]
    assert min(device["norms"]) > 1.0  # both steps clip, which reads the precision-aware path's decoupled_grad
    total = sum(m.numel() for m in device["mains"])
    for fraction in (1.0, 0.5):
        run, host = runs[fraction], runs[fraction]["host"]
        for a, b in zip(run["norms"], device["norms"]):
            assert abs(a - b) <= 1e-6 * b, (fraction, run["norms"], device["norms"])
        gap = max((m - d).abs().max().item() for m, d in zip(run["mains"], device["mains"]))
        assert gap < 1e-6, f"fraction {fraction}: main weights differ from the device optimizer's by {gap}"
        # the model's bf16 shards are the updated main weights rounded: copied back from where they were updated
        assert all(torch.equal(s, m.bfloat16()) for s, m in zip(run["shards"], run["mains"])), fraction
        # the offloaded share: main weights and both moments in the host sub-optimizer(s), apart from the model
        assert host["host_numel"] + host["device_numel"] == total
        assert host["host_numel"] >= fraction * total  # megatron moves whole shards until it has the share
        assert host["host_state_keys"] == ["exp_avg", "exp_avg_sq", "master_param", "step"]
        assert host["host_devices"] == ["cpu"] and host["master_is_host_copy"]
        assert not host["host_in_model_storage"]
        # each offloaded element leaves the device its fp32 main weight and two fp32 moments: 12 bytes
        assert device["device_bytes"] - run["device_bytes"] == 12 * host["host_numel"], fraction
    assert runs[1.0]["host"]["device_numel"] == 0
    assert 0 < runs[0.5]["host"]["device_numel"] <= total / 2


@pytest.mark.long  # 17 s; the one-rank comparison above stays in `make test`
def test_an_offloaded_optimizer_trains_experts_over_ep2_and_dense_weights_over_dp2_like_the_device_optimizer(
        tiny_moe_model_dir):
    """Two ranks: megatron chains a dense and an expert optimizer, each a hybrid one over its own DP shards."""
    layout = dict(data_parallel_size=2, expert_model_parallel_size=2, precision="bf16", adam_eps=1e-5, steps=2)
    device = run_trainer_ranks(tiny_moe_model_dir, 1, make_batch(), **layout)
    offloaded = run_trainer_ranks(tiny_moe_model_dir, 1, make_batch(), megatron={
        **OFFLOAD, "optimizer_offload_fraction": 0.5}, **layout)
    assert (device["after"] - device["before"]).abs().max().item() > 0.1  # the two steps moved the logprobs
    norms = [(m["train/grad_norm"], o["train/grad_norm"])
             for m, o in zip(device["all_metrics"], offloaded["all_metrics"])]
    assert all(abs(a - b) <= 1e-6 * a for a, b in norms), norms
    assert (offloaded["after"] - device["after"]).abs().max().item() < 1e-5
    for name, weight in device["weights"].items():  # bf16: equal up to one rounding of the main weights
        assert torch.allclose(offloaded["weights"][name].float(), weight.float(), rtol=2**-8, atol=0), name
