"""Chunked (online-softmax) and cuDNN attention against the reference, with GQA, left and
right padding, chunk sizes that do not divide T, and inside the full model (Qwen3 q/k norms)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import forward, left_padded_batch, max_intermediate_size, tiny

from models import fp8
from models import functional as F
from models.attention import (
    causal_allowed,
    causal_self_attention,
    chunked_attention,
    length_masked_attention,
    reference_attention,
    resolve_attention,
)

ON_GPU = jax.default_backend() == "gpu"


def _qkv(b, t, h, kh, e, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, e), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, t, kh, e), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, t, kh, e), jnp.float32).astype(dtype)
    return q, k, v


def _mask(t: int, left: tuple[int, ...], right: tuple[int, ...]) -> jnp.ndarray:
    """Row b: left[b] leading pads, right[b] trailing pads (one contiguous run of real tokens)."""
    m = np.ones((len(left), t), bool)
    for b, (lo, hi) in enumerate(zip(left, right, strict=True)):
        m[b, :lo] = False
        m[b, t - hi :] = False
    return jnp.asarray(m)


def _reference(q, k, v, mask):
    return reference_attention(q, k, v, causal_allowed(mask))


@pytest.mark.parametrize(("q_chunk", "k_chunk"), [(4, 3), (5, 5), (16, 16), (1, 7)])
def test_chunked_equals_reference_f32_gqa_padding(q_chunk, k_chunk):
    t = 11  # no chunk size above divides it (16 > T: one block)
    q, k, v = _qkv(3, t, 4, 2, 8)
    mask = _mask(t, left=(0, 4, 0), right=(0, 0, 3))  # unpadded, left-padded, right-padded
    ref = _reference(q, k, v, mask)
    out = chunked_attention(q, k, v, mask, q_chunk=q_chunk, k_chunk=k_chunk)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=0)
    assert np.all(np.asarray(out)[~real] == 0)  # pad query rows: 0

    w = jax.random.normal(jax.random.key(9), ref.shape) * mask[:, :, None, None]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    def chunked(q, k, v):
        return chunked_attention(q, k, v, mask, q_chunk=q_chunk, k_chunk=k_chunk)

    def reference(q, k, v):
        return _reference(q, k, v, mask)

    g = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_chunked_bf16_is_close_to_reference():
    q, k, v = _qkv(2, 37, 8, 2, 16, dtype=jnp.bfloat16)
    mask = _mask(37, left=(5, 0), right=(0, 6))
    ref = np.asarray(_reference(q, k, v, mask), np.float32)
    out = np.asarray(chunked_attention(q, k, v, mask, q_chunk=8, k_chunk=16), np.float32)
    real = np.asarray(mask)
    np.testing.assert_allclose(out[real], ref[real], atol=2e-2, rtol=0)


def test_chunked_never_builds_t_by_t_forward_or_backward():
    b, t, h, kh, e, c = 1, 512, 4, 2, 16, 64
    q, k, v = _qkv(b, t, h, kh, e)
    mask = jnp.ones((b, t), bool)

    def loss(q, k, v):
        return jnp.sum(chunked_attention(q, k, v, mask, q_chunk=c, k_chunk=c) ** 2)

    biggest = max_intermediate_size(
        jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v).jaxpr
    )
    assert biggest <= max(b * h * c * c, b * t * h * e), biggest  # a block, or an output
    assert biggest < b * h * t * t // 16


def test_model_with_chunked_attention_equals_reference():
    """Full forward and logprob gradients: chunked (blocks of 3, T = 10) vs reference, f32,
    left-padded rows; tiny_qwen3 has GQA, the q/k norms and head_dim 32 != hidden / heads."""
    cfg, _, params = tiny("tiny_qwen3")
    g_ref, _ = F.abstract_model(cfg.replace(attention="reference"))
    g_chk, _ = F.abstract_model(cfg.replace(attention="chunked", attention_chunk=3))
    tokens, mask = left_padded_batch(cfg.vocab_size, 10, (0, 4))
    real = np.asarray(mask).astype(bool)
    ref = np.asarray(forward(g_ref, params, tokens, mask, recipe=fp8.BF16))
    out = np.asarray(forward(g_chk, params, tokens, mask, recipe=fp8.BF16))
    np.testing.assert_allclose(out[real], ref[real], atol=1e-5, rtol=0)

    def loss(p, g):
        return F.token_logprobs(g, p, tokens, mask, recipe=fp8.BF16).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    chex.assert_trees_all_close(grad(params, g_chk), grad(params, g_ref), atol=1e-5, rtol=1e-4)


def test_padding_as_rotated_lengths_equals_reference():
    """The cudnn path's padding scheme (rotate each row so its real run starts at 0, pass
    lengths), through jax's "xla" implementation of the same API: checks it on CPU."""
    t = 13
    q, k, v = _qkv(4, t, 4, 2, 8)
    mask = _mask(t, left=(0, 5, 0, 2), right=(0, 0, 4, 3))
    ref = _reference(q, k, v, mask)
    out = length_masked_attention(q, k, v, mask, implementation="xla")
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=0)
    assert np.all(np.asarray(out)[~real] == 0)


def test_auto_is_chunked_off_gpu_and_for_f32():
    assert resolve_attention("auto", jnp.float32, 128) == "chunked"
    expected = "cudnn" if ON_GPU else "chunked"
    assert resolve_attention("auto", jnp.bfloat16, 128) == expected
    assert resolve_attention("reference", jnp.bfloat16, 128) == "reference"


def test_cudnn_refuses_f32_naming_the_key():
    q, k, v = _qkv(1, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="model.attention=chunked"):
        causal_self_attention(q, k, v, jnp.ones((1, 4), bool), impl="cudnn", chunk=4)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN flash attention needs a CUDA GPU (CPU backend)")
@pytest.mark.parametrize("t", [128, 77])
def test_cudnn_equals_reference_bf16_on_gpu(t):
    q, k, v = _qkv(4, t, 8, 2, 128, dtype=jnp.bfloat16)
    mask = _mask(t, left=(0, 9, 0, 30), right=(0, 0, 17, 0))
    ref = np.asarray(_reference(q, k, v, mask), np.float32)
    fn = jax.jit(lambda q, k, v: causal_self_attention(q, k, v, mask, impl="cudnn", chunk=64))
    out = np.asarray(fn(q, k, v), np.float32)
    real = np.asarray(mask)
    np.testing.assert_allclose(out[real], ref[real], atol=2e-2, rtol=0)
    w = jax.random.normal(jax.random.key(3), q.shape, jnp.float32) * mask[:, :, None, None]

    def loss(impl, q, k, v):
        out = causal_self_attention(q, k, v, mask, impl=impl, chunk=64)
        return jnp.sum(out.astype(jnp.float32) * w)

    g = jax.jit(jax.grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g, g_ref, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 1e-2
