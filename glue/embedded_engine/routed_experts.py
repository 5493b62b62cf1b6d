"""MoE routing capture for `return_routed_experts` (R3, rollout routing replay): forward hooks on the HF model's
top-k routers record which experts every token went to, and the answer carries them in SGLang's encoding.

SGLang's encoding (sglang/srt/state_capturer/routed_experts.py, `extract_routed_experts_from_meta_info`, and
tokenizer_manager.py's `meta_info["routed_experts"] = pybase64.b64encode(val.numpy().tobytes())`): base64 of a
C-order int32 array `[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]`; row i is the
token at absolute position `routed_experts_start_len + i` (batch_result_processor.py `_maybe_collect_routed_experts`
and state_capturer/base.py `get_topk`: `req_to_token[start_len : seqlen - 1]`). The last token is never run
through the model, so it has no row. Layers without experts (Qwen3-MoE's `mlp_only_layers`) hold -1 here by default;
with `dense_layer_value=0` (--sglang-strict) they hold 0, as SGLang's zero-initialised capture buffer, never written
for a dense layer, reports them (state_capturer/base.py BaseDeviceCache: `torch.zeros`).
"""
from __future__ import annotations

import base64
from typing import Any

import torch


def moe_routers(model: Any) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> the HF top-k router of that layer's sparse MoE block (`layers[i].mlp.gate`, a
    `*TopKRouter` returning `(router_logits, router_scores, router_indices)`, e.g. Qwen3MoeTopKRouter)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    found = {}
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and type(gate).__name__.endswith("TopKRouter"):
            found[i] = gate
    return found


class RoutingRecorder:
    """Records the experts each token is routed to in every forward, using the HF router's own selection: the
    hook keeps the `router_indices` its forward returns (Qwen3MoeTopKRouter: `torch.topk` of the softmaxed router
    logits), so what is recorded is exactly what the experts were run with.

    Only the model runner thread runs forwards, under its model lock, so the captured indices of one forward are
    read by `take` before the next forward begins."""

    def __init__(self, model: Any, dense_layer_value: int = -1):
        self.dense_layer_value = dense_layer_value
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"--enable-return-routed-experts: the model ({type(model).__name__}) has no MoE top-k "
                             "routers (layers[i].mlp.gate); routed experts exist only for MoE models such as qwen3_moe")
        self.num_layers = len(model.model.layers)
        self.top_k = next(iter(self.routers.values())).top_k
        self._captured: dict[int, torch.Tensor] = {}
        for index, router in self.routers.items():
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def keep(module: torch.nn.Module, inputs: Any, output: tuple) -> None:
            self._captured[index] = output[2]  # router_indices [batch * seq, top_k]
        return keep

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The last forward's routing as int32 `[batch, seq, num_layers, top_k]` (`dense_layer_value` in layers
        without experts)."""
        routing = torch.full((batch * seq, self.num_layers, self.top_k), self.dense_layer_value, dtype=torch.int32)
        for index, indices in self._captured.items():
            routing[:, index] = indices.to("cpu", torch.int32)
        self._captured.clear()
        return routing.view(batch, seq, self.num_layers, self.top_k)

    def record(self, seqs: list, first_positions: list[int], seq_len: int) -> None:
        """File the last forward's routing (`len(seqs)` rows of `seq_len` tokens; row i starts at absolute position
        `first_positions[i]` of its sequence) under the sequences that asked for it. A position keeps the routing
        of the first forward that ran it, the one whose output sampled the token after it: a request retracted and
        prefilled again adds only the positions it had not run yet."""
        wanted = [i for i, s in enumerate(seqs) if s.request.return_routed_experts]
        if not wanted:
            self._captured.clear()
            return
        routing = self.take(len(seqs), seq_len)
        for i in wanted:
            seq, skip = seqs[i], seqs[i].routed_len - first_positions[i]
            assert skip >= 0, "a sequence's recorded routing never runs past the positions forwarded so far"
            if skip < seq_len:
                seq.routing.append(routing[i, skip:].clone())


def encode_routed_experts(routing: list[torch.Tensor], start_len: int, seqlen: int) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of int32 rows `[start_len, seqlen - 1)` of the recorded routing
    (fewer when the request ended before running them, e.g. aborted while queued: then possibly "")."""
    if not routing:
        return ""
    chosen = torch.cat(routing)[start_len:max(start_len, seqlen - 1)].contiguous()
    return base64.b64encode(chosen.numpy().astype("<i4", copy=False).tobytes()).decode("ascii")
