"""examples/configs/openai_agent.yaml trains through a whole sluice run (Ray, embedded engines behind the real
sgl-router serving /v1/chat/completions, megatron on gloo), as a user runs it: the agent of rollout_fns/arith_agent.py
sends tool messages answering its tool calls by id, its recorded calls become samples the trainer scores with the
same logprobs the engine reported, and the engines receive the trained weights."""
import json
import math
from pathlib import Path

import pytest

from glue.metrics.logger import read_metrics
from launch.config import load_config
from launch.run.runner import run


@pytest.mark.slow
@pytest.mark.long  # a second variant of the end-to-end run; the agent through the real router stays in CI
def test_the_openai_agent_example_config_trains_through_sgl_router(tmp_path):
    cfg = load_config("examples/configs/openai_agent.yaml", [
        f"run.output_dir={tmp_path}", "run.num_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.num_engines=1", "run.save_rollouts=true"])
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["weights/version"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/num_samples"] >= 8 and r["rollout/failed"] == 0  # 2 prompts x 4 runs, >= 1 sample each
        assert r["rollout/failed_groups"] == 0
        # the trainer's logprobs of the recorded tokens are the engine's: the ids were recorded, not re-tokenised
        assert math.isclose(r["train/discrepancy/ratio_mean"], 1.0, abs_tol=1e-3), r
        assert r["train/discrepancy/ratio_max"] < 1.01, r
    # the run folder records the code the config names: a hash and a copy of each module
    info = json.loads((run_dir / "run_info.json").read_text())
    assert {"rollout_fns.openai_agent:generate_group", "rollout_fns.arith_agent:ArithAgentTask"} <= set(info["code"])
    for module in info["code"].values():
        assert (run_dir / module["copy"]).read_bytes() == Path(module["file"]).read_bytes()
    # every agent run made two calls, the second after a tool message: a merged sample masks the tool turn, a split
    # run gives two samples
    saved = json.loads(sorted((run_dir / "rollouts").glob("step_*.json"))[0].read_text())
    samples = [s for g in saved["groups"] for s in g["samples"]]
    runs = {}
    for s in samples:
        runs.setdefault((s["group_id"], s["metadata"]["agent_run"]), []).append(s)
    assert len(runs) == 8
    for trajectories in runs.values():
        masked = sum(m == 0 for s in trajectories for m in s["loss_mask"])
        assert (len(trajectories) == 1 and masked > 0) or len(trajectories) == 2, trajectories
