"""Token-budget micro-batches of the update (`train.max_tokens_per_micro_batch` > 0).

A mini-batch's sequences are sorted by length and packed into micro-batches of at most the
budget's tokens per device (`jfp8rl.trainer.microbatch.pack_token_budget`), each padded only to
the bucket length of its longest sequence (`train.length_buckets` lengths: T, T / 2, T / 4, ...
with T = data.max_prompt_tokens + rollout.max_tokens). A micro-batch of bucket L has
`ranks x (budget // L)` rows, so each bucket is one shape: at most `3 x buckets` compiled
micro-batch programs (the no-gradient FP8 forward, its calibrating FP8 + BF16 variant, the
forward/backward) plus the calibrating and plain bounds and finishing programs over the whole
mini-batch, whatever the step's lengths. Samples whose response mask is empty (a group dynamic
sampling left out) add nothing to the loss and are not computed at all.

The micro-batches have different shapes, so one mini-batch's update is a short host loop over
compiled programs, not one program (as the fixed `train.micro_batch_size` is):

1. (Calibrated Clipping) the no-gradient FP8 (and on calibrating mini-batches BF16) logprobs of
   every micro-batch, put back in mini-batch order;
2. `bounds`: the mini-batch's bounds from ALL its tokens' ratios, and the loss's global
   denominator (`losses.masked.agg_denominator` of the whole mini-batch's mask);
3. per micro-batch: gradient of num_j / D added to the accumulator (donated: updated in place);
4. `finish`: the logged loss and metrics recomputed once on the whole mini-batch from the
   micro-batches' logprobs, then the optimizer update (skipped when not finite).

So gradients, bounds and metrics equal the whole mini-batch's, exactly as with fixed micro-
batches (`jfp8rl.trainer.step`); only the summation order differs. (An MoE policy's optional
load-balancing loss is the exception: each micro-batch adds its own, weighted by its share of
the counted tokens, so it depends on the split, as with fixed micro-batches.) The trade
against the fixed micro-batches: the pre-pass runs even when everything fits one
micro-batch, and `prepare` keeps `train.micro_batch_size` (forwards only, no gradient).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.parallel.mesh import Layout, batch_size_divisor, put_batch
from jfp8rl.trainer.forward import balance_mask
from jfp8rl.trainer.microbatch import (
    pack_token_budget,
    padding_share,
    scatter_rows,
    sequence_lengths,
    take_rows,
)
from losses.masked import agg_denominator
from models.sharding import host_array

# Mini-batch arrays a micro-batch's forward/backward reads (`ref_logp` only with a KL loss).
MICRO_INPUTS = (
    "tokens", "attention_mask", "prompt_lens", "response_mask",
    "old_logp", "advantages", "is_weights", "ref_logp",
)  # fmt: skip
PRE_INPUTS = ("tokens", "attention_mask", "prompt_lens", "response_mask")


class Accumulated(NamedTuple):
    """A mini-batch's bounds and summed gradient, and what `finish` reads besides."""

    grads: Any
    calib: Any
    lo: jax.Array
    hi: jax.Array
    aux: dict[str, jax.Array]
    mb: dict[str, jax.Array]  # the whole mini-batch on device
    logp: jax.Array  # [N, R] the micro-batches' logprobs in mini-batch order
    entropy: jax.Array
    micro_batches: int
    padding_share: float


@dataclasses.dataclass(frozen=True)
class TokenBudgetUpdate:
    """The compiled pieces of a token-budget update and the host loop that runs them."""

    pre: Any  # (params, micro, calibrate) -> {"fp8": [rows, r], "bf16"?}
    micro: Any  # (params, acc, micro, lo, hi, den, tokens, resp_len) -> (acc, (logp, ent, bal))
    bounds: Any  # (calib, logp8, logp16, mb, on_policy, calibrate) -> (calib, lo, hi, aux, den)
    finish: Any  # (state, grads, calib, lo, hi, aux, mb, logp, ent) -> (state, metrics)
    zeros: Any  # params -> zero gradient accumulator
    layout: Layout
    budget: int
    buckets: tuple[int, ...]
    calibrated: bool

    def plan(self, mb: dict[str, np.ndarray]) -> tuple[np.ndarray, list[Any]]:
        """(sequence lengths, packed micro-batches) of a host mini-batch."""
        lengths = sequence_lengths(mb["attention_mask"])
        lengths = np.where(np.asarray(mb["response_mask"]).any(axis=1), lengths, 0)
        ranks = batch_size_divisor(self.layout.mesh)
        return lengths, pack_token_budget(lengths, self.budget, ranks, self.buckets)

    def accumulate(
        self, state: dict[str, Any], mb: dict[str, Any], calibrate: bool, on_policy: bool
    ) -> Accumulated:
        """Steps 1-3 (module docstring): bounds and the summed gradient of a mini-batch (on host
        or device); `state` is only read."""
        mesh = self.layout.mesh
        host = {k: host_array(v) for k, v in mb.items()}
        on_device = all(isinstance(v, jax.Array) for v in mb.values())
        full = mb if on_device else put_batch(host, mesh)
        lengths, plan = self.plan(host)
        n, resp_len = host["response_mask"].shape
        keys = [k for k in MICRO_INPUTS if k in host]
        micro = [put_batch(take_rows({k: host[k] for k in keys}, p), mesh) for p in plan]
        params = state["params"]

        def gather(parts: list[Any]) -> jax.Array:
            rows = [host_array(x) for x in parts]
            return put_batch({"x": scatter_rows(plan, rows, n, resp_len)}, mesh)["x"]

        logp8 = logp16 = None
        if self.calibrated:
            pre = [self.pre(params, {k: m[k] for k in PRE_INPUTS}, calibrate) for m in micro]
            logp8 = gather([o["fp8"] for o in pre])
            logp16 = gather([o["bf16"] for o in pre]) if calibrate else None
        calib, lo, hi, aux, den = self.bounds(
            state["calib"], logp8, logp16, full, jnp.asarray(on_policy), calibrate
        )
        grads, outs = self.zeros(params), []
        tokens = jnp.sum(balance_mask(host), dtype=jnp.float32)  # an MoE balancing loss's
        for m in micro:
            grads, out = self.micro(params, grads, m, lo, hi, den, tokens, resp_len)
            outs.append(out)
        logp, ent = gather([o[0] for o in outs]), gather([o[1] for o in outs])
        if outs and outs[0][2] is not None:  # each micro-batch's share of the MoE loss
            aux = {**aux, "actor/moe_aux_loss": sum(o[2] for o in outs)}
        return Accumulated(grads, calib, lo, hi, aux, full, logp, ent, len(plan),
                           padding_share(plan, lengths))  # fmt: skip

    def update(
        self, state: dict[str, Any], mb: dict[str, Any], calibrate: bool, on_policy: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One mini-batch's optimizer update (module docstring); `mb` on host or device."""
        a = self.accumulate(state, mb, calibrate, on_policy)
        new_state, metrics = self.finish(
            state, a.grads, a.calib, a.lo, a.hi, a.aux, a.mb, a.logp, a.entropy
        )
        metrics = dict(metrics)
        metrics["perf/micro_batches"] = float(a.micro_batches)
        metrics["perf/padding_share"] = a.padding_share
        return new_state, metrics


def build(
    s: Any,
    layout: Layout,
    state_sh: Any,
    *,
    pre_forwards: Callable[..., Any],
    micro_grads: Callable[..., Any],
    bounds: Callable[..., Any],
    whole_metrics: Callable[..., Any],
    apply_grads: Callable[..., Any],
) -> TokenBudgetUpdate:
    """Jits the pieces with explicit shardings. `s`: the step's `StepSettings`; the callables
    are `jfp8rl.trainer.step.make_step_fns`'s closures (the same loss, bounds and optimizer
    code as the fixed micro-batches)."""
    rep, dat, param_sh = layout.replicated(), layout.batch(), layout.params()

    algo = s.algo

    def bounds_and_den(calib_state, logp8, logp16, mb, on_policy, calibrate):
        den = agg_denominator(mb["response_mask"], algo.agg_mode)
        return (*bounds(calib_state, logp8, logp16, mb, on_policy, calibrate), den)

    def finish(state, grads, calib_state, lo, hi, caux, mb, logp, ent):
        loss, metrics = whole_metrics(logp, ent, mb, lo, hi, caux)
        return apply_grads(state, loss, grads, calib_state, metrics)

    def micro(params, acc, m, lo, hi, den, tokens, resp_len):
        # A micro-batch's response arrays are cut to its bucket; seq-mean-token-sum-norm must
        # still divide by the mini-batch's response length.
        a = dataclasses.replace(algo, loss_scale_len=algo.loss_scale_len or resp_len)
        return micro_grads(params, acc, m, lo, hi, den, a, tokens)

    return TokenBudgetUpdate(
        pre=jax.jit(pre_forwards, static_argnums=2, in_shardings=(param_sh, dat),
                    out_shardings=dat),
        micro=jax.jit(micro, static_argnums=7, donate_argnums=1,
                      in_shardings=(param_sh, param_sh, dat, rep, rep, rep, rep),
                      out_shardings=(param_sh, (dat, dat, rep))),
        bounds=jax.jit(bounds_and_den, static_argnums=5, out_shardings=rep),
        finish=jax.jit(finish, donate_argnums=0, out_shardings=(state_sh, rep)),
        zeros=jax.jit(functools.partial(jax.tree.map, jnp.zeros_like), out_shardings=param_sh),
        layout=layout,
        budget=s.max_tokens_per_micro_batch,
        buckets=s.length_buckets,
        calibrated=s.calibrated,
    )  # fmt: skip
