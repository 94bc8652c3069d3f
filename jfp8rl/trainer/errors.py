"""How a run stops early: `RunStopped` and the resume command its message names;
`CheckpointDamaged`, a checkpoint that fails its digest manifest check."""

from __future__ import annotations

from pathlib import Path

from jfp8rl.config import Config


class RunStopped(RuntimeError):
    """The run stopped early with its last checkpoint intact; the message says how to resume."""


class CheckpointDamaged(RuntimeError):
    """A run folder holds no intact checkpoint to resume from, or the checkpoint asked for
    is damaged; the message names each checkpoint, its damaged file and what is wrong."""


def resume_hint(cfg: Config) -> str:
    return f"python -m jfp8rl.train --config {Path(cfg.run_dir) / 'config.yaml'} --resume"
