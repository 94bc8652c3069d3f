"""The trainer's pure parts against independent numpy references: response gathering, batch
packing, `prepare` (old logprobs, GRPO advantages, TIS weights) and the non-finite skip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import random_batch

from jfp8rl.data.batch import pack
from jfp8rl.parallel.mesh import make_mesh, put_batch, replicated_layout
from jfp8rl.trainer.forward import gather_response
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import get_algorithm
from models import functional as mf
from models.config import get_config
from rollout_bridge.backend import Completion


def test_gather_response_matches_loop() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 9)).astype(np.float32)
    plen = np.array([2, 5, 3], np.int32)
    got = np.asarray(gather_response(jnp.asarray(x), jnp.asarray(plen), 4))
    for i in range(3):
        for j in range(4):
            assert got[i, j] == x[i, min(plen[i] + j, 8)]


def _completion(i: int, prompt: tuple[int, ...], resp: list[int], lps: list[float]) -> Completion:
    return Completion(
        prompt_index=i, prompt_ids=prompt, response_ids=np.array(resp, np.int32),
        logprobs=np.array(lps, np.float32), finish_reason="stop", weight_version="v",
    )  # fmt: skip


def test_pack_layout() -> None:
    comps = [
        _completion(0, (5, 6, 7), [8, 9], [-0.5, -0.25]),
        _completion(1, (5,), [1, 2, 3], [-1.0, -2.0, -3.0]),
    ]
    b = pack(comps, np.array([1.0, 0.0]), np.array([1.0, 0.0]), np.array([True, False]),
             max_prompt_tokens=4, max_tokens=3, pad_id=256)  # fmt: skip
    np.testing.assert_array_equal(
        b.tokens, [[5, 6, 7, 8, 9, 256, 256], [5, 1, 2, 3, 256, 256, 256]]
    )
    np.testing.assert_array_equal(b.attention_mask, [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(b.prompt_lens, [3, 1])
    # Sample 1 belongs to a dropped group: its loss mask is zero.
    np.testing.assert_array_equal(b.response_mask, [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(b.rollout_logp, [[-0.5, -0.25, 0], [-1, -2, -3]])
    np.testing.assert_array_equal(b.response_lens, [2, 3])


def _settings():
    algo = get_algorithm("grpo").__class__(name="grpo", agg_mode="seq-mean-token-mean")
    calib = CalibConfig(eps_low=0.2, eps_high=0.2)
    return default_settings(
        algo, train_recipe="fp8_block", calibrated=True, calib_cfg=calib, correction="tis",
        correction_level="token", tis_cap=2.0, group_size=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32)
    graphdef, params = mf.init_model(cfg, 0)
    fns = make_step_fns(
        graphdef,
        _settings(),
        OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999),
        replicated_layout(make_mesh(), params),
    )
    # Two groups of 4, each with both rewards (nonzero GRPO advantages).
    batch = random_batch(8, 4, 3, seed=1)
    batch["rewards"] = np.array([1, 0, 0, 1, 0, 0, 0, 1], np.float32)
    return cfg, graphdef, params, fns, batch


def test_prepare_matches_numpy_reference(tiny) -> None:
    cfg, graphdef, params, fns, batch = tiny
    out, _ = fns.prepare(params, None, put_batch(batch, make_mesh()), calibrate=True)
    # Old logprobs: the model's own per-token logprobs, moved to the response layout.
    from models.fp8 import get_recipe

    lp = np.asarray(mf.token_logprobs(graphdef, params, jnp.asarray(batch["tokens"]),
                                      jnp.asarray(batch["attention_mask"]),
                                      recipe=get_recipe("fp8_block")))  # fmt: skip
    m = batch["response_mask"]
    want_old = np.zeros_like(m)
    for i in range(8):
        for j in range(3):
            if m[i, j]:
                want_old[i, j] = lp[i, batch["prompt_lens"][i] + j]
    np.testing.assert_allclose(np.asarray(out["old_logp"]), want_old, rtol=0, atol=1e-6)
    # GRPO advantages: (R - mean_G) / (std_G + 1e-6), unbiased std, groups of 4.
    g = batch["rewards"].astype(np.float64).reshape(2, 4)
    adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(np.asarray(out["advantages"]), adv[:, None] * m, rtol=1e-5)
    # TIS: min(exp(old - rollout), 2) on response tokens.
    w = np.minimum(np.exp(want_old.astype(np.float64) - batch["rollout_logp"]), 2.0) * m
    np.testing.assert_allclose(np.asarray(out["is_weights"]), w, rtol=1e-5)
    # The BF16 shadow pass differs from the FP8 one, but only by quantization noise.
    d = np.abs(np.asarray(out["old_logp_bf16"]) - want_old)[m > 0]
    assert 0 < d.max() < 0.5


def test_prepare_scores_at_the_rollout_temperature(tiny) -> None:
    """Old logprobs are those of the distribution sampled from: log_softmax(logits / T)
    (float64 numpy over the model's logits), as the rollout reports them."""
    from models.fp8 import get_recipe

    cfg, graphdef, params, fns_t1, batch = tiny
    t = 0.7
    fns = make_step_fns(
        graphdef, _settings()._replace(temperature=t), OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999),
        replicated_layout(make_mesh(), params),
    )  # fmt: skip
    out, _ = fns.prepare(params, None, put_batch(batch, make_mesh()), calibrate=True)
    logits = np.asarray(mf.forward(graphdef, params, jnp.asarray(batch["tokens"]),
                                   jnp.asarray(batch["attention_mask"]),
                                   recipe=get_recipe("fp8_block")), np.float64) / t  # fmt: skip
    logz = logits.max(-1, keepdims=True)
    logz = logz + np.log(np.exp(logits - logz).sum(-1, keepdims=True))
    m = batch["response_mask"]
    want = np.zeros(m.shape)
    for i, j in zip(*np.nonzero(m), strict=True):
        pos = batch["prompt_lens"][i] + j  # logits at pos - 1 predict the token at pos
        want[i, j] = logits[i, pos - 1, batch["tokens"][i, pos]] - logz[i, pos - 1, 0]
    np.testing.assert_allclose(np.asarray(out["old_logp"]), want, rtol=0, atol=2e-5)
    at_one, _ = fns_t1.prepare(params, None, put_batch(batch, make_mesh()), calibrate=True)
    d = np.abs(np.asarray(out["old_logp"]) - np.asarray(at_one["old_logp"]))[m > 0]
    assert d.max() > 1e-2  # the temperature is really applied


def _update_inputs(fns, params, batch):
    out, _ = fns.prepare(params, None, put_batch(batch, make_mesh()))
    mb = {
        k: batch[k]
        for k in ("tokens", "attention_mask", "prompt_lens", "response_mask", "rollout_logp")
    }
    mb.update({k: np.asarray(out[k]) for k in ("old_logp", "advantages", "is_weights")})
    return mb


def _host(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


def _assert_skipped(fns, state, mb) -> None:
    """`update` reports the mini-batch skipped and returns params, Adam state and calibration
    state bit-identical to `state` (the donated input, read back before the call)."""
    before = _host(state)
    st, mets = fns.update(state, put_batch(mb, make_mesh()), False)
    assert float(mets["actor/nonfinite"]) == 1.0
    after = _host(st)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_nonfinite_update_is_skipped(tiny) -> None:
    cfg, graphdef, params, fns, batch = tiny
    mb = _update_inputs(fns, params, batch)
    calib = lambda: init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2))  # noqa: E731
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    # A finite mini-batch moves the params (and leaves nonzero Adam moments, so the skipped
    # updates below are checked against a non-trivial optimizer state).
    st, mets = fns.update({"params": copy(params), "opt_state": fns.optimizer.init(params),
                           "calib": calib()}, put_batch(mb, make_mesh()), False)  # fmt: skip
    assert float(mets["actor/nonfinite"]) == 0.0
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(st["params"]), jax.tree.leaves(params), strict=True)
    ]
    assert any(moved)
    # A NaN advantage makes loss and grads NaN: the update is skipped, state unchanged.
    bad = dict(mb, advantages=np.where(mb["response_mask"] > 0, np.nan, 0.0).astype(np.float32))
    _assert_skipped(fns, st, bad)


def test_overflowing_update_is_skipped(tiny) -> None:
    """Loss and gradients finite, but the step itself overflows (a huge finite lr and weight
    decay: lr x wd x w > f32 max for the ~1.0 norm weights): the guard must see the params
    it would write, not only the loss and gradient norm."""
    cfg, graphdef, params, fns, batch = tiny
    huge = make_step_fns(
        graphdef, _settings(), OptimSettings(3e38, 0, 100.0, 1.0, 0.9, 0.999),
        fns.layout,
    )  # fmt: skip
    mb = _update_inputs(fns, params, batch)
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    state = {
        "params": copy(params),
        "opt_state": huge.optimizer.init(params),
        "calib": init_calib_state(CalibConfig(eps_low=0.2, eps_high=0.2)),
    }
    mb_dev = {k: jnp.asarray(v) for k, v in mb.items()}
    # Jitted as in `update` (one compile; op by op it compiles ~200 small programs).
    loss_and_grads = jax.jit(huge.loss_and_grads, static_argnums=4)
    loss, grads, _, _ = loss_and_grads(params, state["calib"], mb_dev, jnp.asarray(False), False)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    _assert_skipped(huge, state, mb)


def test_checkpointed_state_stays_donatable(tmp_path) -> None:
    # Orbax leaves per-shard arrays cached on what it saves, and a referenced buffer cannot be
    # donated (the next update would copy the whole train state). The loop saves
    # `buffer_view`s: same buffers, no copy, the state's own arrays untouched.
    from jfp8rl.trainer.checkpoint import Checkpointer
    from jfp8rl.trainer.state import buffer_view

    def donated(tree):
        leaves = jax.tree.leaves(tree)
        jax.block_until_ready(jax.jit(lambda t: [x * 2 for x in t], donate_argnums=0)(leaves))
        return [x.is_deleted() for x in leaves]

    state = {"w": jnp.arange(6.0).reshape(2, 3), "opt": {"mu": jnp.ones(4)}}
    ckpt = Checkpointer(tmp_path, keep=2)
    views = jax.tree.map(buffer_view, state)
    assert all(
        v.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()  # a view, not a copy
        for v, x in zip(jax.tree.leaves(views), jax.tree.leaves(state), strict=True)
    )
    ckpt.save(1, views, {"step": 1})
    del views
    restored, _ = ckpt.restore(1, state)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6.0).reshape(2, 3))
    assert all(donated(state))
    # Without the views the same save pins the buffers (what the loop avoids).
    plain = {"w": jnp.arange(6.0).reshape(2, 3), "opt": {"mu": jnp.ones(4)}}
    ckpt.save(2, plain, {"step": 2})
    assert not all(donated(plain))
    ckpt.close()


def test_prepare_applies_the_configured_correction_and_rejection(tiny) -> None:
    """IcePop with batch normalisation and a token_k1 rejection, as the config asks: prepare's
    weights, kept mask and metrics are those of `losses` on its old logprobs, and the arrays the
    update reads carry the rejected mask."""
    from types import SimpleNamespace

    from jfp8rl.trainer.stages import stage_prepare
    from losses.rollout_correction import is_weights
    from losses.rollout_rejection import parse_rejection, rejection_mask

    _, graphdef, params, _, batch = tiny
    rules = parse_rejection("token_k1", "0.1_10.0")
    s = _settings()._replace(
        calibrated=False, correction="icepop", correction_lower=0.05, tis_cap=20.0,
        correction_batch_norm=True, rejection=rules,
    )  # fmt: skip
    mesh = make_mesh()
    fns = make_step_fns(graphdef, s, OptimSettings(1e-3, 0, 0.0, 1.0, 0.9, 0.999),
                        replicated_layout(mesh, params))  # fmt: skip
    t = SimpleNamespace(fns=fns, ref_params=None, mesh=mesh)
    full, mets = stage_prepare(t, {"params": params}, SimpleNamespace(**batch, routing=None), False)
    mask, roll = batch["response_mask"], batch["rollout_logp"]
    w, is_aux = is_weights(full["old_logp"], roll, mask, mode="icepop", cap=20.0, lower=0.05,
                           batch_normalize=True)  # fmt: skip
    kept, rs_aux = rejection_mask(full["old_logp"], roll, mask, rules)
    np.testing.assert_allclose(full["is_weights"], w, rtol=1e-6)
    np.testing.assert_array_equal(full["response_mask"], kept)
    assert 0 < kept.sum() < mask.sum()  # some tokens rejected, some kept
    assert float(np.sum(w == 0) - np.sum(mask == 0)) > 0  # IcePop zeroed some
    for k, v in (is_aux | rs_aux).items():
        np.testing.assert_allclose(mets[k], float(v), rtol=1e-6, err_msg=k)
