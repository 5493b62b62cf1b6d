"""Bring an SFT run (`run.mode: sft`) up and down: model, chat data, Ray + placement group, the megatron-core trainer
with the SFT loss, then glue.sft.loop; checkpoints, loggers, plots and the final HF export are an RL run's own, so
`runs/<name>/hf/` is a `model.path` an RL run starts from (docs/sft.md). No engines, router or weight bridge."""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

from glue.loop.checkpoint import Checkpoints
from glue.metrics.logger import open_run_logger, read_metrics, run_info
from glue.sft.data import ConversationStream, load_samples, write_example_chats
from glue.sft.loop import loss_summary, run_sft_loop
from glue.trainer.group import TrainerGroup
from launch.config import ConfigError, SluiceConfig, to_dict, write_resolved
from launch.plan.model_check import has_tokenizer
from launch.plan.run_plan import RunPlan
from launch.run.cluster import check_paths, start_cluster
from launch.run.components import trainer_actor_options, trainer_log_dir
from launch.run.folder import export_final_policy, find_checkpoint, plot_run, prepare_model
from launch.run.folder_lock import RunFolderLock
from launch.run.preflight import preflight
from launch.run.startup import StartupClock
from launch.run.stopping import StopSignals


def run_sft(cfg: SluiceConfig, plan: RunPlan) -> Path:
    """Run the resolved SFT config `cfg` to completion (or a requested stop); returns the run directory."""
    preflight(cfg, plan)
    check_sft_files(cfg)
    with RunFolderLock(cfg.run_dir):  # one run per folder, for the run's whole life (launch.run.folder_lock)
        return run_sft_in_folder(cfg, plan)


def run_sft_in_folder(cfg: SluiceConfig, plan: RunPlan) -> Path:
    """`run_sft`, once the run holds its folder."""
    run_dir = cfg.run_dir
    resume_from = find_checkpoint(cfg)
    clock = StartupClock()
    model_path = prepare_model(cfg, run_dir)
    clock("model", f"{model_path}" + (" (a tiny random model)" if cfg.model.path is None else ""))
    samples, summary = load_data(cfg, model_path)
    clock("data", f"{summary['conversations']} conversations from {cfg.sft.data}: {summary['tokens']} tokens, "
                  f"{summary['trained_tokens']} of them assistant tokens (trained), "
                  f"{summary['cut_frac']:.0%} cut at sft.max_seq_len={cfg.sft.max_seq_len}")
    with contextlib.ExitStack() as stack:
        placement = start_cluster(cfg, plan, stack, clock)
        clock("placement", f"{len(plan.trainer)} trainer bundles")
        stop = stack.enter_context(StopSignals())  # after ray.init, which sets a SIGTERM handler of its own
        trainer = start_sft_trainer(cfg, plan, placement, model_path, stack, clock)
        first_step, cursor = restore_sft(cfg, resume_from, trainer)
        write_resolved(cfg, run_dir / "config.yaml")
        clock.finished(f"SFT for {cfg.run.num_steps} steps of {cfg.sft.conversations_per_step} conversations, "
                       f"metrics in {run_dir / 'metrics.jsonl'}")
        stop.armed = True
        try:
            last_step = train(cfg, samples, trainer, first_step=first_step, cursor=cursor, stop=stop, stack=stack)
        finally:
            stop.stopping = True

    latest = Checkpoints(run_dir / "checkpoints").latest()
    done = f"{loss_summary(read_metrics(run_dir / 'metrics.jsonl'))}; metrics in {run_dir / 'metrics.jsonl'}"
    done += plot_run(run_dir)
    if stop.requested:
        print(f"sluice: stopped at step {last_step} of {cfg.run.num_steps} on {stop.requested}; checkpoint "
              f"{latest}; the same command resumes it (run.resume=auto); {done}", flush=True)
        return run_dir
    export_final_policy(latest, run_dir / "hf")
    print(f"sluice: SFT run finished; {done}; final policy in {run_dir / 'hf'} (use it as model.path of an RL run)",
          flush=True)
    return run_dir


def check_sft_files(cfg: SluiceConfig) -> str:
    """Before anything starts (and in a dry run): the chat data is there (or will be written), and model.path has a
    tokenizer; returns the line a dry run prints."""
    if not Path(cfg.sft.data).is_file() and cfg.sft.example_rows == 0:
        raise ConfigError(f"sft.data={cfg.sft.data!r} does not exist; point it at a JSONL file of "
                          "{\"messages\": [...]} rows, or set sft.example_rows to write generated chats there")
    if cfg.model.path is not None and not has_tokenizer(cfg.model.path):
        raise ConfigError(f"model.path={cfg.model.path!r} holds no tokenizer; run.mode=sft renders chats with the "
                          "model's tokenizer and chat template")
    written = "" if Path(cfg.sft.data).is_file() else f" (written at start-up: {cfg.sft.example_rows} generated chats)"
    return f"sft data: {cfg.sft.data}{written}"


def load_data(cfg: SluiceConfig, model_path: str) -> tuple[list, dict]:
    """The run's conversations as Samples (glue.sft.data), writing the example chats first if asked and absent. A
    bad row is a ConfigError naming its line."""
    from transformers import AutoTokenizer

    s = cfg.sft
    if not Path(s.data).is_file() and s.example_rows > 0:
        write_example_chats(s.data, s.example_rows, seed=cfg.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.chat_template is None:
        raise ConfigError(f"the tokenizer in {model_path} has no chat template; run.mode=sft renders chats with it")
    try:
        return load_samples(s.data, tokenizer, messages_key=s.messages_key, max_seq_len=s.max_seq_len)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def start_sft_trainer(cfg: SluiceConfig, plan: RunPlan, placement, model_path: str, stack: contextlib.ExitStack,
                      clock):
    """The RL run's TrainerGroup, built with the SFT loss (loss.SftLossConfig) instead of the `loss:` section."""
    check_paths(placement, {"the model directory": model_path})
    trainer = TrainerGroup(model_path, cfg.trainer, cfg.sft.loss_config(),
                           actor_options=trainer_actor_options(cfg, plan, placement), log_dir=trainer_log_dir(cfg))
    stack.callback(trainer.shutdown)
    t = cfg.trainer
    clock("trainer", f"{t.world_size} megatron-core ranks (TP {t.tensor_model_parallel_size} x PP "
                     f"{t.pipeline_model_parallel_size} x EP {t.expert_model_parallel_size} x DP "
                     f"{t.data_parallel_size}) hold the model; loss: cross-entropy on assistant tokens "
                     f"({cfg.sft.aggregation}); {trainer.output_line()}")
    return trainer


def restore_sft(cfg: SluiceConfig, checkpoint: Path | None, trainer) -> tuple[int, int]:
    """(first step, data cursor): from `checkpoint` (an SFT run's: its weights, optimizer and data cursor, with
    metrics.jsonl cut back to its step), or (1, 0) on a fresh start, clearing what a previous run left."""
    run_dir, metrics = cfg.run_dir, cfg.run_dir / "metrics.jsonl"
    if checkpoint is None:
        metrics.unlink(missing_ok=True)
        if cfg.run.overwrite:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return 1, 0
    state = Checkpoints.read_state(checkpoint)  # an SFT run's (launch.run.folder.find_checkpoint checked)
    version = trainer.load_checkpoint(str(checkpoint))
    kept = [line for line in (metrics.read_text().splitlines() if metrics.exists() else [])
            if line.strip() and json.loads(line).get("step", 0) <= state["step"]]
    metrics.write_text("".join(line + "\n" for line in kept))
    print(f"sluice: resuming SFT from {checkpoint} (step {state['step']}, version {version}, "
          f"{state['cursor']} conversations served)", flush=True)
    return state["step"] + 1, int(state["cursor"])


def train(cfg: SluiceConfig, samples: list, trainer, *, first_step: int, cursor: int, stop,
          stack: contextlib.ExitStack) -> int:
    """The SFT loop with the run's loggers, checkpoints and progress bar."""
    from tqdm import tqdm

    run_dir = cfg.run_dir
    resume_step = None if first_step == 1 else first_step - 1
    logger = open_run_logger(run_dir, loggers=cfg.run.loggers, info=run_info(to_dict(cfg), resume_step=resume_step),
                             resume_step=resume_step, wandb=to_dict(cfg.run.wandb))
    stack.callback(logger.close)
    progress = stack.enter_context(tqdm(total=cfg.run.num_steps, initial=first_step - 1, unit="step", file=sys.stdout,
                                        desc=f"sluice {cfg.run.name} (sft)", dynamic_ncols=True))

    def on_step(record: dict) -> None:
        progress.update(1)
        progress.set_postfix(loss=f"{record.get('train/loss', 0):.3f}")

    data = ConversationStream(samples, per_step=cfg.sft.conversations_per_step, seed=cfg.run.seed, cursor=cursor)
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.run.keep_checkpoints, interval=cfg.run.save_interval,
                              interval_s=cfg.run.save_interval_s, max_failures=cfg.run.max_checkpoint_failures)
    return run_sft_loop(num_steps=cfg.run.num_steps, data=data, trainer=trainer, logger=logger,
                        checkpoints=checkpoints, first_step=first_step, stop=stop, on_step=on_step)
