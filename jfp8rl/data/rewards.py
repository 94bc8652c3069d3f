"""Rewards: verifiers (built-in task, exact match, math-verify on the boxed or the natural
answer) and DAPO overlong shaping.

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

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Verifier = Callable[[str, str], float]


def task_verifier(response: str, answer: str) -> float:
    """The built-in arithmetic task: the response (eos already stripped) is exactly the answer.

    Stripping surrounding whitespace only; anything else ("46 apples", "046") is wrong, so the
    policy must learn the exact output format, then eos.
    """
    return float(response.strip() == answer.strip())


# The scratchpad task's format (jfp8rl/data/tasks.py): column steps `a+b+c=ss;`, then `#` and the sum.
SCRATCHPAD_RE = re.compile(r"(?:\d\+\d\+[01]=\d\d;)+#(\d+)")


def scratchpad_answer(response: str) -> str | None:
    """The final number of a well-formed scratchpad response (stripped), or None when the
    response does not follow the format: a garbled output (`reward/unparsed_frac`)."""
    m = SCRATCHPAD_RE.fullmatch(response.strip())
    return None if m is None else m.group(1)


def scratchpad_parsed(response: str) -> bool:
    """Whether `response` is a well-formed scratchpad (not garbled)."""
    return scratchpad_answer(response) is not None


def scratchpad_verifier(response: str, answer: str) -> float:
    """The long-response task: a well-formed scratchpad whose final number (zero-padded) equals
    the answer; the steps themselves are not checked, only the format and the final sum."""
    final = scratchpad_answer(response)
    return float(final is not None and int(final) == int(answer))


def exact_match(response: str, answer: str) -> float:
    """Exact string match after stripping whitespace and one trailing period."""

    def norm(s: str) -> str:
        s = s.strip()
        return s[:-1].rstrip() if s.endswith(".") else s

    return float(norm(response) == norm(answer))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces matched) in `text`, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


@functools.lru_cache(maxsize=8192)
def _parse_answer(text: str) -> Any:
    """math-verify's parse of `text` as a boxed answer; None when it does not parse.
    Cached: the verifier and the unparsed count parse each answer once."""
    from math_verify import parse  # heavy import (sympy); only when configured

    return parse(f"$\\boxed{{{text}}}$") or None


def math_prediction(response: str) -> Any:
    """math-verify's parse of the last `\\boxed{}` answer of `response`; None when there is no
    box or math-verify cannot parse its content (an unparsed answer, `reward/unparsed_frac`)."""
    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return None
    return _parse_answer(boxed)


NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` (thousands commas dropped), or None."""
    found = NUMBER_RE.findall(text.replace(",", ""))
    return found[-1] if found else None


def natural_prediction(response: str) -> Any:
    """The answer as a small chat model writes it: the last non-empty `\\boxed{}`, else the
    last number of the response ("12 + 7 = 19" answers 19), parsed by math-verify."""
    boxed = last_boxed(response)
    text = boxed if boxed is not None and boxed.strip() else last_number(response)
    return None if text is None else _parse_answer(text)


def math_answer_parsed(response: str) -> bool:
    """Whether `response` holds a parsable `\\boxed{}` answer."""
    return math_prediction(response) is not None


def natural_answer_parsed(response: str) -> bool:
    """Whether `response` holds a parsable boxed answer or a number."""
    return natural_prediction(response) is not None


def _verify(pred: Any, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    if not gold or pred is None:
        return 0.0
    try:
        return float(bool(verify(gold, pred)))
    except Exception:  # math-verify raises on exotic expressions; an unverifiable answer is wrong
        return 0.0


def math_verify_reward(response: str, answer: str) -> float:
    """math-verify equivalence of the response's last `\\boxed{}` answer with the reference
    (DeepScaleR / DAPO's rule: the boxed answer counts); 0 when either side does not parse.
    math-verify's own timeouts apply."""
    return _verify(math_prediction(response), answer)


def math_natural_reward(response: str, answer: str) -> float:
    """As `math_verify_reward`, on `natural_prediction`: the boxed answer, else the last number.
    For models too small to follow a "put the answer in \\boxed{}" instruction, so that a
    correct sum written their own way is rewarded (reward.kind "math_natural")."""
    return _verify(natural_prediction(response), answer)


VERIFIERS: dict[str, Verifier] = {
    "task": task_verifier,
    "exact": exact_match,
    "math": math_verify_reward,
    "math_natural": math_natural_reward,
    "scratchpad": scratchpad_verifier,
}


# Verifiers that extract an answer before judging it say how, so a run can count the
# responses without one (`reward/unparsed_frac`).
# For the scratchpad task an unparsed response is a garbled one (off-format).
ANSWER_PARSERS: dict[Verifier, Callable[[str], bool]] = {
    math_verify_reward: math_answer_parsed,
    math_natural_reward: natural_answer_parsed,
    scratchpad_verifier: scratchpad_parsed,
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
