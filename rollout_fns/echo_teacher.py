"""The demo's distillation teacher (`teacher.build` in examples/configs/distill.yaml): a model of the policy's shape
and vocabulary whose weights solve the echo task (rollout_fns.toy_tasks.EchoTask) by construction, written at
start-up in milliseconds, with no training run to wait for or to trust.

How it copies: the echo rule is "emit the token you are looking at". Every attention output projection and MLP down
projection is zero, so each layer adds nothing to the residual stream and the final hidden state is the input
token's embedding. Embedding row i is c * e_i (one-hot, needs hidden_size >= vocab_size); the final RMSNorm maps it to
sqrt(hidden_size) * e_i whatever c is, and LM-head row j is c * e_j, so the logits are sqrt(hidden_size) * c at the
input token and 0 elsewhere: c is chosen so the input token gets probability `confidence`.
"""
from __future__ import annotations

import math

COPY_CONFIDENCE = 0.98  # the teacher's probability of repeating the token it reads


def build_echo_teacher(out_dir: str, policy_dir: str, confidence: float = COPY_CONFIDENCE) -> None:
    """Write the copying teacher (the policy's config, its own weights) to `out_dir` as an HF checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, for a few kilobytes
    config = AutoConfig.from_pretrained(policy_dir)
    vocab, hidden = config.vocab_size, config.hidden_size
    if vocab > hidden:
        raise ValueError(f"build_echo_teacher: a one-hot embedding needs hidden_size >= vocab_size, got "
                         f"{hidden} < {vocab}; use a policy with a small vocabulary (the echo demo's 32)")
    if not 0 < confidence < 1:
        raise ValueError(f"build_echo_teacher: confidence must be in (0, 1), got {confidence}")
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    gap = math.log(confidence * (vocab - 1) / (1 - confidence))  # logit of the input token over the others
    scale = gap / math.sqrt(hidden)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()
        one_hot = torch.zeros(vocab, hidden)
        one_hot[torch.arange(vocab), torch.arange(vocab)] = scale
        model.get_input_embeddings().weight.copy_(one_hot)
        model.get_output_embeddings().weight.copy_(one_hot)
    check_copies(model, vocab, confidence)
    model.save_pretrained(out_dir)


def check_copies(model, vocab: int, confidence: float) -> None:
    """The construction holds for this architecture: after any context, the next-token distribution puts
    `confidence` on the last token read (an architecture with another residual path would fail here)."""
    import torch

    ids = torch.arange(vocab).roll(3).unsqueeze(0)
    with torch.no_grad():
        probs = torch.softmax(model(ids).logits[0].float(), -1)
    got = probs[torch.arange(vocab), ids[0]]
    if not torch.allclose(got, torch.full_like(got, confidence), atol=1e-3):
        raise RuntimeError(f"build_echo_teacher: the copying construction does not hold for "
                           f"{type(model).__name__} (copy probabilities {got.min():.3f}..{got.max():.3f})")
