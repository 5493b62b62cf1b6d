"""The `slime` modules that slime's rollout and reward functions import, for running them where slime is not
installed: `slime.utils.types.Sample`, `slime.utils.http_utils.post / get` (http_calls), `slime.utils.misc.load_function`,
`slime.rollout.sglang_rollout` (GenerateState, generate, generate_and_rm, generate_and_rm_group, generate_rollout) and
`slime.rollout.base_types`, with the rule-based rewards of `slime.rollout.rm_hub` (glue.rollout.slime.rm_hub) and the
rest of `slime.utils` that functions import (glue.rollout.slime.utils). `install()` registers them (only when
`import slime` would fail); an installed slime is left alone.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from glue.rollout.slime import rm_hub, sglang_rollout, utils
from glue.rollout.slime.http_calls import get, post
from glue.rollout.slime.sample import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample


def load_function(path: str) -> Any:
    """slime's `load_function`: 'package.module.function'."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


# How slime's rollout decodes (sglang_rollout.GenerateState's sampling_params): special tokens kept in the text
# (--rollout-skip-special-tokens off), a matched stop string kept at the end of it, no spaces added between
# special tokens; slime's functions rely on this, e.g. search-r1 finding "</search>" at the end of a turn's text.
SLIME_TEXT_PARAMS = {"skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}


MODULES = {
    "slime.utils.types": {"Sample": Sample},
    "slime.utils.http_utils": {"post": post, "get": get},
    "slime.utils.misc": {"load_function": load_function},
    "slime.rollout.sglang_rollout": {name: getattr(sglang_rollout, name) for name in (
        "GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "generate_rollout")},
    "slime.rollout.base_types": {"RolloutFnTrainOutput": RolloutFnTrainOutput,
                                 "RolloutFnEvalOutput": RolloutFnEvalOutput},
}


def install() -> bool:
    """Register the `slime` modules above unless slime itself imports; True when they were (or are) installed."""
    if getattr(sys.modules.get("slime"), "__sluice_shim__", False):
        return True
    if importlib.util.find_spec("slime") is not None:
        return False
    for name, attrs in (entry for table in (MODULES, rm_hub.MODULES, utils.MODULES) for entry in table.items()):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module_name = ".".join(parts[:depth])
            if module_name not in sys.modules:
                module = types.ModuleType(module_name, "sluice's stand-in for slime (glue.rollout.slime.shim)")
                module.__path__ = []  # a package, so the next level imports
                module.__sluice_shim__ = True
                sys.modules[module_name] = module
                if depth > 1:
                    setattr(sys.modules[".".join(parts[:depth - 1])], parts[depth - 1], module)
        vars(sys.modules[name]).update(attrs)
    return True
