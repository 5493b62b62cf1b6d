"""SGLang's OpenAI-compatible `/v1/chat/completions` and `/v1/models` on the embedded engine: the model directory's
chat template turns messages into prompt ids, the runner generates, and the answer carries SGLang's fields (names from
sglang/srt/entrypoints/openai/protocol.py), token ids and weight versions included, so an agent's calls can be recorded.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from glue.embedded_engine.json_body import describe
from glue.embedded_engine.request_schema import GenerationRequest, RequestError, parse_generate
from glue.embedded_engine.text_io import TOKENIZER_FILES, output_text

ROLES = ("system", "user", "assistant", "tool", "developer", "function")
# SGLang request fields the embedded engine accepts only at their neutral value (no penalties, grammars, adapters).
NEUTRAL_FIELDS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
                  "min_tokens": 0, "regex": None, "ebnf": None, "stop_regex": None, "lora_path": None,
                  "return_hidden_states": False, "return_routed_experts": False, "custom_logit_processor": None}
# Sampling params parse_generate checks, and the chat field each one came from (for the error's field name).
CHAT_NAME_OF = {"max_new_tokens": "max_completion_tokens", "sampling_seed": "seed", "temperature": "temperature",
                "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop_token_ids": "stop_token_ids",
                "ignore_eos": "ignore_eos", "stop": "stop"}


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """One chat completion, parsed: the generation request for the runner plus what shapes the answer."""

    generation: GenerationRequest
    model: str
    want_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    return_prompt_token_ids: bool
    return_token_ids: bool
    return_meta_info: bool
    return_input_ids: bool
    return_output_ids: bool


class ChatFront:
    """The chat layer of one engine: its tokenizer (loaded on first use from `model_path`) and SGLang's chat fields.

    Token ids come back as SGLang returns them: per choice with `return_prompt_token_ids` / `return_token_ids`, and
    as the answer's `sglext.input_ids` / `sglext.output_ids` with `return_input_ids_in_sglext` /
    `return_output_ids_in_sglext` or server-wide, `return_input_ids` / `return_output_ids` (SGLang's
    `--return-input-ids` / `--return-output-ids`). Those are on by default here: sgl-router forwards neither the
    request flags nor SGLang's `x-sglext-return-*-ids` headers, so behind a router only the server-wide switch
    reaches the engine, and sluice always records ids."""

    def __init__(self, *, model_path: str, served_model_name: str, vocab_size: int, max_context: int,
                 return_input_ids: bool = True, return_output_ids: bool = True):
        self.model_path, self.served_model_name = model_path, served_model_name
        self.vocab_size, self.max_context = vocab_size, max_context
        self.return_input_ids, self.return_output_ids = return_input_ids, return_output_ids
        self._tokenizer: Any = None
        self._created = int(time.time())

    def model_list(self) -> dict[str, Any]:
        """SGLang's `/v1/models` answer (a `ModelList` of one `ModelCard`)."""
        card = {"id": self.served_model_name, "object": "model", "created": self._created, "owned_by": "sglang",
                "root": self.served_model_name, "parent": None, "max_model_len": self.max_context}
        return {"object": "list", "data": [card]}

    async def parse(self, body: dict[str, Any], *, rid: str) -> ChatRequest:
        """Check a chat body (field kinds were checked by the route) and build its prompt with the chat template."""
        refuse_unsupported(body)
        tokenizer = await asyncio.to_thread(self.tokenizer)
        prompt = await asyncio.to_thread(self.prompt_ids, tokenizer, body)
        params = sampling_params(body, room=self.max_context - len(prompt))
        generate_body = {"input_ids": prompt, "rid": body.get("rid") or rid, "return_logprob": True,
                         "sampling_params": params}
        try:
            [generation], _ = parse_generate(generate_body, vocab_size=self.vocab_size,
                                             max_context=self.max_context, next_rid=None, tokenizer=tokenizer)
        except RequestError as e:
            raise as_chat_error(e, body) from None
        return ChatRequest(
            generation=generation, model=body.get("model") or "default", want_logprobs=bool(body.get("logprobs")),
            skip_special_tokens=body.get("skip_special_tokens", True), no_stop_trim=bool(body.get("no_stop_trim")),
            return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
            return_token_ids=bool(body.get("return_token_ids")),
            return_meta_info=bool(body.get("return_meta_info")),
            return_input_ids=self.return_input_ids or bool(body.get("return_input_ids_in_sglext")),
            return_output_ids=self.return_output_ids or bool(body.get("return_output_ids_in_sglext")))

    def tokenizer(self) -> Any:
        """The model directory's tokenizer; a 400 saying so when the directory has none or it has no template."""
        if self._tokenizer is None:
            if not any(os.path.isfile(os.path.join(self.model_path, f)) for f in TOKENIZER_FILES):
                raise RequestError("messages", f"this engine's model directory {self.model_path!r} has no tokenizer, "
                                               "so it cannot serve chat; send token ids to /generate, or serve a model "
                                               "saved with its tokenizer and chat template")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if not getattr(self._tokenizer, "chat_template", None):
            raise RequestError("messages", f"the tokenizer in {self.model_path!r} has no chat template")
        return self._tokenizer

    def prompt_ids(self, tokenizer: Any, body: dict[str, Any]) -> list[int]:
        """SGLang's `input_ids` when given (it bypasses the template), else the rendered, tokenised conversation."""
        messages = conversation(body["messages"])
        if body.get("input_ids") is not None:
            return body["input_ids"]
        from jinja2 import TemplateError

        continuing = bool(body.get("continue_final_message"))
        if continuing and messages[-1]["role"] != "assistant":
            raise RequestError("continue_final_message", "needs the last message to be the assistant's")
        try:
            ids = tokenizer.apply_chat_template(
                messages, tools=body.get("tools"), add_generation_prompt=not continuing,
                continue_final_message=continuing, tokenize=True, return_dict=False,
                **(body.get("chat_template_kwargs") or {}))
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise RequestError("messages", f"the chat template cannot render these messages: {e}") from None
        return list(ids)

    def answer(self, request: ChatRequest, output: dict[str, Any]) -> dict[str, Any]:
        """SGLang's `ChatCompletionResponse` for one `/generate`-shaped `output` of `request`."""
        ids, meta = output["output_ids"], output["meta_info"]
        finish = meta["finish_reason"] or {}
        text = output_text(self._tokenizer, ids, finish, no_stop_trim=request.no_stop_trim,
                           skip_special_tokens=request.skip_special_tokens, spaces_between_special_tokens=True)
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
            "logprobs": self.logprobs(meta) if request.want_logprobs else None,
            "finish_reason": finish.get("type"), "matched_stop": finish.get("matched")}
        if request.return_prompt_token_ids or request.return_token_ids:
            choice["prompt_token_ids"] = list(request.generation.input_ids)
        if request.return_token_ids:
            choice["response_token_ids"] = list(ids)
        if request.return_meta_info:
            choice["meta_info"] = meta
        prompt_len = len(request.generation.input_ids)
        response: dict[str, Any] = {
            "id": meta["id"], "object": "chat.completion", "created": int(time.time()), "model": request.model,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(ids), "total_tokens": prompt_len + len(ids),
                      "prompt_tokens_details": None, "reasoning_tokens": 0},
            "metadata": {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"]}}
        sglext = {**({"input_ids": list(request.generation.input_ids)} if request.return_input_ids else {}),
                  **({"output_ids": [list(ids)]} if request.return_output_ids else {})}
        if sglext:
            response["sglext"] = sglext
        return response

    def logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        """SGLang's `ChoiceLogprobs`: one entry per output token (the embedded engine keeps no top logprobs)."""
        content = []
        for logprob, token_id, _ in meta["output_token_logprobs"]:
            token = self._tokenizer.decode([token_id])
            content.append({"token": token, "bytes": list(token.encode("utf-8", "surrogatepass")),
                            "logprob": logprob, "top_logprobs": []})
        return {"content": content}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """400 for what the embedded engine cannot do, rather than silently doing something else."""
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the embedded engine; send stream=false")
    if body.get("n", 1) != 1:
        raise RequestError("n", f"n must be 1 for the embedded engine, got {describe(body['n'])}; send n requests")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs", "top logprobs are not computed by the embedded engine; leave it 0 or unset")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise RequestError("tool_choice", "the embedded engine neither parses nor forces tool calls; use 'auto' or "
                                          "'none' and parse the assistant's text")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format", "constrained decoding is not supported by the embedded engine")
    for name, neutral in NEUTRAL_FIELDS.items():
        value = body.get(name)
        if value is not None and value != neutral and value != {}:
            raise RequestError(name, f"{name} is not supported by the embedded engine; leave it unset")


def conversation(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: a known role and string content (text parts joined, null as
    ""), other keys (tool_calls, tool_call_id, name) passed through."""
    if not messages:
        raise RequestError("messages", "must hold at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"must be a JSON object, got {describe(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RequestError(f"{where}.role", f"must be one of {list(ROLES)}, got {describe(role)}")
        out.append({**message, "role": role.lower(), "content": message_text(message.get("content"), where)})
    return out


def message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content", "must be a string or a list of {'type': 'text', 'text': ...} parts "
                                           f"(the embedded engine reads text only), got {describe(content)}")


def sampling_params(body: dict[str, Any], *, room: int) -> dict[str, Any]:
    """SGLang's `ChatCompletionRequest.to_sampling_params` for the params the embedded engine has (`stop` strings
    matched on the decoded output, glue.embedded_engine.text_io). Without a budget, generation may run to the end
    of the context, as SGLang's does."""
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    params = {"max_new_tokens": room if max_new is None else max_new, "stop": body.get("stop"),
              "stop_token_ids": list(body.get("stop_token_ids") or []),
              "ignore_eos": body.get("ignore_eos", False), "sampling_seed": body.get("seed")}
    for name in ("temperature", "top_p", "top_k", "min_p"):
        if body.get(name) is not None:
            params[name] = body[name]
    return params


def as_chat_error(error: RequestError, body: dict[str, Any]) -> RequestError:
    """A `/generate` check's error renamed to the chat field the client sent."""
    name = error.field.removeprefix("sampling_params.")
    if name == "max_new_tokens" and body.get("max_completion_tokens") is None:
        name = "max_tokens"
    elif name in CHAT_NAME_OF:
        name = CHAT_NAME_OF[name]
    elif name.startswith("input_ids"):
        name = "input_ids" if body.get("input_ids") is not None else "messages"
    return RequestError(name, str(error).replace(error.field, name, 1), status=error.status)
