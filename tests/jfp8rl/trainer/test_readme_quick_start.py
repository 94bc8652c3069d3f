"""The README's Quick-start commands, run as written one after another in a fresh folder
(shortened by overrides appended to each): each trains what it says, and the first one run
again finds its run complete."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import yaml
from tiny_run import REPO

from jfp8rl import report, train
from jfp8rl.observe.metrics import read_metrics

# Appended to every training command: the tiny run for one step (calibrating, evaluated), with the test session's
# warm start (the same base policy as tests/jfp8rl/tiny_run.small, so its cache is shared).
SHORT = [
    "warmstart.steps=120", "warmstart.target_accuracy=0", "data.batch_size=4",
    "data.eval_size=16", "rollout.n=4", "train.steps=1", "train.mini_batches=2",
    "train.eval_every=1", "calibration.every=1", "checkpoint.every=1", "logging.console=none",
]  # fmt: skip


def quick_start_commands() -> list[list[str]]:
    """The commands of the README's Quick-start block, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def run_command(argv: list[str]) -> int:
    """One README command in this process: `.venv/bin/python -m jfp8rl.<command> ...`."""
    assert argv[:3] in ([".venv/bin/python", "-m", "jfp8rl.train"], [".venv/bin/python", "-m", "jfp8rl.report"]), argv  # fmt: skip
    if argv[2] == "jfp8rl.train":
        return train.main([*argv[3:], *SHORT])
    return report.main(argv[3:])


def test_quick_start_commands_in_order(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".base_policies").symlink_to(cache_dir)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        (tmp_path / "runs" / ".jax_cache").symlink_to(os.environ["JAX_COMPILATION_CACHE_DIR"])
    monkeypatch.chdir(tmp_path)
    commands = quick_start_commands()
    assert len(commands) == 4
    for argv in commands:
        assert run_command(argv) == 0, argv
    runs = tmp_path / "runs"

    def saved(name: str) -> dict:
        return yaml.safe_load((runs / name / "config.yaml").read_text())

    # The default: DAPO, FP8 block training and rollout, Calibrated Clipping, no KL term.
    default = saved("tiny_cpu")
    assert (default["algorithm"]["name"], default["algorithm"]["clip"]) == ("dapo", "calibrated")
    assert (default["train"]["recipe"], default["rollout"]["recipe"]) == ("fp8_block", "fp8_block")
    records = read_metrics(runs / "tiny_cpu")
    assert [r["step"] for r in records] == [0, 1]
    assert not any("actor/kl_loss" in r for r in records)
    assert all("calib/alpha" in r for r in records[1:])

    # GRPO at lr 3e-4: GRPO's own bounds, aggregation and KL term, in the loss it logs.
    grpo = saved("tiny_grpo")
    assert grpo["optim"]["lr"] == 3e-4
    a = grpo["algorithm"]
    assert (a["name"], a["eps_low"], a["eps_high"], a["kl_coef"], a["loss_agg_mode"]) == (
        "grpo", 0.2, 0.2, 0.001, "seq-mean-token-mean",
    )  # fmt: skip
    for r in read_metrics(runs / "tiny_grpo")[1:]:
        assert r["actor/kl_coef"] == pytest.approx(0.001)
        assert r["actor/kl_loss"] > 0
        # total = policy-gradient loss + kl_coef * KL (no entropy term), per update and so
        # in their means over the step's updates.
        want = r["actor/pg_loss"] + 0.001 * r["actor/kl_loss"]
        assert r["actor/loss"] == pytest.approx(want, rel=1e-4, abs=1e-7)

    # BF16 training and rollout with plain clipping: DAPO's fixed bounds, no calibration.
    bf16 = saved("tiny_bf16")
    assert (bf16["train"]["recipe"], bf16["rollout"]["recipe"]) == ("bf16", "bf16")
    assert bf16["algorithm"]["clip"] == "plain"
    for r in read_metrics(runs / "tiny_bf16")[1:]:
        assert (r["calib/lower"], r["calib/upper"]) == pytest.approx((0.8, 1.28))
        assert "calib/alpha" not in r

    # The report overlays the three runs in one PNG.
    assert capsys.readouterr().out.splitlines()[-1] == "runs/tiny_cpu/report.png"
    assert (runs / "tiny_cpu" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The default again: complete, and it says how to go on.
    assert run_command(commands[0]) == 0
    assert capsys.readouterr().out == (
        "runs/tiny_cpu is complete (step 1 of 1); to train it further, rerun with "
        "train.steps=<more than 1>, or use another run_dir (or --fresh) for a new run\n"
    )
