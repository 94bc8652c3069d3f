"""Prompt data: JSONL files and the built-in arithmetic task, with a resumable order.

JSONL: one JSON object per line with string fields `prompt` and `answer` (other fields are kept
as metadata); blank lines are skipped; any other problem raises `DataError` naming `file:line`.

The built-in task ("arithmetic"): prompt `"{a}+{b}="` with both operands zero-padded to
max_digits digits (`"07+45="`: fixed digit positions, which a 2-layer model learns far faster
than variable-width operands), answer `str(a + b)` without padding (`"52"`). The eval set is `eval_size` problems drawn with a fixed seed; the training
set is every other pair, so eval problems are never trained on.

Order: `PromptStream` yields training examples epoch by epoch, each epoch a permutation drawn
from (seed, epoch). Its whole state is one integer, the number of prompts consumed so far
(`position`), which the checkpoint stores; `take(position, k)` is a pure function of it, so a
resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


class DataError(ValueError):
    """A prompt file or example is malformed; the message names file:line or the example."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; `meta` holds the JSONL line's other fields."""

    prompt: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_jsonl(path: str | Path) -> list[Example]:
    """Reads `{"prompt": str, "answer": str, ...}` lines; errors name `path:line`."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: prompt file not found (set data.train_file / data.eval_file)")
    out: list[Example] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from e
            if not isinstance(obj, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            for key in ("prompt", "answer"):
                if key not in obj:
                    raise DataError(f"{p}:{lineno}: missing required field {key!r}")
                if not isinstance(obj[key], str):
                    # Numbers as answers are common in math sets; accept them as their text.
                    if key == "answer" and isinstance(obj[key], int | float):
                        obj[key] = str(obj[key])
                    else:
                        raise DataError(
                            f"{p}:{lineno}: field {key!r} must be a string, "
                            f"got {type(obj[key]).__name__}"
                        )
            meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer")}
            out.append(Example(obj["prompt"], obj["answer"], meta))
    if not out:
        raise DataError(f"{p}: no examples (the file is empty)")
    return out


def arithmetic_prompt(a: int, b: int, width: int) -> Example:
    """The built-in task's example for a + b, operands zero-padded to `width` digits."""
    return Example(f"{a:0{width}d}+{b:0{width}d}=", str(a + b), {"a": a, "b": b})


def arithmetic_split(
    max_digits: int, eval_size: int, seed: int = 1234
) -> tuple[list[Example], list[Example]]:
    """(train, eval) for the built-in task: all pairs in [0, 10^max_digits)^2, eval held out."""
    hi = 10**max_digits
    pairs = np.stack(np.meshgrid(np.arange(hi), np.arange(hi), indexing="ij"), -1).reshape(-1, 2)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(pairs))
    if eval_size >= len(pairs):
        raise DataError(
            f"data.eval_size={eval_size} leaves no training pairs ({len(pairs)} in all)"
        )
    eval_idx, train_idx = perm[:eval_size], np.sort(perm[eval_size:])
    train = [arithmetic_prompt(int(a), int(b), max_digits) for a, b in pairs[train_idx]]
    evals = [arithmetic_prompt(int(a), int(b), max_digits) for a, b in pairs[eval_idx]]
    return train, evals


class PromptStream:
    """Deterministic epoch-wise shuffled order over `examples`; state = prompts consumed."""

    def __init__(self, examples: Sequence[Example], seed: int) -> None:
        if not examples:
            raise DataError("no training examples")
        self.examples = list(examples)
        self.seed = seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = {epoch: rng.permutation(len(self.examples))}
        return self._perm_cache[epoch]

    def take(self, position: int, k: int) -> tuple[list[Example], int]:
        """The k examples after `position` prompts consumed, and the new position."""
        n = len(self.examples)
        out = []
        for pos in range(position, position + k):
            epoch, i = divmod(pos, n)
            out.append(self.examples[int(self._perm(epoch)[i])])
        return out, position + k


def encode_prompts(examples: Sequence[Example], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (no special tokens); a prompt longer than `max_tokens` is an
    error naming it, since truncating a prompt would change the task."""
    out = []
    for i, ex in enumerate(examples):
        ids = tokenizer.encode(ex.prompt, add_special_tokens=False).ids
        if len(ids) > max_tokens:
            raise DataError(
                f"prompt {i} ({ex.prompt[:40]!r}...) has {len(ids)} tokens > "
                f"data.max_prompt_tokens={max_tokens}; raise it or shorten the prompt"
            )
        if not ids:
            raise DataError(f"prompt {i} is empty after tokenization")
        out.append(list(ids))
    return out


def build_datasets(
    task: str, train_file: str, eval_file: str, max_digits: int, eval_size: int
) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for the configured task (`jfp8rl.config.DataConfig` fields)."""
    if task == "arithmetic":
        return arithmetic_split(max_digits, eval_size)
    train = load_jsonl(train_file)
    evals = load_jsonl(eval_file)[:eval_size] if eval_file else train[:eval_size]
    return train, evals
