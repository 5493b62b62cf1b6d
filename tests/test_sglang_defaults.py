"""With SGLang engines (real servers, or the embedded engine in strict mode) sluice picks what SGLang supports, and
`--dry-run` refuses, in one line, what cannot work against it."""
from __future__ import annotations

import pytest

from launch.cli import main
from launch.config import load_config
from launch.plan.run_plan import resolve

STRICT = ["cluster.engine=sglang_strict"]


@pytest.mark.parametrize("setting, says", [
    ("sync.verify=checksum", "sync.verify=checksum with SGLang engines"),
    ("sync.verify=full", "sync.verify=full with SGLang engines"),
    ("sync.pause_mode=in_place", "sync.pause_mode=in_place with SGLang engines"),
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


GPUS = ["cluster.gpus_per_node=2", "rollout.num_engines=1"]  # SGLang servers (engine auto on a GPU cluster)


def test_colocated_sglang_engines_sync_by_ipc_unless_told_otherwise_and_others_by_broadcast():
    def transport(*overrides):
        return resolve(load_config(None, list(overrides)))[0].sync.transport

    assert transport(*GPUS, "cluster.placement=colocated") == "ipc"
    # shared memory on CPU, one source per device (engines on bundles without a trainer rank get disk, said in the plan)
    assert transport(*STRICT, "cluster.placement=colocated", "rollout.num_engines=3") == "ipc"
    assert transport(*GPUS, "cluster.placement=colocated", "sync.transport=disk") == "disk"
    assert transport(*GPUS) == transport(*STRICT) == transport("cluster.placement=colocated") == "broadcast"


@pytest.mark.parametrize("overrides, says", [
    (GPUS + ["sync.transport=ipc"], "sync.transport=ipc with disaggregated SGLang engines"),
])
def test_ipc_is_refused_where_an_sglang_engine_could_not_open_the_sources_cuda_handles(capsys, overrides, says):
    assert main(["--dry-run", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


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


def test_every_engine_gets_its_own_random_seed_fixed_by_the_run_seed_or_sglang_random_seed():
    from glue.fleet.processes import engine_seed

    def seeds(*overrides):
        _, plan = resolve(load_config(None, ["rollout.num_engines=3", *overrides]))
        assert plan.engine_args.count("--random-seed") == 0  # per engine, never one for all
        return [[a for a in e.command if a.startswith("--random-seed=")] for e in plan.engines]

    first = seeds("run.seed=0")
    assert all(len(s) == 1 for s in first) and len({s[0] for s in first}) == 3
    assert seeds("run.seed=0") == first and seeds("run.seed=1") != first
    assert seeds("sglang.random_seed=7") == [[f"--random-seed={engine_seed(7, i)}"] for i in range(3)]
    # a replacement engine draws new numbers, not its predecessor's again
    assert len({engine_seed(0, 0, launch) for launch in range(4)} | {engine_seed(0, 1, 0)}) == 5


class FleetSeen(Exception):
    """Raised by the stand-in fleet below once it has the arguments a fleet would start with."""


def test_the_judge_and_teacher_fleets_get_seeds_of_their_own_fixed_by_the_run_seed(monkeypatch, tmp_path):
    import contextlib

    from glue.fleet.processes import engine_seed
    import launch.run.fleets
    import launch.run.reward_models
    import launch.run.teacher

    def fleet(**kwargs):
        raise FleetSeen(kwargs["seed"])

    class Placement:  # the bundles' devices and actor options: none on a CPU run
        def engine_env(self, engine):
            return {}

        def actor_options(self, bundle, num_cpus):
            return {}

    monkeypatch.setattr(launch.run.fleets, "RolloutFleet", fleet)
    monkeypatch.setattr(launch.run.fleets, "check_paths", lambda placement, paths: None)  # no Ray here
    monkeypatch.setattr(launch.run.reward_models, "checkpoint_dir", lambda *a: str(tmp_path))
    monkeypatch.setattr(launch.run.teacher, "teacher_model", lambda *a: str(tmp_path))

    def seed_of(config, start, run_seed):
        cfg, plan = resolve(load_config(f"examples/configs/{config}", [f"run.seed={run_seed}"]))
        with contextlib.ExitStack() as stack, pytest.raises(FleetSeen) as seen:
            start(cfg, plan, stack)
        return seen.value.args[0], plan.engine_seed

    judge, policy = seed_of("judge_reward.yaml", lambda c, p, s: launch.run.reward_models.start_judge(
        c, p, Placement(), tmp_path, s, None, lambda *a: None), 3)
    teacher, _ = seed_of("distill.yaml", lambda c, p, s: launch.run.teacher.start_teacher(
        c, p, Placement(), None, str(tmp_path), tmp_path, s, None, lambda *a: None), 3)
    assert (judge, teacher) == (f"{policy}:judge", f"{policy}:teacher")
    # the judge's engine 0 draws other numbers than the policy's engine 0, and the run's seed moves both
    assert engine_seed(judge, 0) != engine_seed(policy, 0)
    assert seed_of("judge_reward.yaml", lambda c, p, s: launch.run.reward_models.start_judge(
        c, p, Placement(), tmp_path, s, None, lambda *a: None), 4)[0] != judge
