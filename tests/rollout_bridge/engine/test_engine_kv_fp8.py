"""The embedded engine with an FP8 KV cache: its sampled logprobs and scores against the
decoder whose attention is the float64 reference over the quantized cache
(`tests/reference/kv_fp8_ref.py`), and scales that follow every weight install."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import sharp_hf_state
from kv_fp8_ref import reference_logits

from models import functional as mf
from models.config import get_config
from models.hf_io import from_hf_state_dict
from models.kv_calibration import calibrate_kv_scales
from rollout_bridge.backend import SamplingParams
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.export import to_rollout_format
from rollout_bridge.weights import ExportError
from rollout_bridge.weights.kv_scales import kv_scale_tensors, split_kv_scales

PROMPTS = [[5, 17, 99, 3], [42, 7]]
T = 16
calibrate = jax.jit(calibrate_kv_scales, static_argnums=0, static_argnames="recipe")


def _right_padded(seqs):
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros_like(tokens)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)], mask[r, : len(s)] = s, 1
    return tokens, mask


def _ref_logprobs(eng, seqs):
    """Teacher-forced logprobs of `seqs` (entry t: token t given tokens < t) under the
    float64-attention reference with the engine's installed weights and scales."""
    tokens, mask = _right_padded(seqs)
    z = np.asarray(
        reference_logits(
            eng.graphdef, eng.params, tokens, mask, *eng.kv_scales, recipe=eng._forward_recipe
        ),
        np.float64,
    )
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return [
        np.concatenate([[0.0], logp[r, np.arange(len(s) - 1), s[1:]]]) for r, s in enumerate(seqs)
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = get_config("tiny_qwen2", compute_dtype=jnp.float32)  # f32: the reference's rounding
    graphdef, _ = mf.init_model(cfg, 0)
    params = from_hf_state_dict(cfg, sharp_hf_state(cfg, 1))
    eng = EmbeddedBackend(
        cfg, graphdef, params, recipe="bf16", eos_id=None, max_len=T, kv_cache_dtype="fp8",
        export_root=tmp_path_factory.mktemp("kv"), export_format="fp32",
    )  # fmt: skip
    return cfg, eng


def test_fp8_cache_samples_and_scores_as_the_float64_reference(setup):
    cfg, eng = setup
    assert eng.kv_scales is None  # nothing calibrated before the first call
    out = eng.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=1))
    # The first call calibrated on its own prompts, with the installed weights.
    tokens, mask = _right_padded(PROMPTS)
    want = calibrate(eng.graphdef, eng.params, tokens, mask, recipe=eng._forward_recipe)
    for got, w in zip(eng.kv_scales, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6)
    seqs = [list(c.prompt_ids) + list(c.response_ids) for c in out]
    ref = _ref_logprobs(eng, seqs)
    for c, s, r in zip(out, seqs, ref, strict=True):
        np.testing.assert_allclose(c.logprobs, r[len(c.prompt_ids) : len(s)], atol=1e-4)
    for got, r in zip(eng.score(seqs), ref, strict=True):
        np.testing.assert_allclose(got, r, atol=1e-4)


def test_fp8_scales_follow_every_install(setup):
    cfg, eng = setup
    out = eng.generate(PROMPTS, SamplingParams(n=1, max_tokens=5, temperature=1.0, seed=2))
    before = [np.asarray(x) for x in eng.kv_scales]
    eng.push_weights(sharp_hf_state(cfg, 2), "step-1")
    # Recalibrated with the new weights on the latest generation's prompt ++ response rows.
    tokens, mask = _right_padded([list(c.prompt_ids) + list(c.response_ids) for c in out])
    want = calibrate(eng.graphdef, eng.params, tokens, mask, recipe=eng._forward_recipe)
    for got, w, old in zip(eng.kv_scales, want, before, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6)
        assert np.abs(np.asarray(got) / old - 1).max() > 0.05
    # Scales pushed with the weights are installed as they are.
    k, v = np.full(cfg.num_layers, 0.5, np.float32), np.full(cfg.num_layers, 0.25, np.float32)
    eng.push_weights({**sharp_hf_state(cfg, 3), **kv_scale_tensors(k, v)}, "step-2")
    np.testing.assert_array_equal(np.asarray(eng.kv_scales.k), k)
    np.testing.assert_array_equal(np.asarray(eng.kv_scales.v), v)


def test_kv_scales_stay_f32_in_every_export_format_and_partial_sets_are_refused():
    scales = kv_scale_tensors([0.1234567], [3.3e-5])
    for fmt in ("bf16", "fp8", "fp8_fp32", "fp32"):
        out, _ = to_rollout_format(scales, fmt)
        for name, x in scales.items():
            assert out[name].dtype == np.float32 and out[name].shape == ()
            assert out[name] == x
    rest, (k, v) = split_kv_scales({"a": 1, **scales}, 1)
    assert rest == {"a": 1} and k[0] == np.float32(0.1234567) and v[0] == np.float32(3.3e-5)
    with pytest.raises(ExportError, match="model.layers.1.self_attn.k_scale"):
        split_kv_scales(scales, 2)
    with pytest.raises(ExportError, match="positive"):
        split_kv_scales(kv_scale_tensors([0.0], [1.0]), 1)
