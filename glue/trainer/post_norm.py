"""A norm after a layer's attention and after its MLP, before each residual add (GLM-4's "sandwich" norms:
`post_self_attn_layernorm`, `post_mlp_layernorm`). megatron-core's TransformerLayer has no slot for them, so the
layer's two output projections carry them: a row-parallel linear whose output (whole hidden size, after the TP
reduce) is normed before the layer adds it to the residual. The norm's weight is `<projection>.post_layernorm.weight`
(weight_sync.families.table.POST_NORMS)."""
from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.tensor_parallel import RowParallelLinear


@functools.cache
def with_post_norm(norm: type) -> type:
    """RowParallelLinear followed by a `norm` (the layer spec's RMSNorm class) over its output."""

    class RowParallelLinearThenNorm(RowParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = norm(config, output_size, eps=config.layernorm_epsilon)

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            out, bias = super().forward(input_, *args, **kwargs)
            if bias is not None:  # the norm would have to follow the bias add, which the layer does after this
                raise ValueError("a post-norm projection takes no bias (GLM-4's o_proj / down_proj have none); "
                                 "drop --add-bias-linear")
            return self.post_layernorm(out), None

    return RowParallelLinearThenNorm
