"""What one CUDA GPU holds besides the transports (tests/test_weight_gpu.py): the megatron-core trainer at TP=1 on
CUDA (NCCL world of one, no Ray: a spawned process), the embedded engine on CUDA, and a colocated sync between them
by CUDA IPC. Run by `make gpu-check` (tests/gpu_check.py), which reads the figures they record into
bench-results/gpu.json. Skipped cleanly without CUDA, and with a one-line reason without megatron-core or
transformers."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import threading
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

    model_path = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3)
    batch = _advantage_batch()

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


def test_the_trainers_norm_on_cuda_runs_torchs_fused_kernel_and_the_compiled_one_equal_to_sluices(record_property):
    from types import SimpleNamespace

    from glue.trainer import norm

    config = SimpleNamespace(normalization="RMSNorm", params_dtype=torch.bfloat16, sequence_parallel=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = 1 + 0.1 * torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for name, cls in (("sluice", norm.RMSNorm), ("torch_fused", norm.RMSNorm), ("compiled", norm.CompiledRMSNorm)):
        module = cls(config, 1024, eps=1e-6).cuda()
        with torch.no_grad():
            module.weight.copy_(weight)
        a = x.clone().requires_grad_()
        out = norm.rms_norm(a, module.weight, 1e-6) if name == "sluice" else module(a)
        out.backward(grad)
        kernel = "sluice" if name == "sluice" else module.kernel("cuda")
        results[name] = (out.float(), a.grad.float(), module.weight.grad.float(), kernel)
    record_property("norm_kernels", {name: r[3] for name, r in results.items()})
    assert results["torch_fused"][3] == "torch_fused", f"torch {torch.__version__} has no fused CUDA rms_norm"
    for name in ("torch_fused", "compiled"):
        for got, ref in zip(results[name][:3], results["sluice"][:3]):
            gap = ((got - ref).abs().max() / ref.abs().max()).item()
            record_property(f"norm_{name}_relative_gap", gap)
            assert gap < 2e-2, f"{name}: {gap}"


def _advantage_batch():
    """BATCH random samples, advantages rising with the index."""
    from glue.types import Sample, TrainBatch

    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(BATCH):
        tokens = torch.randint(2, 32, (PROMPT_LEN + RESPONSE_LEN,), generator=gen).tolist()
        sample = Sample(prompt_tokens=tokens[:PROMPT_LEN], reward=float(i), index=i)
        sample.append_response(tokens[PROMPT_LEN:], [-1.0] * RESPONSE_LEN, version=0)
        samples.append(sample)
    return TrainBatch.from_samples(samples, [float(i) - (BATCH - 1) / 2 for i in range(BATCH)])


def _trainer_serving(port: int, model_path: str, calls, answers) -> None:
    """The one trainer rank in a process of its own (a CUDA IPC handle opens only in another process than its
    source's): one train step, then it serves the bridge's and the colocation's calls from `calls` until None."""
    from glue.trainer.config import TrainerConfig
    from glue.trainer.worker import TrainerWorker
    from loss import LossConfig

    cfg = TrainerConfig(tensor_model_parallel_size=1, micro_batch_size=4, lr=1e-2, num_cpus_per_worker=1)
    worker = TrainerWorker(model_path=model_path, cfg=cfg, loss_cfg=LossConfig(), rank=0, world_size=1)
    worker.initialize("127.0.0.1", port)
    worker.train_step(_advantage_batch())  # built here: a batch passed to a spawned process lands in shared memory
    answers.put(("ok", worker.version))
    for method, args in iter(calls.get, None):
        try:
            answers.put(("ok", getattr(worker, method)(*args)))
        except Exception as err:  # handed to the caller, which raises it
            answers.put(("error", f"{type(err).__name__}: {err}"))
    worker.shutdown()


class TrainerProcess:
    """The trainer as the bridge (weight_sync.transports.WeightSource) and the colocation see it: every call
    forwarded to the rank's process, one at a time."""

    def __init__(self, calls, answers, version: int):
        self.calls, self.answers, self.version = calls, answers, version
        self._lock = threading.Lock()

    def _call(self, method: str, *args):
        with self._lock:
            self.calls.put((method, args))
            status, value = self.answers.get(timeout=300)
        if status == "error":
            raise RuntimeError(f"trainer {method}: {value}")
        return value

    def hf_weight_specs(self):
        return self._call("hf_weight_specs")

    def open_weight_channel(self, name, spec):
        return self._call("open_weight_channel", name, spec)

    def stage_weights(self, with_tensor_checksums=False):
        return self._call("stage_weights", with_tensor_checksums)

    def send_weight_bucket(self, channel, index):
        return self._call("send_weight_bucket", channel, index)

    def close_weight_channel(self, name):
        return self._call("close_weight_channel", name)

    def offload(self):
        return self._call("offload")

    def onload(self):
        return self._call("onload")


def test_a_colocated_sync_from_the_trainer_on_cuda_reaches_an_engine_on_the_same_gpu_by_cuda_ipc_bit_identically(
        tmp_path, engine_processes, record_property):
    """The production colocated path on one GPU: the megatron-core trainer (after a step) and two embedded engines
    on the same device; the engines release their memory for training and take it back, then the bridge sends every
    bucket through /update_weights_from_tensor as SGLang reads it (CUDA IPC handles, one per engine TP rank) inside
    the weight-update session, both engines served by the trainer rank on their GPU (the plan's one source per GPU,
    launch.plan.ipc_sources) in the same sync. verify: full compares every tensor's SHA-256, trainer against each
    engine; a strict engine (SGLang's payload checks) takes the same payload and then generates what the verified
    engines do."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from glue.embedded_engine.tiny_model import save_tiny_model
    from glue.loop.colocation import Colocated
    from glue.loop.config import SyncConfig
    from helpers.engines import call, generate
    from weight_sync.bridge import make_bridge

    model_path = save_tiny_model(str(tmp_path / "qwen2"), family="qwen2", seed=3, vocab_size=16000,
                                 hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8,
                                 intermediate_size=2816)  # 79 M parameters, 316 MB in float32
    lenient = engine_processes.start(model_path, "--device", "cuda", timeout_s=180)
    beside = engine_processes.start(model_path, "--device", "cuda", timeout_s=180)  # a second engine on the GPU
    colocated = [lenient, beside]
    strict = engine_processes.start(model_path, "--device", "cuda", "--sglang-strict", timeout_s=180)

    ctx = mp.get_context("spawn")
    calls, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_trainer_serving, args=(_free_port(), model_path, calls, answers))
    proc.start()
    try:
        status, version = answers.get(timeout=300)
        assert status == "ok", version
        trainer = TrainerProcess(calls, answers, version)
        cfg = SyncConfig(transport="ipc", verify="full", pipeline=True, bucket_bytes=128 * 2**20)
        bridge = make_bridge(cfg, source=trainer, engine_urls=colocated, ipc_sources=lambda url: [0])
        try:
            colocation = Colocated(trainer=trainer, bridge=bridge, engine_urls=colocated)
            figures = []
            for _ in range(3):  # train phase (engines release, trainer onloads), then rollout (resume, sync, offload)
                colocation.before_train()
                colocation.sync(version)
                colocation.before_rollout()
                figures.append(colocation.metrics())
        finally:
            bridge.close()
        bridge = make_bridge(SyncConfig(transport="ipc", pipeline=True, bucket_bytes=128 * 2**20), source=trainer,
                             engine_urls=[strict])
        try:
            trainer.onload()
            bridge.sync(version)
        finally:
            bridge.close()
        calls.put(None)
        proc.join(timeout=120)
    finally:
        if proc.is_alive():
            proc.kill()
    first, warm = figures[0], min(figures[1:], key=lambda f: f["sync/total_s"])
    for name, value in {"engines": len(colocated), "bytes": first["sync/bytes"], "buckets": first["sync/buckets"],
                        "first_sync_s": first["sync/total_s"], "sync_s": warm["sync/total_s"],
                        "sync_gb_per_s": warm["sync/gb_per_s"], "transfer_s": warm["sync/transfer_s"],
                        "transfer_gb_per_s": warm["sync/bytes"] / warm["sync/transfer_s"] / 1e9,
                        "verify_full_s": warm["sync/verify_s"], "pack_s": warm["sync/pack_s"],
                        "copy_in_s": warm["sync/copy_in_s"]}.items():
        record_property(name, value)
    print(f"colocated CUDA IPC sync of {first['sync/bytes'] / 1e6:.0f} MB in {int(first['sync/buckets'])} buckets: "
          f"{warm['sync/total_s']:.3f} s with verify full ({warm['sync/gb_per_s']:.2f} GB/s), transfer "
          f"{warm['sync/transfer_s']:.3f} s; first sync {first['sync/total_s']:.3f} s")
    for url in (*colocated, strict):
        assert call(url, "/model_info")[1]["weight_version"] == str(version)
    prompt = {"input_ids": [3, 4, 5], "return_logprob": True,
              "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}
    ours, beside_ours, theirs = (generate(url, prompt) for url in (*colocated, strict))
    assert ours["output_ids"] == beside_ours["output_ids"] == theirs["output_ids"]
    assert [t[0] for t in ours["meta_info"]["output_token_logprobs"]] == \
        [t[0] for t in beside_ours["meta_info"]["output_token_logprobs"]] == \
        [t[0] for t in theirs["meta_info"]["output_token_logprobs"]]
