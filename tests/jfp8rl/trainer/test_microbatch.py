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
from jfp8rl.trainer import step as step_lib
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import default_settings, make_step_fns
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import Algorithm
from models import functional as mf
from models.config import get_config

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
N, P, R = 8, 5, 4
OPT = OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999)


@pytest.fixture(scope="module")
def model():
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32, num_layers=1)
    graphdef, params = mf.init_model(cfg, 0)
    return graphdef, params


def _fns(graphdef, params, agg: str, micro: int, *, calibrated: bool, recipe: str = "bf16"):
    algo = Algorithm(
        name="t", agg_mode=agg, use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0
    )
    s = default_settings(
        algo, train_recipe=recipe, calibrated=calibrated,
        calib_cfg=CalibConfig(eps_low=0.2, eps_high=0.2), correction="tis",
        correction_level="token", tis_cap=2.0, group_size=4, micro_batch_size=micro,
    )  # fmt: skip
    return make_step_fns(graphdef, s, OPT, replicated_layout(make_mesh(), params))


def _mini_batch(fns, params) -> dict[str, np.ndarray]:
    """A prepared mini-batch whose old logprobs are perturbed (ratios != 1, some clipped)."""
    b = random_batch(N, P, R, seed=3)
    b["response_mask"][5] = 0.0  # a dropped group's sample: excluded from sequence means
    b["rewards"] = np.array([1, 0, 0, 1, 0, 1, 1, 0], np.float32)
    calibrated = True in fns.prepare_programs
    out, _ = fns.prepare(params, params, put_batch(b, make_mesh()), calibrate=calibrated)
    mb = {k: b[k] for k in step_lib.MODEL_INPUTS + ("rollout_logp",)}
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


def _assert_close(a, b, rtol=1e-5):
    scale = max(float(np.max(np.abs(np.asarray(b)))), 1e-30)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batched_grads_equal_whole_mini_batch(model, agg: str) -> None:
    graphdef, params = model
    whole, micro = (_fns(graphdef, params, agg, m, calibrated=False) for m in (0, 2))
    mb = _mini_batch(whole, params)
    calib = init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2))
    loss_w, g_w, _, met_w = _grads(whole, params, calib, mb, False)
    loss_m, g_m, _, met_m = _grads(micro, params, calib, mb, False)
    assert float(met_w["actor/pg_clipfrac"]) > 0  # the clipped branch is exercised
    _assert_close(loss_m, loss_w)
    for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_w), strict=True):
        _assert_close(a, b)
    # Logged metrics are global too (one recomputation on the whole mini-batch).
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_q50", "actor/kl_loss"):
        _assert_close(met_m[k], met_w[k])


def test_micro_batched_calibrated_bounds_equal_whole(model) -> None:
    # Bounds solved once per mini-batch from all micro-batches' ratios: the same bounds (and
    # grads) as the whole mini-batch, on a calibrating and then a tracking mini-batch.
    graphdef, params = model
    agg = "token-mean"
    whole, micro = (_fns(graphdef, params, agg, m, calibrated=True) for m in (0, 4))
    mb = _mini_batch(whole, params)
    calib = init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2))
    for calibrate in (True, False):
        loss_w, g_w, cs_w, met_w = _grads(whole, params, calib, mb, calibrate)
        loss_m, g_m, cs_m, met_m = _grads(micro, params, calib, mb, calibrate)
        assert float(cs_w.n_calibrations) == 1
        for f in dataclasses.fields(cs_w):
            _assert_close(getattr(cs_m, f.name), getattr(cs_w, f.name))
        _assert_close(loss_m, loss_w)
        for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_w), strict=True):
            _assert_close(a, b)
        calib = cs_w


def _count_forwards(monkeypatch, fn, *args) -> dict[str, int]:
    """Model forwards traced into `fn`'s program, per recipe name."""
    counts: dict[str, int] = {}
    real = mf.token_logprobs_and_entropy

    def counting(*a, recipe, **kw):
        counts[recipe.name] = counts.get(recipe.name, 0) + 1
        return real(*a, recipe=recipe, **kw)

    monkeypatch.setattr(mf, "token_logprobs_and_entropy", counting)
    jax.make_jaxpr(fn)(*args)
    monkeypatch.setattr(mf, "token_logprobs_and_entropy", real)
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
    mb_np = _mini_batch(fns, params)
    state = {
        "params": params,
        "opt_state": fns.optimizer.init(params),
        "calib": init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2)),
    }
    upd = {}
    for c in (False, True):
        mb = {k: v for k, v in mb_np.items() if c or k != "old_logp_bf16"}
        upd[c] = _count_forwards(
            monkeypatch,
            fns.update_programs[c],
            state,
            put_batch(mb, make_mesh()),
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
