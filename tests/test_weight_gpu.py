"""GPU transports (run through the device tool): a ~256 MB bucket by NCCL broadcast between two processes, and by
CUDA IPC handle (SGLang's flattened_bucket payload) to another process; both ends' checksums agree and GB/s is printed
(and recorded for `make gpu-check`'s bench-results/gpu.json). Skipped cleanly without CUDA; NCCL between two ranks
needs two GPUs (NCCL refuses two ranks on one device)."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from conftest import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUMEL = 64 * 1024**2  # float32: 256 MiB


def _layout():
    from weight_sync.buckets import plan_buckets

    return plan_buckets([("w", "float32", (NUMEL // 2,)), ("b", "bfloat16", (NUMEL,))], bucket_bytes=1 << 30)[0]


def _nccl_receiver(port: int, queue) -> None:
    from weight_sync.broadcast import broadcast_bucket
    from weight_sync.buckets import checksum
    from weight_sync.process_group import create_process_group

    torch.cuda.set_device(torch.cuda.device_count() - 1)
    group = create_process_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                                 group_name="gpu_weights", backend="nccl", timeout_s=120)
    flat = torch.empty(_layout().nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        broadcast_bucket(group, flat)
    torch.cuda.synchronize()
    queue.put(checksum(flat))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL broadcast of a bucket between two ranks, "
                    "one device each (weight_sync/broadcast.py, the disaggregated sync path)")
def test_nccl_broadcast_moves_a_bucket_bit_exactly_between_two_processes():
    from weight_sync.broadcast import broadcast_bucket
    from weight_sync.buckets import checksum, pack_bucket
    from weight_sync.process_group import create_process_group

    layout, port = _layout(), free_port()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_nccl_receiver, args=(port, queue))
    proc.start()
    try:
        group = create_process_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                     group_name="gpu_weights", backend="nccl", timeout_s=120)
        tensors = {"w": torch.randn(NUMEL // 2, device="cuda"), "b": torch.randn(NUMEL, device="cuda").bfloat16()}
        flat = pack_bucket(layout, tensors, torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda"))
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            broadcast_bucket(group, flat)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"NCCL broadcast of {layout.nbytes / 1e6:.0f} MB: {layout.nbytes / min(times[1:]) / 1e9:.1f} GB/s")
        assert queue.get(timeout=120) == checksum(flat)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def _ipc_receiver(entry: str, queue) -> None:
    from weight_sync.buckets import checksum
    from weight_sync.ipc import read_entry

    read = read_entry(entry)  # SGLang's envelope, the device found by its UUID
    flat = read.flattened[: read.layout.nbytes]
    t0 = time.perf_counter()
    copy = flat.clone()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    queue.put((checksum(flat), flat.device.type, read.layout.nbytes, seconds, checksum(copy),
               torch.cuda.max_memory_allocated()))
    del flat, read


def test_cuda_ipc_handle_shares_a_bucket_with_another_process_without_a_copy_on_the_source(record_property):
    from weight_sync.buckets import checksum, pack_bucket
    from weight_sync.ipc import encode_cuda_entries

    layout = _layout()
    tensors = {"w": torch.randn(NUMEL // 2, device="cuda"), "b": torch.randn(NUMEL, device="cuda").bfloat16()}
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()  # the weights and the bucket buffer, before the sync
    t_sync = time.perf_counter()
    flat = pack_bucket(layout, tensors, buffer)
    torch.cuda.synchronize()
    [handle] = encode_cuda_entries(buffer, layout, [0])
    assert len(handle) < 10_000  # a handle, not the bytes
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(handle, queue))
    proc.start()
    try:
        got, device, nbytes, seconds, copied, receiver_peak = queue.get(timeout=120)
        sync_s = time.perf_counter() - t_sync  # pack, handle, receiver process start, open, copy-in
        source_extra = torch.cuda.max_memory_allocated() - resident
        print(f"CUDA IPC: receiver copied {nbytes / 1e6:.0f} MB out of the shared bucket at {nbytes / seconds / 1e9:.1f} GB/s")
        for key, value in {"bytes": nbytes, "copy_in_s": seconds, "copy_in_gb_per_s": nbytes / seconds / 1e9,
                           "sync_s_with_process_start": sync_s, "source_peak_extra_bytes": source_extra,
                           "receiver_peak_bytes": receiver_peak}.items():
            record_property(key, value)
        assert source_extra < nbytes // 2, f"the source allocated {source_extra} bytes during the sync: a copy"
        assert device == "cuda" and nbytes == layout.nbytes
        assert got == copied == checksum(flat)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    torch.cuda.ipc_collect()  # the receiver has released its handle
