"""Block-FP8 checkpoints (DeepSeek-V3's format: float8_e4m3fn weights with a float32 `weight_scale_inv` per block):
a tiny Qwen3 written by transformers, its linear weights quantized here by hand in 16x16 blocks over dims that leave
partial blocks. The trainer's reader, the embedded engine and the plan all see the dequantized model, computed here
block by block, and the export writes what the trainer loaded and trained (frozen MTP layers dequantized too); a
quantization sluice cannot dequantize is refused in one line naming the field."""
import json
import math
import pickle

import pytest
import torch

from weight_sync.fp8_blocks import BlockFp8, block_fp8_of, dequantize_weight

BLOCK = 16
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
             "up_proj.weight", "down_proj.weight")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per BLOCK x BLOCK block): each block scaled so its largest |value|
    is e4m3's largest, 448, as DeepSeek's quantizer does."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = block.abs().max() / 448
            quantized[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(
                torch.float8_e4m3fn)
    return quantized, scale


def by_hand(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The real value, block by block: each block's FP8 values times its one scale, in float32."""
    out = torch.empty(quantized.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = quantized[rows, cols].float() * scale[i, j]
    return out


def write_fp8_checkpoint(path, family: str, **dims) -> tuple[str, dict[str, torch.Tensor]]:
    """(directory of a block-FP8 checkpoint, its dequantized weights by hand): a tiny `family` model written by
    transformers, every linear weight (attention, MLP, each expert) quantized and the rest kept."""
    from safetensors.torch import load_file, save_file

    from glue.embedded_engine.tiny_model import save_tiny_model

    path = save_tiny_model(path, family=family, hidden_size=40, num_heads=4, num_kv_heads=2, **dims)
    plain = load_file(f"{path}/model.safetensors")
    stored, expected = {}, {}
    for name, tensor in plain.items():
        if name.endswith(QUANTIZED):
            stored[name], stored[name + "_scale_inv"] = quantize(tensor)
            expected[name] = by_hand(stored[name], stored[name + "_scale_inv"])
        else:
            stored[name] = expected[name] = tensor
    save_file(stored, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**config, "quantization_config": FP8_CONFIG}, f)
    return path, expected


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A Qwen3, hidden 40 and intermediate 56: not multiples of the 16 x 16 block."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "qwen3", "qwen3", intermediate_size=56)


@pytest.fixture(scope="module")
def fp8_moe_model(tmp_path_factory):
    """A Qwen3-MoE, as Qwen's FP8 MoE releases: each expert's weights quantized on their own ([16, 40] and [40, 16]),
    the router unquantized."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "qwen3_moe", "qwen3_moe", intermediate_size=64)


def test_a_partial_block_is_scaled_by_its_own_scale():
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 3.0], [5.0, 7.0]])  # blocks of 2x2: the last row and column are partial
    out = dequantize_weight(weight, scale_inv, (2, 2), torch.float32)
    assert torch.equal(out, torch.tensor([[2.0, 4.0, 9.0], [8.0, 10.0, 18.0], [35.0, 40.0, 63.0]]))
    # Qwen's FP8 releases store the scales in bf16: the same value
    assert torch.equal(dequantize_weight(weight, scale_inv.to(torch.bfloat16), (2, 2), torch.float32), out)


def test_the_dequantized_checkpoint_is_the_hand_computed_value_exactly_and_holds_no_scales(fp8_model):
    from safetensors.torch import load_file

    path, expected = fp8_model
    stored = load_file(f"{path}/model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (3, 3)  # 40 = 16 + 16 + 8
    assert stored["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    out = BlockFp8(block=(BLOCK, BLOCK)).dequantize(stored, torch.float32)
    assert sorted(out) == sorted(expected)
    assert all(torch.equal(out[name], expected[name]) for name in expected)


def test_the_trainers_reader_returns_plain_float_weights_in_its_dtype(fp8_model):
    from glue.trainer.model import read_hf_state

    path, expected = fp8_model
    state = read_hf_state(path, torch.bfloat16)
    assert not [name for name in state if name.endswith("_scale_inv")]
    name = "model.layers.1.mlp.down_proj.weight"
    assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], expected[name].to(torch.bfloat16))
    assert state["model.norm.weight"].dtype == torch.float32  # unquantized tensors stay as stored
    assert all(torch.equal(t, expected[n]) for n, t in read_hf_state(path).items())


@pytest.mark.parametrize("model", ["fp8_model", "fp8_moe_model"])
def test_the_embedded_engine_serves_the_logits_of_the_unquantized_model_with_the_dequantized_weights(model, request,
                                                                                                     tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from glue.embedded_engine.engine import load_model

    path, expected = request.getfixturevalue(model)
    engine_model = load_model(path)
    assert getattr(engine_model.config, "quantization_config", None) is None
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    config.save_pretrained(tmp_path)
    save_file(expected, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.tensor([[0, 5, 9, 3, 17, 2]])
    with torch.no_grad():
        assert torch.equal(engine_model(tokens).logits, plain(tokens).logits)


@pytest.mark.parametrize("field, value", [("quant_method", "mxfp4"), ("fmt", "e5m2"), ("weight_block_size", None),
                                          ("activation_scheme", "static")])
def test_a_quantization_sluice_cannot_dequantize_is_refused_in_one_line_naming_the_field(field, value):
    with pytest.raises(ValueError) as err:
        block_fp8_of({"model_type": "qwen3", "quantization_config": {**FP8_CONFIG, field: value}})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"config.json quantization_config.{field} is {value!r}: sluice loads block-FP8 "
                              "checkpoints only")


def test_the_trainers_start_up_line_says_the_checkpoint_is_block_fp8_and_dequantized(fp8_model):
    from glue.trainer.config import TrainerConfig
    from glue.trainer.model import read_hf_config
    from glue.trainer.optim import precision_line

    line = precision_line("bf16", TrainerConfig(), read_hf_config(fp8_model[0]), 1)
    assert line.startswith("trainer precision bf16: checkpoint block-FP8, dequantized at load (its unquantized "
                           "tensors float32), model weights bfloat16")


def test_a_checkpoint_without_quantization_config_is_not_block_fp8():
    assert block_fp8_of({"model_type": "qwen3"}) is None


def test_the_dry_run_says_the_checkpoint_is_block_fp8_and_dequantized_to_the_trainers_dtype(fp8_model, capsys):
    import os

    import yaml

    from launch.cli import main
    from launch.plan.model_check import format_bytes

    path, expected = fp8_model
    on_disk, elements = os.path.getsize(f"{path}/model.safetensors"), sum(t.numel() for t in expected.values())
    for precision, element_size in (("fp32", 4), ("bf16", 2)):
        argv = ["--dry-run", "--config", "examples/configs/demo.yaml", f"model.path={path}",
                f"trainer.precision={precision}"]
        assert main(argv) == 0
        checked = yaml.safe_load(capsys.readouterr().out)["checked"]
        assert f"model: {path} is a qwen3 checkpoint (1 weight files, {format_bytes(on_disk)}); block-FP8 " \
               f"(float8_e4m3fn weights, weight_scale_inv per 16x16 block): dequantized to the trainer's {precision} " \
               f"at load ({format_bytes(elements * element_size)} once dequantized), and exported dequantized" \
               in checked


def _trainer_rank(model_path, port, checkpoint, results):
    """One trainer rank (world size 1) started from `model_path`: its weights as loaded, then after one step, which
    it saves as a checkpoint."""
    from glue.trainer.config import TrainerConfig
    from glue.trainer.worker import TrainerWorker
    from helpers.trainer import make_batch
    from loss import LossConfig

    worker = TrainerWorker(model_path=model_path, cfg=TrainerConfig(micro_batch_size=6, lr=1e-2),
                           loss_cfg=LossConfig(), rank=0, world_size=1)
    try:
        worker.initialize("127.0.0.1", port)
        loaded = {n: t.clone() for n, t in worker.full_hf_state().items()}
        worker.train_step(make_batch())
        worker.save_checkpoint(checkpoint)
        results.put(pickle.dumps((loaded, {n: t.clone() for n, t in worker.full_hf_state().items()})))
    except Exception as err:  # reported to the test, which asserts on it
        results.put(pickle.dumps(err))
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_the_trainer_loads_the_dequantized_weights_and_its_export_writes_them_without_quantization_config(
        fp8_model, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    from conftest import REPO_ROOT, free_port
    from helpers.forkserver import rank_context

    path, expected = fp8_model
    ctx = rank_context()
    results = ctx.Queue()
    rank = ctx.Process(target=_trainer_rank, args=(path, free_port(), str(tmp_path / "step_1"), results))
    rank.start()
    try:
        loaded = pickle.loads(results.get(timeout=240))
    finally:
        rank.join(timeout=60)
    assert not isinstance(loaded, Exception), loaded
    loaded, trained = loaded
    assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[n], expected[n]) for n in expected)
    done = subprocess.run([sys.executable, "-m", "launch", "export-hf", str(tmp_path / "step_1"), str(tmp_path / "hf")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("(1 safetensors file(s)); the initial model was block-FP8: its weights are written dequantized, in the "
            "trainer's fp32, and config.json has no quantization_config") in done.stdout
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}  # the trainer's dtype (fp32 here), no FP8
    assert sorted(exported) == sorted(trained) and all(torch.equal(exported[n], trained[n]) for n in trained)
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                           expected["model.layers.0.self_attn.q_proj.weight"])  # trained, not copied
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "qwen3"


def test_a_checkpoint_keeps_a_block_fp8_models_frozen_mtp_layer_dequantized_for_the_export(tmp_path):
    from safetensors.torch import load_file, save_file

    from glue.embedded_engine.tiny_model import tiny_config
    from glue.trainer.checkpointing import FROZEN, _copy_frozen_tensors

    config = tiny_config(family="glm4_moe")  # 2 decoder layers; its MTP layer is model.layers.2
    config.num_nextn_predict_layers, config.quantization_config = 1, FP8_CONFIG
    gen = torch.Generator().manual_seed(0)
    eh_proj, scale = quantize(torch.randn(40, 72, generator=gen))
    enorm = torch.randn(64, generator=gen)
    save_file({"model.layers.2.eh_proj.weight": eh_proj, "model.layers.2.eh_proj.weight_scale_inv": scale,
               "model.layers.2.enorm.weight": enorm, "model.norm.weight": torch.ones(64)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "hf_config").mkdir()  # save_rank copies the config files there first
    _copy_frozen_tensors(str(tmp_path), str(tmp_path / "hf_config"), config, torch.bfloat16)
    frozen = load_file(str(tmp_path / "hf_config" / FROZEN))
    assert sorted(frozen) == ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"]
    assert torch.equal(frozen["model.layers.2.eh_proj.weight"], by_hand(eh_proj, scale).to(torch.bfloat16))
    assert torch.equal(frozen["model.layers.2.enorm.weight"], enorm)
