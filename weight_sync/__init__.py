"""Weight sync: how trainer weights reach the engines (buckets, transports, verification, version tags).
Never imports glue; speaks SGLang's weight endpoints itself. Submodules import torch, so they load on first use:
`weight_sync.make_bridge(cfg.sync, source=trainer, engine_urls=fleet.engine_urls)` builds a connected bridge.
"""
from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("make_bridge", "WeightBridge", "WeightSyncError"):
        from weight_sync import bridge  # lazy: its modules import torch; weight_sync.config must load without it

        return getattr(bridge, name)
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
