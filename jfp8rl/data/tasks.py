"""Built-in tasks: data that needs no file, for the tiny warm-started policies.

The built-in task ("arithmetic"): prompt `"{a}+{b}="` with both operands zero-padded to
max_digits digits (`"07+45="`: fixed digit positions, which a 2-layer model learns far faster
than variable-width operands), answer `str(a + b)` without padding (`"52"`). The eval set is `eval_size` problems drawn with a fixed seed; the training
set is every other pair, so eval problems are never trained on.

The built-in long-response task ("scratchpad"): the same prompt, but the policy is
warm-started to write a column-addition scratchpad before the answer, least significant digit
first, one step `a_i+b_i+c=ss;` per digit (c the incoming carry, ss the two-digit column sum),
then `#` and the sum zero-padded to max_digits + 1 digits:

    "123+459=" -> "3+9+0=12;2+5+1=08;1+4+0=05;#0582"   (9 * max_digits + max_digits + 2 chars)

32 characters (+ eos: 33 response tokens of the byte tokenizer) at 3 digits. `Example.answer`
is `str(a + b)` (what the verifier checks); `Example.meta["target"]` holds the scratchpad (what
the warm start trains on). With 3 digits there are 10^6 pairs, so the training set is a fixed
draw of at most `SCRATCHPAD_TRAIN_SIZE` pairs disjoint from the eval set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jfp8rl.data.records import DataError, Example


def arithmetic_prompt(a: int, b: int, width: int) -> Example:
    """The built-in task's example for a + b, operands zero-padded to `width` digits."""
    return Example(f"{a:0{width}d}+{b:0{width}d}=", str(a + b), {"a": a, "b": b})


def scratchpad_text(a: int, b: int, width: int) -> str:
    """The scratchpad of a + b with `width`-digit operands (module docstring)."""
    steps, carry = [], 0
    for i in range(width):
        da, db = a // 10**i % 10, b // 10**i % 10
        s = da + db + carry
        steps.append(f"{da}+{db}+{carry}={s:02d};")
        carry = s // 10
    return "".join(steps) + f"#{a + b:0{width + 1}d}"


def scratchpad_prompt(a: int, b: int, width: int) -> Example:
    """The long-response task's example: the arithmetic prompt, the scratchpad as target."""
    ex = arithmetic_prompt(a, b, width)
    return dataclasses.replace(ex, meta={**ex.meta, "target": scratchpad_text(a, b, width)})


# Training pairs of the scratchpad task (a fixed draw; 3 digits have 10^6 pairs in all).
SCRATCHPAD_TRAIN_SIZE = 65536

# Tasks whose data (and warm-started base policy) are built in: data.task names.
BUILTIN_TASKS = ("arithmetic", "scratchpad")


def arithmetic_split(
    max_digits: int,
    eval_size: int,
    seed: int = 1234,
    *,
    make: Callable[[int, int, int], Example] = arithmetic_prompt,
    max_train: int = 0,
) -> tuple[list[Example], list[Example]]:
    """(train, eval) for a built-in task: pairs in [0, 10^max_digits)^2, eval held out; the
    training set is every other pair, or a fixed draw of `max_train` of them (0 = all)."""
    hi = 10**max_digits
    n_pairs = hi * hi
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_pairs)
    if eval_size >= n_pairs:
        raise DataError(f"data.eval_size={eval_size} leaves no training pairs ({n_pairs} in all)")
    rest = perm[eval_size:]
    eval_idx, train_idx = perm[:eval_size], np.sort(rest[:max_train] if max_train else rest)
    train = [make(int(i // hi), int(i % hi), max_digits) for i in train_idx]
    evals = [make(int(i // hi), int(i % hi), max_digits) for i in eval_idx]
    return train, evals
