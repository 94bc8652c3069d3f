"""Run by test_invariant_sharded.py in a subprocess with 4 forced host devices: the exact
(batch-invariant) policy's token log-probs on a data x fsdp mesh, against the same on one
device and against the embedded engine's sampled log-probs. Prints one JSON line: one entry
per recipe named on the command line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.parallel.mesh import make_mesh, param_layout, put_batch
from models import functional as F
from models.fp8 import get_recipe

spec = importlib.util.spec_from_file_location(
    "test_invariant", Path(__file__).parents[2] / "models" / "test_invariant.py"
)
ti = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ti)


def check(recipe_name: str) -> dict:
    cfg, gd, params = ti.policy(True)
    rec = get_recipe(recipe_name)
    prompts = ti.random_prompts(8, 9, cfg.vocab_size, seed=21)
    src, toks, lps = ti.engine_rollout(cfg, gd, params, rec, prompts, 10, 1.0, 19)
    one = ti.trainer_logprobs(gd, params, rec, src, toks, 1.0, 1, 8)
    mesh = make_mesh(2, 2, 1)
    layout = param_layout(mesh, cfg, params)
    sharded = jax.device_put(jax.tree.map(np.asarray, params), layout.params())
    seq, mask, p_max = ti.trainer_rows(src, toks, 1)
    new = toks.shape[1]
    batch = put_batch({"tokens": seq, "attention_mask": mask}, mesh)
    fn = jax.jit(F.token_logprobs, static_argnums=0, static_argnames=("recipe", "temperature"))
    with jax.set_mesh(mesh):
        lp = fn(gd, sharded, batch["tokens"], batch["attention_mask"], recipe=rec, temperature=1.0)
    mesh_lp = np.asarray(lp)[:, p_max : p_max + new]
    return {
        "devices": len(jax.devices()),
        "engine_vs_one_device": float(np.mean(lps == one)),
        "mesh_vs_one_device": float(np.mean(mesh_lp == one)),
        "max_abs_mesh": float(np.max(np.abs(mesh_lp - one))),
    }


if __name__ == "__main__":
    print(json.dumps({name: check(name) for name in sys.argv[1:]}))
    jnp.zeros(())  # keep the backend alive until the print is flushed
