"""Transformer Engine's layer spec, on a machine without it: the converter reads a megatron state in TE's names
(fused input / pre-MLP norms, `_extra_state` entries) into the same HF tensors as in local names and writes HF
weights back in exactly TE's parameter names; `trainer.layer_spec` resolves auto to local here, and `te` is refused
by the config check and by `--dry-run` in one line."""
from __future__ import annotations

import io
import itertools
import sys
import types

import pytest
import torch
import yaml

from glue.trainer import te_spec
from glue.trainer.config import TrainerConfig
from glue.trainer.te_spec import resolve_layer_spec, te_available, te_layer_spec
from launch.cli import main
from helpers.cli import DEMO, one_line_error
from weight_sync.convert import (ParallelLayout, attention_shape, from_te_names, hf_to_megatron, hf_to_megatron_local,
                                 in_names_of, megatron_to_hf, rules, to_te_names)

LLAMA = dict(model_type="llama", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=24)
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 8}  # head_dim != hidden / heads, as in Qwen3
# layer 0 dense (mlp_only_layers), layers 1-3 routed experts: TE fuses the pre-MLP norm of layer 0 only
QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "mlp_only_layers": [0]}
FAMILIES = {"llama": LLAMA, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}

# megatron-core 0.16's TE spec (get_gpt_layer_with_transformer_engine_spec), per layer under decoder.layers.{i}.
TE_ATTENTION = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight"]
QK_NORMS = ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
TE_DENSE_MLP = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
TE_MOE_MLP = ["pre_mlp_layernorm.weight", "mlp.router.weight",
              *[f"mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(4) for k in (1, 2)]]
WHOLE_MODEL = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
TE_LAYERS = {
    "llama": [TE_ATTENTION + TE_DENSE_MLP] * 2,
    "qwen3": [TE_ATTENTION + QK_NORMS + TE_DENSE_MLP] * 2,
    "qwen3_moe": [TE_ATTENTION + QK_NORMS + TE_DENSE_MLP] + [TE_ATTENTION + QK_NORMS + TE_MOE_MLP] * 3,
}


def hf_state(config: dict) -> dict[str, torch.Tensor]:
    """A random HF checkpoint shaped by `config`, every tensor the converter's name table lists."""
    generator = torch.Generator().manual_seed(0)
    names = [name for rule in rules(config) for name in rule.hf]
    return {name: torch.randn(_hf_shape(name, config), generator=generator) for name in names}


def _hf_shape(name: str, config: dict) -> tuple[int, ...]:
    hidden, (nq, ng, head_dim) = config["hidden_size"], attention_shape(config)
    ffn = config["moe_intermediate_size"] if ".experts." in name else config["intermediate_size"]
    shapes = {"embed_tokens.weight": (config["vocab_size"], hidden), "lm_head.weight": (config["vocab_size"], hidden),
              "q_proj.weight": (nq * head_dim, hidden), "k_proj.weight": (ng * head_dim, hidden),
              "v_proj.weight": (ng * head_dim, hidden), "o_proj.weight": (hidden, nq * head_dim),
              "q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,), "gate_proj.weight": (ffn, hidden),
              "up_proj.weight": (ffn, hidden), "down_proj.weight": (hidden, ffn),
              "gate.weight": (config.get("num_experts", 0), hidden)}
    return shapes.get(".".join(name.split(".")[-2:]), (hidden,))  # the rest are norms over the hidden size


def with_extra_states(state: dict) -> dict:
    """`state` plus the `_extra_state` entries TE modules add (its linears and core attention): an empty uint8
    tensor as TE 1.x/2.x stores one without FP8, or a BytesIO as older TE did."""
    modules = {name.rsplit(".", 1)[0] for name in state if ".linear_" in name}
    modules |= {f"decoder.layers.{i}.self_attention.core_attention" for i in _layers(state)}
    extra = {f"{m}._extra_state": torch.empty(0, dtype=torch.uint8) if n % 2 else io.BytesIO()
             for n, m in enumerate(sorted(modules))}
    return {**state, **extra}


def _layers(state: dict) -> set[str]:
    return {name.split(".")[2] for name in state if name.startswith("decoder.layers.")}


def te_parameter_names(family: str) -> set[str]:
    return set(WHOLE_MODEL) | {f"decoder.layers.{i}.{name}" for i, layer in enumerate(TE_LAYERS[family])
                               for name in layer}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_state_in_te_names_converts_to_the_same_hf_tensors_as_in_local_names(family):
    config = FAMILIES[family]
    hf = hf_state(config)
    local = hf_to_megatron(hf, config)
    te = with_extra_states(to_te_names(local))
    assert "decoder.layers.0.input_layernorm.weight" in local and "decoder.layers.0.input_layernorm.weight" not in te
    from_local, from_te = megatron_to_hf(local, config), megatron_to_hf(te, config)
    assert list(from_te) == list(from_local) == list(hf)
    for name, tensor in hf.items():
        assert torch.equal(from_local[name], tensor) and torch.equal(from_te[name], tensor), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_weights_converted_for_a_te_model_carry_exactly_the_te_specs_parameter_names(family):
    config = FAMILIES[family]
    local = hf_to_megatron(hf_state(config), config)
    te = in_names_of(local, te_parameter_names(family))
    assert set(te) == te_parameter_names(family)
    assert te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] is \
        local["decoder.layers.0.input_layernorm.weight"]
    back = from_te_names(te)
    assert list(back) == list(local) and all(back[name] is local[name] for name in local)


def test_only_the_dense_layer_of_a_moe_model_fuses_its_pre_mlp_norm_into_linear_fc1():
    te = to_te_names(hf_to_megatron(hf_state(QWEN3_MOE), QWEN3_MOE))
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te and "decoder.layers.0.pre_mlp_layernorm.weight" \
        not in te
    for layer in (1, 2, 3):
        assert f"decoder.layers.{layer}.pre_mlp_layernorm.weight" in te
        assert f"decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight" not in te


def test_te_named_ranks_of_a_tp2_pp2_ep2_layout_gather_back_to_the_hf_checkpoint():
    hf = hf_state(QWEN3_MOE)
    ranks = [ParallelLayout.even(4, tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, ep_rank=e, ep_size=2)
             for p, e, t in itertools.product(range(2), range(2), range(2))]
    states = [with_extra_states(to_te_names(hf_to_megatron_local(hf, QWEN3_MOE, rank))) for rank in ranks]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in states[0], "stage 0's layer 0 is the dense one"
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in states[-1], "stage 1's layer 0 is the model's MoE layer 2"
    back = megatron_to_hf(states, QWEN3_MOE, ranks)
    assert set(back) == set(hf) and all(torch.equal(back[name], tensor) for name, tensor in hf.items())


def test_a_model_in_local_names_gets_the_converted_state_unchanged():
    local = hf_to_megatron(hf_state(LLAMA), LLAMA)
    assert in_names_of(local, list(local)) is local


def test_a_state_holding_a_norm_under_both_names_is_refused():
    norm = torch.ones(4)
    with pytest.raises(ValueError, match="'decoder.layers.0.input_layernorm.weight' is in the state twice"):
        from_te_names({"decoder.layers.0.input_layernorm.weight": norm,
                       "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": norm})


# megatron-core 0.16's TEGroupedMLP (--moe-grouped-gemm, TE spec): one GroupedLinear per projection, expert i's
# weight named weight{i} (experts.py TEGroupedMLP, extensions/transformer_engine.py TEGroupedLinear)
TE_GROUPED_MOE_MLP = ["pre_mlp_layernorm.weight", "mlp.router.weight",
                      *[f"mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in range(4)]]


def te_grouped_parameter_names() -> set[str]:
    layers = [TE_ATTENTION + QK_NORMS + TE_DENSE_MLP] + [TE_ATTENTION + QK_NORMS + TE_GROUPED_MOE_MLP] * 3
    return set(WHOLE_MODEL) | {f"decoder.layers.{i}.{name}" for i, layer in enumerate(layers) for name in layer}


def test_hf_weights_converted_for_te_grouped_experts_carry_exactly_their_parameter_names():
    local = hf_to_megatron(hf_state(QWEN3_MOE), QWEN3_MOE)
    te = in_names_of(local, te_grouped_parameter_names())
    assert set(te) == te_grouped_parameter_names()
    assert te["decoder.layers.1.mlp.experts.linear_fc1.weight3"] is \
        local["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert te["decoder.layers.3.mlp.experts.linear_fc2.weight0"] is \
        local["decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight"]
    back = from_te_names(te)
    assert list(back) == list(local) and all(back[name] is local[name] for name in local)


def test_te_grouped_experts_convert_to_the_same_hf_tensors_as_sequential_ones():
    hf = hf_state(QWEN3_MOE)
    grouped = with_extra_states(to_te_names(hf_to_megatron(hf, QWEN3_MOE), grouped_experts=True))
    assert "decoder.layers.2.mlp.experts.linear_fc2.weight1" in grouped
    assert "decoder.layers.2.mlp.experts.linear_fc1._extra_state" in grouped  # one per grouped linear, as TE has
    assert not any(".local_experts." in name for name in grouped)
    back = megatron_to_hf(grouped, QWEN3_MOE)
    assert list(back) == list(hf) and all(torch.equal(back[name], tensor) for name, tensor in hf.items())


def test_grouped_experts_are_numbered_per_ep_rank_and_gather_back_from_a_tp2_ep2_layout():
    hf = hf_state(QWEN3_MOE)
    ranks = [ParallelLayout.even(4, tp_rank=t, tp_size=2, ep_rank=e, ep_size=2) for e in range(2) for t in range(2)]
    states = [with_extra_states(to_te_names(hf_to_megatron_local(hf, QWEN3_MOE, rank), grouped_experts=True))
              for rank in ranks]
    second_ep = states[2]  # ep_rank 1, tp_rank 0: the model's experts 2 and 3 as its weight0 and weight1
    assert {n.rsplit(".", 1)[1] for n in second_ep if ".mlp.experts.linear_fc1.weight" in n} == {"weight0", "weight1"}
    down = hf["model.layers.1.mlp.experts.2.down_proj.weight"]  # ROW kind: TP splits the input dimension
    assert torch.equal(second_ep["decoder.layers.1.mlp.experts.linear_fc2.weight0"], down.chunk(2, dim=1)[0])
    back = megatron_to_hf(states, QWEN3_MOE, ranks)
    assert set(back) == set(hf) and all(torch.equal(back[name], tensor) for name, tensor in hf.items())


def test_the_legacy_grouped_mlps_fused_expert_weights_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"'decoder.layers.1.mlp.experts.weight1' is a weight of megatron's legacy "
                                         r"GroupedMLP .* drop --moe-use-legacy-grouped-gemm"):
        from_te_names({"decoder.layers.1.mlp.experts.weight1": torch.ones(16, 32)})


@pytest.fixture
def without_te(monkeypatch):
    """This machine as one without Transformer Engine, whatever is installed: its import fails."""
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    te_available.cache_clear()
    yield
    te_available.cache_clear()


@pytest.fixture
def with_te_importable(monkeypatch):
    """`import transformer_engine.pytorch` succeeds (empty modules: TE itself cannot run on this CPU machine)."""
    package = types.ModuleType("transformer_engine")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    te_available.cache_clear()
    yield
    te_available.cache_clear()


@pytest.fixture
def te_absent_for_the_launcher(monkeypatch):
    """The launcher's answer on a machine without TE, leaving the import system alone: a dry run imports megatron,
    which must not record TE as absent for the rest of the session where TE is installed."""
    monkeypatch.setattr(te_spec, "te_available", lambda: False)


TE_NEEDED = "trainer.layer_spec=te needs transformer_engine importable on the trainer nodes; use auto or local"


def test_auto_builds_the_local_spec_where_transformer_engine_does_not_import(without_te):
    assert not te_available()
    assert resolve_layer_spec("auto") == "local" and resolve_layer_spec("local") == "local"


def test_auto_builds_te_where_transformer_engine_imports(with_te_importable):
    assert resolve_layer_spec("auto") == "te" and resolve_layer_spec("te") == "te"
    assert resolve_layer_spec("local") == "local"


def test_te_without_transformer_engine_is_refused_naming_the_fix(without_te):
    with pytest.raises(ValueError) as refused:
        resolve_layer_spec("te")
    assert str(refused.value) == TE_NEEDED
    with pytest.raises(ValueError, match="use auto or local"):
        te_layer_spec(object())
    with pytest.raises(ValueError, match="trainer.layer_spec must be one of auto, local, te, got 'tee'"):
        resolve_layer_spec("tee")


def test_the_trainer_config_takes_auto_local_or_te_and_defaults_to_auto():
    assert TrainerConfig().layer_spec == "auto"
    assert TrainerConfig(layer_spec="te").layer_spec == "te"  # whether TE imports is the trainer node's question
    with pytest.raises(ValueError, match="trainer.layer_spec must be auto, local or te, got 'TE'"):
        TrainerConfig(layer_spec="TE")


def test_dry_run_refuses_te_without_transformer_engine_in_one_line(capsys, te_absent_for_the_launcher):
    assert one_line_error(capsys, ["trainer.layer_spec=te"]) == f"sluice: config error: {TE_NEEDED}"
    line = one_line_error(capsys, ["trainer.layer_spec=tee"])
    assert line == "sluice: config error: trainer.layer_spec must be one of ['auto', 'local', 'te'], got 'tee'"


def test_dry_run_reports_the_layer_spec_auto_resolves_to_here(capsys, te_absent_for_the_launcher):
    assert main(["--dry-run", "--config", DEMO]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["layer_spec"] == "auto"
    assert ("layer spec: auto, local here (transformer_engine does not import; each trainer node resolves it for "
            "itself)") in shown["checked"]
    assert main(["--dry-run", "--config", DEMO, "trainer.layer_spec=local"]) == 0
    assert "layer spec: local" in yaml.safe_load(capsys.readouterr().out)["checked"]
