"""Rollout dumps (rounding, fields) and the eval metrics, against hand-written expectations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jfp8rl.data.templates import PromptFormat
from jfp8rl.observe.rollout_dump import dump_groups
from jfp8rl.trainer.evaluation import EvalResult
from models.tokenizer import build_byte_tokenizer, save_tokenizer

REPO = Path(__file__).resolve().parents[3]
DEEPSCALER = "{prompt} Let's think step by step and output the final answer within \\boxed{{}}."


def test_dump_rounding_and_eval_metrics() -> None:
    # k samples -> ceil(k / n) whole groups, capped at the batch's groups.
    assert [dump_groups(k, 4, 3) for k in (1, 4, 5, 8, 100)] == [1, 1, 2, 2, 3]
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    lengths = np.array([[3, 4, 5, 6], [1, 1, 1, 1], [2, 2, 2, 2]], np.int32)
    m = EvalResult(correct, lengths, np.zeros((3, 4), bool), 1.0).metrics()
    assert m["avg@4"] == m["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["response_length/mean"] == pytest.approx(30 / 12)
    assert m["reward/unparsed_frac"] == 0.0 and m["problems"] == 3


def test_rollout_dump_fields(tmp_path: Path) -> None:
    from jfp8rl.data.batch import pack
    from jfp8rl.observe.rollout_dump import write_rollouts
    from rollout_bridge.backend import Completion

    tok = build_byte_tokenizer()
    save_tokenizer(tok, tmp_path)
    fmt = PromptFormat(tmp_path, tok)

    def comp(i: int, resp: bytes, eos: bool) -> Completion:
        ids = [*resp, 256] if eos else list(resp)
        return Completion(
            prompt_index=i, prompt_ids=tuple(b"1+2="), response_ids=np.array(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            finish_reason="stop" if eos else "length", weight_version="step-4",
        )  # fmt: skip

    comps = [comp(0, b"3", True), comp(0, b"4", True), comp(1, b"77", False), comp(1, b"7", True)]
    rewards = np.array([1.0, 0.0, 0.0, 0.0])
    keep = np.array([True, True, False, False])  # group 1: a dynamic-sampling filler
    batch = pack(
        comps, rewards, rewards, keep, max_prompt_tokens=4, max_tokens=3, pad_id=256,
        texts=["3", "4", "77", "7"], answers=["3"] * 4, unparsed=np.zeros(4, bool),
    )  # fmt: skip
    adv = np.array([[0.7, 0.7, 0], [-0.7, -0.7, 0], [0, 0, 0], [0, 0, 0]], np.float32)
    path = write_rollouts(tmp_path / "run", 5, batch, adv, fmt, samples=3, n=2)
    assert path == tmp_path / "run" / "rollouts" / "step_5.jsonl"
    rows = [json.loads(x) for x in path.open()]
    assert len(rows) == 4  # 3 samples -> 2 whole groups of 2
    assert rows[0] == {
        "step": 5, "group": 0, "sample": 0, "prompt_ids": list(b"1+2="), "prompt_text": "1+2=",
        "response_ids": [ord("3"), 256], "response_text": "3", "answer": "3", "reward": 1.0,
        "correct": 1.0, "advantage": pytest.approx(0.7), "in_loss": True, "unparsed": False,
        "finish_reason": "stop", "weight_version": "step-4",
    }  # fmt: skip
    assert rows[2]["finish_reason"] == "length" and rows[2]["response_ids"] == list(b"77")
    assert [r["in_loss"] for r in rows] == [True, True, False, False]
    assert [r["advantage"] for r in rows[2:]] == [0.0, 0.0]
