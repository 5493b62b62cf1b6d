"""SFT (issue 28 item 1): chat data rendered with the chat template, the loss on assistant tokens only, and one real
`python -m launch` run of examples/configs/sft.yaml (Ray, the megatron-core trainer, no engines) whose loss falls and
whose exported policy is the model.path an RL run starts from, loaded weight for weight by the trainer."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import free_port
from glue.sft.data import ConversationStream, load_samples, read_conversations, to_sample, tokenize_chat
from loss import SftLossConfig, compute_loss, sft_loss
from helpers.trainer import hf_teacher_forced_logprobs
from helpers.forkserver import rank_context

REPO = Path(__file__).resolve().parents[1]
SFT_YAML = REPO / "examples/configs/sft.yaml"
STEPS, PER_STEP = 12, 16
CHAT = [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "3+4=7"}, {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "1+1=2"}]


def logits_and_mask():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 0]], dtype=torch.float)
    return logits, targets, mask


def token_logprobs(logits, targets):
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def test_the_sft_loss_is_the_mean_negative_log_likelihood_of_the_masked_in_tokens_only():
    logits, targets, mask = logits_and_mask()
    logprobs = token_logprobs(logits, targets)
    loss, metrics = sft_loss(SftLossConfig(), logprobs=logprobs, mask=mask)
    expected = -(logprobs * mask).sum() / mask.sum()  # by hand: 6 trained tokens
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx((-logprobs.mean()).item(), rel=1e-3)  # what ignoring the mask would give
    assert metrics["nll"].item() == pytest.approx(expected.item(), rel=1e-6)
    per_seq, _ = sft_loss(SftLossConfig(aggregation="seq_mean_token_mean"), logprobs=logprobs, mask=mask)
    rows = -(logprobs * mask).sum(1) / mask.sum(1)
    assert per_seq.item() == pytest.approx(rows.mean().item(), rel=1e-6)


def test_a_masked_out_user_token_carries_no_gradient_and_does_not_move_the_loss():
    logits, targets, mask = logits_and_mask()
    loss, _ = sft_loss(SftLossConfig(), logprobs=token_logprobs(logits, targets), mask=mask)
    loss.backward()
    assert torch.all(logits.grad[mask == 0] == 0)  # every vocabulary entry of every masked position
    assert torch.all(logits.grad[mask == 1].abs().sum(-1) > 0)
    perturbed = logits.detach().clone()
    perturbed[mask == 0] = torch.randn_like(perturbed[mask == 0]) * 100
    logprobs = token_logprobs(perturbed, targets)
    logprobs[0, 0] = float("nan")  # even a NaN at a masked position does not leak
    again, _ = sft_loss(SftLossConfig(), logprobs=logprobs, mask=mask)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_the_trainer_s_loss_entry_picks_the_sft_loss_by_the_config_s_kind():
    logits, targets, mask = logits_and_mask()
    logprobs = token_logprobs(logits, targets).detach()
    zeros = torch.zeros_like(logprobs)
    loss, metrics = compute_loss(SftLossConfig(), logprobs=logprobs, old_logprobs=None, rollout_logprobs=zeros,
                                 advantages=zeros, mask=mask, num_global_tokens=12, num_global_seqs=2)
    assert loss.item() == pytest.approx((-(logprobs * mask).sum() / 12).item(), rel=1e-6)  # the global count
    assert set(metrics) == {"nll"}


def test_the_chat_template_s_assistant_turns_alone_are_trained_up_to_their_end_of_turn_token(tokenizer):
    tokens, trained = tokenize_chat(tokenizer, CHAT)
    whole = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tokens == whole
    assert tokenizer.decode([t for t, f in zip(tokens, trained) if f]) == "3+4=7<|im_end|>1+1=2<|im_end|>"
    assert "What is" in tokenizer.decode([t for t, f in zip(tokens, trained) if not f])
    batch = ConversationStream([to_sample(tokens, trained, 0)], per_step=1, seed=0).next_batch()[0]
    # position t of the mask says whether token t + 1 is trained
    assert batch.tokens[0].tolist() == tokens
    assert batch.logprob_mask[0, :-1].tolist() == [float(f) for f in trained[1:]]


@pytest.mark.parametrize("row, error", [
    ({"conversation": []}, "line 2: no 'messages' key"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "line 2: message 0 has role 'robot'"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "line 2: message 0 (assistant) needs a string content"),
])
def test_a_bad_row_is_refused_with_its_line(tmp_path, row, error):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        read_conversations(path)
    path.write_text(json.dumps({"messages": CHAT}) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_conversations(path)


def test_parquet_rows_are_read_like_jsonl_lines(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs pyarrow")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}, {"messages": CHAT[:2]}]), tmp_path / "chat.parquet")
    with pytest.raises(ValueError, match="row 2: no assistant turn"):
        read_conversations(tmp_path / "chat.parquet")


def sluice(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", "--config", "examples/configs/sft.yaml", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_run_on_bad_data_stops_before_anything_starts_naming_the_line(tmp_path, capsys):
    from launch.cli import main

    bad = tmp_path / "chat.jsonl"
    bad.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT[:2]}) + "\n")
    assert main(["--config", str(SFT_YAML), f"run.output_dir={tmp_path}", f"sft.data={bad}"]) == 2
    out = capsys.readouterr()
    assert f"{bad} line 2: no assistant turn" in out.err
    assert "sluice: model" in out.out and "sluice: ray" not in out.out  # refused before Ray or the trainer started


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """examples/configs/sft.yaml, shortened: STEPS steps of PER_STEP generated chats, the final checkpoint only."""
    out = tmp_path_factory.mktemp("sft")
    done = sluice(f"run.output_dir={out}", f"sft.data={out / 'data/chat.jsonl'}", "sft.example_rows=400",
                  f"run.num_steps={STEPS}", f"sft.conversations_per_step={PER_STEP}", "run.save_interval=0",
                  "run.loggers=[jsonl]")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    phases = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("sluice: ")
              and len(line.split()) > 3 and line.split()[3] == "s"]
    assert phases == ["model", "data", "ray", "placement", "trainer"]  # no engines, no router, no weight bridge
    return out / "sft"


@pytest.mark.slow
def test_the_sft_loss_falls_and_its_first_step_is_the_masked_cross_entropy_of_the_initial_model(sft_run):
    from transformers import AutoTokenizer

    records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["train/loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    # step 1's batch again, and its loss from the initial HF model: assistant tokens only
    samples, _ = load_samples(sft_run / "../data/chat.jsonl",
                              AutoTokenizer.from_pretrained(sft_run / "init_model"), max_seq_len=256)
    batch, _ = ConversationStream(samples, per_step=PER_STEP, seed=0).next_batch()
    logprobs = hf_teacher_forced_logprobs(str(sft_run / "init_model"), batch.tokens)
    mask = batch.logprob_mask
    assert losses[0] == pytest.approx((-(logprobs * mask).sum() / mask.sum()).item(), rel=1e-4)
    assert losses[0] != pytest.approx((-logprobs[:, :-1].mean()).item(), rel=1e-2)  # mask ignored
    state = json.loads(next((sft_run / "checkpoints").glob("step_*/state.json")).read_text())
    assert state == {"mode": "sft", "version": STEPS, "cursor": STEPS * PER_STEP, "step": STEPS}


def _trainer_weights(model_path: str, port: int, results) -> None:
    """An RL run's trainer (the default loss) started on `model_path`: its weights as HF tensors."""
    from glue.trainer.config import TrainerConfig
    from glue.trainer.worker import TrainerWorker
    from loss import LossConfig

    worker = TrainerWorker(model_path=model_path, cfg=TrainerConfig(), loss_cfg=LossConfig(), rank=0, world_size=1)
    worker.initialize("127.0.0.1", port)
    results.put(pickle.dumps(worker.full_hf_state()))  # bytes: shared tensors would die with this process
    worker.shutdown()


@pytest.mark.slow
def test_the_exported_sft_policy_is_the_model_path_of_an_rl_run_and_its_trainer_loads_those_weights(sft_run):
    from safetensors.torch import load_file

    from launch.config import load_config
    from launch.plan.model_check import check_model
    from launch.plan.run_plan import resolve
    from launch.run.preflight import preflight

    hf = sft_run / "hf"
    cfg, plan = resolve(load_config(REPO / "examples/configs/text_arith.yaml", [f"model.path={hf}"]))
    preflight(cfg, plan, here=False)
    assert "qwen2 checkpoint" in check_model(cfg, plan_only=False)
    assert len(plan.engines) == 2 and cfg.run.mode == "sync"
    ctx = rank_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_trainer_weights, args=(str(hf), free_port(), results))
    proc.start()
    try:
        loaded = pickle.loads(results.get(timeout=240))
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    exported, initial = load_file(hf / "model.safetensors"), load_file(sft_run / "init_model/model.safetensors")
    assert set(loaded) == set(exported)
    assert all(torch.equal(loaded[name], exported[name]) for name in exported)
    assert not all(torch.equal(exported[name], initial[name]) for name in exported)  # SFT moved the weights


def test_the_rehearsal_shrink_moves_an_sft_recipe_s_data_to_generated_chats_and_keeps_its_mode(tmp_path):
    from launch.tools.shrink import shrink

    raw = {"run": {"mode": "sft", "num_steps": 3000}, "model": {"path": "/models/Qwen3-8B"},
           "sft": {"data": "/data/ultrachat.parquet", "conversations_per_step": 256},
           "trainer": {"tensor_model_parallel_size": 4, "data_parallel_size": 8}}
    shrunk = shrink(raw, data_dir=tmp_path, name_hint="sft")
    sft, record = shrunk.raw["sft"], shrunk.record
    assert sft == {"data": str(tmp_path / "sft-ultrachat.jsonl"), "conversations_per_step": 16, "example_rows": 64}
    assert shrunk.raw["model"]["tiny"]["tokenizer"] is True  # chats are rendered with the chat template
    assert record.kept["run.mode"] == "sft" and record.scaled["sft.data"]["from"] == "/data/ultrachat.parquet"


def test_an_rl_run_refuses_to_resume_an_sft_checkpoint_and_says_to_start_from_its_policy(tmp_path):
    from glue.loop.checkpoint import Checkpoints
    from launch.config import ConfigError, load_config
    from launch.run.folder import find_checkpoint

    Checkpoints(tmp_path / "runs/sft/checkpoints").save(3, lambda folder: None, {"mode": "sft", "version": 3,
                                                                                "cursor": 48})
    checkpoint = tmp_path / "runs/sft/checkpoints/step_00000003"
    rl = load_config(REPO / "examples/configs/demo.yaml", [f"run.resume={checkpoint}"])
    with pytest.raises(ConfigError, match="an SFT run's checkpoint .* set model.path=OUT"):
        find_checkpoint(rl)
    sft = load_config(SFT_YAML, [f"run.output_dir={tmp_path / 'runs'}"])
    assert find_checkpoint(sft) == checkpoint  # run.resume auto: an SFT run continues its own


def test_the_dry_run_of_an_sft_config_plans_the_trainer_alone_and_checks_its_data(tmp_path, capsys):
    import yaml

    from launch.cli import main

    data = tmp_path / "chat.jsonl"
    assert main(["--config", str(SFT_YAML), f"sft.data={data}", "--dry-run"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    plan = shown["plan"]
    assert plan["engines"] == [] and plan["router"] == "" and len(plan["trainer"]) == 1
    assert plan["placement_group"]["bundles"] == 1 and plan["weight_sync"].startswith("none")
    assert f"sft data: {data} (written at start-up: 2000 generated chats)" in shown["checked"]
    assert main(["--config", str(SFT_YAML), f"sft.data={data}", "sft.example_rows=0", "--dry-run"]) == 2
    assert f"sft.data='{data}' does not exist" in capsys.readouterr().err
    assert main(["--config", str(SFT_YAML), "model.tiny.tokenizer=false", "--dry-run"]) == 2
    assert "set model.tiny.tokenizer: true" in capsys.readouterr().err
