"""The embedded engine's text layer, as SGLang 0.5.23's tokenizer manager, scheduler and detokenizer do it: `text`
prompts are tokenized, `stop` strings end a request once the decoded tail of its output holds one, and each answer's
`text` is the output decoded with the matched stop trimmed (kept with `no_stop_trim`). Only an engine whose model
directory holds a tokenizer has this layer; without one, text and stop strings are refused as SGLang refuses them
under --skip-tokenizer-init."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from glue.embedded_engine.request_error import RequestError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_STOP_COUNT = 32  # sglang.srt.sampling.sampling_params.MAX_STOP_COUNT


def load_tokenizer(model_path: str) -> Any | None:
    """The model directory's tokenizer, or None when it has none (a token-id model such as the toy tasks')."""
    if not any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


@dataclass(frozen=True, eq=False)
class StopStrings:
    """A request's `stop` strings and the tokenizer that decodes its output. SGLang decodes the last
    `max_len + 1` output tokens (max_len: the longest stop string in tokens) after each one and stops on the first
    stop string found there; the tokens that produced it stay in `output_ids`."""

    strings: tuple[str, ...]
    max_len: int
    tokenizer: Any

    def match(self, output_ids: list[int]) -> str | None:
        """The stop string the output now ends in (within its tail), or None."""
        tail = self.tokenizer.decode(output_ids[-(self.max_len + 1):])
        return next((s for s in self.strings if s in tail), None)


def parse_stop(tokenizer: Any | None, stop: Any, where: str) -> StopStrings | None:
    """`sampling_params.stop`: a string or a list of at most 32 strings; None or [] for none."""
    if stop is None or stop == []:
        return None
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise RequestError(f"{where}.stop", f"must be a string or a list of strings, got {str(stop)[:100]}")
    if len(strings) > MAX_STOP_COUNT:
        raise RequestError(f"{where}.stop", f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(strings)}")
    if tokenizer is None:
        raise RequestError(f"{where}.stop", f"stop={strings!r} needs a tokenizer to match text, and this engine's "
                                             "model directory has none; send stop_token_ids, or serve a model saved "
                                             "with its tokenizer")
    max_len = max(len(tokenize(tokenizer, s, f"{where}.stop", add_special_tokens=False)) for s in strings)
    return StopStrings(strings=tuple(strings), max_len=max_len, tokenizer=tokenizer)


def encode_text(tokenizer: Any | None, text: Any, field: str) -> list[int]:
    """One `text` prompt as SGLang tokenizes it (the tokenizer's own special tokens added, as `tokenizer(text)`)."""
    if tokenizer is None:
        raise RequestError(field, "this engine's model directory has no tokenizer; send input_ids instead of text, "
                                   "or serve a model saved with its tokenizer")
    if not isinstance(text, str):
        raise RequestError(field, f"must be a string (or the batch a list of strings), got {str(text)[:100]}")
    ids = tokenize(tokenizer, text, field)
    if not ids:
        raise RequestError(field, "tokenizes to no tokens; send a non-empty text")
    return ids


def tokenize(tokenizer: Any, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`; a string no tokenizer takes (a lone surrogate from JSON's \\ud800) is a 400."""
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    except (ValueError, TypeError) as err:  # UnicodeEncodeError is a ValueError
        raise RequestError(field, f"cannot be tokenized ({type(err).__name__}): send valid UTF-8 text")


def output_text(tokenizer: Any, output_ids: list[int], finish_reason: dict[str, Any] | None, *,
                no_stop_trim: bool, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
    """The answer's `text`, as SGLang's detokenizer makes it (`trim_matched_stop`): a matched stop token is left
    out before decoding, a matched stop string is cut at its first occurrence; `no_stop_trim` keeps either (and
    only what follows a stop string inside its last token is cut)."""
    matched = (finish_reason or {}).get("matched")
    ids = output_ids
    if isinstance(matched, int) and not isinstance(matched, bool) and not no_stop_trim and ids:
        ids = ids[:-1]  # SGLang: the last token is always the matched one
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos + len(matched)] if no_stop_trim else text[:pos]
    return text
