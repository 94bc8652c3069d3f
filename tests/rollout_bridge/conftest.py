"""The rollout bridge's shared real vLLM: one server of the tiny model for the session.

`tiny_vllm` serves `tiny_qwen2_vllm` (`init_model` seed 0, byte tokenizer; vLLM's CPU attention
refuses the tiny presets' head_dim 16) and requires the key `TINY_VLLM_KEY` on every route but
/health (VLLM_API_KEY with our middleware `rollout_bridge.vllm_auth.RequireApiKey`). The parity tests need it as it started; the client tests
push other weights into it and their last test kills it, so tests marked `tiny_vllm_last` run
after every other user of the fixture. It is launched when the package's first test starts, so
that its start-up (one busy thread) runs beside the in-process tests before its users.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bridge_support import TINY_VLLM_KEY, VllmServer

from models.config import get_config
from models.functional import init_model
from models.hf_io import save_hf
from models.tokenizer import build_byte_tokenizer

MARK = "tiny_vllm_last"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}: changes or kills the shared tiny vLLM; runs after its other users"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [i for i, item in enumerate(items) if item.get_closest_marker(MARK)]
    if not last:
        return
    early = {
        i
        for i, item in enumerate(items)
        if i > last[0] and "tiny_vllm" in getattr(item, "fixturenames", ())
        and not item.get_closest_marker(MARK)
    }  # fmt: skip
    moved = [items[i] for i in sorted(early)]
    kept = [item for i, item in enumerate(items) if i not in early]
    cut = kept.index(items[last[0]])
    items[:] = kept[:cut] + moved + kept[cut:]


@pytest.fixture(scope="session")
def tiny_vllm(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The launched server (module docstring); its users call `wait_healthy()`."""
    cfg = get_config("tiny_qwen2_vllm")
    _, params = init_model(cfg, 0)
    model_dir = save_hf(tmp_path_factory.mktemp("tiny_vllm"), cfg, params, build_byte_tokenizer())
    server = VllmServer(
        model_dir,
        venv=vllm_venv,
        extra_args=("--middleware", "rollout_bridge.vllm_auth.RequireApiKey"),
        env={"VLLM_API_KEY": TINY_VLLM_KEY},
    ).launch()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package", autouse=True)
def _launch_tiny_vllm_early(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker cannot tell whether it will run the server's users: they start it
    wanted = any("tiny_vllm" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if wanted and os.environ.get("JFP8RL_SKIP_VLLM") != "1":
        try:
            request.getfixturevalue("tiny_vllm")
        except Exception:  # noqa: BLE001 (pytest raises it again in the tests that use it)
            pass
