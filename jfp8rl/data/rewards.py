"""Rewards: verifiers (built-in task, exact match, math-verify on the boxed or the natural
answer), the user's reward functions, and DAPO overlong shaping.

A verifier maps (response text, reference answer) to correctness in {0, 1}; the reward is the
correctness plus the optional overlong penalty, and `reward/accuracy` is the mean correctness.

The user's reward functions (`reward.kind: function`, `RewardFunctions`) are called as verl
calls a custom reward, so a verl reward file works unchanged:

    score = compute_score(data_source=..., solution_str=response, ground_truth=answer,
                          extra_info=...)

with `data_source` and `extra_info` the record's fields of those names ("" and {} when it has
none). A function returns a float, or a dict with a float `score` whose other numeric entries
are logged as `reward/<key>` (their mean over the samples scored). Several functions are summed
with weights (TRL's `reward_weights`). Their weighted score is the correctness too: accuracy
metrics are then the mean score before overlong shaping. A function that raises, or returns
something that is not a finite number, stops the step with `RewardError` naming the function,
the sample and the value or exception.

DAPO soft overlong punishment (Yu et al. 2025, eq. 13), with L_max = rollout.max_tokens and
L_cache = reward.overlong_buffer:

    R_len(y) = 0                                  if |y| <= L_max - L_cache
               ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
               -1                                 if |y| > L_max
multiplied by `overlong_penalty`. |y| counts response tokens including eos, as verl does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jfp8rl.data.records import Example

Verifier = Callable[[str, str], float]


class RewardError(RuntimeError):
    """A user reward function failed on a sample; the message names it, the sample and why."""


@dataclasses.dataclass(frozen=True)
class RewardFunctions:
    """The user's reward functions (module docstring) with their weights; `names` say where
    each comes from (`file.py:compute_score`) in errors."""

    functions: tuple[Callable[..., Any], ...]
    weights: tuple[float, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.functions:
            raise ValueError("no reward function given")
        if len(self.weights) != len(self.functions):
            raise ValueError(
                f"{len(self.functions)} reward functions but {len(self.weights)} weights"
            )

    def score(
        self, texts: Sequence[str], examples: Sequence[Example]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weighted score float64 [N], {metric: per-sample values [N], NaN where a sample
        has none}) of each response with its example."""
        total = np.zeros(len(texts), np.float64)
        extras: dict[str, np.ndarray] = {}
        for fn, weight, name in zip(self.functions, self.weights, self.names, strict=True):
            for i, (text, ex) in enumerate(zip(texts, examples, strict=True)):
                value, extra = _call(fn, name, i, text, ex)
                total[i] += weight * value
                if len(self.functions) > 1:
                    extra = {name.rsplit(":", 1)[-1]: value, **extra}
                for key, v in extra.items():
                    extras.setdefault(key, np.full(len(texts), np.nan))[i] = v
        return total, extras


def _call(fn: Callable[..., Any], name: str, i: int, text: str, ex: Example) -> tuple[float, dict]:
    """One call as verl makes it; (score, the other numeric entries of a dict result)."""
    where = f"reward function {name} on sample {i} (ground_truth {ex.answer!r})"
    try:
        out = fn(
            data_source=ex.meta.get("data_source", ""),
            solution_str=text,
            ground_truth=ex.answer,
            extra_info=dict(ex.meta.get("extra_info") or {}),
        )
    except Exception as e:
        raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
    extra: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise RewardError(f"{where} returned a dict without 'score': {out!r}")
        extra = {
            k: float(v)
            for k, v in out.items()
            if k != "score" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        out = out["score"]
    if isinstance(out, bool) or not isinstance(out, int | float | np.number):
        raise RewardError(
            f"{where} returned {out!r}; a reward is a finite number (or a dict with one at 'score')"
        )
    if not math.isfinite(float(out)):
        raise RewardError(f"{where} returned {out!r}; a reward must be a finite number")
    return float(out), extra


def load_reward_functions(path: str, names: str, weights: Sequence[float]) -> RewardFunctions:
    """The functions `names` (comma-separated) of the Python file `path`, weighted by
    `weights` (empty: 1 each). Raises `ValueError` naming `reward.path` / `reward.name` /
    `reward.weights` when the file, a function or the weights are wrong."""
    p = Path(path)
    if not path or not p.is_file():
        raise ValueError(
            f"reward.path={path!r}: no such file; reward.kind=function needs the Python file "
            "that defines the reward function (verl's custom_reward_function.path)"
        )
    spec = importlib.util.spec_from_file_location(f"jfp8rl_reward_{p.stem}", p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"reward.path={path}: importing it raised {type(e).__name__}: {e}") from e
    fns, labels = [], []
    for name in (n.strip() for n in names.split(",")):
        fn = getattr(module, name, None)
        if not callable(fn):
            found = sorted(
                k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
            )
            raise ValueError(
                f"reward.name={name!r}: {path} defines no function of that name "
                f"(its functions: {', '.join(found) or 'none'})"
            )
        fns.append(fn)
        labels.append(f"{path}:{name}")
    w = tuple(float(x) for x in weights) or (1.0,) * len(fns)
    if len(w) != len(fns):
        raise ValueError(
            f"reward.weights={list(weights)}: {len(w)} weights for {len(fns)} functions ({names})"
        )
    return RewardFunctions(tuple(fns), w, tuple(labels))


# A run's reward: a built-in verifier or the user's functions.
Reward = Verifier | RewardFunctions


def judge(
    reward: Reward, texts: Sequence[str], examples: Sequence[Example]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(correctness float64 [N], per-sample metrics) of each response with its example."""
    if isinstance(reward, RewardFunctions):
        return reward.score(texts, examples)
    got = [reward(t, ex.answer) for t, ex in zip(texts, examples, strict=True)]
    return np.array(got, np.float64), {}


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
    examples: Sequence[Example],
    lengths: np.ndarray,
    *,
    verifier: Reward,
    max_tokens: int,
    overlong: bool,
    overlong_buffer: int,
    overlong_penalty_coef: float,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(rewards, correctness), float32 [N] each, and the reward functions' per-sample metrics:
    correctness from `verifier` (a verifier or `RewardFunctions`), plus shaping."""
    if len(texts) != len(examples):
        raise ValueError(f"{len(texts)} responses but {len(examples)} examples")
    correct, extras = judge(verifier, texts, examples)
    reward = correct.copy()
    if overlong:
        reward += overlong_penalty(lengths, max_tokens, overlong_buffer, overlong_penalty_coef)
    return reward.astype(np.float32), correct.astype(np.float32), extras
