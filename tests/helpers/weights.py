"""Weight-transport fixtures: a tiny HF model as a local weight source, and how far an engine's logprobs are from it."""
from __future__ import annotations

import torch

from weight_sync.sender import LocalWeightSource

from .engines import generate, teacher_forced_logprobs

PROMPTS = ([3, 4, 5], [9], [2, 7, 7, 1])


def hf_model(tmp_path_factory, seed: int):
    from transformers import AutoModelForCausalLM

    from glue.embedded_engine.tiny_model import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp(f"seed{seed}"), seed=seed)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def source_of(model) -> LocalWeightSource:
    return LocalWeightSource({n: p.detach().clone() for n, p in model.named_parameters()})


def max_logprob_diff(url: str, model) -> float:
    """Greedy generations on PROMPTS: the engine's tokens must be the model's argmax; returns the largest
    |engine logprob - model's teacher-forced logprob|."""
    worst = 0.0
    for prompt in PROMPTS:
        out = generate(url, {"input_ids": prompt, "return_logprob": True,
                             "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})
        tokens = out["output_ids"]
        with torch.no_grad():
            greedy = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert tokens == greedy
        expected = teacher_forced_logprobs(model, prompt, tokens, 1.0)
        engine = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(engine, expected)))
    return worst
