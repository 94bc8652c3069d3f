"""Time of the calibrated clipped loss (bound solving included) against the plain one.

Both are jitted `value_and_grad` of the loss w.r.t. the new log-probs on [B, T] tokens
(default [256, 8192]). The calibrated variant solves L, H in `track` mode from the mini-batch's
FP8 ratios (two sort-free histogram searches over the B*T ratios, `losses.select`) before the
loss. Printed: median wall times and their ratio (target <= 1.5x), with and without the ratio
quantile metrics (which use the same search, once per quantile), then the solver alone beside
a key-value sort of the ratios for scale.

    python benchmarks/loss_overhead.py [--b 256] [--t 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import median_seconds  # benchmarks/timing.py (scripts run from this folder)

from losses import calibrated as C
from losses.policy import importance_ratio, policy_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=256)
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    b, t = args.b, args.t
    k = jax.random.split(jax.random.key(0), 5)
    old = -jnp.abs(jax.random.normal(k[0], (b, t)))
    logp = old + 0.1 * jax.random.normal(k[1], (b, t))
    adv = jnp.repeat(jax.random.normal(k[2], (b, 1)), t, axis=1)
    lengths = jax.random.randint(k[3], (b, 1), t // 8, t + 1)
    mask = (jnp.arange(t)[None, :] < lengths).astype(jnp.float32)
    cfg = C.CalibConfig(eps_low=0.2, eps_high=0.28)
    r16 = importance_ratio(logp, old)
    r8 = r16 * jnp.exp(0.05 * jax.random.normal(k[4], (b, t)))
    state, _ = jax.jit(C.calibrate, static_argnums=1)(
        C.init_calib_state(cfg), cfg, r8, r16, adv, mask
    )

    # Arrays are passed as arguments, not closed over: captured constants make XLA constant-fold
    # the mask/advantage reductions at compile time, which is neither realistic nor quick.
    def plain(quantiles):
        def loss(lp, old, adv, mask):
            return policy_loss(
                lp,
                old,
                adv,
                mask,
                clip_low=0.8,
                clip_high=1.28,
                agg_mode="token-mean",
                dual_clip=3.0,
                ratio_quantiles=quantiles,
            )

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    def calibrated(quantiles):
        def loss(lp, st, old, adv, mask):
            r = importance_ratio(jax.lax.stop_gradient(lp), old)
            st, lo, hi, caux = C.current_bounds(st, cfg, r, adv, mask)
            val, aux = policy_loss(
                lp,
                old,
                adv,
                mask,
                clip_low=lo,
                clip_high=hi,
                agg_mode="token-mean",
                dual_clip=3.0,
                ratio_quantiles=quantiles,
            )
            return val, (aux, caux, st)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    print(
        f"backend={jax.default_backend()} devices={jax.devices()} tokens=[{b}, {t}] "
        f"(mask fill {float(mask.mean()):.2f}), median of {args.repeats}"
    )
    for label, q in (
        ("without ratio quantiles", ()),
        ("with ratio quantiles", (0.01, 0.1, 0.5, 0.9, 0.99)),
    ):
        tp = median_seconds(plain(q), logp, old, adv, mask, repeats=args.repeats)
        tc = median_seconds(calibrated(q), logp, state, old, adv, mask, repeats=args.repeats)
        print(
            f"{label:26s} plain {tp * 1e3:9.2f} ms   calibrated {tc * 1e3:9.2f} ms   "
            f"ratio {tc / tp:5.2f}x"
        )
    # What the bound solving costs on its own, and what a sort would have cost.
    solve = jax.jit(lambda r, a, m: C.current_bounds(state, cfg, r, a, m)[1:3])
    ts = median_seconds(solve, r8, adv, mask, repeats=args.repeats)
    sort = jax.jit(lambda r, a: jax.lax.sort((r.reshape(-1), a.reshape(-1)), num_keys=1))
    tsort = median_seconds(sort, r8, adv, repeats=args.repeats)
    print(
        f"bound solving alone {ts * 1e3:.2f} ms (two histogram searches); a key-value sort of "
        f"the B*T ratios (the obvious alternative) takes {tsort * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
