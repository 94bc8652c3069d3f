"""ModelConfig: HF config.json round trip, preset sizes against the published counts, errors."""

from __future__ import annotations

import pytest

from models.config import PRESETS, ModelConfig, get_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    cfg = PRESETS[name]
    back = ModelConfig.from_hf_config(cfg.to_hf_config())
    assert back == cfg
    assert hash(back) == hash(cfg)


@pytest.mark.parametrize(
    "name, published",
    [
        # Parameter counts from the model cards / safetensors index totals.
        ("qwen3_0.6b", 0.596e9),
        ("qwen3_8b", 8.19e9),
        ("qwen3_14b", 14.77e9),
        ("qwen2.5_7b", 7.62e9),
        ("qwen2.5_32b", 32.76e9),
        ("llama3.1_8b", 8.03e9),
    ],
)
def test_real_presets_match_published_sizes(name, published):
    assert PRESETS[name].num_params() == pytest.approx(published, rel=0.01)


def test_transformers5_rope_parameters_are_read():
    hf = PRESETS["llama3.1_8b"].to_hf_config()
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    assert ModelConfig.from_hf_config(hf) == PRESETS["llama3.1_8b"]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="model_type='mistral'"):
        ModelConfig.from_hf_config({"model_type": "mistral"})
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        get_config("tiny_llama", num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        get_config("tiny_llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(KeyError, match="tiny_gpt"):
        get_config("tiny_gpt")
