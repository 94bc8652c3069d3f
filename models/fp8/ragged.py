"""`jax.lax.ragged_dot` (rows sorted by group times one [K, N] matrix per group) without the
dense expansion XLA:CPU lowers it to.

On GPU and TPU `jax.lax.ragged_dot` is a grouped GEMM. On CPU, JAX lowers it by expanding the
rows into a [G, M, K] copy masked per group and contracting over G and K together: G times the
memory and the work of the GEMM itself (and its transpose for the weights' gradient, [G, M, N]).
For a Mixture-of-Experts layer at scale that is the whole budget (Qwen3-30B-A3B: 128 experts,
one 9K-token sequence: 72 GiB for one expansion). `ragged_dot` here runs, on CPU and above
`DENSE_LIMIT_BYTES` of expansion, a loop over (row tile, group) work items instead: every row
tile is multiplied by the matrix of each group it holds rows of, the rows outside the group
masked to zero, so the work is that of the GEMM plus at most one tile per group boundary, and
the memory that of the operands and the output. Items past the real rows (padding) are skipped.
Each output row is one group's dot product, the same sum as the dense form's up to f32
summation order. Small problems, and every problem on other backends, keep `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Above this many bytes of XLA:CPU's dense expansion ([G, M, max(K, N)] f32), the tiled loop.
# High enough that the CPU-sized MoE models (tests, the tiny configs) keep XLA's lowering in
# every program, whatever its batch, so their numbers do not depend on the batch size.
DENSE_LIMIT_BYTES = 1 << 30
# Rows per work item of the tiled loop.
ROW_TILE = 512


def ragged_dot(
    a: Float[Array, "M K"],
    b: Float[Array, "G K N"],
    group_sizes: Int[Array, " G"],
    *,
    precision: jax.lax.PrecisionLike = None,
    tiled: bool | None = None,
) -> Float[Array, "M N"]:
    """`jax.lax.ragged_dot(a, b, group_sizes, precision=precision,
    preferred_element_type=float32)`: rows [start_g, start_g + group_sizes[g]) of `a` times
    b[g], rows past the groups 0; f32. `tiled`: force the tiled loop (True) or
    `jax.lax.ragged_dot` (False); None decides by backend and size (module doc)."""
    (m, k), (g, _, n) = a.shape, b.shape
    if tiled is None:
        dense = g * m * max(k, n) * 4
        tiled = jax.default_backend() == "cpu" and dense > DENSE_LIMIT_BYTES
    if not tiled:
        return jax.lax.ragged_dot(
            a, b, group_sizes, precision=precision, preferred_element_type=jnp.float32
        )
    return _tiled(a, b, group_sizes.astype(jnp.int32), precision, min(ROW_TILE, m))


def _tiled(a: Array, b: Array, sizes: Array, precision, tile: int) -> Array:
    a, b = jnp.asarray(a), jnp.asarray(b)
    (m, _), (g, _, n) = a.shape, b.shape
    tiles = -(-m // tile)
    a = jnp.pad(a, ((0, tiles * tile - m), (0, 0)))
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    # The tiles each group touches; consecutive groups share at most their boundary tile, so
    # there are at most tiles + G - 1 (tile, group) items.
    count = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)
    item_ends = jnp.cumsum(count)

    def item(out: Array, i: Array) -> tuple[Array, None]:
        grp = jnp.minimum(jnp.searchsorted(item_ends, i, side="right"), g - 1)
        t = first[grp] + i - (item_ends[grp] - count[grp])

        def run(out: Array) -> Array:
            rows = jax.lax.dynamic_slice_in_dim(a, t * tile, tile)
            y = jnp.dot(rows, b[grp], precision=precision, preferred_element_type=jnp.float32)
            r = t * tile + jnp.arange(tile)
            y = jnp.where(((r >= starts[grp]) & (r < ends[grp]))[:, None], y, 0.0)
            cur = jax.lax.dynamic_slice_in_dim(out, t * tile, tile)
            return jax.lax.dynamic_update_slice_in_dim(out, cur + y, t * tile, 0)

        return jax.lax.cond(i < item_ends[-1], run, lambda o: o, out), None

    out = jnp.zeros((tiles * tile, n), jnp.float32)
    # Inside `jax.shard_map` the output varies over the mesh axes its operands vary over.
    vma = set().union(*(_varying(x) for x in (a, b, sizes)))
    if vma:
        out = jax.lax.pcast(out, tuple(sorted(vma)), to="varying")
    out, _ = jax.lax.scan(item, out, jnp.arange(tiles + g - 1))
    return out[:m]


def _varying(x: Array) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside `jax.shard_map` (none outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", None) or getattr(aval, "vma", ()))
