"""Wiring of one embedded engine: load the HF model, make the runner, the weight receiver and the HTTP server."""
from __future__ import annotations

import asyncio
import logging
import os

import torch
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from glue.embedded_engine.model_runner import ModelRunner
from glue.embedded_engine.routed_experts import RoutingRecorder
from glue.embedded_engine.server import EngineServer
from glue.embedded_engine.strict_server import StrictEngineServer
from glue.embedded_engine.text_io import load_tokenizer
from glue.embedded_engine.weight_update import WeightReceiver
from weight_sync.fp8_blocks import BlockFp8, read_block_fp8, read_dequantized

SEGMENT_PRUNE_S = 2.0  # how often the engine unmaps shared segments whose ipc source has closed them
SHUTDOWN_GRACE_S = 5.0  # after SIGTERM and the abort of every request: how long answers may take to go out


# SGLang's --dtype choices and the torch dtype each serves; "auto" follows the checkpoint's torch_dtype (fp32 when it
# is fp32 or unsaid, bf16 for a bf16 checkpoint; SGLang turns fp32 checkpoints to bf16 on GPU, on CPU fp32 stays).
DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "half": torch.float16, "float16": torch.float16}


def serving_dtype(model_path: str, dtype: str) -> torch.dtype:
    """The dtype an engine started with `--dtype dtype` serves the checkpoint at `model_path` in."""
    if DTYPES[dtype] is not None:
        return DTYPES[dtype]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    return stored if stored in (torch.bfloat16, torch.float16) else torch.float32


def load_model(model_path: str, dtype: str = "auto", device: str = "cpu"):
    """The HF causal LM at `model_path` in eval mode on `device`, its weights in the serving dtype (`--dtype`);
    FileNotFoundError that says what is missing."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(
            f"no HF model at --model-path {model_path!r}: expected a directory with config.json and *.safetensors "
            "(make one with glue.embedded_engine.tiny_model.save_tiny_model)"
        )
    from transformers import AutoModelForCausalLM

    fp8 = read_block_fp8(model_path)
    if fp8 is not None:
        model = load_dequantized(model_path, fp8, serving_dtype(model_path, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=serving_dtype(model_path, dtype))
    return model.to(device).eval()


def load_dequantized(model_path: str, fp8: BlockFp8, dtype: torch.dtype):
    """A block-FP8 checkpoint as the unquantized model it stands for, its weights dequantized to `dtype`: what the
    trainer loads. transformers' own FP8 path would need a GPU (or accelerate, to dequantize on CPU in bf16)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(model_path)
    del config.quantization_config
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = model_class.from_pretrained(None, config=config, state_dict=read_dequantized(model_path, fp8, dtype),
                                        dtype=dtype)
    if os.path.isfile(os.path.join(model_path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


def eos_token_ids(model) -> set[int]:
    ids: set[int] = set()
    for config in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def build_engine(*, model_path: str, host: str, port: int, seed: int, max_running_requests: int, num_threads: int,
                 weight_version: str, weight_sync_timeout_s: float, api_key: str | None = None,
                 admin_api_key: str | None = None, deterministic: bool = False,
                 enable_return_routed_experts: bool = False, sglang_strict: bool = False, tp_size: int = 1,
                 enable_memory_saver: bool = False, dtype: str = "auto", device: str = "cpu", nnodes: int = 1,
                 dist_init_addr: str | None = None) -> EngineServer:
    """The server; `sglang_strict` answers as SGLang 0.5.23 does (strict_server), with `tp_size` simulated ranks on
    the weight path. `device` holds the model and its KV cache (cpu, or cuda on a GPU machine); sampling stays on
    the CPU so a request's seed gives the same tokens on either. `nnodes` / `dist_init_addr`: node rank 0 of an
    engine over that many nodes (glue.embedded_engine.node_ranks), as /get_server_info reports them."""
    if tp_size > 1 and not sglang_strict:
        raise ValueError(f"--tp-size {tp_size}: simulated engine TP is served only with --sglang-strict")
    torch.set_num_threads(num_threads)
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: the embedded engine runs on cpu or cuda (cuda:N)")
    model = load_model(model_path, dtype, device)
    config = model.config
    tokenizer = load_tokenizer(model_path)
    eos = eos_token_ids(model) | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None
                                   else set())  # SGLang stops on the tokenizer's eos too
    # SGLang's routing buffer starts zeroed, so its layers without experts read 0; the lenient engine marks them -1.
    recorder = RoutingRecorder(model, dense_layer_value=0 if sglang_strict else -1) if enable_return_routed_experts \
        else None
    runner = ModelRunner(model, max_running_requests=max_running_requests, seed=seed, weight_version=weight_version,
                         eos_token_ids=eos, deterministic=deterministic, recorder=recorder)
    model_info = {"model_path": model_path, "served_model_name": model_path, "tokenizer_path": model_path if tokenizer is not None else None,
                  "is_generation": True, "preferred_sampling_params": None, "load_format": "auto",
                  "has_image_understanding": False, "has_audio_understanding": False,
                  "model_type": config.model_type, "architectures": config.architectures}
    server_info = {"model_path": model_path, "host": host, "port": port, "random_seed": seed, "tp_size": tp_size,
                   "dp_size": 1, "dtype": dtype, "device": device, "max_running_requests": max_running_requests, "num_threads": num_threads,
                   "enable_deterministic_inference": deterministic,
                   "enable_return_routed_experts": enable_return_routed_experts,
                   "enable_memory_saver": enable_memory_saver,
                   "nnodes": nnodes, "node_rank": 0, "dist_init_addr": dist_init_addr,
                   "skip_tokenizer_init": tokenizer is None, "context_length": config.max_position_embeddings,
                   "version": "embedded", "frontend": "sluice-embedded-engine"}
    receiver = WeightReceiver(runner, timeout_s=weight_sync_timeout_s, tp_size=tp_size,
                              bucket_checksums=not sglang_strict)
    shared = dict(vocab_size=config.vocab_size, max_context=config.max_position_embeddings, model_info=model_info,
                  server_info=server_info, api_key=api_key, admin_api_key=admin_api_key, tokenizer=tokenizer)
    if sglang_strict:
        return StrictEngineServer(runner, receiver, tp_size=tp_size, enable_memory_saver=enable_memory_saver, **shared)
    return EngineServer(runner, receiver, **shared)


class ProbeFilter(logging.Filter):
    """sgl-router probes each worker with an HTTP/2 preface (`PRI * HTTP/2.0`) before it talks HTTP/1.1; aiohttp
    answers 400 and logged a traceback per probe (one per worker per health check). Those records become one debug
    line, not shown at the default level; every other error keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and "PRI" in str(error):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "answered an HTTP/2 probe (the router's) with 400: this engine speaks HTTP/1.1", (), None, None)
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def serve(server: EngineServer, *, host: str, port: int) -> None:
    """Run until SIGTERM / SIGINT; then every request is aborted (a paused engine's waiting ones too: they would
    otherwise hold the process for aiohttp's default minute), and the model thread and weight groups are closed."""
    logging.getLogger("aiohttp.server").addFilter(ProbeFilter())
    app = server.build_app()

    housekeeping: list[asyncio.Task] = []

    async def unmap_closed_segments() -> None:
        """A closed ipc channel's segments stay mapped until the next bucket; this unmaps them within seconds."""
        while True:
            await asyncio.sleep(SEGMENT_PRUNE_S)
            await asyncio.to_thread(server.receiver.prune_segments)

    async def on_startup(_: web.Application) -> None:
        server.runner.start()
        housekeeping.append(asyncio.create_task(unmap_closed_segments()))

    async def on_shutdown(_: web.Application) -> None:
        server.runner.abort(abort_all=True)  # every waiting handler answers "abort" now, paused or not

    async def on_cleanup(_: web.Application) -> None:
        for task in housekeeping:
            task.cancel()
        server.runner.stop()
        server.receiver.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    web.run_app(app, host=host, port=port, print=lambda _: print(f"embedded engine serving on http://{host}:{port}",
                                                                 flush=True),
                access_log=None, handler_cancellation=True,  # a client that hangs up aborts its requests
                shutdown_timeout=SHUTDOWN_GRACE_S)
