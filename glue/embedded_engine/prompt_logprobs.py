"""SGLang's prompt-logprob request (`return_logprob` with `logprob_start_len`, often with `max_new_tokens: 0`): the
model runner scores the request's own input tokens in its prefill forward, and the answer carries them as
`meta_info.input_token_logprobs` in SGLang's shape (a teacher scoring a student's tokens is the main user)."""
from __future__ import annotations

from typing import Any

import torch


def wants_input_logprobs(request: Any) -> bool:
    """The request asked for logprobs of some of its input tokens: `return_logprob` and a `logprob_start_len` inside
    the input (SGLang computes none for -1, its default, or for a start at the input's end)."""
    return request.return_logprob and 0 <= request.logprob_start_len < len(request.input_ids)


def input_logprob_values(logits: torch.Tensor, ids: list[int], start: int) -> list[float | None]:
    """SGLang's `input_token_logprobs` values for input positions `start` .. len(ids) - 1 from one forward's
    `logits` [len(ids), V] over `ids`: the entry of position p is log softmax(logits[p - 1])[ids[p]], except the
    first, which is None whatever `start` is (SGLang drops the logprob before `start` and pads with None:
    scheduler_components/logprob_result_processor.py). So the logprob of input token p needs `start <= p - 1`."""
    targets = torch.tensor(ids[start + 1:], dtype=torch.long)
    scored = torch.log_softmax(logits[start:len(ids) - 1].float(), dim=-1)
    return [None, *scored.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()]


def record_input_logprobs(seqs: list[Any], logits: torch.Tensor) -> None:
    """After a forward over each sequence's whole input (row i of `logits` [n, L, V] is `seqs[i]`), keep the input
    logprobs of those that asked for them and have none yet (a retracted request keeps its first ones, as SGLang)."""
    for i, seq in enumerate(seqs):
        if seq.input_logprobs is None and wants_input_logprobs(seq.request):
            ids = seq.request.input_ids
            seq.input_logprobs = input_logprob_values(logits[i, :len(ids)], ids, seq.request.logprob_start_len)


def input_token_logprobs(seq: Any) -> list[list]:
    """`meta_info.input_token_logprobs`: [logprob, token id, None] from `logprob_start_len` on (empty when none)."""
    if seq.input_logprobs is None:
        return []
    ids = seq.request.input_ids[seq.request.logprob_start_len:]
    return [[lp, tok, None] for lp, tok in zip(seq.input_logprobs, ids)]
