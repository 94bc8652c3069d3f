"""Logits of the tiny qwen2 / qwen3 / llama configs against transformers' PyTorch models (f32).

Golden fixtures (tests/models/golden/*.npz, made by scripts/make_model_golden.py) always run;
the live comparisons run when torch and transformers are importable. Only real (unpadded)
positions are compared: transformers' pad-query rows are unspecified.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import HAVE_TORCH, TINY, forward, left_padded_batch, tiny

from models import fp8
from models import functional as F
from models.config import get_config
from models.hf_io import from_hf_state_dict, load_hf, random_hf_state_dict, save_hf

GOLDEN = Path(__file__).parent / "golden"
TOL = 1e-4
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch + transformers not installed")


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


def _hf_logits(folder, tokens, mask):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    pos = np.maximum(np.cumsum(np.asarray(mask), axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.numpy()


@needs_torch
@pytest.mark.parametrize("name", TINY)
def test_live_transformers_random_init_loads_into_ours(name, tmp_path):
    """transformers initialises the model; we load its state dict through the name map."""
    import torch
    import transformers

    cfg = get_config(name, compute_dtype=jnp.float32)
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb them to test the map
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tokens, mask = left_padded_batch(cfg.vocab_size, 20, (0, 6))
    ours = _ours(cfg, tensors, tokens, mask)
    theirs = _hf_logits(tmp_path, tokens, mask)
    # The folder transformers wrote (its own config.json dialect) loads the same way.
    loaded_cfg, graphdef, params = load_hf(tmp_path, compute_dtype=jnp.float32)
    assert loaded_cfg == cfg.replace(bos_token_id=loaded_cfg.bos_token_id)
    np.testing.assert_array_equal(
        np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16)), ours
    )
    real = np.asarray(mask).astype(bool)
    assert np.abs(ours - theirs)[real].max() < TOL


@needs_torch
@pytest.mark.parametrize("name", TINY)
def test_saved_folder_loads_in_transformers_with_same_logits(name, tmp_path):
    from models.tokenizer import build_byte_tokenizer

    cfg, graphdef, params = tiny(name)
    save_hf(tmp_path, cfg, params, tokenizer=build_byte_tokenizer())
    tokens, mask = left_padded_batch(cfg.vocab_size, 12, (0, 3))
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    theirs = _hf_logits(tmp_path, tokens, mask)
    real = np.asarray(mask).astype(bool)
    assert np.abs(ours - theirs)[real].max() < TOL
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.decode(tok("2+3=5")["input_ids"]) == "2+3=5"
