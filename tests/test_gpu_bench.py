"""`make gpu-bench` (tests/gpu_bench.py) on CPU: megatron's FLOP accounting against the figure measured with
megatron's own code and against a GEMM-by-GEMM count, a measurement that runs out of memory, and the CPU mode
end to end (a tiny model through the real trainer and the peer; the GPU models "skipped: no CUDA")."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests"))
import gpu_bench  # noqa: E402
from gpu_bench_model import FIGURES, NO_CUDA, OUT_OF_MEMORY, Phases, first_that_fits, halvings  # noqa: E402


def test_megatron_flop_accounting_gives_1_455_gflop_per_token_for_the_265m_qwen3_at_512_tokens():
    # 1.455 GFLOP/token: megatron's num_floating_point_operations for this shape, measured earlier
    flops = gpu_bench.flops_per_token(gpu_bench.MODELS["qwen3_265m"].hf, seq_len=512)
    assert flops == pytest.approx(1.455e9, rel=0.005)


def test_the_flop_formula_equals_counting_every_gemm_of_a_gqa_swiglu_decoder_forward_and_backward():
    h, layers, n, g, d, ffn, vocab, s = 1536, 28, 12, 2, 128, 8960, 151936, 1024
    per_layer = (2 * h * n * d  # q projection, 2 FLOPs per multiply-add
                 + 2 * 2 * h * g * d  # k and v projections
                 + 2 * s * n * d / 2 + 2 * s * n * d / 2  # q k^T and probs @ v over the causal half
                 + 2 * n * d * h  # out projection
                 + 3 * 2 * h * ffn)  # gate, up, down
    forward = layers * per_layer + 2 * h * vocab  # the logits
    flops = gpu_bench.megatron_flops_per_token(layers=layers, hidden=h, heads=n, kv_heads=g, head_dim=d, ffn=ffn,
                                               vocab=vocab, seq_len=s)
    assert flops == pytest.approx(3 * forward, rel=1e-12)  # backward: data and weight gradients, 2 x forward


def test_a_measurement_that_runs_out_of_memory_reads_out_of_memory_and_the_next_still_runs():
    sent = []
    phases = Phases(sent.append, deadline=float("inf"))

    def too_big() -> dict:
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert phases.run(("train_tokens_per_s", "train_mfu"), too_big) is None
    assert phases.run(("peer",), lambda: {"peer": {"peer_tokens_per_s": 1.0}}) == {"peer": {"peer_tokens_per_s": 1.0}}
    assert sent == [{"train_tokens_per_s": OUT_OF_MEMORY, "train_mfu": OUT_OF_MEMORY},
                    {"peer": {"peer_tokens_per_s": 1.0}}]
    assert Phases(sent.append, deadline=0).run(("peer",), lambda: {}) is None
    assert sent[-1] == {"peer": "skipped: time budget"}


def test_the_packed_row_length_is_halved_until_a_step_fits_and_the_lengths_that_did_not_are_recorded():
    tried = []

    def step(max_tokens: int) -> None:
        tried.append(max_tokens)
        if max_tokens > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert halvings(16384, 1024) == [16384, 8192, 4096, 2048, 1024] and halvings(512, 1024) == [512]
    assert first_that_fits(halvings(16384, 1024), step) == (4096, [16384, 8192])
    assert tried == [16384, 8192, 4096]
    with pytest.raises(torch.OutOfMemoryError):
        first_that_fits([16384, 8192], step)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, make gpu-bench runs the GPU models")
def test_make_gpu_bench_without_cuda_runs_a_tiny_model_through_the_trainer_and_the_peer_and_skips_the_gpu_ones(
        tmp_path):
    out = tmp_path / "gpu_bench.json"
    done = subprocess.run(["make", "-s", "gpu-bench", f"GPU_BENCH_JSON={out}", f"PY={sys.executable}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["cuda_available"] is False and result["torch"] == torch.__version__ and result["seconds"] > 0
    tiny, big = result["models"]["tiny_cpu"], result["models"]["qwen3_265m"]
    assert set(result["models"]) == {"tiny_cpu", "tiny_cpu_moe_sequential", "tiny_cpu_moe_grouped", "qwen3_265m",
                                     "qwen2_1.5b", "qwen3_moe_a3b_6l_sequential", "qwen3_moe_a3b_6l_grouped"}
    assert tiny["parameters"] > 0 and tiny["train_tokens_per_s"] > 0 and tiny["forward_tokens_per_s"] > 0
    assert tiny["peer"]["peer_tokens_per_s"] > 0 and isinstance(tiny["attention_kernel"], str)
    gap = tiny["logprob_gap_vs_reference"]
    assert gap is None or 0 <= gap < 0.05, gap  # bf16 kernels against the fp32-softmax reference
    for key in ("train_mfu", "forward_mfu", "peak_bytes", "peak_bytes_per_parameter", "vs_peer"):
        assert tiny[key] == NO_CUDA, key
    assert tiny["peer"]["peer_mfu"] == NO_CUDA and tiny["meets_target"] is None
    assert tiny["batch"]["trainer_compile"] is False
    sequential, grouped = result["models"]["tiny_cpu_moe_sequential"], result["models"]["tiny_cpu_moe_grouped"]
    assert sequential["experts_kernel"] == "SequentialMLP" and tiny["experts_kernel"] == "none (dense)"
    assert grouped["experts_kernel"] == "GroupedExperts: torch._grouped_mm"  # bf16 on CPU, 16-byte rows
    assert grouped["batch"]["megatron"] == {"moe_grouped_gemm": True} and grouped["batch"]["layer_spec"] == "local"
    assert sequential["train_tokens_per_s"] > 0 and grouped["peer"]["peer_tokens_per_s"] > 0
    assert sequential["peer"].startswith("skipped: measured once")
    experts = result["experts"]["tiny_cpu_moe"]
    assert experts["device"].startswith("cpu, tiny shape") and experts["meets_target"] is None
    assert experts["grouped_vs_sequential"] > 0
    assert result["experts"]["qwen3_moe_a3b_6l"]["meets_target"] is None
    for name in ("qwen3_265m", "qwen2_1.5b", "qwen3_moe_a3b_6l_sequential", "qwen3_moe_a3b_6l_grouped"):
        model = result["models"][name]
        assert {model[key] for key in FIGURES} == {NO_CUDA} and model["vs_peer"] == NO_CUDA, name
        assert model["meets_target"] is None
    assert big["flops_per_token"]["train"] == pytest.approx(1.455e9, rel=0.005)
    assert big["targets"] == {"train_mfu": 0.25, "vs_peer": 1.0}
    assert result["models"]["qwen2_1.5b"]["targets"]["train_mfu"] == 0.35
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu-bench ")]
    assert [line.split(":")[0] for line in lines] == [f"gpu-bench {name}" for name in [*result["models"],
                                                                                      *result["experts"]]]


def test_the_moe_models_flops_count_the_top_k_experts_a_token_runs_through():
    moe = gpu_bench.MODELS["qwen3_moe_a3b_6l_grouped"].hf
    active = dict(moe, num_experts=0, intermediate_size=8 * 768)  # a dense model of the active width
    assert gpu_bench.flops_per_token(moe, 512) == gpu_bench.flops_per_token(active, 512)
    assert moe["hidden_size"] == 2048 and moe["num_experts"] == 128 and moe["num_experts_per_tok"] == 8


def test_gpu_bench_compile_flag_turns_trainer_compile_on_for_every_model(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--compile", "--models", "qwen3_265m"])
    specs = gpu_bench.chosen_models(gpu_bench.parse_args())
    assert list(specs) == ["qwen3_265m"] and specs["qwen3_265m"].compile is True
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--compile", "--models", "qwen3_moe_a3b_6l_grouped"])
    assert gpu_bench.chosen_models(gpu_bench.parse_args())["qwen3_moe_a3b_6l_grouped"].compile is True
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py"])
    assert not any(spec.compile for spec in gpu_bench.chosen_models(gpu_bench.parse_args()).values())
