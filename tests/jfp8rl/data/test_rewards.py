"""Verifiers, the math reward's unparsed count and DAPO overlong shaping, against hand-computed
cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jfp8rl.data.records import Example
from jfp8rl.data.rewards import (
    ANSWER_PARSERS,
    RewardError,
    exact_match,
    last_boxed,
    load_reward_functions,
    math_answer_parsed,
    math_natural_reward,
    math_verify_reward,
    natural_answer_parsed,
    overlong_penalty,
    score_responses,
    scratchpad_parsed,
    scratchpad_verifier,
    task_verifier,
)

REPO = Path(__file__).resolve().parents[3]


def test_scratchpad_verifier_and_garbled_rate() -> None:
    good = "3+9+0=12;2+5+1=08;1+4+0=05;#0582"
    assert scratchpad_verifier(good, "582") == 1.0
    assert scratchpad_verifier(" " + good + "\n", "582") == 1.0
    assert scratchpad_verifier(good.replace("#0582", "#0581"), "582") == 0.0  # wrong sum
    garbled = [good[:-1] + "x", good.replace(";", ",", 1), "582", "", good + ";", "#0582"]
    for g in garbled:
        assert not scratchpad_parsed(g) and scratchpad_verifier(g, "582") == 0.0, g
    assert scratchpad_parsed(good.replace("1+4+0=05", "1+4+0=99"))  # wrong step, well-formed
    from jfp8rl.data.rewards import ANSWER_PARSERS, get_verifier

    assert ANSWER_PARSERS[get_verifier("scratchpad")] is scratchpad_parsed


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
    r, c, extras = score_responses(
        ["12", "13", "12"],
        [Example("1+11=", "12")] * 3,
        np.array([3, 3, 6]),
        verifier=task_verifier,
        max_tokens=6,
        overlong=True,
        overlong_buffer=2,
        overlong_penalty_coef=1.0,
    )
    np.testing.assert_allclose(c, [1, 0, 1])
    np.testing.assert_allclose(r, [1, 0, 0])
    assert extras == {}


def test_math_reward_boxed_and_unparsed() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert last_boxed("no box 42") is None
    cases = [  # (response, answer, reward, parsed)
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0, True),
        ("\\boxed{12}", "12", 1.0, True),
        ("\\boxed{13}", "12", 0.0, True),
        ("the answer is 12", "12", 0.0, False),  # no box: unparsed, scores 0
        ("\\boxed{}", "12", 0.0, False),
        ("\\boxed{\\frac{1}{2", "0.5", 0.0, False),
    ]
    for response, answer, reward, parsed in cases:
        assert math_verify_reward(response, answer) == reward, response
        assert math_answer_parsed(response) is parsed, response
    assert ANSWER_PARSERS[math_verify_reward] is math_answer_parsed


def test_math_natural_reward_reads_the_box_else_the_last_number() -> None:
    cases = [  # (response, answer, reward, parsed), by hand
        ("11 + 17 = 28", "28", 1.0, True),  # no box: the last number
        ("11 + 17 = 22", "28", 0.0, True),
        ("20 + 10 = 30\n\nThe answer is \\boxed{}.", "30", 1.0, True),  # empty box: number
        ("It is 7, so \\boxed{30}", "30", 1.0, True),  # a box wins over later numbers
        ("\\boxed{30} or maybe 31", "31", 0.0, True),
        ("The total is 1,024.", "1024", 1.0, True),
        ("Half: 0.5", "\\frac{1}{2}", 1.0, True),
        ("-3 it is", "-3", 1.0, True),
        ("no digits here", "3", 0.0, False),
    ]
    for response, answer, reward, parsed in cases:
        assert math_natural_reward(response, answer) == reward, response
        assert natural_answer_parsed(response) is parsed, response
    assert ANSWER_PARSERS[math_natural_reward] is natural_answer_parsed


def test_reward_functions_verl_signature_weights_and_metrics(tmp_path: Path) -> None:
    """Called with verl's keywords; a float or a dict's `score`, weighted and summed; the
    dict's other numbers and (with several functions) each one's score as metrics."""
    f = tmp_path / "r.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'n': len(extra_info)}\n"
        "def length(data_source, solution_str, ground_truth, extra_info):\n"
        "    return len(solution_str) / 10 if data_source == 'a' else 0\n"
    )
    fns = load_reward_functions(str(f), "compute_score, length", [1.0, 0.5])
    examples = [
        Example("p", "12", {"data_source": "a", "extra_info": {"i": 0, "j": 1}}),
        Example("q", "7"),
    ]
    score, extras = fns.score(["12", "8"], examples)
    np.testing.assert_allclose(score, [1.0 + 0.5 * 0.2, 0.0])
    np.testing.assert_allclose(extras["n"], [2, 0])
    np.testing.assert_allclose(extras["compute_score"], [1.0, 0.0])
    np.testing.assert_allclose(extras["length"], [0.2, 0.0])
    # One function: its float is the score, nothing else logged.
    one = load_reward_functions(str(f), "length", [])
    score, extras = one.score(["1234"], examples[:1])
    np.testing.assert_allclose(score, [0.4])
    assert extras == {}


@pytest.mark.parametrize(
    "body, why",
    [
        ("raise KeyError('x')", "raised KeyError: 'x'"),
        ("return float('nan')", "returned nan; a reward must be a finite number"),
        (
            "return 'high'",
            "returned 'high'; a reward is a finite number (or a dict with one at 'score')",
        ),  # fmt: skip
        ("return {'acc': 1.0}", "returned a dict without 'score': {'acc': 1.0}"),
        (
            "return None",
            "returned None; a reward is a finite number (or a dict with one at 'score')",
        ),  # fmt: skip
    ],
)
def test_reward_function_failures_name_function_sample_and_value(
    tmp_path: Path, body: str, why: str
) -> None:
    f = tmp_path / "bad.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    if solution_str == 'b':\n        {body}\n    return 1.0\n"
    )
    fns = load_reward_functions(str(f), "compute_score", [])
    with pytest.raises(RewardError) as err:
        fns.score(["a", "b"], [Example("p", "1"), Example("q", "2")])
    assert (
        str(err.value) == f"reward function {f}:compute_score on sample 1 (ground_truth '2') {why}"
    )


def test_reward_file_errors_name_the_key(tmp_path: Path) -> None:
    f = tmp_path / "r.py"
    f.write_text("def compute_score(**kw):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"reward\.weights=\[1\.0, 2\.0\]: 2 weights for 1"):
        load_reward_functions(str(f), "compute_score", [1.0, 2.0])
    f.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(ValueError, match=r"reward\.path=.*importing it raised ModuleNotFoundError"):
        load_reward_functions(str(f), "compute_score", [])
