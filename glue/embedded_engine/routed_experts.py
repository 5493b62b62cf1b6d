"""MoE routing capture for `return_routed_experts` (R3, rollout routing replay): forward hooks on the HF model's
top-k routers record which experts every token went to, and the answer carries them in SGLang's encoding.

SGLang's encoding (sglang/srt/state_capturer/routed_experts.py, `extract_routed_experts_from_meta_info`, and
tokenizer_manager.py's `meta_info["routed_experts"] = pybase64.b64encode(val.numpy().tobytes())`): base64 of a
C-order int32 array `[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]`; row i is the
token at absolute position `routed_experts_start_len + i` (batch_result_processor.py `_maybe_collect_routed_experts`
and state_capturer/base.py `get_topk`: `req_to_token[start_len : seqlen - 1]`). The last token is never run
through the model, so it has no row. Layers without experts (Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's and
GLM-4.5's first `first_k_dense_replace` layers) hold -1 here by default; with `dense_layer_value=0`
(--sglang-strict) they hold 0, as SGLang's zero-initialised capture buffer, never written for a dense layer,
reports them (state_capturer/base.py BaseDeviceCache: `torch.zeros`).

Where the selection is made (transformers 5.23): in all five families the MoE block calls its router, which returns
`(router_logits, routing_weights, expert_indices)`, `expert_indices` int64 `[tokens, num_experts_per_tok]`, and
hands `expert_indices` unchanged to its experts, so the router's third output is what the experts ran with.
- qwen3_moe: `layers[i].mlp.gate`, Qwen3MoeTopKRouter, top-k of softmax(logits); dense layers: `mlp_only_layers`
  and those off `decoder_sparse_step`.
- mixtral: `layers[i].mlp.gate`, MixtralTopKRouter, top-k of softmax(logits); no dense layers.
- deepseek_v3 and glm4_moe: `layers[i].mlp.gate`, DeepseekV3TopkRouter and Glm4MoeTopkRouter, all inside the
  router: sigmoid(logits) + `e_score_correction_bias`, keep the `topk_group` of `n_group` groups scoring best (a
  group's score: the sum of its top 2), top-k within them (`sorted=False`); `routed_scaling_factor` scales only
  the weights; dense layers: the first `first_k_dense_replace`.
- gpt_oss: `layers[i].mlp.router`, GptOssTopKRouter, top-k of (logits + router bias); no dense layers.
"""
from __future__ import annotations

import base64
from typing import Any

import torch

# The MoE block's attribute that holds its router: `gate` in qwen3_moe, mixtral, deepseek_v3 and glm4_moe, `router`
# in gpt_oss. Dense MLPs have `gate_proj` instead, so a layer without either has no experts.
ROUTER_ATTRIBUTES = ("gate", "router")


def _router_of(block: Any) -> torch.nn.Module | None:
    """The top-k router of an MoE block, None for a dense MLP. "TopKRouter" (qwen3_moe, mixtral, gpt_oss) and
    "TopkRouter" (deepseek_v3, glm4_moe) name the same contract, so the name is compared without case."""
    for attribute in ROUTER_ATTRIBUTES:
        router = getattr(block, attribute, None)
        if isinstance(router, torch.nn.Module) and type(router).__name__.lower().endswith("topkrouter"):
            return router
    return None


def moe_routers(model: Any) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> the HF top-k router of that layer's MoE block (`layers[i].mlp.gate` or
    `layers[i].mlp.router`, a `*TopKRouter`/`*TopkRouter`); layers without experts are absent."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    found = {}
    for i, layer in enumerate(layers):
        router = _router_of(getattr(layer, "mlp", None))
        if router is not None:
            found[i] = router
    return found


class RoutingRecorder:
    """Records the experts each token is routed to in every forward, using the HF router's own selection: the
    hook keeps the expert indices its forward returns, which its MoE block hands unchanged to the experts, so what
    is recorded is exactly what the experts were run with (the families' selection rules: module docstring).

    Only the model runner thread runs forwards, under its model lock, so the captured indices of one forward are
    read by `take` before the next forward begins."""

    def __init__(self, model: Any, dense_layer_value: int = -1):
        self.dense_layer_value = dense_layer_value
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"--enable-return-routed-experts: the model ({type(model).__name__}) has no MoE top-k "
                             "routers (a *TopKRouter at model.layers[i].mlp.gate or .mlp.router); routed experts "
                             "exist only for MoE models such as qwen3_moe, mixtral, deepseek_v3, glm4_moe, gpt_oss")
        self.num_layers = len(model.model.layers)
        # The config's num_experts_per_tok is the one name all five families share for k.
        self.top_k = int(model.config.num_experts_per_tok)
        self._captured: dict[int, torch.Tensor] = {}
        for index, router in self.routers.items():
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def keep(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            indices = output[2] if isinstance(output, tuple) and len(output) == 3 else None
            if not (isinstance(indices, torch.Tensor) and not indices.is_floating_point()
                    and indices.shape[-1] == self.top_k):
                raise RuntimeError(
                    f"routed experts: layer {index}'s router {type(module).__name__} did not return (router_logits, "
                    f"routing_weights, expert_indices [tokens, {self.top_k}]); this transformers version routes "
                    "differently: teach glue/embedded_engine/routed_experts.py its router to record its routing")
            self._captured[index] = indices
        return keep

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The last forward's routing as int32 `[batch, seq, num_layers, top_k]` (`dense_layer_value` in layers
        without experts)."""
        missing = sorted(set(self.routers) - set(self._captured))
        if missing:  # a fused MoE kernel that bypasses the HF router would otherwise read as dense layers
            raise RuntimeError(f"routed experts: the routers of MoE layers {missing} did not run in the last forward; "
                               "serve the model without fused MoE kernels to record its routing")
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
