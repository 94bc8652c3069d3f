"""policy_loss: hand-computed cases, a float64 numpy reference, gradients, masking, reduction."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _loss_testlib import np_policy_loss, random_inputs
from absl.testing import parameterized

from losses.masked import agg_denominator
from losses.policy import policy_loss

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# Hand case: seq 0 has A = +2, seq 1 has A = -1; bounds 0.8 / 1.28, dual clip 3.
RATIOS = np.array([[1.0, 0.5, 1.5, 1.2], [1.1, 0.7, 4.0, 0.9]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
ADV = np.array([[2.0] * 4, [-1.0] * 4], np.float32)
# Per-token losses worked by hand: -min(rA, clip(r)A), dual min(., 3) for A < 0.
#   seq 0: r=1 -> -2; r=0.5 -> max(-1, -1.6) = -1; r=1.5 -> max(-3, -2.56) = -2.56 (clipped)
#   seq 1: r=1.1 -> 1.1; r=0.7 -> max(0.7, 0.8) = 0.8 (clipped); r=4 -> min(4, 3) = 3 (dual);
#          r=0.9 -> 0.9
SEQ_SUMS_DUAL = np.array([-5.56, 5.8])
SEQ_SUMS_NODUAL = np.array([-5.56, 6.8])
HAND_DUAL = {
    "token-mean": 0.24 / 7,
    "seq-mean-token-mean": (-5.56 / 3 + 5.8 / 4) / 2,
    "seq-mean-token-sum": 0.24 / 2,
    "seq-mean-token-sum-norm": (-5.56 / 4 + 5.8 / 4) / 2,
}


def hand_inputs():
    old = np.full(RATIOS.shape, -1.0, np.float32)
    logp = (old + np.log(RATIOS)).astype(np.float32)
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ADV), jnp.asarray(MASK)


class HandComputedTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(m, m) for m in AGG_MODES])
    def test_aggregation_modes(self, agg):
        logp, old, adv, mask = hand_inputs()
        fn = self.variant(
            functools.partial(
                policy_loss, clip_low=0.8, clip_high=1.28, agg_mode=agg, dual_clip=3.0
            )
        )
        loss, aux = fn(logp, old, adv, mask)
        np.testing.assert_allclose(loss, HAND_DUAL[agg], rtol=1e-5)
        np.testing.assert_allclose(aux["actor/pg_loss"], HAND_DUAL[agg], rtol=1e-5)
        np.testing.assert_allclose(
            aux["actor/pg_loss_num"] / aux["actor/pg_loss_den"], HAND_DUAL[agg], rtol=1e-5
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_metrics_both_sides_both_signs(self):
        logp, old, adv, mask = hand_inputs()
        fn = self.variant(
            functools.partial(
                policy_loss, clip_low=0.8, clip_high=1.28, agg_mode="token-mean", dual_clip=3.0
            )
        )
        _, aux = fn(logp, old, adv, mask)
        # clipped term wins at (0, r=1.5) and (1, r=0.7); dual clip at (1, r=4).
        np.testing.assert_allclose(aux["actor/pg_clipfrac"], 2 / 7, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/clipfrac_neg_lower"], 1 / 7, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/clipfrac_pos_upper"], 1 / 7, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/pg_clipfrac_lower"], 1 / 7, rtol=1e-6)
        # Over the tokens of one sign: 1 of the 4 A < 0 tokens, 1 of the 3 A > 0 tokens.
        np.testing.assert_allclose(aux["actor/clipfrac_neg_lower_of_neg"], 1 / 4, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/clipfrac_pos_upper_of_pos"], 1 / 3, rtol=1e-6)
        assert float(aux["actor/sum/neg"]) == 4.0 and float(aux["actor/sum/pos"]) == 3.0
        kl = -np.log(RATIOS)[MASK > 0].mean()
        np.testing.assert_allclose(aux["actor/ppo_kl"], kl, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(aux["actor/ratio_max"], 4.0, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/ratio_min"], 0.5, rtol=1e-6)
        np.testing.assert_allclose(aux["actor/ratio_q50"], 1.0, rtol=1e-6)  # sorted[3] of 7
        assert float(aux["actor/sum/tokens"]) == 7.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_dual_clip_and_norm_constant(self):
        logp, old, adv, mask = hand_inputs()
        fn = self.variant(
            functools.partial(policy_loss, clip_low=0.8, clip_high=1.28, agg_mode="token-mean")
        )
        np.testing.assert_allclose(
            fn(logp, old, adv, mask)[0], SEQ_SUMS_NODUAL.sum() / 7, rtol=1e-5
        )
        fn = self.variant(
            functools.partial(
                policy_loss,
                clip_low=0.8,
                clip_high=1.28,
                agg_mode="seq-mean-token-sum-norm",
                dual_clip=3.0,
                loss_scale_len=10,
            )
        )
        np.testing.assert_allclose(
            fn(logp, old, adv, mask)[0], (SEQ_SUMS_DUAL / 10).mean(), rtol=1e-5
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_inside_is_minus_a_r_w_and_clipped_is_zero(self):
        logp, old, adv, mask = hand_inputs()
        w = jnp.asarray(np.array([[1.5, 0.5, 2.0, 9.0], [0.25, 1.0, 1.0, 2.0]], np.float32))

        def f(lp):
            return policy_loss(
                lp,
                old,
                adv,
                mask,
                clip_low=0.8,
                clip_high=1.28,
                agg_mode="token-mean",
                dual_clip=3.0,
                is_weights=w,
            )[0]

        g = self.variant(jax.grad(f))(logp)
        inside = np.array([[1, 1, 0, 0], [1, 0, 0, 1]], bool)  # clipped, dual-clipped, padding: 0
        expected = np.where(inside, -ADV * RATIOS * np.asarray(w) / 7.0, 0.0)
        np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_on_a_bound_keeps_full_gradient(self):
        # verl/torch: a token with r exactly on a bound is not clipped (pg_clipfrac counts
        # pg2 > pg1 only) and its gradient is the full -A r / n (torch.clamp passes the
        # gradient at its bounds; torch.maximum splits a tie evenly between equal branches).
        # Realistic: on-policy r == 1 against a calibrated bound clamped to 1. Hand case,
        # token-mean over 4 tokens: r = (1, 1, 1, 1), A = (-1, +2, -3, +0.5), lo = hi = 1.
        zeros = jnp.zeros((1, 4), jnp.float32)
        adv = jnp.asarray([[-1.0, 2.0, -3.0, 0.5]])
        mask = jnp.ones((1, 4), jnp.float32)

        def f(lp):
            return policy_loss(
                lp,
                zeros,
                adv,
                mask,
                clip_low=1.0,
                clip_high=1.0,
                agg_mode="token-mean",
                ratio_quantiles=(),
            )

        (loss, aux), g = self.variant(jax.value_and_grad(f, has_aux=True))(zeros)
        np.testing.assert_allclose(g, [[0.25, -0.5, 0.75, -0.125]], rtol=1e-6)
        np.testing.assert_allclose(loss, (1.0 - 2.0 + 3.0 - 0.5) / 4, rtol=1e-6)
        assert float(aux["actor/pg_clipfrac"]) == 0.0
        # Bounds equal to tokens' own ratios (Calibrated Clipping's L = x_(k), quantile-rule
        # H = y_(j)): full gradient on those tokens, zero on the one strictly below lo.
        logp = jnp.log(jnp.asarray([[0.7, 0.9, 1.1, 1.2]], jnp.float32))
        adv = jnp.asarray([[-1.0, -1.0, 1.0, 1.0]])
        r = np.exp(np.asarray(logp))
        r_jax = jnp.exp(jnp.clip(logp - zeros, -20.0, 20.0))  # as the loss computes it
        lo, hi = float(r_jax[0, 1]), float(r_jax[0, 3])

        def f2(lp):
            return policy_loss(
                lp,
                zeros,
                adv,
                mask,
                clip_low=lo,
                clip_high=hi,
                agg_mode="token-mean",
                ratio_quantiles=(),
            )[0]

        g = self.variant(jax.grad(f2))(logp)
        np.testing.assert_allclose(g, [[0.0, r[0, 1] / 4, -r[0, 2] / 4, -r[0, 3] / 4]], rtol=1e-5)


class ReferenceTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(agg=AGG_MODES, level=("token", "sequence"))
    def test_matches_float64_numpy(self, agg, level):
        # Dual clip and IS weights on at token level, off at sequence level (as verl's GSPO).
        dual, weighted = (3.0, True) if level == "token" else (None, False)
        logp, old, adv, mask, w = random_inputs(AGG_MODES.index(agg) + 10 * (level == "token"))
        lo, hi = (0.8, 1.28) if level == "token" else (0.97, 1.04)
        fn = self.variant(
            functools.partial(
                policy_loss,
                clip_low=lo,
                clip_high=hi,
                agg_mode=agg,
                ratio_level=level,
                dual_clip=dual,
                ratio_quantiles=(),
            )
        )
        loss, _ = fn(logp, old, adv, mask, is_weights=w if weighted else None)
        ref = np_policy_loss(
            logp, old, adv, mask, lo, hi, agg, level, dual, w if weighted else None
        )
        np.testing.assert_allclose(loss, ref, rtol=2e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_gradient_is_sequence_level(self):
        logp, old, adv, mask, _ = random_inputs(3)
        lo, hi = 0.5, 2.0  # wide: no sequence is clipped

        def f(lp):
            return policy_loss(
                lp,
                old,
                adv,
                mask,
                clip_low=lo,
                clip_high=hi,
                agg_mode="seq-mean-token-mean",
                ratio_level="sequence",
            )[0]

        g = self.variant(jax.grad(f))(jnp.asarray(logp))
        n_b = mask.sum(-1)
        valid = n_b > 0
        s = np.exp(((logp - old) * mask).sum(-1) / np.maximum(n_b, 1))
        per_tok = -adv[:, 0] * s / np.maximum(n_b, 1) / valid.sum()
        np.testing.assert_allclose(g, per_tok[:, None] * mask, rtol=1e-4, atol=1e-7)


class MaskingAndReductionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_values_change_nothing(self):
        logp, old, adv, mask, w = random_inputs(7)
        pad = mask == 0
        rng = np.random.default_rng(1)
        junk = lambda x, v: np.where(pad, v, x).astype(np.float32)  # noqa: E731

        def f(lp, o, a, ww):
            return policy_loss(
                lp,
                o,
                a,
                mask,
                clip_low=0.8,
                clip_high=1.28,
                agg_mode="seq-mean-token-mean",
                dual_clip=3.0,
                is_weights=ww,
            )

        vg = self.variant(jax.value_and_grad(f, has_aux=True))
        (l1, a1), g1 = vg(logp, old, adv, w)
        (l2, a2), g2 = vg(
            junk(logp, 50.0),
            junk(old, np.inf),
            junk(adv, rng.normal(size=adv.shape) * 1e3),
            junk(w, np.nan),
        )
        np.testing.assert_allclose(l1, l2, rtol=0, atol=0)
        np.testing.assert_allclose(g1, g2, rtol=0, atol=0)
        assert np.all(np.asarray(g2)[pad] == 0.0)
        chex.assert_trees_all_close(a1, a2)
        chex.assert_tree_all_finite(a2)

    @pytest.mark.filterwarnings("ignore")
    def test_micro_batches_reduce_exactly(self):
        logp, old, adv, mask, _ = random_inputs(11, b=8)
        for agg in AGG_MODES:
            kw = dict(clip_low=0.8, clip_high=1.28, agg_mode=agg, dual_clip=3.0, ratio_quantiles=())
            full, aux = policy_loss(logp, old, adv, mask, **kw)
            parts = [
                policy_loss(logp[s], old[s], adv[s], mask[s], **kw)[1]
                for s in (slice(0, 3), slice(3, 8))
            ]
            num = sum(p["actor/pg_loss_num"] for p in parts)
            den = sum(p["actor/pg_loss_den"] for p in parts)
            np.testing.assert_allclose(num / den, full, rtol=1e-5)
            summed = sum(
                policy_loss(
                    logp[s], old[s], adv[s], mask[s], denominator=aux["actor/pg_loss_den"], **kw
                )[0]
                for s in (slice(0, 3), slice(3, 8))
            )
            np.testing.assert_allclose(summed, full, rtol=1e-5)
            # The mask-only denominator the micro-batched trainer passes in, by hand: tokens
            # (token-mean) or non-empty sequences (seq-*).
            m = np.asarray(mask) != 0
            want = m.sum() if agg == "token-mean" else m.any(axis=1).sum()
            assert (
                float(agg_denominator(mask, agg)) == float(want) == float(aux["actor/pg_loss_den"])
            )
            clipped = sum(p["actor/sum/clipped"] for p in parts) / sum(
                p["actor/sum/tokens"] for p in parts
            )
            np.testing.assert_allclose(clipped, aux["actor/pg_clipfrac"], rtol=1e-6)

    def test_empty_mask_is_finite(self):
        logp, old, adv, mask, _ = random_inputs(2)
        loss, aux = jax.jit(
            functools.partial(
                policy_loss, clip_low=0.8, clip_high=1.28, agg_mode="seq-mean-token-mean"
            )
        )(logp, old, adv, np.zeros_like(mask))
        assert float(loss) == 0.0
        chex.assert_tree_all_finite(aux)

    def test_array_bounds_and_vmap(self):
        logp, old, adv, mask, _ = random_inputs(4)
        fn = functools.partial(policy_loss, agg_mode="token-mean", ratio_quantiles=(0.5,))
        his = jnp.asarray([1.1, 1.2, 1.3])
        out = jax.vmap(lambda h: fn(logp, old, adv, mask, clip_low=0.8, clip_high=h)[0])(his)
        for i, h in enumerate([1.1, 1.2, 1.3]):
            ref = np_policy_loss(logp, old, adv, mask, 0.8, h, "token-mean")
            np.testing.assert_allclose(out[i], ref, rtol=2e-5)


class ErrorsTest(chex.TestCase):
    def test_shape_and_dtype_errors_name_the_argument(self):
        logp, old, adv, mask, w = random_inputs(0)
        kw = dict(clip_low=0.8, clip_high=1.28)
        with pytest.raises(ValueError, match="old_logp"):
            policy_loss(logp, old[:, :-1], adv, mask, **kw)
        with pytest.raises(ValueError, match="advantages"):
            jax.jit(functools.partial(policy_loss, **kw))(logp, old, adv[:, 0], mask)
        with pytest.raises(ValueError, match="is_weights"):
            policy_loss(logp, old, adv, mask, is_weights=w[:2], **kw)
        with pytest.raises(TypeError, match="logp"):
            policy_loss(logp.astype(np.int32), old, adv, mask, **kw)
        with pytest.raises(ValueError, match="agg_mode"):
            policy_loss(logp, old, adv, mask, agg_mode="mean", **kw)
        with pytest.raises(ValueError, match="ratio_level"):
            policy_loss(logp, old, adv, mask, ratio_level="seq", **kw)
