"""User code as the launcher finds it: modules beside the config file or in the working directory import in the driver
and in Ray's workers, `--dry-run` says which file each plugin came from, and a misspelt task argument fails the dry run
in one line naming it and the accepted ones."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO_ROOT
import yaml

from helpers.cli import DEMO, one_line_error

TASK = '''
from rollout_fns.toy_tasks import EchoTask


class ShortEchoTask(EchoTask):
    """EchoTask with one-token prompts."""

    def __init__(self, *, prompt_len: int = 1, **echo_args):
        super().__init__(prompt_len=prompt_len, **echo_args)
'''
FUNCTION = '''
from rollout_fns.single_turn import generate_group as built_in


async def generate_group(ctx, prompt, num_samples):
    return await built_in(ctx, prompt, num_samples)
'''


def user_project(tmp_path: Path) -> tuple[Path, Path]:
    """project/ (the working directory) holds my_task.py; project/conf/ holds the config and my_rollout.py."""
    project, conf = tmp_path / "project", tmp_path / "project" / "conf"
    conf.mkdir(parents=True)
    (project / "my_task.py").write_text(TASK)
    (conf / "my_rollout.py").write_text(FUNCTION)
    (conf / "run.yaml").write_text(textwrap.dedent("""\
        run: {name: mine, num_steps: 1}
        model:
          tiny: {family: qwen2, vocab_size: 32, hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, intermediate_size: 128}
        rollout:
          num_engines: 1
          function: my_rollout:generate_group
          task: my_task:ShortEchoTask
          task_args: {prompt_len: 2}
        """))
    return project, conf


@pytest.fixture
def in_project(tmp_path, monkeypatch):
    """The user's project (user_project), entered as its working directory; the import path, PYTHONPATH and the
    modules imported from it are put back afterwards."""
    project, conf = user_project(tmp_path)
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    assert str(project) not in sys.path and str(conf) not in sys.path
    yield project, conf
    for name in ("my_task", "my_rollout"):
        sys.modules.pop(name, None)


def test_modules_beside_the_config_and_in_the_working_directory_import_and_the_dry_run_says_where(
        in_project, capsys):
    from launch.cli import main

    project, conf = in_project
    assert main(["--config", "conf/run.yaml", "--dry-run"]) == 0
    plugins = next(line for line in capsys.readouterr().out.splitlines() if "plugins:" in line)
    assert f"rollout.function my_rollout:generate_group from {conf.resolve() / 'my_rollout.py'}" in plugins
    assert f"rollout.task my_task:ShortEchoTask from {project.resolve() / 'my_task.py'}" in plugins
    # what the processes it starts inherit
    assert os.environ["PYTHONPATH"].split(os.pathsep)[:2] == [str(conf.resolve()), str(project.resolve())]
    # a misspelt argument of the user's task fails the same dry run, through its **kwargs into EchoTask
    assert main(["--config", "conf/run.yaml", "--dry-run", "rollout.task_args.content_hi=9"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "sluice: config error: rollout.task_args.content_hi: my_task:ShortEchoTask takes no argument 'content_hi' "
        "(did you mean 'content_high'?); it takes prompt_len, vocab_size, content_low, content_high, k, bos_id"]


ACTOR = '''
import sys
from launch.run.cluster import start_ray
from launch.run.user_code import put_on_import_path
import contextlib, ray

put_on_import_path(sys.argv[1])
with contextlib.ExitStack() as stack:
    start_ray(address=None, num_cpus=1, stack=stack)

    @ray.remote(num_cpus=0)
    def where(path):
        from glue.plugins import load_object
        import inspect
        return inspect.getsourcefile(load_object(path, what="task"))

    print(ray.get(where.remote("my_task:ShortEchoTask")))
    print(ray.get(where.remote("my_rollout:generate_group")))
'''


@pytest.mark.slow
def test_a_ray_worker_imports_the_users_modules_as_the_driver_does(tmp_path):
    project, conf = user_project(tmp_path)
    (tmp_path / "actor.py").write_text(ACTOR)
    done = subprocess.run([sys.executable, str(tmp_path / "actor.py"), "conf/run.yaml"], cwd=project,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(project.resolve() / "my_task.py"), str(conf.resolve() / "my_rollout.py")]


@pytest.mark.parametrize("config, given, meant", [
    ("examples/configs/demo_async.yaml", "max_latency", "max_latency_s"),      # through **echo_args into EchoTask
    ("examples/configs/calc_multi_turn.yaml", "latency", "latency_s"),
])
def test_a_misspelt_task_argument_of_a_shipped_task_fails_the_dry_run_in_one_line(capsys, config, given, meant):
    from launch.cli import main

    assert main(["--dry-run", "--config", config, f"rollout.task_args.{given}=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"sluice: config error: rollout.task_args.{given}: ")
    assert f"(did you mean {meant!r}?); it takes " in err[0] and f" {meant}," in err[0]


KWARGS_TASK = """
class CheckedTask:
    def __init__(self, **options):
        unknown = set(options) - {"tool_latency_s"}
        if unknown:
            raise KeyError(f"unknown option(s) {sorted(unknown)}; CheckedTask takes tool_latency_s")
        if options.get("tool_latency_s", 0) < 0:
            raise ValueError("tool_latency_s must be >= 0")

    def prompts(self, seed):
        while True:
            yield {"prompt_tokens": [1, 2]}

    def reward(self, sample):
        return 0.0
"""


@pytest.mark.parametrize("given, says", [
    ("tool_latency=1", "KeyError: \"unknown option(s) ['tool_latency']; CheckedTask takes tool_latency_s\""),
    ("tool_latency_s=-1", "ValueError: tool_latency_s must be >= 0"),
])
def test_the_dry_run_builds_a_task_that_checks_its_own_arguments(capsys, tmp_path, monkeypatch, given, says):
    (tmp_path / "checked_task.py").write_text(KWARGS_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = one_line_error(capsys, ["rollout.task=checked_task:CheckedTask", f"rollout.task_args.{given}"])
    assert line == (f"sluice: config error: rollout.task_args: building checked_task:CheckedTask from it failed: "
                    f"{says}")


def test_the_dry_run_says_which_tasks_it_built(capsys, tmp_path, monkeypatch):
    from launch.cli import main

    (tmp_path / "checked_task.py").write_text(KWARGS_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--dry-run", "--config", DEMO, "rollout.task=checked_task:CheckedTask",
                 "rollout.task_args.tool_latency_s=0.5"]) == 0
    plugins = next(line for line in yaml.safe_load(capsys.readouterr().out)["checked"] if line.startswith("plugins"))
    assert plugins.endswith("; built rollout.task from task_args")


def test_an_environment_argument_that_its_class_does_not_take_fails_the_dry_run(capsys, tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    line = one_line_error(capsys, [
        "rollout.function=rollout_fns.multi_turn:generate_group", "rollout.task=rollout_fns.multi_turn:EnvTask",
        "rollout.task_args.env=rollout_fns.envs.calculator:CalculatorEnv", f"rollout.task_args.path={tmp_path}/data.jsonl",
        "rollout.task_args.tokenizer=/nonexistent", "rollout.task_args.env_args={latency: 1}"])
    assert line.startswith("sluice: config error: rollout.task_args.env_args: environment "
                           "'rollout_fns.envs.calculator:CalculatorEnv' cannot be built with env_args {'latency': 1}")


def test_the_run_record_hashes_and_copies_each_named_module_and_an_untracked_one_makes_it_dirty(tmp_path, monkeypatch):
    import hashlib
    import json

    from glue.metrics.logger import run_info
    from launch.config import load_config
    from launch.run.user_code import record_code

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "my_task.py").write_text(TASK)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "my_task.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "task"], check=True)
    (repo / "my_rollout.py").write_text(FUNCTION)  # never added: untracked
    monkeypatch.syspath_prepend(str(repo))
    cfg = load_config(None, ["rollout.function=my_rollout:generate_group", "rollout.task=my_task:ShortEchoTask"])
    run_dir = tmp_path / "run"
    try:
        code = record_code(cfg, run_dir)
    finally:
        for name in ("my_task", "my_rollout"):
            sys.modules.pop(name, None)
    assert set(code) == {"my_rollout:generate_group", "my_task:ShortEchoTask"}
    for path, module in code.items():
        source = Path(module["file"]).read_bytes()
        assert module["sha256"] == hashlib.sha256(source).hexdigest()
        assert (run_dir / module["copy"]).read_bytes() == source
    assert code["my_task:ShortEchoTask"]["git"]["dirty"] is False
    assert code["my_rollout:generate_group"]["git"]["dirty"] is True
    info = json.loads(json.dumps(run_info({}, code=code)))
    if info["git"] is not None:  # sluice's own checkout (None in an unpacked copy)
        assert info["git"]["dirty"] is True and info["git"]["uncommitted_modules"] == ["my_rollout:generate_group"]
