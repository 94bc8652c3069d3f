"""Routing replay in the trainer (`rollout.routing_replay: record`) on a tiny Qwen3-MoE whose
middle layer is dense (the record holds the two MoE layers):
`prepare` scores the rollout's recorded experts, not its own router's, and logs the share of
(token, layer) pairs where the two differ; the update replays them too (its first on-policy
ratio is exactly 1 only if it routes as `prepare` did); the batch packs the record token-aligned.
References: the model's own forward with the routing given (`models.functional`), and numpy
counts of the differing expert sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import random_batch

from jfp8rl.config import ConfigError, load_config
from jfp8rl.data.batch import pack
from jfp8rl.parallel.mesh import make_mesh, put_batch, replicated_layout
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import get_algorithm
from models import functional as mf
from models.config import get_config
from models.fp8 import get_recipe
from rollout_bridge.backend import Completion

REPO_CONFIG = "configs/tiny_cpu.yaml"
RECIPE = get_recipe("fp8_block")


@pytest.fixture(scope="module")
def moe():
    cfg = get_config("tiny_qwen3_moe_mixed", compute_dtype=jnp.float32)
    graphdef, params = mf.init_model(cfg, 0)
    settings = default_settings(
        get_algorithm("grpo").__class__(name="grpo", agg_mode="seq-mean-token-mean"),
        train_recipe="fp8_block", calibrated=False,
        calib_cfg=CalibConfig(eps_low=0.2, eps_high=0.2), correction="tis",
        correction_level="token", tis_cap=2.0, group_size=4,
    )  # fmt: skip
    fns = make_step_fns(
        graphdef, settings, OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999),
        replicated_layout(make_mesh(), params),
    )  # fmt: skip
    batch = random_batch(8, 5, 4, seed=2)
    batch["rewards"] = np.array([1, 0, 0, 1, 0, 1, 0, 0], np.float32)
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"])
    routed = jax.jit(lambda p, t, m: mf.routed_experts(graphdef, p, t, m, recipe=RECIPE))
    own = np.asarray(routed(params, tokens, mask))
    # The "rollout's" record: the router's own choice except every third real token of layer 0
    # (other experts), unknown (-1) on pads.
    rec = own.astype(np.int16)
    real = batch["attention_mask"].astype(bool)
    changed = np.zeros(real.shape, bool)
    changed[:, ::3] = True
    changed &= real
    rec[changed, 0] = (own[changed, 0] + 3) % cfg.num_experts
    rec[~real] = -1
    batch["routing"] = rec
    return cfg, graphdef, params, fns, batch, own, changed


def _state(fns, params):
    """A fresh train state on a copy of `params` (`update` donates it)."""
    return {
        "params": jax.tree.map(lambda x: jnp.array(x, copy=True), params),
        "opt_state": fns.optimizer.init(params),
        "calib": init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2)),
    }


def _response(x, batch):
    r = batch["response_mask"].shape[1]
    idx = batch["prompt_lens"][:, None] + np.arange(r)[None, :]
    return np.take_along_axis(x, np.minimum(idx, x.shape[1] - 1), axis=1) * batch["response_mask"]


def test_prepare_scores_the_recorded_routing_and_logs_the_mismatch(moe) -> None:
    cfg, graphdef, params, fns, batch, own, changed = moe
    out, mets = fns.prepare(params, None, put_batch(batch, make_mesh()), calibrate=False)
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"])

    @jax.jit  # the model's own forwards, one program
    def forwards(params, routing):
        replayed = mf.token_logprobs(graphdef, params, tokens, mask, recipe=RECIPE, routing=routing)
        mine = mf.token_logprobs(graphdef, params, tokens, mask, recipe=RECIPE)
        # The experts the router itself picks in the replayed forward.
        own_replayed = mf.hidden_states_and_routing(
            graphdef, params, tokens, mask, recipe=RECIPE, routing=routing
        )[1]
        return replayed, mine, own_replayed

    replayed, mine, own_replayed = forwards(params, jnp.asarray(batch["routing"]))
    got = np.asarray(out["old_logp"])
    np.testing.assert_allclose(got, _response(np.asarray(replayed), batch), rtol=0, atol=1e-6)
    assert np.abs(got - _response(np.asarray(mine), batch)).max() > 1e-3
    # Every replayed pair of layer 0 differs in its expert set (a shift by 3 of 8 experts);
    # later layers see other hidden states, so their own choice may differ too: count them.
    known = (batch["routing"] >= 0).all(-1) & batch["attention_mask"].astype(bool)[..., None]
    differ = (np.sort(batch["routing"], -1) != np.sort(np.asarray(own_replayed), -1)).any(-1)
    differ &= known
    assert differ[:, :, 0].sum() == changed.sum()
    np.testing.assert_allclose(
        float(mets["rollout_corr/routing_mismatch"]), differ.sum() / known.sum(), rtol=1e-6
    )


def test_update_routes_as_prepare_did(moe) -> None:
    """At the update's first mini-batch the params are the old ones: every ratio is exactly 1
    when the update replays the routing `prepare` scored, and not when it routes itself."""
    cfg, graphdef, params, fns, batch, own, changed = moe
    mesh = make_mesh()

    def first_update_ratio_range(b):
        out, _ = fns.prepare(params, None, put_batch(b, mesh), calibrate=False)
        mb = {k: b[k] for k in ("tokens", "attention_mask", "prompt_lens", "response_mask",
                                "rollout_logp", "routing") if k in b}  # fmt: skip
        mb.update({k: np.asarray(v) for k, v in out.items()})
        _, mets = fns.update(_state(fns, params), put_batch(mb, mesh), False, True)
        return float(mets["actor/ratio_min"]), float(mets["actor/ratio_max"])

    assert first_update_ratio_range(batch) == (1.0, 1.0)
    # Prepare replayed, the update not: the ratios move where the routing differs.
    out, _ = fns.prepare(params, None, put_batch(batch, mesh), calibrate=False)
    mb = {k: batch[k] for k in ("tokens", "attention_mask", "prompt_lens", "response_mask",
                                "rollout_logp")}  # fmt: skip
    mb.update({k: np.asarray(v) for k, v in out.items()})
    _, mets = fns.update(_state(fns, params), put_batch(mb, mesh), False, True)
    assert float(mets["actor/ratio_max"]) - float(mets["actor/ratio_min"]) > 1e-3


def test_pack_aligns_the_record_with_tokens_and_refuses_a_partial_one() -> None:
    """Packed only when routing replay asks (`routing=True`), token-aligned, -1 past each
    sample; a completion without a record is refused naming the server flag."""
    rec = [np.arange(10, dtype=np.int16).reshape(5, 1, 2), np.ones((3, 1, 2), np.int16)]

    def completion(i, prompt, resp, routed=None):
        return Completion(
            prompt_index=i, prompt_ids=prompt, response_ids=np.array(resp, np.int32),
            logprobs=np.zeros(len(resp), np.float32), finish_reason="stop", weight_version="v",
            routed_experts=routed,
        )  # fmt: skip

    comps = [completion(0, (5, 6, 7), [8, 9], rec[0]), completion(1, (5,), [1, 2], rec[1])]
    b = pack(comps, np.zeros(2), np.zeros(2), np.ones(2, bool), max_prompt_tokens=4,
             max_tokens=3, pad_id=0, routing=True)  # fmt: skip
    assert (
        pack(
            comps,
            np.zeros(2),
            np.zeros(2),
            np.ones(2, bool),
            max_prompt_tokens=4,
            max_tokens=3,
            pad_id=0,
        ).routing
        is None
    )  # not asked: not packed
    assert b.routing.shape == (2, 7, 1, 2) and b.routing.dtype == np.int16
    np.testing.assert_array_equal(b.routing[0, :5], rec[0])
    np.testing.assert_array_equal(b.routing[1, :3], rec[1])
    assert (b.routing[0, 5:] == -1).all() and (b.routing[1, 3:] == -1).all()
    comps[1] = completion(1, (5,), [1, 2])
    with pytest.raises(
        Exception,
        match="1 of 2 completions carry no routed experts.*--enable-return-routed-experts",
    ):
        pack(comps, np.zeros(2), np.zeros(2), np.ones(2, bool), max_prompt_tokens=4,
             max_tokens=3, pad_id=0, routing=True)  # fmt: skip


def test_config_refusals_name_the_key() -> None:
    with pytest.raises(ConfigError, match="rollout.routing_replay='sometimes' is not one of"):
        load_config(REPO_CONFIG, ["rollout.routing_replay=sometimes"])
    with pytest.raises(ConfigError, match="train.max_tokens_per_micro_batch"):
        load_config(
            REPO_CONFIG, ["rollout.routing_replay=record", "train.max_tokens_per_micro_batch=64"]
        )
