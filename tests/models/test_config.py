"""ModelConfig and PRESETS (models.config): HF config.json round trip, preset sizes against the
published counts, errors."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from models.config import PRESETS, ModelConfig, get_config
from models.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer, eos_token_id


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    cfg = PRESETS[name]
    # config.json carries no compute dtype: it is a run setting, passed as an override.
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), compute_dtype=cfg.compute_dtype)
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
        ("qwen3_30b_a3b", 30.5e9),
        ("qwen1.5_moe_a2.7b", 14.3e9),  # a shared expert beside 60 routed ones
        ("mixtral_8x7b", 46.7e9),
    ],
)
def test_real_presets_match_published_sizes(name, published):
    assert PRESETS[name].num_params() == pytest.approx(published, rel=0.01)


def test_moe_active_parameters_and_config_json_dialects():
    """Qwen3-30B-A3B's 3.3B active parameters (its model card); transformers 5's
    `num_local_experts` is read as `num_experts`; dense layers among the MoE ones follow HF's
    rule (not in `mlp_only_layers`, (i + 1) % `decoder_sparse_step` == 0) and round-trip through
    config.json; a mix without an MoE layer, or out of range, is refused naming the keys."""
    cfg = PRESETS["qwen3_30b_a3b"]
    assert cfg.num_params(active=True) == pytest.approx(3.3e9, rel=0.02)
    # Qwen1.5-MoE-A2.7B's and Mixtral-8x7B's active counts (their model cards).
    assert PRESETS["qwen1.5_moe_a2.7b"].num_params(active=True) == pytest.approx(2.7e9, rel=0.02)
    assert PRESETS["mixtral_8x7b"].num_params(active=True) == pytest.approx(12.9e9, rel=0.02)
    hf = cfg.to_hf_config()
    hf["num_local_experts"] = hf.pop("num_experts")
    assert ModelConfig.from_hf_config(hf) == cfg
    mixed = ModelConfig.from_hf_config(
        {**cfg.to_hf_config(), "mlp_only_layers": [5, 0], "decoder_sparse_step": 2}
    )
    kinds = mixed.sparse_layers
    assert kinds[:8] == (False, True, False, True, False, False, False, True)
    assert mixed.num_moe_layers == 23 and mixed.mlp_slots[:6] == (0, 0, 1, 1, 2, 3)
    assert ModelConfig.from_hf_config(mixed.to_hf_config()) == mixed
    # 25 dense MLPs of width 6144 instead of 25 MoE blocks (128 experts of 768, a router).
    dense, sparse = 3 * 2048 * 6144, 2048 * 128 + 128 * 3 * 2048 * 768
    assert cfg.num_params() - mixed.num_params() == 25 * (sparse - dense)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0, 1\].*has no MoE layer"):
        get_config("tiny_qwen3_moe", mlp_only_layers=[1, 0])
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[2\] layer indices in 0..1"):
        get_config("tiny_qwen3_moe", mlp_only_layers=[2])
    with pytest.raises(ValueError, match="mixtral.*experts in every layer"):
        get_config("tiny_mixtral", decoder_sparse_step=2)
    with pytest.raises(ValueError, match="arch='qwen3' has no experts"):
        get_config("tiny_qwen3", mlp_only_layers=[0])
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be in 1..num_experts=8"):
        get_config("tiny_qwen3_moe", num_experts_per_tok=9)
    # A Qwen3-MoE config.json without `norm_topk_prob` routes with raw top-k weights, as
    # transformers' and vLLM's Qwen3-MoE configs default it.
    bare = {k: v for k, v in cfg.to_hf_config().items() if k != "norm_topk_prob"}
    assert ModelConfig.from_hf_config(bare).norm_topk_prob is False
    # Qwen2-MoE as vLLM builds it: q/k/v biases and head_dim = hidden / heads.
    with pytest.raises(ValueError, match="arch='qwen2_moe'.*needs qkv_bias=True"):
        get_config("tiny_qwen2_moe", qkv_bias=False)
    with pytest.raises(ValueError, match="arch='qwen2_moe'.*head_dim=32 must equal"):
        get_config("tiny_qwen2_moe", head_dim=32)


def test_byte_tokenizer_presets():
    """tiny_arith and study_25m: the byte vocabulary, its eos, 128-wide FP8 blocks per row."""
    eos = eos_token_id(build_byte_tokenizer())
    for name, d in (("tiny_arith", 128), ("study_25m", 512)):
        cfg = PRESETS[name]
        assert (cfg.vocab_size, cfg.eos_token_id, cfg.hidden_size) == (BYTE_VOCAB_SIZE, eos, d)
        assert cfg.arch == "qwen3" and cfg.compute_dtype == jnp.float32
    assert PRESETS["study_25m"].num_params() == pytest.approx(23.7e6, rel=0.01)


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
