"""Config loading/errors, JSONL data and the prompt stream, verifiers and overlong shaping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jfp8rl.config import Config, ConfigError, load_config, save_config
from jfp8rl.data import DataError, PromptStream, arithmetic_split, load_examples
from jfp8rl.rewards import (
    exact_match,
    math_verify_reward,
    overlong_penalty,
    score_responses,
    scratchpad_parsed,
    scratchpad_verifier,
    task_verifier,
)

REPO = Path(__file__).resolve().parents[2]


def test_yaml_and_overrides_merge(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  lr: 1e-3\nalgorithm:\n  name: dapo\n")
    cfg = load_config(y, ["optim.lr=3e-4", "rollout.n=4"])
    assert cfg.optim.lr == 3e-4
    assert cfg.algorithm.name == "dapo"
    assert cfg.rollout.n == 4
    assert load_config(y, ["train.jax_cache_dir="]).train.jax_cache_dir == ""
    # The saved resolved config loads back into an equal Config.
    saved = save_config(cfg, tmp_path / "run")
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optim.lrr=1"], "optim.lrr"),
        (["optim.lr=abc"], "optim.lr"),
        (["algorithm.name=ppo2"], "algorithm.name"),
        (["train.mini_batches=7"], "train.mini_batches"),
        (["calibration.range_lo=1.5"], "calibration.range_lo"),
        (["nonsense"], "nonsense"),
        (["rollout.export_hash=md5"], "rollout.export_hash"),
        (["algorithm.name=gspo", "algorithm.clip=calibrated"], "algorithm.clip"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, overrides)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    y = tmp_path / "bad.yaml"
    y.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*train\.stepz"):
        load_config(y)


def test_shipped_configs_load() -> None:
    ys = sorted((REPO / "configs").glob("*.yaml"))
    assert len(ys) >= 6
    for y in ys:
        assert isinstance(load_config(y, ["model.path=/m", "data.train_file=/d.jsonl"]), Config)
    # The paper configs leave the model and data paths to the user, and say so.
    with pytest.raises(ConfigError, match=r"model\.path.*data\.train_file"):
        load_config(REPO / "configs" / "qwen3_14b_dapo_fp8_block.yaml")


def test_jsonl_ok_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"prompt": "1+1=", "answer": "2", "src": "x"}\n\n{"prompt": "2+2=", "answer": 4}\n'
    )
    ex = load_examples(p)
    assert [(e.prompt, e.answer) for e in ex] == [("1+1=", "2"), ("2+2=", "4")]
    assert ex[0].meta == {"src": "x"}
    cases = {
        '{"prompt": "a"}\n': ":1: missing required field 'answer'",
        '{"prompt": "a", "answer": "b"}\n{oops\n': ":2: not valid JSON",
        "[1, 2]\n": ":1: expected a JSON object",
        '{"prompt": 3, "answer": "b"}\n': ":1: field 'prompt' must be a string",
    }
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(
            DataError,
            match=str(p).replace(".", r"\.") + msg.replace("[", r"\[").replace("(", r"\("),
        ):
            load_examples(p)
    with pytest.raises(DataError, match="not found"):
        load_examples(tmp_path / "nope.jsonl")


def test_arithmetic_split_disjoint_and_correct() -> None:
    train, evals = arithmetic_split(max_digits=2, eval_size=100)
    assert len(train) + len(evals) == 100 * 100
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    for e in evals[:20]:
        a, b = e.prompt[:-1].split("+")
        assert int(e.answer) == int(a) + int(b)


def test_scratchpad_task_by_hand() -> None:
    from jfp8rl.data import SCRATCHPAD_TRAIN_SIZE, build_datasets, scratchpad_text
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


def test_scratchpad_verifier_and_garbled_rate() -> None:
    good = "3+9+0=12;2+5+1=08;1+4+0=05;#0582"
    assert scratchpad_verifier(good, "582") == 1.0
    assert scratchpad_verifier(" " + good + "\n", "582") == 1.0
    assert scratchpad_verifier(good.replace("#0582", "#0581"), "582") == 0.0  # wrong sum
    garbled = [good[:-1] + "x", good.replace(";", ",", 1), "582", "", good + ";", "#0582"]
    for g in garbled:
        assert not scratchpad_parsed(g) and scratchpad_verifier(g, "582") == 0.0, g
    assert scratchpad_parsed(good.replace("1+4+0=05", "1+4+0=99"))  # wrong step, well-formed
    from jfp8rl.rewards import ANSWER_PARSERS, get_verifier

    assert ANSWER_PARSERS[get_verifier("scratchpad")] is scratchpad_parsed


def test_study_config_is_the_scratchpad_task() -> None:
    cfg = load_config(REPO / "configs" / "study_scratchpad.yaml")
    assert (cfg.data.task, cfg.reward.kind, cfg.data.max_digits) == ("scratchpad", "scratchpad", 3)
    assert cfg.rollout.max_tokens >= 33  # the scratchpad and eos fit
    lower_only = load_config(
        REPO / "configs" / "study_scratchpad.yaml", ["calibration.upper_rule=plain"]
    )
    assert lower_only.calibration.upper_rule == "plain"
    with pytest.raises(ConfigError, match="calibration.upper_rule"):
        load_config(None, ["calibration.upper_rule=lower"])


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


def test_verifiers() -> None:
    assert task_verifier(" 46", "46") == 1.0
    assert task_verifier("046", "46") == 0.0
    assert task_verifier("46 apples", "46") == 0.0
    assert exact_match("Paris.", "Paris") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert math_verify_reward("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_verify_reward("the answer is $\\boxed{3}$", "4") == 0.0
    assert math_verify_reward("no idea", "4") == 0.0


def test_overlong_penalty_matches_dapo_formula() -> None:
    # L_max = 10, L_cache = 4: free up to 6, then -(L - 6)/4, -1 beyond 10.
    lengths = np.array([1, 6, 7, 8, 10, 11])
    want = np.array([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 10, 4), want)
    np.testing.assert_allclose(overlong_penalty(lengths, 10, 4, penalty=0.5), want * 0.5)


def test_score_responses_adds_shaping_to_correctness() -> None:
    r, c = score_responses(
        ["12", "13", "12"],
        ["12", "12", "12"],
        np.array([3, 3, 6]),
        verifier=task_verifier,
        max_tokens=6,
        overlong=True,
        overlong_buffer=2,
        overlong_penalty_coef=1.0,
    )
    np.testing.assert_allclose(c, [1, 0, 1])
    np.testing.assert_allclose(r, [1, 0, 0])


def test_mesh_config_replaces_num_devices(tmp_path: Path) -> None:
    # The removed key fails naming its replacement, from the command line and from a file.
    with pytest.raises(ConfigError, match=r"train\.num_devices.*train\.mesh"):
        load_config(None, ["train.num_devices=2"])
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  num_devices: 2\n")
    with pytest.raises(ConfigError, match=rf"{old}.*train\.mesh\.data=N"):
        load_config(old)
    cfg = load_config(None, ["train.mesh.fsdp=-1", "train.mesh.tensor=2"])
    assert (cfg.train.mesh.data, cfg.train.mesh.fsdp, cfg.train.mesh.tensor) == (1, -1, 2)
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        load_config(None, ["train.mesh.fsdp=-1", "train.mesh.data=-1"])
    with pytest.raises(ConfigError, match=r"train\.mesh\.tensor=0"):
        load_config(None, ["train.mesh.tensor=0"])
    # Mini-batch 16 * 8 / 4 = 32: micro-batches must divide it and split over data x fsdp.
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=12 must divide.*32"):
        load_config(None, ["train.micro_batch_size=12"])
    with pytest.raises(ConfigError, match=r"micro_batch_size 8 must be a multiple of the 16"):
        load_config(None, ["train.micro_batch_size=8", "train.mesh.fsdp=16"])


def test_resolve_mesh_shape() -> None:
    from jfp8rl.mesh import resolve_mesh_shape

    assert resolve_mesh_shape(1, -1, 2, 8) == (1, 4, 2)
    assert resolve_mesh_shape(2, 2, 1, 8) == (2, 2, 1)  # the first 4 of 8 devices
    with pytest.raises(ValueError, match="not a multiple"):
        resolve_mesh_shape(3, -1, 1, 8)
    with pytest.raises(ValueError, match="needs 16 devices, only 8"):
        resolve_mesh_shape(1, 16, 1, 8)


def test_calibration_defaults_agree_with_the_loss_config_and_the_tiny_run() -> None:
    # One default, chosen by docs/fp8_study.md ("Why the calibrated upper bound swung").
    from losses.calibrated import CalibConfig

    want = CalibConfig()
    for c in (Config().calibration, load_config(REPO / "configs" / "tiny_cpu.yaml").calibration):
        assert (c.mode, c.upper_rule, c.balance) == (want.mode, want.upper_rule, want.balance)
    assert want.mode == "hold"
