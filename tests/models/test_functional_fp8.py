"""FP8 recipes on the whole model: logits within a bound of the bf16 recipe, and gradients
finite and aligned with bf16's.

The bounds are about twice the differences these tiny models show under tensor, row and block
scaling (init N(0, 0.02), T = 16, bf16 compute): an FP8 recipe that moved the logits or the
gradient direction by more than its quantization error fails here.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from _model_testlib import forward, left_padded_batch, tiny

from models import fp8
from models import functional as F

MAX_DIFF, MEAN_DIFF, MIN_COSINE = 0.15, 0.02, 0.98


@functools.partial(jax.jit, static_argnums=0, static_argnames="recipe")
def _loss_grad(graphdef, params, tokens, mask, *, recipe):
    def loss(p):
        lp = F.token_logprobs(graphdef, p, tokens, mask, recipe=recipe, chunk_size=8)
        return -lp.sum()

    return jax.grad(loss)(params)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def model_and_batch():
    cfg, graphdef, params = tiny("tiny_qwen3", f32=False)
    tokens, mask = left_padded_batch(cfg.vocab_size, 16, (0, 4))
    ref = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    return graphdef, params, tokens, mask, ref


@pytest.mark.parametrize("recipe_name", ["fp8_tensor", "fp8_row", "fp8_block"])
def test_fp8_logits_near_bf16(recipe_name, model_and_batch):
    graphdef, params, tokens, mask, ref = model_and_batch
    out = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.get_recipe(recipe_name)))
    diff = np.abs(out - ref)[np.asarray(mask).astype(bool)]
    print(f"{recipe_name}: max|dlogit|={diff.max():.4f} mean={diff.mean():.5f}")
    assert 0 < diff.mean() < MEAN_DIFF, diff.mean()
    assert diff.max() < MAX_DIFF, diff.max()


def test_fp8_block_grads_finite_and_aligned_with_bf16(model_and_batch):
    """One recipe only (compiling FP8 backward passes is the slow part on CPU); the benchmark
    reports the cosine for every recipe."""
    graphdef, params, tokens, mask, _ = model_and_batch
    g_ref = _flat(_loss_grad(graphdef, params, tokens, mask, recipe=fp8.BF16))
    g = _flat(_loss_grad(graphdef, params, tokens, mask, recipe=fp8.FP8_BLOCK))
    assert np.isfinite(g).all()
    cosine = float(g @ g_ref / (np.linalg.norm(g) * np.linalg.norm(g_ref)))
    print(f"fp8_block: grad cosine to bf16 = {cosine:.5f}")
    assert cosine > MIN_COSINE
