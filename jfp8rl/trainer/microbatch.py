"""Micro-batches: a mini-batch run as k slices inside one program.

Micro-batching (`micro_batch_size` m < mini-batch size n, k = n / m micro-batches). Micro-batch
j holds the samples j, j + k, j + 2k, ... (a strided split: with the samples sharded in
contiguous blocks over `data x fsdp`, every micro-batch is spread over all devices). Exact for
every aggregation mode (`losses.masked`): the loss of micro-batch j is num_j / D with D the
mini-batch's global denominator (tokens or non-empty sequences), so sum_j loss_j and its
gradient equal the whole mini-batch's; no per-micro-batch mean is ever averaged. The logged
loss and metrics are recomputed once on the whole mini-batch from the micro-batches' (stop-
gradient) logprobs, so quantiles and fractions are global too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def num_micro_batches(n: int, micro_batch_size: int) -> int:
    """k = n / micro_batch_size (1 when micro_batch_size is 0 or >= n); n must divide evenly."""
    if micro_batch_size <= 0 or micro_batch_size >= n:
        return 1
    if n % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch of {n}")
    return n // micro_batch_size


def split_micro(tree: Any, k: int) -> Any:
    """[N, ...] leaves -> [k, N / k, ...]; micro-batch j = samples j, j + k, j + 2k, ..."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), tree)


def merge_micro(tree: Any) -> Any:
    """Inverse of `split_micro`: [k, N / k, ...] -> [N, ...] in the original sample order."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def constrain(tree: Any, sharding: Any) -> Any:
    """`with_sharding_constraint` on every leaf (no-op when `sharding` is None)."""
    if sharding is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def map_micro(fn: Callable[[Any], Any], batch: Any, k: int, sharding: Any = None) -> Any:
    """`fn` over the k micro-batches of `batch` (one at a time, `lax.map`), outputs merged
    back to [N, ...]; k == 1 calls `fn` once on the whole batch. `sharding`: the batch
    sharding each micro-batch keeps inside the loop (XLA's propagation would otherwise
    replicate a loop's slices: a whole micro-batch on every device)."""
    if k == 1:
        return fn(batch)
    return merge_micro(jax.lax.map(lambda m: fn(constrain(m, sharding)), split_micro(batch, k)))


# Token-budget micro-batches (`train.max_tokens_per_micro_batch`): the mini-batch's sequences,
# sorted by length, packed into micro-batches of at most `budget` tokens per device, each padded
# only to the bucket length of its longest sequence. A micro-batch of bucket L holds
# `ranks x (budget // L)` rows, so its shape depends on L alone: one compiled program per
# bucket, whatever the lengths of a step.


def length_buckets(max_len: int, n: int, multiple: int = 8) -> tuple[int, ...]:
    """Up to `n` padded lengths, ascending: max_len, max_len / 2, max_len / 4, ... each rounded
    up to a multiple of `multiple` (never above max_len). A micro-batch pads to the smallest one
    that holds its longest sequence, so padding within a bucket is below one half of it."""
    if max_len < 1 or n < 1:
        raise ValueError(f"length_buckets needs max_len >= 1 and n >= 1, got {max_len}, {n}")
    sizes = {min(max_len, -(-math.ceil(max_len / 2**i) // multiple) * multiple) for i in range(n)}
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class PackedMicroBatch:
    """One token-budget micro-batch: rows padded to `length` tokens; `rows[j]` is the mini-batch
    sample in row j or -1 for a filler row. Rows are in rank blocks: rank r (of the `data x fsdp`
    devices that split samples) holds rows [r * per_rank, (r + 1) * per_rank)."""

    length: int
    rows: np.ndarray

    @property
    def samples(self) -> np.ndarray:
        return self.rows[self.rows >= 0]


def sequence_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Tokens per right-padded row: the last attended position + 1 (0 for an empty row)."""
    m = np.asarray(attention_mask) != 0
    last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
    return np.where(m.any(axis=1), last, 0)


def pack_token_budget(
    lengths: np.ndarray, budget: int, ranks: int, buckets: tuple[int, ...]
) -> list[PackedMicroBatch]:
    """Sequences (length 0 = left out: it adds nothing to the loss) sorted longest first, taken
    greedily: a micro-batch's bucket L is the smallest bucket >= its longest sequence, and it takes
    the next `ranks x (budget // L)` sequences (all no longer, since sorted), spread over the ranks
    in snake order (0, 1, .., R-1, R-1, .., 0, 0, ..) so their sequence counts differ by at most
    one and their token counts are balanced. Only a group's last micro-batch has filler rows."""
    lengths = np.asarray(lengths)
    if lengths.size and lengths.max() > buckets[-1]:
        raise ValueError(f"a sequence of {lengths.max()} tokens exceeds the largest bucket "
                         f"{buckets[-1]}")  # fmt: skip
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] > 0]
    out: list[PackedMicroBatch] = []
    i = 0
    while i < len(order):
        length = next(b for b in buckets if b >= lengths[order[i]])
        per_rank = budget // length
        if per_rank < 1:
            raise ValueError(f"a token budget of {budget} cannot hold one sequence of {length}")
        take = order[i : i + ranks * per_rank]
        rows = np.full(ranks * per_rank, -1, np.int64)
        for j, sample in enumerate(take):
            lap, pos = divmod(j, ranks)
            rank = pos if lap % 2 == 0 else ranks - 1 - pos
            rows[rank * per_rank + lap] = sample
        out.append(PackedMicroBatch(length, rows))
        i += len(take)
    return out


def padding_share(plan: list[PackedMicroBatch], lengths: np.ndarray) -> float:
    """The share of the plan's computed tokens (rows x padded length) that are padding."""
    computed = sum(p.rows.size * p.length for p in plan)
    real = sum(int(np.asarray(lengths)[p.samples].sum()) for p in plan)
    return 1.0 - real / computed if computed else 0.0


def take_rows(batch: dict[str, np.ndarray], p: PackedMicroBatch) -> dict[str, np.ndarray]:
    """The micro-batch's arrays: its rows, token arrays ([N, T]: tokens, attention_mask) cut to
    `p.length` columns, response-aligned ones ([N, R]) to min(R, length) (a response token sits
    before its sequence's end). Filler rows attend to one token and mask every response token,
    so they add exactly nothing to a loss or gradient and keep the attention finite."""
    filler = p.rows < 0
    idx = np.where(filler, 0, p.rows)
    out = {}
    for k, v in batch.items():
        x = np.array(v[idx])
        if x.ndim == 2:
            x = x[:, : p.length]
        x[filler] = 0
        out[k] = x
    if "attention_mask" in out:
        out["attention_mask"][filler, 0] = 1
    return out


def scatter_rows(
    plan: list[PackedMicroBatch], parts: list[np.ndarray], n: int, width: int
) -> np.ndarray:
    """Per-micro-batch [rows, w] arrays back to one [n, width] array in mini-batch order (zeros
    for samples no micro-batch holds and past each part's width)."""
    out = np.zeros((n, width), parts[0].dtype if parts else np.float32)
    for p, x in zip(plan, parts, strict=True):
        keep = p.rows >= 0
        out[p.rows[keep], : x.shape[1]] = x[keep]
    return out
