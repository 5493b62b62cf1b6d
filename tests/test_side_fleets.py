"""The teacher's and the judge's fleets on bundles of their own: planned for GPUs, the distillation and judge recipes
give the trainer, the policy engines and the teacher / judge engines disjoint devices (in the plan, in Ray's
placement group: tests/test_launch_cluster.py, and in the rehearsal that models them on CPU); too few GPUs is one
line naming the figures; and a teacher engine killed mid-run is replaced by the same watch that keeps the policy's
engines serving."""
import asyncio
import contextlib
import os
import re
import signal
import time

import pytest

from glue.fleet.fleet import RolloutFleet
from glue.fleet.repairs import fleet_repair
from glue.fleet.watch import FleetWatch
from launch.config import ConfigError, build, load_config, SluiceConfig
from launch.plan.run_plan import resolve
from launch.run.fleets import planned_devices_env
from launch.tools.rehearse import raw_config
from launch.tools.shrink import shrink
from helpers.fleet import StandInFleet

# (recipe, its fleet beside the policy's, overrides that plan it for one 8-GPU node)
RECIPES = [("examples/configs/distill.yaml", "teacher", ["teacher.num_engines=2", "teacher.gpus=2"]),
           ("examples/configs/judge_reward.yaml", "judge", ["judge.tensor_parallel_size=2"])]


def devices_by_role(plan, side: str) -> dict[str, list]:
    """Each role's devices: (node, gpu) on GPUs, the device a CPU bundle stands for in a rehearsal."""
    def device(bundle):
        return plan.bundle_slots[bundle] if plan.device == "gpu" else plan.device_of(bundle)

    return {"trainer": [device(r.bundle) for r in plan.trainer],
            "policy engines": [device(b) for e in plan.engines for b in e.bundles],
            side: [device(b) for b in plan.side_fleet(side).bundles]}


def assert_disjoint(roles: dict[str, list]) -> None:
    seen = [d for devices in roles.values() for d in devices]
    assert len(seen) == len(set(seen)), f"two roles share a device: {roles}"


@pytest.mark.parametrize("recipe, side, overrides", RECIPES)
def test_a_recipe_planned_for_gpus_gives_trainer_policy_and_its_side_fleet_disjoint_devices_also_in_rehearsal(
        recipe, side, overrides, tmp_path):
    raw = raw_config(["--config", recipe, "cluster.gpus_per_node=8", *overrides])
    _, plan = resolve(build(SluiceConfig, raw, prefix=""))
    roles = devices_by_role(plan, side)
    assert_disjoint(roles)
    fleet = plan.side_fleet(side)
    assert len(roles[side]) == len(fleet.engines) * fleet.tp == 2  # two teacher engines, or one judge engine of TP 2
    assert all(len({node for node, _ in [plan.bundle_slots[b] for b in e.bundles]}) == 1 for e in fleet.engines)
    assert f"--tp-size {fleet.tp}" in " ".join(fleet.engines[0].command)
    # the rehearsal of the same recipe: CPU bundles stand for the devices, and every engine is told only its own
    shrunk = shrink(raw, data_dir=tmp_path / "data", name_hint=recipe)
    _, rehearsed = resolve(build(SluiceConfig, shrunk.raw, prefix=""))
    assert rehearsed.models_devices and rehearsed.side_fleet(side).tp == fleet.tp  # engine TP 2 stays 2 (strict)
    assert_disjoint(devices_by_role(rehearsed, side))
    engines = rehearsed.side_fleet(side).engines
    told = [planned_devices_env(rehearsed, e.bundles)["SLUICE_PLANNED_DEVICES"] for e in engines]
    assert told == [",".join(rehearsed.device_of(b) for b in e.bundles) for e in engines]
    assert not set(",".join(told).split(",")) & set(devices_by_role(rehearsed, side)["trainer"])


@pytest.mark.parametrize("overrides, message", [
    (["cluster.gpus_per_node=4", "teacher.num_engines=2"],
     "disaggregated placement asks for trainer 1 + engines 2 + teacher 2 = 5 GPUs but cluster.num_nodes x "
     "gpus_per_node = 4; lower the parallel sizes / rollout.num_engines / teacher.num_engines"),
    (["cluster.gpus_per_node=8", "teacher.gpus=3"], "teacher.gpus=3 but teacher.num_engines x tensor_parallel_size "
                                                    "= 1 x 1 = 1"),
    (["cluster.gpus_per_node=4", "cluster.num_nodes=2", "teacher.tensor_parallel_size=2"],
     "teacher engine 0 would span nodes 0 and 1"),
    (["teacher.tensor_parallel_size=2"], "teacher.tensor_parallel_size=2: the embedded engine"),
])
def test_a_side_fleet_that_does_not_fit_is_refused_in_one_line_naming_the_figures(overrides, message):
    with pytest.raises(ConfigError, match=None) as refused:
        resolve(load_config("examples/configs/distill.yaml", overrides))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_cpu_run_keeps_its_teacher_and_judge_on_cpu_bundles_after_the_trainers():
    _, plan = resolve(load_config("examples/configs/distill.yaml"))
    assert plan.device == "cpu" and len(plan.bundles) == 4  # 2 policy engines, 1 trainer rank, 1 teacher engine
    assert plan.side_fleet("teacher").bundles == [3] and plan.side_fleet("teacher").engines[0].devices is None
    assert "--enable-return-routed-experts" not in plan.side_fleet("teacher").engine_args


@pytest.mark.slow
def test_a_killed_teacher_engine_is_replaced_by_the_watch_beside_the_policys_and_counted_under_its_name(
        tiny_model_dir, tmp_path, capsys):
    policy = StandInFleet(1, hung=set(), hang_s=0)
    try:
        with RolloutFleet(model_path=tiny_model_dir, num_engines=1, engine_args=["--num-threads", "1"],
                          log_dir=tmp_path / "teacher", name="teacher") as teacher:
            first = teacher.engine_urls[0]
            teacher_watch = FleetWatch(teacher, repair=fleet_repair(teacher), poll_s=0.2, health_interval_s=60)
            watch = FleetWatch(policy, repair=None, poll_s=0.2, health_interval_s=60, beside=[teacher_watch])

            async def training():
                os.kill(teacher._engines[0].pid, signal.SIGKILL)
                deadline = time.monotonic() + 120
                while teacher_watch.restarts < 1 or not teacher.serving_urls:
                    assert time.monotonic() < deadline, "the teacher's engine was not replaced within 120 s"
                    await asyncio.sleep(0.1)
                return "trained"

            async def main():
                return await watch.run(asyncio.ensure_future(training()))

            assert asyncio.run(main()) == "trained"
            assert teacher.registered_workers() == {teacher.engine_urls[0]: True} and teacher.engine_urls[0] != first
            assert teacher_watch.metrics()["fault/teacher_engine_restarts"] == 1.0
    finally:
        policy.close()
    out = capsys.readouterr().out
    assert "sluice: teacher engine 0 (" in out and "exited with code -9" in out
    assert "sluice: teacher engine 0 serves again at" in out and "with its weights" in out


@pytest.mark.slow
@pytest.mark.long  # a whole distillation run (~55 s on 2 cores); the watch's repair of a teacher engine stays in CI
def test_a_teacher_engine_killed_mid_run_is_replaced_and_the_run_finishes_with_no_group_lost(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import descendants, sluice_run
    from glue.metrics.logger import read_metrics

    metrics = tmp_path / "d" / "metrics.jsonl"
    command = [sys.executable, "-m", "launch", "--config", "examples/configs/distill.yaml",
               f"run.output_dir={tmp_path}",
               "run.name=d", "run.num_steps=60", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
               "rollout.num_engines=1", "teacher.num_engines=2", "cluster.engine=sglang_strict"]
    with sluice_run(command, lambda: metrics.exists() and len(read_metrics(metrics)) >= 1,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, seen):
        teachers = [p for p in descendants(proc.pid)
                    if b"teacher_model" in (Path("/proc") / str(p) / "cmdline").read_bytes()]
        assert len(teachers) == 2, teachers
        os.kill(teachers[1], signal.SIGKILL)  # one of the two; the router sends its work to the other
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, 61))  # long enough for the replacement to serve
    assert sum(r["rollout/failed_groups"] for r in records) == 0  # every group was scored: by engine 0 meanwhile
    assert records[-1]["fault/teacher_engine_restarts"] == 1 and records[-1]["fault/engine_restarts"] == 0
    # (tqdm's progress bar shares stdout: the line may follow a bar on the same line)
    served = r"sluice: teacher engine [01] serves again at http://127\.0\.0\.1:\d+ with its weights"
    assert re.search(served, out), out[-2000:]


def test_a_group_the_teachers_fleet_cannot_score_fails_alone_instead_of_ending_the_run():
    from glue.rewards.teacher import TeacherScorer, TeacherScoringManager
    from glue.types import Group, Sample, SampleStatus

    class GoneTeacher:  # what the engine client raises once its retries are spent on a fleet with no engine left
        async def generate(self, *args, **kwargs):
            raise ConnectionError("generate: http://router/generate could not serve it after 7 attempts (HTTP 503)")

    class Manager:
        def next_group(self):
            async def generated():
                return Group(group_id=5, samples=[Sample(prompt_tokens=[1, 2], response_tokens=[3, 4], group_id=5,
                                                         index=i) for i in range(2)])
            return 5, generated()

    group_id, scoring = TeacherScoringManager(Manager(), TeacherScorer(GoneTeacher())).next_group()
    group = asyncio.run(scoring)
    assert group_id == 5 and group.lost and group.error.startswith("the teacher could not score it: generate: ")
    assert [s.status for s in group.samples] == [SampleStatus.FAILED] * 2
