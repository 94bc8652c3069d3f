"""Micro-batched `update` == the whole mini-batch at once (docs/design.md section 9), and the BF16
shadow forwards exist only in the calibrating programs.

Gradient accumulation is exact only if every micro-batch's loss is its numerator over the
mini-batch's global denominator: checked for the four aggregation modes, with padding, unequal
prompt and response lengths and a fully masked sample (a dropped group), with the KL and
entropy terms on (they share the denominator), in f32 with the BF16 recipe (no FP8 rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import random_batch

from jfp8rl.parallel.mesh import make_mesh, put_batch, replicated_layout
from jfp8rl.trainer.forward import MODEL_INPUTS, present
from jfp8rl.trainer.microbatch import (
    length_buckets,
    pack_token_budget,
    padding_share,
    scatter_rows,
    sequence_lengths,
    take_rows,
)
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import Algorithm
from models import functional as mf
from models.config import get_config

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
N, P, R = 8, 5, 4
OPT = OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999)
# Token-budget micro-batches of P + R = 9 tokens at most: a budget of 10 tokens holds 1 row of
# bucket 9 or 2 of bucket 5 (the batch's sequences: 3 to 9 tokens).
BUCKETS, BUDGET = (5, 9), 10
CALIB = CalibConfig(eps_low=0.2, eps_high=0.2)


@pytest.fixture(scope="module")
def model():
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32, num_layers=1)
    graphdef, params = mf.init_model(cfg, 0)
    return graphdef, params


def _fns(
    graphdef, params, agg: str, micro: int, *, calibrated: bool, recipe: str = "bf16", budget=0
):
    algo = Algorithm(
        name="t", agg_mode=agg, use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0
    )
    s = default_settings(
        algo, train_recipe=recipe, calibrated=calibrated,
        calib_cfg=CALIB, correction="tis",
        correction_level="token", tis_cap=2.0, group_size=4, micro_batch_size=micro,
        max_tokens_per_micro_batch=budget, length_buckets=BUCKETS,
    )  # fmt: skip
    return make_step_fns(graphdef, s, OPT, replicated_layout(make_mesh(), params))


def _mini_batch(fns, params) -> dict[str, np.ndarray]:
    """A prepared mini-batch whose old logprobs are perturbed (ratios != 1, some clipped)."""
    b = random_batch(N, P, R, seed=3)
    b["response_mask"][5] = 0.0  # a dropped group's sample: excluded from sequence means
    b["rewards"] = np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float32)
    calibrated = True in fns.prepare_programs
    out, _ = fns.prepare(params, params, put_batch(b, make_mesh()), calibrate=calibrated)
    mb = present(b, MODEL_INPUTS + ("rollout_logp",))
    mb |= {k: np.asarray(v) for k, v in out.items()}
    noise = np.random.default_rng(4).normal(0, 0.3, size=(N, R)).astype(np.float32)
    m = b["response_mask"]
    mb["old_logp"] = mb["old_logp"] + noise * m
    if calibrated:
        mb["old_logp_bf16"] = mb["old_logp_bf16"] + noise * m
    mb["ref_logp"] = mb["ref_logp"] - 0.5 * noise * m
    return mb


def _grads(fns, params, calib, mb, calibrate):
    fn = jax.jit(fns.loss_and_grads, static_argnums=4)
    return fn(params, calib, put_batch(mb, make_mesh()), jnp.asarray(False), calibrate)


def _state(fns, params):
    return {
        "params": params,
        "opt_state": fns.optimizer.init(params),
        "calib": init_calib_state(CALIB),
    }


def _assert_close(a, b, rtol=1e-5):
    scale = max(float(np.max(np.abs(np.asarray(b)))), 1e-30)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batched_grads_equal_whole_mini_batch(model, agg: str) -> None:
    graphdef, params = model
    whole, micro = (_fns(graphdef, params, agg, m, calibrated=False) for m in (0, 2))
    mb = _mini_batch(whole, params)
    calib = init_calib_state(CALIB)
    loss_w, g_w, _, met_w = _grads(whole, params, calib, mb, False)
    loss_m, g_m, _, met_m = _grads(micro, params, calib, mb, False)
    assert float(met_w["actor/pg_clipfrac"]) > 0  # the clipped branch is exercised
    _assert_close(loss_m, loss_w)
    for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_w), strict=True):
        _assert_close(a, b)
    # Logged metrics are global too (one recomputation on the whole mini-batch).
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_q50", "actor/kl_loss"):
        _assert_close(met_m[k], met_w[k])
    # Token-budget micro-batches: unequal shapes (buckets 5 and 9), response arrays cut to
    # each bucket, the empty sample left out; the same grads.
    budget = _fns(graphdef, params, agg, 0, calibrated=False, budget=BUDGET)
    acc = budget.token_budget.accumulate(_state(budget, params), mb, False, False)
    _, plan = budget.token_budget.plan(mb)
    assert sorted({p.length for p in plan}) == [5, 9] and acc.micro_batches == len(plan)
    assert 5 not in np.concatenate([p.samples for p in plan])  # the empty sample
    for a, b in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(g_w), strict=True):
        _assert_close(a, b)


@pytest.fixture(scope="module")
def calibrated_whole(model):
    """(mini-batch, {calibrate: (calib state in, whole mini-batch's (loss, grads, calib state,
    metrics))}) under calibrated bounds, "token-mean": a calibrating and then a tracking
    mini-batch, the second from the first's calib state. Computed once for the calibrated
    micro-batch and token-budget tests."""
    graphdef, params = model
    whole = _fns(graphdef, params, "token-mean", 0, calibrated=True)
    mb = _mini_batch(whole, params)
    calib, out = init_calib_state(CALIB), {}
    for calibrate in (True, False):
        out[calibrate] = (calib, _grads(whole, params, calib, mb, calibrate))
        calib = out[calibrate][1][2]
    return mb, out


def test_micro_batched_calibrated_bounds_equal_whole(model, calibrated_whole) -> None:
    # Bounds solved once per mini-batch from all micro-batches' ratios: the same bounds (and
    # grads) as the whole mini-batch, on a calibrating and then a tracking mini-batch.
    graphdef, params = model
    micro = _fns(graphdef, params, "token-mean", 4, calibrated=True)
    mb, whole = calibrated_whole
    for calibrate in (True, False):
        calib, (loss_w, g_w, cs_w, met_w) = whole[calibrate]
        loss_m, g_m, cs_m, met_m = _grads(micro, params, calib, mb, calibrate)
        assert float(cs_w.n_calibrations) == 1
        for f in dataclasses.fields(cs_w):
            _assert_close(getattr(cs_m, f.name), getattr(cs_w, f.name))
        _assert_close(loss_m, loss_w)
        for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_w), strict=True):
            _assert_close(a, b)


def _count_forwards(monkeypatch, fn, *args) -> dict[str, int]:
    """Model forwards traced into `fn`'s program, per recipe name."""
    counts: dict[str, int] = {}
    real = mf.hidden_states_routing_and_load

    def counting(*a, recipe, **kw):
        counts[recipe.name] = counts.get(recipe.name, 0) + 1
        return real(*a, recipe=recipe, **kw)

    monkeypatch.setattr(mf, "hidden_states_routing_and_load", counting)
    jax.make_jaxpr(fn)(*args)
    monkeypatch.setattr(mf, "hidden_states_routing_and_load", real)
    return counts


def test_bf16_shadow_only_in_calibrating_programs(model, monkeypatch) -> None:
    graphdef, params = model
    fns = _fns(graphdef, params, "token-mean", 2, calibrated=True, recipe="fp8_block")
    b = put_batch(random_batch(N, P, R, seed=5), make_mesh())
    prep = {
        c: _count_forwards(monkeypatch, fns.prepare_programs[c], params, params, b)
        for c in (False, True)
    }
    # prepare: the FP8 old logprobs and the KL reference; the BF16 old logprobs only when calibrating.
    assert prep[False] == {"fp8_block": 2}
    assert prep[True] == {"fp8_block": 2, "bf16": 1}
    # The update's inputs as `prepare` gives them: shapes only (traced, never compiled).
    out = jax.eval_shape(fns.prepare_programs[True], params, params, b)[0]
    mb_shapes = present(random_batch(N, P, R, seed=5), MODEL_INPUTS + ("rollout_logp",)) | out
    state = {
        "params": params,
        "opt_state": fns.optimizer.init(params),
        "calib": init_calib_state(CALIB),
    }
    upd = {}
    for c in (False, True):
        mb = {k: v for k, v in mb_shapes.items() if c or k != "old_logp_bf16"}
        upd[c] = _count_forwards(
            monkeypatch,
            fns.update_programs[c],
            state,
            mb,
            jnp.asarray(False),
        )
    # update (2 micro-batches, calibrated bounds): the no-gradient FP8 pre-pass for the bounds
    # and the FP8 forward/backward; the BF16 forward of the current params only when calibrating.
    assert upd[False] == {"fp8_block": 2}
    assert upd[True] == {"fp8_block": 2, "bf16": 1}

    # The jaxpr itself: the non-calibrating program is smaller by the BF16 forward.
    def n_dots(fn, *args) -> int:
        return str(jax.make_jaxpr(fn)(*args)).count("dot_general")

    assert n_dots(fns.prepare_programs[False], params, params, b) < n_dots(
        fns.prepare_programs[True], params, params, b
    )


def test_token_budget_calibrated_update_equals_whole(model, calibrated_whole) -> None:
    # The no-gradient pre-pass over the token-budget micro-batches: the calibrated bounds (on a
    # calibrating and then a tracking mini-batch), grads and every logged metric of the update
    # equal the whole mini-batch's.
    graphdef, params = model
    budget = _fns(graphdef, params, "token-mean", 0, calibrated=True, budget=BUDGET)
    mb, whole = calibrated_whole
    for calibrate in (True, False):
        calib, (_, g_w, cs_w, _) = whole[calibrate]
        state = _state(budget, params) | {"calib": calib}
        acc = budget.token_budget.accumulate(state, mb, calibrate, False)
        assert float(cs_w.n_calibrations) == 1
        for f in dataclasses.fields(cs_w):
            _assert_close(getattr(acc.calib, f.name), getattr(cs_w, f.name))
        for a, b in zip(jax.tree.leaves(acc.grads), jax.tree.leaves(g_w), strict=True):
            _assert_close(a, b)
    # The update itself (calibrating): the metrics recomputed on the whole mini-batch.
    met_w = whole[True][1][3]
    copy = jax.tree.map(jnp.copy, params)
    _, met_b = budget.update(_state(budget, copy), mb, True)
    assert float(met_w["actor/pg_clipfrac"]) > 0  # the clipped branch is exercised
    for k in met_w:
        _assert_close(met_b[k], met_w[k])
    assert 0 < met_b["perf/padding_share"] < 0.5


def test_length_buckets() -> None:
    assert length_buckets(16384, 6) == (512, 1024, 2048, 4096, 8192, 16384)
    assert length_buckets(100, 3) == (32, 56, 100)  # 100, 50 -> 56, 25 -> 32 (multiples of 8)
    assert length_buckets(9, 3) == (8, 9)  # 9 / 2 and 9 / 4 both round up to 8


def test_pack_token_budget_hand_computed() -> None:
    # Sorted: 16 (5), 12 (2), 9 (7), 7 (4), 5 (0), 3 (3), 2 (6); sample 1 is empty (left out).
    # Bucket 16 holds 16 // 16 = 1 row per rank, bucket 8 two; snake order over 2 ranks.
    lengths = np.array([5, 0, 12, 3, 7, 16, 2, 9])
    plan = pack_token_budget(lengths, budget=16, ranks=2, buckets=(4, 8, 16))
    assert [p.length for p in plan] == [16, 16, 8]
    assert [p.rows.tolist() for p in plan] == [[5, 2], [7, 4], [0, -1, 3, 6]]
    for p in plan:  # the budget per rank: rows per rank x padded length
        assert (p.rows.size // 2) * p.length <= 16
        assert lengths[p.samples].max() <= p.length
    # Balance: rank 0 holds sample 0 (5 tokens), rank 1 samples 3 and 6 (3 + 2 tokens).
    assert lengths[plan[2].rows[:2][plan[2].rows[:2] >= 0]].sum() == 5 == lengths[[3, 6]].sum()
    # Computed 2 x 16 + 2 x 16 + 4 x 8 = 96 tokens, 54 of them real.
    assert padding_share(plan, lengths) == pytest.approx(1 - 54 / 96)
    with pytest.raises(ValueError, match="budget of 8 cannot hold one sequence of 16"):
        pack_token_budget(lengths, budget=8, ranks=2, buckets=(4, 8, 16))


def test_take_and_scatter_rows() -> None:
    b = random_batch(4, 3, 3, seed=1)
    assert sequence_lengths(b["attention_mask"]).tolist() == list(
        b["prompt_lens"] + b["response_lens"]
    )
    plan = pack_token_budget(sequence_lengths(b["attention_mask"]), 12, 1, (4, 6))
    for p in plan:
        m = take_rows(b, p)
        assert m["tokens"].shape == (p.rows.size, p.length)
        assert m["response_mask"].shape == (p.rows.size, min(3, p.length))
        filler = p.rows < 0
        assert (m["response_mask"][filler] == 0).all()
        assert (m["attention_mask"][filler].sum(axis=1) == 1).all()
        real = p.rows[~filler]
        np.testing.assert_array_equal(m["tokens"][~filler], b["tokens"][real, : p.length])
    parts = [take_rows(b, p)["rollout_logp"] for p in plan]
    np.testing.assert_array_equal(scatter_rows(plan, parts, 4, 3), b["rollout_logp"])
