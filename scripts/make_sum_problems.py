"""Writes the sum problems of configs/smollm2_135m_math.yaml: flat {prompt, answer} JSONL.

`python scripts/make_sum_problems.py [OUT_DIR]` (default configs/data) writes
`sums_train.jsonl` and `sums_eval.jsonl`: "What is a + b?" with a, b drawn (seed 0) from
1..max, each pair once, the eval pairs never among the training pairs.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

MAX_OPERAND = 50
N_TRAIN, N_EVAL = 1024, 128


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(1, MAX_OPERAND + 1) for b in range(1, MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    return rows[N_EVAL : N_EVAL + N_TRAIN], rows[:N_EVAL]


def main(out_dir: str = "configs/data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, evals = problems()
    for name, rows in (("sums_train.jsonl", train), ("sums_eval.jsonl", evals)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(out / name, len(rows))


if __name__ == "__main__":
    main(*sys.argv[1:2])
