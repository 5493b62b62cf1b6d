"""Tasks as a run builds them: the training task's arguments (the policy's tokenizer given to text tasks) checked
against its constructor before anything starts, the eval task, and what a task counts itself."""
from __future__ import annotations

import difflib
import inspect
from typing import Any

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


def accepted_args(task: type) -> tuple[list[str], list[str], bool]:
    """(keyword arguments `task`'s constructor accepts, those it requires, whether it takes any keyword at all). A
    constructor with `**kwargs` is followed into the base classes it forwards them to (super().__init__(**kwargs)),
    as EnvTask does to TextDataTask; one that ends in `**kwargs` with no base left accepts anything."""
    accepted, required = [], []
    for cls in task.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        params = list(inspect.signature(vars(cls)["__init__"]).parameters.values())[1:]
        named = [p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        accepted += [p.name for p in named if p.name not in accepted]
        required += [p.name for p in named if p.default is p.empty and p.name not in required]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return accepted, required, False
    return accepted, required, True


def check_task_args(task_path: str, task_args: dict[str, Any], key: str) -> None:
    """Raise ValueError (one line naming `key`.<name> and the accepted names) when `task_args` has a key the task's
    constructor does not take or lacks one it requires (`tokenizer` excepted: the run gives the model's); then the
    task's own `check_args(task_args)` when it has one (EnvTask: env_args against the environment)."""
    task = load_object(task_path, what="task")
    if not inspect.isclass(task):
        if task_args:
            raise ValueError(f"{key}: {task_path} is an object, not a class, so task_args cannot apply; remove "
                             f"{key} or point the task at the class")
        return
    accepted, required, open_ended = accepted_args(task)
    for name in task_args:
        if name not in accepted and not open_ended:
            close = difflib.get_close_matches(name, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{key}.{name}: {task_path} takes no argument {name!r}{hint}; it takes "
                             f"{', '.join(accepted) or 'none'}")
    missing = [n for n in required if n not in task_args and n != "tokenizer"]
    if missing:
        raise ValueError(f"{key}: {task_path} needs {', '.join(missing)}; set {key}.{missing[0]}")
    if callable(getattr(task, "check_args", None)):
        task.check_args(task_args, key=key)


def build_if_standalone(task_path: str, task_args: dict[str, Any], key: str) -> bool:
    """Build the task from `task_args` as the run will, where it needs nothing the run only makes at start-up (a
    task that takes a tokenizer reads the model directory's files, which a tiny or downloaded-at-start model does
    not have yet): so a task that checks its own arguments (a `**kwargs` task, a bad value) fails the dry run. True
    when built; ValueError, one line naming `key`, when building fails."""
    task = load_object(task_path, what="task")
    if inspect.isclass(task) and "tokenizer" in inspect.signature(task).parameters:
        return False
    from glue.rollout.manager import build_task  # lazy: the rollout side (aiohttp) only for a dry run or a run

    try:
        build_task(task_path, task_args)
    except Exception as err:  # noqa: BLE001 - whatever the user's constructor raises, said in one line
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(f"{key}: building {task_path} from it failed: {type(err).__name__}: {first}") from None
    return True
