"""Causal self-attention with GQA, three ways: reference, chunked (online softmax), cuDNN.

All compute, per query head h (kv head h // G, G = H / K) and with scale 1 / sqrt(E),

    out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(E) over allowed s) v[s],
    allowed(t, s) = s <= t and key_mask[s]          (columns of one left/right-padded row)

with scores and softmax in f32, the probabilities cast to v's dtype for the product with v
(f32 accumulation), the output in q's dtype. The Qwen3 q/k norms and RoPE are applied before
(`decoder.Attention.project_qkv`), so they are the same for every implementation.

Implementations (`ModelConfig.attention`):
  reference  builds [B, K, G, T, S] scores: the oracle of the tests, and the decode step's read
             of its KV cache ([B, H, 1, S], `reference_attention` with an explicit mask).
  chunked    FlashAttention-2's algorithm in plain XLA (Dao 2023, arXiv:2307.08691): query
             blocks of C_q, and for each a loop over the key blocks at or before its diagonal
             with a running max m, sum l and accumulator a (m' = max(m, max_s x_s),
             l' = l e^(m - m') + sum_s e^(x_s - m'), a' = a e^(m - m') + sum_s e^(x_s - m') v_s,
             out = a / l). A custom VJP keeps only out and lse = m + log l per query and
             recomputes each block's probabilities in the backward pass, so memory is linear
             in T in both passes (live blocks [B, H, C_q, C_k]). Runs anywhere.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN flash attention,
             GPU, bf16/fp16, head_dim % 8 == 0). cuDNN takes padding only as per-row lengths
             of a *right*-padded row, so each row is rotated left by its number of leading pads
             (its real tokens must be one contiguous run: left-padded prompts, right-padded
             prompt ++ response rows both are), attended with `query_seq_lengths =
             key_value_seq_lengths = #real tokens` and `is_causal`, and rotated back.
  auto       cudnn on a GPU backend when the dtype and head_dim allow it, else chunked.

Pad query rows (key_mask 0) are not defined by the formula; `reference` returns a finite
uniform mixture there (masked scores are a finite -1e30) and `chunked` / `cudnn` return 0.
They are masked out of every loss and logprob, and no real row reads them (they are masked as
keys), so only real rows are compared across implementations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from models.config import AttentionImpl

_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform, not a NaN, row
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def reference_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B S K E"],
    v: Float[Array, "B S K E"],
    allowed: Bool[Array, "B T S"],
    *,
    heads_major: bool = False,
) -> Float[Array, "B T H E"]:
    """softmax(q k^T / sqrt(E) + mask) v with GQA (query head h reads kv head h // (H/K)),
    as out = (p v) / sum_s p with p = exp(x - max_s x) (f32, cast to v's dtype for p v).

    `allowed[b, t, s]` is False where query t must not see key s. Normalising after the
    product (as FlashAttention does) makes a one-block `chunked_attention` the same sequence
    of roundings, so in bf16 the KV-cache decode step (this function) and the chunked prefill
    and training forward agree to f32 reduction order, not just to bf16 rounding.
    `heads_major`: k and v are given [B, K, S, E] (the KV cache's layout, which the products
    read without a transpose).
    """
    b, t, h, d = q.shape
    kv = "bksd" if heads_major else "bskd"
    kh = k.shape[1 if heads_major else 2]
    qg = q.reshape(b, t, kh, h // kh, d)
    scores = jnp.einsum(f"btkgd,{kv}->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * np.float32(1.0 / np.sqrt(d))
    scores = jnp.where(allowed[:, None, None, :, :], scores, _NEG_INF)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    out = jnp.einsum(f"bkgts,{kv}->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.sum(p, axis=-1)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def causal_allowed(key_mask: Bool[Array, "B T"]) -> Bool[Array, "B T T"]:
    """allowed[b, t, s] = s <= t and key_mask[b, s] (the [B, T, T] mask `reference` needs)."""
    t = key_mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return causal[None, :, :] & key_mask.astype(bool)[:, None, :]


def resolve_attention(impl: AttentionImpl, dtype: jnp.dtype, head_dim: int) -> str:
    """The implementation "auto" stands for here: cudnn on a GPU backend for bf16/fp16
    activations and head_dim <= 128, a multiple of 8 (cuDNN's flash-attention limits on
    pre-Hopper GPUs); chunked otherwise. Other names are returned as they are."""
    if impl != "auto":
        return impl
    cudnn_ok = jnp.dtype(dtype) in _CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if jax.default_backend() == "gpu" and cudnn_ok else "chunked"


def causal_self_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B T K E"],
    v: Float[Array, "B T K E"],
    key_mask: Bool[Array, "B T"],
    *,
    impl: AttentionImpl,
    chunk: int,
) -> Float[Array, "B T H E"]:
    """Causal self-attention of one padded batch by `impl` (module docstring); `chunk` is the
    query and key block length of "chunked"."""
    name = resolve_attention(impl, q.dtype, q.shape[-1])
    key_mask = key_mask.astype(bool)
    if name == "reference":
        return reference_attention(q, k, v, causal_allowed(key_mask))
    if name == "chunked":
        return chunked_attention(q, k, v, key_mask, q_chunk=chunk, k_chunk=chunk)
    if name == "cudnn":
        return cudnn_attention(q, k, v, key_mask)
    raise ValueError(f"attention={impl!r}: use one of auto, reference, chunked, cudnn")


# ----------------------------------------------------------------------------------------------
# chunked: blockwise online softmax with a recomputing custom VJP
# ----------------------------------------------------------------------------------------------


def _pad_axis1(x: Array, n: int, value: float | bool = 0) -> Array:
    """x padded with `value` along axis 1 to length n."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _slices(xs: tuple[Array, ...], start: Array, size: int, *, axis: int) -> tuple[Array, ...]:
    """x[start : start + size] along `axis` for each x (one block of each operand)."""
    return tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis) for x in xs)


def _block_scores(
    q_i: Array, k_j: Array, km_j: Array, q_start: Array, k_start: Array
) -> tuple[Array, Array]:
    """Scaled f32 scores [B, K, G, C_q, C_k] of one (query, key) block, masked to -1e30 where
    not allowed, and the allowed mask (causal by column, key padding)."""
    cq, ck, e = q_i.shape[1], k_j.shape[1], q_i.shape[-1]
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
    s = s * np.float32(1.0 / np.sqrt(e))
    t_idx = q_start + jnp.arange(cq)
    s_idx = k_start + jnp.arange(ck)
    allowed = (s_idx[None, :] <= t_idx[:, None])[None, None, None] & km_j[:, None, None, None, :]
    return jnp.where(allowed, s, _NEG_INF), allowed


def _chunked_forward(
    q: Array, k: Array, v: Array, key_mask: Array, cq: int, ck: int
) -> tuple[Array, Array]:
    """(out [B, T, H, E] in q's dtype, lse [B, K, G, Tq] f32) over padded blocks."""
    b, t, h, e = q.shape
    kh = k.shape[2]
    g = h // kh
    nq, nk = -(-t // cq), -(-t // ck)
    qg = _pad_axis1(q.reshape(b, t, kh, g, e), nq * cq)
    kp, vp = _pad_axis1(k, nk * ck), _pad_axis1(v, nk * ck)
    kmp = _pad_axis1(key_mask, nk * ck, False)

    def q_block(i: Array, bufs: tuple[Array, Array]) -> tuple[Array, Array]:
        out, lse = bufs
        q_start = i * cq
        q_i = jax.lax.dynamic_slice_in_dim(qg, q_start, cq, axis=1)

        def k_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            m, denom, acc = carry
            k_start = j * ck
            k_j, v_j, km_j = _slices((kp, vp, kmp), k_start, ck, axis=1)
            s, _ = _block_scores(q_i, k_j, km_j, q_start, k_start)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            denom = denom * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bkgqs,bskd->bkgqd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32
            )
            return m_new, denom, acc * corr[..., None] + pv

        init = (
            jnp.full((b, kh, g, cq), _NEG_INF, jnp.float32),
            jnp.zeros((b, kh, g, cq), jnp.float32),
            jnp.zeros((b, kh, g, cq, e), jnp.float32),
        )
        # Causal: only key blocks starting at or before this block's last query column.
        n_j = jnp.minimum(nk, (q_start + cq - 1) // ck + 1)
        m, denom, acc = jax.lax.fori_loop(0, n_j, k_block, init)
        o = (acc / denom[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, cq, h, e)
        out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(q.dtype), q_start, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(denom), q_start, axis=3)
        return out, lse

    bufs = (jnp.zeros((b, nq * cq, h, e), q.dtype), jnp.zeros((b, kh, g, nq * cq), jnp.float32))
    out, lse = jax.lax.fori_loop(0, nq, q_block, bufs)
    out = jnp.where(key_mask[:, :, None, None], out[:, :t], 0).astype(q.dtype)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(q: Array, k: Array, v: Array, key_mask: Array, cq: int, ck: int) -> Array:
    return _chunked_forward(q, k, v, key_mask, cq, ck)[0]


def _chunked_fwd(q, k, v, key_mask, cq, ck):
    out, lse = _chunked_forward(q, k, v, key_mask, cq, ck)
    return out, (q, k, v, key_mask, out, lse)


def chunked_backward(cq, ck, res, dout):
    """FlashAttention-2's backward: with P = exp(S - lse) recomputed per block,
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = dS K / sqrt(E),
    dK = dS^T Q / sqrt(E); key blocks outer, the query blocks at or after their diagonal inner."""
    q, k, v, key_mask, out, lse = res
    b, t, h, e = q.shape
    kh = k.shape[2]
    g = h // kh
    nq, nk = -(-t // cq), -(-t // ck)
    scale = np.float32(1.0 / np.sqrt(e))
    dout = jnp.where(key_mask[:, :, None, None], dout, 0)  # pad query rows output a constant 0
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, H]
    delta = _pad_axis1(delta.reshape(b, t, kh, g), nq * cq).transpose(0, 2, 3, 1)
    qg = _pad_axis1(q.reshape(b, t, kh, g, e), nq * cq)
    dog = _pad_axis1(dout.reshape(b, t, kh, g, e), nq * cq)
    kp, vp = _pad_axis1(k, nk * ck), _pad_axis1(v, nk * ck)
    kmp = _pad_axis1(key_mask, nk * ck, False)

    def k_block(j: Array, grads: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        dq, dk, dv = grads
        k_start = j * ck
        k_j, v_j, km_j = _slices((kp, vp, kmp), k_start, ck, axis=1)

        def q_block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            dq, dk_j, dv_j = carry
            q_start = i * cq
            q_i, do_i = _slices((qg, dog), q_start, cq, axis=1)
            lse_i, delta_i = _slices((lse, delta), q_start, cq, axis=3)
            s, allowed = _block_scores(q_i, k_j, km_j, q_start, k_start)
            p = jnp.where(allowed, jnp.exp(s - lse_i[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum(
                "bkgqs,bqkgd->bskd", p.astype(dout.dtype), do_i, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None])) * scale
            dq_i = jnp.einsum(
                "bkgqs,bskd->bqkgd", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32
            )
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, jax.lax.dynamic_slice_in_dim(dq, q_start, cq, axis=1) + dq_i, q_start, axis=1
            )
            dk_j = dk_j + jnp.einsum(
                "bkgqs,bqkgd->bskd", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32
            )
            return dq, dk_j, dv_j

        zeros_kv = jnp.zeros((b, ck, kh, e), jnp.float32)
        # Causal: only query blocks whose last column reaches this key block's first column.
        i0 = k_start // cq
        dq, dk_j, dv_j = jax.lax.fori_loop(i0, nq, q_block, (dq, zeros_kv, zeros_kv))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, k_start, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, k_start, axis=1)
        return dq, dk, dv

    grads = (
        jnp.zeros((b, nq * cq, kh, g, e), jnp.float32),
        jnp.zeros((b, nk * ck, kh, e), jnp.float32),
        jnp.zeros((b, nk * ck, kh, e), jnp.float32),
    )
    dq, dk, dv = jax.lax.fori_loop(0, nk, k_block, grads)
    dq = dq[:, :t].reshape(b, t, h, e).astype(q.dtype)
    return dq, dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype), None


_chunked.defvjp(_chunked_fwd, chunked_backward)


def chunked_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B T K E"],
    v: Float[Array, "B T K E"],
    key_mask: Bool[Array, "B T"],
    *,
    q_chunk: int = 512,
    k_chunk: int = 512,
) -> Float[Array, "B T H E"]:
    """Causal self-attention by blocks (module docstring, "chunked"); pad query rows give 0.

    Blocks are min(chunk, T) long; T need not be a multiple (the last block is padded with
    masked keys / dropped queries). Live memory: O(B H C_q C_k) scores plus O(B T H E) outputs,
    forward and backward.
    """
    t = q.shape[1]
    cq, ck = max(1, min(q_chunk, t)), max(1, min(k_chunk, t))
    return _chunked(q, k, v, key_mask.astype(bool), cq, ck)


# ----------------------------------------------------------------------------------------------
# cudnn
# ----------------------------------------------------------------------------------------------


def leading_pads(key_mask: Bool[Array, "B T"]) -> Array:
    """Pads before each row's first real token (0 for an all-pad row)."""
    lengths = jnp.sum(key_mask, axis=1, dtype=jnp.int32)
    return jnp.where(lengths > 0, jnp.argmax(key_mask, axis=1), 0).astype(jnp.int32)


def rotate_rows(x: Array, shift: Array) -> Array:
    """y[b, t] = x[b, (t + shift[b]) mod T] along axis 1 (a per-row roll to the left)."""
    t = x.shape[1]
    idx = (jnp.arange(t)[None, :] + shift[:, None]) % t
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def cudnn_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B T K E"],
    v: Float[Array, "B T K E"],
    key_mask: Bool[Array, "B T"],
) -> Float[Array, "B T H E"]:
    """cuDNN flash attention for rows whose real tokens form one contiguous run (module
    docstring, "cudnn"); pad query rows give 0. Needs a CUDA GPU, bf16/fp16 q/k/v and
    head_dim % 8 == 0 (<= 128 before Hopper), else cuDNN raises at compile time."""
    if jnp.dtype(q.dtype) not in _CUDNN_DTYPES:
        raise ValueError(
            f"attention='cudnn' needs bf16/fp16 activations, got {q.dtype}; set "
            "model.compute_dtype=bfloat16 or model.attention=chunked"
        )
    return length_masked_attention(q, k, v, key_mask, implementation="cudnn")


def length_masked_attention(
    q: Float[Array, "B T H E"],
    k: Float[Array, "B T K E"],
    v: Float[Array, "B T K E"],
    key_mask: Bool[Array, "B T"],
    *,
    implementation: str,
) -> Float[Array, "B T H E"]:
    """`jax.nn.dot_product_attention(implementation=...)` with the padding given as per-row
    lengths: each row is rotated left by its leading pads, so its real run starts at column 0,
    attended with `is_causal` and q/kv lengths = #real, and rotated back; pad query rows give 0.
    "cudnn" in production; "xla" (the same API and length semantics) tests the rotation on CPU.
    """
    t = key_mask.shape[1]
    lengths = jnp.sum(key_mask, axis=1, dtype=jnp.int32)
    first = leading_pads(key_mask)
    # An all-pad row keeps one (masked-out) key so cuDNN never sees length 0.
    lengths = jnp.maximum(lengths, 1)
    out = jax.nn.dot_product_attention(
        rotate_rows(q, first),
        rotate_rows(k, first),
        rotate_rows(v, first),
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    out = rotate_rows(out, (t - first) % t)
    return jnp.where(key_mask[:, :, None, None], out, 0).astype(q.dtype)
