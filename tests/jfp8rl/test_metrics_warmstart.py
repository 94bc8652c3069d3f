"""Metrics sinks (JSONL truncation on resume, non-finite values) and warm-start label helpers."""

from __future__ import annotations

import io
import json
from pathlib import Path

from jfp8rl.data import arithmetic_prompt
from jfp8rl.metrics import MetricsLogger, read_metrics
from jfp8rl.warmstart import carryless_sum, with_carry_habit


def test_jsonl_nonfinite_as_null_and_console_line(tmp_path: Path) -> None:
    out = io.StringIO()
    m = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, stream=out)
    m.log(1, {"reward/mean": 0.5, "actor/pg_loss": float("nan")})
    m.log(2, {"reward/mean": 0.75, "eval/accuracy": 0.25})
    m.close()
    recs = read_metrics(tmp_path)
    assert recs == [
        {"step": 1, "actor/pg_loss": None, "reward/mean": 0.5},
        {"step": 2, "eval/accuracy": 0.25, "reward/mean": 0.75},
    ]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/3 | reward 0.5")
    assert "eval_acc 0.25" in lines[1] and "ETA" in lines[1]
    # Every line is valid JSON (NaN would not be).
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def test_resume_truncates_later_steps(tmp_path: Path) -> None:
    m = MetricsLogger(tmp_path, total_steps=5, tensorboard=True, console=False)
    for k in range(1, 5):
        m.log(k, {"reward/mean": float(k)})
    m.close()
    # Resumed from checkpoint 2: steps 3 and 4 will be redone, so they are dropped.
    m = MetricsLogger(tmp_path, total_steps=5, start_step=2, tensorboard=True, console=False)
    m.log(3, {"reward/mean": 30.0})
    m.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]


def test_carryless_sum_by_hand() -> None:
    assert carryless_sum(58, 67) == 15  # 8+7=15 -> 5, 5+6=11 -> 1
    assert carryless_sum(45, 32) == 77  # no carry: the true sum
    assert carryless_sum(99, 1) == 90
    assert carryless_sum(5, 5) == 0
    ex = with_carry_habit([arithmetic_prompt(58, 67, 2), arithmetic_prompt(12, 30, 2)])
    assert [(e.prompt, e.answer) for e in ex] == [("58+67=", "15"), ("12+30=", "42")]


def test_warm_start_stops_at_the_first_check_reaching_the_target() -> None:
    """The rule: stop at the first multiple of check_every whose train-check accuracy reaches
    the target. Reference: the same (deterministic) run without a target, measured at every
    check point by hand."""
    import jax.numpy as jnp

    from jfp8rl.data import build_datasets
    from jfp8rl.warmstart import (
        _check_split,
        greedy_correct,
        model_config,
        supervised_arrays,
        warm_start,
    )
    from models.fp8 import get_recipe
    from models.tokenizer import build_byte_tokenizer, eos_token_id

    train, evals = build_datasets("arithmetic", "", "", 1, 16)
    cfg = model_config("tiny_arith")
    kw = dict(batch_size=32, lr=3e-3, seed=0, prompt_len=8, answer_len=6, log=None)
    tok = build_byte_tokenizer()
    check = [
        jnp.asarray(a)
        for a in supervised_arrays(_check_split(train, 256, 0), tok, eos_token_id(tok), 8, 6)
    ]
    curve = []
    for steps in (10, 20, 30):
        graphdef, params, _ = warm_start(cfg, train, evals, steps=steps, **kw)
        curve.append(
            float(jnp.mean(greedy_correct(graphdef, params, *check, recipe=get_recipe("bf16"))))
        )
    target = max(curve[1:])  # reached first at a later check, not at the first
    first = curve.index(target)
    assert first > 0 and target > 0, curve
    _, _, stats = warm_start(
        cfg, train, evals, steps=30, target_accuracy=target, check_every=10, **kw
    )
    assert stats["steps_run"] == 10 * (first + 1)
    assert stats["train_check_accuracy"] == curve[first]


def test_supervised_arrays_train_on_the_scratchpad() -> None:
    """The scratchpad task's warm-start target is the worked steps then the answer, + eos."""
    from jfp8rl.data import scratchpad_prompt
    from jfp8rl.warmstart import supervised_arrays
    from models.tokenizer import build_byte_tokenizer, eos_token_id

    tok = build_byte_tokenizer()
    eos = eos_token_id(tok)
    ex = scratchpad_prompt(123, 459, 3)
    tokens, attn, target = supervised_arrays([ex], tok, eos, 8, 40)
    want = list(b"123+459=3+9+0=12;2+5+1=08;1+4+0=05;#0582") + [eos]
    assert tokens[0, : len(want)].tolist() == want
    assert attn[0].sum() == len(want)
    assert target[0].tolist() == [0.0] * 8 + [1.0] * 33 + [0.0] * (48 - 41)
