"""The jitted programs of the embedded engine: generation, scoring, kernel installation.

`install_kernels` runs once per weight install: it turns the decoder linears' kernels into the
values every forward would compute from them (the recipe's FP8 fake-quantization, or the cast
to the compute dtype), so decoding does not re-quantize the weights at every step.
`generate_rows` prefills the KV cache for a left-padded batch and runs `decode_step` + sampling
in a `lax.while_loop` until every row has finished; `score_logprobs` / `score_ranks` give
teacher-forced logprobs (and vLLM's `prompt_logprobs` ranks); `calibrate` gives FP8 KV-cache
scales. Static arguments are the model graph, config, recipe, cache length and KV-cache dtype,
so one executable serves every batch of one bucket shape; every sampling knob is a traced
per-row array (`rollout_bridge.engine.sampling`), the KV-cache scales are traced too.

With `kv_cache_dtype="fp8"` keys and values are stored as e4m3 with per-layer scales
(`models.kv_quant`) and every attention, prefill, decode and scoring alike, reads them as the
cache holds them (as vLLM's attention reads its cache, prompt tokens included).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models import decoding, fp8
from models import functional as mf
from models.config import ModelConfig
from models.decoder import PerLayer, layer_slices
from models.fp8 import Recipe
from models.kv_calibration import calibrate_kv_scales
from models.kv_quant import KVScales
from rollout_bridge.engine import sampling as smp


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef", "cfg", "recipe", "cache_len", "kv_cache_dtype", "record_routing"
    ),
)  # fmt: skip
def generate_rows(
    graphdef: Any,
    params: Any,
    prompt: Int[Array, "U P"],
    mask: Int[Array, "U P"],
    source: Int[Array, " B"],
    keys: Array,
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    stop_ids: Int[Array, "B S"],
    max_new: Int[Array, " B"],
    kv_scales: KVScales | None = None,
    *,
    cfg: ModelConfig,
    recipe: Recipe,
    cache_len: int,
    kv_cache_dtype: str = "auto",
    record_routing: bool = False,
) -> tuple[Int[Array, "B N"], Float[Array, "B N"], Int[Array, " B"], Array | None]:
    """Samples up to N = cache_len - P tokens per row; returns (tokens, logprobs, lengths,
    routing): with `record_routing`, an MoE model's [B, cache_len, L, k] experts of every
    token fed, by position (`models.decoding.KVCache.routing`); else None.

    Row b continues prompt `source[b]` (the n samples of a prompt share one prefill: the
    prompts are prefilled once each and their KV-cache rows copied to the rows). Entries past
    a row's length are 0. A row is done once it emits a stop id or reaches its `max_new`; rows
    with `max_new == 0` (batch padding) are done from the start.
    """
    rows, plen = source.shape[0], prompt.shape[1]
    steps = cache_len - plen
    cache = decoding.init_cache(
        cfg, prompt.shape[0], cache_len, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
        record_routing=record_routing,
    )  # fmt: skip
    logits, cache = decoding.prefill(graphdef, params, prompt, mask, cache, recipe=recipe)
    if prompt.shape[0] != rows:  # one prefill per prompt: copy its cache row to each sample
        logits, cache = logits[source], decoding.take_rows(cache, source)
    exact = cfg.batch_invariant
    tok, lp = smp.sample_tokens(logits, keys, jnp.int32(0), temperature, top_k, top_p, exact=exact)
    live = max_new > 0
    out_tok = jnp.zeros((rows, steps), jnp.int32).at[:, 0].set(jnp.where(live, tok, 0))
    out_lp = jnp.zeros((rows, steps), jnp.float32).at[:, 0].set(jnp.where(live, lp, 0.0))
    lengths = live.astype(jnp.int32)
    done = ~live | smp.is_stop(tok, stop_ids) | (lengths >= max_new)

    def cond(state):
        step, _, _, _, _, done, _ = state
        return (step < steps) & ~jnp.all(done)

    def body(state):
        step, cache, prev, out_tok, out_lp, done, lengths = state
        logits, cache = decoding.decode_step(graphdef, params, prev, cache, recipe=recipe)
        tok, lp = smp.sample_tokens(logits, keys, step, temperature, top_k, top_p, exact=exact)
        active = ~done
        out_tok = out_tok.at[:, step].set(jnp.where(active, tok, 0))
        out_lp = out_lp.at[:, step].set(jnp.where(active, lp, 0.0))
        lengths = lengths + active.astype(jnp.int32)
        done = done | smp.is_stop(tok, stop_ids) | (lengths >= max_new)
        return step + 1, cache, jnp.where(active, tok, prev), out_tok, out_lp, done, lengths

    init = (jnp.int32(1), cache, tok, out_tok, out_lp, done, lengths)
    _, cache, _, out_tok, out_lp, _, lengths = jax.lax.while_loop(cond, body, init)
    return out_tok, out_lp, lengths, cache.routing


@functools.partial(jax.jit, static_argnames=("graphdef", "recipe", "kv_cache_dtype"))
def score_logprobs(
    graphdef: Any,
    params: Any,
    tokens: Int[Array, "B T"],
    mask: Int[Array, "B T"],
    kv_scales: KVScales | None = None,
    *,
    recipe: Recipe,
    kv_cache_dtype: str = "auto",
) -> Float[Array, "B T"]:
    """`models.functional.token_logprobs` (temperature 1), jitted with static shapes."""
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    return mf.token_logprobs(graphdef, params, tokens, mask, recipe=recipe, **kv)


@functools.partial(jax.jit, static_argnames=("graphdef", "recipe", "kv_cache_dtype"))
def score_ranks(
    graphdef: Any,
    params: Any,
    tokens: Int[Array, "B T"],
    mask: Int[Array, "B T"],
    kv_scales: KVScales | None = None,
    *,
    recipe: Recipe,
    kv_cache_dtype: str = "auto",
) -> tuple[Float[Array, "B T"], Int[Array, "B T"]]:
    """Teacher-forced (logprob, rank) of each token; rank = 1 + #tokens with a larger logit
    (vLLM's `prompt_logprobs` rank). Entry 0 has no context: logprob 0, rank 1."""
    kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    logits = mf.forward(graphdef, params, tokens, mask, recipe=recipe, **kv)
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nxt = tokens[:, 1:]
    tok_lp = jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
    rank = 1 + jnp.sum(logp > tok_lp[..., None], axis=-1)
    zero = jnp.zeros_like(tokens[:, :1])
    return (
        jnp.concatenate([zero.astype(jnp.float32), tok_lp], axis=1),
        jnp.concatenate([zero + 1, rank.astype(jnp.int32)], axis=1),
    )


calibrate = jax.jit(calibrate_kv_scales, static_argnums=0, static_argnames="recipe")


def install_kernels(kernels: dict[Any, Any], *, recipe: Recipe, dtype: Any) -> dict[Any, Any]:
    """Linear kernels [L, in, out] (f32 / bf16 arrays or `models.fp8.StoredFP8Weight`) -> the
    exact operands the forward multiplies with, per layer (`models.decoder.PerLayer`; a kernel
    without a layer axis stays one array): `fp8.fake_quantize_weight` (FP8 recipes; run under
    `recipe.prequantized_weights=True` afterwards) or the cast to the compute dtype `dtype`
    (the unquantized recipe). Same values as computing them in every decode step, so logits
    are unchanged bit for bit (tested).

    Built one layer at a time (`install_layer`): the install holds its input and its output,
    never a stacked copy of the output beside its slices.

    A stored FP8 weight whose tiles and format are the recipe's own (a block-FP8 push of the
    trainer's weights under the same recipe) is installed as `q * s`, the trainer's operand
    itself: re-quantizing it would re-derive each scale as `fl(448 s) * (1/448)`, which can
    move s by one ulp."""

    def one(w: Any) -> Any:
        if (w.q if isinstance(w, fp8.StoredFP8Weight) else w).ndim == 2:
            return install_layer(w, recipe=recipe, dtype=dtype)
        return PerLayer(
            tuple(install_layer(x, recipe=recipe, dtype=dtype) for x in layer_slices(w))
        )

    return jax.tree.map(one, kernels, is_leaf=lambda x: isinstance(x, fp8.StoredFP8Weight))


@functools.partial(jax.jit, static_argnames=("recipe", "dtype"))
def install_layer(w: Any, *, recipe: Recipe, dtype: Any) -> Array:
    """One layer's kernel [..., in, out] -> its operand (`install_kernels`); leading axes
    (a layer's experts) are mapped over, each matrix quantized on its own."""
    if (w.q if isinstance(w, fp8.StoredFP8Weight) else w).ndim > 2:
        if isinstance(w, fp8.StoredFP8Weight):  # each expert's matrix has the trailing tile
            w = fp8.StoredFP8Weight(w.q, w.scale, w.tile[1:])
        return jax.vmap(functools.partial(install_layer, recipe=recipe, dtype=dtype))(w)
    tile = fp8.operand_tile(2, -2, recipe.weight_granularity, "weight", recipe.block_size)
    if isinstance(w, fp8.StoredFP8Weight) and recipe.quantized and own_operand(w, recipe, tile):
        return fp8.dense_weights(w)
    w = fp8.dense_weights(w)
    return fp8.fake_quantize_weight(w, recipe) if recipe.quantized else w.astype(dtype)


def own_operand(w: fp8.StoredFP8Weight, recipe: Recipe, tile: tuple[int | None, ...]) -> bool:
    """Whether a stored FP8 weight has the recipe's weight tiles and FP8 format, so that
    `q * s` is exactly the operand the recipe's forward computes (`install_kernels`)."""
    return tuple(w.tile) == tuple(tile) and w.q.dtype == fp8.FP8_DTYPES[recipe.fwd_format]
