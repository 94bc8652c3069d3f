"""The pure, jitted parts of one RL step (docs/design.md sections 7 and 9).

`make_step_fns` closes over everything static (graphdef, recipes, algorithm, calibration
config, optimizer, mesh layout) and returns jitted programs with explicit in/out shardings:

* `prepare(params, ref_params, batch)` -> (per-sample outputs, metrics): behaviour ("old")
  logprobs of the sampled tokens under the TRAINING recipe, their entropy, (KL) the reference
  logprobs, and on calibration steps only the BF16 shadow old logprobs; group advantages;
  rollout-correction weights (TIS / IcePop / MIS, `losses.rollout_correction`) and, with
  `algorithm.rejection`, the response mask with rejected tokens dropped
  (`losses.rollout_rejection`: the update trains on that mask); off-policy metrics.
  Response-aligned [N, R]. The forwards run micro-batch by micro-batch (`lax.map`), so
  activations are bounded by `micro_batch_size` sequences whatever the step's batch.
* `update(state, mb, on_policy)` -> (state, metrics): one mini-batch: gradients accumulated
  over its micro-batches inside one program (`lax.scan`), then one optax update of the FP32
  masters (skipped, state unchanged, when the loss, a gradient or a new param would not be
  finite: decided before anything is written, so the donated state is updated in place).

Calibrating and non-calibrating steps are separate executables (`calibrate` is static), so a
non-calibrating program holds no BF16 forward at all: the paper's two BF16 forwards (old params
in `prepare`, current params in `update`) run on calibration steps only (docs/paper.md; every 20).

Micro-batching: `jfp8rl.trainer.microbatch` (exact for every aggregation mode); token-budget
micro-batches of the update: `jfp8rl.trainer.token_budget` (the same closures, run per bucket).

Calibrated Clipping per mini-batch (losses.calibrated): with r8 = exp(logp8 - old8),
r16 = exp(logp16 - old16) (same params, BF16 recipe, calibration programs only): calibrating
mini-batch -> `calibrate(state, r8, r16)`; any other -> `current_bounds(state, r8)` (track /
hold). Bounds are solved once per mini-batch from ALL its tokens' ratios. With one micro-batch
the ratios come from the loss's own forward (stop-gradient), so nothing runs twice; with
k > 1 micro-batches the bounds must be known before the first micro-batch's backward, so a
no-gradient FP8 forward over the micro-batches (and on calibrating mini-batches the BF16 one)
runs first: +1 forward per mini-batch, the price of exact bounds under gradient accumulation.
All quantiles and balance sums are reductions inside the jitted program over the global
(sharded) arrays, so sharding changes their summation order, not their definition.

Train state: {"params", "opt_state", "calib"} (the trainer adds "rng", which no program sees).
`ref_params` (the base policy, for a KL loss) travels separately because it never changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from jfp8rl.parallel.mesh import Layout
from jfp8rl.trainer import token_budget
from jfp8rl.trainer.forward import (
    MODEL_INPUTS,
    balance_mask,
    present,
    response_forward,
    response_logprobs,
    response_logprobs_and_routing,
    routing_mismatch_counts,
)
from jfp8rl.trainer.microbatch import (
    constrain,
    map_micro,
    merge_micro,
    num_micro_batches,
    split_micro,
)
from jfp8rl.trainer.optimizer import OptimSettings, make_optimizer
from jfp8rl.trainer.step_settings import StepSettings
from losses import advantages as adv_lib
from losses import calibrated as cal
from losses import rollout_correction as rc
from losses import rollout_rejection as rej
from losses.masked import agg_denominator
from losses.registry import compute_loss

# Metrics that only a calibrating mini-batch computes (`losses.calibrated.calibrate`); between
# calibrations the last values stay in force and are logged as such.
CALIBRATION_ONLY = (
    "calib/bf16_clipfrac_neg_lower",
    "calib/bf16_clipfrac_pos_upper",
    "calib/balance_bf16",
)


def loggable_metrics(aux: dict[str, Array]) -> dict[str, Array]:
    """The metrics of a loss's aux dict, as f32, without its raw sums (`*/sum/*`, `*_num`,
    `*_den`), which exist for reductions across shards and micro-batches, not for logs."""
    return {
        k: jnp.asarray(v, jnp.float32)
        for k, v in aux.items()
        if "/sum/" not in k and not k.endswith(("_num", "_den"))
    }


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The step's programs. `prepare` / `update` pick the calibrating or the plain executable;
    `prepare_programs[calibrate]` / `update_programs[calibrate]` are the jitted functions
    themselves (what `jfp8rl.plan` lowers ahead of time)."""

    prepare_programs: dict[bool, Any]
    update_programs: dict[bool, Any]
    optimizer: optax.GradientTransformation
    layout: Layout
    # The pure (unjitted) gradient of one mini-batch, for tests:
    # (params, calib_state, mb, on_policy, calibrate) -> (loss, grads, calib_state, metrics).
    loss_and_grads: Callable[..., Any]
    # The host-driven update of token-budget micro-batches (None: `update_programs` run).
    token_budget: token_budget.TokenBudgetUpdate | None = None

    def mesh_context(self) -> Any:
        """Trace under this: the model reads the mesh (`jax.sharding.get_abstract_mesh`) to
        keep its activations split over the batch axes."""
        return jax.set_mesh(self.layout.mesh)

    def prepare(
        self, params: Any, ref_params: Any, batch: dict[str, Array], calibrate: bool = False
    ) -> tuple[dict[str, Array], dict[str, Array]]:
        with self.mesh_context():
            return self.prepare_programs[bool(calibrate)](params, ref_params, batch)

    def update(
        self, state: dict[str, Any], mb: dict[str, Array], calibrate: bool, on_policy: bool = False
    ) -> tuple[dict[str, Any], dict[str, Array]]:
        with self.mesh_context():
            if self.token_budget is not None:
                return self.token_budget.update(state, mb, bool(calibrate), bool(on_policy))
            return self.update_programs[bool(calibrate)](state, mb, jnp.asarray(on_policy))

    def state_shardings(self, calib_state: Any) -> dict[str, Any]:
        """Shardings of the train state {"params", "opt_state", "calib"}."""
        rep = self.layout.replicated()
        return {
            "params": self.layout.params(),
            "opt_state": self.layout.opt_state(self.optimizer),
            "calib": jax.tree.map(lambda _: rep, calib_state),
        }


@functools.lru_cache(maxsize=8)
def make_step_fns(graphdef: Any, s: StepSettings, opt: OptimSettings, layout: Layout) -> StepFns:
    """The jitted `prepare` and `update` (module docstring), sharded by `layout`.

    Cached on its (hashable) arguments, so runs in one process with the same settings (a
    resume, the tests) reuse the compiled executables.
    """
    rep, dat, param_sh = layout.replicated(), layout.batch(), layout.params()
    optimizer = make_optimizer(opt)

    def prepare(params, ref_params, batch, *, calibrate: bool):
        mask = batch["response_mask"]
        k = num_micro_batches(mask.shape[0], s.micro_batch_size)

        def forwards(mb):
            out = {}
            if not s.old_logp_from_rollout:
                out["old_all"], out["entropy"], own = response_logprobs_and_routing(
                    graphdef, params, mb, s.train_recipe, s.temperature
                )
                if "routing" in mb:
                    differ, known = routing_mismatch_counts(
                        mb["routing"], own, mb["attention_mask"]
                    )
                    out["routing_differ"], out["routing_known"] = differ[None], known[None]
            if calibrate:
                out["old_bf16"] = response_logprobs(
                    graphdef, params, mb, s.shadow_recipe, s.temperature
                )[0]
            if ref_params is not None:
                out["ref"] = response_logprobs(
                    graphdef, ref_params, mb, s.train_recipe, s.temperature
                )[0]
            return out

        exact = s.old_logp_from_rollout  # bit-identical rollout: its log-probs are the old ones
        needs_forward = not exact or calibrate or ref_params is not None
        f = map_micro(forwards, present(batch, MODEL_INPUTS), k, dat) if needs_forward else {}
        old_all = batch["rollout_logp"] if exact else f["old_all"]
        resp_len = mask.shape[1]
        valid = (jnp.arange(resp_len)[None, :] < batch["response_lens"][:, None]).astype(
            jnp.float32
        )
        old = jnp.where(mask != 0, old_all, 0.0)
        adv = adv_lib.compute_advantages(s.algo.adv_estimator, batch["rewards"], s.group_size)
        w, is_aux = rc.is_weights(
            old, batch["rollout_logp"], mask,
            mode=s.correction, level=s.correction_level, cap=s.tis_cap,
            lower=s.correction_lower, batch_normalize=s.correction_batch_norm,
        )  # fmt: skip
        out = {
            "old_logp": old,
            "advantages": adv_lib.broadcast_to_tokens(adv, mask),
            "is_weights": w,
        }
        # Rejection: the update trains on the kept tokens only (the weights, as in verl, come
        # from the full mask).
        kept, rs_aux = rej.rejection_mask(old, batch["rollout_logp"], mask, s.rejection)
        if s.rejection:
            out["response_mask"] = kept
        if calibrate:
            out["old_logp_bf16"] = jnp.where(mask != 0, f["old_bf16"], 0.0)
        if ref_params is not None:
            out["ref_logp"] = jnp.where(mask != 0, f["ref"], 0.0)
        metrics = {
            **loggable_metrics(is_aux),
            **rs_aux,
            # Mismatch and entropy over every sampled token, including groups that dynamic
            # sampling left out of the loss.
            **rc.mismatch_metrics(old_all, batch["rollout_logp"], valid),
        }
        if not exact:
            ent = f["entropy"]
            metrics["actor/entropy"] = jnp.sum(ent * valid) / jnp.maximum(jnp.sum(valid), 1.0)
        if "routing_differ" in f:  # counts per micro-batch
            metrics["rollout_corr/routing_mismatch"] = jnp.sum(f["routing_differ"]) / jnp.maximum(
                jnp.sum(f["routing_known"]), 1.0
            )
        return out, metrics

    def bounds(calib_state, logp8, logp16, mb, on_policy, calibrate):
        """(calib_state, lo, hi, metrics) for this mini-batch; no gradient flows through.
        logp8 / logp16: the whole mini-batch's FP8 / BF16 (calibrating only) logprobs."""
        mask, adv = mb["response_mask"], mb["advantages"]
        if not s.calibrated:
            lo, hi = s.algo.plain_bounds
            return calib_state, jnp.float32(lo), jnp.float32(hi), {}
        r8 = jnp.exp(jnp.clip(jax.lax.stop_gradient(logp8) - mb["old_logp"], -20.0, 20.0))
        if calibrate:
            r16 = jnp.exp(jnp.clip(logp16 - mb["old_logp_bf16"], -20.0, 20.0))
            cs, caux = cal.calibrate(calib_state, s.calib_cfg, r8, r16, adv, mask)
            return cs, cs.lower, cs.upper, caux
        # An on-policy mini-batch's ratios are 1 only up to the rounding of two compiled
        # programs (device count, jax version): never solve bounds from that noise.
        return cal.current_bounds(calib_state, s.calib_cfg, r8, adv, mask, on_policy=on_policy)

    def loss_terms(
        logp, ent, mb, lo, hi, denominator=None, ratio_quantiles=(0.01, 0.1, 0.5, 0.9, 0.99),
        algo=None,
    ):  # fmt: skip
        return compute_loss(
            algo or s.algo, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"],
            mask=mb["response_mask"], lo=lo, hi=hi, is_weights=mb["is_weights"],
            ref_logp=mb.get("ref_logp"), entropy=ent, denominator=denominator,
            ratio_quantiles=ratio_quantiles,
        )  # fmt: skip

    def update_forward(p, m, share=1.0):
        """(logp, entropy) of the update's forward and an MoE policy's load-balancing loss
        times `share` (this micro-batch's part of the mini-batch's counted tokens; None for
        a dense policy): added to the loss with `algorithm.moe_aux_loss_coef` by `balanced`."""
        logp, ent, _, bal = response_forward(graphdef, p, m, s.train_recipe, s.temperature)
        return logp, ent, None if bal is None else share * bal

    def balanced(loss, bal):
        return loss if bal is None or not s.moe_aux_loss_coef else loss + s.moe_aux_loss_coef * bal

    def grads_whole(params, calib_state, mb, on_policy, calibrate):
        """One micro-batch: one forward serves the bounds (stop-gradient ratios at the current
        params, i.e. before this update) and the loss."""

        def loss_fn(p):
            logp, ent, bal = update_forward(p, mb)
            logp16 = None
            if calibrate:
                logp16 = response_logprobs(
                    graphdef, jax.lax.stop_gradient(p), mb, s.shadow_recipe, s.temperature
                )[0]
            cs, lo, hi, caux = bounds(calib_state, logp, logp16, mb, on_policy, calibrate)
            loss, aux = loss_terms(logp, ent, mb, lo, hi)
            if bal is not None:
                aux["actor/moe_aux_loss"] = bal
            return balanced(loss, bal), (
                cs,
                {**caux, **loggable_metrics(aux), "calib/lower": lo, "calib/upper": hi},
            )

        (loss, (cs, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, grads, cs, metrics

    def pre_forwards(params, m, calibrate):
        """No-gradient logprobs of a micro-batch for the bounds: FP8, and BF16 if calibrating."""
        sg = jax.lax.stop_gradient(params)
        out = {"fp8": response_logprobs(graphdef, sg, m, s.train_recipe, s.temperature)[0]}
        if calibrate:
            out["bf16"] = response_logprobs(graphdef, sg, m, s.shadow_recipe, s.temperature)[0]
        return out

    def micro_grads(params, acc, m, lo, hi, den, algo, tokens):
        """acc + grad(num_m / den) of one micro-batch; its (stop-gradient) logprobs, entropy
        and MoE balancing loss times its share of the mini-batch's `tokens` (or None)."""
        m = constrain(m, dat)
        share = jnp.sum(balance_mask(m), dtype=jnp.float32) / jnp.maximum(tokens, 1.0)

        def loss_fn(p):
            logp, ent, bal = update_forward(p, m, share)
            loss, _ = loss_terms(logp, ent, m, lo, hi, den, ratio_quantiles=(), algo=algo)
            return balanced(loss, bal), (logp, ent, bal)

        (_, out), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        acc = jax.tree.map(jnp.add, acc, g)
        # The accumulator lives in the params' sharding (no gathered gradient).
        acc = jax.lax.with_sharding_constraint(acc, param_sh)
        return acc, jax.lax.stop_gradient(out)

    def whole_metrics(logp, ent, mb, lo, hi, caux):
        """The logged loss and metrics from the whole mini-batch at once (no model call); the
        loss includes the MoE balancing term the micro-batches added (`caux`), as
        `grads_whole`'s does."""
        loss, aux = loss_terms(logp, ent, mb, lo, hi)
        loss = balanced(loss, caux.get("actor/moe_aux_loss"))
        return loss, {**caux, **loggable_metrics(aux), "calib/lower": lo, "calib/upper": hi}

    def grads_accumulated(params, calib_state, mb, on_policy, calibrate, k):
        """k micro-batches: bounds from a no-gradient pre-pass, then sum_j grad(num_j / D)."""
        model_mb = present(mb, MODEL_INPUTS)
        pre = {}
        if s.calibrated:
            pre = map_micro(lambda m: pre_forwards(params, m, calibrate), model_mb, k, dat)
        cs, lo, hi, caux = bounds(
            calib_state, pre.get("fp8"), pre.get("bf16"), mb, on_policy, calibrate
        )
        den = agg_denominator(mb["response_mask"], s.algo.agg_mode)
        tokens = jnp.sum(balance_mask(mb), dtype=jnp.float32)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_sh)
        grads, (logp_k, ent_k, bal_k) = jax.lax.scan(
            lambda acc, m: micro_grads(params, acc, m, lo, hi, den, s.algo, tokens),
            zeros,
            split_micro(mb, k),
        )
        if bal_k is not None:
            caux = {**caux, "actor/moe_aux_loss": jnp.sum(bal_k)}
        loss, metrics = whole_metrics(merge_micro(logp_k), merge_micro(ent_k), mb, lo, hi, caux)
        return loss, grads, cs, metrics

    def loss_and_grads(params, calib_state, mb, on_policy, calibrate):
        """(loss, grads, new calib state, metrics) of one mini-batch, micro-batched."""
        k = num_micro_batches(mb["response_mask"].shape[0], s.micro_batch_size)
        if k == 1:
            return grads_whole(params, calib_state, mb, on_policy, calibrate)
        return grads_accumulated(params, calib_state, mb, on_policy, calibrate, k)

    def update(state, mb, on_policy, *, calibrate: bool):
        loss, grads, calib_state, metrics = loss_and_grads(
            state["params"], state["calib"], mb, on_policy, calibrate
        )
        return apply_grads(state, loss, grads, calib_state, metrics)

    def apply_grads(state, loss, grads, calib_state, metrics):
        """The optimizer update from a mini-batch's gradients, skipped when not finite."""
        params, opt_state = state["params"], state["opt_state"]
        # Global L2 norm of the gradients before clipping (optax's clip uses the same norm).
        grad_norm = optax.tree.norm(grads)
        finite = (
            jnp.isfinite(loss) & jnp.isfinite(grad_norm) & lands_finite(grads, opt_state, params)
        )

        # Applied only if finite, inside `cond`: the old state is never needed after the new
        # one is written, so the donated buffers are updated in place (a `where(finite, new,
        # old)` guard keeps both copies of params and Adam moments alive: +2 x 8 bytes/param).
        def apply(_):
            updates, new_opt = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt, calib_state

        new_params, new_opt, new_calib = jax.lax.cond(
            finite, apply, lambda _: (params, opt_state, state["calib"]), None
        )
        new_state = {"params": new_params, "opt_state": new_opt, "calib": new_calib}
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/nonfinite"] = 1.0 - finite.astype(jnp.float32)
        return new_state, metrics

    def lands_finite(grads, opt_state, params):
        """Whether the update would leave every param finite (an overflowing step, e.g. a huge
        lr, must not poison the weights the rollout serves next). Computed as reductions over
        `params + updates` that XLA fuses with the optimizer's elementwise math, so no second
        copy of params or moments is materialised (the `cond` above recomputes the update).
        With finite grads (and a finite grad norm) the new Adam moments are finite whenever the
        old ones are, so params are the only thing to check."""
        updates, _ = optimizer.update(grads, opt_state, params)
        landed = jax.tree.map(lambda p, u: jnp.all(jnp.isfinite(p + u)), params, updates)
        return jnp.all(jnp.stack(jax.tree.leaves(landed)))

    variants = (False, True) if s.calibrated else (False,)
    prepare_programs = {
        c: jax.jit(
            functools.partial(prepare, calibrate=c),
            # ref_params (the KL reference) is None without a KL loss: an empty pytree.
            in_shardings=(param_sh, param_sh if s.algo.use_kl_loss else None, dat),
            out_shardings=(dat, rep),
        )
        for c in variants
    }
    fns = StepFns(prepare_programs, {}, optimizer, layout, loss_and_grads)
    state_sh = fns.state_shardings(cal.init_calib_state(s.calib_cfg))
    for c in variants:
        fns.update_programs[c] = jax.jit(
            functools.partial(update, calibrate=c),
            in_shardings=(state_sh, dat, rep),
            out_shardings=(state_sh, rep),
            donate_argnums=(0,),
        )
    if not s.max_tokens_per_micro_batch:
        return fns
    budget = token_budget.build(
        s, layout, state_sh, pre_forwards=pre_forwards, micro_grads=micro_grads, bounds=bounds,
        whole_metrics=whole_metrics, apply_grads=apply_grads,
    )  # fmt: skip
    return dataclasses.replace(fns, token_budget=budget)
