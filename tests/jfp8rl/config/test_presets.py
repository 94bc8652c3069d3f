"""Algorithm presets as a user sees them in `--print-config`, the shipped configs resolved, and
which config changes a resume accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from jfp8rl.config import load_config
from jfp8rl.config.compare import differences, resumable
from jfp8rl.train import main
from jfp8rl.trainer.settings import loss_algorithm
from losses.registry import ALGORITHMS

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny_cpu.yaml"

# The table of losses/registry.py's docstring (the papers' and verl's example scripts'
# defaults), in the config's keys: eps_low, eps_high, dual_clip (0 = off), kl_coef (0 = no KL
# loss), loss_agg_mode, adv_estimator, norm_adv_by_std_in_grpo.
PRESETS = {
    "grpo": (0.2, 0.2, 3.0, 0.001, "seq-mean-token-mean", "grpo", True),
    "dapo": (0.2, 0.28, 3.0, 0.0, "token-mean", "grpo", True),
    "dr_grpo": (0.2, 0.2, 3.0, 0.0, "seq-mean-token-sum-norm", "grpo", False),
    "gspo": (3e-4, 4e-4, 0.0, 0.0, "seq-mean-token-mean", "grpo", True),
}
KEYS = (
    "eps_low", "eps_high", "dual_clip", "kl_coef", "loss_agg_mode", "adv_estimator",
    "norm_adv_by_std_in_grpo",
)  # fmt: skip


def printed(capsys: pytest.CaptureFixture[str], config: Path, *overrides: str) -> dict:
    """The YAML `python -m jfp8rl.train --config ... --print-config` prints, parsed."""
    capsys.readouterr()
    assert main(["--config", str(config), *overrides, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_print_config_shows_each_preset(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    clip = ["algorithm.clip=plain"] if name == "gspo" else []
    algo = printed(capsys, TINY, f"algorithm.name={name}", *clip)["algorithm"]
    assert tuple(algo[k] for k in KEYS) == PRESETS[name]
    # The loss the run builds from them is the registry's algorithm.
    cfg = load_config(TINY, [f"algorithm.name={name}", *clip])
    built, registered = loss_algorithm(cfg.algorithm), ALGORITHMS[name]
    if not registered.use_kl_loss:  # its kl_coef is unused
        built = dataclasses.replace(built, kl_coef=registered.kl_coef)
    assert built == registered


def test_explicit_keys_win_and_null_takes_the_preset(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    algo = printed(
        capsys, TINY, "algorithm.name=gspo", "algorithm.clip=plain", "algorithm.eps_high=1e-3",
        "algorithm.loss_agg_mode=token-mean", "algorithm.kl_coef=null",
    )["algorithm"]  # fmt: skip
    assert (algo["eps_low"], algo["eps_high"], algo["loss_agg_mode"], algo["kl_coef"]) == (
        3e-4, 1e-3, "token-mean", 0.0,
    )  # fmt: skip
    rloo = load_config(TINY, ["algorithm.name=grpo", "algorithm.adv_estimator=rloo"])
    assert loss_algorithm(rloo.algorithm).adv_estimator == "rloo"
    # A key the YAML file sets wins over the preset of an overridden name, as an override does.
    y = tmp_path / "mine.yaml"
    y.write_text(TINY.read_text().replace("  name: dapo\n", "  name: dapo\n  eps_high: 0.25\n"))
    algo = printed(capsys, y, "algorithm.name=grpo")["algorithm"]
    assert (algo["eps_low"], algo["eps_high"], algo["kl_coef"]) == (0.2, 0.25, 0.001)
    assert main(["--config", str(TINY), "algorithm.loss_agg_mode=mean", "--print-config"]) == 2
    assert capsys.readouterr().err == (
        "error: algorithm.loss_agg_mode='mean' is not one of ['token-mean', "
        "'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm']\n"
    )


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_prints(config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:  # fmt: skip
    """Each config resolves (its ??? paths given), every section and key printed, and the
    printed YAML is the config: it loads back equal."""
    paths = ["model.path=/models/m", "data.train_file=/data/train.jsonl"]
    text_overrides = paths if "???" in config.read_text() else []
    resolved = printed(capsys, config, *text_overrides)
    assert set(resolved) == {
        "run_dir", "model", "warmstart", "data", "rollout", "reward", "algorithm",
        "calibration", "train", "optim", "checkpoint", "eval", "logging",
    }  # fmt: skip
    assert resolved["run_dir"] and resolved["optim"]["lr"] > 0
    saved = tmp_path / "printed.yaml"
    saved.write_text(yaml.safe_dump(resolved))
    assert load_config(saved) == load_config(config, text_overrides)


def test_resumable_keys() -> None:
    base = load_config(TINY)
    same = load_config(TINY, [
        "run_dir=elsewhere", "train.steps=400", "train.eval_every=5", "logging.console=none",
        "checkpoint.keep=5", "eval.n=4", "eval.temperature=0.6", "rollout.url=http://h:1",
        "rollout.max_num_seqs=64", "warmstart.cache_dir=/c", "train.mesh.fsdp=2",
        "rollout.free_cache_engine=false",
    ])  # fmt: skip
    assert differences(base, same) == []
    changed = load_config(TINY, ["optim.lr=1e-4", "rollout.n=4", "data.seed=3"])
    assert differences(base, changed) == [
        ("data.seed", 0, 3), ("rollout.n", 8, 4), ("optim.lr", 5e-4, 1e-4),
    ]  # fmt: skip
    assert resumable("logging.tensorboard") and not resumable("train.stepsize")
    assert not resumable("rollout.urls_extra") and resumable("rollout.urls")
