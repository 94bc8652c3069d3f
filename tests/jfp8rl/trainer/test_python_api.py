"""docs/python_api.md: its first code block, run verbatim from a fresh folder holding the
repository's configs, trains the tiny policy and gives back the metrics and the final policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from tiny_run import REPO


def first_python_block(page: Path) -> str:
    return page.read_text().split("```python\n", 1)[1].split("```", 1)[0]


def test_python_api_page_example(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".base_policies").symlink_to(cache_dir)  # the session's base policy
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        (tmp_path / "runs" / ".jax_cache").symlink_to(os.environ["JAX_COMPILATION_CACHE_DIR"])
    monkeypatch.chdir(tmp_path)
    code = first_python_block(REPO / "docs" / "python_api.md")
    ns: dict = {"__name__": "__main__"}
    exec(compile(code, "docs/python_api.md", "exec"), ns)
    result = ns["result"]
    run_dir = Path("runs/python_api_demo")
    assert result.run_dir == run_dir
    assert [r["step"] for r in result.metrics] == [0, 1, 2, 3, 4]
    for r in result.metrics[1:]:
        # The score is 0 or 1 and there is no overlong shaping: reward = correctness.
        assert r["reward/mean"] == r["reward/accuracy"]
        assert 0 <= r["reward/digits_right"] <= 1
    # Held out: min(data.eval_size 16, ceil(5 % of 400) = 20) = 16 eval problems.
    for r in result.metrics:
        if "eval/accuracy" in r:
            assert (r["eval/accuracy"] * 16) % 1 == 0
    assert [r["step"] for r in result.metrics if "eval/accuracy" in r] == [0, 2, 4]
    assert result.policy_dir == run_dir / "hf_final"
    assert (result.policy_dir / "config.json").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["data"]["task"], saved["reward"]["kind"], saved["reward"]["name"]) == (
        "python", "function", "compute_score",
    )  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "final policy: runs/python_api_demo/hf_final"
    assert printed[-6] == "0 None None"
    # The same script again: the run is complete and left as it is.
    exec(compile(code, "docs/python_api.md", "exec"), ns)
    again = ns["result"]
    assert again.summary["complete"] and again.metrics == result.metrics
    assert capsys.readouterr().out.splitlines()[0] == (
        "runs/python_api_demo is complete (step 4 of 4); to train it further, rerun with "
        "train.steps=<more than 4>, or use another run_dir (or --fresh) for a new run"
    )
