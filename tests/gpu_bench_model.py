"""What runs inside one model's process for `make gpu-bench` (tests/gpu_bench.py): write its random checkpoint,
start the megatron-core trainer as a torch.distributed world of one, time it, stop it, time the plain-PyTorch peer;
each figure is sent to the parent as soon as it is measured."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from gpu_bench import BenchModel

NO_CUDA = "skipped: no CUDA"
OVER_BUDGET = "skipped: time budget"
OUT_OF_MEMORY = "out of memory"
TRAINER_FIGURES = ("train_tokens_per_s", "train_mfu", "forward_tokens_per_s", "forward_mfu", "peak_bytes",
                   "peak_bytes_per_parameter", "attention_kernel", "experts_kernel", "logprob_gap_vs_reference")
FIGURES = ("parameters", *TRAINER_FIGURES, "peer")  # each model's; a string where not measured says why


def write_checkpoint(hf: dict[str, Any], path: str, device: Any) -> None:
    """Random bf16 weights from `hf` into `path` (config.json + safetensors: what the trainer reads), initialised
    on `device` (a 1.5 B model initialises in seconds on a GPU, minutes on CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf)).to(torch.bfloat16)
    model.save_pretrained(path)  # safetensors is the default format


def make_batch(spec: BenchModel, vocab: int) -> Any:
    """`spec.samples` samples of random tokens, an eighth prompt; advantages alternate +1 / -1 and the rollout
    logprobs are a uniform policy's, so PPO ratios start near 1."""
    import torch
    from glue.types import Sample, TrainBatch  # lazy: the tree is on the path only after put_tree_on_path()

    gen = torch.Generator().manual_seed(1)
    prompt_len = spec.seq_len // 8
    samples = []
    for i in range(spec.samples):
        tokens = torch.randint(0, vocab, (spec.seq_len,), generator=gen).tolist()
        sample = Sample(prompt_tokens=tokens[:prompt_len], reward=float(i % 2), index=i)
        sample.append_response(tokens[prompt_len:], [-math.log(vocab)] * (spec.seq_len - prompt_len), version=0)
        samples.append(sample)
    return TrainBatch.from_samples(samples, [1.0 if i % 2 else -1.0 for i in range(spec.samples)])


def time_calls(fn: Callable[[], Any], calls: int, device: Any) -> tuple[list[float], Any]:
    """Seconds of each of `calls` calls of `fn` (the device synchronised around each) and the last result."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds, result = [], None
    for _ in range(calls):
        sync()
        started = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def rate_figures(prefix: str, seconds: list[float], tokens: int, flops: float, peak: float | str) -> dict:
    """`{prefix}_tokens_per_s`, `{prefix}_step_s` and `{prefix}_mfu` (`flops` per token against `peak` FLOP/s, or
    `peak` itself where it is the reason there is no MFU)."""
    rate = tokens * len(seconds) / sum(seconds)
    return {f"{prefix}_tokens_per_s": rate, f"{prefix}_step_s": seconds,
            f"{prefix}_mfu": rate * flops / peak if isinstance(peak, float) else peak}


class Phases:
    """Runs one model's measurements in order, each sending its figures (one dict, whole) as it ends, so a process
    killed at its deadline keeps what it had measured. A measurement that runs out of device memory reads "out of
    memory" and the next one still runs: the bench says what does not fit."""

    def __init__(self, send: Callable[[dict[str, Any]], None], deadline: float):
        self.send, self.deadline = send, deadline
        self.figures: dict[str, Any] = {}  # everything reported so far

    def run(self, keys: tuple[str, ...], measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        import torch

        if time.time() > self.deadline:
            return self.mark(keys, OVER_BUDGET)
        try:
            figures = measure()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return self.mark(keys, OUT_OF_MEMORY)
        self.report(figures)
        return figures

    def report(self, figures: dict[str, Any]) -> None:
        self.figures.update(figures)
        self.send(figures)

    def mark(self, keys: tuple[str, ...], why: str) -> None:
        self.report(dict.fromkeys(keys, why))


def halvings(start: int, floor: int) -> list[int]:
    """`start`, `start // 2`, ... down to no less than `floor`: the sizes to try, largest first."""
    return [start >> k for k in range(start.bit_length()) if start >> k >= floor] or [start]


def first_that_fits(sizes: list[int], attempt: Callable[[int], Any]) -> tuple[int, list[int]]:
    """The first of `sizes` at which `attempt(size)` runs without running out of device memory, and the sizes
    before it that did not fit: a deliberate retry, since what fits is one of the bench's results. Out of memory at
    the last size propagates."""
    import torch

    too_big = []
    for size in sizes[:-1]:
        try:
            attempt(size)
            return size, too_big
        except torch.OutOfMemoryError:
            too_big.append(size)
        if torch.cuda.is_available():  # out of the except block: the failed attempt's tensors are gone
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # the peak of what fits, not of the failed attempt
    attempt(sizes[-1])
    return sizes[-1], too_big


def attention_hooks() -> tuple[Callable | None, Callable | None]:
    """glue.trainer.attention's `attention_kernel` and `reference_attention`, each None where the tree lacks it."""
    if importlib.util.find_spec("glue.trainer.attention") is None:
        return None, None
    import glue.trainer.attention as attention  # lazy: a trainer module, imported in the model's process

    return getattr(attention, "attention_kernel", None), getattr(attention, "reference_attention", None)


def experts_kernel(model: Any) -> str:
    """What the model's routed experts run on its parameters' device and dtype: the grouped product of sluice's
    grouped experts, another experts module's class name, or "none (dense)"."""
    experts = next((m for m in model.modules() if type(m).__name__ in ("GroupedExperts", "SequentialMLP",
                                                                       "TEGroupedMLP")), None)
    if experts is None:
        return "none (dense)"
    if type(experts).__name__ != "GroupedExperts":
        return type(experts).__name__
    weight = next(experts.parameters())
    return f"GroupedExperts: {experts.kernel(weight.dtype, weight.device.type)}"


def measure_trainer(worker: Any, batch: Any, phases: Phases, steps: int, flops: float, peak: float | str) -> None:
    """Train and forward tokens/s of the started `worker` (one warm-up call each, then `steps` timed), its peak
    memory, its attention kernel and the logprob gap of that kernel to the unfused reference."""
    import torch

    tokens, device = sum(batch.seq_lens), worker.device

    def warm_up(max_tokens: int) -> None:
        worker.cfg = dataclasses.replace(worker.cfg, max_tokens_per_micro_batch=max_tokens)
        worker.max_tokens = max_tokens  # what the worker plans with (auto was resolved from memory at start)
        worker.train_step(batch)

    def train() -> dict:  # packed rows as long as fit, then the forward at the same size
        sizes = halvings(worker.max_tokens, max(batch.seq_lens))
        fitted, too_big = first_that_fits(sizes, warm_up)
        seconds = time_calls(lambda: worker.train_step(batch), steps, device)[0]
        return {**rate_figures("train", seconds, tokens, flops, peak), "train_max_tokens_per_micro_batch": fitted,
                "train_out_of_memory_at": too_big}

    fast = {}

    def forward() -> dict:
        worker.compute_logprobs(batch)
        seconds, fast["logprobs"] = time_calls(lambda: worker.compute_logprobs(batch), steps, device)
        return rate_figures("forward", seconds, tokens, flops / 3, peak)

    phases.run(("train_tokens_per_s", "train_mfu"), train)
    phases.run(("forward_tokens_per_s", "forward_mfu"), forward)
    peak_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    phases.report({"peak_bytes": peak_bytes or NO_CUDA,
                   "peak_bytes_per_parameter": peak_bytes / phases.figures["parameters"] if peak_bytes else NO_CUDA})
    kernel, reference = attention_hooks()
    phases.report({"attention_kernel": kernel(worker.model, packed=True) if kernel else "unknown",
                   "experts_kernel": experts_kernel(worker.model)})

    def gap() -> dict:
        if reference is None or "logprobs" not in fast:
            return {"logprob_gap_vs_reference": None}
        with reference():
            slow = worker.compute_logprobs(batch)
        mask = batch.logprob_mask.bool()
        return {"logprob_gap_vs_reference": float((fast["logprobs"] - slow)[mask].abs().max())}

    phases.run(("logprob_gap_vs_reference",), gap)


def measure_peer(model_dir: str, batch: Any, spec: BenchModel, steps: int, device: Any, flops: float,
                 peak: float | str) -> dict:
    """The plain-PyTorch peer on the same rows: the HF model (SDPA attention) in fp32 under bf16 autocast, fused
    AdamW, padded micro-batches of `spec.peer_rows`, and a token-level policy-gradient loss on the gathered
    log-softmax, the trainer's logits -> logprob work. Its `peer_tokens_per_s`, `peer_step_s` and `peer_mfu`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").to(device, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    tokens, mask, advantages = (x.to(device) for x in (batch.tokens, batch.logprob_mask, batch.advantages))
    num_tokens = mask.sum()
    micro_rows = {"rows": spec.peer_rows}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for rows in torch.arange(tokens.shape[0]).split(micro_rows["rows"]):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens[rows]).logits
            logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[rows, 1:, None])[..., 0]
            loss = -(logprobs * advantages[rows, :-1] * mask[rows, :-1]).sum() / num_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the trainer's default trainer.grad_clip
        optimizer.step()

    def warm_up(rows: int) -> None:
        micro_rows["rows"] = rows
        step()

    fitted, too_big = first_that_fits(halvings(spec.peer_rows, 1), warm_up)
    seconds = time_calls(step, steps, device)[0]
    return {"peer": {**rate_figures("peer", seconds, sum(batch.seq_lens), flops, peak), "micro_batch_rows": fitted,
                     "out_of_memory_at_rows": too_big, "weights": "fp32, bf16 autocast", "attention": "sdpa",
                     "experts": getattr(model.config, "_experts_implementation", None)}}


def model_process(spec: BenchModel, model_dir: str, steps: int, deadline: float, flops: float, peak: float | str,
                  out: Any) -> None:
    """One model, in a process of its own (a torch.distributed world of one: NCCL on CUDA, gloo on CPU): write
    the checkpoint, start the trainer, measure it, stop it, measure the peer. Figures go to `out` as dicts; {"done":
    True} ends."""
    import gc

    import torch

    from glue.trainer.config import TrainerConfig  # lazy: the tree is on the path only after put_tree_on_path()
    from glue.trainer.worker import TrainerWorker  # lazy: megatron-core, in the model's process only
    from loss import LossConfig  # lazy: the tree is on the path only after put_tree_on_path()

    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        phases = Phases(out.put, deadline)
        write_checkpoint(spec.hf, model_dir, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # the trainer's peak, not the checkpoint writer's
        batch = make_batch(spec, spec.hf["vocab_size"])
        # rollout old logprobs: train_step is one forward + backward + optimizer step, the peer's work and the work
        # megatron's FLOP count describes (the default recomputes old logprobs first, an uncounted extra forward)
        cfg = TrainerConfig(precision="bf16", max_tokens_per_micro_batch=spec.max_tokens, compile=spec.compile,
                            layer_spec=spec.layer_spec, megatron=dict(spec.megatron))
        worker = TrainerWorker(model_path=model_dir, cfg=cfg, loss_cfg=LossConfig(old_logprobs_from="rollout"),
                               rank=0, world_size=1)
        started = phases.run(("parameters",), lambda: {"trainer": worker.initialize(*worker.rendezvous_address()),
                                                       "parameters": sum(p.numel() for p in worker.model.parameters())})
        if started is not None:
            measure_trainer(worker, batch, phases, steps, flops, peak)
        else:
            phases.mark(TRAINER_FIGURES, f"skipped: the trainer did not start ({phases.figures['parameters']})")
        worker.shutdown()
        del worker
        gc.collect()
        torch.cuda.empty_cache()
        if spec.run_peer:
            phases.run(("peer",), lambda: measure_peer(model_dir, batch, spec, steps, device, flops, peak))
        else:
            phases.report({"peer": "skipped: measured once, beside the grouped experts"})
    except Exception as err:  # recorded in the JSON, then raised: the other model still runs
        out.put({"error": f"{type(err).__name__}: {err}"[:1000]})
        raise
    finally:
        out.put({"done": True})
