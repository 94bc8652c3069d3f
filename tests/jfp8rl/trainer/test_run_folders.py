"""Run folders that say what they do: a complete run is left as it is, a changed config stops a
resume before anything is loaded (exit 2, every differing key named), `train.steps` extends a
run exactly as an uninterrupted one, `--fresh` starts over and keeps the previous run.

The uninterrupted reference is the session's tiny run (`tiny_full_run`, tests/jfp8rl/conftest.py:
the same config run for 4 steps): its first two steps and its checkpoint 2 are what a run of 2
steps from the start gives (nothing in a step depends on `train.steps` or `checkpoint.every`),
so no second run is trained here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_run import TINY, small

from jfp8rl.export import main as export_main
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main
from jfp8rl.trainer.checkpoint import checkpoints_dir, steps_on_disk
from models.hf_io import read_safetensors

TIMING_PREFIXES = ("timing/", "throughput/", "perf/", "memory/")


def _argv(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    # A checkpoint every step: a 1-step run extends to 2 (step 2 calibrates and evaluates).
    return ["--config", str(TINY), *small(run_dir, cache_dir, "checkpoint.every=1", *extra)]


def _snapshot(run_dir: Path) -> dict[str, float]:
    """Every file of the run folder with its modification time."""
    return {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def test_complete_changed_extended_and_fresh(
    tmp_path: Path, cache_dir: Path, tiny_full_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    assert main(_argv(run_dir, cache_dir, "train.steps=1")) == 0
    capsys.readouterr()
    # The run folder's config.yaml is what --print-config prints for the same command.
    assert main([*_argv(run_dir, cache_dir, "train.steps=1"), "--print-config"]) == 0
    assert capsys.readouterr().out == (run_dir / "config.yaml").read_text()

    # The same command again: complete, nothing rewritten.
    before = _snapshot(run_dir)
    assert main(_argv(run_dir, cache_dir, "train.steps=1")) == 0
    out = capsys.readouterr().out
    assert out == (
        f"{run_dir} is complete (step 1 of 1); to train it further, rerun with "
        "train.steps=<more than 1>, or use another run_dir (or --fresh) for a new run\n"
    )
    assert _snapshot(run_dir) == before

    # Another algorithm and learning rate: refused before anything is loaded, every key named.
    assert main(_argv(run_dir, cache_dir, "train.steps=1", "optim.lr=3e-4", "algorithm.name=grpo")) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err == (
        f"error: {run_dir} holds a run trained to step 1 with another config (algorithm.name: "
        "'dapo' -> 'grpo', algorithm.eps_high: 0.28 -> 0.2, algorithm.loss_agg_mode: "
        "'token-mean' -> 'seq-mean-token-mean', algorithm.kl_coef: 0.0 -> 0.001, optim.lr: "
        f"0.0005 -> 0.0003). Train this config in another folder (run_dir={run_dir}-1), or "
        f"start over here with --fresh (the previous run is moved to {run_dir}.replaced-1); to "
        f"resume the run as it was: python -m jfp8rl.train --config {run_dir}/config.yaml\n"
    )
    assert _snapshot(run_dir) == before

    # train.steps=2 extends it; it equals a run of 2 steps from the start: the first two steps
    # of the session's uninterrupted run, and its checkpoint 2 exported as an HF folder.
    assert main(_argv(run_dir, cache_dir, "train.steps=2")) == 0
    assert f"resuming {run_dir} from step 1 of 2\n" in capsys.readouterr().out
    extended, uninterrupted = read_metrics(run_dir), read_metrics(tiny_full_run)[:3]
    assert [r["step"] for r in extended] == [r["step"] for r in uninterrupted] == [0, 1, 2]
    for a, b in zip(extended, uninterrupted, strict=True):
        for key, value in b.items():
            if not key.startswith(TIMING_PREFIXES):
                assert a[key] == value, (b["step"], key, a[key], value)
    assert export_main([str(tiny_full_run), "--step", "2", "--out", str(whole)]) == 0
    pa = read_safetensors(run_dir / "hf_final" / "model.safetensors")
    pb = read_safetensors(whole / "model.safetensors")
    assert pa.keys() == pb.keys()
    for name in pb:
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)

    # --fresh with another config: the previous run is moved aside whole, a new one starts.
    capsys.readouterr()
    argv = _argv(run_dir, cache_dir, "train.steps=1", "optim.lr=3e-4")
    assert main(["--fresh", *argv]) == 0
    moved = tmp_path / "run.replaced-1"
    assert f"--fresh: moved the previous run in {run_dir} to {moved}\n" in capsys.readouterr().err
    assert steps_on_disk(checkpoints_dir(moved)) == [1, 2]
    assert [r["step"] for r in read_metrics(moved)] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert (run_dir / "config.yaml").read_text().count("lr: 0.0003") == 1
