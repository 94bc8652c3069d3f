"""How a run stops early: `RunStopped` and the resume command its message names."""

from __future__ import annotations

from pathlib import Path

from jfp8rl.config import Config


class RunStopped(RuntimeError):
    """The run stopped early with its last checkpoint intact; the message says how to resume."""


def resume_hint(cfg: Config) -> str:
    return f"python -m jfp8rl.train --config {Path(cfg.run_dir) / 'config.yaml'} --resume"
