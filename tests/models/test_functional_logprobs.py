"""token_logprobs / token_entropy against float64 numpy on the model's own logits."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from _model_testlib import forward, left_padded_batch, log_softmax64, max_intermediate_size, tiny

from models import fp8
from models import functional as F

T = 11


def _reference(logits, tokens, mask, temperature=1.0):
    """float64: logp[t] = log_softmax(z[t-1])[tok[t]], entropy of softmax(z[t-1]); 0 where
    token t or t-1 is padding, and at t = 0."""
    z = np.asarray(logits, np.float64) / temperature
    logp = log_softmax64(z)
    tok = np.asarray(tokens)
    m = np.asarray(mask).astype(bool)
    lp = np.zeros(tok.shape)
    ent = np.zeros(tok.shape)
    lp[:, 1:] = np.take_along_axis(logp[:, :-1], tok[:, 1:, None], -1)[..., 0]
    ent[:, 1:] = -(np.exp(logp[:, :-1]) * logp[:, :-1]).sum(-1)
    valid = np.zeros(tok.shape, bool)
    valid[:, 1:] = m[:, 1:] & m[:, :-1]
    return np.where(valid, lp, 0.0), np.where(valid, ent, 0.0)


class TokenLogprobsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_float64_log_softmax(self):
        cfg, graphdef, params = tiny("tiny_llama")
        tokens, mask = left_padded_batch(cfg.vocab_size, T, (0, 4))
        logits = forward(graphdef, params, tokens, mask, recipe=fp8.BF16)
        for chunk, temp in ((4, 1.0), (T, 0.7)):  # 4 does not divide T
            fn = self.variant(
                functools.partial(
                    F.token_logprobs_and_entropy,
                    graphdef,
                    recipe=fp8.BF16,
                    chunk_size=chunk,
                    temperature=temp,
                )
            )
            lp, ent = fn(params, tokens, mask)
            chex.assert_shape((lp, ent), (2, T))
            ref_lp, ref_ent = _reference(logits, tokens, mask, temp)
            np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=2e-6, rtol=1e-6)
            np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-6, rtol=1e-6)
        np.testing.assert_array_equal(
            np.asarray(F.token_logprobs(graphdef, params, tokens, mask, recipe=fp8.BF16)),
            np.asarray(
                F.token_logprobs_and_entropy(graphdef, params, tokens, mask, recipe=fp8.BF16)[0]
            ),
        )

    @chex.variants(with_jit=True)
    def test_chunked_gradient_equals_naive_gradient(self):
        cfg, graphdef, params = tiny("tiny_qwen2")
        tokens, mask = left_padded_batch(cfg.vocab_size, T, (0, 3))
        resp = jnp.asarray(mask).at[:, :6].set(0)

        def chunked(p):
            lp, ent = F.token_logprobs_and_entropy(
                graphdef, p, tokens, mask, recipe=fp8.BF16, chunk_size=3
            )
            return jnp.sum((lp + 0.1 * ent) * resp)

        def naive(p):
            z = F.forward(graphdef, p, tokens, mask, recipe=fp8.BF16)[:, :-1]
            logp = jax.nn.log_softmax(z, -1)
            lp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
            ent = -jnp.sum(jnp.exp(logp) * logp, -1)
            return jnp.sum((lp + 0.1 * ent) * resp[:, 1:])

        g_chunked = self.variant(jax.grad(chunked))(params)
        g_naive = self.variant(jax.grad(naive))(params)
        chex.assert_trees_all_close(g_chunked, g_naive, atol=1e-6, rtol=1e-5)


def test_no_full_logits_block_in_forward_or_backward():
    """With a vocabulary much wider than the model, nothing of size B*T*V is ever built."""
    cfg, _, _ = tiny("tiny_qwen3")
    cfg = cfg.replace(vocab_size=4096)
    graphdef, params = F.abstract_model(cfg)
    b, t, chunk = 2, 256, 8  # B*T*V = 2M floats; the head kernel D*V is 262k
    tokens = jnp.zeros((b, t), jnp.int32)
    mask = jnp.ones((b, t), jnp.int32)

    def loss(p):
        return F.token_logprobs(graphdef, p, tokens, mask, recipe=fp8.BF16, chunk_size=chunk).sum()

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr
    biggest = max_intermediate_size(jaxpr)
    assert biggest < b * t * cfg.vocab_size // 2
