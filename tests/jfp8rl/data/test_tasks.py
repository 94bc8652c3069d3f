"""The built-in tasks (disjoint splits, the scratchpad by hand) and the resumable prompt stream."""

from __future__ import annotations

from pathlib import Path

from jfp8rl.data.rewards import (
    scratchpad_verifier,
)
from jfp8rl.data.stream import PromptStream
from jfp8rl.data.tasks import arithmetic_split

REPO = Path(__file__).resolve().parents[3]


def test_arithmetic_split_disjoint_and_correct() -> None:
    train, evals = arithmetic_split(max_digits=2, eval_size=100)
    assert len(train) + len(evals) == 100 * 100
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    for e in evals[:20]:
        a, b = e.prompt[:-1].split("+")
        assert int(e.answer) == int(a) + int(b)


def test_scratchpad_task_by_hand() -> None:
    from jfp8rl.data.stream import build_datasets
    from jfp8rl.data.tasks import SCRATCHPAD_TRAIN_SIZE, scratchpad_text
    from models.tokenizer import build_byte_tokenizer

    # 3 + 9 = 12 (carry 1), 2 + 5 + 1 = 8, 1 + 4 = 5: 582.
    assert scratchpad_text(123, 459, 3) == "3+9+0=12;2+5+1=08;1+4+0=05;#0582"
    assert scratchpad_text(999, 999, 3) == "9+9+0=18;9+9+1=19;9+9+1=19;#1998"
    train, evals = build_datasets("scratchpad", "", "", 3, 64)
    assert len(train) == SCRATCHPAD_TRAIN_SIZE and len(evals) == 64
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    tok = build_byte_tokenizer()
    for e in train[:50] + evals[:10]:
        a, b = (int(x) for x in e.prompt[:-1].split("+"))
        assert e.answer == str(a + b)
        assert e.meta["target"] == scratchpad_text(a, b, 3)
        assert len(tok.encode(e.meta["target"], add_special_tokens=False).ids) >= 32
        assert scratchpad_verifier(e.meta["target"], e.answer) == 1.0
    # The same draw of eval problems as the arithmetic task's split of the same digits.
    assert [e.prompt for e in evals] == [e.prompt for e in arithmetic_split(3, 64)[1]]


def test_prompt_stream_resumes_and_covers_epochs() -> None:
    train, _ = arithmetic_split(max_digits=1, eval_size=10)  # 90 examples
    s = PromptStream(train, seed=3)
    first, pos = s.take(0, 50)
    second, pos2 = s.take(pos, 80)
    assert pos2 == 130
    # A fresh stream at the saved position continues identically (resume).
    again, _ = PromptStream(train, seed=3).take(50, 80)
    assert [e.prompt for e in again] == [e.prompt for e in second]
    # The first epoch is a permutation: every example exactly once.
    epoch0 = first + second[:40]
    assert sorted(e.prompt for e in epoch0) == sorted(e.prompt for e in train)
