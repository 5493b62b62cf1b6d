"""A short synchronous run through every real seam: Ray, embedded engines behind sgl-router, megatron-core on gloo,
the broadcast bridge. The engine and trainer must agree on the policy at every step, which only holds if each
sync really moved the trainer's weights into both engines."""
import os
from pathlib import Path

import pytest

from glue.metrics.logger import read_metrics
from launch.args.command_line import parse_args
from launch.config import ConfigError, load_config
from launch.run.runner import run
from helpers.processes import live_children

REQUIRED = ["step", "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/clipfrac",
            "train/train_rollout_logprob_abs_diff", "time/rollout_s", "time/train_s", "time/sync_s", "weights/version"]


async def fails_one_group_in_eight(ctx, prompt, num_samples):
    """The demo's rollout function, except that group 5 (of 0..12) raises, like a crashed tool sandbox."""
    from rollout_fns.single_turn import generate_group

    if ctx.group_id % 8 == 5:
        raise RuntimeError("tool sandbox crashed")
    return await generate_group(ctx, prompt, num_samples)


@pytest.mark.slow
def test_a_short_sync_run_keeps_engines_and_trainer_on_the_same_policy(tmp_path, capsys):
    import ray

    before = set(live_children(os.getpid()))
    # the launcher's own flag parsing: the demo's two layers go one per pipeline stage (two trainer ranks), and
    # packed rows put several samples in one forward
    args, overrides = parse_args(["--config", "examples/configs/demo.yaml", "--pipeline-model-parallel-size", "2",
                                  f"run.output_dir={tmp_path}", "run.name=e2e", "run.num_steps=3",
                                  "rollout.prompts_per_step=4", "trainer.max_tokens_per_micro_batch=64",
                                  "rollout.function=test_end_to_end:fails_one_group_in_eight"])
    cfg = load_config(args.config, overrides, args.flags)
    assert cfg.trainer.pipeline_model_parallel_size == 2
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    # group 5 failed, was counted and replaced (by group 12): every step still trained 4 groups x 8 samples
    assert sum(r["rollout/failed_groups"] for r in records) == 1
    assert [r["rollout/num_samples"] for r in records] == [32, 32, 32]
    captured = capsys.readouterr()
    assert "sluice: group 5 failed: rollout function 'test_end_to_end:fails_one_group_in_eight'" in captured.err
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert not [key for key in REQUIRED if key not in record], record
    assert [r["weights/version"] for r in records] == [1, 2, 3]
    # every step's sync reports its size, speed and where the time went
    for record in records:
        assert record["sync/bytes"] > 0 and record["sync/gb_per_s"] > 0, record
        assert {"sync/pack_s", "sync/wire_s", "sync/copy_in_s", "sync/verify_s"} <= set(record), record
    # Step 1 is before any update; steps 2 and 3 sample from weights that arrived through the bridge, gathered from
    # both pipeline stages. The trainer packs samples into shared rows, so this also checks that packing computes
    # each sample's own logprobs, and that the last stage's logprobs reach the loss.
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in records]
    assert max(diffs) < 1e-3, diffs
    assert (run_dir / "config.yaml").exists()
    assert set(live_children(os.getpid())) <= before, "processes left running after the run"
    # the weight group is hosted at trainer rank 0's node address (Ray's), not a loopback default
    assert f"weight group hosted by trainer rank 0 at {ray.util.get_node_ip_address()}:" in captured.out
    # start-up said what it waited for: one line per phase with its seconds, then the total
    lines = [line for line in captured.out.splitlines() if line.startswith("sluice: ")]
    assert [line.split()[1] for line in lines[:7]] == ["model", "ray", "placement", "engines", "router", "trainer",
                                                        "weights"]
    assert all(float(line.split()[2]) >= 0 and line.split()[3] == "s" for line in lines[:7]), lines
    assert lines[7].startswith("sluice: started in "), lines
    assert "started a private local Ray" in lines[1], lines
    assert "2 megatron-core ranks (TP 1 x PP 2 x EP 1 x DP 1)" in lines[5], lines
    assert f"output in {run_dir.resolve()}/logs/trainer_<rank>.log" in lines[5], lines
    assert "Writing model shards" not in captured.out + captured.err


def test_a_rollout_function_that_does_not_import_fails_before_anything_starts(tmp_path):
    before = set(live_children(os.getpid()))
    cfg = load_config("examples/configs/demo.yaml",
                      [f"run.output_dir={tmp_path}", "rollout.function=rollout_fns.no_such_module:generate_group"])
    with pytest.raises(ConfigError, match="no_such_module"):
        run(cfg)
    assert set(live_children(os.getpid())) <= before
    assert not (tmp_path / "demo" / "init_model").exists(), "the run got past validation before failing"
