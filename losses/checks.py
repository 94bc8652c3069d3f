"""Trace-time argument checks shared by every loss function.

Shapes and dtypes are static under `jax.jit`, so these checks run once at trace time and cost
nothing at run time. Every error names the argument and says what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import Array

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def check_float(name: str, x: Array, ndim: int | None = None) -> None:
    """Raise `TypeError` unless `x` is a floating array (of `ndim` dims when given)."""
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"argument `{name}` must be a floating-point array, got "
            f"{getattr(x, 'dtype', type(x).__name__)}; cast it with .astype(jnp.float32)"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"argument `{name}` must have {ndim} dims, got shape {tuple(x.shape)}")


def check_mask(name: str, mask: Array) -> None:
    """A response mask is a 2-D [B, T] array of bool or numbers in {0, 1}."""
    if not hasattr(mask, "dtype"):
        raise TypeError(f"argument `{name}` must be an array, got {type(mask).__name__}")
    if mask.ndim != 2:
        raise ValueError(f"argument `{name}` must be a [B, T] mask, got shape {tuple(mask.shape)}")


def check_same_shape(ref_name: str, ref: Array, **others: Array | None) -> None:
    """Raise `ValueError` naming the first argument whose shape differs from `ref`'s."""
    for name, x in others.items():
        if x is None:
            continue
        if tuple(x.shape) != tuple(ref.shape):
            raise ValueError(
                f"argument `{name}` has shape {tuple(x.shape)} but `{ref_name}` has shape "
                f"{tuple(ref.shape)}; all per-token inputs must be [B, T] with the same B and T"
            )


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"argument `{name}`={value!r} is not one of {tuple(choices)}")


def as_float_mask(mask: Array) -> Array:
    """The mask as float32 0/1 (bool and integer masks are accepted)."""
    return (mask != 0).astype(jnp.float32)
