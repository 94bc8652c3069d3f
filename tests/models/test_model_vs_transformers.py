"""Logits of the tiny qwen2 / qwen3 / llama / qwen3_moe configs against transformers' PyTorch
models (f32).

Golden fixtures (tests/models/golden/*.npz, made by scripts/make_model_golden.py) always run;
the live comparisons run transformers in the vLLM venv (fixture `transformers_ref`,
tests/reference/: the project venv has no torch) and skip only with JFP8RL_SKIP_VLLM=1.
Only real (unpadded) positions are compared: transformers' pad-query rows are unspecified.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import TINY, forward, left_padded_batch, tiny

from models import fp8
from models import functional as F
from models.config import get_config
from models.hf_io import load_hf, read_safetensors, save_hf
from models.hf_state import from_hf_state_dict, random_hf_state_dict
from models.tokenizer import build_byte_tokenizer

GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-4


def _ours(cfg, tensors, tokens, mask):
    graphdef, _ = F.abstract_model(cfg)
    params = from_hf_state_dict(cfg, tensors)
    return np.asarray(
        forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), recipe=fp8.BF16)
    )


@pytest.mark.parametrize("name", TINY)
def test_golden_logits(name):
    gold = np.load(GOLDEN / f"{name}.npz")
    cfg = get_config(name, compute_dtype=jnp.float32)
    logits = _ours(cfg, random_hf_state_dict(cfg, int(gold["seed"])), gold["tokens"], gold["mask"])
    real = gold["mask"].astype(bool)
    assert np.abs(logits - gold["logits"])[real].max() < TOL


@pytest.mark.vllm
@pytest.mark.parametrize("name", TINY)
def test_live_transformers_random_init_loads_into_ours(name, tmp_path, transformers_ref):
    """transformers initialises the model (in the vLLM venv) and saves it; we load its
    safetensors through the name map and compare logits with transformers' own."""
    cfg = get_config(name, compute_dtype=jnp.float32)
    tokens, mask = left_padded_batch(cfg.vocab_size, 20, (0, 6))
    folder = tmp_path / "hf"
    _, out = transformers_ref(
        "random_init",
        hf_config=cfg.to_hf_config(),
        seed=0,
        folder=str(folder),
        arrays={"tokens": np.asarray(tokens), "mask": np.asarray(mask)},
    )
    tensors = read_safetensors(folder / "model.safetensors")
    ours = _ours(cfg, tensors, tokens, mask)
    # The folder transformers wrote (its own config.json dialect) loads the same way.
    loaded_cfg, graphdef, params = load_hf(folder, compute_dtype=jnp.float32)
    assert loaded_cfg == cfg.replace(bos_token_id=loaded_cfg.bos_token_id)
    np.testing.assert_array_equal(
        np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16)), ours
    )
    real = np.asarray(mask).astype(bool)
    assert np.abs(ours - out["logits"])[real].max() < TOL


@pytest.mark.vllm
@pytest.mark.parametrize("name", TINY)
def test_saved_folder_loads_in_transformers_with_same_logits(name, tmp_path, transformers_ref):
    cfg, graphdef, params = tiny(name)
    save_hf(tmp_path, cfg, params, tokenizer=build_byte_tokenizer())
    tokens, mask = left_padded_batch(cfg.vocab_size, 12, (0, 3))
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    _, out = transformers_ref(
        "logits",
        folder=str(tmp_path),
        arrays={"tokens": np.asarray(tokens), "mask": np.asarray(mask)},
    )
    real = np.asarray(mask).astype(bool)
    assert np.abs(ours - out["logits"])[real].max() < TOL
    meta, _ = transformers_ref("tokenize", folder=str(tmp_path), texts=["2+3=5"])
    assert meta["decoded"] == ["2+3=5"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("tiny_qwen3_moe", {"norm_topk_prob": False}),
        ("tiny_qwen2_moe", {"num_layers": 4, "decoder_sparse_step": 2}),
    ],
    ids=["qwen3_moe_raw_topk", "qwen2_moe_sparse_step_2"],
)
def test_live_moe_variants(name, overrides, tmp_path, transformers_ref):
    """MoE config variants, initialised and run by transformers, loaded through the name map:
    Qwen3-MoE with `norm_topk_prob: false` (the experts' weights are the router's raw
    probabilities); Qwen2-MoE with `decoder_sparse_step: 2` (layers 1 and 3 sparse, 0 and 2
    dense MLPs of `intermediate_size`)."""
    cfg = get_config(name, compute_dtype=jnp.float32, **overrides)
    tokens, mask = left_padded_batch(cfg.vocab_size, 20, (0, 6))
    folder = tmp_path / "hf"
    _, out = transformers_ref(
        "random_init", hf_config=cfg.to_hf_config(), seed=1, folder=str(folder),
        arrays={"tokens": np.asarray(tokens), "mask": np.asarray(mask)},
    )  # fmt: skip
    loaded_cfg, graphdef, params = load_hf(folder, compute_dtype=jnp.float32)
    assert loaded_cfg == cfg.replace(bos_token_id=loaded_cfg.bos_token_id)
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    real = np.asarray(mask).astype(bool)
    assert np.abs(ours - out["logits"])[real].max() < TOL
