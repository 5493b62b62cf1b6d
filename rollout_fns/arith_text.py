"""The text arithmetic task of examples/configs/text_arith.yaml: `TextDataTask` over a generated arithmetic JSONL
file (`rollout_fns.arith_data`), written first when it is not there yet, so a run needs nothing prepared."""
from __future__ import annotations

import os

from rollout_fns.arith_data import write_arith_jsonl
from rollout_fns.text_data import TextDataTask


class ArithTextTask(TextDataTask):
    """TextDataTask whose data file `path` is written as `num_rows` rows "What is a<op>b?" (a, b in [low, high],
    op from `operators`, drawn by `data_seed`) if it does not exist; an existing file is read as it is."""

    data_file_args = ()  # `path` is written when it is missing

    def __init__(self, *, path: str, tokenizer: str, num_rows: int = 1000, data_seed: int = 0, low: int = 0,
                 high: int = 4, operators: str = "+", **text_args):
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            partial = f"{path}.partial-{os.getpid()}"  # renamed into place: a reader never sees half a file
            write_arith_jsonl(partial, num_rows, data_seed, low=low, high=high, operators=operators)
            os.replace(partial, path)
        super().__init__(path=path, tokenizer=tokenizer, **text_args)
