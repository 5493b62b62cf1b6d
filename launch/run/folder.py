"""The run folder: whether this run starts fresh or continues a checkpoint, the model it starts from, and what
it leaves behind (plots, the final policy as an HF directory). Shared by RL runs (launch.run.runner) and SFT runs
(launch.run.sft)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from glue.embedded_engine.tiny_model import save_tiny_model
from glue.embedded_engine.tiny_text_model import save_tiny_text_model
from glue.loop.checkpoint import Checkpoints
from glue.metrics.plots import write_plots
from launch.config import ConfigError, SluiceConfig


def check_run_dir(cfg: SluiceConfig) -> None:
    """A folder that holds a previous run is refused unless `run.overwrite`; nothing in it is touched here."""
    run_dir = cfg.run_dir
    metrics = run_dir / "metrics.jsonl"
    if cfg.run.overwrite or not (metrics.exists() or (run_dir / "config.yaml").exists()):
        return
    steps = sum(1 for line in metrics.open() if line.strip()) if metrics.exists() else 0
    raise ConfigError(f"{run_dir} holds a previous run ({steps} steps in metrics.jsonl); start this one under "
                      "another run.name=..., or set run.overwrite=true to replace it (its files are replaced only "
                      "once the new run has started)")


def find_checkpoint(cfg: SluiceConfig) -> Path | None:
    """The checkpoint this run continues from (`run.resume`: auto = the run folder's latest, never, or a path), or
    None for a fresh start. A folder holding a previous run with nothing to continue is refused unless
    `run.overwrite`; nothing in it is touched here."""
    resume = cfg.run.resume
    if resume not in ("auto", "never"):
        try:
            check_resume_kind(Checkpoints.read_state(resume), resume, cfg.run.mode)
        except FileNotFoundError as err:
            raise ConfigError(f"run.resume={resume!r}: {err}") from None
        return Path(resume).resolve()
    if cfg.run.overwrite:
        return None
    latest = newest_complete(Checkpoints(cfg.run_dir / "checkpoints")) if resume == "auto" else None
    if latest is not None and cfg.run.debug != "off":
        raise ConfigError(f"{cfg.run_dir} holds checkpoint {latest.name}, but a run.debug={cfg.run.debug} run does "
                          "not resume; start it under another run.name=..., or set run.overwrite=true")
    if latest is not None:
        check_resume_kind(Checkpoints.read_state(latest), latest, cfg.run.mode)
        return latest
    check_run_dir(cfg)
    return None


def newest_complete(checkpoints: Checkpoints) -> Path | None:
    """The newest complete checkpoint; a newer incomplete one (no state.json) is passed over with a line."""
    latest = checkpoints.latest()
    newest = -1 if latest is None else int(latest.name.split("_")[1])
    for skipped in checkpoints.incomplete():
        if int(skipped.name.split("_")[1]) > newest:
            print(f"sluice: {skipped} is not a complete checkpoint (no state.json, which is written last): passed "
                  f"over; resuming from {latest if latest is not None else 'the start'}", flush=True)
    return latest


def check_resume_kind(state: dict, checkpoint, mode: str) -> None:
    """An RL run resumes an RL run's checkpoint and an SFT run an SFT one (launch.run.sft); an RL run starts from an SFT
    run's policy through model.path instead (its exported hf/)."""
    if (state.get("mode") == "sft") != (mode == "sft"):
        what = "an SFT run's" if state.get("mode") == "sft" else "an RL run's"
        raise ConfigError(f"{checkpoint} is {what} checkpoint and this is a run.mode={mode} run, which resumes only "
                          f"its own kind; to start from its policy, export it (sluice export-hf {checkpoint} OUT) and "
                          "set model.path=OUT, under another run.name=...")


def prepare_model(cfg: SluiceConfig, run_dir: Path) -> str:
    """The HF checkpoint directory engines and trainer load, as an absolute path (engines and trainer ranks may run
    in other folders, or on other nodes that mount the same file system): the configured one, or a tiny random
    model written into the run directory."""
    if cfg.model.path is not None:  # checked by launch.run.preflight
        return str(Path(cfg.model.path).resolve())
    from dataclasses import asdict

    from transformers.utils import logging as hf_logging

    tiny = asdict(cfg.model.tiny)
    save = save_tiny_text_model if tiny.pop("tokenizer") else save_tiny_model
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, for a few kilobytes
    return str(Path(save(str(run_dir / "init_model"), **tiny)).resolve())


def plot_run(run_dir: Path) -> str:
    """Write the run's plots (glue.metrics.plots) and say where; a plot that fails costs one warning line, never the run."""
    try:
        written = write_plots(run_dir)
    except Exception as err:  # plots are a view of metrics.jsonl, which is complete whatever happens here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"sluice: warning: plots not written ({type(err).__name__}: {reason}); try `sluice plot {run_dir}`",
              flush=True)
        return ""
    return f"; {len(written)} plots in {run_dir / 'plots'}" if written else ""


def export_final_policy(checkpoint: Path, out: Path) -> None:
    """`checkpoint`'s weights as an HF directory at `out` (launch.tools.export_hf, in a process of its own: it starts a
    gloo group of one, which the driver must not hold). Checkpoints from before dist/ carry hf/ already."""
    shutil.rmtree(out, ignore_errors=True)
    if (checkpoint / "hf").is_dir():
        shutil.copytree(checkpoint / "hf", out)
        return
    done = subprocess.run([sys.executable, "-m", "launch.tools.export_hf", str(checkpoint), str(out)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"exporting {checkpoint} to {out} failed (exit {done.returncode}): "
                           f"{done.stderr.strip().splitlines()[-1:] or done.stdout[-500:]}; run "
                           f"`sluice export-hf {checkpoint} {out}` to retry")
