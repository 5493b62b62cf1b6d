"""`make gpu-check`: the `gpu` tests one NVIDIA GPU holds, run on a machine with torch built for CUDA (no Ray, no
PyPI; megatron-core from a wheel the tree carries in wheels/, if any), their outcomes and figures written to
bench-results/gpu.json. Without CUDA it runs nothing and records every check as "skipped: no CUDA"."""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# check name -> (pytest node id, what it shows)
CHECKS = {
    "cuda_ipc_sync": ("tests/test_weight_gpu.py::"
                      "test_cuda_ipc_handle_shares_a_bucket_with_another_process_without_a_copy_on_the_source",
                      "a 256 MiB bucket shared with another process by CUDA IPC handle (the colocated sync path), "
                      "checksums equal, no copy on the source"),
    "trainer_tp1_cuda": ("tests/test_gpu_one_device.py::"
                         "test_the_trainer_at_tp1_on_cuda_matches_the_hf_model_and_one_step_moves_toward_positive_"
                         "advantages", "megatron-core trainer, TP=1, NCCL world of one: logprobs equal HF's, one step"),
    "embedded_engine_cuda": ("tests/test_gpu_one_device.py::test_the_embedded_engine_holds_its_model_on_cuda_and_"
                             "generates_what_the_cpu_engine_does", "the embedded engine (--device cuda): model and KV "
                             "cache on CUDA, greedy tokens and logprobs equal to the CPU engine's"),
    "core_attention_cuda": ("tests/test_gpu_one_device.py::test_sluices_core_attention_on_cuda_runs_flash_kernels_"
                            "and_equals_the_unfused_reference", "sluice's core attention on CUDA: packed THD rows "
                            "through torch's varlen FlashAttention, equal to the unfused reference in bf16"),
    "norm_cuda": ("tests/test_gpu_one_device.py::test_the_trainers_norm_on_cuda_runs_torchs_fused_kernel_and_the_"
                  "compiled_one_equal_to_sluices", "the trainer's RMSNorm on CUDA: torch's fused kernel (the default "
                  "there) and trainer.compile's, equal to sluice's function in bf16 with gradients"),
    "colocated_ipc_sync": ("tests/test_gpu_one_device.py::test_a_colocated_sync_from_the_trainer_on_cuda_reaches_an_"
                           "engine_on_the_same_gpu_by_cuda_ipc_bit_identically", "a colocated sync, megatron-core "
                           "trainer on CUDA to two embedded engines on the same GPU in one sync, both served by the "
                           "trainer rank there, through /update_weights_from_tensor (SGLang's flattened-bucket "
                           "entries, CUDA IPC handles): every tensor bit-identical on both, a strict engine takes the "
                           "same payload; seconds and GB/s"),
    "nccl_two_ranks": ("tests/test_weight_gpu.py::test_nccl_broadcast_moves_a_bucket_bit_exactly_between_two_processes",
                       "NCCL broadcast of a bucket between two ranks"),
}
NEEDS_MORE_DEVICES = [  # one line each: what `make gpu-check` on one GPU cannot show
    "needs 2 GPUs: NCCL broadcast of a bucket between two ranks, one device each (nccl_two_ranks)",
    "needs 2 GPUs: the trainer at TP=2 (NCCL all-reduce and all-gather across ranks)",
    "needs 2 GPUs: a disaggregated run, one SGLang engine and one trainer rank on devices of their own",
]


class Outcomes:
    """A pytest plugin keeping each test's outcome, skip reason, seconds and `record_property` figures."""

    def __init__(self):
        self.by_node: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.by_node.setdefault(report.nodeid, {"status": "passed", "seconds": 0.0, "figures": {}})
        entry["seconds"] += report.duration
        entry["figures"].update(dict(report.user_properties))
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry["status"] = f"skipped: {reason.removeprefix('Skipped: ')}"
        elif report.failed:
            entry["status"] = "failed"
            entry["error"] = (str(report.longrepr).strip().splitlines() or [""])[-1][:500]


def environment() -> dict:
    """Device name and count, torch and CUDA versions (None where there is no CUDA)."""
    try:
        import torch
    except ImportError as err:
        return {"torch": None, "cuda": None, "cuda_available": False, "device": None, "device_count": 0,
                "why": f"torch is not importable: {err}"}
    available = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": available,
            "device": torch.cuda.get_device_name(0) if available else None,
            "device_count": torch.cuda.device_count() if available else 0}


def install_carried_megatron() -> str | None:
    """megatron-core from wheels/megatron_core-*.whl into .gpu-check-site (no index, no dependencies) when it is not
    importable; returns the folder added to the path, or None."""
    try:
        import megatron.core  # noqa: F401
        return None
    except ImportError:
        pass
    wheels = sorted(glob.glob(str(REPO / "wheels" / "megatron_core-*.whl")))
    if not wheels:
        return None
    target = REPO / ".gpu-check-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(target), wheels[-1]], check=True)
    return str(target)


def put_tree_on_path() -> None:
    """glue, loss, weight_sync from the tree and megatron-core (the carried wheel, when not importable) on this
    process's path and on PYTHONPATH, which its child processes inherit: nothing is installed on the GPU machine."""
    site = install_carried_megatron()
    for folder in ([site] if site is not None else []) + [str(REPO)]:
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])


def run_checks(env: dict) -> dict[str, dict]:
    if not env["cuda_available"]:
        why = env.get("why") or "no CUDA"
        return {name: {"status": f"skipped: {why}", "test": node, "what": what}
                for name, (node, what) in CHECKS.items()}
    import pytest

    put_tree_on_path()
    outcomes = Outcomes()
    os.chdir(REPO)
    pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", *(node for node, _ in CHECKS.values())],
                plugins=[outcomes])
    missing = {"status": "failed", "error": "not collected: the test was renamed or its file failed to import"}
    return {name: {**outcomes.by_node.get(node, missing), "test": node, "what": what}
            for name, (node, what) in CHECKS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "gpu.json"), help="where to write the JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    env = environment()
    checks = run_checks(env)
    result = {**env, "checks": checks, "needs_more_devices": NEEDS_MORE_DEVICES,
              "seconds": time.perf_counter() - started}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for name, check in checks.items():
        print(f"gpu-check {name}: {check['status']}")
    for line in NEEDS_MORE_DEVICES:
        print(line)
    print(f"gpu-check: wrote {out}")
    return 1 if any(c["status"] == "failed" for c in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
