"""`trainer.max_tokens_per_micro_batch: auto` (glue.trainer.token_budget): the per-token activation estimate and the
budget a GPU's free memory gives, worked out by hand."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glue.trainer.config import TrainerConfig
from glue.trainer.token_budget import activation_bytes_per_token, budget_from_memory, resolve_token_budget


def _config(**fields) -> SimpleNamespace:
    base = dict(tensor_model_parallel_size=1, hidden_size=1024, ffn_hidden_size=3072, num_moe_experts=None)
    return SimpleNamespace(**{**base, **fields})


def test_a_token_of_the_265m_model_holds_about_a_megabyte_of_activations():
    # per layer 2 x (10 x 1024 + 5 x 3072) = 51,200 bytes, 16 layers = 819,200; logits 4 x 32,000 = 128,000
    assert activation_bytes_per_token(_config(), 32000, 16) == 819_200 + 128_000
    # TP=2 halves both; an MoE layer counts its routed experts' FFN width (768 x 8 = 6144)
    assert activation_bytes_per_token(_config(tensor_model_parallel_size=2), 32000, 16) == (819_200 + 128_000) // 2
    moe = _config(num_moe_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8)
    assert activation_bytes_per_token(moe, 32000, 1) == 2 * (10 * 1024 + 5 * 6144) + 128_000


def test_the_budget_is_half_the_free_memory_in_whole_steps_within_its_bounds():
    # 70 GiB free: 37,580,963,840 bytes for activations // 947,200 per token = 39,675 tokens, down to 256s: 39,424
    assert budget_from_memory(70 * 2**30, 947_200) == 39_424
    # a full GPU goes below 1,024 tokens: 2 GB free holds 1,000,000,000 // 947,200 = 1,055 -> 1,024; 1 GB 527 -> 512
    assert budget_from_memory(2 * 10**9, 947_200) == 1024 and budget_from_memory(10**9, 947_200) == 512
    # under 256 tokens in steps of 16: 378,880,000 bytes hold 200 tokens -> 192
    assert budget_from_memory(378_880_000, 947_200) == 192
    assert budget_from_memory(10**6, 947_200) == 16  # never under 16 tokens (the start-up check refuses such a run)
    assert budget_from_memory(10**15, 947_200) == 65536  # nor over 65,536


def test_auto_means_padded_rows_on_cpu_and_a_number_or_zero_stays_what_it_says():
    cpu = torch.device("cpu")
    assert resolve_token_budget("auto", torch.nn.Linear(1, 1), 32, cpu) is None
    assert resolve_token_budget(2048, torch.nn.Linear(1, 1), 32, cpu) == 2048
    assert resolve_token_budget(0, torch.nn.Linear(1, 1), 32, cpu) is None
    assert TrainerConfig().max_tokens_per_micro_batch == "auto"
    with pytest.raises(ValueError, match="auto \\(sized from GPU memory\\)"):
        TrainerConfig(max_tokens_per_micro_batch="big")
