"""Loading user code by dotted import path (rollout functions, tasks, reward functions) and checking its
signature at start-up, so a typo in a config fails in the first second instead of after an hour of rollout."""
from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from typing import Any, Callable


def _split_path(path: str, what: str) -> tuple[str, str]:
    """'pkg.mod:attr' or 'pkg.mod.attr' -> ('pkg.mod', 'attr')."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what}: expected an import path like 'package.module:name', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what}: {path!r} is not an import path; write it as 'package.module:name'")
    return module_name, attr


# glue's modules before it was cut into wings (docs/architecture.md): a config or a user module that names the old
# path is refused with the new one, so the fix is one edit.
MOVED_MODULES = {
    **{f"glue.{m}": f"glue.loop.{m}" for m in ("batch", "buffer", "checkpoint", "colocation", "controller",
                                                "evaluation", "replay", "staleness", "stream")},
    "glue.config": "glue.rollout.config, glue.rewards.config or glue.loop.config (by section)",
    "glue.rollout": "glue.rollout.manager", "glue.routed_experts": "glue.rollout.routed_experts",
    "glue.openai_agent": "glue.rollout.openai_agent", "glue.fleet": "glue.fleet.fleet",
    "glue.fleet_watch": "glue.fleet.watch", "glue.engine_host": "glue.fleet.engine_host",
    "glue.processes": "glue.fleet.processes", "glue.engine_client": "glue.fleet.engine_client",
    "glue.reward_models": "glue.rewards.models", "glue.judge": "glue.rewards.judge",
    "glue.scalar_rm": "glue.rewards.scalar_rm", "glue.teacher": "glue.rewards.teacher",
    "glue.reward_shaping": "glue.rewards.shaping", "glue.isolated": "glue.rewards.isolated",
    "glue.metrics": "glue.metrics.logger", "glue.plots": "glue.metrics.plots",
    "glue.learning_curves": "glue.metrics.learning_curves",
    "glue.tiny_text_model": "glue.embedded_engine.tiny_text_model",
}


def moved_to(module_name: str) -> str | None:
    """Where an old glue module lives now, or None for a module that did not move."""
    return MOVED_MODULES.get(module_name)


def _import_module(module_name: str, path: str, what: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Distinguish "the module in the path does not exist" from "it exists but one of its imports is missing".
        missing = err.name or ""
        if moved_to(missing):
            where = "" if missing == module_name else f" (imported by {module_name!r})"
            raise ImportError(f"{what}: cannot load {path!r}: module {missing!r}{where} moved to "
                              f"{moved_to(missing)}; change the import path") from err
        if module_name == missing or module_name.startswith(missing + "."):
            raise ImportError(
                f"{what}: cannot load {path!r}: module {missing!r} not found; check the spelling and that its "
                f"package is installed or on PYTHONPATH"
            ) from err
        raise ImportError(
            f"{what}: module {module_name!r} (from {path!r}) was found but importing it failed: {err}; "
            f"install the missing package {missing!r}"
        ) from err
    return module


def load_object(path: str, *, what: str) -> Any:
    """Import `path` ('pkg.module:attr', or 'pkg.module.attr') and return the attribute.

    `what` names the role in error messages, e.g. "rollout function" or "task".
    """
    module_name, attr = _split_path(path, what)
    module = _import_module(module_name, path, what)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            if moved_to(module_name):  # glue.rollout, glue.fleet, glue.metrics: now wings of the same name
                hint = f"; module {module_name!r} moved to {moved_to(module_name)}"
            raise AttributeError(
                f"{what}: cannot load {path!r}: {getattr(obj, '__name__', module_name)!r} has no attribute "
                f"{part!r}{hint}"
            )
        obj = getattr(obj, part)
    return obj


def check_signature(fn: Callable, expected_params: list[str], what: str) -> None:
    """Check `fn` is an async function taking exactly the positional parameters `expected_params`.

    Names must match too: the documented contract is positional, but a mismatched name usually means the
    parameters are in a different order than the user thinks.
    """
    expected = f"async def {getattr(fn, '__name__', 'fn')}({', '.join(expected_params)})"
    if not callable(fn):
        raise TypeError(f"{what}: {fn!r} is not callable; expected a function with signature `{expected}`")
    # A callable object (class instance with `async def __call__`) is accepted too.
    target = fn if inspect.isroutine(fn) or isinstance(fn, functools.partial) else fn.__call__
    if not inspect.iscoroutinefunction(target):
        raise TypeError(f"{what}: {_describe(fn)} is not an async function; expected signature `{expected}`")
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_extra = [
        p for p in params[len(positional):]
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty
    ]
    names = [p.name for p in positional]
    if names != list(expected_params) or required_extra:
        raise TypeError(f"{what}: {_describe(fn)} has signature {signature}; expected `{expected}`")


def _describe(fn: Callable) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}:{name}" if module else name
