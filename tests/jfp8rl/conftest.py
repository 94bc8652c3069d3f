"""Shared fixtures of the trainer tests: one warm-started base policy and one finished tiny run
for the whole session.

Under pytest-xdist the workers share one cache folder (beside their own temporary folders) and
take a file lock to build each: one worker trains it while the other waits, instead of both
training the same thing side by side on the same cores.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from filelock import FileLock
from tiny_run import TINY, small


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    if worker_id == "master":
        return tmp_path_factory.mktemp("base_policies")
    shared = tmp_path_factory.getbasetemp().parent / "base_policies"  # one per xdist session
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def base_policy_dir(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF folder of the (briefly) warm-started tiny base policy."""
    from jfp8rl.config import load_config
    from jfp8rl.trainer.policy import load_policy

    cfg = load_config(TINY, small(tmp_path_factory.mktemp("unused"), cache_dir))
    with FileLock(str(cache_dir / "build.lock")):
        return load_policy(cfg, log=lambda msg: None).path


@pytest.fixture(scope="session")
def tiny_full_run(cache_dir: Path) -> Path:
    """The run folder of `small()`'s tiny run (4 steps, checkpoints 2 and 4 kept, `hf_final`),
    trained once per session for every test that reads it. Read-only: a test that changes a run
    works on a copy."""
    from jfp8rl.config import load_config
    from jfp8rl.trainer.loop import run

    run_dir, done = cache_dir.parent / "tiny_full_run", cache_dir.parent / "tiny_full_run.done"
    with FileLock(str(cache_dir.parent / "tiny_full_run.lock")):
        if not done.is_file():
            shutil.rmtree(run_dir, ignore_errors=True)
            run(load_config(TINY, small(run_dir, cache_dir)))
            done.touch()
    return run_dir
