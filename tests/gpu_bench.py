"""`make gpu-bench`: the megatron-core trainer's speed on one GPU (train and forward tokens/s, MFU by megatron's FLOP
accounting, peak memory per parameter, the attention kernel and its logprob gap to the unfused reference) beside a
plain-PyTorch peer on the same batch, into bench-results/gpu_bench.json. Without CUDA a tiny model runs on CPU
through the same code and everything that needs a GPU reads "skipped: no CUDA"."""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_bench_model import FIGURES, NO_CUDA, OVER_BUDGET, model_process
from gpu_check import REPO, environment, put_tree_on_path

# dense bf16 tensor-core peak by device name, the first key the name contains (H200: the H100 SXM chip, more memory)
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """One benchmarked model: its HF config fields and the batch it trains on."""

    hf: dict[str, Any]  # config.json fields, model_type included; random bf16 weights are written from them
    samples: int  # rows of the batch
    seq_len: int  # tokens per sample: an eighth prompt, the rest response
    max_tokens: int | str  # trainer.max_tokens_per_micro_batch: samples packed into rows of at most this many tokens (auto: sized from GPU memory)
    peer_rows: int  # the peer's padded micro-batch, in rows
    target_mfu: float | None  # the train MFU the trainer should reach on an H100
    cap_s: float  # wall seconds this model may take, write and load included
    compile: bool = False  # trainer.compile (--compile): the layers' elementwise work under torch.compile
    megatron: dict[str, Any] = dataclasses.field(default_factory=dict)  # trainer.megatron flags (--moe-grouped-gemm)
    layer_spec: str = "auto"  # trainer.layer_spec: local pins sluice's own experts where TE imports
    run_peer: bool = True  # False: the peer is measured once, beside another variant of the same model


def _qwen(model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
          tied: bool) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": ffn,
            "vocab_size": vocab, "tie_word_embeddings": tied, "max_position_embeddings": 32768}


MODELS = {
    "qwen3_265m": BenchModel(hf=_qwen("qwen3", 1024, 16, 16, 8, 3072, 32000, tied=False), samples=64, seq_len=512,
                             max_tokens=16384, peer_rows=16, target_mfu=0.25, cap_s=140),
    # Qwen2.5-1.5B's shape: qkv bias (every qwen2), tied embeddings
    "qwen2_1.5b": BenchModel(hf=_qwen("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True), samples=32, seq_len=1024,
                             max_tokens="auto", peer_rows=4, target_mfu=0.35, cap_s=260),
}


def _qwen3_moe(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
               expert_ffn: int, vocab: int) -> dict[str, Any]:
    return {**_qwen("qwen3_moe", hidden, layers, heads, kv_heads, 4 * expert_ffn, vocab, tied=False),
            "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": expert_ffn, "norm_topk_prob": True}


def moe_variants(name: str, spec: BenchModel) -> dict[str, BenchModel]:
    """An MoE model's entries: megatron's SequentialMLP and sluice's grouped experts on the local spec, the peer
    measured once, beside the grouped one."""
    local = dataclasses.replace(spec, layer_spec="local")
    return {f"{name}_sequential": dataclasses.replace(local, run_peer=False, target_mfu=None),
            f"{name}_grouped": dataclasses.replace(local, megatron={"moe_grouped_gemm": True})}


# Qwen3-30B-A3B's layer (hidden 2048, 32 / 4 heads of 128, 128 experts of 768, top 8) cut to 6 of its 48 layers:
# 4.4 B parameters (0.6 B active), about 80 GB for the trainer's bf16 weights, fp32 main weights, gradients and
# Adam moments, and as much for the fp32 peer
MOE_MODEL = ("qwen3_moe_a3b_6l", BenchModel(hf=_qwen3_moe(2048, 6, 32, 4, 128, 128, 8, 768, 151936), samples=32,
                                            seq_len=512, max_tokens=8192, peer_rows=4, target_mfu=0.15, cap_s=240))
MODELS.update(moe_variants(*MOE_MODEL))
CPU_MODEL = ("tiny_cpu", BenchModel(hf=_qwen("qwen3", 64, 2, 4, 2, 128, 512, tied=False), samples=8, seq_len=64,
                                    max_tokens=256, peer_rows=4, target_mfu=None, cap_s=240))
# the MoE entries' code path on CPU: 8 experts of 32, top 2
CPU_MOE_MODEL = ("tiny_cpu_moe", BenchModel(hf=_qwen3_moe(64, 2, 4, 2, 16, 8, 2, 32, 512), samples=8, seq_len=64,
                                            max_tokens=256, peer_rows=4, target_mfu=None, cap_s=240))
TARGET_VS_PEER = 1.0  # sluice's train tokens/s over the peer's
TARGET_GROUPED_VS_SEQUENTIAL = 5.0  # an MoE model's train tokens/s with grouped experts over SequentialMLP's
MODEL_FLAGS = {"a": "qwen3_265m", "b": "qwen2_1.5b"}  # --batch-a, --max-tokens-b, ...


def megatron_flops_per_token(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                             vocab: int, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a dense GQA SwiGLU decoder as megatron-lm's
    `num_floating_point_operations` counts them (Narayanan et al. 2021, appendix), forward alone being a third:

        12 L h^2 [ (1 + g/n + s/(2h)) (d n / h) + 1.5 ffn / h + V / (2 L h) ]

    12 = 3 (forward, data-gradient and weight-gradient GEMMs) x 2 (GEMMs come in pairs) x 2 (a multiply-add is two
    FLOPs). Attention, in units of the query width d n: the q and out projections (1), k and v for g of the n heads
    (g/n), and scores plus their product with V over the causal half of the s x s matrix (s / 2h). SwiGLU: three
    h x ffn GEMMs where the pair counts two (1.5). Logits: one h x V GEMM per token, not per layer. `seq_len` is
    one sample's length: packed rows attend within each sample. Megatron pads V to a multiple of 128; the models
    here already are one."""
    g, n, d, h, L = kv_heads, heads, head_dim, hidden, layers
    attention = (1 + g / n + seq_len / (2 * h)) * (d * n / h)
    return 12 * L * h * h * (attention + 1.5 * ffn / h + vocab / (2 * L * h))


def flops_per_token(hf: dict[str, Any], seq_len: int) -> float:
    """`megatron_flops_per_token` for a model's HF config fields; for an MoE model by its active parameters: the
    FFN of the top-k experts a token runs through (the router's h x experts product is not counted)."""
    ffn = hf["moe_intermediate_size"] * hf["num_experts_per_tok"] if hf.get("num_experts") else hf["intermediate_size"]
    return megatron_flops_per_token(
        layers=hf["num_hidden_layers"], hidden=hf["hidden_size"], heads=hf["num_attention_heads"],
        kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], ffn=ffn, vocab=hf["vocab_size"],
        seq_len=seq_len)


def peak_flops(device_name: str | None) -> float | None:
    """The bf16 peak of a known device, by name; None for others."""
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in (device_name or "")), None)


def run_model(spec: BenchModel, steps: int, deadline: float, peak: float | str) -> dict[str, Any]:
    """`model_process` in a spawned process, killed at `deadline`; its figures, each missing one saying why."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    figures: dict[str, Any] = {}
    flops = flops_per_token(spec.hf, spec.seq_len)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as model_dir:
        proc = ctx.Process(target=model_process, args=(spec, model_dir, steps, deadline, flops, peak, out))
        proc.start()
        while "done" not in figures and time.time() < deadline:
            try:
                figures.update(out.get(timeout=1))
            except queue.Empty:
                if not proc.is_alive():  # died without "done": what it sent has arrived by now
                    break
        if proc.is_alive() and "done" not in figures:
            proc.kill()
        proc.join(timeout=30)
    killed = "done" not in figures and time.time() > deadline
    why = OVER_BUDGET if killed else f"failed: {figures.get('error', f'exit code {proc.exitcode}')}"
    figures.pop("done", None)
    return {**dict.fromkeys(FIGURES, why), **figures}  # FIGURES' order, the measured values


def score(figures: dict[str, Any], spec: BenchModel, on_cuda: bool) -> dict[str, Any]:
    """The ratio to the peer and whether the targets are met (null where a figure was not measured)."""
    ours, peer = figures.get("train_tokens_per_s"), figures.get("peer")
    theirs = peer.get("peer_tokens_per_s") if isinstance(peer, dict) else None
    measured = isinstance(ours, float) and isinstance(theirs, float)
    ratio = (ours / theirs if measured else "skipped: a rate was not measured") if on_cuda else NO_CUDA
    mfu = figures.get("train_mfu")
    meets = (mfu >= spec.target_mfu and ratio >= TARGET_VS_PEER
             if isinstance(mfu, float) and isinstance(ratio, float) and spec.target_mfu is not None else None)
    return {"vs_peer": ratio, "targets": {"train_mfu": spec.target_mfu, "vs_peer": TARGET_VS_PEER},
            "meets_target": meets}


def bench(specs: dict[str, BenchModel], steps: int, budget_s: float, env: dict) -> dict[str, dict]:
    """Every model in turn, each within its cap and the whole within `budget_s`."""
    on_cuda = env["cuda_available"]
    peak = peak_flops(env["device"]) or (f"skipped: no bf16 peak known for {env['device']}" if on_cuda else NO_CUDA)
    ends = time.time() + budget_s
    results = {}
    for name, spec in specs.items():
        started = time.time()
        deadline = min(ends, started + spec.cap_s)
        figures = run_model(spec, steps, deadline, peak) if deadline > started else {k: OVER_BUDGET for k in FIGURES}
        results[name] = {**describe(spec), **figures, **score(figures, spec, on_cuda),
                         "seconds": time.time() - started}
    return results


def compare_experts(models: dict[str, dict], on_cuda: bool) -> dict[str, dict]:
    """For each MoE model run both ways (`moe_variants`): grouped over sequential train tokens/s, and whether it
    meets the target (a GPU target: null on CPU, where the tiny model only runs the code path)."""
    out = {}
    for name in [n.removesuffix("_grouped") for n in models if n.endswith("_grouped")]:
        rates = [models.get(f"{name}_{kind}", {}).get("train_tokens_per_s") for kind in ("grouped", "sequential")]
        ratio = rates[0] / rates[1] if all(isinstance(r, float) for r in rates) else "skipped: a rate was not measured"
        out[name] = {"grouped_vs_sequential": ratio, "target": TARGET_GROUPED_VS_SEQUENTIAL,
                     "device": "cuda" if on_cuda else "cpu, tiny shape (the code path, not a speed figure)",
                     "meets_target": (ratio >= TARGET_GROUPED_VS_SEQUENTIAL
                                      if isinstance(ratio, float) and on_cuda else None)}
    return out


def describe(spec: BenchModel) -> dict[str, Any]:
    """What was run: the model's shape, the batch, and megatron's FLOPs per token for it."""
    train = flops_per_token(spec.hf, spec.seq_len)
    batch = {"samples": spec.samples, "tokens_per_sample": spec.seq_len, "prompt_tokens": spec.seq_len // 8,
             "max_tokens_per_micro_batch": spec.max_tokens, "precision": "bf16", "trainer_compile": spec.compile,
             "layer_spec": spec.layer_spec, "megatron": spec.megatron}
    return {"model": spec.hf, "batch": batch, "flops_per_token": {"train": train, "forward": train / 3}}


def summary(name: str, result: dict[str, Any]) -> str:
    """One line for a model: rates, MFU, the peer ratio, memory, kernel, gap, target (or the one reason for all)."""
    values = [result[key] for key in FIGURES]
    if isinstance(values[0], str) and all(value == values[0] for value in values):
        return f"gpu-bench {name}: {values[0]}"

    def show(key: str, form: str, unit: str = "", figures: dict = result) -> str:
        value = figures.get(key)
        return format(value, form) + unit if isinstance(value, (int, float)) else f"[{value}]"

    peer = result["peer"] if isinstance(result["peer"], dict) else {"peer_tokens_per_s": result["peer"]}
    return (f"gpu-bench {name}: train {show('train_tokens_per_s', ',.0f', ' tok/s')} MFU {show('train_mfu', '.1%')}, "
            f"forward {show('forward_tokens_per_s', ',.0f', ' tok/s')} MFU {show('forward_mfu', '.1%')}, "
            f"peer {show('peer_tokens_per_s', ',.0f', ' tok/s', peer)} x{show('vs_peer', '.2f')}, "
            f"{show('peak_bytes_per_parameter', '.1f', ' B/param')}, kernel {result['attention_kernel']}, "
            f"experts {result['experts_kernel']}, "
            f"gap {show('logprob_gap_vs_reference', '.2e')}, meets target: {result['meets_target']}")


def chosen_models(args: argparse.Namespace) -> dict[str, BenchModel]:
    """The GPU models `--models` names, with the command line's batch shapes."""
    unknown = set(args.models) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; choose from {sorted(MODELS)}")
    specs = {}
    for flag, name in MODEL_FLAGS.items():
        samples, seq_len = (int(part) for part in getattr(args, f"batch_{flag}").lower().split("x"))
        specs[name] = dataclasses.replace(MODELS[name], samples=samples, seq_len=seq_len,
                                          max_tokens=getattr(args, f"max_tokens_{flag}"),
                                          peer_rows=getattr(args, f"peer_rows_{flag}"), compile=args.compile)
    return {name: specs.get(name) or dataclasses.replace(MODELS[name], compile=args.compile)
            for name in MODELS if name in args.models}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "gpu_bench.json"), help="where to write the JSON")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps and forward calls per model")
    parser.add_argument("--budget-s", type=float, default=900, help="wall seconds for all models together")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS), help="comma-separated names")
    parser.add_argument("--compile", action="store_true", help="trainer.compile for sluice's trainer (the layers' "
                        "elementwise work under torch.compile; the warm-up step pays the compile)")
    for flag, name in MODEL_FLAGS.items():
        spec = MODELS[name]
        parser.add_argument(f"--batch-{flag}", default=f"{spec.samples}x{spec.seq_len}", help=f"{name}: SAMPLESxTOKENS")
        parser.add_argument(f"--max-tokens-{flag}", type=lambda v: v if v == "auto" else int(v),
                            default=spec.max_tokens, help=f"{name}: trainer.max_tokens_per_micro_batch (tokens per "
                            "packed row, or auto: sized from GPU memory)")
        parser.add_argument(f"--peer-rows-{flag}", type=int, default=spec.peer_rows,
                            help=f"{name}: rows per padded micro-batch of the peer")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    env = environment()
    put_tree_on_path()
    if env["cuda_available"]:
        models = bench(chosen_models(args), args.steps, args.budget_s, env)
    else:  # the same code on tiny models, dense and MoE; the GPU models are only described
        tiny = {CPU_MODEL[0]: CPU_MODEL[1], **moe_variants(*CPU_MOE_MODEL)}
        models = bench({name: dataclasses.replace(spec, compile=args.compile) for name, spec in tiny.items()},
                       args.steps, args.budget_s, env)
        models.update({name: {**describe(spec), **{key: NO_CUDA for key in FIGURES}, **score({}, spec, False)}
                       for name, spec in chosen_models(args).items()})
    result = {**env, "peak_bf16_flops": peak_flops(env["device"]), "models": models,
              "experts": compare_experts(models, env["cuda_available"]), "seconds": time.perf_counter() - started}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for name, figures in models.items():
        print(summary(name, figures))
    for name, comparison in result["experts"].items():
        ratio = comparison["grouped_vs_sequential"]
        print(f"gpu-bench {name}: grouped experts {f'{ratio:.2f}x' if isinstance(ratio, float) else f'[{ratio}]'} "
              f"SequentialMLP's train tokens/s ({comparison['device']}), meets target: {comparison['meets_target']}")
    print(f"gpu-bench: wrote {out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
