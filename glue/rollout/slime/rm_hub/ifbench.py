"""slime.rollout.rm_hub.ifbench (`--rm-type ifbench`): IFBench's strict instruction-following check, through
IFBench's own `evaluation_lib` (github.com/allenai/IFBench), which sluice does not ship: put its checkout on
PYTHONPATH. Metadata: instruction_id_list, kwargs (one dict, or one per instruction), prompt_text, record_id."""
from __future__ import annotations

import importlib
from typing import Any

MISSING = ("rm_type ifbench needs IFBench's evaluation_lib (git clone https://github.com/allenai/IFBench and put it "
           "on PYTHONPATH); sluice does not ship it")


def _evaluation_lib() -> Any:
    try:
        return importlib.import_module("evaluation_lib")
    except ImportError:
        raise ImportError(MISSING) from None


def _kwargs_per_instruction(raw: Any, count: int) -> list[dict]:
    """One kwargs dict per instruction, None values dropped: a list is padded with its last entry, a dict repeated."""
    if isinstance(raw, dict):
        entries = [dict(raw)] * count
    elif isinstance(raw, list):
        entries = [dict(e) if isinstance(e, dict) else {} for e in raw][:count]
        entries += [dict(entries[-1]) if entries else {} for _ in range(count - len(entries))]
    else:
        entries = [{} for _ in range(count)]
    return [{k: v for k, v in entry.items() if v is not None} for entry in entries]


def compute_ifbench_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the response follows every instruction of the metadata, else 0.0 (also without instructions)."""
    ids = [str(i).strip() for i in (metadata or {}).get("instruction_id_list") or [] if i is not None]
    ids = [i for i in ids if i]
    if response is None or not ids:
        return 0.0
    lib = _evaluation_lib()
    prompt = str(metadata.get("prompt_text") or "")
    example = lib.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids, prompt=prompt,
                               kwargs=_kwargs_per_instruction(metadata.get("kwargs"), len(ids)))
    verdict = lib.test_instruction_following_strict(example, {prompt: str(response)})
    return 1.0 if verdict.follow_all_instructions else 0.0
