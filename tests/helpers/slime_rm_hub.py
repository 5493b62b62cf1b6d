"""`slime.rollout.rm_hub` for tests whose slime functions score through it (generate_and_rm): the run's own where this
build provides one, else slime's dispatch to `args.custom_rm_path` (async_rm one sample, batched_async_rm a list),
put in place for the test by `monkeypatch`."""
from __future__ import annotations

import importlib
import sys
import types

from glue.rollout.slime import shim


def use_rm_hub(monkeypatch) -> None:
    shim.install()
    try:
        importlib.import_module("slime.rollout.rm_hub")
        return
    except ImportError:
        pass

    async def async_rm(args, sample, **kwargs):
        return await shim.load_function(args.custom_rm_path)(args, sample, **kwargs)

    async def batched_async_rm(args, samples, **kwargs):
        return await shim.load_function(args.custom_rm_path)(args, samples, **kwargs)

    hub = types.ModuleType("slime.rollout.rm_hub")
    hub.async_rm, hub.batched_async_rm = async_rm, batched_async_rm
    monkeypatch.setitem(sys.modules, "slime.rollout.rm_hub", hub)
