"""Rewards: verifiers (built-in task, exact match, math-verify) and DAPO overlong shaping.

A verifier maps (response text, reference answer) to correctness in {0, 1}; the reward is the
correctness plus the optional overlong penalty, and `reward/accuracy` is the mean correctness.

DAPO soft overlong punishment (Yu et al. 2025, eq. 13), with L_max = rollout.max_tokens and
L_cache = reward.overlong_buffer:

    R_len(y) = 0                                  if |y| <= L_max - L_cache
               ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
               -1                                 if |y| > L_max
multiplied by `overlong_penalty`. |y| counts response tokens including eos, as verl does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Verifier = Callable[[str, str], float]


def task_verifier(response: str, answer: str) -> float:
    """The built-in arithmetic task: the response (eos already stripped) is exactly the answer.

    Stripping surrounding whitespace only; anything else ("46 apples", "046") is wrong, so the
    policy must learn the exact output format, then eos.
    """
    return float(response.strip() == answer.strip())


def exact_match(response: str, answer: str) -> float:
    """Exact string match after stripping whitespace and one trailing period."""

    def norm(s: str) -> str:
        s = s.strip()
        return s[:-1].rstrip() if s.endswith(".") else s

    return float(norm(response) == norm(answer))


def math_verify_reward(response: str, answer: str) -> float:
    """math-verify equivalence of the response's final answer (boxed or last expression) with
    the reference; 0 when either side does not parse. math-verify's own timeouts apply."""
    from math_verify import parse, verify  # heavy import (sympy); only when configured

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    try:
        return float(bool(verify(gold, pred)))
    except Exception:  # math-verify raises on exotic expressions; an unverifiable answer is wrong
        return 0.0


VERIFIERS: dict[str, Verifier] = {
    "task": task_verifier,
    "exact": exact_match,
    "math": math_verify_reward,
}


def get_verifier(kind: str) -> Verifier:
    """The verifier registered as `kind` (`reward.kind`)."""
    if kind not in VERIFIERS:
        raise ValueError(f"reward.kind={kind!r} is not one of {sorted(VERIFIERS)}")
    return VERIFIERS[kind]


def overlong_penalty(
    lengths: np.ndarray, max_tokens: int, buffer: int, penalty: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment (module docstring) per response length; float64 [N]."""
    lengths = np.asarray(lengths, dtype=np.float64)
    start = max_tokens - buffer
    ramp = (start - lengths) / buffer
    out = np.where(lengths <= start, 0.0, np.where(lengths <= max_tokens, ramp, -1.0))
    return penalty * out


def score_responses(
    texts: Sequence[str],
    answers: Sequence[str],
    lengths: np.ndarray,
    *,
    verifier: Verifier,
    max_tokens: int,
    overlong: bool,
    overlong_buffer: int,
    overlong_penalty_coef: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(rewards, correctness), float32 [N] each: correctness from `verifier`, plus shaping."""
    if len(texts) != len(answers):
        raise ValueError(f"{len(texts)} responses but {len(answers)} answers")
    correct = np.array([verifier(t, a) for t, a in zip(texts, answers, strict=True)], np.float64)
    reward = correct.copy()
    if overlong:
        reward += overlong_penalty(lengths, max_tokens, overlong_buffer, overlong_penalty_coef)
    return reward.astype(np.float32), correct.astype(np.float32)
