"""Typed run configuration: dataclasses -> OmegaConf structured config -> YAML + dotted overrides.

`load_config(yaml_path, overrides)` merges, in order, the dataclass defaults, the YAML file and
command-line overrides (`optim.lr=3e-4 algorithm.name=dapo`). OmegaConf checks every key and
type against the dataclasses; an unknown key or a wrong type raises `ConfigError` naming the
full key (e.g. `optim.lrr`) and the file it came from; so does a malformed override, and a
NaN in a float field. Field values are then checked by each dataclass's `__post_init__`. The
resolved config is written to `<run_dir>/config.yaml` by `save_config`, and that file loads
back into an equal `Config`, but for `rollout.api_key`, which is never written (`to_yaml`; a
key belongs in the environment, `JFP8RL_ROLLOUT_API_KEY`).

Sections (one dataclass each): model, warmstart, data, rollout, reward, algorithm,
calibration, train, optim, checkpoint, eval, logging. Hyperparameter names follow verl where one
exists (`eps_low`/`eps_high` = verl's `clip_ratio_low`/`clip_ratio_high`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jfp8rl.config.checks import ConfigError
from jfp8rl.config.run import Config
from jfp8rl.config.sections import PRESET_KEYS


def _describe(err: OmegaConfBaseException) -> str:
    """OmegaConf's message without its multi-line context, plus the full key."""
    key = getattr(err, "full_key", None)
    msg = str(err).split("\n")[0]
    return f"key {key!r}: {msg}" if key else msg


# Keys whose right value depends on the model and the task: a config file (or an override)
# must set them, no default stands in (configs/tiny_cpu.yaml holds the tiny policy's values).
REQUIRED_KEYS = ("run_dir", "optim.lr", "rollout.max_tokens", "data.max_prompt_tokens")


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults <- YAML file `path` <- dotted `overrides`; returns a validated `Config`.

    `algorithm.name` selects its preset (`jfp8rl.config.sections.algorithm_preset`) for the
    `algorithm.*` keys that neither the file nor an override sets. With a file, `REQUIRED_KEYS`
    must be set by it or an override (without one, the dataclass defaults stand). Raises `ConfigError` naming the key (and file) for unknown keys, wrong
    types, bad values, a missing file or a malformed override.
    """
    if path is None:  # the dataclass defaults (tests), no key required
        return resolve_config(OmegaConf.create(), "config", overrides, required=())
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found (pass --config configs/<name>.yaml)")
    try:
        from_file = OmegaConf.load(p)
    except Exception as e:  # yaml.YAMLError and friends: name the file
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    return resolve_config(from_file, str(p), overrides)


def config_from_yaml(text: str, where: str) -> Config:
    """The `Config` a resolved YAML text (`to_yaml`, e.g. a checkpoint's) describes; errors
    name `where`."""
    try:
        conf = OmegaConf.create(yaml.safe_load(text) or {})
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    return resolve_config(conf, where, ())


def resolve_config(
    from_file: Any,
    where: str,
    overrides: list[str] | tuple[str, ...],
    required: tuple[str, ...] = REQUIRED_KEYS,
) -> Config:
    """Defaults <- `from_file` (an OmegaConf node read from `where`) <- `overrides`; the keys
    `required` must be set by one of them."""
    base = OmegaConf.structured(Config)
    given = OmegaConf.create()  # what the file and the overrides set, untyped
    file_missing = set(OmegaConf.missing_keys(from_file))
    try:
        base = OmegaConf.merge(base, from_file)
        given = OmegaConf.merge(given, from_file)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_describe(e)}") from e
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
    base, given = _apply_overrides(base, given, overrides)
    # OmegaConf's merge keeps the default where the file says ??? (mandatory), so the
    # file's mandatory keys are checked against what the overrides set.
    set_by_overrides = {item.split("=", 1)[0] for item in overrides}
    unset = {k for k in required if OmegaConf.select(given, k, default=None) is None}
    missing = sorted({k for k in file_missing if k not in set_by_overrides} | unset)
    if missing:
        raise ConfigError(
            f"{where}: no value for {', '.join(missing)} (its value depends on the model and "
            "task); set " + " ".join(f"{k}=..." for k in missing) + " in the config file or "
            "on the command line"
        )
    # The algorithm's preset fills what the file and the overrides leave unset.
    for key in PRESET_KEYS:
        if OmegaConf.select(given, f"algorithm.{key}", default=None) is None:
            base.algorithm[key] = None
    try:
        cfg = OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from e
    assert isinstance(cfg, Config)
    nan = _nan_keys(cfg)
    if nan:
        raise ConfigError(f"{nan[0]}=nan: not a number ({where} or an override)")
    return cfg


def _apply_overrides(base: Any, given: Any, overrides: list[str] | tuple[str, ...]) -> Any:
    """`base` and `given` with the dotted `overrides` merged in, in order (a later one wins).
    All in one merge; when that fails, one at a time, so that the error names its override.
    `key=` means the empty string (OmegaConf would read it as null)."""
    dots = [item + "''" if item.endswith("=") else item for item in overrides]
    if not dots:
        return base, given
    try:
        one = OmegaConf.from_dotlist(dots)
        merged = OmegaConf.merge(base, one), OmegaConf.merge(given, one)
        for item in overrides:
            if "${" in item:  # resolve it now: a failing interpolation names its override
                OmegaConf.select(merged[0], item.split("=", 1)[0])
        return merged
    except (OmegaConfBaseException, TypeError, yaml.YAMLError):
        pass
    for item, dot in zip(overrides, dots, strict=True):
        try:
            one = OmegaConf.from_dotlist([dot])
            base = OmegaConf.merge(base, one)
            given = OmegaConf.merge(given, one)
            if "${" in item:
                OmegaConf.select(base, item.split("=", 1)[0])
        except (OmegaConfBaseException, TypeError) as e:  # TypeError: list <- dict merges
            raise ConfigError(f"command-line override {item!r}: {_describe(e)}") from e
        except yaml.YAMLError as e:  # OmegaConf parses each override's value as YAML
            why = " ".join(str(e).split())
            raise ConfigError(
                f"command-line override {item!r}: its value is not valid YAML ({why}); quote "
                "it, e.g. 'data.prompt_template=\"{prompt} ...\"' (braces and colons need quotes)"
            ) from e
    return base, given


def _nan_keys(section: Any, prefix: str = "") -> list[str]:
    """The dotted keys of the float fields that are NaN (a value no check compares false)."""
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out += _nan_keys(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and math.isnan(value):
            out.append(f"{prefix}{f.name}")
    return out


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (loads back with `load_config`), with `rollout.api_key`
    written empty: the run folder and its checkpoints are copied and shared, keys must not be
    (a run that needs one reads it from $JFP8RL_ROLLOUT_API_KEY, or from the override again)."""
    conf = OmegaConf.structured(cfg)
    conf.rollout.api_key = ""
    return OmegaConf.to_yaml(conf)


def save_config(cfg: Config, run_dir: str | Path) -> Path:
    """Writes `<run_dir>/config.yaml` and returns its path."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(cfg))
    return out
