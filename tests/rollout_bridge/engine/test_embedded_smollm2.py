"""The embedded engine on a real model (SmolLM2-135M-Instruct, 4-bit GGUF weights dequantized
by scripts/get_smollm2.sh): greedy answers, bf16 recipe in f32, equal transformers' `generate`
on the GGUF-loaded model (fixture `smollm2_ref`), and end where transformers ends them: at the
end of turn `<|im_end|>` (id 2), which the engine takes from the folder although the request
names no stop ids."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from smollm2_cases import MAX_NEW_TOKENS

from rollout_bridge.backend import SamplingParams
from rollout_bridge.engine.embedded import EmbeddedBackend

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]


def test_greedy_answers_equal_transformers_generate(smollm2_dir, smollm2_ref) -> None:
    meta, _ = smollm2_ref
    engine = EmbeddedBackend.from_hf_dir(
        smollm2_dir, recipe="bf16", config_overrides={"compute_dtype": jnp.float32}, max_len=256
    )
    assert engine.eos_ids == (2,)
    try:
        out = engine.generate(
            meta["prompts"], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        )
    finally:
        engine.close()
    assert [c.response_ids.tolist() for c in out] == meta["greedy"]
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped, "no answer ended before max_tokens: the end of turn is not exercised"
    assert all(c.response_ids[-1] == 2 and len(c.response_ids) < MAX_NEW_TOKENS for c in stopped)
    assert all(c.finish_reason == "length" for c in out if c not in stopped)
