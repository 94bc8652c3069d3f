"""Fixtures for the rollout-bridge tests.

`vllm_venv` (session scope) makes the real-vLLM tests self-contained on a bare machine: it runs
`scripts/setup_vllm_env.sh` (idempotent and cached: ~10 s when the venv exists, several minutes
the first time) and fails loudly if that fails. Tests marked `vllm` never skip silently: they
skip only when `JFP8RL_SKIP_VLLM=1` is set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_server import ensure_vllm_env  # noqa: E402


def skip_vllm() -> bool:
    return os.environ.get("JFP8RL_SKIP_VLLM") == "1"


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv, built or refreshed by scripts/setup_vllm_env.sh."""
    if skip_vllm():
        pytest.skip("JFP8RL_SKIP_VLLM=1: real-vLLM tests disabled")
    return ensure_vllm_env()
