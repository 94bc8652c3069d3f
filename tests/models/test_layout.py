"""Checkpoints of the per-layer layout (before stacking) convert exactly to the stacked one,
params and Adam moments alike, through a real orbax save and raw restore."""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _model_testlib import tiny
from flax import nnx

from models.layout import has_per_layer_layers, stack_per_layer_layers


def _per_layer(pure: dict, num_layers: int) -> dict:
    """The old layout of a stacked pure dict: model.layers.{i}.<...> = stacked leaf [i]."""
    layers = pure["model"]["layers"]
    old = {i: jax.tree.map(lambda x, i=i: np.asarray(x)[i], layers) for i in range(num_layers)}
    return {**pure, "model": {**pure["model"], "layers": old}}


def test_old_orbax_checkpoint_converts_exactly(tmp_path):
    cfg, _, params = tiny("tiny_qwen2")
    pure = nnx.to_pure_dict(params)
    opt = optax.adam(1e-3)
    opt_state = opt.init(pure)
    opt_state = jax.tree.map(lambda x: x + 0.5 if x.ndim else x, opt_state)  # non-trivial mu/nu
    old_state = {
        "params": _per_layer(pure, cfg.num_layers),
        "opt_state": (
            optax.ScaleByAdamState(
                count=opt_state[0].count,
                mu=_per_layer(opt_state[0].mu, cfg.num_layers),
                nu=_per_layer(opt_state[0].nu, cfg.num_layers),
            ),
            opt_state[1],
        ),
    }
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "old", old_state)
    ckpt.wait_until_finished()
    raw = ckpt.restore(tmp_path / "old")  # no target: nested dicts / lists, "0".."L-1" keys
    assert has_per_layer_layers(raw)
    new = stack_per_layer_layers(raw)
    assert not has_per_layer_layers(new)
    want = {"params": pure, "opt_state": opt_state}
    got_leaves, want_leaves = jax.tree.leaves(new), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    np.testing.assert_array_equal(
        new["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"],
        np.asarray(pure["model"]["layers"]["self_attn"]["q_proj"]["kernel"]),
    )
    mu = new["opt_state"][0]["mu"]["model"]["layers"]["mlp"]["down_proj"]["kernel"]
    np.testing.assert_array_equal(
        mu, np.asarray(opt_state[0].mu["model"]["layers"]["mlp"]["down_proj"]["kernel"])
    )


def test_mismatched_layers_are_reported():
    tree = {"layers": {"0": {"w": np.zeros(2)}, "1": {"v": np.zeros(2)}}}
    with pytest.raises(ValueError, match="do not hold the same params"):
        stack_per_layer_layers(tree)
    assert not has_per_layer_layers({"layers": {"a": 1}})
