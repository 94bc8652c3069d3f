"""Typed run configuration: one dataclass per section, loaded from YAML plus dotted overrides.

`load_config("configs/tiny_cpu.yaml", ["optim.lr=3e-4"])` returns a validated `Config`; every
error is a `ConfigError` naming the key and the file (`loading`). The sections and the meaning
of every field are in `sections` (`algorithm.name` selects the preset of the `algorithm.*` keys
left unset: `sections.algorithm_preset`); which keys may change when a run folder is resumed
is in `compare`.
"""

from jfp8rl.config.checks import ConfigError
from jfp8rl.config.loading import load_config, save_config, to_yaml
from jfp8rl.config.rollout import RolloutConfig
from jfp8rl.config.run import Config, check_batch_split
from jfp8rl.config.sections import (
    AlgorithmConfig,
    CalibrationConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    MeshConfig,
    OptimConfig,
    PolicyConfig,
    RewardConfig,
    TrainConfig,
    WarmStartConfig,
)

__all__ = [
    "AlgorithmConfig",
    "CalibrationConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "MeshConfig",
    "OptimConfig",
    "PolicyConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "WarmStartConfig",
    "check_batch_split",
    "load_config",
    "save_config",
    "to_yaml",
]
