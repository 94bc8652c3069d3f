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

from collections.abc import Callable
from typing import Any

import jax


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
