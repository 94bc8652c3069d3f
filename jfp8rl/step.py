"""The pure, jitted parts of one RL step (DESIGN.md section 7, items 5-7).

`make_step_fns` closes over everything static (graphdef, recipes, algorithm, calibration
config, optimizer) and returns two jitted functions with explicit shardings over the mesh:

* `prepare(params, ref_params, batch)`: behaviour ("old") logprobs of the sampled
  tokens under the TRAINING recipe, their entropy, and (calibrated clipping) the BF16 shadow
  old logprobs; group advantages; rollout-correction weights (TIS/MIS) from
  rho = pi_old / pi_rollout; trainer-vs-rollout mismatch metrics. Response-aligned [N, R].
* `update(state, mb, calibrate, on_policy)`: one mini-batch: loss with plain or calibrated bounds,
  grads of the FP32 masters through the FP8 recipe, a non-finite check, and the optax update
  (skipped, state unchanged, when the loss or a gradient is not finite).

One executable each: whether a mini-batch calibrates is a traced flag (`lax.cond`, which runs
one branch). With calibrated clipping `prepare` computes the BF16 shadow old logprobs on every
step (one extra forward, cheap next to compiling a second variant); the BF16 shadow of the
current params runs inside the calibrating branch only. The bounds use the ratios of the
loss's own forward (stop-gradient), so no mini-batch runs the FP8 forward twice.

Calibrated Clipping per mini-batch (losses.calibrated): with r8 = exp(logp8 - old8),
r16 = exp(logp16 - old16) (same params, BF16 recipe, calibration steps only):
calibration mini-batch -> `calibrate(state, r8, r16)`, bounds = the new state's (L, H);
any other mini-batch -> `current_bounds(state, r8)` (track / hold). The loss then uses
`compute_loss(..., lo=L, hi=H, is_weights=w)`.

Train state: {"params", "opt_state", "calib", "ref_params"?}. `ref_params` (the base policy,
for a KL loss) travels separately because it never changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jfp8rl.mesh import data_sharded, replicated
from losses import advantages as adv_lib
from losses import calibrated as cal
from losses import rollout_correction as rc
from losses.registry import Algorithm, compute_loss
from models import functional as mf
from models.fp8 import Recipe, get_recipe


class StepSettings(NamedTuple):
    """Static settings of the jitted functions (from the config)."""

    train_recipe: Recipe
    shadow_recipe: Recipe  # BF16 recipe of the calibration shadow pass
    algo: Algorithm
    calibrated: bool
    calib_cfg: cal.CalibConfig
    correction: str  # tis | mis | none
    correction_level: str
    tis_cap: float
    group_size: int


def gather_response(
    x_NxT: Float[Array, "N T"], prompt_lens_N: Int[Array, " N"], resp_len: int
) -> Float[Array, "N R"]:
    """Moves per-token values of `tokens` ([N, P + R], right padded) to the response-aligned
    layout [N, R]: out[i, j] = x[i, prompt_lens[i] + j] (positions past T read the last one and
    are masked by the response mask anyway)."""
    idx = prompt_lens_N[:, None] + jnp.arange(resp_len)[None, :]
    idx = jnp.minimum(idx, x_NxT.shape[1] - 1)
    return jnp.take_along_axis(x_NxT, idx, axis=1)


def response_logprobs(
    graphdef: Any, params: Any, batch: dict[str, Array], recipe: Recipe
) -> tuple[Float[Array, "N R"], Float[Array, "N R"]]:
    """(logp, entropy) of the response tokens under `recipe`, response-aligned."""
    lp, ent = mf.token_logprobs_and_entropy(
        graphdef, params, batch["tokens"], batch["attention_mask"], recipe=recipe
    )
    r = batch["response_mask"].shape[1]
    return (
        gather_response(lp, batch["prompt_lens"], r),
        gather_response(ent, batch["prompt_lens"], r),
    )


class OptimSettings(NamedTuple):
    """AdamW hyperparameters (hashable, so the jitted step can be cached per setting)."""

    lr: float
    warmup_updates: int
    weight_decay: float
    grad_clip: float
    b1: float
    b2: float


def make_optimizer(o: OptimSettings) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW with linear warmup over `o.warmup_updates` optimizer
    updates (then constant), on the FP32 masters."""
    sched = optax.linear_schedule(0.0, o.lr, o.warmup_updates) if o.warmup_updates > 0 else o.lr
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
    )


def _mean_metrics(aux: dict[str, Array]) -> dict[str, Array]:
    # Raw shard sums (`*/sum/*`, `*_num`, `*_den`) are for multi-host reductions, not logs.
    return {
        k: jnp.asarray(v, jnp.float32)
        for k, v in aux.items()
        if "/sum/" not in k and not k.endswith(("_num", "_den"))
    }


@dataclasses.dataclass(frozen=True)
class StepFns:
    prepare: Callable[..., dict[str, Array]]
    update: Callable[..., tuple[dict[str, Any], dict[str, Array]]]
    optimizer: optax.GradientTransformation


@functools.lru_cache(maxsize=8)
def make_step_fns(graphdef: Any, s: StepSettings, opt: OptimSettings, mesh: Mesh) -> StepFns:
    """The jitted `prepare` and `update` (module docstring), sharded over `mesh`.

    Cached on its (hashable) arguments, so runs in one process with the same settings (a
    resume, the tests) reuse the compiled executables.
    """
    rep, dat = replicated(mesh), data_sharded(mesh)
    optimizer = make_optimizer(opt)

    def prepare(params, ref_params, batch):
        mask = batch["response_mask"]
        old_all, ent = response_logprobs(graphdef, params, batch, s.train_recipe)
        resp_len = mask.shape[1]
        valid = (jnp.arange(resp_len)[None, :] < batch["response_lens"][:, None]).astype(
            jnp.float32
        )
        old = jnp.where(mask != 0, old_all, 0.0)
        rewards = batch["rewards"]
        adv = adv_lib.compute_advantages(s.algo.adv_estimator, rewards, s.group_size)
        adv_tok = adv_lib.broadcast_to_tokens(adv, mask)
        w, is_aux = rc.is_weights(
            old, batch["rollout_logp"], mask,
            mode=s.correction, level=s.correction_level, cap=s.tis_cap,
        )  # fmt: skip
        out = {
            "old_logp": old,
            "advantages": adv_tok,
            "is_weights": w,
            "metrics": {
                **_mean_metrics(is_aux),
                # Mismatch and entropy over every sampled token, including groups that dynamic
                # sampling left out of the loss.
                **rc.mismatch_metrics(old_all, batch["rollout_logp"], valid),
                "actor/entropy": jnp.sum(ent * valid) / jnp.maximum(jnp.sum(valid), 1.0),
            },
        }
        if s.calibrated:
            old16, _ = response_logprobs(graphdef, params, batch, s.shadow_recipe)
            out["old_logp_bf16"] = jnp.where(mask != 0, old16, 0.0)
        if ref_params is not None:
            ref, _ = response_logprobs(graphdef, ref_params, batch, s.train_recipe)
            out["ref_logp"] = jnp.where(mask != 0, ref, 0.0)
        return out

    def bounds(p, logp8, calib_state, mb, calibrate, on_policy):
        """(calib_state, lo, hi, metrics) for this mini-batch; no gradient flows through."""
        mask, adv = mb["response_mask"], mb["advantages"]
        if not s.calibrated:
            lo, hi = s.algo.plain_bounds
            return calib_state, jnp.float32(lo), jnp.float32(hi), {}
        r8 = jnp.exp(jnp.clip(jax.lax.stop_gradient(logp8) - mb["old_logp"], -20.0, 20.0))

        def do_calibrate(cs):
            # The BF16 shadow pass (same params, BF16 recipe) runs on calibrating
            # mini-batches only: lax.cond executes one branch.
            logp16, _ = response_logprobs(graphdef, jax.lax.stop_gradient(p), mb, s.shadow_recipe)
            r16 = jnp.exp(jnp.clip(logp16 - mb["old_logp_bf16"], -20.0, 20.0))
            cs, caux = cal.calibrate(cs, s.calib_cfg, r8, r16, adv, mask)
            return cs, cs.lower, cs.upper, caux

        def do_track(cs):
            # An on-policy mini-batch's ratios are 1 only up to the rounding of two compiled
            # programs (device count, jax version): never solve bounds from that noise.
            return cal.current_bounds(cs, s.calib_cfg, r8, adv, mask, on_policy=on_policy)

        # lax.cond needs one output structure: pad each branch's metrics to the union.
        keys = sorted(
            set(jax.eval_shape(do_calibrate, calib_state)[3])
            | set(jax.eval_shape(do_track, calib_state)[3])
        )

        def padded(fn):
            def run(cs):
                cs, lo, hi, caux = fn(cs)
                zero = jnp.zeros((), jnp.float32)
                return cs, lo, hi, {k: jnp.asarray(caux.get(k, zero), jnp.float32) for k in keys}

            return run

        return jax.lax.cond(calibrate, padded(do_calibrate), padded(do_track), calib_state)

    def update(state, mb, calibrate, on_policy):
        params = state["params"]

        def loss_fn(p):
            # One forward serves the bounds (stop-gradient ratios at the current params, i.e.
            # before this update) and the loss.
            logp, ent = response_logprobs(graphdef, p, mb, s.train_recipe)
            calib_state, lo, hi, caux = bounds(p, logp, state["calib"], mb, calibrate, on_policy)
            loss, aux = compute_loss(
                s.algo, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"],
                mask=mb["response_mask"], lo=lo, hi=hi, is_weights=mb["is_weights"],
                ref_logp=mb.get("ref_logp"), entropy=ent,
            )  # fmt: skip
            metrics = {**caux, **_mean_metrics(aux), "calib/lower": lo, "calib/upper": hi}
            return loss, (calib_state, metrics)

        (loss, (calib_state, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        # Global L2 norm of the gradients before clipping (optax's clip uses the same norm).
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        # An update is kept only if the loss, the gradients AND the new params are finite: an
        # overflowing step (e.g. a huge lr) must not poison the weights the rollout serves next.
        params_finite = jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(new_params)])
        )
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = {
            "params": keep(new_params, params),
            "opt_state": keep(opt_state, state["opt_state"]),
            "calib": keep(calib_state, state["calib"]),
        }
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/nonfinite"] = 1.0 - finite.astype(jnp.float32)
        return new_state, metrics

    prepare_jit = jax.jit(prepare, in_shardings=(rep, rep, dat))
    update_jit = jax.jit(
        update,
        in_shardings=(rep, dat, rep, rep),
        out_shardings=(rep, rep),
        donate_argnums=(0,),
    )
    return StepFns(
        prepare=prepare_jit,
        update=lambda state, mb, calibrate, on_policy=False: update_jit(
            state, mb, jnp.asarray(calibrate), jnp.asarray(on_policy)
        ),
        optimizer=optimizer,
    )


def default_settings(
    algo: Algorithm,
    *,
    train_recipe: str,
    calibrated: bool,
    calib_cfg: cal.CalibConfig,
    correction: str,
    correction_level: str,
    tis_cap: float,
    group_size: int,
) -> StepSettings:
    """`StepSettings` from config names (recipes by name, BF16 as the shadow)."""
    return StepSettings(
        train_recipe=get_recipe(train_recipe),
        shadow_recipe=get_recipe("bf16"),
        algo=algo,
        calibrated=calibrated,
        calib_cfg=calib_cfg,
        correction=correction,
        correction_level=correction_level,
        tis_cap=tis_cap,
        group_size=group_size,
    )
