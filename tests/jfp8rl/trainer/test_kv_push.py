"""The FP8 KV-cache scales the trainer pushes to servers (`jfp8rl.trainer.backends.kv_scale_push`):
amax / 448 per layer of the pushed params' keys and values on the step's rollout, or on the
left-padded eval prompts before any rollout; nothing for the embedded engine or an unquantized
cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8rl.config import ConfigError, RolloutConfig
from jfp8rl.trainer.backends import kv_scale_push
from models import functional as mf
from models.config import get_config
from models.fp8 import get_recipe
from models.kv_calibration import kv_amax
from rollout_bridge.weights.kv_scales import kv_scale_name


def test_kv_scale_push_is_amax_over_448_of_the_rollout_or_the_prompts():
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32)
    graphdef, params = mf.init_model(cfg, 0)
    r = RolloutConfig(backend="http", kv_cache_dtype="fp8", recipe="bf16", max_num_seqs=2)
    tokens = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [1, 2, 3, 4]], np.int32)
    mask = (tokens > 0).astype(np.int32)
    got = kv_scale_push(r, graphdef, params, (tokens, mask), [])
    # The first max_num_seqs rows.
    amax = jax.jit(kv_amax, static_argnums=0, static_argnames="recipe")
    k, v = amax(graphdef, params, tokens[:2], mask[:2], recipe=get_recipe("bf16"))
    assert len(got) == 2 * cfg.num_layers
    for layer in range(cfg.num_layers):
        for kind, amax in (("k", k), ("v", v)):
            x = got[kv_scale_name(layer, kind)]
            assert x.dtype == np.float32 and x.shape == ()
            np.testing.assert_allclose(x, np.float32(amax[layer]) / np.float32(448), rtol=1e-6)
    # Before any rollout: the prompts, left-padded (amax ignores the pads).
    first = kv_scale_push(r, graphdef, params, None, [[5, 6, 7, 8], [9, 10]])
    for name, x in first.items():
        np.testing.assert_allclose(x, got[name], rtol=1e-6)
    assert kv_scale_push(RolloutConfig(backend="http"), graphdef, params, None, []) == {}
    embedded = RolloutConfig(backend="embedded", kv_cache_dtype="fp8")
    assert kv_scale_push(embedded, graphdef, params, (tokens, mask), []) == {}


def test_kv_cache_dtype_is_validated_naming_the_key():
    assert RolloutConfig().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_dtype='fp8_e5m2'.*'fp8'"):
        RolloutConfig(kv_cache_dtype="fp8_e5m2")
