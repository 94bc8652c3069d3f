"""`rollout.on_policy: exact` in the trainer: a run whose every rollout log-prob equals the
trainer's recompute bit for bit (the online check at every step), the refusals of what cannot
hold, and the online check catching an engine that is not batch-invariant."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import TINY, small

from jfp8rl.config import ConfigError, load_config
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.parallel.mesh import make_mesh
from jfp8rl.trainer.loop import run
from jfp8rl.trainer.on_policy import on_policy_check
from jfp8rl.trainer.policy import check_exact_moe
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig
from losses.registry import Algorithm
from models import functional as F
from models.config import get_config
from models.fp8 import get_recipe

pytestmark = pytest.mark.slow  # a whole run: scheduled first

# The engine-rollout helpers of the model-level bit-identity tests.
_spec = importlib.util.spec_from_file_location(
    "test_invariant", Path(__file__).parents[2] / "models" / "test_invariant.py"
)
ti = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ti)


def test_exact_run_every_logprob_equal(tmp_path: Path, cache_dir: Path) -> None:
    run_dir = tmp_path / "exact"
    # No evaluation and no HF export: neither is checked here, each compiles programs of its own.
    extra = ("rollout.on_policy=exact", "rollout.on_policy_check_every=1", "train.steps=2",
             "train.eval_every=0", "checkpoint.export_hf=false", "logging.tensorboard=false")  # fmt: skip
    run(load_config(TINY, small(run_dir, cache_dir, *extra)))
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout_corr/exact_share"] == 1.0
        assert r["rollout_corr/max_abs_dlogp"] == 0.0
        assert r["rollout_corr/kl"] == 0.0  # old log-probs are the rollout's


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.backend=http", "rollout.backend=http"),
        ("rollout.top_p=0.9", "rollout.top_k=-1 / rollout.top_p=0.9"),
        ("rollout.kv_cache_dtype=fp8", "rollout.kv_cache_dtype=fp8"),
        ("rollout.export_format=fp8", "rollout.export_format=fp8"),
        ("rollout.recipe=fp8_tensor", "rollout.recipe=fp8_tensor"),
        ("train.recipe=bf16", "train.recipe=bf16 and rollout.recipe=fp8_block"),
        ("train.mesh.tensor=2", "train.mesh.tensor=2"),
    ],
)
def test_refusals_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["rollout.on_policy=exact", override])
    assert str(e.value).startswith("rollout.on_policy=exact cannot hold with ")
    assert message in str(e.value)


def test_exact_moe_needs_one_trainer_device() -> None:
    """An MoE model's layers are batch-invariant on one device: a mesh is refused, naming
    train.mesh and the way out; a dense model and a one-device MoE trainer pass."""
    moe = get_config("tiny_qwen3_moe_mixed", batch_invariant=True)
    with pytest.raises(ConfigError, match="on one device only, train.mesh has 2"):
        check_exact_moe(moe, 2, Path("m"))
    check_exact_moe(moe, 1, Path("m"))
    check_exact_moe(get_config("tiny_qwen3", batch_invariant=True), 8, Path("m"))


class _Fns:
    """What the check needs of `StepFns`: its mesh context."""

    def __init__(self, mesh):
        self.mesh = mesh

    def mesh_context(self):
        return jax.set_mesh(self.mesh)


def test_online_check_catches_an_engine_that_is_not_batch_invariant() -> None:
    """Rollouts sampled by the exact engine pass the check; the same weights served with the
    fast numerics (a deliberately broken path) are caught, with the size of the gap."""
    rec = get_recipe("fp8_block")
    cfg, gd, params = ti.policy(True)
    fast = get_config("tiny_qwen3", compute_dtype=jnp.float32)
    gd_fast, _ = F.init_model(fast, 0)
    prompts = ti.random_prompts(4, 7, cfg.vocab_size, seed=11)
    s = default_settings(
        Algorithm(name="grpo"), train_recipe="fp8_block", calibrated=False,
        calib_cfg=CalibConfig(eps_low=0.2, eps_high=0.2), correction="none",
        correction_level="token", tis_cap=2.0, group_size=1,
    )  # fmt: skip
    mesh = make_mesh(1, 1, 1)
    results = []
    for engine_cfg, engine_gd in ((cfg, gd), (fast, gd_fast)):
        src, toks, lps = ti.engine_rollout(engine_cfg, engine_gd, params, rec, prompts, 8, 1.0, 15)
        results.append(on_policy_check(gd, s, _Fns(mesh), mesh, params, _batch(src, toks, lps), 4))
    assert results[0] == {"rollout_corr/exact_share": 1.0, "rollout_corr/max_abs_dlogp": 0.0}
    assert results[1]["rollout_corr/exact_share"] < 1.0
    assert 0.0 < results[1]["rollout_corr/max_abs_dlogp"] < 0.5


def _batch(prompts, toks, lps) -> dict[str, np.ndarray]:
    """The trainer's batch layout: prompt ++ response right-padded, response-aligned log-probs."""
    n, r = toks.shape
    t = max(len(p) for p in prompts) + r
    tokens = np.zeros((n, t), np.int32)
    mask = np.zeros_like(tokens)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], tokens[i, len(p) : len(p) + r] = p, toks[i]
        mask[i, : len(p) + r] = 1
    return {
        "tokens": tokens,
        "attention_mask": mask,
        "prompt_lens": np.array([len(p) for p in prompts], np.int32),
        "response_mask": np.ones((n, r), np.float32),
        "rollout_logp": lps.astype(np.float32),
    }


def test_off_spelled_bare_in_yaml_and_on_the_command_line(tmp_path: Path) -> None:
    """YAML reads a bare `off` as false: both spellings still mean "off"."""
    text = TINY.read_text() + "\n"
    conf = tmp_path / "c.yaml"
    conf.write_text(text.replace("rollout:\n", "rollout:\n  on_policy: off\n", 1))
    assert load_config(conf).rollout.on_policy == "off"
    assert load_config(TINY, ["rollout.on_policy=off"]).rollout.on_policy == "off"
    assert load_config(conf, ["rollout.on_policy=exact"]).rollout.on_policy == "exact"
