"""A generated text arithmetic data set ({"prompt": "What is 12+7?", "answer": "19"} per line) for the CPU text
example and the tests: the input `rollout_fns.text_data:TextDataTask` reads, verified by `math_reward`."""
from __future__ import annotations

import json
import os
import random

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arith_rows(n: int, seed: int, *, low: int = 0, high: int = 20, operators: str = "+-") -> list[dict]:
    """`n` seeded rows "What is a<op>b?" with a, b drawn from [low, high] and op from `operators`."""
    unknown = set(operators) - set(OPERATORS)
    if unknown or not operators:
        raise ValueError(f"arith_rows: operators must be a non-empty string of {''.join(OPERATORS)}, got {operators!r}")
    if low > high:
        raise ValueError(f"arith_rows: need low <= high, got low={low}, high={high}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(operators)
        rows.append({"prompt": f"What is {a}{op}{b}?", "answer": str(OPERATORS[op](a, b))})
    return rows


def write_arith_jsonl(path: str | os.PathLike, n: int, seed: int = 0, **row_args) -> str:
    """Write `arith_rows(n, seed, **row_args)` as JSON lines to `path`; return the path as a string."""
    with open(path, "w", encoding="utf-8") as f:
        for row in arith_rows(n, seed, **row_args):
            f.write(json.dumps(row) + "\n")
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """`python -m rollout_fns.arith_data OUT.jsonl --n 1000 --seed 0 --high 20 --operators +-`"""
    import argparse

    parser = argparse.ArgumentParser(description="Write a text arithmetic data set as JSON lines.")
    parser.add_argument("path", help="output .jsonl file")
    parser.add_argument("--n", type=int, default=1000, help="number of rows")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same rows")
    parser.add_argument("--low", type=int, default=0, help="smallest operand")
    parser.add_argument("--high", type=int, default=20, help="largest operand")
    parser.add_argument("--operators", default="+-", help="operators to draw from, out of +-*")
    args = parser.parse_args(argv)
    write_arith_jsonl(args.path, args.n, args.seed, low=args.low, high=args.high, operators=args.operators)


if __name__ == "__main__":
    main()
