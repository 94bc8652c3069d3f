"""Registry defaults and compute_loss = policy + KL - entropy, against numpy."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _loss_testlib import np_policy_loss, random_inputs

from losses import calibrated as C
from losses.policy import importance_ratio
from losses.registry import ALGORITHMS, compute_loss, get_algorithm


class RegistryTest(chex.TestCase):
    def test_defaults(self):
        assert set(ALGORITHMS) == {"grpo", "dapo", "dr_grpo", "gspo"}
        assert get_algorithm("dapo").plain_bounds == (0.8, 1.28)
        assert get_algorithm("dapo").agg_mode == "token-mean"
        assert (
            get_algorithm("grpo").agg_mode == "seq-mean-token-mean"
            and get_algorithm("grpo").use_kl_loss
        )
        assert get_algorithm("dr_grpo").adv_estimator == "dr_grpo"
        assert get_algorithm("gspo").ratio_level == "sequence"
        with pytest.raises(ValueError, match="unknown algorithm"):
            get_algorithm("ppo2")
        with pytest.raises(ValueError, match="agg_mode"):
            dataclasses.replace(get_algorithm("grpo"), agg_mode="mean")

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_total_loss(self):
        logp, old, adv, mask, w = random_inputs(5)
        rng = np.random.default_rng(0)
        ref = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
        ent = rng.uniform(0, 3, logp.shape).astype(np.float32)
        algo = dataclasses.replace(get_algorithm("grpo"), entropy_coef=0.01)
        fn = self.variant(functools.partial(compute_loss, algo, lo=0.75, hi=1.3))
        loss, aux = fn(
            logp=logp,
            old_logp=old,
            advantages=adv,
            mask=mask,
            is_weights=w,
            ref_logp=ref,
            entropy=ent,
        )
        agg = "seq-mean-token-mean"
        pg = np_policy_loss(logp, old, adv, mask, 0.75, 1.3, agg, dual=3.0, w=w)
        d = logp.astype(np.float64) - ref
        k3 = np.exp(-d) + d - 1
        valid = mask.sum(-1) > 0

        def seq_mean(x):
            return ((x * mask).sum(-1)[valid] / mask.sum(-1)[valid]).mean()

        expected = pg + 0.001 * seq_mean(k3) - 0.01 * seq_mean(ent)
        np.testing.assert_allclose(loss, expected, rtol=2e-5)
        np.testing.assert_allclose(aux["actor/loss"], expected, rtol=2e-5)
        np.testing.assert_allclose(aux["actor/clip_lo"], 0.75)

    def test_missing_inputs_name_the_argument(self):
        logp, old, adv, mask, _ = random_inputs(6)
        with pytest.raises(ValueError, match="ref_logp"):
            compute_loss(get_algorithm("grpo"), logp=logp, old_logp=old, advantages=adv, mask=mask)
        loss, aux = compute_loss(
            get_algorithm("dapo"), logp=logp, old_logp=old, advantages=adv, mask=mask
        )
        np.testing.assert_allclose(aux["actor/clip_hi"], 1.28)
        np.testing.assert_allclose(
            loss, np_policy_loss(logp, old, adv, mask, 0.8, 1.28, "token-mean", dual=3.0), rtol=2e-5
        )


def test_calibrated_switch_inside_one_jitted_step():
    """The trainer's pattern: bounds from current_bounds, then compute_loss, one jit, one grad."""
    logp, old, adv, mask, w = random_inputs(8, b=8, t=16)
    algo = get_algorithm("dapo")
    # track mode: current_bounds re-solves the bounds inside the jitted step (n_updates 1).
    cfg = C.CalibConfig(eps_low=algo.eps_low, eps_high=algo.eps_high, mode="track")
    r16 = np.asarray(importance_ratio(logp, old))
    r8 = (r16 * np.exp(np.random.default_rng(0).normal(0, 0.1, r16.shape))).astype(np.float32)
    state, _ = jax.jit(C.calibrate, static_argnums=1)(
        C.init_calib_state(cfg), cfg, r8, r16, adv, mask
    )

    @jax.jit
    def step(lp, st):
        def loss_fn(lp):
            r = importance_ratio(jax.lax.stop_gradient(lp), old)
            st2, lo, hi, caux = C.current_bounds(st, cfg, r, adv, mask)
            loss, aux = compute_loss(
                algo, logp=lp, old_logp=old, advantages=adv, mask=mask, lo=lo, hi=hi, is_weights=w
            )
            return loss, (aux, caux, st2)

        return jax.value_and_grad(loss_fn, has_aux=True)(lp)

    (loss, (aux, caux, st2)), g = step(jnp.asarray(logp), state)
    lo, hi = float(caux["calib/lower"]), float(caux["calib/upper"])
    assert (lo, hi) != (0.8, 1.28) and int(st2.n_updates) == 1
    np.testing.assert_allclose(
        loss, np_policy_loss(logp, old, adv, mask, lo, hi, "token-mean", dual=3.0, w=w), rtol=2e-5
    )
    chex.assert_tree_all_finite((aux, caux, g))
