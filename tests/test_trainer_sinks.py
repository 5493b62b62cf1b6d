"""gpt-oss's attention sinks and sliding windows in sluice's core attention (glue.trainer.sinks): the SDPA form with
the sink as an extra key equals the softmax over the scores and a sink column worked out by hand, forward and
backward; a packed (THD) row equals each of its samples run alone, so neither the window nor the sink lets samples
see each other."""
from __future__ import annotations

import pytest
import torch

from glue.trainer.sinks import allowed_keys, attend_with_sinks

HEADS, GROUPS, HEAD_DIM = 4, 2, 8
SPANS = [5, 9, 3, 7]


def by_hand(query, key, value, scale, window, sinks):
    """out[h, i] = sum_j p_hij v_j with p = exp(s_hij) / (sum over seen j of exp(s_hij) + exp(sink_h)), j seen when
    j <= i and i - j <= window."""
    heads, seq, _ = query.shape
    out = torch.zeros(heads, seq, value.shape[-1], dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // key.shape[0])
        for i in range(seq):
            seen = [j for j in range(seq) if j <= i and (window is None or i - j <= window)]
            scores = torch.stack([(query[h, i] @ key[g, j]) * scale for j in seen])
            weights = scores.exp() / (scores.exp().sum() + (sinks[h].exp() if sinks is not None else 0))
            out[h, i] = sum(w * value[g, j] for w, j in zip(weights, seen))
    return out


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("reference", [False, True])
def test_attention_with_sinks_equals_the_softmax_with_a_sink_column_worked_by_hand(window, reference):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 6, HEAD_DIM, generator=gen, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    got = attend_with_sinks(q, k, v, 0.3, window, sinks, reference=reference)
    # the reference softmaxes in fp32, as megatron's unfused attention does
    assert torch.allclose(got, by_hand(q, k, v, 0.3, window, sinks), atol=1e-6 if reference else 1e-12)
    assert not torch.allclose(got, attend_with_sinks(q, k, v, 0.3, window, None, reference=reference))


def test_the_sdpa_form_and_the_unfused_reference_agree_on_the_sinks_gradient():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 7, HEAD_DIM, generator=gen, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS))
    grads = []
    for reference in (False, True):
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
        attend_with_sinks(q, k, v, 0.3, 3, sinks, reference=reference).square().sum().backward()
        grads.append(sinks.grad)
    assert grads[0].abs().min() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


def test_a_window_of_two_lets_query_four_see_keys_two_to_four():
    assert allowed_keys(6, 2, torch.device("cpu"))[4].tolist() == [False, False, True, True, True, False]


def test_a_packed_row_with_sinks_and_a_window_equals_each_sample_run_alone():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from glue.trainer.attention import SluiceCoreAttention

    config = TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               softmax_type="learnable", window_size=(2, 0), window_attn_skip_freq=[1, 0])
    windowed, full = (SluiceCoreAttention(config, n, AttnMaskType.causal, "self") for n in (1, 2))
    assert (windowed.window, full.window) == (2, None)
    gen = torch.Generator().manual_seed(2)
    total = sum(SPANS)
    cu = torch.tensor([0, *torch.tensor(SPANS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(SPANS),
                             max_seqlen_kv=max(SPANS))
    for module in (windowed, full):
        with torch.no_grad():
            module.softmax_offset.copy_(torch.randn(HEADS, generator=gen))
        q, k, v = (torch.randn(total, n, HEAD_DIM, generator=gen).requires_grad_() for n in (HEADS, GROUPS, GROUPS))
        thd = module(q, k, v, None, packed_seq_params=packed)
        thd_grads = torch.autograd.grad(thd.square().sum(), (q, k, v, module.softmax_offset))
        alone = torch.cat([module(q[a:b, None], k[a:b, None], v[a:b, None], None)[:, 0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        alone_grads = torch.autograd.grad(alone.square().sum(), (q, k, v, module.softmax_offset))
        assert torch.allclose(thd, alone, atol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(thd_grads, alone_grads))
