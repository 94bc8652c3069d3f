"""Helpers shared by the trainer tests: the tiny config and the overrides that shrink it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def small(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """Overrides that shrink tiny_cpu.yaml to a few-second run (compiles aside). The run's
    compilation cache is the test session's (tests/conftest.py), else one in `cache_dir`."""
    jax_cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_dir / "jax"
    return [
        f"run_dir={run_dir}",
        f"warmstart.cache_dir={cache_dir}",
        f"train.jax_cache_dir={jax_cache}",
        "warmstart.steps=120",
        "warmstart.target_accuracy=0",
        "data.batch_size=4",
        "data.eval_size=16",
        "rollout.n=4",
        "train.steps=4",
        "train.mini_batches=2",
        "train.eval_every=2",
        "calibration.every=2",
        "checkpoint.every=2",
        "logging.console=none",
        *extra,
    ]


def full_optimization_env() -> dict[str, str]:
    """This environment with XLA:CPU's LLVM back at its default -O3, for a subprocess that runs
    a real model: tests/conftest.py lowers it to -O0 for the tiny programs that are mostly
    compile time, where a real model's steps are mostly run time (about twice as fast at -O3)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level")]  # fmt: skip
    return dict(os.environ, XLA_FLAGS=" ".join(flags), PYTHONPATH=str(REPO))


def random_batch(n: int, p: int, r: int, seed: int, vocab: int = 256) -> dict:
    """A packed batch of n samples (prompt <= p, response <= r tokens, right padded) with
    unequal prompt and response lengths, rewards in {0, 1} and rollout logprobs: the layout of
    `jfp8rl.data.batch.pack`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(n, p + r)).astype(np.int32)
    plen = rng.integers(2, p + 1, size=n).astype(np.int32)
    rlen = rng.integers(1, r + 1, size=n).astype(np.int32)
    attn = np.zeros((n, p + r), np.int32)
    resp_mask = np.zeros((n, r), np.float32)
    for i in range(n):
        attn[i, : plen[i] + rlen[i]] = 1
        resp_mask[i, : rlen[i]] = 1
    return {
        "tokens": tokens,
        "attention_mask": attn,
        "prompt_lens": plen,
        "response_mask": resp_mask,
        "rollout_logp": (-rng.uniform(0.5, 8.0, size=(n, r)) * resp_mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=n).astype(np.float32),
        "response_lens": rlen,
    }
