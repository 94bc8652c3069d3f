"""`HttpBackend` error handling and `ClientSettings` checks, without vLLM.

The happy path runs against a real vLLM in tests/rollout_bridge/test_vllm_plugin.py. A real
server cannot be made to answer with an aborted request, a -9999 clamp, a NaN or a transient
503 on demand, so those paths use a stdlib HTTP server (`bridge_support.FakeServer`) that
replays canned vLLM-shaped JSON and records what the client sent.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bridge_support import Answer, FakeServer

from rollout_bridge.backend import RolloutError, SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.weights.reader import load_export


class Canned(FakeServer):
    """Per-route queues of (status, body) answers, each used once, before the healthy default."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[int, Any]]] = {}
        super().__init__(version="default", model={"id": "tiny", "max_model_len": 256})

    def reply(self, path: str, status: int, body: Any) -> None:
        self.answers.setdefault(path, []).append((status, body))

    def answer(self, route: str, body: Any) -> Answer:
        queue = self.answers.get(route)
        return queue.pop(0) if queue else super().answer(route, body)


@pytest.fixture
def canned() -> Iterator[tuple[Canned, str]]:
    state = Canned()
    try:
        yield state, state.url
    finally:
        state.close()


def _choice(index: int, ids: list[int], lps: list[float], reason: str = "length") -> dict:
    return {
        "index": index,
        "finish_reason": reason,
        "token_ids": ids,
        "prompt_token_ids": [1, 2],
        "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids]},
    }


def test_down_server_names_url_and_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HttpBackend(f"http://127.0.0.1:{port}", ClientSettings(max_retries=2, backoff_s=0.01))
    assert not client.health()
    with pytest.raises(RolloutError) as err:
        client.generate([[1, 2]], SamplingParams())
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}" in msg and "connection refused" in msg
    assert "after 3 attempt(s)" in msg and "vllm serve" in msg and "rollout_bridge.serve" in msg


def test_request_fields_token_and_parsing(canned: tuple[Canned, str]) -> None:
    state, url = canned
    state.reply(
        "/v1/completions",
        200,
        {"choices": [_choice(1, [5], [-0.5], "stop"), _choice(0, [3, 4], [-1.0, -2.0])]},
    )
    client = HttpBackend(url, ClientSettings(api_key="s3cret"))
    comps = client.generate([[1, 2]], SamplingParams(n=2, max_tokens=2, seed=7, top_k=0))
    assert [c.response_ids.tolist() for c in comps] == [[3, 4], [5]]  # reordered by index
    np.testing.assert_array_equal(comps[0].logprobs, np.float32([-1.0, -2.0]))
    assert [c.finish_reason for c in comps] == ["length", "stop"]
    assert {c.weight_version for c in comps} == {"default"}
    (_, _, headers, body) = next(e for e in state.log if e[1] == "/v1/completions")
    assert headers["Authorization"] == "Bearer s3cret"
    assert body == {
        "model": "tiny",
        "prompt": [[1, 2]],
        "n": 2,
        "max_tokens": 2,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 7,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": False,
        "stop_token_ids": [],
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    state.reply(
        "/v1/completions",
        200,
        {"choices": [{"index": 0, "prompt_logprobs": [None, {"2": {"logprob": -0.25}}]}]},
    )
    np.testing.assert_array_equal(client.score([[1, 2]])[0], np.float32([0.0, -0.25]))


@pytest.mark.parametrize(
    ("choices", "match"),
    [
        ([_choice(0, [3], [-1.0], "abort")], "finish_reason 'abort'"),
        ([_choice(0, [3, 4], [-1.0])], "2 token ids but 1 logprobs"),
        ([_choice(0, [3], [-9999.0])], "clamped at -9999"),
        ([_choice(0, [3], [float("nan")])], "NaN logprob"),
        ([_choice(0, [3], [-1.0]), _choice(1, [3], [-1.0])], "expected 1 choices, got 2"),
    ],
)
def test_malformed_responses_are_errors(
    canned: tuple[Canned, str], choices: list[dict], match: str
) -> None:
    state, url = canned
    state.reply("/v1/completions", 200, {"choices": choices})
    with pytest.raises(RolloutError, match=match):
        HttpBackend(url).generate([[1, 2]], SamplingParams())


def test_transient_errors_are_retried_then_reported(canned: tuple[Canned, str]) -> None:
    state, url = canned
    state.reply("/v1/completions", 503, {"error": "busy"})
    state.reply("/v1/completions", 200, {"choices": [_choice(0, [3], [-1.0])]})
    client = HttpBackend(url, ClientSettings(max_retries=2, backoff_s=0.01))
    assert client.generate([[1, 2]], SamplingParams())[0].response_ids.tolist() == [3]
    for _ in range(3):
        state.reply("/v1/completions", 503, {"error": "busy"})
    with pytest.raises(RolloutError, match=r"failed .*HTTP 503.* after 3 attempt\(s\)"):
        client.generate([[1, 2]], SamplingParams())
    state.reply("/v1/completions", 400, {"error": "prompt too long"})
    with pytest.raises(RolloutError, match="HTTP 400.*prompt too long"):
        client.generate([[1, 2]], SamplingParams())


def test_push_sequence_and_resume_after_failure(canned: tuple[Canned, str], tmp_path: Path) -> None:
    state, url = canned
    client = HttpBackend(url, ClientSettings(export_format="fp32", export_root=tmp_path))
    w = {"model.norm.weight": np.arange(4, dtype=np.float32)}
    client.push_weights(w, "step-1")
    routes = [(m, p) for m, p, _, _ in state.log]
    assert routes == [
        ("POST", "/pause?mode=wait"),
        ("POST", "/init_weight_transfer_engine"),
        ("POST", "/start_weight_update"),
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
        ("POST", "/resume"),
        ("GET", "/weight_info"),
    ]
    info = state.log[3][3]["update_info"]
    tensors, manifest = load_export(
        info["path"], expected_version="step-1", expected_manifest_sha256=info["manifest_sha256"]
    )
    np.testing.assert_array_equal(tensors["model.norm.weight"], w["model.norm.weight"])
    assert state.log[1][3] == {"init_info": {"root": str(tmp_path.resolve())}}
    assert client.weight_version() == "step-1"
    # A refused update: no finish, but the server is resumed; init is not repeated.
    state.log.clear()
    state.reply("/update_weights", 500, {"error": "sha256 mismatch"})
    with pytest.raises(RolloutError, match="update_weights failed: HTTP 500"):
        client.push_weights(w, "step-2")
    assert [p for _, p, _, _ in state.log] == [
        "/pause?mode=wait",
        "/start_weight_update",
        "/update_weights",
        "/resume",
    ]
    assert client.weight_version() == "step-1"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("export_format", "fp16", r"export_format='fp16'; choose one of \('fp32'"),
        ("export_hash", "md5", r"export_hash='md5'; choose one of \('xxh3_128'"),
        ("keep_versions", 0, "keep_versions=0; keep at least the served version"),
        ("timeout_s", 0.0, "timeout_s=0.0 must be > 0"),
        ("max_retries", -1, "max_retries=-1, backoff_s=0.5: both must be >= 0"),
    ],
)
def test_settings_are_checked_at_construction(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClientSettings(**{field: value})
    assert ClientSettings(export_root="/x").export_root == Path("/x")
