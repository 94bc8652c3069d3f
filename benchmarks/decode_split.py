"""Where one decode step of the embedded engine goes: its parts compiled and timed one by one.

`decode_split(engine, rows, cache_len, repeats)` builds, for the engine's installed weights and
forward recipe, the batch shape a `generate` call compiles (`rows` bucketed rows, a KV cache of
`cache_len` slots half full) and times, each as its own jitted program (median of `repeats`
after a warm-up, round-robin: `timing.interleaved_median_seconds`):

  decode step          `models.decoding.decode_step`: the layers with attention over the KV
                       cache, and the LM head (the body of the decode loop, sampling apart);
                       `STEPS` steps in a loop with the cache updated in place, per step
  layers, no attention the same layers with attention replaced by its query (the GEMMs,
                       norms, RoPE and, for FP8 recipes, the activation quantization)
  FP8 act. quant       the activation fake-quantization of every GEMM input alone (FP8 only)
  attention + KV cache decode step - layers without attention - LM head
  LM head              the tied/untied head, [rows, D] x [D, V], f32 logits
  sampling             `sampling.sample_tokens` at temperature 1 (no top-k/top-p)

The parts run as separate programs, so they add up to the whole only roughly; the benchmark
prints them next to the measured seconds per generated token of the real `generate` calls.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import interleaved_median_seconds

from models import decoding, fp8
from models import functional as mf
from rollout_bridge.engine import sampling as smp

STEPS = 8  # decode steps per timed call of "decode step"


def decode_split(engine: Any, rows: int, cache_len: int, repeats: int) -> dict[str, float]:
    """Seconds of each part of one decode step (module docstring) of `engine`
    (an `EmbeddedBackend`) at `rows` rows and a `cache_len`-slot cache."""
    cfg, graphdef, params = engine.cfg, engine.graphdef, engine.params
    recipe = engine._forward_recipe
    dot_general = mf.dot_general_for(cfg, recipe)
    filled = cache_len // 2
    cache = decoding.init_cache(cfg, rows, cache_len, kv_cache_dtype=engine.kv_cache_dtype,
                                kv_scales=engine.kv_scales)  # fmt: skip
    cache = cache._replace(
        mask=cache.mask.at[:, :filled].set(True),
        pos=jnp.full((rows,), filled, jnp.int32),
        index=jnp.asarray(filled, jnp.int32),
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, rows), jnp.int32)

    @jax.jit
    def step(params, tokens, cache):
        # STEPS steps in a loop, the cache carried and updated in place as in `generate`.
        def body(_, carry):
            cache, acc = carry
            logits, cache = decoding.decode_step(graphdef, params, tokens, cache, recipe=recipe)
            return cache, acc + logits[:, 0]

        return jax.lax.fori_loop(0, STEPS, body, (cache, jnp.zeros((rows,), jnp.float32)))[1]

    @jax.jit
    def layers(params, tokens):
        model = nnx.merge(graphdef, params)
        h, _, _ = model.hidden_states(
            tokens[:, None],
            jnp.full((rows, 1), filled, jnp.int32),
            lambda i, q, k, v, carry: (q, carry),
            dot_general,
        )
        return h

    @jax.jit
    def head(params, h):
        return mf.apply_head(h, mf.head_of(nnx.merge(graphdef, params)))

    keys = jax.random.split(jax.random.key(0), rows)
    ones = jnp.ones((rows,), jnp.float32)
    no_k = jnp.full((rows,), cfg.vocab_size, jnp.int32)

    @jax.jit
    def sample(logits):
        return smp.sample_tokens(logits, keys, jnp.int32(1), ones, no_k, ones)

    h = jnp.ones((rows, cfg.hidden_size), cfg.compute_dtype)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(rows, cfg.vocab_size)), jnp.float32)
    programs = {
        "decode step": (step, (params, tokens, cache)),
        "layers, no attention": (layers, (params, tokens)),
        "LM head": (head, (params, h)),
        "sampling": (sample, (logits,)),
    }
    if recipe.quantized:
        programs["FP8 act. quant"] = _activation_quant(cfg, recipe, rows)
    out = interleaved_median_seconds(programs, repeats=repeats)
    out["decode step"] /= STEPS
    out["attention + KV cache"] = out["decode step"] - out["layers, no attention"] - out["LM head"]
    return out


def _activation_quant(cfg: Any, recipe: fp8.Recipe, rows: int) -> tuple[Any, tuple[Any, ...]]:
    """A program that runs the activation fake-quantization of one decode step's GEMM inputs
    (q, k, v, o, gate, up, down per layer) alone, and its arguments."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    widths = (d, d, d, hd, d, d, f)
    xs = [jnp.ones((cfg.num_layers, rows, w), cfg.compute_dtype) for w in widths]

    @jax.jit
    def quantize_all(xs):
        def one(x):
            return fp8.fake_quantize_operand(
                x, recipe.fwd_format, -1, recipe.act_granularity, "act", recipe
            )

        return [jax.lax.map(one, x) for x in xs]

    return quantize_all, (xs,)


def print_split(name: str, split: dict[str, float], per_token: float) -> None:
    """The split as milliseconds per decode step, next to the measured seconds per step."""
    print(f"decode step split, {name} (ms per step; each part its own program):")
    for part, sec in split.items():
        print(f"  {part:<32}{sec * 1e3:>10.1f}")
    print(f"  {'generate(), measured per step':<32}{per_token * 1e3:>10.1f}")
