"""A tiny random HF causal LM with a real tokenizer and chat template, made offline: the model that text-data runs
and tests start from (a byte-level BPE trained here on generated arithmetic and chat text, no hub download)."""
from __future__ import annotations

import os
import random
from typing import Iterable

from glue.embedded_engine.tiny_model import save_tiny_model

# Ids 0..3, in this order: the trainer puts special tokens first.
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]

# How text is split before BPE: the GPT-4-style pattern Qwen2's tokenizer class uses (one digit per piece). Trained
# with the same split and NFC normalizer, the tokenizer encodes alike whether AutoTokenizer picks Qwen2Tokenizer
# (which rebuilds its pipeline from vocab and merges) or the generic backend that reads tokenizer.json as is.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML, as Qwen's instruct models speak it: every turn is "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CHAT_LINES = ["system", "user", "assistant", "You are a helpful assistant.", "Solve the problem.",
               "Put the final answer in \\boxed{}.", "Let's think step by step.", "The answer is",
               "What is", "Compute", "Therefore", "So the result is"]
_LATEX_BITS = ["\\boxed{", "\\frac{", "}{", "\\sqrt{", "\\cdot", "\\times", "\\div", "\\left(", "\\right)",
               "$", "^{2}", "\\pi", "0.5", "-", "="]


def arithmetic_corpus(seed: int, n: int = 600) -> list[str]:
    """Generated training text for the tokenizer: arithmetic questions and boxed answers, chat role words,
    digits and LaTeX fragments, so that the data sets used with the tiny model tokenize to short sequences."""
    rng = random.Random(seed)
    lines = list(_CHAT_LINES) + list(_LATEX_BITS)
    for _ in range(n):
        a, b = rng.randrange(0, 100), rng.randrange(1, 100)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        question, answer = f"What is {a}{op}{b}?", f"{a} {op} {b} = {value}. The answer is \\boxed{{{value}}}."
        lines.append(f"{IM_START}system\n{rng.choice(_CHAT_LINES)}{IM_END}\n{IM_START}user\n{question}{IM_END}\n"
                     f"{IM_START}assistant\n{answer}{IM_END}\n")
        lines.append(f"{rng.choice(_LATEX_BITS)}\\frac{{{a}}}{{{b}}} + \\sqrt{{{a}}} = ${value}$")
    return lines


def train_tokenizer(corpus: Iterable[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `corpus`, with the ChatML specials and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer=trainer)
    # A small corpus runs out of merges early; reserved specials fill the vocabulary so its size is what was asked.
    core.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - core.get_vocab_size())])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=ENDOFTEXT, eos_token=IM_END,
                                        pad_token=PAD, unk_token=None, additional_special_tokens=[IM_START],
                                        model_max_length=2048)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_text_model(
    path: str | os.PathLike,
    *,
    family: str = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    moe_top_k: int = 2,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
) -> str:
    """Write a tokenizer (trained on `corpus`, default `arithmetic_corpus(seed)`) and a random `family` model whose
    vocabulary is exactly the tokenizer's (`vocab_size` tokens, reserved specials filling what BPE did not) to
    `path`; return the path. Loads offline with AutoTokenizer and AutoModelForCausalLM; the same arguments write
    the same files."""
    smallest = 256 + len(SPECIAL_TOKENS)  # every byte, then the specials
    if vocab_size < smallest:
        raise ValueError(f"save_tiny_text_model: vocab_size must be >= {smallest} (256 bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tokenizer = train_tokenizer(arithmetic_corpus(seed) if corpus is None else corpus, vocab_size)
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(path)
    save_tiny_model(path, family=family, vocab_size=len(tokenizer), hidden_size=hidden_size, num_layers=num_layers,
                    num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                    num_experts=num_experts, moe_top_k=moe_top_k, seed=seed,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    return str(path)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m glue.embedded_engine.tiny_text_model OUTPUT_DIR")
    print(save_tiny_text_model(sys.argv[1]))
