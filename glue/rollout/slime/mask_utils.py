"""slime.utils.mask_utils, written by sluice: a chat as token ids with a loss mask that is 1 on the assistant's
own tokens only (not its turn header, not user / system / tool turns, not a message with `step_loss_mask` != 1).

`MultiTurnLossMaskGenerator(tokenizer, tokenizer_type)` with slime's types: "qwen" and "qwen3" render each message
by the checkpoint's chat template on its own (a run of tool messages together, as Qwen's templates wrap them) and
concatenate, the first keeping the system block the template adds; "qwen3_5" renders the whole chat once and masks
the tokens inside each assistant message's text; "distill_qwen" is the first message's prompt followed by the last
message's content, which alone is trained. Any template that renders a message the same after any other works.
"""
from __future__ import annotations

from typing import Any

ANCHOR = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}  # a neutral turn to render messages beside
DISTILL_MARKER = "<｜Assistant｜>"  # DeepSeek-R1-distilled checkpoints' assistant token


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask, the tokens from its first 1 to its end (0 for a mask without a 1)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        self.tokenizer, self.tokenizer_type = tokenizer, tokenizer_type
        self.system_message_length, self.gen_token_length = 0, 0
        if tokenizer_type in ("qwen", "qwen3"):
            self.system_message_length, self.gen_token_length = self.get_system_message_length()

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    @staticmethod
    def find_all_sublist_indices(main_list: list, sublist: list) -> list[int]:
        n = len(sublist)
        return [i for i in range(len(main_list) - n + 1) if main_list[i:i + n] == sublist]

    def _ids(self, messages: list[dict], **kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def get_system_message_length(self) -> tuple[int, int]:
        """(tokens of the system block the template puts before a chat that has none, tokens of the assistant turn
        header that add_generation_prompt appends)."""
        one, two = self._ids([ANCHOR]), self._ids([ANCHOR, ANCHOR])
        turn = len(two) - len(one)
        header = len(self._ids([ANCHOR], add_generation_prompt=True)) - len(one)
        return len(one) - turn, header

    def _turns(self, messages: list[dict]) -> list[list[dict]]:
        """Messages in the groups the template renders as one turn: a run of tool messages is one."""
        turns: list[list[dict]] = []
        for message in messages:
            if message["role"] == "tool" and turns and turns[-1][-1]["role"] == "tool":
                turns[-1].append(message)
            else:
                turns.append([message])
        return turns

    def _per_message(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        anchor = self._ids([ANCHOR])
        anchor_turn = len(self._ids([ANCHOR, ANCHOR])) - len(anchor)
        ids: list[int] = []
        mask: list[int] = []
        for i, turn in enumerate(self._turns(messages)):
            if i == 0:
                piece = self._ids(turn + [ANCHOR], tools=tools)[:-anchor_turn]
            else:
                piece = self._ids([ANCHOR] + turn)[len(anchor):]
            trained = turn[0]["role"] == "assistant" and turn[0].get("step_loss_mask", 1) == 1
            head = min(self.gen_token_length, len(piece))
            mask += [0] * head + [1] * (len(piece) - head) if trained else [0] * len(piece)
            ids += piece
        return ids, mask

    gen_multi_turn_loss_mask_qwen = _per_message
    gen_multi_turn_loss_mask_qwen3 = _per_message

    def gen_multi_turn_loss_mask_qwen3_5(self, messages: list[dict], tools: list[dict] | None = None
                                         ) -> tuple[list[int], list[int]]:
        """The whole chat rendered once; a token is trained when it overlaps a trained assistant message's text
        (where the chat rendered through that message ends, after the text it renders before it)."""
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools)
        trained = [False] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or message.get("step_loss_mask", 1) != 1:
                continue
            start = len(self.tokenizer.apply_chat_template(messages[:i], tokenize=False, tools=tools,
                                                           add_generation_prompt=True)) if i else 0
            end = len(self.tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, tools=tools))
            trained[start:end] = [True] * (end - start)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        if encoded.get("offset_mapping") is None:
            raise ValueError("tokenizer_type qwen3_5 needs a fast tokenizer (return_offsets_mapping)")
        mask = [int(any(trained[a:b])) for a, b in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: list[dict], tools: list[dict] | None = None
                                              ) -> tuple[list[int], list[int]]:
        prompt = self._ids(messages[:1], add_generation_prompt=True, tools=tools)
        response = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = messages[-1].get("step_loss_mask", 1) == 1
        return prompt + response, [0] * len(prompt) + [int(trained)] * len(response)

    def get_loss_mask(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of the chat, by this generator's tokenizer_type."""
        kind = self.tokenizer_type
        if kind == "qwen" and DISTILL_MARKER in self.tokenizer.get_added_vocab():
            kind = "distill_qwen"
        methods = {"qwen": self._per_message, "qwen3": self._per_message,
                   "qwen3_5": self.gen_multi_turn_loss_mask_qwen3_5,
                   "distill_qwen": self.gen_multi_turn_loss_mask_distill_qwen}
        if kind not in methods:
            raise ValueError(f"Unsupported tokenizer type: {kind} (slime's mask_utils has {', '.join(methods)})")
        return methods[kind](messages, tools)

    def get_loss_mask_with_multimodal_alignment(self, messages: list[dict], input_ids: list[int],
                                                tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """The text-only mask of `messages` (list contents reduced to their text parts), left-padded with 0 to the
        length of `input_ids` (a processor's ids, with image tokens)."""
        texts = [{**m, "content": " ".join(p.get("text", "") if isinstance(p, dict) else str(p)
                                           for p in m["content"] if not isinstance(p, dict) or p.get("type") == "text")}
                 if isinstance(m.get("content"), list) else m for m in messages]
        _, mask = self.get_loss_mask(texts, tools=tools)
        if len(input_ids) < len(mask):
            raise ValueError(f"input_ids ({len(input_ids)}) are shorter than the text loss mask ({len(mask)}): the "
                             "processor and the tokenizer tokenise differently")
        return input_ids, [0] * (len(input_ids) - len(mask)) + mask

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The decoded text of each run of trained tokens."""
        spans: list[list[int]] = []
        for i, (token, bit) in enumerate(zip(token_ids, loss_masks)):
            if bit == 1:
                if i == 0 or loss_masks[i - 1] != 1:
                    spans.append([])
                spans[-1].append(token)
        return [self.tokenizer.decode(span) for span in spans]
