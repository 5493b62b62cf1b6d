"""An engine that stops answering (SIGSTOP: alive, holding its sockets) is removed from the broadcast bridge: the
removal succeeds in seconds, the source closes its side of the old weight group, and the group rebuilt for the
others (and then for a replacement) syncs."""
from __future__ import annotations

import os
import signal
import time

import torch

from glue.loop.config import SyncConfig
from glue.fleet.fleet import RolloutFleet
from helpers.engines import call
from weight_sync.bridge import make_bridge
from weight_sync.sender import LocalWeightSource


class RecordingSource(LocalWeightSource):
    """The real source, with the names of the channels it was asked to close."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.closed: list[str] = []

    def close_weight_channel(self, name: str) -> None:
        self.closed.append(name)
        super().close_weight_channel(name)


def test_a_hung_engine_is_removed_from_the_broadcast_group_and_the_rebuilt_group_syncs_a_replacement(
        tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    source = RecordingSource({n: p.detach().clone() for n, p in model.named_parameters()})
    fleet = RolloutFleet(model_path=tiny_model_dir, num_engines=2, log_dir=tmp_path / "logs",
                         engine_args=["--num-threads", "1"])
    fleet.start()
    bridge = None
    hung = fleet.pids[0]
    try:
        bridge = make_bridge(SyncConfig(transport="broadcast", verify="checksum", timeout_s=60.0), source=source,
                             engine_urls=list(fleet.engine_urls))
        bridge.sync(1)
        first_group = next(iter(source._sender.channels))
        os.kill(hung, signal.SIGSTOP)
        t0 = time.monotonic()
        bridge.remove_engine(fleet.engine_urls[0])
        assert time.monotonic() - t0 < 30, "removing a hung engine waited out the weight group's timeout"
        assert bridge.engine_urls == [fleet.engine_urls[1]]
        assert first_group in source.closed and first_group not in source._sender.channels
        assert bridge.sync(2) and call(fleet.engine_urls[1], "/model_info")[1]["weight_version"] == "2"
        assert bridge.last_sync["left_behind"] == 1.0  # the hung engine's side of the group: counted, not hidden
        late = fleet.add_engine(prepare=bridge.add_engine)
        assert call(late, "/model_info")[1]["weight_version"] == "2"
        bridge.sync(3)
        assert [call(u, "/model_info")[1]["weight_version"] for u in bridge.engine_urls] == ["3", "3"]
        bridge.close()
        bridge = None
        assert "" not in source.closed and not source._sender.channels
    finally:
        os.kill(hung, signal.SIGCONT)
        if bridge is not None:
            bridge.close()
        fleet.stop()
