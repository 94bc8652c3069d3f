"""A config without an eval file evaluates on a held-out share of the training file, never on
examples it trains on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jfp8rl.data.records import DataError, Example
from jfp8rl.data.stream import build_datasets, hold_out


def test_hold_out_share_is_disjoint_seeded_and_capped() -> None:
    examples = [Example(f"p{i}", str(i)) for i in range(101)]
    train, evals = hold_out(examples, eval_size=256, share=0.05, seed=0)
    assert len(evals) == math.ceil(0.05 * 101) == 6 and len(train) == 95
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in evals)
    assert sorted(e.prompt for e in train + evals) == sorted(e.prompt for e in examples)
    # Training keeps the file's order; the draw depends on the seed only.
    assert [e.prompt for e in train] == [e.prompt for e in examples if e not in evals]
    assert hold_out(examples, 256, 0.05, 0)[1] == evals
    assert hold_out(examples, 256, 0.05, 1)[1] != evals
    assert len(hold_out(examples, 4, 0.5, 0)[1]) == 4  # at most eval_size
    with pytest.raises(DataError, match="cannot spare 1 for eval; give data.eval_file"):
        hold_out(examples[:1], 256, 0.05, 0)


def test_file_task_without_eval_file_holds_out(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(40))
    )
    train, evals = build_datasets("file", str(f), "", 2, 256, eval_share=0.1, seed=0)
    assert (len(train), len(evals)) == (36, 4)
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in evals)
    # With an eval file: its first eval_size examples, the training file whole.
    train, evals = build_datasets("file", str(f), str(f), 2, 5)
    assert (len(train), [e.prompt for e in evals]) == (40, [f"q{i}" for i in range(5)])
