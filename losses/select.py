"""Exact threshold search on positive float32 values without sorting.

`search_min(v, w, target, lo, hi)` returns the smallest float32 x in [lo, hi] with

    F(x) = sum_i w_i [v_i < x]  >=  target          (w_i >= 0, so F is non-decreasing)

exactly (to the float32 grid), which gives order statistics (w = 1: the k-th smallest value
is the x found for target k+1, minus one ulp) and the balance threshold of Calibrated Clipping
(w = A r). Why not a sort: XLA's sort of B*T keys costs many times the clipped loss itself
(`python benchmarks/loss_overhead.py` times the solver beside a key-value sort); this is two
histogram passes instead. Positive float32
values order like their int32 bit patterns, so the search runs on bits: pass 1 bins [lo, hi]
into <= 4096 buckets of 2^s consecutive floats (a scatter-add of w), a cumulative sum locates
the bucket where F crosses `target`; pass 2 bins that bucket at one-ulp resolution. lo and hi
are static (trace-time) floats, so all shapes are static. Entries with w = 0 never matter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

_LEVEL1_BITS = 12


def _bits(x: float) -> int:
    return int(np.asarray(x, np.float32).view(np.int32))


def float_bits(x: Array) -> Array:
    """The int32 bit pattern of float32 `x` (monotone in x for x >= 0)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def from_bits(b: Array) -> Array:
    """float32 from its int32 bit pattern."""
    return jax.lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def prev_float(x: Array) -> Array:
    """The largest float32 below x."""
    return jnp.nextafter(x.astype(jnp.float32), jnp.float32(-jnp.inf))


def search_min(v: Array, w: Array, target: Array, lo: float, hi: float) -> tuple[Array, Array]:
    """(x, found): the smallest float32 x in [lo, hi] with sum_i w_i [v_i < x] >= target.

    v: positive float32 values (any shape; flattened); w: non-negative weights, same shape;
    target: scalar; lo, hi: static floats with 0 < lo <= hi. found is False when even hi
    falls short; x is then hi. If F(lo) >= target already, x = lo.
    """
    if not 0.0 < lo <= hi:
        raise ValueError(f"search_min needs static 0 < lo <= hi, got lo={lo}, hi={hi}")
    base, top = _bits(lo), _bits(hi)
    span = top - base + 1
    shift = max(span.bit_length() - _LEVEL1_BITS, 0)
    n1 = ((span - 1) >> shift) + 1
    n2 = 1 << shift
    vb = float_bits(v.reshape(-1))
    w = w.reshape(-1).astype(jnp.float32)
    target = jnp.asarray(target, jnp.float32)

    below = jnp.sum(jnp.where(vb < base, w, 0.0))
    in1 = (vb >= base) & (vb <= top)
    idx1 = jnp.where(in1, (vb - base) >> shift, n1)  # n1: the overflow segment, dropped
    cum1 = below + jnp.cumsum(jax.ops.segment_sum(jnp.where(in1, w, 0.0), idx1, n1 + 1)[:n1])
    j = jnp.minimum(jnp.searchsorted(cum1, target, side="left"), n1 - 1)
    base2 = base + (j << shift)
    in2 = (vb >= base2) & (vb < base2 + n2) & (vb <= top)
    idx2 = jnp.where(in2, vb - base2, n2)
    before = jnp.where(j > 0, cum1[jnp.maximum(j - 1, 0)], below)
    cum2 = before + jnp.cumsum(jax.ops.segment_sum(jnp.where(in2, w, 0.0), idx2, n2 + 1)[:n2])
    m = jnp.searchsorted(cum2, target, side="left")
    # cum1[j] and cum2[-1] sum the same bucket in different orders, so float rounding can
    # leave cum2 just short of a target that cum1[j] reached: the crossing is then the
    # bucket's last non-empty bin (otherwise the search would report "not found" and x = hi).
    last = jnp.max(jnp.where(in2 & (w > 0), idx2, 0))
    m = jnp.where((m >= n2) & (cum1[j] >= target), last, m)
    # F(from_bits(base2 + m + 1)) = cum2[m]: the crossing value is at base2 + m, x one ulp above.
    x_bits = base2 + m + 1
    at_lo = below >= target
    found = at_lo | ((m < n2) & (x_bits <= top) & (cum1[-1] >= target))
    x = jnp.where(at_lo, jnp.float32(lo), jnp.where(found, from_bits(x_bits), jnp.float32(hi)))
    return x, found


def order_statistics(v: Array, valid: Array, ks: Array, lo: float, hi: float) -> Array:
    """The ks-th smallest (0-based) of the valid values, clamped to [lo, hi]; one search per k."""
    w = valid.reshape(-1).astype(jnp.float32)
    v = jnp.where(valid, v, jnp.float32(lo)).reshape(-1)

    def one(k: Array) -> Array:
        x, found = search_min(v, w, k + 1.0, lo, hi)
        return jnp.where(found, jnp.maximum(prev_float(x), lo), hi)

    ks = jnp.asarray(ks, jnp.float32).reshape(-1)
    # A loop, not vmap: a batched scatter is several times slower on XLA:CPU than k plain ones.
    return jnp.stack([one(ks[i]) for i in range(ks.shape[0])])
