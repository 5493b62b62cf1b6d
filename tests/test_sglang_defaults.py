"""With SGLang engines (real servers, or the embedded engine in strict mode) sluice picks what SGLang supports, and
`--dry-run` refuses, in one line, what cannot work against it."""
from __future__ import annotations

import pytest

from launch.cli import main
from launch.config import load_config
from launch.plan import resolve

STRICT = ["cluster.engine=sglang_strict"]


@pytest.mark.parametrize("setting, says", [
    ("sync.verify=checksum", "sync.verify=checksum with SGLang engines"),
    ("sync.verify=full", "sync.verify=full with SGLang engines"),
    ("sync.pause_mode=in_place", "sync.pause_mode=in_place with SGLang engines"),
    ("sync.transport=ipc", "sync.transport=ipc with SGLang engines"),
    ("sync.delta=true", "sync.delta=true with SGLang engines"),
    ("sglang.pp_size=2", "--sglang-pp-size (sglang.pp_size) is set by sluice itself"),
])
def test_dry_run_refuses_what_sglang_cannot_do_in_one_line(capsys, setting, says):
    assert main(["--dry-run", *STRICT, setting]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.parametrize("setting", ["sync.verify=checksum", "sync.verify=full", "sync.pause_mode=in_place",
                                     "sync.transport=ipc", "sync.delta=true"])
def test_the_same_settings_stay_allowed_with_the_embedded_engine(setting):
    resolve(load_config(None, [setting] + (["cluster.placement=colocated"] if "ipc" in setting else [])))


def test_sglang_defaults_are_auto_verification_and_abort_pauses():
    cfg, plan = resolve(load_config(None, STRICT))
    assert cfg.sync.verify == "auto" and cfg.sync.pause_mode == "abort"
    assert cfg.cluster.engine_kind == "sglang" and cfg.cluster.engine_server == "embedded"
    assert "glue.embedded_engine" in plan.engines[0].command  # the CPU engine, in SGLang's strict face
    assert "--sglang-strict" in plan.engine_args and plan.engine_args[:2] == ["--tp-size", "1"]


def test_strict_engines_may_simulate_engine_tp_on_cpu():
    cfg, plan = resolve(load_config(None, STRICT + ["cluster.engine_tensor_parallel_size=2", "rollout.num_engines=1"]))
    assert plan.engine_args[:2] == ["--tp-size", "2"]
    with pytest.raises(Exception, match="runs one process per engine"):
        resolve(load_config(None, ["cluster.engine_tensor_parallel_size=2", "rollout.num_engines=1"]))
