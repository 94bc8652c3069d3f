"""Run by tests/jfp8rl/parallel/test_sharded.py in a subprocess with 8 forced host devices: the step on
sharded meshes against the same step on one device. Prints one JSON line of measured maximum
relative differences (and layout facts) per mesh.

Usage: python sharded_check.py <recipe>:<mesh>,<mesh>... [...]   e.g. bf16:fsdp8,data2_fsdp2_tensor2
(with XLA_FLAGS=--xla_force_host_platform_device_count=8). Calibrated Clipping is on: its
quantiles and balance sums must stay reductions over the global batch. `<recipe>+budget` runs
the sharded meshes with token-budget micro-batches (`BUDGET`, `BUCKETS`) against the whole
mini-batch on one device.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tiny_run import random_batch

from jfp8rl.parallel.mesh import make_mesh, param_layout, put_batch
from jfp8rl.trainer.forward import UPDATE_INPUTS, present
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import Algorithm
from models import functional as mf
from models.config import get_config

MESHES = {
    "fsdp8": (1, 8, 1),
    "fsdp4_tensor2": (1, 4, 2),
    "data2_fsdp4": (2, 4, 1),
    "data2_fsdp2_tensor2": (2, 2, 2),
}
N, P, R = 16, 5, 4
CALIB = CalibConfig(eps_low=0.2, eps_high=0.2)
# Adam's first update is g / (|g| + eps): with the default eps (1e-8) it turns f32 roundoff in
# near-zero gradient entries into O(lr) changes (measured: 2e-4 relative params after one
# update, for grads equal to 6e-7). A larger eps keeps the update continuous in the gradient,
# so the params compare what sharding changes, not Adam's conditioning.
OPT = OptimSettings(1e-2, 0, 0.0, 1.0, 0.9, 0.999, eps=1e-3)
# Three calibrating updates (one compiled program; the calibration's quantile and balance are
# the global reductions at stake; tracking mini-batches run the same solver).
UPDATES = 3
# Token-budget micro-batches of P + R = 9 tokens on each batch rank of a mesh: 1 row of bucket 9
# or 2 rows of bucket 5 per rank (the batch's sequences: 3 to 9 tokens).
BUDGET, BUCKETS = 10, (5, 9)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tree_rel(a, b) -> float:
    return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def fns_for(recipe: str, shape: tuple[int, int, int], cfg, graphdef, params0, budget=0):
    mesh = make_mesh(*shape)
    algo = Algorithm(name="t", agg_mode="seq-mean-token-mean", dual_clip=3.0)
    s = default_settings(
        algo, train_recipe=recipe, calibrated=True, calib_cfg=CALIB, correction="tis",
        correction_level="token", tis_cap=2.0, group_size=4,
        max_tokens_per_micro_batch=budget, length_buckets=BUCKETS,
    )  # fmt: skip
    return mesh, make_step_fns(graphdef, s, OPT, param_layout(mesh, cfg, params0))


def init_state(fns, params0):
    sh = fns.state_shardings(init_calib_state(CALIB))
    # From host copies: device_put onto one device would alias params0, and updates donate.
    params = jax.device_put(jax.tree.map(np.asarray, params0), sh["params"])
    return {
        "params": params,
        "opt_state": jax.jit(fns.optimizer.init, out_shardings=sh["opt_state"])(params),
        "calib": jax.device_put(init_calib_state(CALIB), sh["calib"]),
    }


def prepared(recipe: str, cfg, graphdef, params0, batch) -> dict[str, np.ndarray]:
    """The mini-batch the updates read, prepared once on one device (the sharded `prepare`
    runs in the trainer end-to-end test), with perturbed old logprobs: ratios != 1."""
    mesh, fns = fns_for(recipe, (1, 1, 1), cfg, graphdef, params0)
    params = init_state(fns, params0)["params"]
    out, _ = fns.prepare(params, None, put_batch(batch, mesh), calibrate=True)
    full = present(batch, UPDATE_INPUTS) | {k: np.asarray(v) for k, v in out.items()}
    noise = np.random.default_rng(4).normal(0, 0.2, size=(N, R)).astype(np.float32)
    full["old_logp"] = full["old_logp"] + noise * full["response_mask"]
    full["old_logp_bf16"] = full["old_logp_bf16"] + noise * full["response_mask"]
    return full


def run_mesh(recipe: str, shape: tuple[int, int, int], cfg, graphdef, params0, full, budget=0):
    mesh, fns = fns_for(recipe, shape, cfg, graphdef, params0, budget)
    state = init_state(fns, params0)
    dev = put_batch(full, mesh)
    with fns.mesh_context():
        if budget:
            grads = fns.token_budget.accumulate(state, dev, True, False).grads
        else:
            loss, grads, _, _ = jax.jit(fns.loss_and_grads, static_argnums=4)(
                state["params"], state["calib"], dev, jnp.asarray(False), True
            )
    grads = jax.device_get(grads)
    metrics, history = [], []
    for _ in range(UPDATES):
        state, mets = fns.update(state, dev, True)
        metrics.append({k: float(v) for k, v in mets.items()})
        history.append(jax.device_get(state["params"]))
    if budget:  # the loss logged by the first update: the one at the initial params
        loss = metrics[0]["actor/loss"]
    # Layout facts: the big matrices are split (no device holds a whole one) and Adam's
    # moments follow their params.
    q = state["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]
    mu = state["opt_state"][1][0].mu["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]
    facts = {
        "q_spec": str(q.sharding.spec),
        "mu_spec": str(mu.sharding.spec),
        "q_shard_fraction": q.addressable_shards[0].data.size / q.size,
        "micro_batches": metrics[0].get("perf/micro_batches", 1.0),  # token budget: > 1
    }
    return float(loss), grads, history[-1], metrics, facts, history


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32, num_layers=1)
    graphdef, params0 = mf.init_model(cfg, 0)
    batch = random_batch(N, P, R, seed=7)
    report, refs = {}, {}
    for job in sys.argv[1:]:
        kind, names = job.split(":")
        recipe, budget = kind.removesuffix("+budget"), BUDGET if kind.endswith("+budget") else 0
        if recipe not in refs:  # the whole mini-batch on one device, once per recipe
            full = prepared(recipe, cfg, graphdef, params0, batch)
            refs[recipe] = full, run_mesh(recipe, (1, 1, 1), cfg, graphdef, params0, full)
        full, ref = refs[recipe]
        for name in names.split(","):
            got = run_mesh(recipe, MESHES[name], cfg, graphdef, params0, full, budget)
            report[f"{kind}:{name}"] = {
                "loss": rel(got[0], ref[0]),
                "grads": tree_rel(got[1], ref[1]),
                "params_after_3": tree_rel(got[2], ref[2]),
                "metrics": max(
                    rel(g[k], r[k]) for g, r in zip(got[3], ref[3], strict=True) for k in r
                ),
                "bounds_after_3": [got[3][-1]["calib/lower"], got[3][-1]["calib/upper"]],
                "ref_bounds_after_3": [ref[3][-1]["calib/lower"], ref[3][-1]["calib/upper"]],
                **got[4],
            }
    print(json.dumps(report))
