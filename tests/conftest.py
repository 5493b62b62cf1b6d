"""Shared fixtures: tiny HF models on disk, SGLang's source folder and embedded engine processes (started and
stopped by pid). Helpers that test modules share live in tests/helpers (`from helpers.engines import call`)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.forkserver import EngineProcess

REPO_ROOT = Path(__file__).resolve().parents[1]
# tests that call ray.init themselves, as launch.run.cluster.start_ray does: Ray leaves builtins.print alone (it
# replaces it once it prints a dead actor's message, and a later test would pickle Ray's print for builtins.print)
os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")


@pytest.fixture(scope="session", autouse=True)
def _preloading_forkserver():
    """The fork server of trainer ranks and engines (helpers/forkserver.py), stopped by its pid after the last test."""
    yield
    from helpers.forkserver import stop_server

    stop_server()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny Qwen2 (vocab 32, 2 layers, hidden 64, seed 0) saved with save_pretrained."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> str:
    """A random tiny Qwen3-MoE (vocab 32, 2 layers, hidden 64, 4 experts, top-2, seed 0) saved with save_pretrained."""
    from glue.embedded_engine.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), family="qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 with a real tokenizer (byte-level BPE trained here, ChatML chat template, vocab 512)."""
    from glue.embedded_engine.tiny_text_model import save_tiny_text_model

    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_text"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(text_model_dir):
    """`text_model_dir`'s tokenizer, loaded offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 with non-zero qkv biases (HF initialises them to 0, which would hide a bias layout mistake)."""
    import torch
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    raw = save_tiny_model(str(tmp_path_factory.mktemp("raw")), family="qwen2", seed=3)
    model = AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    path = str(tmp_path_factory.mktemp("qwen2_bias"))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sglang_srt() -> Path:
    """SGLang's `srt` source folder, found without importing sglang; skips when sglang is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (`pip install --no-deps sglang` provides the source these tests read)")
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_processes() -> dict[int, tuple[str, list[str]]]:
    """Every live (not zombie) process: pid -> (command name, the fields of /proc/<pid>/stat after it: state, ppid,
    pgrp, session, ...)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            found[int(entry.name)] = (name, fields)
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    parents = {p: int(fields[1]) for p, (_, fields) in live_processes().items()}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def is_alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def sluice_run(command: list[str], ready, *, timeout_s: float = 240, **popen):
    """`command` (a `python -m launch ...` run) in a session of its own: waits until `ready()` holds or the process
    ends, then yields (process, every pid seen below it so far, a set to extend); kills it on the way out if it
    still runs."""
    proc = subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, **popen)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= descendants(proc.pid)
            if ready():
                break
            time.sleep(0.2)
        seen |= descendants(proc.pid)
        yield proc, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def is_gone(pid: int) -> bool:
    """True when neither the process nor anything left in its process group exists."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_healthy(url: str, proc: EngineProcess, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with code {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s} s; log:\n{log_path.read_text()[-3000:]}")


class EngineProcesses:
    """Starts `python -m glue.embedded_engine` processes; `stop_all()` ends each by its own pid."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[EngineProcess] = []

    def start(self, model_dir: str, *extra_args: str, timeout_s: float = 90.0) -> str:
        port = free_port()
        log_path = self.log_dir / f"engine-{port}.log"
        log_path.touch()
        # `python -m glue.embedded_engine ...`, forked from the preloading server (tests/helpers/forkserver.py)
        proc = EngineProcess(["--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port), *extra_args],
                             str(log_path), str(REPO_ROOT), {**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log_path, timeout_s)
        return url

    def start_sglang_stand_in(self, model_dir: str, *extra_args: str, timeout_s: float = 90.0) -> str:
        """`start` with `--sglang-strict`: an engine standing in for a real SGLang server answers exactly as SGLang
        0.5.23 does (no bucket checksums, no test hooks, SGLang's abort and version semantics). Tests of sluice's
        own code against engines use this; tests of the embedded engine's extras call `start`."""
        return self.start(model_dir, "--sglang-strict", *extra_args, timeout_s=timeout_s)

    def log_of(self, url: str) -> str:
        """What the engine at `url` has written so far."""
        return (self.log_dir / f"engine-{url.rsplit(':', 1)[1]}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self.procs.clear()


@pytest.fixture(scope="module")
def engine_processes(tmp_path_factory):
    """Module-scoped starter of embedded engines: `url = engine_processes.start(model_dir, *args)`."""
    engines = EngineProcesses(tmp_path_factory.mktemp("engine_logs"))
    try:
        yield engines
    finally:
        engines.stop_all()


@contextlib.contextmanager
def fake_engine_server(on_post):
    """A threaded HTTP server on loopback standing in for engines' control routes: every POST calls
    `on_post(body)` (it may block, e.g. on a barrier, as a collective would) and answers 200 with
    `{"success": true, "status": "ok"}`. Yields the base URL; stopped on exit."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self):
            on_post(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"success": true, "status": "ok"}')

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 64  # many engines connect at once

    server = Server(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
