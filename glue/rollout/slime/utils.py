"""The `slime.utils` helpers slime's rollout functions import besides `types` and `http_utils.post`, written by
sluice: `async_utils.run` (a coroutine run to its end from plain code, on one background event loop per process,
as slime's whole-rollout functions call it), `misc.SingletonMeta`, `processing_utils.load_tokenizer /
load_processor`, `http_utils.get_rollout_num_engines` and `mask_utils` (glue.rollout.slime.mask_utils).

`MODULES` is what the stand-in `slime` package (glue.rollout.slime.shim) registers under slime's names.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

from glue.rollout.slime import mask_utils


class AsyncLoopThread:
    """An event loop running for ever on a daemon thread; `run` hands it a coroutine and waits for the result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="slime-async-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine) -> Any:
        """The coroutine's result (or its exception). The caller's context variables go with it (the run's fleet
        and the recording of its /generate answers)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Cancel what still runs on the loop, stop it and join its thread; False if the thread outlived
        `timeout_s` (a coroutine that ignores cancellation)."""
        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_soon(self.loop.stop)
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(cancel_all)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self.loop.close()
        return True


_loop: AsyncLoopThread | None = None
_loop_lock = threading.Lock()


def get_async_loop() -> AsyncLoopThread:
    """The process's one background loop, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = AsyncLoopThread()
        return _loop


def stop_async_loop() -> bool:
    """At a run's end: the background loop `run` started, if any, stopped with its thread (slime's lives until its
    process exits; a sluice run can end before its process does). True when no such thread is left."""
    global _loop
    with _loop_lock:
        loop, _loop = _loop, None
    return loop is None or loop.stop()


def run(coro: Coroutine) -> Any:
    """slime's `async_utils.run`: run `coro` on the background loop and block until it is done. Not from a
    coroutine of that loop itself (it would wait for itself): RuntimeError then."""
    loop = get_async_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop.loop:
        coro.close()
        raise RuntimeError("slime.utils.async_utils.run was called from a coroutine on its own loop; await the "
                           "coroutine instead")
    return loop.run(coro)


class SingletonMeta(type):
    """slime's `misc.SingletonMeta`: a class whose first instance is the only one (`clear_instances` forgets it)."""

    _instances: dict = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """transformers' AutoTokenizer for `name_or_path`, keyword arguments as given (slime passes
    trust_remote_code=True)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """A multimodal processor, or None: sluice trains text models, and a checkpoint whose AutoProcessor is only its
    tokenizer (or fails to load) has none, as slime treats it."""
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError):
        return None
    return processor if isinstance(processor, ProcessorMixin) else None


def get_rollout_num_engines(args: Any) -> int:
    """The engines behind the router: `args.rollout_num_engines` when set, else rollout GPUs / GPUs per engine."""
    engines = getattr(args, "rollout_num_engines", None)
    if engines is not None:
        return int(engines)
    gpus, per_engine = args.rollout_num_gpus or 0, args.rollout_num_gpus_per_engine or 1
    return max(1, gpus // per_engine) if gpus > 0 else 0


MODULES = {
    "slime.utils.async_utils": {"run": run, "get_async_loop": get_async_loop, "AsyncLoopThread": AsyncLoopThread},
    "slime.utils.misc": {"SingletonMeta": SingletonMeta},
    "slime.utils.processing_utils": {"load_tokenizer": load_tokenizer, "load_processor": load_processor},
    "slime.utils.http_utils": {"get_rollout_num_engines": get_rollout_num_engines},
    "slime.utils.mask_utils": {"MultiTurnLossMaskGenerator": mask_utils.MultiTurnLossMaskGenerator,
                               "get_response_lengths": mask_utils.get_response_lengths},
}
