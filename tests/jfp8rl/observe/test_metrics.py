"""Metrics sinks: JSONL truncation on resume, non-finite values as null, the console line."""

from __future__ import annotations

import io
import json
from pathlib import Path

from jfp8rl.observe.metrics import MetricsLogger, read_metrics


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
