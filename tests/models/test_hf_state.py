"""HF state dicts (models.hf_state): the name map and layout, exact round trips, and errors
that name the tensor."""

from __future__ import annotations

import numpy as np
import pytest
from _model_testlib import TINY, tiny

from models.hf_state import from_hf_state_dict, hf_name_map, random_hf_state_dict, to_hf_state_dict


def test_name_map_layout_and_tied_head():
    cfg, _, params = tiny("tiny_llama")
    sd = to_hf_state_dict(cfg, params)
    assert [row.name for row in hf_name_map(cfg)] == list(sd)
    # HF layout [out, in]: q_proj maps hidden -> heads * head_dim.
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert sd["lm_head.weight"].shape == (512, 64)
    np.testing.assert_array_equal(
        sd["model.layers.0.mlp.up_proj.weight"],
        np.asarray(params["model"]["layers"]["mlp"]["up_proj"]["kernel"][...][0]).T,
    )
    tied_cfg, _, tied = tiny("tiny_qwen2")
    tied_sd = to_hf_state_dict(tied_cfg, tied)
    assert "lm_head.weight" not in tied_sd
    assert "model.layers.0.self_attn.q_proj.bias" in tied_sd
    assert "model.layers.0.self_attn.q_norm.weight" in to_hf_state_dict(*tiny("tiny_qwen3")[::2])


def test_missing_and_unexpected_tensors_are_named():
    cfg, _, params = tiny("tiny_qwen3")
    sd = to_hf_state_dict(cfg, params)
    missing = dict(sd)
    del missing["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"k_norm.weight' is missing \(expected shape \(32,\)"):
        from_hf_state_dict(cfg, missing, source="x.safetensors")
    extra = {**sd, "model.layers.2.mlp.up_proj.weight": np.zeros((128, 64), np.float32)}
    with pytest.raises(ValueError, match="unexpected tensor.*layers.2.mlp.up_proj"):
        from_hf_state_dict(cfg, extra)
    # A tied checkpoint may carry an lm_head copy (transformers does); it is ignored.
    from_hf_state_dict(cfg, {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]})


@pytest.mark.parametrize("name", TINY)
def test_random_state_dict_round_trips_exactly(name):
    cfg = tiny(name)[0]
    sd = random_hf_state_dict(cfg, 3)
    assert list(sd) == [row.name for row in hf_name_map(cfg)]
    back = to_hf_state_dict(cfg, from_hf_state_dict(cfg, sd))
    assert list(back) == list(sd)
    for k, x in sd.items():
        np.testing.assert_array_equal(back[k], x)
    # Seeded: the same seed gives the same weights, another seed others.
    np.testing.assert_array_equal(random_hf_state_dict(cfg, 3)[k], x)
    assert not np.array_equal(random_hf_state_dict(cfg, 4)[k], x)
