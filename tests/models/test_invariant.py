"""Batch-invariant numerics (`models.invariant`): the embedded engine's sampled-token
log-probs equal, bit for bit (`==` on float32 arrays), what the trainer's log-prob head computes
for the same tokens, for both exact recipes and both compute dtypes, across batch sizes, prompt
lengths, paddings, cache sizes and micro-batches; and the pieces against float64 references."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import functional as F
from models import invariant as inv
from models.attention import causal_allowed, reference_attention
from models.config import get_config
from models.fp8 import get_recipe
from rollout_bridge.engine import programs
from rollout_bridge.engine import sampling as smp

token_logprobs = jax.jit(
    F.token_logprobs, static_argnums=0, static_argnames=("recipe", "temperature", "chunk_size")
)


@functools.cache
def policy(f32: bool, preset: str = "tiny_qwen3", invariant: bool = True):
    cfg = get_config(
        preset, compute_dtype=jnp.float32 if f32 else jnp.bfloat16, batch_invariant=invariant
    )
    return (cfg, *F.init_model(cfg, 0))


def engine_rollout(cfg, gd, params, recipe, prompts, new, temperature, cache_len, n=1):
    """generate_rows over left-padded `prompts` (n samples each): (prompt lengths, tokens, logprobs)."""
    plen = max(len(p) for p in prompts)
    u = len(prompts)
    prompt = np.zeros((u, plen), np.int32)
    mask = np.zeros((u, plen), np.int32)
    for b, p in enumerate(prompts):
        prompt[b, plen - len(p) :], mask[b, plen - len(p) :] = p, 1
    source = np.repeat(np.arange(u), n)
    rows = len(source)
    keys = smp.row_keys(
        jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.uint32),
        jnp.asarray(source), jnp.arange(rows) % n,
    )  # fmt: skip
    toks, lps, _, _ = programs.generate_rows(
        gd, params, jnp.asarray(prompt), jnp.asarray(mask), jnp.asarray(source), keys,
        jnp.full((rows,), temperature, jnp.float32), jnp.full((rows,), -1, jnp.int32),
        jnp.ones((rows,), jnp.float32), jnp.full((rows, 1), -1, jnp.int32),
        jnp.full((rows,), new, jnp.int32), cfg=cfg, recipe=recipe, cache_len=cache_len,
    )  # fmt: skip
    return [prompts[s] for s in source], np.asarray(toks)[:, :new], np.asarray(lps)[:, :new]


def trainer_rows(prompts, toks, pad_left):
    """(tokens, mask, P) of [pads][prompt][response][pads] rows, prompts ending at column P."""
    new = toks.shape[1]
    p_max = max(len(p) for p in prompts) + pad_left
    seq = np.zeros((len(prompts), p_max + new + 3), np.int32)
    mask = np.zeros_like(seq)
    for b, p in enumerate(prompts):
        seq[b, p_max - len(p) : p_max], mask[b, p_max - len(p) : p_max] = p, 1
        seq[b, p_max : p_max + new], mask[b, p_max : p_max + new] = toks[b], 1
    return seq, mask, p_max


def trainer_logprobs(gd, params, recipe, prompts, toks, temperature, pad_left, micro):
    """token_logprobs over [pads][prompt][response][pads] rows in micro-batches of `micro`."""
    seq, mask, p_max = trainer_rows(prompts, toks, pad_left)
    new = toks.shape[1]
    out = []
    for i in range(0, len(prompts), micro):
        lp = token_logprobs(
            gd, params, jnp.asarray(seq[i : i + micro]), jnp.asarray(mask[i : i + micro]),
            recipe=recipe, temperature=temperature,
        )  # fmt: skip
        out.append(np.asarray(lp)[:, p_max : p_max + new])
    return np.concatenate(out)


def random_prompts(rows: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, rng.integers(1, max_len + 1))) for _ in range(rows)]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
@pytest.mark.parametrize("f32", [True, False], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "rows,max_prompt,new,n,temperature,cache_extra,pad_left,micro",
    [(3, 6, 10, 2, 1.0, 0, 2, 6), (5, 11, 14, 1, 0.7, 150, 0, 2)],
)
def test_engine_logprobs_equal_trainer_bit_for_bit(
    recipe, f32, rows, max_prompt, new, n, temperature, cache_extra, pad_left, micro
):
    """Sampled with the KV cache (prefill + one-token steps, shared prefills, a cache of one
    or two attention chunks), scored by one causal forward with other padding and in
    micro-batches: every log-prob equal."""
    cfg, gd, params = policy(f32)
    rec = get_recipe(recipe)
    prompts = random_prompts(rows, max_prompt, cfg.vocab_size, seed=rows)
    cache_len = max_prompt + new + cache_extra
    src, toks, lps = engine_rollout(cfg, gd, params, rec, prompts, new, temperature, cache_len, n)
    want = trainer_logprobs(gd, params, rec, src, toks, temperature, pad_left, micro)
    np.testing.assert_array_equal(lps, want)
    assert np.all(lps < 0) and len({tuple(t) for t in toks}) > 1


@pytest.mark.parametrize(
    "preset,f32", [("tiny_qwen3_moe_mixed", False), ("tiny_qwen2_moe", True)],
    ids=["qwen3_moe_mixed_bf16", "qwen2_moe_f32"],
)  # fmt: skip
def test_moe_engine_logprobs_equal_trainer_bit_for_bit(preset, f32):
    """Mixture-of-Experts layers under the exact mode (a dense layer between two MoE layers;
    Qwen2-MoE's shared expert), FP8 block: the engine's decode steps route and run each token
    alone (a few expert rows per step), the trainer's forward all of them at once; every
    log-prob equal."""
    cfg, gd, params = policy(f32, preset)
    rec = get_recipe("fp8_block")
    prompts = random_prompts(5, 11, cfg.vocab_size, seed=5)
    src, toks, lps = engine_rollout(cfg, gd, params, rec, prompts, 14, 0.7, 175)
    want = trainer_logprobs(gd, params, rec, src, toks, 0.7, 0, 2)
    np.testing.assert_array_equal(lps, want)
    assert np.all(lps < 0) and len({tuple(t) for t in toks}) > 1


def test_fast_numerics_are_not_bit_identical():
    """The same comparison without batch invariance differs: what the exact mode removes."""
    cfg, gd, params = policy(True, invariant=False)
    rec = get_recipe("fp8_block")
    prompts = random_prompts(4, 9, cfg.vocab_size, seed=3)
    src, toks, lps = engine_rollout(cfg, gd, params, rec, prompts, 12, 1.0, 21)
    want = trainer_logprobs(gd, params, rec, src, toks, 1.0, 3, 4)
    np.testing.assert_allclose(lps, want, atol=5e-2)
    assert np.mean(lps == want) < 1.0


def test_exact_under_the_default_optimising_build():
    """The suite compiles with LLVM at -O0; a user's build runs -O3, where LLVM may contract a
    multiply and an add into one FMA. The f32 comparison again, dense and MoE, in a -O3
    subprocess."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import numpy as np, test_invariant as t\n"
        "from models.fp8 import get_recipe\n"
        "for preset in ('tiny_qwen3', 'tiny_qwen3_moe_mixed'):\n"
        "    cfg, gd, params = t.policy(True, preset)\n"
        "    rec = get_recipe('fp8_block')\n"
        "    prompts = t.random_prompts(5, 11, cfg.vocab_size, seed=5)\n"
        "    src, toks, lps = t.engine_rollout(cfg, gd, params, rec, prompts, 14, 0.7, 175)\n"
        "    want = t.trainer_logprobs(gd, params, rec, src, toks, 0.7, 0, 2)\n"
        "    print(preset, 'equal', float(np.mean(lps == want)))\n"
    ).replace("%r", repr(str(Path(__file__).parent)))
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "optimization_level" not in f
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for preset in ("tiny_qwen3", "tiny_qwen3_moe_mixed"):
        assert f"{preset} equal 1.0" in out.stdout, out.stdout + out.stderr[-2000:]


def test_tree_sum_against_float64_and_invariant_to_other_axes():
    x = np.random.default_rng(0).standard_normal((5, 37, 193)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: inv.tree_sum(a, -1))(x))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
    one = np.asarray(jax.jit(lambda a: inv.tree_sum(a, -1))(x[2:3, 7:8]))
    assert one[0, 0] == got[2, 7]
    axis0 = np.asarray(jax.jit(lambda a: inv.tree_sum(a, 0))(x))
    np.testing.assert_allclose(axis0, x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_log_softmax_against_float64():
    z = np.random.default_rng(1).standard_normal((3, 4, 1000)).astype(np.float32) * 4
    got = np.asarray(jax.jit(inv.log_softmax)(z))
    z64 = z.astype(np.float64)
    want = z64 - z64.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("k,n", [(64, 128), (128, 384), (576, 1536), (1536, 576), (896, 4864)])
def test_gemm_rows_do_not_depend_on_the_row_count(k, n):
    """The backend property rule 1 rests on, for the tiny, SmolLM2 and Qwen2.5-0.5B shapes."""
    assert inv.rows_invariant(k, n)


def test_exact_attention_against_float64_and_decode():
    """Position-aligned chunked attention: a left-padded batch against the float64 formula,
    and each query of it, read from a KV cache written by position, bit for bit."""
    rng = np.random.default_rng(2)
    b, t, h, kh, e = 2, 150, 4, 2, 16
    q, k, v = (rng.standard_normal((b, t, n_, e)).astype(np.float32) for n_ in (h, kh, kh))
    mask = np.ones((b, t), bool)
    mask[1, :9] = False  # row 1: nine leading pads
    out = np.asarray(jax.jit(lambda *a: inv.exact_attention(*a, chunk=inv.CHUNK))(q, k, v, mask))
    want = np.asarray(reference_attention(q, k, v, causal_allowed(jnp.asarray(mask))))
    np.testing.assert_allclose(out[mask], want[mask], atol=2e-5)
    dec = jax.jit(lambda *a: inv.exact_decode_attention(*a, chunk=inv.CHUNK))
    first = np.array([0, 9])

    def cache(x: np.ndarray) -> np.ndarray:  # slot s = position s, 256 slots
        rows = [np.pad(x[r, first[r] :], ((0, 256 - t + first[r]), (0, 0), (0, 0))) for r in (0, 1)]
        return np.stack(rows).transpose(0, 2, 1, 3)

    kc, vc = cache(k), cache(v)
    for pos in (0, 5, 127, 128, 140):
        q1 = np.stack([q[r, first[r] + pos] for r in range(b)])[:, None]
        got = np.asarray(dec(q1, kc, vc, jnp.full((b,), pos, jnp.int32)))[:, 0]
        for r in range(b):
            np.testing.assert_array_equal(got[r], out[r, first[r] + pos])


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_gradients_through_the_exact_products(invariant: bool) -> None:
    """The trainer differentiates the log-prob head at a sampling temperature (the logits
    scaled by `exact_mul`) and, in a batch-invariant model, the exact norms and attention: the
    gradient equals that of the same function written with plain products (the default model's
    forward, then log_softmax(logits / T)), not the zero an integer round trip would give."""
    cfg, gd, params = policy(True, invariant=invariant)
    _, gd_plain, _ = policy(True, invariant=False)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 9)), jnp.int32)
    mask = jnp.ones_like(tokens)
    recipe, temperature = get_recipe("bf16"), 0.7

    def ours(p):
        return F.token_logprobs(gd, p, tokens, mask, recipe=recipe, temperature=temperature).sum()

    def plain(p):
        logits = F.forward(gd_plain, p, tokens, mask, recipe=recipe)[:, :-1] / temperature
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).sum()

    got, want = jax.jit(jax.grad(ours))(params), jax.jit(jax.grad(plain))(params)
    norm = float(optax.tree.norm(want))
    assert norm > 1.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-4 * norm)
