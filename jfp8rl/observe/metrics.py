"""Metrics sinks: `metrics.jsonl` (always), TensorBoard (optional) and one console line per step.

`metrics.jsonl` holds one JSON object per step, `{"step": k, "<name>": value, ...}` with the
names of docs/design.md section 8 (verl / TRL compatible). Values are plain floats; a non-finite
value is written as null in JSON (and skipped in TensorBoard) so every line stays valid JSON.

On resume from step k the file is cut back to steps <= k before appending, so it always
describes one consistent run. The console line shows the step, the headline metrics, the rate
(s/step, EMA over steps) and the ETA.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "acc"),
    ("eval/accuracy", "eval_acc"),
    ("actor/entropy", "ent"),
    ("reward/unparsed_frac", "garbled"),
    ("response_length/mean", "len"),
    ("actor/pg_clipfrac", "clip"),
    ("calib/lower", "L"),
    ("calib/upper", "H"),
    ("rollout_corr/kl", "mkl"),
)


def _finite_or_none(v: Any) -> float | None:
    f = float(v)
    return f if math.isfinite(f) else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a `metrics.jsonl` file (a run folder or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: is this a jfp8rl run folder?")
    with p.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class MetricsLogger:
    """Writes each step's metrics to every sink; `close()` flushes TensorBoard."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        console: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.console = console
        self.stream = stream or sys.stdout
        self._truncate_after(start_step)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional sink; imported only when used

            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1)
        self._last_time: float | None = None
        self._rate: float | None = None  # seconds per step, EMA

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` for `step` (1-based) in every sink."""
        record = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
        now = time.perf_counter()
        if self._last_time is not None:
            dt = now - self._last_time
            self._rate = dt if self._rate is None else 0.7 * self._rate + 0.3 * dt
        self._last_time = now
        if self.console:
            self.stream.write(self.format_line(step, record) + "\n")
            self.stream.flush()

    def format_line(self, step: int, record: Mapping[str, Any]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        for key, short in CONSOLE_KEYS:
            v = record.get(key)
            if v is not None:
                parts.append(f"{short} {v:.3g}")
        if self._rate is not None:
            eta = self._rate * (self.total_steps - step)
            parts.append(f"{self._rate:.2f} s/step ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def message(self, text: str) -> None:
        """A free-form console line (start, eval, checkpoint, errors)."""
        if self.console:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
