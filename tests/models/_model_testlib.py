"""Shared helpers for the model tests: tiny models, jitted entry points, float64 references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import functional as F
from models.config import ModelConfig, get_config

TINY = ("tiny_qwen2", "tiny_qwen3", "tiny_llama")

forward = jax.jit(F.forward, static_argnums=0, static_argnames="recipe")
prefill = jax.jit(F.prefill, static_argnums=0, static_argnames="recipe")
decode_step = jax.jit(F.decode_step, static_argnums=0, static_argnames="recipe")


@functools.cache
def tiny(name: str, f32: bool = True, seed: int = 0) -> tuple[ModelConfig, object, object]:
    """(cfg, graphdef, params) of a tiny preset; f32 compute unless f32=False (bf16)."""
    cfg = get_config(name, compute_dtype=jnp.float32 if f32 else jnp.bfloat16)
    graphdef, params = F.init_model(cfg, seed)
    return cfg, graphdef, params


def left_padded_batch(vocab: int, t: int, pads: tuple[int, ...], seed: int = 0):
    """tokens, mask [B, t]: row b has pads[b] leading pads (token 0, mask 0)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, vocab, size=(len(pads), t)).astype(np.int32)
    mask = np.ones((len(pads), t), np.int32)
    for b, p in enumerate(pads):
        tokens[b, :p] = 0
        mask[b, :p] = 0
    return jnp.asarray(tokens), jnp.asarray(mask)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
