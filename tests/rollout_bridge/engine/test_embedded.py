"""The embedded engine against the model's own full forward (`models.functional`).

References are independent of the engine's KV cache and sampler: a jitted full `forward` run
step by step on the growing sequence (greedy), and `token_logprobs` on the finished sequences
(sampled logprobs). One module-scoped tiny model with sharpened random weights (HF init
N(0, 0.02) gives near-uniform logits, so greedy ties and dull samples would test little).

Compiling is most of this file's time: the references run on fixed shapes (one sequence, or
`REF_ROWS` rows, of `T_REF` tokens) and the tests ask the engine for the same few batch shapes
(12 or 8 rows), so each program is compiled once per model and recipe and then reused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import sharp_hf_state

from models import fp8
from models import functional as mf
from models.config import get_config
from models.fp8 import get_recipe
from models.hf_io import from_hf_state_dict, hf_name_map, iter_hf_state, random_hf_state_dict
from rollout_bridge.backend import RolloutError, SamplingParams
from rollout_bridge.engine.batching import bucket, generate_batch, length_bucket, row_bucket
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.engine.params import served_params
from rollout_bridge.weights.reader import load_export

EOS = 256
PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
T_REF = 64  # reference buffer length (prompt + response <= 64)
REF_ROWS = 12  # rows of every batched reference call (padding rows hold one token 0)


@pytest.fixture(scope="module")
def model():
    cfg = get_config("tiny_qwen2")
    graphdef, _ = mf.init_model(cfg, 0)
    hf = sharp_hf_state(cfg, 1)
    return cfg, graphdef, from_hf_state_dict(cfg, hf), hf


@pytest.fixture(scope="module")
def engine(model):
    cfg, graphdef, params, _ = model
    return EmbeddedBackend(cfg, graphdef, params, recipe="fp8_block", eos_id=None, max_len=256)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("recipe",))
def _ref_logits(graphdef, params, tokens, mask, *, recipe):
    return mf.forward(graphdef, params, tokens, mask, recipe=recipe)


def _ref_batch(seqs):
    """Right-padded tokens and mask [REF_ROWS, T_REF] of the sequences: one shape (one compile)
    for every batched reference call; a padding row holds one token 0, so no row attends to
    nothing. Every row is computed on its own (causal attention, per-token FP8 activation
    tiles, dropless routing), so the padding rows change no real row."""
    assert len(seqs) <= REF_ROWS
    buf = np.zeros((REF_ROWS, T_REF), np.int32)
    mask = np.zeros_like(buf)
    mask[:, 0] = 1
    for r, s in enumerate(seqs):
        buf[r, : len(s)], mask[r, : len(s)] = s, 1
    return buf, mask


def _ref_seq_logits(graphdef, params, seq, recipe):
    """The full forward's logits [len(seq), V] of one sequence (right-padded fixed buffer:
    one compile)."""
    buf = np.zeros((1, T_REF), np.int32)
    mask = np.zeros((1, T_REF), np.int32)
    buf[0, : len(seq)], mask[0, : len(seq)] = seq, 1
    return np.asarray(_ref_logits(graphdef, params, buf, mask, recipe=recipe))[0, : len(seq)]


def _ref_greedy(graphdef, params, prompt, steps, recipe):
    """argmax of the full forward, step by step."""
    seq = list(prompt)
    lps = []
    for _ in range(steps):
        z = _ref_seq_logits(graphdef, params, seq, recipe)[-1].astype(np.float64)
        tok = int(np.argmax(z))
        lps.append(z[tok] - z.max() - np.log(np.exp(z - z.max()).sum()))
        seq.append(tok)
    return seq[len(prompt) :], np.asarray(lps)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("recipe", "temperature"))
def _ref_token_logprobs(graphdef, params, tokens, mask, *, recipe, temperature=1.0):
    return mf.token_logprobs(graphdef, params, tokens, mask, recipe=recipe, temperature=temperature)


# The FP8 operands the trainer's forward computes from a master kernel, and one layer's dense
# values of a stored FP8 weight: jitted (one compile per shape instead of one per eager op).
_fake_quantize_weight = jax.jit(fp8.fake_quantize_weight, static_argnames="recipe")
_layer_dense = jax.jit(lambda w, i: fp8.dense_weights(jax.tree.map(lambda x: x[i], w)))


def _ref_response_logprobs(graphdef, params, completions, recipe, temperature=1.0):
    """`token_logprobs` over prompt ++ response (right-padded batch), response part only."""
    buf, mask = _ref_batch([list(c.prompt_ids) + list(c.response_ids) for c in completions])
    lp = np.asarray(
        _ref_token_logprobs(graphdef, params, buf, mask, recipe=recipe, temperature=temperature)
    )
    out = []
    for r, c in enumerate(completions):
        p = len(c.prompt_ids)
        out.append(lp[r, p : p + len(c.response_ids)])
    return out


def test_bucket():
    assert [bucket(n, 8) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 32]


def test_row_and_length_buckets():
    """Rows: eight sizes per octave from 8 on (padding under 12.5%); prompt and scored lengths:
    four from 16 on (under 25%); each the smallest multiple of 2^e / (2 * per_octave) (2^e:
    the power of two at or above it) that holds n."""
    ns = (1, 8, 9, 11, 16, 17, 33, 36, 64, 65, 200)
    assert [row_bucket(n) for n in ns] == [8, 8, 9, 11, 16, 18, 36, 36, 64, 72, 208]
    assert [length_bucket(n) for n in (1, 16, 17, 33, 48, 49, 100)] == [16, 16, 20, 40, 48, 56, 112]
    for n in range(8, 2000):
        for m, b, per_octave in ((n, row_bucket(n), 8), (n + 8, length_bucket(n + 8), 4)):
            assert m <= b < (1 + 1 / per_octave) * m
            step = max(1, (1 << (b - 1).bit_length()) // (2 * per_octave))
            assert b % step == 0 and b - step < m  # the smallest multiple of the step


def test_greedy_equals_stepwise_argmax_of_full_forward(model, engine):
    """Mixed prompt lengths in one batch (left padding), n = 4 identical greedy samples that
    share their prompt's prefill (3 prompts prefilled in 8 rows, copied to 12)."""
    cfg, graphdef, params, _ = model
    sp = SamplingParams(n=4, max_tokens=12, temperature=0.0)
    batch = generate_batch([tuple(p) for p in PROMPTS], [0, 1, 2], sp, set())
    assert batch.prefill_prompt.shape[0] == 8 and batch.prompt.shape[0] == 12
    np.testing.assert_array_equal(batch.source[:12], np.repeat([0, 1, 2], 4))
    out = engine.generate(PROMPTS, sp)
    assert [c.prompt_index for c in out] == [0] * 4 + [1] * 4 + [2] * 4
    for c in out:
        want_ids, want_lp = _ref_greedy(
            graphdef, params, PROMPTS[c.prompt_index], 12, engine.recipe
        )
        np.testing.assert_array_equal(c.response_ids, want_ids)
        # Greedy returns the raw (temperature 1) logprob; KV-cache decode vs full forward in
        # bf16 compute: same math, different op grouping.
        np.testing.assert_allclose(c.logprobs, want_lp, atol=2e-3)
        assert c.finish_reason == "length" and c.weight_version == "default"
    assert len({tuple(c.response_ids) for c in out}) == 3  # the model is not degenerate


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.7, -1, 1.0)],
)
def test_sampled_logprobs_equal_token_logprobs(model, engine, temperature, top_k, top_p):
    """Without truncation the sampling distribution is softmax(logits / T), which
    `token_logprobs(temperature=T)` computes independently on the finished sequences.
    (12 rows of 16 tokens: the greedy test's compiled shape, the temperature a traced input.)"""
    _, graphdef, params, _ = model
    sp = SamplingParams(
        n=4, max_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=5
    )
    out = engine.generate(PROMPTS, sp)
    ref = _ref_response_logprobs(graphdef, params, out, engine.recipe, temperature)
    for c, want in zip(out, ref, strict=True):
        assert len(c.response_ids) == 16
        # The fast numerics (bf16 compute, FP8 block recipe) round the decode step's sums in
        # another order than the full forward; the FP8 grid amplifies it (measured <= 6e-3).
        # Batch-invariant numerics make them equal: tests/models/test_invariant.py.
        np.testing.assert_allclose(c.logprobs, want, atol=1e-2)
    assert len({tuple(c.response_ids) for c in out}) >= len(out) // 2


def test_truncated_sampling_stays_in_the_kept_set(model, engine):
    """top-k 3 / top-p 0.5: every sampled token is among the row's 3 most likely under the
    full forward, and its logprob (renormalised) is >= its raw logprob."""
    _, graphdef, params, _ = model
    out = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=10, top_k=3, top_p=0.5, seed=1))
    raw = _ref_response_logprobs(graphdef, params, out, engine.recipe)
    for c, raw_lp in zip(out, raw, strict=True):
        seq = list(c.prompt_ids) + list(c.response_ids)
        logits = _ref_seq_logits(graphdef, params, seq, engine.recipe)
        p = len(c.prompt_ids)
        for i, tok in enumerate(c.response_ids):
            top3 = np.argsort(logits[p - 1 + i])[::-1][:3]
            assert tok in top3
        assert np.all(c.logprobs >= raw_lp - 1e-3)
        assert np.all(c.logprobs <= 0.0)


def test_seeds_reproduce_independent_of_batch(engine):
    sp = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=123)
    a = engine.generate(PROMPTS[:2], sp)  # 8 rows: bucket 8
    b = engine.generate(PROMPTS[:2], sp)
    c = engine.generate(PROMPTS, sp)  # 12 rows: bucket 16, longer prompt bucket
    for x, y, z in zip(a, b, c[:8], strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.response_ids, z.response_ids)
        np.testing.assert_allclose(x.logprobs, z.logprobs, atol=1e-5)
    d = engine.generate(PROMPTS[:2], SamplingParams(n=4, max_tokens=8, seed=124))
    assert any(
        not np.array_equal(x.response_ids, y.response_ids) for x, y in zip(a, d, strict=True)
    )


def test_chunks_sample_what_one_decode_samples(model, engine):
    """max_num_seqs below the rows: a call runs in chunks (here 5 + 3 rows, a prompt's samples
    split over both) and samples the tokens of the one-chunk decode; a call that fits in one
    chunk is that decode, bit for bit. Scoring in chunks gives the same numbers too."""
    cfg, graphdef, params, _ = model
    small = EmbeddedBackend(
        cfg, graphdef, params, recipe="fp8_block", eos_id=None, max_len=256, max_num_seqs=5
    )
    sp = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=123)
    whole = engine.generate(PROMPTS[:2], sp)  # 8 rows <= 256: one chunk
    chunked = small.generate(PROMPTS[:2], sp)
    assert [c.prompt_index for c in chunked] == [c.prompt_index for c in whole] == [0] * 4 + [1] * 4
    for x, y in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    for x, y in zip(engine.generate(PROMPTS[:1], sp), small.generate(PROMPTS[:1], sp), strict=True):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    seqs = [[1, 2, 3], [4] * 9, [5], [6, 7], [8] * 3, [9] * 5, [10] * 2]  # chunks of 5 + 2
    for x, y in zip(engine.score(seqs), small.score(seqs), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_stop_eos_and_max_tokens(model, engine):
    cfg, graphdef, params, _ = model
    base = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0))[0]
    ids = list(base.response_ids)
    stop = ids[3]
    first = ids.index(stop)
    # A stop token ends the response, is kept, finish "stop"; the prefix is unchanged.
    sp = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    s = engine.generate(PROMPTS[:1], sp)[0]
    assert list(s.response_ids) == ids[: first + 1] and s.finish_reason == "stop"
    np.testing.assert_allclose(s.logprobs, base.logprobs[: first + 1], atol=1e-6)
    # The same token as the engine's eos; ignore_eos runs on to max_tokens.
    eos_engine = EmbeddedBackend(
        cfg, graphdef, params, recipe="fp8_block", eos_id=stop, max_len=256
    )
    e = eos_engine.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert list(e.response_ids) == ids[: first + 1] and e.finish_reason == "stop"
    g = eos_engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    assert list(g.response_ids) == ids and g.finish_reason == "length"
    m = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert list(m.response_ids) == ids[:3] and m.finish_reason == "length"


def test_score_equals_token_logprobs(model, engine):
    _, graphdef, params, _ = model
    seqs = [[1, 2, 3, 4, 5], [9], list(range(30, 60))]
    got = engine.score(seqs)
    buf, mask = _ref_batch(seqs)
    want = np.asarray(_ref_token_logprobs(graphdef, params, buf, mask, recipe=engine.recipe))
    for r, s in enumerate(seqs):
        assert got[r].shape == (len(s),) and got[r][0] == 0.0
        np.testing.assert_allclose(got[r], want[r, : len(s)], atol=1e-4)
    for r, (lp, rk) in enumerate(engine.score_with_ranks(seqs)):
        s = seqs[r]
        np.testing.assert_allclose(lp, want[r, : len(s)], atol=1e-4)
        z = _ref_seq_logits(graphdef, params, s, engine.recipe)[:-1]
        want_rank = 1 + np.sum(z > z[np.arange(len(s) - 1), s[1:]][:, None], axis=-1)
        np.testing.assert_array_equal(rk, np.concatenate([[1], want_rank]))


def test_engine_owns_its_weights(model, engine):
    """The caller's param buffers may be donated or deleted (the trainer donates its state)."""
    cfg, graphdef, params, _ = model
    mine = jax.tree.map(jnp.copy, params)
    own = EmbeddedBackend(cfg, graphdef, mine, recipe="fp8_block", eos_id=None, max_len=256)
    jax.tree.map(lambda x: x.delete(), mine)
    seqs = [[1, 2, 3, 4, 5], [9]]
    for a, b in zip(own.score(seqs), engine.score(seqs), strict=True):
        np.testing.assert_array_equal(a, b)
    own.close()


def test_engine_without_weights_until_a_streamed_push(model, tmp_path):
    """params=None: refused until the first push; a push may stream (name, array) pairs
    (`iter_hf_state`), and then scores like the engine built with those weights (fp32 export)."""
    cfg, graphdef, params, _ = model
    eng = EmbeddedBackend(
        cfg, graphdef, None, eos_id=None, export_root=tmp_path, export_format="fp32"
    )
    with pytest.raises(RolloutError, match="no weights.*push_weights"):
        eng.score([[1, 2, 3]])
    eng.push_weights(iter_hf_state(cfg, params), "v1")
    ref = EmbeddedBackend(cfg, graphdef, params, eos_id=None)
    seqs = [[1, 2, 3, 4, 5], [9]]
    for a, b in zip(eng.score(seqs), ref.score(seqs), strict=True):
        np.testing.assert_array_equal(a, b)
    assert eng.weight_version() == "v1"


def test_errors_name_the_problem(engine):
    with pytest.raises(RolloutError, match="max_len"):
        engine.generate([[1] * 250], SamplingParams(max_tokens=10))
    with pytest.raises(RolloutError, match="outside"):
        engine.generate([[1, 9999]], SamplingParams(max_tokens=2))
    with pytest.raises(RolloutError, match="stop_token_ids holds token ids"):
        engine.generate([[1]], SamplingParams(max_tokens=2, stop_token_ids=(2**40,)))


def test_push_weights_through_export(model, tmp_path):
    """fp32 export: after a push the engine scores exactly like `token_logprobs` on the new
    masters, and every completion carries the new version."""
    cfg, graphdef, params, _ = model
    eng = EmbeddedBackend(
        cfg,
        graphdef,
        params,
        recipe="fp8_block",
        eos_id=EOS,
        max_len=256,
        export_root=tmp_path,
        export_format="fp32",
    )
    new_hf = sharp_hf_state(cfg, 2)
    new_params = from_hf_state_dict(cfg, new_hf)
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8]]
    before = eng.score(seqs)[0]
    old_struct = jax.tree.structure(eng.params)
    old_leaves = [(x.shape, x.dtype) for x in jax.tree.leaves(eng.params)]
    eng.push_weights(new_hf, "step-1")
    assert eng.weight_version() == "step-1"
    # Same pytree, shapes and dtypes: the jitted generate/score are reused, not recompiled.
    assert jax.tree.structure(eng.params) == old_struct
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(eng.params)] == old_leaves
    after = eng.score(seqs)[0]
    buf, mask = _ref_batch(seqs)
    want = np.asarray(_ref_token_logprobs(graphdef, new_params, buf, mask, recipe=eng.recipe))[
        0, : len(seqs[0])
    ]
    np.testing.assert_allclose(after, want, atol=1e-4)
    assert np.abs(before - want).max() > 0.1
    out = eng.generate(seqs, SamplingParams(n=2, max_tokens=4, seed=0))
    assert all(c.weight_version == "step-1" for c in out)


def test_fp8_export_round_trip(tmp_path):
    """FP8 checkpoint export -> engine. `dense_hf_state` gives exactly q * s; the recipe's
    re-quantization of q * s gives back the same FP8 codes with scales within one f32 ulp, so
    with f32 compute the engine ("fp8_fp32" export: the FP8 values, other tensors f32) scores
    like the trainer's recipe on the masters to float rounding; the GPU-server format "fp8"
    also rounds embeddings, norms and biases to bf16 (bounded by 5e-2 here)."""
    cfg = get_config("tiny_qwen2", compute_dtype=jnp.float32)
    graphdef, _ = mf.init_model(cfg, 0)
    hf = random_hf_state_dict(cfg, 3)
    params = from_hf_state_dict(cfg, hf)
    recipe = get_recipe("fp8_block")
    seqs = np.random.default_rng(0).integers(0, 256, (4, 40)).tolist()
    tokens = np.asarray(seqs, np.int32)
    want = np.asarray(
        _ref_token_logprobs(graphdef, params, tokens, np.ones_like(tokens), recipe=recipe)
    )
    # fp8_fp32: float rounding, plus now and then an activation whose 1-ulp f32 difference
    # crosses an FP8 rounding boundary (one FP8 step for that element), which depends on the
    # order in which XLA:CPU sums the f32 dots on the host CPU.
    for fmt, atol in (("fp8_fp32", 1e-4), ("fp8", 5e-2)):
        eng = EmbeddedBackend(
            cfg, graphdef, params, eos_id=EOS, export_root=tmp_path / fmt, export_format=fmt
        )
        eng.push_weights(hf, f"{fmt}-1")
        np.testing.assert_allclose(np.stack(eng.score(seqs)), want, atol=atol)
    assert EmbeddedBackend(cfg, graphdef, params, eos_id=EOS).export_format == "fp8"

    tensors, manifest = load_export(tmp_path / "fp8" / "fp8-1")
    served = served_params(cfg, tensors, manifest["quantization_config"])
    assert isinstance(served, type(eng.params))
    n_linear = 0
    for row in hf_name_map(cfg):
        if row.name + "_scale_inv" not in tensors:
            continue
        n_linear += 1
        stored = served
        for key in row.path:
            stored = stored[key]
        stored = stored.get_value()
        assert isinstance(stored, fp8.StoredFP8Weight) and stored.q.dtype == jnp.float8_e4m3fn
        dense = np.asarray(_layer_dense(stored, row.layer)).T
        q, s = fp8.quantize_weight(jnp.asarray(hf[row.name]), recipe)
        np.testing.assert_array_equal(dense, np.asarray(fp8.dequantize(q, s, (128, 128))))
        q2, s2 = fp8.quantize_weight(jnp.asarray(dense), recipe)
        np.testing.assert_array_equal(np.asarray(q2, np.float32), np.asarray(q, np.float32))
        np.testing.assert_allclose(np.asarray(s2), np.asarray(s), rtol=2**-23, atol=0)
    assert n_linear == 7 * cfg.num_layers
    # Compact (e4m3 + bf16) holds ~1/3 of the f32 bytes here (vocab-heavy tiny model), and it
    # scores like the f32 widening of the same tensors to about one f32 ulp (how XLA:CPU fuses
    # the in-program widening into the dots depends on the host CPU).
    nbytes = sum(x.nbytes for x in jax.tree.leaves(served))
    assert nbytes < 0.5 * sum(x.nbytes for x in jax.tree.leaves(params))
    widened = {n: np.asarray(x, np.float32) for n, x in tensors.items()}
    dense_eng = EmbeddedBackend(cfg, graphdef, params, eos_id=EOS)
    dense_eng.params = served_params(cfg, widened, manifest["quantization_config"])
    np.testing.assert_allclose(
        np.stack(dense_eng.score(seqs)), np.stack(eng.score(seqs)), rtol=4e-7, atol=0
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0)  # prefill + decode on FP8 codes
    for a, b in zip(
        eng.generate(PROMPTS, greedy), dense_eng.generate(PROMPTS, greedy), strict=True
    ):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=4e-7, atol=0)
    # The compact push is installed as q * s, not quantized again: every installed kernel is
    # the trainer's own forward operand bit for bit (the widened f32 copy is re-quantized).
    for row in hf_name_map(cfg):
        if row.name + "_scale_inv" not in tensors:
            continue
        node = eng.params
        for key in row.path:
            node = node[key]
        installed = np.asarray(node.get_value().slices[row.layer])
        master = params
        for key in row.path:
            master = master[key]
        want_op = _fake_quantize_weight(jnp.asarray(master.get_value()[row.layer]), recipe=recipe)
        np.testing.assert_array_equal(installed, np.asarray(want_op))


def test_default_export_folder_keeps_one_version_and_close_removes_it(model):
    cfg, graphdef, params, hf = model
    eng = EmbeddedBackend(cfg, graphdef, params, eos_id=EOS, export_format="bf16")
    eng.push_weights(hf, "v1")
    eng.push_weights(hf, "v2")
    assert sorted(p.name for p in eng.export_root.iterdir()) == ["v2"]
    eng.close()
    assert not eng.export_root.exists() and not eng.health()
    with pytest.raises(RolloutError, match="closed"):
        eng.generate([[1]], SamplingParams(max_tokens=1))


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_engine_holds_one_install_after_several_pushes(model, monkeypatch):
    """The engine drops its previous weights before it installs new ones: when an install
    starts, the previous one is no longer alive (live device buffers, `jax.live_arrays`: only
    the pushed export's params beside what was there before any push), and after 4 pushes
    the engine holds what it held after 1, one install's bytes."""
    from rollout_bridge.engine import params as engine_params

    cfg, graphdef, params, hf = model
    eng = EmbeddedBackend(cfg, graphdef, None, eos_id=EOS, export_format="fp8")
    base = _live_bytes()
    at_install = []
    real_install = engine_params.install

    def install(served, *args, **kwargs):
        at_install.append(_live_bytes() - base - sum(x.nbytes for x in jax.tree.leaves(served)))
        return real_install(served, *args, **kwargs)

    monkeypatch.setattr(engine_params, "install", install)
    eng.push_weights(hf, "v1")
    one = _live_bytes()
    installed = sum(x.nbytes for x in jax.tree.leaves(eng.params))
    assert one - base == installed > 0
    for k in range(2, 5):
        eng.push_weights(hf, f"v{k}")
    assert _live_bytes() == one
    assert at_install == [0, 0, 0, 0]  # nothing but the served export at each install's start
    eng.close()


def test_released_weights_are_freed_and_the_next_push_serves_the_same(model):
    """`release_weights` (the trainer's `rollout.free_cache_engine`) leaves no installed
    buffer alive (live device bytes back to those before any push), generate and score refuse
    with a message naming the cure, and the next push of the same weights samples the same
    tokens with the same logprobs, bit for bit."""
    cfg, graphdef, params, hf = model
    eng = EmbeddedBackend(cfg, graphdef, None, eos_id=EOS, export_format="fp8")
    base = _live_bytes()
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3)
    eng.push_weights(hf, "v1")
    before = eng.generate(PROMPTS, sp)
    eng.release_weights()
    assert eng.params is None and _live_bytes() == base
    assert eng.weight_version() == "v1"
    for call in (lambda: eng.generate(PROMPTS, sp), lambda: eng.score([[1, 2, 3]])):
        with pytest.raises(RolloutError, match=r"or released\); call push_weights"):
            call()
    eng.push_weights(hf, "v2")
    after = eng.generate(PROMPTS, sp)
    for a, b in zip(before, after, strict=True):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    eng.close()


@pytest.mark.parametrize(
    ("recipe", "fmt"),
    [("fp8_block", None), ("fp8_block", "fp8"), ("fp8_tensor", None), ("bf16", None)],
)
def test_weights_quantized_once_give_the_same_numbers(model, tmp_path, recipe, fmt):
    """Kernels fake-quantized once at install (`params.install`, forward under
    `prequantized_weights`) against quantizing them in every forward (the same params under
    the plain recipe): identical scores bit for bit, from the f32 masters and after a
    block-FP8 push (e4m3 codes + scales), whose samples and logprobs are checked too."""
    cfg, graphdef, params, hf = model
    eng = EmbeddedBackend(cfg, graphdef, params, recipe=recipe, eos_id=EOS, export_root=tmp_path)
    raw = params
    if fmt is not None:
        eng.export_format = fmt
        eng.push_weights(hf, "v1")
        tensors, manifest = load_export(tmp_path / "v1")
        raw = served_params(cfg, tensors, manifest["quantization_config"])
    assert eng._forward_recipe.prequantized_weights == (recipe != "bf16")
    per_step = EmbeddedBackend(cfg, graphdef, None, recipe=recipe, eos_id=EOS)
    per_step._params, per_step._forward_recipe = raw, per_step.recipe  # the per-step path
    if fmt == "fp8":  # the default run's path (prefill + decode loop); others score only
        sp = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3)
        for a, b in zip(eng.generate(PROMPTS, sp), per_step.generate(PROMPTS, sp), strict=True):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
    seqs = [[1, 2, 3, 4, 5], list(range(30, 60))]
    for a, b in zip(eng.score(seqs), per_step.score(seqs), strict=True):
        np.testing.assert_array_equal(a, b)
    eng.close()
    per_step.close()


@pytest.fixture(scope="module", params=["tiny_qwen3_moe_mixed", "tiny_qwen2_moe", "tiny_mixtral"])
def moe_model(request):
    """A tiny MoE model (8 experts, top 2; Qwen3-MoE with a dense layer between two MoE layers,
    Qwen2-MoE with its shared expert, Mixtral with its own tensor names), sharpened weights,
    f32 compute."""
    cfg = get_config(request.param, compute_dtype=jnp.float32)
    graphdef, _ = mf.abstract_model(cfg)
    hf = sharp_hf_state(cfg, 1)
    return cfg, graphdef, from_hf_state_dict(cfg, hf), hf


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_moe_greedy_and_scores_equal_full_forward(moe_model, recipe):
    """The engine decodes a Mixture-of-Experts model: its greedy tokens are the stepwise argmax
    of the full forward (every decode step routes its one token anew), and its scores equal
    `token_logprobs`."""
    cfg, graphdef, params, _ = moe_model
    eng = EmbeddedBackend(cfg, graphdef, params, recipe=recipe, eos_id=None, max_len=128)
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    for c in out:
        want_ids, want_lp = _ref_greedy(graphdef, params, PROMPTS[c.prompt_index], 8, eng.recipe)
        np.testing.assert_array_equal(c.response_ids, want_ids)
        np.testing.assert_allclose(c.logprobs, want_lp, atol=2e-3)
    assert len({tuple(c.response_ids) for c in out}) == 3
    seqs = [list(c.prompt_ids) + list(c.response_ids) for c in out]
    buf, mask = _ref_batch(seqs)
    want = np.asarray(_ref_token_logprobs(graphdef, params, buf, mask, recipe=eng.recipe))
    for r, got in enumerate(eng.score(seqs)):
        np.testing.assert_allclose(got, want[r, : len(seqs[r])], atol=1e-4)


def test_moe_block_fp8_push_installs_each_experts_operand(moe_model, tmp_path):
    """A block-FP8 export of an MoE model holds one e4m3 weight and one scale grid per expert
    (as vLLM's FP8 MoE checkpoints do) and a high-precision router; the engine installs each
    expert's weight as q * s, the trainer's forward operand of that expert bit for bit, and
    scores like the trainer's recipe on what it serves (the masters' FP8 operands and the
    export's bf16 embedding, router, norms and head)."""
    cfg, graphdef, params, hf = moe_model
    recipe = get_recipe("fp8_block")
    eng = EmbeddedBackend(
        cfg, graphdef, params, recipe="fp8_block", eos_id=EOS, export_root=tmp_path,
        export_format="fp8",
    )  # fmt: skip
    eng.push_weights(hf, "moe-1")
    tensors, _ = load_export(tmp_path / "moe-1")
    expert_weights = [n for n in hf if ".experts." in n]
    assert len(expert_weights) == cfg.num_moe_layers * cfg.num_experts * 3
    assert all(n + "_scale_inv" in tensors for n in expert_weights)
    gates = [n for n in hf if n.endswith(("gate.weight", "shared_expert_gate.weight"))]
    assert gates and not any(n + "_scale_inv" in tensors for n in gates)  # routers stay high
    experts = eng.params["model"]["layers"]["mlp"]["experts"]
    masters = params["model"]["layers"]["mlp"]["experts"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        for layer in range(cfg.num_moe_layers):
            installed = np.asarray(experts[name].get_value().slices[layer])
            want = jax.vmap(lambda w: _fake_quantize_weight(w, recipe=recipe))(
                masters[name].get_value()[layer]
            )
            np.testing.assert_array_equal(installed, np.asarray(want))
    # The trainer on what was served: the FP8 experts and linears from their masters (the
    # same operands, as checked), every other tensor as exported (bf16, widened).
    served = {
        n: hf[n] if n + "_scale_inv" in tensors else np.asarray(tensors[n], np.float32) for n in hf
    }
    seqs = np.random.default_rng(0).integers(0, 256, (4, 40)).tolist()
    buf, mask = _ref_batch(seqs)  # the greedy test's reference shape: its compile reused
    want = np.asarray(
        _ref_token_logprobs(graphdef, from_hf_state_dict(cfg, served), buf, mask, recipe=recipe)
    )[: len(seqs), :40]
    np.testing.assert_allclose(np.stack(eng.score(seqs)), want, atol=1e-4)


def test_moe_records_the_routing_the_trainer_computes(moe_model):
    """With `record_routing` each completion carries every fed token's experts per layer,
    aligned with prompt ++ response: the expert sets the full forward's router picks for the
    same tokens (`models.functional.routed_experts`), under FP8 block; the response's last
    token, never fed, is -1. Without it, completions carry none."""
    cfg, graphdef, params, _ = moe_model
    sp = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=0)
    eng = EmbeddedBackend(
        cfg, graphdef, params, recipe="fp8_block", eos_id=None, max_len=128, record_routing=True
    )
    out = eng.generate(PROMPTS, sp)
    buf = np.zeros((len(out), T_REF), np.int32)
    mask = np.zeros_like(buf)
    for r, c in enumerate(out):
        seq = list(c.prompt_ids) + list(c.response_ids)
        buf[r, : len(seq)], mask[r, : len(seq)] = seq, 1
    own = np.asarray(
        jax.jit(mf.routed_experts, static_argnums=0, static_argnames="recipe")(
            graphdef, params, buf, mask, recipe=eng.recipe
        )
    )
    for r, c in enumerate(out):
        n = len(c.prompt_ids) + len(c.response_ids)
        assert c.routed_experts.shape == (n, cfg.num_moe_layers, cfg.num_experts_per_tok)
        assert c.routed_experts.dtype == np.int16 and np.all(c.routed_experts[-1] == -1)
        np.testing.assert_array_equal(
            np.sort(c.routed_experts[: n - 1], axis=-1), np.sort(own[r, : n - 1], axis=-1)
        )
    plain = EmbeddedBackend(cfg, graphdef, params, recipe="fp8_block", eos_id=None, max_len=128)
    # (The greedy FP8 test's batch shape: its compiled decode is reused.)
    assert all(c.routed_experts is None for c in plain.generate(PROMPTS, sp))
