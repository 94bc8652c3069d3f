"""`python -m jfp8rl.plan` on the tiny config over 4 forced host devices: the final line's format
and numbers that agree with an independent count of the state (heavy plans stay out of CI;
their numbers are in docs/plan_results.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_run import TINY

from models import functional as mf
from models.config import PRESETS

REPO = Path(__file__).resolve().parents[3]
LINE = re.compile(
    r"^plan: (\S+) mesh data=(\d+) fsdp=(\d+) tensor=(\d+) micro_batch=(\d+) tokens=(\d+): "
    r"per-device peak (\d+\.\d) GiB \(state (\d+\.\d) GiB\), compiled in (\d+) s$"
)


def _plan_lines(*overrides: str) -> list[str]:
    """The printed lines of `python -m jfp8rl.plan` on the tiny config over 4 forced devices
    (fsdp 2 x tensor 2, 16 prompts, 2 mini-batches) with `overrides`; it must exit 0."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # XLA_FLAGS: the suite's (jfp8rl.plan appends)
    base = [
        "train.mesh.fsdp=2",
        "train.mesh.tensor=2",
        "data.batch_size=16",
        "train.mini_batches=2",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "jfp8rl.plan", "--config", str(TINY), "--devices", "4", *base,
         *overrides],
        capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


@pytest.mark.slow
def test_plan_prints_the_final_line_with_consistent_numbers() -> None:
    lines = _plan_lines("train.micro_batch_size=32")
    assert sum(line.startswith("plan: ") for line in lines) == 1
    m = LINE.match(lines[-1])
    assert m, lines[-1]
    preset, data, fsdp, tensor, micro, tokens, peak, state, secs = m.groups()
    assert (preset, data, fsdp, tensor, micro, tokens) == ("tiny_arith", "1", "2", "2", "32", "14")
    # The detailed state line against an independent count: f32 params + Adam mu, nu = 12 B
    # per param, at most one full copy and at least 1 / 4 of one per device.
    n_params = sum(
        int(np.prod(x.shape)) for x in _leaves(mf.abstract_model(PRESETS["tiny_arith"])[1])
    )
    st = next(line for line in lines if line.startswith("state per device:"))
    total = _mib(re.search(r"total ([\d.]+ [MG]iB)", st).group(1))
    assert 12 * n_params / 4 <= total * 2**20 * 1.0001 and total * 2**20 <= 12 * n_params * 1.0001
    # Each program's peak is its arguments + outputs + temporaries - aliased, and the update
    # donates its state (aliased > 0).
    progs = [line for line in lines if "per device: arguments" in line]
    assert len(progs) == 2
    for line in progs:
        a, o, t, al, p = (_mib(x) for x in re.findall(r"([\d.]+ [MG]iB)", line))
        assert abs(a + o + t - al - p) < 0.02, line
    assert _mib(re.findall(r"aliased ([\d.]+ [MG]iB)", progs[1])[0]) > 0
    assert float(peak) >= float(state) and int(secs) >= 0


@pytest.mark.slow
def test_plan_of_token_budget_micro_batches() -> None:
    """`train.max_tokens_per_micro_batch` plans each length bucket's micro-batch program with
    the arguments the trainer passes it (the token-budget update's `micro`)."""
    lines = _plan_lines("train.max_tokens_per_micro_batch=64")
    assert any(line.lstrip().startswith("micro L=") for line in lines), lines
    assert lines[-1].startswith("plan: tiny_arith mesh data=1 fsdp=2 tensor=2 micro_tokens=64 ")


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _mib(text: str) -> float:
    value, unit = text.split()
    return float(value) * (1024 if unit == "GiB" else 1)
