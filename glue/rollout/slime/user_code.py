"""Loading a slime user function by path ('pkg.module:function', 'pkg.module.function' or 'path/to/file.py:function'),
and the exit hooks its module registers. slime stops a long-lived rollout function's workers at process exit through
`atexit` (its fully-async rollout does); a sluice run can end before its process does (a test, a notebook, a second
run), so the hooks a function's module registered while it was imported are kept here and run at the run's end too."""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import sys
import threading
from typing import Any, Callable, Iterator

from glue.plugins import load_object

PATH_FORMS = "'package.module:function', 'package.module.function' or 'path/to/file.py:function'"
ExitHook = tuple[Callable, tuple, dict]

_exit_hooks: dict[str, list[ExitHook]] = {}  # module name -> what it registered with atexit while it was imported
_import_lock = threading.Lock()


def load_function(path: str, what: str) -> Callable:
    """The function at `path`; atexit hooks registered while its module is imported are kept (`exit_hooks`)."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what}: expected {PATH_FORMS}, got {path!r}")
    file, sep, attr = path.partition(".py:")
    with _import_lock, _recording_exit_hooks() as hooks:
        fn = load_object(path, what=what) if not sep else _load_from_file(os.path.abspath(file + ".py"), attr,
                                                                           path, what)
    if hooks:
        _exit_hooks.setdefault(getattr(fn, "__module__", path), []).extend(hooks)
    return fn


def _load_from_file(file: str, attr: str, path: str, what: str) -> Callable:
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{what}: {path!r}: no such file {file}; give {PATH_FORMS}")
    name = f"slime_user_{os.path.splitext(os.path.basename(file))[0]}"
    if name not in sys.modules:
        sys.path.insert(0, os.path.dirname(file))  # slime scripts import a function's sibling modules this way
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    if not hasattr(sys.modules[name], attr):
        raise AttributeError(f"{what}: {file} has no function {attr!r}")
    return getattr(sys.modules[name], attr)


@contextlib.contextmanager
def _recording_exit_hooks() -> Iterator[list[ExitHook]]:
    """Within the block, what is registered with atexit is registered as usual and also listed."""
    hooks: list[ExitHook] = []
    register = atexit.register

    def recording_register(fn: Callable, *args: Any, **kwargs: Any) -> Callable:
        hooks.append((fn, args, kwargs))
        return register(fn, *args, **kwargs)

    atexit.register = recording_register
    try:
        yield hooks
    finally:
        atexit.register = register


def exit_hooks(fn: Callable) -> list[ExitHook]:
    """The atexit hooks `fn`'s module registered when sluice imported it."""
    return list(_exit_hooks.get(getattr(fn, "__module__", ""), []))


def run_exit_hooks(fn: Callable) -> list[str]:
    """Run `fn`'s module's exit hooks now (they run again at process exit, as registered: slime's are idempotent);
    returns one line per hook that raised (each is run: one failing does not keep the others from stopping)."""
    failures = []
    for hook, args, kwargs in exit_hooks(fn):
        try:
            hook(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported to the caller, the run's end goes on
            failures.append(f"{getattr(hook, '__qualname__', hook)}: {type(err).__name__}: {err}")
    return failures
