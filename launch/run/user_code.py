"""The user's code as a run sees it: where it imports from (the config file's folder and the working directory, on
the import path of the driver and of every process it starts), which modules the config names, and their record in
the run folder (a hash of each, and its source under runs/<name>/code/)."""
from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # pkg.module:attr, as task_args name hooks


def user_dirs(config_path: str | os.PathLike | None) -> list[str]:
    """The folders user modules import from: the config file's, then the working directory (absolute, no repeats)."""
    dirs = [Path(config_path).resolve().parent] if config_path is not None else []
    dirs.append(Path.cwd().resolve())
    return list(dict.fromkeys(str(d) for d in dirs))


def put_on_import_path(config_path: str | os.PathLike | None) -> list[str]:
    """Put `user_dirs` first on this process's `sys.path` and on `PYTHONPATH`, which every process started from here
    inherits: a local Ray cluster's workers (the trainer ranks), the isolated reward workers, the engines. An
    attached Ray cluster gets the same PYTHONPATH through the job's runtime_env (launch.run.cluster.start_ray)."""
    dirs = user_dirs(config_path)
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    present = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([d for d in dirs if d not in present] + present)
    return dirs


def named_plugins(cfg: Any) -> list[tuple[str, str]]:
    """(config key, import path) of every piece of code the config names: the rollout function, the tasks, the
    import paths among their task_args (reward, env, parse_action, ...), the judge's parser, the teacher's build
    hook."""
    named = [("rollout.function", cfg.rollout.function), ("rollout.task", cfg.rollout.task)]
    named += _hooks("rollout.task_args", cfg.rollout.task_args)
    if cfg.eval.enabled:
        if cfg.eval.task is not None:
            named.append(("eval.task", cfg.eval.task))
        named += _hooks("eval.task_args", cfg.eval.task_args)
    if cfg.judge is not None:
        named.append(("judge.parser", cfg.judge.parser))
    if cfg.teacher is not None and cfg.teacher.build:
        named.append(("teacher.build", cfg.teacher.build))
    return list(dict.fromkeys(named))


def _hooks(prefix: str, args: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"{prefix}.{k}", v) for k, v in args.items() if isinstance(v, str) and IMPORT_PATH.match(v)]


def module_file(import_path: str) -> Path | None:
    """The source file of the module `import_path` names (importing it), or None for one without a file."""
    module_name = import_path.partition(":")[0] if ":" in import_path else import_path.rpartition(".")[0]
    found = getattr(importlib.import_module(module_name), "__file__", None)
    return Path(found).resolve() if found else None


def plugin_files(cfg: Any) -> list[tuple[str, str, Path | None]]:
    """(key, import path, source file) of each of `named_plugins(cfg)` (checked at start-up, so each imports); a
    task argument that only looks like an import path (`a:b`) and imports nothing is left out."""
    found = []
    for key, path in named_plugins(cfg):
        try:
            found.append((key, path, module_file(path)))
        except ImportError:
            if ".task_args." not in key:
                raise
    return found


def record_code(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Copy the source of every module the config names into `run_dir`/code/ (by module name, e.g.
    code/my_agent.py) and return {import path: {key, file, sha256, copy, git}}: `git` is the module's checkout's
    commit and whether the module is uncommitted (modified or untracked), or None outside a checkout."""
    code_dir = run_dir / "code"
    shutil.rmtree(code_dir, ignore_errors=True)
    code_dir.mkdir(parents=True)
    record = {}
    for key, path, file in plugin_files(cfg):
        if file is None:
            record[path] = {"key": key, "file": None}
            continue
        module_name = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        copy = code_dir / f"{module_name}.py"
        shutil.copyfile(file, copy)
        record[path] = {"key": key, "file": str(file), "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
                        "copy": str(copy.relative_to(run_dir)), "git": file_git_state(file)}
    return record


def file_git_state(file: Path) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout holding `file`, dirty when the file is modified or untracked; None
    when it is in no checkout (or git is absent)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(file.parent), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=all", "--", file.name)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status)}
