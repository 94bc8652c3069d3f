"""Shared helpers of the model tests: tiny models, jitted entry points, float64 and FP8 numpy
references, and a jaxpr walk."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models import decoding
from models import functional as F
from models.config import ModelConfig, get_config

TINY = ("tiny_qwen2", "tiny_qwen3", "tiny_llama", "tiny_qwen3_moe", "tiny_qwen2_moe",
        "tiny_mixtral", "tiny_qwen3_moe_mixed")  # fmt: skip

forward = jax.jit(F.forward, static_argnums=0, static_argnames="recipe")
prefill = jax.jit(decoding.prefill, static_argnums=0, static_argnames="recipe")
decode_step = jax.jit(decoding.decode_step, static_argnums=0, static_argnames="recipe")


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


# FP8 quantization written out as the spec (models.fp8.quantization) states it: explicit loops
# over the groups, f32 arithmetic, ml_dtypes casts.

NP_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}
REL_ERR = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def ref_scale(amax: np.float32, fmt: str, pow2: bool) -> np.float32:
    if not np.isfinite(amax):
        return np.float32(np.nan)
    if amax == 0:
        return np.float32(1.0)
    s = np.float32(amax) * np.float32(1.0 / FMAX[fmt])  # f32 multiply, one rounding
    if pow2:
        e = math.ceil(math.log2(float(s)))
        while 2.0 ** (e - 1) >= float(s):
            e -= 1
        while 2.0**e < float(s):
            e += 1
        s = np.float32(2.0**e)
    return s


def ref_quantize(
    x: np.ndarray, fmt: str, tile: tuple, pow2: bool
) -> tuple[np.ndarray, np.ndarray, list]:
    """Returns (q as f64 values, scale, groups) with explicit index ranges per group."""
    x = x.astype(np.float32)
    tiles = [d if t is None else min(t, d) for d, t in zip(x.shape, tile, strict=True)]
    gshape = [-(-d // t) for d, t in zip(x.shape, tiles, strict=True)]
    q = np.zeros(x.shape, np.float64)
    scale = np.zeros(gshape, np.float32)
    for gidx in np.ndindex(*gshape):
        sl = tuple(
            slice(g * t, min((g + 1) * t, d)) for g, t, d in zip(gidx, tiles, x.shape, strict=True)
        )
        block = x[sl]
        amax = np.float32(np.max(np.abs(block))) if np.all(np.isfinite(block)) else np.inf
        s = ref_scale(amax, fmt, pow2)
        scale[gidx] = s
        with np.errstate(invalid="ignore"):
            scaled = np.clip(block / s, -FMAX[fmt], FMAX[fmt])  # f32 division
        q[sl] = scaled.astype(NP_DTYPES[fmt]).astype(np.float64)
    return q, scale, tiles


def ref_fake_quant(x, fmt, tile, pow2):
    q, scale, tiles = ref_quantize(np.asarray(x), fmt, tile, pow2)
    s_full = scale
    for ax, t in enumerate(tiles):
        s_full = np.repeat(s_full, t, axis=ax)
    s_full = s_full[tuple(slice(0, d) for d in q.shape)]
    return q * s_full.astype(np.float64)


def special_input(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Gaussian values with a zero row, huge and tiny entries (subnormals after scaling)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[:: max(1, x.size // 7)] *= 1e4  # outliers push neighbours into subnormals
    x.flat[1 :: max(1, x.size // 5)] *= 1e-6
    if x.ndim >= 2:
        x[0] = 0.0  # an all-zero group
    return -x if rng.random() < 0.5 else x


TILES = {
    "tensor": lambda shape: (None,) * len(shape),
    "row": lambda shape: (1,) * (len(shape) - 1) + (None,),
    "act_block": lambda shape: (1,) * (len(shape) - 1) + (128,),
    "weight_block": lambda shape: (128,) * len(shape),
    "block_32": lambda shape: (1,) * (len(shape) - 1) + (32,),
}


# Walking a jaxpr with its sub-jaxprs (scan, while, cond, remat, pjit, custom_vjp bodies).


def all_eqns(jaxpr) -> Iterator:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def max_intermediate_size(jaxpr) -> int:
    """Elements of the largest array any equation (nested ones included) makes."""
    sizes = (int(np.prod(getattr(v.aval, "shape", ()))) for e in all_eqns(jaxpr) for v in e.outvars)
    return max(sizes, default=0)
