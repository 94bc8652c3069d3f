"""The MoE load-balancing loss in the update (`algorithm.moe_aux_loss_coef`) on a tiny
Qwen3-MoE: the logged `actor/moe_aux_loss` is the loss of the model's router loads over the
real tokens of the samples with a response token (`Decoder.hidden_states_and_load`, whose
loads tests/models/test_moe_balance.py checks against transformers), the gradient is the policy
loss's plus coef times the balancing loss's, and with micro-batches each contributes its loss
weighted by its share of the counted tokens. A dense policy logs nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_run import random_batch

from jfp8rl.config import ConfigError, load_config
from jfp8rl.parallel.mesh import make_mesh, put_batch, replicated_layout
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import get_algorithm
from models import fp8
from models import functional as mf
from models.config import get_config
from models.moe import load_balancing_loss

COEF = 0.5
CALIB = CalibConfig(eps_low=0.2, eps_high=0.2)
ALGO = get_algorithm("grpo").__class__(name="grpo", agg_mode="seq-mean-token-mean")  # no KL


@functools.cache
def model(name: str = "tiny_qwen3_moe"):
    cfg = get_config(name, compute_dtype=jnp.float32)
    return mf.init_model(cfg, 0)


def fns_for(coef: float, micro: int = 0, name: str = "tiny_qwen3_moe"):
    """micro: sequences per micro-batch; -1: token-budget micro-batches of 10 tokens (P + R =
    9: one row of bucket 9 or two of bucket 5)."""
    graphdef, params = model(name)
    settings = default_settings(
        ALGO, train_recipe="bf16", calibrated=False, calib_cfg=CALIB,
        correction="tis", correction_level="token", tis_cap=2.0, group_size=4,
        micro_batch_size=max(micro, 0), moe_aux_loss_coef=coef,
        max_tokens_per_micro_batch=10 if micro < 0 else 0, length_buckets=(5, 9),
    )  # fmt: skip
    layout = replicated_layout(make_mesh(), params)
    return make_step_fns(graphdef, settings, OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999), layout)


@functools.cache
def mini_batch():
    """A mini-batch of 8 samples prepared by the MoE policy; sample 5 has no response token
    left to train on."""
    graphdef, params = model()
    batch = random_batch(8, 5, 4, seed=3)
    fns = fns_for(0.0)
    out, _ = fns.prepare(params, None, put_batch(batch, make_mesh()), calibrate=False)
    mb = {k: batch[k] for k in ("tokens", "attention_mask", "prompt_lens", "response_mask",
                                "rollout_logp")}  # fmt: skip
    mb.update({k: np.asarray(v) for k, v in out.items()})
    mb["response_mask"] = mb["response_mask"].copy()
    mb["response_mask"][5] = 0
    return mb


@functools.cache
def loss_and_grads(coef: float, micro: int):
    """(loss, grads, metrics) of the update's gradient program on `mini_batch()`; computed
    once per (coef, micro) for the whole module (the baseline without the loss is shared)."""
    fns, mb = fns_for(coef, micro), mini_batch()
    _, params = model()
    if fns.token_budget is not None:
        state = {"params": params, "opt_state": None, "calib": init_calib_state(CALIB)}
        with fns.mesh_context():
            a = fns.token_budget.accumulate(state, mb, False, True)
        return None, a.grads, a.aux
    with fns.mesh_context():
        run = jax.jit(lambda p, b: fns.loss_and_grads(p, init_calib_state(CALIB), b, True, False))
        loss, grads, _, metrics = run(params, put_batch(mb, make_mesh()))
    return loss, grads, metrics


PARTS = 8  # room for every split of the mini-batch's 8 samples (one compiled reference)


@functools.cache
def balancing():
    """Jitted (params, counted [PARTS, N, T]) -> ((weighted, losses [PARTS]), d weighted / d
    params): the balancing loss of the model's router loads over the tokens each mask
    `counted[j]` marks (`Decoder.hidden_states_and_load` on the whole mini-batch's rows, its
    `load_mask` one part at a time), and their sum weighted by each part's share of the marked
    tokens (an empty part: loss 0, weight 0)."""
    graphdef, _ = model()
    mb = mini_batch()
    tokens, mask = jnp.asarray(mb["tokens"]), jnp.asarray(mb["attention_mask"])

    def weighted(params, counted):
        decoder = nnx.merge(graphdef, params)
        attend = mf.self_attention(decoder.cfg, mask)
        dot = mf.dot_general_for(decoder.cfg, fp8.BF16)

        def one(load_mask):
            *_, load = decoder.hidden_states_and_load(
                tokens, mf.positions_from_mask(mask),
                lambda i, q, k, v, c: (attend(i, q, k, v), c), dot, load_mask=load_mask,
            )  # fmt: skip
            return load_balancing_loss(load)

        losses = jax.lax.map(one, counted)  # one part after another
        n = jnp.sum(counted, axis=(1, 2), dtype=jnp.float32)
        return jnp.sum(losses * n) / jnp.sum(n), losses

    return jax.jit(jax.value_and_grad(weighted, has_aux=True))


def max_rel(a, b):
    num = max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    return num / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))


@pytest.mark.parametrize("micro", [0, 4, -1], ids=["whole", "two_micro_batches", "token_budget"])
def test_update_adds_the_weighted_balancing_loss(micro):
    _, params = model()
    mb = mini_batch()
    # Micro-batch j holds samples j, j + k, ... (`jfp8rl.trainer.microbatch.split_micro`);
    # token-budget ones the rows of their plan.
    halves = [np.arange(8)] if micro == 0 else [np.arange(0, 8, 2), np.arange(1, 8, 2)]
    if micro < 0:
        halves = [p.rows[p.rows >= 0] for p in fns_for(0.0, micro).token_budget.plan(mb)[1]]
    # The real tokens of each micro-batch's samples that have a response token.
    real = (mb["attention_mask"] != 0) & mb["response_mask"].any(1)[:, None]
    counted = np.zeros((PARTS, *real.shape), bool)
    for j, rows in enumerate(halves):
        counted[j, rows] = real[rows]
    (expected, _), bal_grads = balancing()(params, jnp.asarray(counted))
    expected = float(expected)

    # Without the loss, token-budget micro-batches give the whole mini-batch's gradient
    # (tests/jfp8rl/trainer/test_microbatch.py): the whole one's, computed once for both.
    loss0, grads0, m0 = loss_and_grads(0.0, max(micro, 0))
    loss1, grads1, m1 = loss_and_grads(COEF, micro)
    # Logged with or without the coefficient; the update's loss moves by coef x it.
    for m in (m0, m1) if micro >= 0 else (m1,):
        assert abs(float(m["actor/moe_aux_loss"]) - expected) < 1e-6
    if micro >= 0:  # the whole mini-batch's loss and the micro-batches' recomputed one
        assert abs(float(loss1) - float(loss0) - COEF * expected) < 1e-6
    want = jax.tree.map(lambda g0, gb: g0 + COEF * gb, grads0, bal_grads)
    assert max_rel(grads1, want) < 1e-5


def test_dense_policy_logs_no_balancing_loss_and_the_key_is_checked():
    # The metrics' keys only: traced, not compiled (`jax.eval_shape`).
    fns = fns_for(0.0, name="tiny_qwen3")
    _, params = model("tiny_qwen3")
    with fns.mesh_context():
        metrics = jax.eval_shape(
            lambda p, b: fns.loss_and_grads(p, init_calib_state(CALIB), b, True, False),
            params, put_batch(mini_batch(), make_mesh()),
        )[3]  # fmt: skip
    assert "actor/moe_aux_loss" not in metrics
    assert load_config("configs/tiny_moe_cpu.yaml", []).algorithm.moe_aux_loss_coef == 0.0
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        load_config("configs/tiny_moe_cpu.yaml", ["algorithm.moe_aux_loss_coef=-0.1"])
