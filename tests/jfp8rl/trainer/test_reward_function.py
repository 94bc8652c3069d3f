"""The user's reward (`reward.kind: function`): a reward file in verl's signature scores the
run (the dumped rewards recomputed here from the dumped texts, overlong shaping included), a
reward that raises stops the step before its update with the last checkpoint intact, and a
missing file or function stops the run at start-up naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny_run import TINY, small

from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main
from jfp8rl.trainer.checkpoint import checkpoints_dir, newest_intact

# verl's custom reward signature, with a dict result: `score` plus a metric.
VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    exact = float(solution_str.strip() == ground_truth)
    weight = {"sums/a": 1.0, "sums/b": 0.5}[data_source]
    return {"score": weight * exact + 0.01 * extra_info["index"], "exact": exact}
"""

FAILING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError(f"cannot read {solution_str!r}")
"""


def _records(path: Path) -> dict[str, dict]:
    """64 distinct sums in verl's layout, with data_source and extra_info; by prompt."""
    records = {}
    for i in range(64):
        a, b = (7 * i) % 100, (13 * i + 5) % 100
        prompt = f"{a:02d}+{b:02d}="
        records[prompt] = {
            "prompt": prompt,
            "reward_model": {"ground_truth": str(a + b)},
            "data_source": "sums/a" if i % 2 else "sums/b",
            "extra_info": {"index": i},
        }
    path.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    return records


def _expected(record: dict, text: str, length: int) -> tuple[float, float]:
    """(score, reward) of one sample, recomputed: the score as VERL_REWARD defines it, then
    DAPO's overlong shaping with max_tokens 6 and buffer 2 (0 up to 4 tokens, then -1/2 each)."""
    exact = float(text.strip() == record["reward_model"]["ground_truth"])
    weight = 1.0 if record["data_source"] == "sums/a" else 0.5
    score = weight * exact + 0.01 * record["extra_info"]["index"]
    return score, score + (0.0 if length <= 4 else (4 - length) / 2)


def test_verl_reward_file_scores_the_run_and_a_failing_one_stops_it(
    tmp_path: Path, cache_dir: Path, base_policy_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, data, reward = tmp_path / "run", tmp_path / "sums.jsonl", tmp_path / "my_reward.py"
    records = _records(data)
    reward.write_text(VERL_REWARD)
    argv = ["--config", str(TINY), *small(
        run_dir, cache_dir, f"model.path={base_policy_dir}", "data.task=file",
        f"data.train_file={data}", "reward.kind=function", f"reward.path={reward}",
        "reward.overlong=true", "reward.overlong_buffer=2", "logging.rollout_samples=16",
        "train.steps=2",
    )]  # fmt: skip
    assert main(argv) == 0
    checked = 0
    for step in (1, 2):
        lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
        assert len(lines) == 16
        for line in lines:
            s = json.loads(line)
            record = records[s["prompt_text"]]
            assert s["answer"] == record["reward_model"]["ground_truth"]
            score, want = _expected(record, s["response_text"], len(s["response_ids"]))
            assert s["correct"] == pytest.approx(score, abs=1e-6), s
            assert s["reward"] == pytest.approx(want, abs=1e-6), s
            checked += 1
    assert checked == 32
    logged = read_metrics(run_dir)[1:]
    assert all(0 <= r["reward/exact"] <= 1 for r in logged)

    # A reward that raises: step 3 stops before its update, checkpoint 2 stays the newest.
    reward.write_text(FAILING_REWARD)
    capsys.readouterr()
    assert main([*argv, "train.steps=4"]) == 1
    err = capsys.readouterr().err
    pattern = (
        rf"error: the reward failed at step 3, before its update: reward function "
        rf"{re.escape(str(reward))}:compute_score on sample 0 \(ground_truth '\d+'\) raised "
        r"ValueError: cannot read '.*'\nLast checkpoint: "
        rf"{re.escape(str(checkpoints_dir(run_dir)))}/2 \(step 2\)\. Fix the reward function, "
        rf"then resume: python -m jfp8rl\.train --config {re.escape(str(run_dir))}/config\.yaml "
        r"--resume\n"
    )
    assert re.fullmatch(pattern, err), err
    assert newest_intact(checkpoints_dir(run_dir), "full") == (2, [])
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_missing_reward_file_or_function_fails_at_start(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, reward = tmp_path / "run", tmp_path / "my_reward.py"
    reward.write_text(VERL_REWARD)
    base = ["--config", str(TINY), *small(run_dir, cache_dir, "reward.kind=function")]
    assert main([*base, f"reward.path={tmp_path / 'nope.py'}"]) == 2
    assert capsys.readouterr().err == (
        f"error: reward.path='{tmp_path / 'nope.py'}': no such file; reward.kind=function needs "
        "the Python file that defines the reward function (verl's custom_reward_function.path)\n"
    )
    assert main([*base, f"reward.path={reward}", "reward.name=score"]) == 2
    assert capsys.readouterr().err == (
        f"error: reward.name='score': {reward} defines no function of that name (its "
        "functions: compute_score)\n"
    )
    assert not run_dir.exists()  # nothing was started
