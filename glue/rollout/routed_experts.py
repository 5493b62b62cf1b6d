"""MoE routing replay (R3), rollout side: which experts the engine routed each token to, from SGLang's
`meta_info.routed_experts` into `Sample.routed_experts`, concatenated across the requests of a partial rollout.

Wire format (SGLang; the embedded engine speaks the same, see glue/embedded_engine/routed_experts.py): base64 of
int32 `[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]`, one row per token
position from `routed_experts_start_len` on. The row count is implied; the layer and top-k sizes come from the
model's config (`RoutedExpertsLayout.from_model_dir`). Every decoder layer has its slot: SGLang leaves the slots of
layers without experts at 0 (its capture buffer starts zeroed and no router writes there), the embedded engine -1;
decoding makes them -1 either way, so expert 0 is never read where no router ran.
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from weight_sync.families import BY_MODEL_TYPE


@dataclass(frozen=True, kw_only=True)
class RoutedExpertsLayout:
    """The model sizes that shape one token's routing: `[num_layers, top_k]` expert ids below `num_experts`."""

    num_layers: int  # decoder layers (config num_hidden_layers); layers without experts hold -1
    top_k: int  # experts per token (config num_experts_per_tok)
    num_experts: int  # routed experts per layer (config num_experts)
    dense_layers: tuple[int, ...] = ()  # decoder layers without experts (a dense MLP): their slots are set to -1

    def __post_init__(self) -> None:
        if min(self.num_layers, self.top_k, self.num_experts) < 1 or self.num_experts > np.iinfo(np.int16).max:
            raise ValueError(f"routed experts layout {self}: sizes must be >= 1 and num_experts <= 32767")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"routed experts layout {self}: dense_layers must lie in [0, num_layers)")

    @property
    def dtype(self) -> np.dtype:
        """The compact dtype a sample keeps routing in: int8 when every id (and the -1 filler) fits, else int16."""
        return np.dtype(np.int8 if self.num_experts <= np.iinfo(np.int8).max else np.int16)

    @classmethod
    def from_model_dir(cls, model_path: str | os.PathLike) -> "RoutedExpertsLayout":
        """Read the sizes from an HF model directory's config.json: its family's (weight_sync.families: which
        layers route, how many experts), else the HF / SGLang model code's rules for the MoE families the trainer
        does not build (Qwen2-MoE)."""
        with open(os.path.join(model_path, "config.json")) as handle:
            config = json.load(handle)
        config = config.get("text_config", config)
        family = BY_MODEL_TYPE.get(config.get("model_type"))
        if family is not None and family.num_experts(config) and config.get("num_experts_per_tok"):
            num_layers = int(config["num_hidden_layers"])
            return cls(num_layers=num_layers, top_k=int(config["num_experts_per_tok"]),
                       num_experts=family.num_experts(config),
                       dense_layers=tuple(i for i in range(num_layers) if not family.is_moe_layer(config, i)))
        num_experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
        if not num_experts or not config.get("num_experts_per_tok"):
            raise ValueError(f"rollout.return_routed_experts: the model at {model_path} is not an MoE model "
                             f"(config.json has no num_experts / num_experts_per_tok); turn the key off")
        num_layers = int(config["num_hidden_layers"])
        return cls(num_layers=num_layers, top_k=int(config["num_experts_per_tok"]), num_experts=int(num_experts),
                   dense_layers=tuple(i for i in range(num_layers) if not _has_experts(config, i)))


def _has_experts(config: dict, layer: int) -> bool:
    """Does decoder layer `layer` of a model outside sluice's families (Qwen2-MoE, DeepSeek-V2) route through
    experts? The HF / SGLang model code's rules: not in `mlp_only_layers`, every `decoder_sparse_step`-th layer; dense
    below `first_k_dense_replace`, then every `moe_layer_freq`-th; else experts everywhere."""
    if layer in (config.get("mlp_only_layers") or ()):
        return False
    if (layer + 1) % int(config.get("decoder_sparse_step") or 1):
        return False
    if layer < int(config.get("first_k_dense_replace") or 0):
        return False
    freq = config.get("moe_layer_freq")
    return not isinstance(freq, int) or freq < 1 or layer % freq == 0


def start_len_for(sample: Any) -> int:
    """`routed_experts_start_len` for the next request of `sample` (sent prompt + response so far): the first
    position it has no routing for. 0 for a fresh sample; after a partial answer, the sample's last token, which
    the engine had not run yet."""
    return 0 if sample.routed_experts is None else len(sample.routed_experts)


def decode_routed_experts(text: Any, layout: RoutedExpertsLayout) -> np.ndarray:
    """`meta_info.routed_experts` as `[rows, num_layers, top_k]` in `layout.dtype`; ValueError when it is not."""
    if not isinstance(text, str):
        raise ValueError("engine answer has no meta_info.routed_experts string although return_routed_experts was "
                         "asked: start the engines with sglang.enable_return_routed_experts: true (SGLang answers "
                         "without it silently), and send R3 requests to engines directly, not through sgl-router")
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    per_row = layout.num_layers * layout.top_k
    if flat.size % per_row:
        raise ValueError(f"meta_info.routed_experts holds {flat.size} int32 values, not whole rows of "
                         f"[num_layers={layout.num_layers}, top_k={layout.top_k}]: the layout does not fit the model")
    if flat.size and (flat.min() < -1 or flat.max() >= layout.num_experts):
        raise ValueError(f"meta_info.routed_experts has expert ids outside [-1, {layout.num_experts})")
    rows = flat.reshape(-1, layout.num_layers, layout.top_k).astype(layout.dtype)
    rows[:, list(layout.dense_layers)] = -1  # SGLang's 0 there is no expert: no router ran in those layers
    return rows


def lost_routing(meta: dict) -> bool:
    """Is this an aborted answer that came back without its routing? SGLang answers a request aborted while in its
    waiting queue (queued, or retracted there and then paused with mode "abort") with the tokens it had streamed
    but no `routed_experts` (tokenizer_manager.py `_handle_abort_req`). The caller drops those tokens, so the
    resumed request generates them again and brings their routing."""
    finish = meta.get("finish_reason")
    aborted = (finish.get("type") if isinstance(finish, dict) else finish) == "abort"
    return aborted and not isinstance(meta.get("routed_experts"), str)


def append_routed_experts(sample: Any, meta: dict, layout: RoutedExpertsLayout, new_tokens: int) -> None:
    """Extend `sample.routed_experts` with the routing an answer brought for its `new_tokens` response tokens
    (already appended to the sample): rows up to position `prompt + response - 2`, the sample's last token having
    not been run. An answer that added no tokens adds no routing (an aborted request may not have run at all)."""
    if new_tokens == 0:
        return
    have = start_len_for(sample)
    want = len(sample.prompt_tokens) + len(sample.response_tokens) - 1 - have
    rows = decode_routed_experts(meta.get("routed_experts"), layout)
    if len(rows) != want:
        raise ValueError(f"meta_info.routed_experts has {len(rows)} rows; expected {want} (positions {have} to "
                         f"{have + want - 1}): was routed_experts_start_len={have} sent with the request?")
    sample.routed_experts = rows if sample.routed_experts is None else np.concatenate([sample.routed_experts, rows])


def fill_unrun_positions(sample: Any, layout: RoutedExpertsLayout) -> None:
    """Give the positions of `sample` that no request ran rows of -1 (as the train batch pads), so its routing
    covers prompt + response - 1 positions. Only an agent episode has them: one that ended after appending tool
    output that no later request prefilled (the next turn timed out, or was aborted before it ran). Every token
    after the first such position is that untrained tool output, so no trained logprob depends on their routing."""
    have, want = start_len_for(sample), len(sample.prompt_tokens) + len(sample.response_tokens) - 1
    assert have <= want, f"sample holds routing for {have} positions, more than its {want}"
    if have == want:
        return
    filler = np.full((want - have, layout.num_layers, layout.top_k), -1, dtype=layout.dtype)
    sample.routed_experts = filler if sample.routed_experts is None else np.concatenate([sample.routed_experts, filler])
