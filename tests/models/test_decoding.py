"""KV-cache decoding equals the full forward at every position; padding leaves real tokens alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import TINY, decode_step, forward, left_padded_batch, prefill, tiny

from models import decoding, fp8


def _decode_all(cfg, graphdef, params, tokens, mask, prompt_len, recipe):
    """Logits of prefill (column prompt_len - 1) and of each decode step, as [B, n, V]."""
    cache = decoding.init_cache(cfg, tokens.shape[0], tokens.shape[1] + 2)
    last, cache = prefill(
        graphdef, params, tokens[:, :prompt_len], mask[:, :prompt_len], cache, recipe=recipe
    )
    out = [last]
    for t in range(prompt_len, tokens.shape[1]):
        logits, cache = decode_step(graphdef, params, tokens[:, t], cache, recipe=recipe)
        out.append(logits)
    assert int(cache.index) == tokens.shape[1]
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(mask).sum(1))
    return np.stack([np.asarray(x) for x in out], axis=1)


def _shifted_batch(vocab: int, t: int, pads: tuple[int, ...]):
    """Row b = pads[b] pad tokens, then the first t - pads[b] tokens of one shared sequence."""
    base = np.random.RandomState(5).randint(1, vocab, size=t)
    tokens = np.full((len(pads), t), -1, np.int32)  # pad id -1: out of range on purpose
    mask = np.zeros((len(pads), t), np.int32)
    for b, p in enumerate(pads):
        tokens[b, p:] = base[: t - p]
        mask[b, p:] = 1
    return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.mark.parametrize("name", TINY)
def test_kv_decoding_and_padding_f32(name):
    cfg, graphdef, params = tiny(name)
    pads = (0, 3, 5)
    # Prompts of 7, 4 and 2 real tokens left-padded to 7, then 5 generated tokens each.
    tokens, mask = _shifted_batch(cfg.vocab_size, 12, pads)
    full = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    # Padding: a row's real-token logits equal the unpadded row's at the same real position.
    for b, p in enumerate(pads):
        np.testing.assert_allclose(full[b, p:], full[0, : 12 - p], atol=2e-6, rtol=0)
    steps = _decode_all(cfg, graphdef, params, tokens, mask, 7, fp8.BF16)
    np.testing.assert_allclose(steps, full[:, 6:], atol=2e-6, rtol=0)


def test_kv_decoding_equals_full_forward_bf16_fp8_block():
    """bf16 compute with FP8 block scaling (per-token activation tiles): the cached keys and
    values are the same bf16 numbers the full forward computes, so only reduction order
    differs."""
    cfg, graphdef, params = tiny("tiny_qwen3", f32=False)
    tokens, mask = left_padded_batch(cfg.vocab_size, 10, (0, 2))
    recipe = fp8.FP8_BLOCK
    full = np.asarray(forward(graphdef, params, tokens, mask, recipe=recipe))
    steps = _decode_all(cfg, graphdef, params, tokens, mask, 6, recipe)
    np.testing.assert_allclose(steps, full[:, 5:], atol=2e-2, rtol=0)
    # Greedy choices agree (what the rollout engine acts on).
    np.testing.assert_array_equal(steps.argmax(-1), full[:, 5:].argmax(-1))
