"""Shared fixtures of the trainer tests: one warm-started base policy for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_run import TINY, small


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("base_policies")


@pytest.fixture(scope="session")
def base_policy_dir(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF folder of the (briefly) warm-started tiny base policy."""
    from jfp8rl.config import load_config
    from jfp8rl.trainer.policy import load_policy

    cfg = load_config(TINY, small(tmp_path_factory.mktemp("unused"), cache_dir))
    return load_policy(cfg, log=lambda msg: None).path
