"""What one CUDA GPU holds besides the transports (tests/test_weight_gpu.py): the megatron-core trainer at TP=1 on
CUDA (NCCL world of one, no Ray: a spawned process) and the embedded engine on CUDA. Run by `make gpu-check`
(tests/gpu_check.py), which reads the figures they record into bench-results/gpu.json. Skipped cleanly without
CUDA, and with a one-line reason without megatron-core or transformers."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]

PROMPT_LEN, RESPONSE_LEN, BATCH = 5, 7, 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _trainer_rank(port: int, model_path: str, batch, results) -> None:
    """The one trainer rank, in a process of its own (it initialises torch.distributed with NCCL): logprobs, one
    train step, logprobs again, with seconds and the device memory peak."""
    from glue.trainer.config import TrainerConfig
    from glue.trainer.worker import TrainerWorker
    from loss import LossConfig

    cfg = TrainerConfig(tensor_model_parallel_size=1, micro_batch_size=4, lr=1e-2, num_cpus_per_worker=1)
    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=0, world_size=1)
    worker.initialize("127.0.0.1", port)
    torch.cuda.reset_peak_memory_stats()
    before = worker.compute_logprobs(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = worker.train_step(batch)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    after = worker.compute_logprobs(batch)
    figures = {"device": str(worker.device), "train_step_s": step_s, "peak_bytes": torch.cuda.max_memory_allocated(),
               "version": worker.version}
    worker.shutdown()
    results.put(pickle.dumps((before.cpu(), after.cpu(), metrics, figures)))


def test_the_trainer_at_tp1_on_cuda_matches_the_hf_model_and_one_step_moves_toward_positive_advantages(
        tmp_path, record_property):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (make gpu-check installs "
                                                "wheels/megatron_core-*.whl when the tree carries one)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.types import Sample, TrainBatch

    model_path = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(BATCH):
        tokens = torch.randint(2, 32, (PROMPT_LEN + RESPONSE_LEN,), generator=gen).tolist()
        sample = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=float(i), index=i)
        sample.append_response(tokens[PROMPT_LEN:], [-1.0] * RESPONSE_LEN, version=0)
        samples.append(sample)
    advantages = [float(i) - (BATCH - 1) / 2 for i in range(BATCH)]
    batch = TrainBatch.from_samples(samples, advantages)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_trainer_rank, args=(_free_port(), model_path, batch, results))
    proc.start()
    try:
        while True:
            try:
                before, after, metrics, figures = pickle.loads(results.get(timeout=5))
                break
            except queue.Empty:
                assert proc.exitcode in (None, 0), f"the trainer rank died with exit code {proc.exitcode}"
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(batch.tokens).logits.float(), dim=-1)
    reference = torch.nn.functional.pad(logp[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0], (0, 1))
    mask = batch.logprob_mask.bool()
    gap = float((before - reference)[mask].abs().max())
    # per sample: mean logprob change of its trained tokens; the highest advantage should gain the most
    moved = ((after - before) * mask).sum(1) / mask.sum(1)
    for key, value in {**figures, "max_abs_logprob_gap_vs_hf": gap, "loss": metrics.get("train/loss")}.items():
        record_property(key, value)
    assert figures["device"].startswith("cuda") and figures["version"] == 1
    assert gap < 1e-2, f"megatron TP=1 logprobs on CUDA differ from the HF model's by {gap}"
    assert moved[-1] > moved[0], f"one step did not favour the positive advantage: {moved.tolist()}"


def _greedy_answers(server, prompts, max_new_tokens=6):
    """Each prompt's greedy tokens and their logprobs from the engine's runner, all prompts batched together."""
    from glue.embedded_engine.request_schema import GenerationRequest, SamplingSettings

    done, seqs = [], []
    server.runner.start()
    try:
        for i, ids in enumerate(prompts):
            request = GenerationRequest(rid=f"r{i}", input_ids=ids, return_logprob=True,
                                        sampling=SamplingSettings(max_new_tokens=max_new_tokens, top_k=1,
                                                                  ignore_eos=True))
            seqs.append(server.runner.submit(request, done.append))
        deadline = time.monotonic() + 60
        while len(done) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.runner.stop()
    assert len(done) == len(prompts), f"{len(done)} of {len(prompts)} requests finished within 60 s"
    return [s.output_ids for s in seqs], torch.tensor([s.logprobs for s in seqs])


def test_the_embedded_engine_holds_its_model_on_cuda_and_generates_what_the_cpu_engine_does(tmp_path, record_property):
    from glue.embedded_engine.engine import build_engine
    from glue.embedded_engine.tiny_model import save_tiny_model

    model_path = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]  # mixed lengths: prefill groups + KV padding
    answers = {}
    for device in ("cpu", "cuda"):
        torch.cuda.reset_peak_memory_stats()
        server = build_engine(model_path=model_path, host="127.0.0.1", port=_free_port(), seed=0,
                              max_running_requests=4, num_threads=1, weight_version="0", weight_sync_timeout_s=60,
                              device=device)
        devices = {p.device.type for p in server.runner.model.parameters()}
        assert devices == {device}, f"the {device} engine's parameters are on {devices}"
        answers[device] = _greedy_answers(server, prompts)
    record_property("peak_bytes", torch.cuda.max_memory_allocated())
    (cpu_tokens, cpu_logprobs), (cuda_tokens, cuda_logprobs) = answers["cpu"], answers["cuda"]
    gap = float((cpu_logprobs - cuda_logprobs).abs().max())
    record_property("max_abs_logprob_gap_vs_cpu", gap)
    assert cuda_tokens == cpu_tokens, f"greedy tokens differ: cuda {cuda_tokens} vs cpu {cpu_tokens}"
    assert gap < 1e-3, f"the CUDA engine's logprobs differ from the CPU engine's by {gap}"


def test_sluices_core_attention_on_cuda_runs_flash_kernels_and_equals_the_unfused_reference(record_property):
    # packed rows through torch's varlen FlashAttention (GQA heads shared, not repeated), padded rows through SDPA's
    # causal kernel; both against the fp32-softmax reference, forward and input gradients, in bf16
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from glue.trainer import attention

    heads, groups, dim, spans = 16, 8, 64, [300, 17, 1024, 5, 700]
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=dim, attention_dropout=0.0, bf16=True,
                               params_dtype=torch.bfloat16)
    core = attention.SluiceCoreAttention(config, 1, None, "self")
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(spans)
    qkv = [torch.randn(total, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
           for n in (heads, groups, groups)]
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(spans),
                             max_seqlen_kv=max(spans))
    kernel = attention.thd_kernel(qkv[0])

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = core(*qkv, None, packed_seq_params=params)
        out.float().square().mean().backward()
        grads = [x.grad.float().clone() for x in qkv]
        for x in qkv:
            x.grad = None
        return out.float(), grads

    fast_out, fast_grads = run()
    with attention.reference_attention():
        ref_out, ref_grads = run()
    gap = (fast_out - ref_out).abs().max().item()
    grad_gap = max(((f - r).abs().max() / r.abs().max()).item() for f, r in zip(fast_grads, ref_grads))
    record_property("thd_kernel", kernel)
    record_property("thd_output_gap", gap)
    record_property("thd_relative_grad_gap", grad_gap)
    assert kernel == "varlen_attn", f"torch {torch.__version__} has no usable varlen_attn: {kernel}"
    assert gap < 2e-2 and grad_gap < 5e-2
