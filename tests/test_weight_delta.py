"""Delta sync (`sync.delta: true`): a bucket travels as its changed elements' positions and values, the engines scatter
them into their weights and end bit-identical to the source; the bytes sent for a sparse change are a small fraction of
a whole sync; a sync that fails midway makes the next one whole; engines that cannot apply deltas are refused."""
from __future__ import annotations

import pytest
import torch

from glue.loop.config import SyncConfig
from weight_sync.bridge import WeightSyncError, make_bridge
from weight_sync.buckets import pack_bucket, plan_buckets, unpack_bucket
from weight_sync.delta import (DELTA_LOAD_FORMAT, INDEX_SUFFIX, VALUES_SUFFIX, apply_delta, delta_layout,
                               delta_nbytes, delta_tensors, diff_bucket)
from weight_sync.engine_calls import weight_checksums
from weight_sync.buckets import tensor_checksum
from weight_sync.sender import LocalWeightSource


def packed(tensors: dict[str, torch.Tensor]):
    layout = plan_buckets([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()],
                          1 << 30)[0]
    return layout, pack_bucket(layout, tensors, torch.empty(layout.nbytes, dtype=torch.uint8)).clone()


def perturb(tensors: dict[str, torch.Tensor], fraction: float, seed: int) -> int:
    """Add noise to `fraction` of every tensor's elements (a sparse training step); returns how many changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for tensor in tensors.values():
            flat = tensor.view(-1)
            chosen = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * fraction))]
            flat[chosen] += torch.randn(chosen.numel(), generator=gen).to(flat.dtype) * 0.5 + 0.25
            changed += chosen.numel()
    return changed


def test_a_delta_scattered_into_the_baseline_gives_the_current_bucket_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    base = {"c.weight": torch.randn(5, 3, generator=gen, dtype=torch.float64),  # three dtypes in one bucket
            "a.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
            "b.bias": torch.randn(7, generator=gen)}
    current = {n: t.clone() for n, t in base.items()}
    current["a.weight"][3, 5] = 1.5
    current["a.weight"][60, 0] = -0.0  # a sign bit alone counts as a change
    current["c.weight"][4, 2] = 9.0
    layout, old = packed(base)
    _, new = packed(current)
    changes = diff_bucket(layout, new, old)
    assert len(layout.slots) == 3
    assert [(s.name, p.tolist()) for s, p in changes] == [("c.weight", [14]), ("a.weight", [3 * 32 + 5, 60 * 32])]
    assert delta_nbytes(layout, changes) == 2 * (4 + 2) + (4 + 8)  # int32 positions + values in their dtype
    named = delta_tensors(layout, new, changes)
    wire = delta_layout(0, named)
    flat = pack_bucket(wire, dict(named), torch.empty(wire.nbytes, dtype=torch.uint8))
    model = torch.nn.Module()
    for name, tensor in base.items():  # parameters named like the checkpoint
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor.clone()))
    targets = {name: getattr(model, name.replace(".", "_")) for name in base}
    assert apply_delta(model, unpack_bucket(wire, flat), targets) == ["c.weight", "a.weight"]
    for name, tensor in current.items():
        assert tensor_checksum(targets[name].detach()) == tensor_checksum(tensor), name


def test_the_delta_loader_refuses_a_bad_delta_before_writing_anything():
    model = torch.nn.Linear(4, 2, bias=False)
    before = model.weight.detach().clone()
    good = [("weight" + INDEX_SUFFIX, torch.tensor([0, 1], dtype=torch.int32)),
            ("weight" + VALUES_SUFFIX, torch.tensor([1.0, 2.0]))]
    with pytest.raises(ValueError, match="outside its 8 elements"):
        apply_delta(model, good + [("bias" + INDEX_SUFFIX, torch.tensor([9], dtype=torch.int32)),
                                   ("bias" + VALUES_SUFFIX, torch.tensor([1.0]))], {"weight": model.weight,
                                                                                      "bias": torch.zeros(8)})
    with pytest.raises(ValueError, match="no weight 'missing'"):
        apply_delta(model, good + [("missing" + INDEX_SUFFIX, torch.tensor([0], dtype=torch.int32)),
                                   ("missing" + VALUES_SUFFIX, torch.tensor([1.0]))])
    with pytest.raises(ValueError, match="float64 values for a torch.float32 weight"):
        apply_delta(model, [good[0], ("weight" + VALUES_SUFFIX, torch.tensor([1.0, 2.0], dtype=torch.float64))])
    assert torch.equal(model.weight.detach(), before)
    apply_delta(model, good)
    assert model.weight.detach().view(-1)[:2].tolist() == [1.0, 2.0]


@pytest.fixture(scope="module")
def engines(engine_processes, tiny_model_dir) -> list[str]:
    return [engine_processes.start(tiny_model_dir), engine_processes.start(tiny_model_dir)]


def model_source(tiny_model_dir) -> LocalWeightSource:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()})


def source_sums(source: LocalWeightSource) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in source.tensors.items()}


def test_a_chain_of_delta_syncs_leaves_engines_bit_identical_and_sends_a_fraction_of_the_bytes(engines,
                                                                                               tiny_model_dir):
    source = model_source(tiny_model_dir)
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000, verify="full", delta=True),
                         source=source, engine_urls=engines)
    try:
        assert len(bridge.layouts) >= 8
        first = bridge.sync(1)  # no baseline yet: whole
        assert first["bytes_sent"] == first["bytes_full"] and first["delta_changed_frac"] == 1.0
        elements = sum(t.numel() for t in source.tensors.values())
        for version in (2, 3, 4):  # a sparse "step" before each sync
            changed = perturb(source.tensors, 0.01, seed=version)
            figures = bridge.sync(version)
            assert figures["delta_changed_frac"] == pytest.approx(changed / elements, rel=0.01)
            assert figures["bytes_sent"] < 0.05 * figures["bytes_full"], figures  # 1% of elements, 8 bytes each
            for url in engines:  # verify: full compared every tensor already; and once more here, by hand
                assert weight_checksums(url, 30) == source_sums(source)
        with torch.no_grad():  # a dense step: every bucket goes whole, by its own choice
            for tensor in source.tensors.values():
                tensor.add_(0.125)
        dense = bridge.sync(5)
        assert dense["bytes_sent"] == dense["bytes_full"] and dense["delta_changed_frac"] > 0.9
        quiet = bridge.sync(6)  # nothing changed: empty deltas, only the version moves
        assert quiet["bytes_sent"] == 0 and quiet["delta_changed_frac"] == 0.0
        assert [weight_checksums(url, 30) for url in engines] == [source_sums(source)] * 2
    finally:
        bridge.close()


class TwoSources(LocalWeightSource):
    """A state dict split between two parallel sources (as two pipeline stages would send it), in one process."""

    def weight_source_plan(self) -> list[tuple[int, list[str]]]:
        names = list(self.tensors)
        return [(0, names[: len(names) // 2]), (1, names[len(names) // 2:])]


def test_parallel_sources_send_deltas_and_engines_end_bit_identical(engines, tiny_model_dir):
    source = TwoSources(model_source(tiny_model_dir).tensors)
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000, verify="full", delta=True,
                                    sources="parallel"), source=source, engine_urls=engines)
    try:
        assert len(bridge.transport.parts) == 2
        bridge.sync(1)
        for version in (2, 3):
            perturb(source.tensors, 0.01, seed=20 + version)
            figures = bridge.sync(version)
            assert figures["bytes_sent"] < 0.05 * figures["bytes_full"], figures
        assert [weight_checksums(url, 30) for url in engines] == [source_sums(source)] * 2
    finally:
        bridge.close()


@pytest.mark.parametrize("where", ["transfer", "verify", "transfer_retried"])
def test_an_engine_failing_midway_through_a_delta_sync_makes_the_next_sync_whole_and_exact(engines, tiny_model_dir,
                                                                                          monkeypatch, where):
    """transfer: engine 1 fails its fourth bucket (the broadcast is aborted, its group dropped); verify: every bucket
    landed but an engine then reports the wrong version (the group stays, with the source's baselines); both with
    sync.max_retries 0, so the failure surfaces. transfer_retried: the same transfer fault with the default retries:
    the sync goes again on groups built anew, whole (no delta against baselines an engine may not hold), and exact."""
    import weight_sync.bridge as bridge_module
    import weight_sync.transports as transports

    source = model_source(tiny_model_dir)
    retries = {} if where == "transfer_retried" else {"max_retries": 0}
    bridge = make_bridge(SyncConfig(transport="broadcast", bucket_bytes=40_000, verify="full", delta=True, **retries),
                         source=source, engine_urls=engines)
    real_call, real_check, calls = transports.call_update, bridge_module.check_versions, []

    def fails_on_the_fourth_bucket(url, route, payload, timeout_s, key=None):
        if route == "/update_weights_from_distributed" and url == engines[1]:
            calls.append(url)
            if len(calls) == 4:
                raise WeightSyncError(f"engine {url} failed {route}: injected")
        return real_call(url, route, payload, timeout_s, key)

    def reports_an_old_version(urls, version, timeout_s, key=None):
        raise WeightSyncError(f"engine {urls[1]} reports weight_version '2' after a sync to {version!r}: injected")

    try:
        bridge.sync(1)
        perturb(source.tensors, 0.01, seed=11)
        bridge.sync(2)
        assert bridge.delta_ready
        perturb(source.tensors, 0.01, seed=12)
        if where == "transfer_retried":
            monkeypatch.setattr(transports, "call_update", fails_on_the_fourth_bucket)
            retried = bridge.sync(3)
            assert len(calls) > 4 and bridge.sync_retries == 1
            assert retried["bytes_sent"] == retried["bytes_full"]
            assert [weight_checksums(url, 30) for url in engines] == [source_sums(source)] * 2
            return
        if where == "transfer":
            monkeypatch.setattr(transports, "call_update", fails_on_the_fourth_bucket)
        else:
            monkeypatch.setattr(bridge_module, "check_versions", reports_an_old_version)
        with pytest.raises(WeightSyncError, match="injected"):
            bridge.sync(3)
        monkeypatch.setattr(transports, "call_update", real_call)
        monkeypatch.setattr(bridge_module, "check_versions", real_check)
        assert not bridge.delta_ready
        # Nothing changed since: a delta against the source's baselines (which hold the failed sync's buckets)
        # would send nothing for buckets an engine may never have applied. The sync after a failure is whole.
        after = bridge.sync(3)
        assert after["bytes_sent"] == after["bytes_full"]
        assert [weight_checksums(url, 30) for url in engines] == [source_sums(source)] * 2
        perturb(source.tensors, 0.01, seed=13)
        again = bridge.sync(4)  # and deltas resume once a sync was confirmed
        assert again["bytes_sent"] < 0.05 * again["bytes_full"]
        assert [weight_checksums(url, 30) for url in engines] == [source_sums(source)] * 2
    finally:
        bridge.close()


def test_delta_sync_is_refused_before_any_weight_moves_for_engines_that_cannot_apply_deltas(
        engine_processes, tiny_model_dir):
    strict = engine_processes.start(tiny_model_dir, "--sglang-strict")
    with pytest.raises(WeightSyncError, match="sync.delta: true needs engines that apply delta buckets"):
        make_bridge(SyncConfig(transport="broadcast", verify="auto", delta=True), source=model_source(tiny_model_dir),
                    engine_urls=[strict])
    with pytest.raises(ValueError, match="sync.delta: true needs sync.transport: broadcast"):
        SyncConfig(transport="ipc", delta=True)
    # SGLang 0.5.x's /update_weights_from_distributed never reaches a custom loader: the strict stand-in refuses a
    # delta bucket's request outright rather than receiving tensors it would hand to the model's own loader
    from helpers.engines import call

    assert call(strict, "/begin_weight_update", {})[0] == 200
    status, answer = call(strict, "/update_weights_from_distributed", {
        "names": ["lm_head.weight" + INDEX_SUFFIX, "lm_head.weight" + VALUES_SUFFIX], "dtypes": ["int32", "float32"],
        "shapes": [[1], [1]], "group_name": "none", "load_format": DELTA_LOAD_FORMAT})
    assert status == 400 and not answer["success"] and DELTA_LOAD_FORMAT in answer["message"]
    assert call(strict, "/end_weight_update", {})[0] == 200
