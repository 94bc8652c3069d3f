"""Named architectures: `PRESETS` (name -> ModelConfig) and `get_config`.

Tiny presets are for tests and CPU runs; real presets copy the HF config.json values of the
named checkpoints.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from models.config.architecture import ModelConfig

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_id=256,  # the byte tokenizer's <|endoftext|>
)

# The built-in arithmetic task's policy: 2 Qwen3 layers, d = 128 (one 128-wide FP8 block per
# row, so the block recipe quantizes real 1 x 128 tiles and 128 x 128 weight blocks), the byte
# vocabulary (`models.tokenizer.BYTE_VOCAB_SIZE`, eos = its <|endoftext|>), f32 compute.
_TINY_ARITH = dict(
    arch="qwen3",
    vocab_size=257,
    hidden_size=128,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    max_position_embeddings=64,
    eos_token_id=256,
    compute_dtype=jnp.float32,
)

# Qwen3-MoE: 8 experts of width 32, 2 per token (renormalised), every layer sparse.
_TINY_QWEN3_MOE = ModelConfig(
    arch="qwen3_moe",
    **{**_TINY, "head_dim": 32},
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qk_norm=True,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
)

# The tiny_* presets cover every feature: qkv bias + tied head (qwen2), q/k norm with
# head_dim != hidden/heads (qwen3), llama3 RoPE scaling with an untied head (llama), top-2 of 8
# experts in every layer (qwen3_moe; qwen2_moe with a shared expert and q/k/v biases, the top-k
# weights not renormalised; mixtral with Llama attention), dense and MoE layers mixed
# (qwen3_moe_mixed).
PRESETS: dict[str, ModelConfig] = {
    "tiny_qwen2": ModelConfig(
        arch="qwen2",
        **_TINY,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "tiny_qwen3": ModelConfig(
        arch="qwen3",
        **{**_TINY, "head_dim": 32},
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    "tiny_qwen3_moe": _TINY_QWEN3_MOE,
    # The same with dense and MoE layers mixed: 3 layers, the middle one a dense SwiGLU MLP of
    # width 128 (`mlp_only_layers`), so the layer stack runs sparse, dense, sparse.
    "tiny_qwen3_moe_mixed": _TINY_QWEN3_MOE.replace(num_layers=3, mlp_only_layers=(1,)),
    # Qwen2-MoE: 8 experts of width 32, 2 per token (raw probabilities), a shared expert of 48.
    "tiny_qwen2_moe": ModelConfig(
        arch="qwen2_moe",
        **_TINY,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
        shared_expert_intermediate_size=48,
    ),
    # Mixtral: 8 experts of width 32 (its config.json's intermediate_size), 2 per token.
    "tiny_mixtral": ModelConfig(
        arch="mixtral",
        **{**_TINY, "intermediate_size": 32},
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        router_aux_loss_coef=0.02,
    ),
    # The smallest shape a CPU vLLM serves: its CPU attention refuses head_dim 16.
    "tiny_qwen2_vllm": ModelConfig(
        arch="qwen2",
        **{**_TINY, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32},
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "tiny_llama": ModelConfig(
        arch="llama",
        **_TINY,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "tiny_arith": ModelConfig(**_TINY_ARITH),
    # The arithmetic policy as a Qwen3-MoE: 8 experts of width 192 per layer, 2 per token (the
    # active MLP width of tiny_arith's 384), for MoE runs on the built-in task.
    "tiny_arith_moe": ModelConfig(
        **{**_TINY_ARITH, "arch": "qwen3_moe"},
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        norm_topk_prob=True,
    ),
    # The FP8 study's larger policy (configs/study_scratchpad_25m.yaml): the same family at
    # d = 512 (four 128-wide FP8 blocks per row), 6 layers: 23.7M parameters.
    "study_25m": ModelConfig(
        **{
            **_TINY_ARITH,
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_layers": 6,
            "num_heads": 8,
            "num_kv_heads": 4,
            "head_dim": 64,
        }
    ),
    "qwen3_0.6b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (30.5B parameters, 3.3B active).
    "qwen3_30b_a3b": ModelConfig(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
    # Qwen1.5-MoE-A2.7B (a Qwen2-MoE): 24 layers of 60 experts, 4 per token, and a shared expert
    # (14.3B parameters, 2.7B active).
    "qwen1.5_moe_a2.7b": ModelConfig(
        arch="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=8192,
        bos_token_id=151643,
        eos_token_id=151643,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
        shared_expert_intermediate_size=5632,
    ),
    # Mixtral-8x7B: 32 layers of 8 experts, 2 per token (46.7B parameters, 12.9B active).
    "mixtral_8x7b": ModelConfig(
        arch="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_id=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
        router_aux_loss_coef=0.02,
    ),
    "qwen3_8b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3_14b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=40,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen2.5_7b": ModelConfig(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=131072,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    "qwen2.5_32b": ModelConfig(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=131072,
        bos_token_id=151643,
        eos_token_id=151643,
    ),
    "llama3.1_8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name, with optional field overrides (e.g. `compute_dtype=jnp.float32`)."""
    if name not in PRESETS:
        raise KeyError(f"model preset {name!r} is unknown; presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
