"""Config loading: YAML + overrides, errors that name the key and file, the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from jfp8rl.config import Config, ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parents[3]


def test_yaml_and_overrides_merge(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  lr: 1e-3\nalgorithm:\n  name: dapo\n")
    # The keys whose value depends on the model have no default in a config file.
    with pytest.raises(ConfigError) as err:
        load_config(y, ["rollout.n=4"])
    assert str(err.value) == (
        f"{y}: no value for data.max_prompt_tokens, rollout.max_tokens, run_dir (its value "
        "depends on the model and task); set data.max_prompt_tokens=... rollout.max_tokens=... "
        "run_dir=... in the config file or on the command line"
    )
    required = ["run_dir=runs/c", "rollout.max_tokens=64", "data.max_prompt_tokens=32"]
    cfg = load_config(y, ["optim.lr=3e-4", "rollout.n=4", *required])
    assert cfg.optim.lr == 3e-4
    assert cfg.algorithm.name == "dapo"
    assert cfg.rollout.n == 4
    assert load_config(y, ["train.jax_cache_dir=", *required]).train.jax_cache_dir == ""
    # The saved resolved config loads back into an equal Config.
    saved = save_config(cfg, tmp_path / "run")
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optim.lrr=1"], "optim.lrr"),
        (["optim.lr=abc"], "optim.lr"),
        (["algorithm.name=ppo2"], "algorithm.name"),
        (["train.mini_batches=7"], "train.mini_batches"),
        (["calibration.range_lo=1.5"], "calibration.range_lo"),
        (["nonsense"], "nonsense"),
        (["rollout.export_hash=md5"], "rollout.export_hash"),
        (["rollout.max_staleness=2"], r"rollout.max_staleness=2 is not one of \[0, 1\]"),
        (["algorithm.name=gspo", "algorithm.clip=calibrated"], "algorithm.clip"),
        (["algorithm.correction=icepop", "algorithm.correction_lower=3"], "algorithm.correction_"),
        (
            ["algorithm.rejection=token_k9", "algorithm.rejection_threshold=2"],
            "algorithm.rejection",
        ),
        (["algorithm.rejection=token_k1"], "algorithm.rejection"),
        (
            ["algorithm.rejection=seq_max_k2", "algorithm.rejection_threshold=1.0_2.0"],
            "single upper",
        ),
        (["train.max_tokens_per_micro_batch=-1"], "train.max_tokens_per_micro_batch"),
        (["train.length_buckets=0"], "train.length_buckets"),
        # Below one full-length sequence (data.max_prompt_tokens + rollout.max_tokens).
        (["train.max_tokens_per_micro_batch=7"], "train.max_tokens_per_micro_batch=7 cannot"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, overrides)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    y = tmp_path / "bad.yaml"
    y.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*train\.stepz"):
        load_config(y)


def test_shipped_configs_load() -> None:
    ys = sorted((REPO / "configs").glob("*.yaml"))
    assert len(ys) >= 6
    for y in ys:
        assert isinstance(load_config(y, ["model.path=/m", "data.train_file=/d.jsonl"]), Config)
    # The paper configs leave the model and data paths to the user, and say so.
    with pytest.raises(ConfigError, match=r"model\.path.*data\.train_file"):
        load_config(REPO / "configs" / "qwen3_14b_dapo_fp8_block.yaml")


def test_study_config_is_the_scratchpad_task() -> None:
    cfg = load_config(REPO / "configs" / "study_scratchpad.yaml")
    assert (cfg.data.task, cfg.reward.kind, cfg.data.max_digits) == ("scratchpad", "scratchpad", 3)
    assert cfg.rollout.max_tokens >= 33  # the scratchpad and eos fit
    lower_only = load_config(
        REPO / "configs" / "study_scratchpad.yaml", ["calibration.upper_rule=plain"]
    )
    assert lower_only.calibration.upper_rule == "plain"
    with pytest.raises(ConfigError, match="calibration.upper_rule"):
        load_config(None, ["calibration.upper_rule=lower"])


def test_mesh_config_and_batch_split(tmp_path: Path) -> None:
    # An unknown key fails naming the key and the file, from the command line and from a file.
    with pytest.raises(ConfigError, match=r"train\.num_devices"):
        load_config(None, ["train.num_devices=2"])
    old = tmp_path / "old.yaml"
    old.write_text("train:\n  num_devices: 2\n")
    with pytest.raises(ConfigError, match=rf"{old}.*train\.num_devices"):
        load_config(old)
    cfg = load_config(None, ["train.mesh.fsdp=-1", "train.mesh.tensor=2"])
    assert (cfg.train.mesh.data, cfg.train.mesh.fsdp, cfg.train.mesh.tensor) == (1, -1, 2)
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        load_config(None, ["train.mesh.fsdp=-1", "train.mesh.data=-1"])
    with pytest.raises(ConfigError, match=r"train\.mesh\.tensor=0"):
        load_config(None, ["train.mesh.tensor=0"])
    # Mini-batch 16 * 8 / 4 = 32: micro-batches must divide it and split over data x fsdp.
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=12 must divide.*32"):
        load_config(None, ["train.micro_batch_size=12"])
    with pytest.raises(ConfigError, match=r"micro_batch_size 8 must be a multiple of the 16"):
        load_config(None, ["train.micro_batch_size=8", "train.mesh.fsdp=16"])


def test_calibration_defaults_agree_with_the_loss_config_and_the_tiny_run() -> None:
    # One default, chosen by docs/fp8_study.md ("Why the calibrated upper bound swung").
    from losses.calibrated import CalibConfig

    want = CalibConfig()
    for c in (Config().calibration, load_config(REPO / "configs" / "tiny_cpu.yaml").calibration):
        assert (c.mode, c.upper_rule, c.balance) == (want.mode, want.upper_rule, want.balance)
    assert want.mode == "hold"


def test_api_key_is_never_written(tmp_path: Path) -> None:
    """rollout.api_key stays out of <run_dir>/config.yaml (and checkpoints, which hold the same
    YAML): the saved file loads back equal but for the key, which comes from the environment."""
    cfg = load_config(None, ["rollout.backend=http", "rollout.api_key=s3cret-key"])
    saved = save_config(cfg, tmp_path / "run")
    assert "s3cret-key" not in saved.read_text()
    back = load_config(saved)
    assert back.rollout.api_key == "" and cfg.rollout.api_key == "s3cret-key"
    back.rollout.api_key = cfg.rollout.api_key
    assert back == cfg
