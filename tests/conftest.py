"""Fixtures shared by every test package: the real-vLLM venv and the transformers reference.

Both live in the vLLM venv (`scripts/setup_vllm_env.sh`, Python 3.11 with torch 2.13 cpu and
transformers; the project venv has no torch). Tests that need it never skip silently: they skip
only when `JFP8RL_SKIP_VLLM=1` is set, and otherwise build the venv (cached) or fail loudly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "rollout_bridge"))
sys.path.insert(0, str(TESTS / "reference"))


def skip_vllm() -> bool:
    return os.environ.get("JFP8RL_SKIP_VLLM") == "1"


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv, built or refreshed by scripts/setup_vllm_env.sh."""
    if skip_vllm():
        pytest.skip("JFP8RL_SKIP_VLLM=1: real-vLLM / transformers tests disabled")
    from bridge_support import ensure_vllm_env

    return ensure_vllm_env()


@pytest.fixture(scope="session")
def transformers_ref(vllm_venv: Path) -> Callable[..., tuple[dict, dict]]:
    """`transformers_ref(kind, arrays=..., **fields) -> (meta, arrays)`: a job of
    tests/reference/transformers_ref.py run in the vLLM venv (see tests/reference/client.py)."""
    from client import run_reference

    return run_reference
