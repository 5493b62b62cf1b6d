"""Routed-experts fixtures: the HF model's own routing and the wire rows engines answer with."""
from __future__ import annotations

import base64

import numpy as np
import torch

from glue.rollout.routed_experts import RoutedExpertsLayout


def reference_routing(model, tokens: list[int]) -> np.ndarray:
    """The model's own top-k from a teacher-forced forward, recomputed here from the router logits it reports:
    `[len(tokens) - 1, layers, top_k]` (the last token's row dropped, as an engine never runs it)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    top = [torch.topk(torch.softmax(layer.float(), dim=-1), k, dim=-1).indices for layer in logits]
    return torch.stack(top, dim=1)[:-1].numpy()


LAYOUT = RoutedExpertsLayout(num_layers=2, top_k=2, num_experts=4)


def wire(rows: list) -> str:
    """SGLang's meta_info.routed_experts for `rows` ([n, layers, top_k] nested lists): base64 of int32 bytes."""
    return base64.b64encode(np.array(rows, dtype=np.int32).tobytes()).decode()


def rows(first: int, n: int) -> list:
    """n hand-made rows whose experts encode the position: position p -> [[p%4, (p+1)%4], [(p+2)%4, (p+3)%4]]."""
    return [[[p % 4, (p + 1) % 4], [(p + 2) % 4, (p + 3) % 4]] for p in range(first, first + n)]
