"""Ray placement for real: one placement group, bundles mapped to GPUs in a stable order (logical GPUs on CPU),
trainer ranks pinned to their bundles; and a 2-rank CPU run configured only through pass-through flags."""
import contextlib
from pathlib import Path

import pytest

from glue.metrics.logger import read_metrics
from launch.args.command_line import parse_args
from launch.cli import main
from launch.config import load_config
from launch.plan.run_plan import resolve

DEMO = str(Path(__file__).resolve().parents[1] / "examples/configs/demo.yaml")


def test_bundles_map_to_gpus_in_order_and_each_trainer_rank_and_teacher_engine_gets_its_bundles_gpus():
    import ray

    from launch.run import cluster

    args, overrides = parse_args(["--config", DEMO, "--tensor-model-parallel-size", "2", "cluster.gpus_per_node=6",
                                  "cluster.cpus_per_bundle=0.5", "rollout.num_engines=2",
                                  "teacher.build=rollout_fns.echo_teacher:build_echo_teacher",
                                  "teacher.tensor_parallel_size=2"])
    _, plan = resolve(load_config(args.config, overrides, args.flags))
    with contextlib.ExitStack() as stack:
        cluster.start_ray(address=None, num_cpus=4, num_gpus=6, stack=stack)  # logical GPUs: Ray sets CUDA ids
        placement = cluster.reserve(plan, stack)
        assert placement.gpu_id == [0, 1, 2, 3, 4, 5]  # plan bundle b is GPU b of the (only) node
        assert [placement.engine_env(e) for e in plan.engines] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                                                    {"CUDA_VISIBLE_DEVICES": "1"}]
        # the teacher's engine (TP 2) sees the two GPUs after the trainer's, no other
        assert [placement.engine_env(e) for e in plan.side_fleet("teacher").engines] == [
            {"CUDA_VISIBLE_DEVICES": "4,5"}]

        @ray.remote
        def gpus_seen():
            return ray.get_gpu_ids()

        ranks = [gpus_seen.options(**placement.actor_options(r.bundle, num_cpus=0, num_gpus=1)).remote()
                 for r in plan.trainer]
        assert ray.get(ranks, timeout=60) == [[2], [3]]


@pytest.mark.slow
@pytest.mark.long  # 26 s; the passthrough flags stay in CI through tests/test_launch_passthrough.py and the MoE cluster run
def test_a_two_rank_cpu_run_configured_through_passthrough_flags_trains(tmp_path, capsys):
    argv = ["--config", DEMO, "--tensor-model-parallel-size", "2", "--hidden-dropout", "0.0",
            "--sglang-max-running-requests", "32", "--router-request-timeout-secs", "120",
            f"run.output_dir={tmp_path}", "run.name=tp2", "run.num_steps=2", "rollout.prompts_per_step=4"]
    assert main(argv) == 0, capsys.readouterr().err
    records = read_metrics(tmp_path / "tp2" / "metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3  # both TP shards reached the engines
    import yaml

    resolved = yaml.safe_load((tmp_path / "tp2" / "config.yaml").read_text())
    assert resolved["trainer"]["tensor_model_parallel_size"] == 2
    assert resolved["trainer"]["megatron"] == {"hidden_dropout": 0.0}
    assert resolved["sglang"] == {"max_running_requests": 32} and resolved["router"] == {"request_timeout_secs": 120}


@pytest.mark.long  # 38 s; EP over DP stays in CI through test_trainer_parallel's expert-replica test and the MoE rehearsal
def test_an_moe_run_with_experts_split_over_two_data_parallel_ranks_trains_and_syncs_every_expert(tmp_path, capsys):
    # The MoE recipe's shape on CPU: a tiny Qwen3-MoE, EP=2 over DP=2 trainer ranks (each holds 2 of the 4 experts
    # and trains on half the rows); after each step the bridge gathers every expert and the engines must match.
    argv = ["--config", DEMO, "--expert-model-parallel-size", "2", "trainer.data_parallel_size=2",
            "model.tiny.family=qwen3_moe", f"run.output_dir={tmp_path}", "run.name=ep2",
            "run.num_steps=2", "rollout.prompts_per_step=4", "sync.verify=full"]
    assert main(argv) == 0, capsys.readouterr().err
    records = read_metrics(tmp_path / "ep2" / "metrics.jsonl")
    assert [r["weights/version"] for r in records] == [1, 2]
    # step 2's rollouts come from the weights trained at step 1: had an expert not reached the engines, the
    # engines' logprobs would be off the trainer's
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in records) < 1e-3
