"""Tasks as a run builds them: the training task's arguments (the policy's tokenizer given to text tasks), the
eval task, and what a task counts itself."""
from __future__ import annotations

import inspect

from glue.plugins import load_object
from launch.config import SluiceConfig


def task_args_for(task_path: str, task_args: dict, model_path: str) -> dict:
    """`task_args`, with `tokenizer: <model_path>` added when the task is a class whose constructor takes a
    tokenizer and none was given: a text task reads the policy's own tokenizer and chat template by default."""
    task = load_object(task_path, what="task")
    if "tokenizer" in task_args or not inspect.isclass(task):
        return dict(task_args)
    takes_tokenizer = "tokenizer" in inspect.signature(task).parameters
    return {**task_args, "tokenizer": model_path} if takes_tokenizer else dict(task_args)


def eval_task(cfg: SluiceConfig) -> tuple[str, dict]:
    """The eval task's import path and arguments: `eval.task` with `eval.task_args`, or with no `eval.task` the
    training task with `rollout.task_args` updated by `eval.task_args` (e.g. another data file)."""
    if cfg.eval.task is None:
        return cfg.rollout.task, {**cfg.rollout.task_args, **cfg.eval.task_args}
    return cfg.eval.task, dict(cfg.eval.task_args)


def task_metrics(task) -> dict[str, float]:
    """What a task counts itself: `rollout/filtered_prompts` (e.g. TextDataTask's rows over max_prompt_tokens)."""
    count = getattr(task, "filtered_prompts", None)
    return {"rollout/filtered_prompts": float(count)} if isinstance(count, (int, float)) else {}
