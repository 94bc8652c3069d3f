"""The training prompt order, prompt encoding, and the (train, eval) sets of a config.

Order: `PromptStream` yields training examples epoch by epoch, each epoch a permutation drawn
from (seed, epoch). Its whole state is one integer, the number of prompts consumed so far
(`position`), which the checkpoint stores; `take(position, k)` is a pure function of it, so a
resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jfp8rl.data.records import DataError, Example, load_examples
from jfp8rl.data.tasks import SCRATCHPAD_TRAIN_SIZE, arithmetic_split, scratchpad_prompt


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


def encode_texts(texts: Sequence[str], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """Token ids of each text with no special tokens added (what transformers does with a
    rendered chat template); a prompt longer than `max_tokens` is an error naming it, since
    truncating a prompt would change the task."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > max_tokens:
            raise DataError(
                f"prompt {i} ({text[:40]!r}...) has {len(ids)} tokens > "
                f"data.max_prompt_tokens={max_tokens}; raise it or shorten the prompt"
            )
        if not ids:
            raise DataError(f"prompt {i} is empty after tokenization")
        out.append(list(ids))
    return out


def encode_prompts(examples: Sequence[Example], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """`encode_texts` of the examples' raw prompt texts (no template)."""
    return encode_texts([ex.prompt for ex in examples], tokenizer, max_tokens)


def hold_out(
    examples: Sequence[Example], eval_size: int, share: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, eval): ceil(share x len(examples)) examples, at most `eval_size`, drawn with
    `seed` as the eval set, the others (in their order) as the training set."""
    k = min(eval_size, math.ceil(share * len(examples)))
    if k >= len(examples):
        raise DataError(
            f"{len(examples)} training examples cannot spare {k} for eval; give data.eval_file "
            "or lower data.eval_share"
        )
    chosen = set(np.random.default_rng([seed, 1]).permutation(len(examples))[:k].tolist())
    train = [ex for i, ex in enumerate(examples) if i not in chosen]
    return train, [examples[i] for i in sorted(chosen)]


def build_datasets(
    task: str,
    train_file: str,
    eval_file: str,
    max_digits: int,
    eval_size: int,
    *,
    prompt_key: str = "",
    answer_key: str = "",
    eval_share: float = 0.05,
    seed: int = 0,
) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for the configured task (`jfp8rl.config.DataConfig` fields);
    without an eval file, a held-out share of the training file (`hold_out`)."""
    if task == "arithmetic":
        return arithmetic_split(max_digits, eval_size)
    if task == "scratchpad":
        return arithmetic_split(
            max_digits, eval_size, make=scratchpad_prompt, max_train=SCRATCHPAD_TRAIN_SIZE
        )
    train = load_examples(train_file, prompt_key=prompt_key, answer_key=answer_key)
    if not eval_file:
        return hold_out(train, eval_size, eval_share, seed)
    evals = load_examples(eval_file, prompt_key=prompt_key, answer_key=answer_key)
    return train, evals[:eval_size]
