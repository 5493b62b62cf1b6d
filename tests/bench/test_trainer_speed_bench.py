"""`make bench` trainer_speed: what the fused core attention and the chunked logprobs change on the CPU the CI runs,
one megatron-core rank on gloo. Writes bench-results/trainer_speed.json:
- `packed_t2_bytes`: bytes of tensors of >= T^2 elements allocated in a packed train step of 2,048-token rows
  (target 0), with megatron's unfused attention's figure beside it;
- `ops_per_layer`: ops per transformer layer per micro-batch, forward + backward, from the op counts of a 2- and a
  4-layer model, for megatron's unfused path (`before`), sluice's (`after`) and sluice's with `trainer.compile`
  (`compiled`); counted by torch's profiler (the only counter that sees compiled code): aten ops as their callers
  call them plus compiled kernels (target after <= 0.5 x before, `ops_ratio`);
- `launches_per_layer`: of those, the work a GPU would launch a kernel for: aten ops that do work themselves (no
  views, no allocations, no no-op casts) and compiled kernels;
- `launches_per_layer_bf16`: the launches with trainer.precision bf16 (on CPU a mixed-dtype elementwise op casts
  with a copy of its own, which a CUDA kernel does inside: the eager paths' CPU counts run high);
- `dispatch_ops_per_layer`: the eager paths' ops as a Python dispatch mode sees them (the measure earlier runs
  reported; it cannot see compiled code);
- `logprob_peak_extra_bytes` vs `logprob_full_fp32_bytes` (tokens x vocab / TP x 4; target ratio <= 0.25);
- `packed_vs_padded`: train tokens/s (median of five steps) of the same spread batch packed (eager and compiled) and
  padded.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO_ROOT
from glue.types import Sample, TrainBatch
from loss import LossConfig
from helpers.trainer_process import run_in_trainer_process

pytestmark = pytest.mark.bench

OUT = REPO_ROOT / "bench-results" / "trainer_speed.json"
ROW = 2048  # packed row width of the T^2 census
MODEL = dict(family="qwen3", vocab_size=1024, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
OPS_ROW, OPS_SAMPLES = 512, 4
# the MoE row's model: routed experts of a quarter of intermediate_size (64), top 2, at each expert count
MOE_MODEL = dict(family="qwen3_moe", vocab_size=1024, hidden_size=128, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, moe_top_k=2)
MOE_EXPERTS = (8, 32, 128)  # the op-count micro-batch: one packed row of four samples


# ops that only make a new view of a tensor's storage: counted in `dispatch_ops_per_layer`
VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "expand", "detach", "slice",
            "select", "split", "split_with_sizes", "alias", "lift_fresh", "as_strided", "_reshape_alias"}
# aten ops that launch no kernel of their own: views, allocations, casts that may be no-ops (a real cast's copy_
# is counted), p = 0 dropout
NO_LAUNCH = VIEW_OPS | {"reshape", "chunk", "narrow", "view_as", "expand_as", "flatten", "unflatten", "to",
                        "contiguous", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                        "resolve_conj", "resolve_neg", "lift_fresh_copy", "dropout"}

# aten ops that are one kernel on a GPU and a loop of other aten ops in torch's CPU implementation: torch's grouped
# matrix product runs one mm per group (and reads each group's end) on CPU, one grouped GEMM kernel on CUDA
ONE_KERNEL = {"aten::_grouped_mm"}


class OpCount(TorchDispatchMode):
    """Counts aten ops dispatched while entered (in-place ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _is_compiled_kernel(name: str) -> bool:
    return "cpp_fused" in name or "triton_" in name


def profiled_counts(events) -> tuple[int, int]:
    """(ops, launches) of a torch.profiler trace: ops are the aten ops no other aten op called plus compiled
    kernels; launches are the events that do work themselves (a compiled kernel, or an aten op outside NO_LAUNCH
    none of whose callees does work), an op of ONE_KERNEL being one launch whatever it calls on CPU."""
    def works(event) -> bool:
        return (_is_compiled_kernel(event.name) or (event.name.startswith("aten::")
                                                    and event.name[6:] not in NO_LAUNCH)) and not in_one_kernel(event)

    def callee_works(event) -> bool:
        return event.name not in ONE_KERNEL and any(works(child) or callee_works(child)
                                                    for child in event.cpu_children)

    def in_one_kernel(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and parent.name not in ONE_KERNEL:
            parent = parent.cpu_parent
        return parent is not None

    def called_by_aten(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is not None

    ops = sum(1 for e in events if _is_compiled_kernel(e.name) or (e.name.startswith("aten::")
                                                                   and not called_by_aten(e)))
    launches = sum(1 for e in events if works(e) and not callee_works(e))
    return ops, launches


class LargeAllocations(TorchDispatchMode):
    """Bytes of every fresh tensor of at least `elements` elements that an aten op returns while entered."""

    def __init__(self, elements: int) -> None:
        super().__init__()
        self.elements, self.bytes = elements, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.elements and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def batch_of(lengths: list[int], vocab: int, seed: int = 0) -> TrainBatch:
    """Samples of random tokens with these total lengths (prompt 8), rewards 0, 1, ... (advantage = reward - mean)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(2, vocab, (n,), generator=gen).tolist()
        s = Sample(prompt_tokens=tokens[:8], reward=float(i), index=i)
        s.append_response(tokens[8:], [-7.0] * (n - 8), version=0)
        samples.append(s)
    mean = (len(lengths) - 1) / 2
    return TrainBatch.from_samples(samples, [i - mean for i in range(len(lengths))])


def _start(model_dir: str, **fields):
    from helpers.trainer_process import start_worker

    return start_worker(model_dir, LossConfig(old_logprobs_from="rollout"), **fields)


def _ops_scenario(model_dir: str, backend: str, compiled: bool = False, precision: str = "fp32",
                  megatron: dict | None = None) -> dict:
    """Op counts (profiled ops and launches, and without compile the dispatched ops) of one packed micro-batch's
    forward + backward (logprobs summed) with `backend`, trainer.compile `compiled`, trainer.precision and further
    megatron flags."""
    import torch._inductor.config

    from glue.trainer import model as trainer_model
    from helpers.trainer_process import stop_worker

    torch._inductor.config.cpp.enable_kernel_profile = True  # compiled CPU kernels appear in the profiler
    worker = _start(model_dir, max_tokens_per_micro_batch=OPS_ROW,
                    megatron={"attention_backend": backend, **(megatron or {})}, compile=compiled, precision=precision)
    span = OPS_ROW // OPS_SAMPLES
    tokens = torch.randint(2, MODEL["vocab_size"], (1, OPS_ROW))
    seq_ids = torch.arange(OPS_SAMPLES).repeat_interleave(span)[None]
    positions = torch.arange(span).repeat(OPS_SAMPLES)[None]

    def step() -> None:
        logits = trainer_model.forward_logits(worker.model, tokens, positions, seq_ids)
        trainer_model.token_logprobs(logits, tokens, 1.0, seq_ids).sum().backward()

    for _ in range(2):  # warm-up: lazy buffers, rope tables, compiled graphs
        step()
    with torch.profiler.profile() as profile:
        step()
    counts = dict(zip(("ops", "launches"), profiled_counts(profile.events())))
    if not compiled:  # a dispatch mode turns torch.compile off
        counter = OpCount()
        with counter:
            step()
        counts["dispatch_ops"] = counter.count
    stop_worker(worker)
    return counts


def _census_scenario(model_dir: str, backend: str) -> int:
    from helpers.trainer_process import stop_worker

    worker = _start(model_dir, max_tokens_per_micro_batch=ROW, megatron={"attention_backend": backend})
    census = LargeAllocations(ROW * ROW)
    with census:
        worker.train_step(batch_of([ROW // 4] * 4, MODEL["vocab_size"]))
    stop_worker(worker)
    return census.bytes


def _throughput_scenario(model_dir: str, fields: dict, lengths: list[int]) -> float:
    from helpers.trainer_process import stop_worker

    worker = _start(model_dir, **fields)
    batch = batch_of(lengths, MODEL["vocab_size"])
    worker.train_step(batch)  # warm-up
    seconds = []
    for _ in range(5):
        started = time.perf_counter()
        worker.train_step(batch)
        seconds.append(time.perf_counter() - started)
    stop_worker(worker)
    return sum(lengths) / sorted(seconds)[2]  # the median step


def _logprob_memory_scenario(tokens: int, vocab: int) -> dict:
    """Peak bytes the chunked logprobs + entropy allocate in forward + backward beyond the logits' own gradient."""
    from glue.trainer.logprobs import token_logprobs_and_entropy
    from helpers.trainer_process import stop_worker
    from tensor_census import TensorCensus

    from glue.embedded_engine.tiny_model import save_tiny_model
    import tempfile

    worker = _start(save_tiny_model(tempfile.mkdtemp(), family="qwen3"))  # for the TP group of one
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (1, tokens))
    census = TensorCensus()
    with census:
        logprobs, entropy = token_logprobs_and_entropy(logits, ids, 1.0, with_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
    stop_worker(worker)
    gradient = logits.numel() * logits.element_size()
    return {"logprob_peak_extra_bytes": census.peak - gradient, "logprob_full_fp32_bytes": tokens * vocab * 4,
            "logits_gradient_bytes": gradient}


def write_report(fields: dict) -> None:
    """`fields` into bench-results/trainer_speed.json, beside what the other trainer_speed test wrote there."""
    report = json.loads(OUT.read_text()) if OUT.exists() else {}
    report.update(fields)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(fields, indent=2))


def test_trainer_speed(tmp_path):
    from glue.embedded_engine.tiny_model import save_tiny_model

    dirs = {n: save_tiny_model(str(tmp_path / f"l{n}"), num_layers=n, **MODEL) for n in (2, 4)}
    paths = {"before": ("local", False), "after": ("auto", False), "compiled": ("auto", True)}
    counts = {path: {n: run_in_trainer_process(_ops_scenario, dirs[n], *args) for n in (2, 4)}
              for path, args in paths.items()}
    per_layer = {measure: {path: (counts[path][4][measure] - counts[path][2][measure]) / 2
                           for path in paths if measure in counts[path][2]}
                 for measure in ("ops", "launches", "dispatch_ops")}
    bf16 = {path: {n: run_in_trainer_process(_ops_scenario, dirs[n], *args, "bf16")["launches"] for n in (2, 4)}
            for path, args in paths.items()}
    per_layer["launches_bf16"] = {path: (bf16[path][4] - bf16[path][2]) / 2 for path in paths}
    t2 = {backend: run_in_trainer_process(_census_scenario, dirs[2], backend) for backend in ("auto", "local")}
    lengths = [64, 96, 128, 192, 256, 384, 512, 512, 80, 160, 320, 448]
    throughput = {"packed_2048": run_in_trainer_process(_throughput_scenario, dirs[2],
                                                        {"max_tokens_per_micro_batch": 2048}, lengths),
                  "packed_2048_compiled": run_in_trainer_process(
                      _throughput_scenario, dirs[2], {"max_tokens_per_micro_batch": 2048, "compile": True}, lengths),
                  "padded_4": run_in_trainer_process(_throughput_scenario, dirs[2], {"micro_batch_size": 4}, lengths)}
    memory = run_in_trainer_process(_logprob_memory_scenario, 16384, 32000)  # the budget auto gave on a GPU
    report = {
        "packed_t2_bytes": t2["auto"], "packed_t2_bytes_unfused_reference": t2["local"], "packed_row_tokens": ROW,
        "ops_per_layer": per_layer["ops"], "launches_per_layer": per_layer["launches"],
        "dispatch_ops_per_layer": per_layer["dispatch_ops"], "launches_per_layer_bf16": per_layer["launches_bf16"],
        "ops_ratio": {path: round(per_layer["ops"][path] / per_layer["ops"]["before"], 3)
                      for path in ("after", "compiled")},
        "ops_micro_batch": f"one packed row of {OPS_ROW} tokens, {OPS_SAMPLES} samples",
        **memory, "logprob_ratio": memory["logprob_peak_extra_bytes"] / memory["logprob_full_fp32_bytes"],
        "packed_vs_padded": {k: round(v, 1) for k, v in throughput.items()},
        "targets": {"packed_t2_bytes": 0, "ops_after_over_before": 0.5, "logprob_ratio": 0.25},
    }
    write_report(report)
    assert t2["local"] > 0, "the census must see megatron's [T, T] scores, or it sees nothing"


@pytest.mark.timeout(2400)  # 18 trainer processes, SequentialMLP at 128 experts among them
def test_trainer_speed_moe(tmp_path):
    """The `moe` row: launches per MoE layer per micro-batch, forward + backward (counted as `launches_per_layer`),
    and train tokens/s, of megatron's SequentialMLP and sluice's grouped experts (`--moe-grouped-gemm`) at 8, 32
    and 128 experts (targets: grouped flat in the expert count within 10 %, <= 0.25 x sequential at 32)."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    kinds = {"sequential": {}, "grouped": {"moe_grouped_gemm": True}}
    launches, tokens_per_s = {}, {}
    lengths = [64, 96, 128, 192, 256, 384, 512, 512, 80, 160, 320, 448]
    for experts in MOE_EXPERTS:
        dirs = {n: save_tiny_model(str(tmp_path / f"e{experts}-l{n}"), num_layers=n, num_experts=experts, **MOE_MODEL)
                for n in (2, 4)}
        counts = {kind: {n: run_in_trainer_process(_ops_scenario, dirs[n], "auto", False, "fp32", flags)["launches"]
                         for n in (2, 4)} for kind, flags in kinds.items()}
        launches[str(experts)] = {kind: (c[4] - c[2]) / 2 for kind, c in counts.items()}
        tokens_per_s[str(experts)] = {kind: round(run_in_trainer_process(
            _throughput_scenario, dirs[2], {"max_tokens_per_micro_batch": 2048, "megatron": flags}, lengths), 1)
            for kind, flags in kinds.items()}
    grouped = [launches[str(e)]["grouped"] for e in MOE_EXPERTS]
    moe = {"launches_per_layer": launches, "tokens_per_s": tokens_per_s,
           "grouped_spread": round(max(grouped) / min(grouped) - 1, 3),
           "grouped_over_sequential_at_32": round(launches["32"]["grouped"] / launches["32"]["sequential"], 3),
           "model": {**MOE_MODEL, "micro_batch": f"one packed row of {OPS_ROW} tokens, {OPS_SAMPLES} samples"},
           "targets": {"grouped_spread": 0.1, "grouped_over_sequential_at_32": 0.25}}
    write_report({"moe": moe})
    assert launches["32"]["sequential"] > 32 * 3, "the loop launches at least three products per expert"
