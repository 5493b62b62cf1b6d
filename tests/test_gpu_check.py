"""`make gpu-check` on a machine without CUDA (this one): it exits 0 within seconds and writes bench-results/gpu.json
with every check "skipped: no CUDA", the machine's torch version, and one "needs 2 GPUs: ..." line per check that
one device cannot hold. The check names point at tests that exist."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests"))
from gpu_check import CHECKS  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, make gpu-check runs the GPU tests themselves")
def test_make_gpu_check_without_cuda_exits_0_quickly_and_records_every_check_as_skipped(tmp_path):
    out = tmp_path / "gpu.json"
    started = time.monotonic()
    done = subprocess.run(["make", "-s", "gpu-check", f"GPU_JSON={out}", f"PY={sys.executable}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)  # PY: this interpreter, the torch it has
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 60
    result = json.loads(out.read_text())
    assert result["cuda_available"] is False and result["device"] is None and result["torch"] == torch.__version__
    assert set(result["checks"]) == set(CHECKS) >= {"cuda_ipc_sync", "trainer_tp1_cuda", "embedded_engine_cuda"}
    assert {c["status"] for c in result["checks"].values()} == {"skipped: no CUDA"}
    assert result["needs_more_devices"] and all(line.startswith("needs 2 GPUs: ") for line in result["needs_more_devices"])
    assert all(line in done.stdout for line in result["needs_more_devices"])


def test_every_gpu_check_names_a_gpu_marked_test_that_exists():
    nodes = [node for node, _ in CHECKS.values()]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           *nodes], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(nodes) <= set(done.stdout.split()), done.stdout
