"""The sender's channels one by one, in this process (no engine): the factory builds one class per transport and
refuses any other kind; each channel delivers the bytes it was given with the checksum a receiver computes; and a
bucket's send returns the per-tensor checksums the trainer used to compute itself after the send."""
from __future__ import annotations

import pytest
import torch

from weight_sync.buckets import checksum_tensors, plan_buckets, tensor_checksum, unpack_bucket
from weight_sync.channels import CHANNELS, BroadcastChannel, DiskChannel, IpcChannel, open_channel
from weight_sync.config import BridgeConfig
from weight_sync.sender import BucketSender
from weight_sync.transports import DiskTransport, free_port


def tensors_and_layouts(bucket_bytes: int = 4000):
    gen = torch.Generator().manual_seed(7)
    tensors = {f"w{i}": torch.randn(250 * (i + 1), generator=gen) for i in range(3)}
    tensors["b"] = torch.randn(10, generator=gen).to(torch.bfloat16)
    layouts = plan_buckets([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()],
                           bucket_bytes)
    return tensors, layouts


def spec_of(kind: str, layouts, **extra) -> dict:
    return {"kind": kind, "layouts": [b.to_json() for b in layouts], "name": f"test-{kind}", **extra}


def broadcast_spec(layouts, name: str) -> dict:
    """A weight group of the sender alone (world size 1) stands in for the engines."""
    return spec_of("broadcast", layouts, master_address="127.0.0.1", master_port=free_port(), world_size=1,
                   group_name=name, backend="gloo", timeout_s=30)


def test_the_factory_has_one_class_per_transport_and_refuses_any_other_kind():
    assert CHANNELS == {"broadcast": BroadcastChannel, "ipc": IpcChannel, "disk": DiskChannel}
    with pytest.raises(ValueError, match=r"^unknown channel kind 'pigeon': use 'broadcast', 'ipc' or 'disk'$"):
        open_channel({"kind": "pigeon", "layouts": []})


def test_an_ipc_channel_shares_each_bucket_bit_identical_with_its_checksum_one_entry_per_tp_rank():
    from weight_sync.ipc import read_entries

    tensors, layouts = tensors_and_layouts()
    channel = open_channel(spec_of("ipc", layouts, tp_size=2))
    try:
        assert isinstance(channel, IpcChannel) and channel.buffers == []  # allocated where the first bucket's tensors are
        for layout in layouts:
            out = channel.send(layout.index, tensors)
            assert out["checksum"] == checksum_tensors([tensors[n] for n in layout.names])
            assert out["device"] == "cpu" and len(out["handles"]) == 2 and len(channel.buffers) == 2  # pipelined
            read, (stand_in, *_) = read_entries(out["handles"], 2)
            flat = torch.from_file(stand_in.sluice_shm, shared=True, size=read.nbytes, dtype=torch.uint8)
            for name, tensor in unpack_bucket(read, flat):
                assert torch.equal(tensor, tensors[name]), name
        with pytest.raises(ValueError, match="delta sync runs on the broadcast transport; this channel is 'ipc'"):
            channel.prepare(0, tensors, delta=True)
    finally:
        channel.close()
    assert channel.buffers == [] and channel.segments == []


def test_a_disk_channel_writes_a_checkpoint_and_names_it_with_the_last_bucket(tmp_path):
    from weight_sync.disk import read_checkpoint

    tensors, layouts = tensors_and_layouts()
    channel = open_channel(spec_of("disk", layouts, dir=str(tmp_path)))
    try:
        outs = [channel.send(layout.index, tensors) for layout in layouts]
        assert [("path" in out) for out in outs] == [False] * (len(layouts) - 1) + [True]
        named, sums = read_checkpoint(outs[-1]["path"])
        assert sums == [out["checksum"] for out in outs]
        assert all(torch.equal(t, tensors[n]) for n, t in named) and len(named) == len(tensors)
    finally:
        channel.close()


def test_a_streamed_send_returns_the_buckets_tensor_sums_in_the_same_call():
    """The trainer used to call `tensor_checksum` on the bucket's tensors itself after the send; the sender now
    returns exactly those values with the send, and nothing when they were not asked for."""
    tensors, layouts = tensors_and_layouts()
    sender = BucketSender()
    try:
        sender.open_channel("streamed", broadcast_spec(layouts, "test_streamed_sums"), streamed=True)
        assert isinstance(sender.channels["streamed"], BroadcastChannel)
        for layout in layouts:
            bucket = {n: tensors[n] for n in layout.names}
            out = sender.send_bucket("streamed", layout.index, bucket, tensor_sums=True)
            assert out["tensor_sums"] == {n: tensor_checksum(t) for n, t in bucket.items()}
            assert out["checksum"] == checksum_tensors(list(bucket.values()))
            assert "tensor_sums" not in sender.send_bucket("streamed", layout.index, bucket)
    finally:
        sender.close()


def test_a_prepared_bucket_returns_the_sums_taken_when_it_was_prepared_once():
    tensors, layouts = tensors_and_layouts()
    sender = BucketSender()
    try:
        sender.open_channel("delta", broadcast_spec(layouts, "test_prepared_sums"), streamed=True)
        bucket = {n: tensors[n] for n in layouts[0].names}
        answer = sender.prepare_bucket("delta", 0, delta=False, tensors=bucket, tensor_sums=True)
        assert answer["load_format"] == "flattened_bucket" and "tensor_sums" not in answer
        out = sender.send_bucket("delta", 0)
        assert out["tensor_sums"] == {n: tensor_checksum(t) for n, t in bucket.items()}
        assert out["checksum"] == checksum_tensors(list(bucket.values()))
        sender.prepare_bucket("delta", 0, delta=False, tensors=bucket)  # not asked for this time: none are kept
        assert "tensor_sums" not in sender.send_bucket("delta", 0)
    finally:
        sender.close()


def test_make_bridge_takes_a_bridge_config_and_builds_the_transport_it_names(tmp_path):
    from weight_sync.bridge import WeightBridge, make_bridge

    made = {}

    def fake_init(self, source, engine_urls, **kwargs):  # what make_bridge chose, without connecting anything
        made.update(kwargs)
        raise RuntimeError("stop here")

    for cfg, directory in [(BridgeConfig(transport="disk", disk_dir=str(tmp_path / "cfg")), tmp_path / "cfg"),
                           (BridgeConfig(transport="disk"), tmp_path / "arg")]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(WeightBridge, "__init__", fake_init)
            with pytest.raises(RuntimeError, match="stop here"):
                make_bridge(cfg, source=None, engine_urls=[], disk_dir=str(tmp_path / "arg"))
        transport = made["make_transport"](None, [], True, False)
        try:
            assert isinstance(transport, DiskTransport) and transport.directory == str(directory)
        finally:
            transport.close()
        assert made["sources"] == "one" and made["pipeline"] is False and made["verify"] == "auto"
