"""The `sft:` section of a run config, read when `run.mode: sft`. Light: imports no backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class SftConfig:
    data: str | None = None  # JSONL (or Parquet, with pyarrow) file, one conversation per row: {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}
    messages_key: str = "messages"  # the row's key holding the conversation
    example_rows: int = 0  # > 0: when sft.data does not exist, write this many generated arithmetic chats there first (examples/configs/sft.yaml); 0: the file must exist
    conversations_per_step: int = 16  # conversations in each optimizer step (drawn in a seeded order, reshuffled every epoch)
    max_seq_len: int = 1024  # a conversation longer than this many tokens is cut to it (counted in sft/cut_frac)
    aggregation: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"  # token_mean: every assistant token weighs the same; seq_mean_token_mean: every conversation weighs the same

    def __post_init__(self) -> None:
        if self.example_rows < 0:
            raise ValueError(f"sft.example_rows must be >= 0, got {self.example_rows}")
        if self.conversations_per_step < 1:
            raise ValueError(f"sft.conversations_per_step must be >= 1, got {self.conversations_per_step}")
        if self.max_seq_len < 2:
            raise ValueError(f"sft.max_seq_len must be >= 2 (a token and the one it predicts), got {self.max_seq_len}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(f"sft.aggregation must be token_mean or seq_mean_token_mean, got {self.aggregation!r}")
        if not self.messages_key:
            raise ValueError("sft.messages_key must name the rows' conversation key (default: messages)")

    def loss_config(self):
        """The trainer's loss config for this run (loss.SftLossConfig)."""
        from loss import SftLossConfig  # lazy: loss imports torch, a config module must not

        return SftLossConfig(aggregation=self.aggregation)

    def check_against(self, *, has_tokenizer: bool, temperature: float, eval_enabled: bool, debug: str,
                      routing_replay: bool) -> None:
        """The rules an SFT run sets on other sections; raises ValueError naming the key and the fix."""
        if self.data is None:
            raise ValueError("run.mode=sft needs sft.data: a JSONL file of {\"messages\": [...]} rows (or set "
                             "sft.example_rows to write a generated one there)")
        if not has_tokenizer:
            raise ValueError("run.mode=sft renders chats with the model's tokenizer and chat template, but the tiny "
                             "model has none: set model.tiny.tokenizer: true (with model.tiny.vocab_size >= 260)")
        if temperature != 1.0:
            raise ValueError(f"trainer.temperature={temperature} with run.mode=sft: the cross-entropy is of the "
                             "model's own distribution; set trainer.temperature: 1.0")
        if eval_enabled:
            raise ValueError("eval.interval needs engines, which an SFT run does not start; set eval.interval: 0")
        if debug != "off":
            raise ValueError(f"run.debug={debug} replays RL rollouts; an SFT run has none: set run.debug: off")
        if routing_replay:
            raise ValueError("trainer.routing_replay replays the engines' MoE routing; an SFT run has no engines: "
                             "set trainer.routing_replay: false")
