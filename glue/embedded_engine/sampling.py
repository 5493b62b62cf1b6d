"""Next-token choice for one row of a decode step: logits in, (token, logprob) out, the way SGLang's sampler does it.

The returned logprob is SGLang's default `output_token_logprobs` value: `log_softmax(logits / temperature)` of the
chosen token, taken after temperature and before top-k / top-p / min-p filtering; greedy rows (temperature 0,
or top_k 1) use the raw logits (SGLang maps temperature 0 to top_k=1 at temperature 1). SGLang returns the raw
distribution instead only when SGLANG_RETURN_ORIGINAL_LOGPROB is set; the embedded engine does not read it.
"""
from __future__ import annotations

import torch

from glue.embedded_engine.request_schema import SamplingSettings


def _filter_probs(probs: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """Zero out tokens outside top-k, then outside the top-p nucleus, then below min_p x max; renormalise."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if s.top_k > 0:
        keep[s.top_k:] = False
    if s.top_p < 1.0:
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before <= s.top_p  # keeps the token that crosses top_p, like SGLang
    if s.min_p > 0.0:
        keep &= sorted_probs >= s.min_p * sorted_probs[0]
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def sample_token(logits: torch.Tensor, s: SamplingSettings, generator: torch.Generator) -> tuple[int, float]:
    """Choose the next token from one row of float32 logits `[V]`; return it and its logprob (see module doc)."""
    logits = logits.float()
    if s.is_greedy:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = torch.log_softmax(logits / s.temperature, dim=-1)
    probs = logprobs.exp()
    if s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0:
        probs = _filter_probs(probs, s)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
