"""`rollout_bridge.vllm_auth.RequireApiKey` driven as vLLM's ASGI app drives it (no server): the
key on every path but /health, vLLM's 401 body, OPTIONS and lifespan passed through. The real
vLLM with it loaded: `server/test_vllm_parity.py`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollout_bridge.vllm_auth import ENV, RequireApiKey


def _run(scope: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
    """(whether the wrapped app was called, the messages the middleware sent itself)."""
    called, sent = [], []

    async def app(scope, receive, send):
        called.append(scope["type"])

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(RequireApiKey(app)(scope, receive, send))
    return bool(called), sent


def _http(path: str, auth: bytes | None = None, method: str = "POST") -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if auth is not None:
        headers.append((b"authorization", auth))
    return {"type": "http", "method": method, "path": path, "headers": headers}


def test_key_on_every_route_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "k3y")
    for path in ("/pause", "/update_weights", "/weight_info", "/collective_rpc", "/v1/models"):
        for auth in (None, b"Bearer wrong", b"Basic k3y", b"Bearer k3y ", b"k3y"):
            called, sent = _run(_http(path, auth))
            assert not called and sent[0]["status"] == 401, (path, auth)
            assert json.loads(sent[1]["body"]) == {"error": "Unauthorized"}
        for auth in (b"Bearer k3y", b"bearer k3y", b"BEARER k3y"):
            assert _run(_http(path, auth)) == (True, [])
    assert _run(_http("/health", None, "GET")) == (True, [])
    assert _run(_http("/pause", None, "OPTIONS")) == (True, [])  # CORS pre-flight
    assert _run({"type": "lifespan"}) == (True, [])
    called, sent = _run({"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert not called and sent == [{"type": "websocket.close", "code": 1008}]


def test_refuses_to_start_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        RequireApiKey(lambda *a: None)
