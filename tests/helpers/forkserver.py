"""How the tests start trainer-rank and embedded-engine processes: forked from one server process that has imported
torch, megatron-core, transformers, the trainer and the engine once, instead of spawned or exec'd fresh (such a
process spends 3-4 s of CPU on those imports, several times its tiny model's work). Each one is still a new
process: the server only imports, it never initialises torch.distributed, megatron's parallel state, a torch thread
pool or an event loop, so nothing carries over from one process or test to the next. The server is stopped by the
session fixture in conftest.py."""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import subprocess
import sys

# What the rank and engine processes import; the server imports them once (an import error there is ignored by
# multiprocessing: the process then imports the module itself)
PRELOAD = ["torch", "torch.distributed", "safetensors.torch", "aiohttp", "transformers", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.llama.modeling_llama", "megatron.core.dist_checkpointing", "megatron.core.models.gpt",
           "glue.trainer.worker", "glue.trainer.group", "glue.trainer.layer_spec", "glue.embedded_engine.tiny_model",
           "glue.embedded_engine.__main__", "glue.embedded_engine.engine", "weight_sync.sender",
           "weight_sync.process_group", "helpers.trainer", "helpers.trainer_process"]


# A server that imported torch may have touched the CUDA driver (megatron asks whether CUDA is available), and a
# process forked after that cannot use CUDA: on a machine with an NVIDIA device the processes are spawned as before.
FORK = not os.path.exists("/dev/nvidiactl")


def rank_context():
    """A multiprocessing context whose processes fork from the preloading server (started on first use); spawned
    ones where CUDA may be used."""
    if not FORK:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def stop_server() -> None:
    """Stop the server if a test started it, and wait for it (by the pid multiprocessing keeps)."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        server._stop()


def _engine_main(argv: list[str], log_path: str, cwd: str, env: dict[str, str]) -> None:
    """`python -m glue.embedded_engine ARGV` in this forked process: a session of its own, output to `log_path`."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = ["python -m glue.embedded_engine", *argv]
    from glue.embedded_engine.__main__ import main

    sys.exit(main(argv))


class EngineProcess:
    """An embedded engine forked from the server, with the `subprocess.Popen` surface the tests use (pid, poll,
    returncode, wait, terminate, kill)."""

    def __init__(self, argv: list[str], log_path: str, cwd: str, env: dict[str, str]):
        self._proc = rank_context().Process(target=_engine_main, args=(argv, log_path, cwd, env), daemon=False)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("glue.embedded_engine", timeout)
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
