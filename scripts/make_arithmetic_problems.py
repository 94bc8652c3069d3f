"""Writes the arithmetic problems of the real-model configs: flat {prompt, answer} JSONL.

`python scripts/make_arithmetic_problems.py [OUT_DIR]` (default configs/data) writes two sets,
each pair of operands once (shuffled with seed 0), the eval problems never among the training
ones:

- `sums_train.jsonl` (1024) / `sums_eval.jsonl` (128): "What is a + b?", a, b in 1..50
  (configs/smollm2_135m_math.yaml);
- `products_train.jsonl` (495) / `products_eval.jsonl` (128): "What is a * b?", a in 11..99,
  b in 3..9 (configs/qwen25_coder_05b_math.yaml): a two-digit number times a digit, which
  Qwen2.5-Coder-0.5B-Instruct answers right in one short line about a third of the time
  greedily, and otherwise starts a long explanation that the response budget cuts off.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

N_EVAL = 128


def _split(rows: list[dict], n_train: int, seed: int) -> tuple[list[dict], list[dict]]:
    random.Random(seed).shuffle(rows)
    return rows[N_EVAL : N_EVAL + n_train], rows[:N_EVAL]


def sums(seed: int = 0) -> tuple[list[dict], list[dict]]:
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(1, 51)
        for b in range(1, 51)
    ]
    return _split(rows, 1024, seed)


def products(seed: int = 0) -> tuple[list[dict], list[dict]]:
    rows = [
        {"prompt": f"What is {a} * {b}?", "answer": str(a * b)}
        for a in range(11, 100)
        for b in range(3, 10)
    ]
    return _split(rows, len(rows) - N_EVAL, seed)


def main(out_dir: str = "configs/data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind, make in (("sums", sums), ("products", products)):
        train, evals = make()
        for name, rows in ((f"{kind}_train.jsonl", train), (f"{kind}_eval.jsonl", evals)):
            (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(out / name, len(rows))


if __name__ == "__main__":
    main(*sys.argv[1:2])
