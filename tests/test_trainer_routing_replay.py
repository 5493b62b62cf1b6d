"""MoE routing replay (R3) in the trainer: an engine whose router differs from the trainer's (a perturbed gate, as
different kernels or precision would) picks other experts for some tokens. Without replay the trainer routes by
itself and its logprobs drift from the engine's; with replay every MoE layer routes each token through the engine's
experts, forward and backward, and the gap drops."""
import numpy as np
import pytest
import torch

from helpers.trainer_process import run_in_trainer_process, start_worker, stop_worker, with_versions

NOISE = 0.6  # the engine's gate weights differ by this much noise (x their std): a few % of routings change


def engine_rollouts(model_dir: str) -> tuple[list, float]:
    """Samples as the engine would return them: an HF Qwen3-MoE with a perturbed router generates nothing new but
    scores fixed responses (teacher-forced logprobs) and reports its own top-k per token and layer."""
    from transformers import AutoModelForCausalLM

    from glue.types import Sample

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * NOISE)
    samples, k = [], model.config.num_experts_per_tok
    for i in range(6):
        tokens = torch.randint(1, model.config.vocab_size, (10 + 3 * i,), generator=gen).tolist()
        prompt, response = tokens[:4], tokens[4:]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
        logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])
        routing = torch.stack([torch.topk(torch.softmax(layer.float(), -1), k, dim=-1).indices
                               for layer in out.router_logits], dim=1)[:-1]
        samples.append(Sample(prompt_tokens=prompt, response_tokens=response, loss_mask=[1] * len(response),
                              rollout_logprobs=logprobs[len(prompt) - 1:, 0].tolist(), versions=[0] * len(response),
                              reward=float(i % 2), group_id=i // 2, index=i % 2,
                              routed_experts=routing.numpy().astype(np.int8)))
    return samples, NOISE


RUNS = {"plain": {}, "replay": {"routing_replay": True},
        # full recompute: every MoE layer runs again in backward, where it must replay the same experts
        "replay_recompute": {"routing_replay": True, "megatron": {"recompute_granularity": "full",
                                                                  "recompute_method": "uniform",
                                                                  "recompute_num_layers": 1}},
        # old logprobs from the version snapshots (here the live weights: every token is version 0)
        "replay_snapshot": {"routing_replay": True, "old_logprobs": "snapshot"},
        # sluice's grouped experts behind the same router: replay is the router's, the experts' kind changes nothing
        "replay_grouped": {"routing_replay": True, "megatron": {"moe_grouped_gemm": True}}}


def _scenario(model_dir: str) -> dict:
    from glue.types import TrainBatch
    from loss import LossConfig

    samples, _ = engine_rollouts(model_dir)
    batch = TrainBatch.from_samples(samples, [1.0, -1.0] * 3)
    out = {}
    for name, fields in RUNS.items():
        worker = start_worker(model_dir, LossConfig(), max_tokens_per_micro_batch=40, **fields)
        try:
            dispatches = record_dispatches(worker)
            out[name] = {"metrics": worker.train_step(batch), "dispatches": dispatches}
        finally:
            stop_worker(worker)
    return out


def _stale_scenario(model_dir: str) -> dict:
    """Issue 27 item 6: R3 with the trainer one version ahead of half the batch. Snapshot old logprobs (two versions
    kept); one step on fresh samples, then the same samples with rows 0-2 stamped version 0 (stale) and 3-5 version
    1 (fresh)."""
    from glue.types import TrainBatch
    from loss import LossConfig

    samples, _ = engine_rollouts(model_dir)
    worker = start_worker(model_dir, LossConfig(), keep_versions=2, max_tokens_per_micro_batch=40,
                          routing_replay=True, old_logprobs="snapshot")
    try:
        first = worker.train_step(TrainBatch.from_samples(samples, [1.0, -1.0] * 3))
        mixed = with_versions(TrainBatch.from_samples(samples, [1.0, -1.0] * 3), lambda b, t: 0 if b < 3 else 1)
        return {"first": first, "mixed": mixed, "second": worker.train_step(mixed)}
    finally:
        stop_worker(worker)


@pytest.fixture(scope="module")
def stale_run(tiny_moe_model_dir) -> dict:
    return run_in_trainer_process(_stale_scenario, tiny_moe_model_dir)


def test_routing_agreement_is_counted_once_per_step_in_the_pre_update_forward(runs, stale_run):
    """It was counted in every replayed forward (old logprobs, gap, each optimizer step's training forward), which
    after an optimizer step mixes in a policy that moved."""
    mixed = stale_run["mixed"]
    token_layers = int((mixed.routed_experts[..., 0] >= 0).sum())  # every routed token of every MoE layer, once
    assert stale_run["second"]["moe/routing_token_layers"] == token_layers
    assert runs["replay_recompute"]["metrics"]["moe/routing_token_layers"] == token_layers


def test_r3_metrics_split_by_staleness_and_replay_closes_the_gap_at_each_token_s_own_version(stale_run):
    first, second, mixed = stale_run["first"], stale_run["second"], stale_run["mixed"]
    assert "moe/logprob_gap_with_replay_stale" not in first and "moe/routing_agreement_stale" not in first
    trained = mixed.logprob_mask > 0
    stale, fresh = int((trained & (mixed.versions == 0)).sum()), int((trained & (mixed.versions == 1)).sum())
    for name in ("with", "without"):  # the split adds up to the whole
        whole = second[f"moe/logprob_gap_{name}_replay"]
        parts = (stale * second[f"moe/logprob_gap_{name}_replay_stale"]
                 + fresh * second[f"moe/logprob_gap_{name}_replay_fresh"]) / (stale + fresh)
        assert whole == pytest.approx(parts, rel=1e-5)
    assert 0.0 < second["moe/routing_agreement_stale"] < 1.0 and 0.0 < second["moe/routing_agreement_fresh"] < 1.0
    # the stale rows were generated by version 0 (the engine's perturbed copy of it): at that version (its snapshot)
    # replay removes most of the gap the engine's different router causes, though the trainer is a version ahead.
    # (The "fresh" rows were stamped version 1 but generated by version 0 too, so only the stale ones are checked.)
    print({k: round(v, 5) for k, v in second.items() if k.startswith("moe/")})
    at_version = [second[f"moe/logprob_gap_{name}_replay_at_version_stale"] for name in ("with", "without")]
    assert at_version[0] < 0.5 * at_version[1]
    # at the current weights, a version on, the stale rows' gap is mostly the policy's own step: replay or not
    assert second["moe/logprob_gap_with_replay_stale"] > 2 * at_version[0]


def record_dispatches(worker) -> list:
    """For every MoE router call of the worker's model: (replay action, whether the experts it dispatched each
    token to are exactly the replayed ones, number of tokens)."""
    seen = []

    def check(router, args, out):
        replay = router.router_replay
        action = getattr(replay.router_replay_action, "value", None) if replay is not None else None
        target = None if replay is None or action is None else (
            replay.target_topk_idx if action == "replay_forward" else None)
        dispatched = out[1].nonzero()[:, 1].reshape(out[1].shape[0], -1).sort(1).values
        same = None if target is None else bool((dispatched == target.sort(1).values).all())
        seen.append((action, same, out[1].shape[0], torch.is_grad_enabled()))

    for module in worker.model.modules():
        if type(module).__name__ == "TopKRouter":
            module.register_forward_hook(check)
    return seen


@pytest.fixture(scope="module")
def runs(tiny_moe_model_dir) -> dict:
    return run_in_trainer_process(_scenario, tiny_moe_model_dir)


def test_without_replay_the_trainer_routes_differently_and_with_replay_the_logprob_gap_drops(runs):
    plain, replayed = runs["plain"]["metrics"], runs["replay"]["metrics"]
    agreement = replayed["moe/routing_agreement"]
    print(f"routing agreement {agreement:.3f}; logprob gap without replay {replayed['moe/logprob_gap_without_replay']:.5f}"
          f", with replay {replayed['moe/logprob_gap_with_replay']:.5f}; pre-update |old - rollout| "
          f"{plain['train/train_rollout_logprob_abs_diff']:.5f} without, "
          f"{replayed['train/train_rollout_logprob_abs_diff']:.5f} with")
    assert 0.5 < agreement < 0.99, agreement  # the perturbed engine disagrees on some, not all, token-layers
    assert "moe/routing_agreement" not in plain
    # the gap the engine/trainer disagreement causes, measured both ways on the same weights: replay shrinks it
    assert replayed["moe/logprob_gap_with_replay"] < 0.5 * replayed["moe/logprob_gap_without_replay"]
    assert replayed["train/train_rollout_logprob_abs_diff"] < 0.5 * plain["train/train_rollout_logprob_abs_diff"]
    # recompute changes nothing in what is computed, nor do grouped experts
    assert runs["replay_recompute"]["metrics"]["train/loss"] == pytest.approx(replayed["train/loss"], abs=1e-6)
    grouped = runs["replay_grouped"]["metrics"]
    for name in ("train/loss", "moe/routing_agreement", "moe/logprob_gap_with_replay"):
        assert grouped[name] == pytest.approx(replayed[name], abs=1e-6), name


def test_with_replay_every_token_goes_to_the_replayed_experts_in_forward_and_in_recompute(runs):
    assert all(action is None for action, *_ in runs["plain"]["dispatches"])
    for name in ("replay", "replay_recompute", "replay_grouped"):
        dispatches = runs[name]["dispatches"]
        actions = {action for action, *_ in dispatches}
        assert all(same for action, same, *_ in dispatches if action == "replay_forward"), name
        assert "replay_forward" in actions and None in actions  # None: the gap's forward without replay
    # in recompute the routers run again during backward, under replay_backward, fed from the queued targets
    backward = [d for d in runs["replay_recompute"]["dispatches"] if d[0] == "replay_backward"]
    assert backward, "no router ran in backward: recompute did not happen"
    assert not [d for d in runs["replay"]["dispatches"] if d[0] == "replay_backward"]


def test_snapshot_old_logprobs_replay_the_engines_routing_too(runs):
    """Issue 26 item 9: the snapshot forward replays routing like the recompute one, so pi_old is the engine-routed
    policy (without replay its gap to the rollout is the unreplayed one)."""
    plain, replayed = runs["plain"]["metrics"], runs["replay"]["metrics"]
    snapshot = runs["replay_snapshot"]["metrics"]
    assert snapshot["train/train_rollout_logprob_abs_diff"] == pytest.approx(
        replayed["train/train_rollout_logprob_abs_diff"], abs=1e-6)
    assert snapshot["train/train_rollout_logprob_abs_diff"] < 0.5 * plain["train/train_rollout_logprob_abs_diff"]


def test_token_labels_follow_the_routing_into_a_tp_rank_s_sequence_share():
    """Under sequence parallelism each TP rank's routers see its share of the positions; the staleness labels the
    agreement is counted by must be cut the same way, or a rank counts its tokens under another token's label."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from glue.trainer.routing_replay import TOKEN_KINDS, RoutingReplay

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router_replay, self.layer_number = RouterReplay(), 1

    model = torch.nn.Sequential(Router())
    replay = RoutingReplay(model)
    routing = torch.tensor([0, 1, 2, 0, 1]).reshape(1, 5, 1, 1)  # one row of 5 tokens, 1 layer, top-1
    labels = torch.tensor([[0, 1, 0, 1, 2]])  # fresh, stale, fresh, stale, other
    # rank 1 of 2 holds positions 3, 4 and a padding slot; its router would pick expert 0 for all three
    scores = torch.tensor([[5.0, 0.0, 0.0]] * 3)
    with replay.counting(torch.zeros(1, 5, dtype=torch.long)):
        replay.load(routing, labels=labels, sequence_parallel=True, tp_rank=1, tp_size=2)
        router = model[0].router_replay
        _, chosen = router.get_replay_topk(scores, 1, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
    assert chosen[:2, 0].tolist() == [0, 1]  # the engine's experts for positions 3 and 4
    counts = dict(zip(TOKEN_KINDS, replay.counts.tolist()))
    # position 3 (stale) agrees, position 4 (other) does not, padding is not counted
    assert counts == {"fresh": [0.0, 0.0], "stale": [1.0, 1.0], "other": [0.0, 1.0]}
    replay.clear()
