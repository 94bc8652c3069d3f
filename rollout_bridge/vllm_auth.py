"""`RequireApiKey`: the API key on every route of a vLLM server, the weight routes included.

vLLM's `--api-key` (or env VLLM_API_KEY) guards only the paths under /v1, /v2, /inference and
/cohere (vLLM 0.32, `vllm.entrypoints.serve.middleware.authenticate`). The routes our weight
sync uses (docs/rollout.md section 3: /pause, /resume, /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /weight_info) and the rest of
`VLLM_SERVER_DEV_MODE=1` (/collective_rpc, /reset_prefix_cache, ...) answer anyone who reaches
the port (measured). Load this middleware into vLLM to require the key there too:

    VLLM_API_KEY=<key> VLLM_SERVER_DEV_MODE=1 vllm serve <model> ... \
        --middleware rollout_bridge.vllm_auth.RequireApiKey

It checks `Authorization: Bearer <key>` as vLLM's own middleware does (scheme in any case,
sha256 digests compared in constant time) on every path but /health and on every method but
OPTIONS, and answers vLLM's 401 `{"error": "Unauthorized"}`. The key comes from VLLM_API_KEY
(vLLM passes a middleware no arguments); without it the server refuses to start. A pure ASGI
class: no jax, no starlette import (it runs in vLLM's venv).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

ENV = "VLLM_API_KEY"
OPEN_PATHS = ("/health",)  # polled by launchers and load balancers, as vLLM leaves it open
_UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequireApiKey:
    """ASGI middleware: `Authorization: Bearer $VLLM_API_KEY` on every route (module
    docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = os.environ.get(ENV, "")
        if not key:
            raise RuntimeError(
                f"rollout_bridge.vllm_auth.RequireApiKey: set {ENV}=<key> in the server's "
                "environment (vLLM's --api-key is not passed to middlewares)"
            )
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, key = value.decode("latin-1").partition(" ")
        got = hashlib.sha256(key.encode("latin-1")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(got, self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.authorized(scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
