"""The FP8 KV cache (`models.kv_quant`, `models.kv_calibration`, the cache of
`models.functional`) against a float64 numpy reference of attention over the quantized cache
(`tests/reference/kv_fp8_ref.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import decode_step, left_padded_batch, prefill, tiny
from kv_fp8_ref import GRID, cache_values64, quantized_attention64, reference_logits

from models import decoding, fp8
from models import kv_quant as kvq
from models.attention import causal_allowed, causal_self_attention
from models.kv_calibration import calibrate_kv_scales

calibrate = jax.jit(calibrate_kv_scales, static_argnums=0, static_argnames="recipe")


def test_store_is_the_nearest_e4m3_value_and_saturates():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=4000) * 3.0, [0.0, 2000.0, -2000.0, 1e-9]])
    x = x.astype(np.float32)
    scale = jnp.float32(0.0123)
    codes = kvq.store(jnp.asarray(x), scale, kvq.storage_dtype("fp8", jnp.float32))
    assert codes.dtype == jnp.float8_e4m3fn
    got = np.asarray(kvq.load(codes, scale, jnp.float32), np.float64)
    np.testing.assert_array_equal(got, cache_values64(x, 0.0123).astype(np.float32))
    assert got[-3] == np.float32(448 * np.float32(0.0123)) and got[-2] == -got[-3]
    assert set(np.unique(np.asarray(codes, np.float64))) <= set(GRID)


def test_scales_map_the_calibrated_amax_to_448():
    s = kvq.kv_scales_from_amax(jnp.array([4.48, 0.0]), jnp.array([896.0, 1.0]))
    np.testing.assert_allclose(np.asarray(s.k), [0.01, np.finfo(np.float32).tiny], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(s.v), [2.0, 1 / 448], rtol=1e-7)


def test_fp8_kv_attention_equals_float64_reference():
    """GQA (4 query heads on 2 kv heads), left padding; K/V amax-scaled per tensor; the
    chunked attention (the prefill's) over K/V as the FP8 cache holds them."""
    rng = np.random.default_rng(1)
    b, t, h, kh, e = 2, 9, 4, 2, 16
    q, k, v = (rng.normal(size=(b, t, n, e)).astype(np.float32) for n in (h, kh, kh))
    k[0, 3, 1, 5] = 9.0  # one outlier sets the K scale
    mask = np.ones((b, t), bool)
    mask[1, :3] = False
    ks, vs = np.float32(np.abs(k).max() / 448), np.float32(np.abs(v).max() / 448)
    kr = kvq.round_trip(jnp.asarray(k), jnp.float32(ks), "fp8")
    vr = kvq.round_trip(jnp.asarray(v), jnp.float32(vs), "fp8")
    got = causal_self_attention(jnp.asarray(q), kr, vr, jnp.asarray(mask), impl="chunked", chunk=4)
    allowed = np.asarray(causal_allowed(jnp.asarray(mask)))
    want = quantized_attention64(q, k, v, allowed, ks, vs)
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=2e-6, rtol=0)
    # The quantization is visible at this tolerance: 1e30 scales leave every entry 0.
    flat = quantized_attention64(q, k, v, allowed, 1e30, 1e30)
    assert np.abs(flat[mask]).max() == 0 and np.abs(want[mask]).max() > 0.1


def test_fp8_cache_decoding_equals_float64_reference_model():
    """Prefill + decode steps with an FP8 cache calibrated on the prompts give the logits of
    the decoder whose every attention is the float64 reference over the quantized cache (f32
    rounding apart), and the calibrated scales put the code 448 (E4M3's largest) at each
    layer's largest prompt key and value: scale = amax / 448 of what the cache stores."""
    cfg, graphdef, params = tiny("tiny_qwen2")
    recipe = fp8.BF16
    tokens, mask = left_padded_batch(cfg.vocab_size, 10, (0, 2), seed=3)
    scales = calibrate(graphdef, params, tokens[:, :6], mask[:, :6], recipe=recipe)
    cache = decoding.init_cache(cfg, 2, 10, kv_cache_dtype="fp8", kv_scales=scales)
    last, cache = prefill(graphdef, params, tokens[:, :6], mask[:, :6], cache, recipe=recipe)
    # The cache is written by position: slot s of a row holds its position s.
    real = np.asarray(cache.mask[:, :6], bool)[None, :, None, :, None]
    for c in (cache.k, cache.v):  # per layer [B, K, S, E]
        top = np.where(real, np.abs(np.stack(c)[:, :, :, :6].astype(np.float64)), 0)
        np.testing.assert_array_equal(top.max(axis=(1, 2, 3, 4)), 448.0)
    steps = [last]
    for t in range(6, 10):
        logits, cache = decode_step(graphdef, params, tokens[:, t], cache, recipe=recipe)
        steps.append(logits)
    got = np.stack([np.asarray(x) for x in steps], axis=1)
    want = np.asarray(reference_logits(graphdef, params, tokens, mask, *scales, recipe=recipe))
    np.testing.assert_allclose(got, want[:, 5:], atol=1e-4, rtol=0)


def test_auto_and_bf16_storage_of_bf16_keys_change_nothing():
    """For bf16 compute, "auto" and "bf16" caches store and read back the very arrays."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)), jnp.bfloat16)
    for name in ("auto", "bf16"):
        assert kvq.storage_dtype(name, jnp.bfloat16) == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(kvq.round_trip(x, jnp.float32(7), name)), x)


def test_fp8_cache_refuses_missing_scales_and_unknown_dtypes():
    cfg, _, _ = tiny("tiny_qwen3")
    with pytest.raises(ValueError, match="kv_scales"):
        decoding.init_cache(cfg, 1, 4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="auto, bf16, fp8"):
        decoding.init_cache(cfg, 1, 4, kv_cache_dtype="fp8_e5m2")
