"""The decoder's configuration: `architecture` (the `ModelConfig` dataclass and its HF
config.json translation) and `presets` (named architectures). Both are re-exported here:
`from models.config import ModelConfig, PRESETS, get_config`."""

from models.config.architecture import (
    ATTENTION_CHOICES,
    HF_ARCHITECTURES,
    REMAT_CHOICES,
    Arch,
    AttentionImpl,
    ModelConfig,
    RematPolicy,
)
from models.config.presets import PRESETS, get_config

__all__ = [
    "ATTENTION_CHOICES",
    "HF_ARCHITECTURES",
    "PRESETS",
    "REMAT_CHOICES",
    "Arch",
    "AttentionImpl",
    "ModelConfig",
    "RematPolicy",
    "get_config",
]
