"""Batch-invariant numerics: a token's numbers independent of its batch, its padding, the
sequence length and the KV-cache size, so that the rollout engine (prefill + one-token decode
steps) and the trainer (one causal forward over prompt ++ response) compute the same bits.

Floating-point sums round differently when their order changes, and the order of every
reduction a forward runs (a GEMM's K sum, attention's sums over keys) is chosen by the kernel
from the operand shapes. Under an FP8 recipe such one-ulp differences are amplified by the
quantization grid, so an engine and a trainer that agree "to reduction order" still draw
independent rounding noise. With `ModelConfig.batch_invariant` the model runs three rules:

1. Token GEMMs run with at least `MIN_ROWS` rows (`rows_padded`): XLA:CPU's dot kernels compute
   every row of a product with M >= MIN_ROWS rows in one order that does not depend on M (it
   does for 2 <= M < ~61, where a small-M kernel sums in another order). The rows of a decode
   step are padded with zero rows; a training forward has more rows already. The weights'
   side (K and N) is the same on both sides. Whether a backend keeps this property is checked by
   `rows_invariant`, and `tests/models/test_invariant.py` pins it for the shapes of the models.
2. Attention is computed by position-aligned key chunks of `chunk` keys (`exact_attention`,
   `exact_decode_attention`): row b's key at RoPE position p is at column p (the trainer's
   rows are rotated left by their leading pads; the engine's KV cache is written by position,
   `models.decoding`), chunk c holds positions [c * chunk, (c + 1) * chunk), and the chunks
   are combined in increasing order by the online softmax. A chunk past a query's position is
   fully masked and leaves the running max, sum and accumulator unchanged bit for bit, so the
   number of chunks (sequence length, cache size) does not matter. Inside a chunk the two
   products q.k (over the head dim) and p.v (over the chunk's keys) and the softmax sum are
   elementwise products summed by `tree_sum`, not dot kernels or `jnp.sum`, whose order XLA
   picks from the shapes (rule 3).
3. Every other sum runs as a fixed tree of elementwise additions (`tree_sum`): RMSNorm's mean
   square and the log-softmax's sum of exponentials (`log_softmax`), which the engine's
   sampler and the trainer's log-prob head both call (`models.functional.log_probs`), with the
   temperature applied as a multiplication by its f32 reciprocal. Maxima need nothing: a max
   does not round.

Mixture-of-Experts layers follow the same rules (`models.moe`): the router's logits on padded
rows, its softmax and top-k weights by `tree_sum`, the grouped GEMMs on at least MIN_ROWS expert
rows, the experts' weighted outputs summed by `tree_sum` of exact products.

What breaks it (and so is refused by `rollout.on_policy: exact`): a tensor-parallel layer's
partial-sum all-reduce (its order depends on the shard count), a GPU GEMM that picks split-K
or its tile by shape (cuBLAS; the Pallas FP8 kernel loops over K in a fixed order with no
split-K and keeps the property), per-tensor activation scaling (`fp8_tensor`: the amax spans
the whole batch, so neighbours change a row's scale), top-k / top-p truncation (the
trainer scores the untruncated distribution), and an MoE model's trainer on several devices
(each runs its own tokens' expert rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from models.attention import chunked_backward, leading_pads, rotate_rows

# Rows below which XLA:CPU's dot kernels change their summation order (measured: M in 2..60
# differ from M >= 61 for the model's GEMM shapes); 64 leaves a margin.
MIN_ROWS = 64
# Keys per position-aligned attention chunk (and queries per block of a training forward).
CHUNK = 128
_NEG_INF = -1e30


@jax.custom_jvp
def exact_mul(a: Array, b: Array) -> Array:
    """a * b in f32, the correctly rounded product, which the compiler can never contract with
    a following addition into a fused multiply-add: whether LLVM contracts `a * b + c` depends
    on how XLA fused and vectorised the surrounding loop, so two programs (a decode step and a
    training forward) would round the same formula differently. The product's bits pass
    through an integer xor with a zero the compiler cannot see (an optimisation barrier's
    output), which leaves the value as it is and keeps the multiply a multiply.

    Differentiable as the product it is (`_exact_mul_jvp`): the integer round trip alone has no
    derivative, and a gradient through it would silently be zero."""
    return _exact_product(a, b)


def _exact_product(a: Array, b: Array) -> Array:
    p = a.astype(jnp.float32) * b.astype(jnp.float32)
    zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.uint32))
    bits = jax.lax.bitcast_convert_type(p, jnp.uint32) ^ zero
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@exact_mul.defjvp
def _exact_mul_jvp(primals: tuple[Array, Array], tangents: tuple[Array, Array]):
    """d(a b) = da b + a db, in f32; the value is `exact_mul`'s own bits."""
    a, b = primals
    da, db = tangents
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    tangent = jnp.asarray(da, jnp.float32) * b32 + a32 * jnp.asarray(db, jnp.float32)
    return _exact_product(a, b), tangent


def tree_sum(x: Array, axis: int = -1, *, keepdims: bool = False) -> Array:
    """Sum over `axis` by pairwise halving with elementwise adds: the reduced axis is moved to
    the front and, while it has n > 1 entries, entries [0, n/2) are added to [n/2, n) (an odd n
    gets a zero appended: exact). Every output element is the same fixed tree of additions,
    whatever the other axes' sizes; a `jnp.sum` is not (XLA vectorises a reduction across the
    other axes or along the reduced one depending on their sizes, and the order changes)."""
    axis = axis % x.ndim
    y = jnp.moveaxis(x, axis, 0)
    while y.shape[0] > 1:
        if y.shape[0] % 2:
            y = jnp.concatenate([y, jnp.zeros((1, *y.shape[1:]), y.dtype)])
        half = y.shape[0] // 2
        y = y[:half] + y[half:]
    y = y[0]
    return jnp.expand_dims(y, axis) if keepdims else y


def log_softmax(z: Float[Array, "... V"]) -> Float[Array, "... V"]:
    """`jax.nn.log_softmax` over the last axis with the sum of exponentials by `tree_sum`."""
    z = z.astype(jnp.float32)
    shifted = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return shifted - jnp.log(tree_sum(jnp.exp(shifted), keepdims=True))


def pad_rows(x: Array, min_rows: int = MIN_ROWS) -> tuple[Array, int]:
    """x [..., K] flattened to [M, K] with zero rows appended up to `min_rows`; and M."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m < min_rows:
        rows = jnp.pad(rows, ((0, min_rows - m), (0, 0)))
    return rows, m


def rows_padded(dot_general: Callable[..., Array]) -> Callable[..., Array]:
    """`dot_general` for a token operand x [..., K] contracted on its last axis with a weight
    [K, ...]: x runs as [max(M, MIN_ROWS), K] (rule 1 of the module docstring)."""

    def dot(lhs: Array, rhs: Array, dimension_numbers, *args, **kwargs) -> Array:
        (lc, _), (lb, _) = dimension_numbers
        if tuple(lb) or tuple(lc) != (lhs.ndim - 1,):
            return dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)
        rows, m = pad_rows(lhs)
        (_, rc), (_, rb) = dimension_numbers
        y = dot_general(rows, rhs, (((1,), rc), ((), rb)), *args, **kwargs)
        return y[:m].reshape(*lhs.shape[:-1], *y.shape[1:])

    return dot


def rows_invariant(k: int, n: int, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> bool:
    """Whether this backend's dot gives every row of x [M, k] @ w [k, n] the same bits for
    M = 1, MIN_ROWS and 4 * MIN_ROWS (rule 1): a cheap check of the property the exact mode
    rests on, for one GEMM shape."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((4 * MIN_ROWS, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    dims = (((1,), (0,)), ((), ()))
    padded = rows_padded(jax.lax.dot_general)
    dot = jax.jit(lambda a, b: padded(a, b, dims, preferred_element_type=jnp.float32))
    full = np.asarray(dot(x, w))
    for m in (1, 3, MIN_ROWS):
        part = np.asarray(dot(x[:m], w))
        if not np.array_equal(part, full[:m]):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Attention by position-aligned key chunks (rule 2)
# ----------------------------------------------------------------------------------------------


def _chunk_step(
    carry: tuple[Array, Array, Array],
    q: Float[Array, "B K G Q E"],
    k: Float[Array, "B K C E"],
    v: Float[Array, "B K C E"],
    allowed: Bool[Array, "B 1 1 Q C"],
) -> tuple[Array, Array, Array]:
    """One key chunk into the running (m, l, a): scores, probabilities and p.v as elementwise
    products reduced over the minor axis (f32; p cast to v's dtype first, as a flash kernel
    does). Fully masked for a query: its (m, l, a) come out unchanged."""
    m, denom, acc = carry
    e = q.shape[-1]
    # Head dim first: the halving adds of `tree_sum` then run over whole [.., C] rows.
    qf = jnp.moveaxis(q, -1, 0)[..., None]  # [E, B, K, G, Q, 1]
    kf = jnp.moveaxis(k, -1, 0)[:, :, :, None, None, :]  # [E, B, K, 1, 1, C]
    s = exact_mul(tree_sum(exact_mul(qf, kf), 0), np.float32(1.0 / np.sqrt(e)))  # [B,K,G,Q,C]
    s = jnp.where(allowed, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    denom = exact_mul(denom, corr) + tree_sum(p, -1)
    pf = jnp.moveaxis(p.astype(v.dtype), -1, 0)[..., None]  # [C, B, K, G, Q, 1]
    vf = jnp.moveaxis(v, 2, 0)[:, :, :, None, None, :]  # [C, B, K, 1, 1, E]
    acc = exact_mul(acc, corr[..., None]) + tree_sum(exact_mul(pf, vf), 0)
    return m_new, denom, acc


def _init(b: int, kh: int, g: int, q: int, e: int) -> tuple[Array, Array, Array]:
    return (
        jnp.full((b, kh, g, q), _NEG_INF, jnp.float32),
        jnp.zeros((b, kh, g, q), jnp.float32),
        jnp.zeros((b, kh, g, q, e), jnp.float32),
    )


def _aligned_forward(
    q: Array, k: Array, v: Array, lengths: Array, chunk: int
) -> tuple[Array, Array]:
    """(out [B, T, H, E] in q's dtype, lse [B, K, G, T'] f32) of position-aligned rows (row b's
    real tokens at columns [0, lengths[b])), queries and keys in blocks of `chunk`."""
    b, t, h, e = q.shape
    kh = k.shape[2]
    g = h // kh
    n = -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t), (0, 0), (0, 0))
    qb = jnp.pad(q, pad).reshape(b, n * chunk, kh, g, e).transpose(0, 2, 3, 1, 4)
    kb = jnp.pad(k, pad).transpose(0, 2, 1, 3)  # [B, K, S, E]
    vb = jnp.pad(v, pad).transpose(0, 2, 1, 3)
    cols = jnp.arange(chunk)

    def q_block(i: Array, bufs: tuple[Array, Array]) -> tuple[Array, Array]:
        out, lse = bufs
        q_i = jax.lax.dynamic_slice_in_dim(qb, i * chunk, chunk, axis=3)
        t_idx = i * chunk + cols

        def k_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis=2) for x in (kb, vb))
            s_idx = j * chunk + cols
            allowed = (s_idx[None, None, :] <= t_idx[None, :, None]) & (
                s_idx[None, None, :] < lengths[:, None, None]
            )
            return _chunk_step(carry, q_i, k_j, v_j, allowed[:, None, None])

        m, denom, acc = jax.lax.fori_loop(0, i + 1, k_block, _init(b, kh, g, chunk, e))
        o = (acc / denom[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, chunk, h, e)
        out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(q.dtype), i * chunk, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(denom), i * chunk, axis=3)
        return out, lse

    bufs = (jnp.zeros((b, n * chunk, h, e), q.dtype), jnp.zeros((b, kh, g, n * chunk), jnp.float32))
    out, lse = jax.lax.fori_loop(0, n, q_block, bufs)
    return out[:, :t], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _aligned(q: Array, k: Array, v: Array, key_mask: Array, chunk: int) -> Array:
    lengths = jnp.sum(key_mask, axis=1, dtype=jnp.int32)
    return _aligned_forward(q, k, v, lengths, chunk)[0]


def _aligned_fwd(q, k, v, key_mask, chunk):
    lengths = jnp.sum(key_mask, axis=1, dtype=jnp.int32)
    out, lse = _aligned_forward(q, k, v, lengths, chunk)
    return out, (q, k, v, key_mask, out, lse)


def _aligned_bwd(chunk, res, dout):
    # The gradient needs no bit-identity: FlashAttention-2's backward of `models.attention`,
    # over the same blocks (it recomputes p from lse, as any blockwise forward defines it).
    return chunked_backward(chunk, chunk, res, dout)


_aligned.defvjp(_aligned_fwd, _aligned_bwd)


def exact_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B T K E"],
    v: Float[Array, "B T K E"],
    key_mask: Bool[Array, "B T"],
    *,
    chunk: int,
) -> Float[Array, "B T H E"]:
    """Causal self-attention of rows whose real tokens are one contiguous run (left-padded
    prompts, prompt ++ response rows): each row rotated so its first real token is column 0,
    attended by position-aligned key chunks (module docstring, rule 2), rotated back; pad
    query rows give 0. The same numbers, token by token, as `exact_decode_attention` over a
    KV cache written by position."""
    key_mask = key_mask.astype(bool)
    first = leading_pads(key_mask)
    rotated = [rotate_rows(x, first) for x in (q, k, v)]
    out = _aligned(*rotated, rotate_rows(key_mask, first), chunk)
    out = rotate_rows(out, (key_mask.shape[1] - first) % key_mask.shape[1])
    return jnp.where(key_mask[:, :, None, None], out, 0).astype(q.dtype)


def exact_decode_attention(
    q: Float[Array, "B 1 H E"],
    k: Float[Array, "B K S E"],
    v: Float[Array, "B K S E"],
    position: Int[Array, " B"],
    *,
    chunk: int,
) -> Float[Array, "B 1 H E"]:
    """One query per row at `position[b]` over a KV cache written by position (slot p holds
    position p, `[B, K, S, E]`), keys 0..position[b] visible: the chunks of `exact_attention`
    in the same order, so the output equals that query's row of a full forward bit for bit."""
    b, _, h, e = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = h // kh
    n = -(-s // chunk)
    if n * chunk != s:
        pad = ((0, 0), (0, 0), (0, n * chunk - s), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    qg = q.reshape(b, 1, kh, g, e).transpose(0, 2, 3, 1, 4)  # [B, K, G, 1, E]
    cols = jnp.arange(chunk)

    def k_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis=2) for x in (k, v))
        allowed = (j * chunk + cols)[None, :] <= position[:, None]  # [B, C]
        return _chunk_step(carry, qg, k_j, v_j, allowed[:, None, None, None, :])

    n_used = jnp.max(position) // chunk + 1
    m, denom, acc = jax.lax.fori_loop(0, n_used, k_block, _init(b, kh, g, 1, e))
    out = (acc / denom[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, 1, h, e)
    return out.astype(q.dtype)
