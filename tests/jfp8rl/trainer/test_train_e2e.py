"""End to end: the trainer on the tiny config for a few steps, resume equality, CLI errors.

One module-scoped warm-started base policy (cached in a temp folder) serves every test; the
jitted step functions are cached per setting in-process, so later runs reuse the compiles.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_run import TINY, small

from jfp8rl.config import load_config
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.observe.plots import make_report
from jfp8rl.train import main
from jfp8rl.trainer.checkpoint import Checkpointer
from jfp8rl.trainer.loop import run
from models.hf_io import load_hf, read_safetensors

# docs/design.md section 8: every one must be present and finite at every step.
SECTION8 = [
    "reward/mean", "reward/accuracy", "response_length/mean", "actor/entropy", "actor/pg_loss",
    "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/clipfrac_neg_lower",
    "actor/clipfrac_pos_upper", "rollout_corr/kl", "rollout_corr/k3_kl",
    "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_eff_sample_size", "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max", "calib/lower", "calib/upper", "calib/alpha",
    "calib/p_ref", "calib/balance_fp8_plain", "calib/balance_fp8_calibrated",
    "calib/bf16_clipfrac_neg_lower", "timing/rollout_s", "timing/train_s", "timing/sync_s",
    "throughput/tokens_per_s",
]  # fmt: skip
# Wall-clock metrics differ between runs; everything else must match exactly on resume.
pytestmark = pytest.mark.slow  # a whole run or more: scheduled first


TIMING_PREFIXES = ("timing/", "throughput/")


@pytest.fixture(scope="module")
def full_run(tiny_full_run: Path) -> Path:
    """The session's tiny run (tests/jfp8rl/conftest.py), shared with the checkpoint tests."""
    return tiny_full_run


def test_every_metric_finite_and_outputs_loadable(full_run: Path) -> None:
    recs = read_metrics(full_run)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[0]["eval/accuracy"] is not None
    for r in recs[1:]:
        missing = [k for k in SECTION8 if r.get(k) is None or not math.isfinite(r[k])]
        assert not missing, f"step {r['step']}: missing or non-finite {missing}"
        # Response lengths, rewards and fractions are in range.
        assert 1 <= r["response_length/mean"] <= 6
        assert 0 <= r["reward/accuracy"] <= 1
        assert 0.6 <= r["calib/lower"] <= 1.0 <= r["calib/upper"] <= 1.8
    assert recs[4]["eval/accuracy"] is not None
    assert (full_run / "config.yaml").is_file()
    assert list((full_run / "tb").glob("events.out.tfevents.*"))

    # The final checkpoint restores, and its params equal the HF export bit for bit.
    cfg, graphdef, params = load_hf(full_run / "hf_final")
    ck = Checkpointer(full_run, keep=2)
    assert ck.latest_step() == 4
    from jfp8rl.trainer.optimizer import OptimSettings, make_optimizer
    from losses.calibrated import CalibConfig, init_calib_state

    # Same structure as the trainer's state (AdamW with warmup; values do not matter).
    like = {
        "params": params,
        "opt_state": make_optimizer(OptimSettings(1e-3, 6, 0.0, 1.0, 0.9, 0.999)).init(params),
        "calib": init_calib_state(CalibConfig()),
        "rng": jax.random.key_data(jax.random.key(0)),
    }
    state, meta = ck.restore(4, like)
    ck.close()
    # Data position = every prompt drawn, dynamic sampling's extra rounds included.
    drawn = sum(r["rollout/sampled_groups"] for r in read_metrics(full_run)[1:])
    assert meta["step"] == 4 and meta["data_position"] == drawn >= 4 * 4
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The HF folder is what vLLM loads: config, safetensors, tokenizer.
    tensors = read_safetensors(full_run / "hf_final" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
    assert (full_run / "hf_final" / "tokenizer.json").is_file()
    assert json.loads((full_run / "hf_final" / "config.json").read_text())["model_type"] == "qwen3"


def test_resume_reproduces_uninterrupted_run(
    full_run: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "resumed"
    run(load_config(TINY, small(run_dir, cache_dir, "train.stop_after=2")))
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    run(load_config(TINY, small(run_dir, cache_dir)))  # finds checkpoint 2, resumes
    a, b = read_metrics(full_run), read_metrics(run_dir)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        ka = {k for k in ra if not k.startswith(TIMING_PREFIXES)}
        kb = {k for k in rb if not k.startswith(TIMING_PREFIXES)}
        assert ka == kb
        for k in ka:
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
    pa = read_safetensors(full_run / "hf_final" / "model.safetensors")
    pb = read_safetensors(run_dir / "hf_final" / "model.safetensors")
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_report_draws_overlaid_runs(full_run: Path, tmp_path: Path) -> None:
    out = make_report([full_run, full_run], tmp_path / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(TINY), f"run_dir={tmp_path}", "optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err
    assert main(["--config", str(TINY), f"run_dir={tmp_path}", "optim.lr=fast"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_malformed_jsonl_exit_2(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    argv = [
        "--config", str(TINY), f"run_dir={tmp_path / 'run'}", "data.task=file",
        f"data.train_file={bad}", f"model.path={full_run / 'hf_final'}", "logging.console=none",
        "train.jax_cache_dir=",
    ]  # fmt: skip
    assert main(argv) == 2
    assert f"{bad}:2: missing required field 'answer'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_down_exits_1_and_keeps_checkpoint(
    full_run: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run folder with checkpoint 2 (the session's run as a kill during step 3 leaves it:
    # checkpoint 4 and the final export not there), resumed against a rollout server that is
    # not there.
    run_dir = tmp_path / "down"
    shutil.copytree(full_run, run_dir, ignore=shutil.ignore_patterns("hf_final", "tb"))
    shutil.rmtree(run_dir / "checkpoints" / "4")
    (run_dir / "summary.json").unlink()
    url = f"http://127.0.0.1:{_free_port()}"
    argv = ["--config", str(TINY), *small(run_dir, cache_dir, "rollout.backend=http",
            f"rollout.url={url}", "rollout.timeout_s=2")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert url in err
    ck = Checkpointer(run_dir, keep=2)
    assert ck.latest_step() == 2
    ck.close()


def test_nonfinite_updates_in_a_row_stop_with_a_loadable_checkpoint(
    full_run: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lr = inf turns every update into inf/NaN params: each one must be skipped (the weights
    # the rollout serves stay finite), and max_nonfinite skipped steps in a row stop the run
    # with a checkpoint and the resume command.
    run_dir = tmp_path / "nonfinite"
    argv = ["--config", str(TINY), *small(run_dir, cache_dir, "optim.lr=inf",
            "train.max_nonfinite=2", "train.steps=6")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 steps in a row had only non-finite" in err and "--resume" in err
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    updates_per_step = 2 * 2  # tiny_cpu's 2 PPO epochs x small()'s 2 mini-batches
    assert all(r["actor/nonfinite_updates"] == updates_per_step for r in rows[1:])
    # Checkpoint 2 restores, and its params are still the initial ones: finite, unchanged.
    cfg, _, params = load_hf(full_run / "hf_final")
    from jfp8rl.trainer.optimizer import OptimSettings, make_optimizer
    from losses.calibrated import CalibConfig, init_calib_state

    like = {
        "params": params,
        "opt_state": make_optimizer(OptimSettings(1e-3, 6, 0.0, 1.0, 0.9, 0.999)).init(params),
        "calib": init_calib_state(CalibConfig()),
        "rng": jax.random.key_data(jax.random.key(0)),
    }
    ck = Checkpointer(run_dir, keep=2)
    assert ck.latest_step() == 2
    first, _ = ck.restore(min(ck.all_steps()), like)
    last, meta = ck.restore(2, like)
    ck.close()
    assert meta["step"] == 2
    for a, b in zip(jax.tree.leaves(last["params"]), jax.tree.leaves(first["params"]), strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_and_eval_reproduce_the_run(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`jfp8rl.export` of the last checkpoint equals `hf_final` byte for byte (one from the
    orbax checkpoint, one from the in-memory final state); `jfp8rl.eval` with the run's config
    on the exports of steps 2 and 4 reproduces the run's greedy eval accuracy of those steps."""
    from jfp8rl.data.tasks import arithmetic_split
    from jfp8rl.eval import main as eval_main
    from jfp8rl.export import main as export_main

    for step in (2, 4):
        assert (
            export_main([str(full_run), "--step", str(step), "--out", str(tmp_path / f"s{step}")])
            == 0
        )
    a = read_safetensors(full_run / "hf_final" / "model.safetensors")
    b = read_safetensors(tmp_path / "s4" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "s4" / name).read_text() == (full_run / "hf_final" / name).read_text()
    assert export_main([str(full_run), "--step", "1"]) == 2
    assert "no checkpoint for step 1; saved steps: [2, 4]" in capsys.readouterr().err

    _, evals = arithmetic_split(2, 16)  # the run's eval set (data.eval_size=16)
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in evals)
    )
    logged = {r["step"]: r["eval/accuracy"] for r in read_metrics(full_run) if "eval/accuracy" in r}
    for step in (2, 4):
        out = tmp_path / f"eval{step}.json"
        argv = ["--model", str(tmp_path / f"s{step}"), "--data", str(data),
                "--config", str(full_run / "config.yaml"), "--out", str(out)]  # fmt: skip
        assert eval_main(argv) == 0
        res = json.loads(out.read_text())
        assert res["problems"] == 16 and res["temperature"] == 0 and res["n"] == 1
        assert res["pass@1"] == res["avg@1"] == logged[step], step
        assert 1 <= res["response_length/mean"] <= 6  # rollout.max_tokens of the run
