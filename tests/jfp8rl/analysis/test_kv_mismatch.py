"""The audit's FP8 KV-cache mismatch (`jfp8rl.analysis.kv_mismatch`) against numpy: the KL,
in float64, between the decoder whose attention is the float64 reference over the FP8 cache
(`tests/reference/kv_fp8_ref.py`) and the unrounded forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from bridge_support import sharp_hf_state
from kv_fp8_ref import reference_logits

from jfp8rl.analysis.kv_mismatch import kv_cache_mismatch
from models import fp8
from models import functional as mf
from models.config import get_config
from models.hf_io import from_hf_state_dict
from models.kv_calibration import calibrate_kv_scales


def _log_softmax64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_kv_cache_mismatch_equals_float64_kl():
    cfg = get_config("tiny_qwen2", compute_dtype=jnp.float32)
    graphdef, _ = mf.init_model(cfg, 0)
    params = from_hf_state_dict(cfg, sharp_hf_state(cfg, 1))  # peaked: a KL well above noise
    recipe = fp8.get_recipe("bf16")
    rng = np.random.default_rng(0)
    # RolloutBatch layout: prompt at 0, response after it, right padded; R = 4.
    tokens = rng.integers(1, cfg.vocab_size, (3, 10)).astype(np.int32)
    prompt_lens = np.array([3, 5, 2], np.int32)
    response_lens = np.array([4, 3, 4], np.int32)
    mask = (np.arange(10)[None] < (prompt_lens + response_lens)[:, None]).astype(np.int32)
    tokens = tokens * mask
    response_mask = (np.arange(4)[None] < response_lens[:, None]).astype(np.float32)
    response_mask[1] = 0  # a group left out of the loss
    got = kv_cache_mismatch(graphdef, params, tokens, mask, prompt_lens, response_mask, recipe)

    scales = jax.jit(calibrate_kv_scales, static_argnums=0, static_argnames="recipe")(
        graphdef, params, tokens, mask, recipe=recipe
    )
    lp8 = _log_softmax64(reference_logits(graphdef, params, tokens, mask, *scales, recipe=recipe))
    forward = jax.jit(mf.forward, static_argnums=0, static_argnames="recipe")
    lp = _log_softmax64(forward(graphdef, params, tokens, mask, recipe=recipe))
    kls, dl = [], []
    for i in (0, 2):
        for j in range(response_lens[i]):
            t = prompt_lens[i] + j - 1  # the position predicting response token j
            kls.append(np.sum(np.exp(lp8[i, t]) * (lp8[i, t] - lp[i, t])))
            dl.append(abs(lp8[i, t, tokens[i, t + 1]] - lp[i, t, tokens[i, t + 1]]))
    assert np.mean(kls) > 1e-4  # the FP8 cache moves the distribution
    np.testing.assert_allclose(got["kv_fp8_kl_mean"], np.mean(kls), rtol=2e-2)
    np.testing.assert_allclose(got["kv_fp8_kl_max"], np.max(kls), rtol=2e-2)
    np.testing.assert_allclose(got["kv_fp8_abs_dlogp_mean"], np.mean(dl), rtol=2e-2)
