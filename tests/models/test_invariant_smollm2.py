"""Exact on-policy numerics on a real 30-layer model: SmolLM2-135M-Instruct
(scripts/get_smollm2.sh) served by the embedded engine under the block-FP8 recipe with
batch-invariant numerics (`ModelConfig.batch_invariant`, what `rollout.on_policy: exact` sets)
samples tokens whose log-probs equal, bit for bit, what the trainer's log-prob head computes
for the same tokens in one causal forward over the trainer's row layout, in two micro-batches.
FP8 rounding amplifies any float32 difference of summation order over the 30 layers (about
0.1 nats a token without the invariant numerics, `docs/benchmarks.md`), so an equality here is
the guarantee at the depth of a real model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import functional as F
from models.fp8 import get_recipe
from models.hf_io import load_hf
from models.tokenizer import load_tokenizer
from rollout_bridge.backend import SamplingParams
from rollout_bridge.engine.embedded import EmbeddedBackend

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]

PROMPTS = ("What is 17 + 25?", "Name a colour.", "Write one word that rhymes with cat.")

token_logprobs = jax.jit(F.token_logprobs, static_argnums=0, static_argnames=("recipe",))


def test_smollm2_fp8_block_engine_logprobs_equal_trainer(smollm2_dir) -> None:
    overrides = {"compute_dtype": jnp.float32, "batch_invariant": True}
    engine = EmbeddedBackend.from_hf_dir(
        smollm2_dir, recipe="fp8_block", config_overrides=overrides, max_len=128
    )
    tok = load_tokenizer(smollm2_dir)
    prompts = [tok.encode(t).ids for t in PROMPTS]
    try:
        done = engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=3))
    finally:
        engine.close()
    # The trainer's rows: prompts left-padded to one column P, responses from P, pads after.
    p_max = max(len(p) for p in prompts)
    seq = np.zeros((len(done), p_max + 12), np.int32)
    mask = np.zeros_like(seq)
    for b, c in enumerate(done):
        p, r = c.prompt_ids, c.response_ids
        seq[b, p_max - len(p) : p_max], mask[b, p_max - len(p) : p_max] = p, 1
        seq[b, p_max : p_max + len(r)], mask[b, p_max : p_max + len(r)] = r, 1
    _, graphdef, params = load_hf(smollm2_dir, **overrides)
    recipe = get_recipe("fp8_block")
    half = len(done) // 2
    lp = np.concatenate([
        np.asarray(token_logprobs(graphdef, params, jnp.asarray(seq[rows]),
                                  jnp.asarray(mask[rows]), recipe=recipe))
        for rows in (slice(0, half), slice(half, None))
    ])  # fmt: skip
    for b, c in enumerate(done):
        n = len(c.response_ids)
        np.testing.assert_array_equal(c.logprobs, lp[b, p_max : p_max + n], err_msg=f"row {b}")
    assert sum(len(c.response_ids) for c in done) > 12
    assert len({tuple(c.response_ids) for c in done}) > 1
