"""The one timing helper of the benchmark scripts (they print ratios, never assert time)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` runs, after one compile/warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_median_seconds(
    programs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]], *, repeats: int
) -> dict[str, float]:
    """Median wall time of each `fn(*args)` of `programs` (name -> (fn, args)), timed
    round-robin after one warm-up run each: every round runs each program once, so a load that
    comes and goes on a shared machine falls on all of them alike. Round r starts at program
    r (mod their number): one that leaves the machine busy after it returns (a server's
    spinning worker threads) does not always slow the same next one."""
    for fn, args in programs.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in programs}
    order = list(programs)
    for r in range(repeats):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            fn, args = programs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
