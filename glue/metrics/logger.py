"""Per-step metrics: one JSON object per line in `runs/<name>/metrics.jsonl`, plus the timers that fill `time/*`.
The same records go to TensorBoard (`runs/<name>/tensorboard/`) and W&B when `run.loggers` asks for them."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence


class MetricsSink(Protocol):
    """Somewhere else a step's numbers go (TensorBoard, W&B); metrics.jsonl stays the record of the run."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class MetricsLogger:
    """Appends one JSON record per step; values must be plain numbers or strings (tensors are converted). The
    numeric values also go to each of `sinks` under the record's `step`; strings (e.g. rollout/group_ids) do not."""

    def __init__(self, path: Path, sinks: Sequence[MetricsSink] = ()):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = list(sinks)
        self._records = 0

    def log(self, record: dict[str, Any]) -> None:
        clean = {key: _plain(value) for key, value in record.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        self._records += 1
        if self.sinks:
            step = clean.get("step", self._records)
            scalars = {key: float(value) for key, value in clean.items()
                       if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
            for sink in self.sinks:
                sink.log_scalars(int(step), scalars)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it visible instead of failing the run
    return value


class TensorboardSink:
    """Scalars as TensorBoard event files in `log_dir` (torch's SummaryWriter), flushed every step so a live
    `tensorboard --logdir runs/` sees each step as it lands. A resumed run passes `purge_step`: TensorBoard then
    drops the steps an earlier session logged past the checkpoint."""

    def __init__(self, log_dir: Path, *, info: dict[str, Any], purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        text = json.dumps(info, indent=2, default=str)
        self.writer.add_text("run_info", "    " + text.replace("\n", "\n    "), global_step=purge_step or 0)
        self.writer.flush()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars to a W&B run (offline by default: `wandb sync <run_dir>/wandb/offline-run-*` uploads it later). The
    run id is kept in `<run_dir>/wandb_run_id`, so a resumed sluice run continues the same W&B run."""

    def __init__(self, run_dir: Path, *, project: str, entity: str | None, mode: str, name: str,
                 config: dict[str, Any], resuming: bool, group: str | None = None):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resuming and id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        settings = wandb.Settings(console="off", quiet=True, x_disable_stats=True)  # no stdout capture, no sampler
        self.run = wandb.init(project=project, entity=entity, mode=mode, id=run_id, name=name, dir=str(run_dir),
                              group=group, config=config, resume="allow", settings=settings)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_run_logger(run_dir: Path, *, loggers: Sequence[str], info: dict[str, Any], resume_step: int | None,
                    wandb: dict[str, Any] | None = None) -> MetricsLogger:
    """The step logger of a run in `run_dir`: metrics.jsonl always, plus the `loggers` asked for ("tensorboard",
    "wandb" with `wandb` = {project, entity, mode, group}). Writes `info` (see `run_info`) to run_info.json. A fresh start
    (`resume_step` None) clears the TensorBoard events a previous run left; a resumed one continues after them."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    sinks: list[MetricsSink] = []
    if "tensorboard" in loggers:
        if resume_step is None:
            shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
        purge = None if resume_step is None else resume_step + 1
        sinks.append(TensorboardSink(run_dir / "tensorboard", info=info, purge_step=purge))
    if "wandb" in loggers:
        w = wandb or {}
        sinks.append(WandbSink(run_dir, project=w.get("project", "sluice"), entity=w.get("entity"),
                               mode=w.get("mode", "offline"), name=run_dir.name, config=info.get("config", {}),
                               resuming=resume_step is not None, group=w.get("group")))
    return MetricsLogger(run_dir / "metrics.jsonl", sinks)


def run_info(config: dict[str, Any], *, resume_step: int | None = None,
             code: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a run was, beyond its metrics: the resolved config, the sluice code's git commit (None outside a git
    checkout), the command line, when it started and from which step, and `code`: the modules the config names
    (launch.run.user_code.record_code: file, sha256, copy in the run folder, git state). `git.dirty` is also true when
    one of those modules is not committed (modified, untracked, or in no checkout at all): the commit alone would
    not give the run back; `git.uncommitted_modules` names them."""
    git = git_commit(Path(__file__).parents[2])
    uncommitted = [path for path, m in (code or {}).items()
                   if m.get("file") is not None and (m.get("git") is None or m["git"]["dirty"])]
    if git is not None and code is not None:
        git = {**git, "dirty": git["dirty"] or bool(uncommitted), "uncommitted_modules": uncommitted}
    return {"started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "resumed_from_step": resume_step, "argv": list(sys.argv), "git": git, "code": code or {},
            "config": config}


def git_commit(directory: Path) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout holding `directory`, or None if it is not one (or git is absent)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # not a checkout, or no git: the run is still recorded
        return None
    return {"commit": commit, "dirty": dirty}


class StepTimer:
    """`with timer("rollout"): ...` records wall seconds as `time/rollout_s`."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.metrics[f"time/{phase}_s"] = time.perf_counter() - start


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in step order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def learning_summary(records: list[dict[str, Any]], window: int = 5) -> str:
    """One line saying whether reward moved: mean `rollout/reward_mean` over the first and last `window` steps."""
    rewards = [r["rollout/reward_mean"] for r in records if isinstance(r.get("rollout/reward_mean"), (int, float))]
    if not rewards:
        return "no rollout/reward_mean recorded"
    n = min(window, len(rewards))
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    return f"reward_mean: first {n} steps {first:.3f} -> last {n} steps {last:.3f} ({last - first:+.3f})"
