"""The embedded engine behind vLLM's routes: a threaded HTTP server (`python -m
rollout_bridge.serve` runs it).

The routes and JSON are those of vLLM 0.32 that `rollout_bridge.client.http_backend.HttpBackend`
uses (docs/rollout.md sections 2 and 3), so the client cannot tell this server from a real vLLM:

  GET  /health                      200, empty body (no token needed, as in vLLM)
  GET  /v1/models                   {"object": "list", "data": [{"id", "max_model_len", ...}]}
  POST /v1/completions              token-id prompts (a list, or a list of lists), n, max_tokens,
                                    temperature, top_p, top_k, seed, logprobs (0),
                                    return_token_ids, return_tokens_as_token_ids,
                                    prompt_logprobs (0), stop_token_ids, ignore_eos,
                                    skip_special_tokens; choices prompt-major (p0 x n, p1 x n..);
                                    extension `jfp8rl_seed_indices` [int] (one per prompt: the
                                    index its samples are seeded with; `client.pool`)
  POST /pause?mode=wait             waits for in-flight generations; new ones wait for /resume
                                    (every mode behaves as "wait")
  POST /resume
  POST /init_weight_transfer_engine {"init_info": {...}}  (recorded; the transport is files)
  POST /start_weight_update
  POST /update_weights              {"update_info": {"path", "version", "manifest_sha256"}}:
                                    `load_export` verifies the manifest, then the engine
                                    installs the weights (`EmbeddedBackend.load_export_dir`)
  POST /finish_weight_update        {"weight_version": str}
  GET  /weight_info                 {"weight_version": str}

Logprobs are those of the distribution actually sampled from (vLLM's `--logprobs-mode
processed_logprobs`; `rollout_bridge.engine.sampling`). Only `logprobs: 0` / `prompt_logprobs: 0`
(the chosen token's own logprob, no alternatives) are served; larger values are refused with
HTTP 400 naming the field. Errors use vLLM's body `{"error": {"message", "type", "code"}}`.
This module is the HTTP server (routes, auth, the pause gate); the JSON bodies are built and
parsed in `openai_format`.

Security: binds 127.0.0.1 unless told otherwise; `--token T` (or env `JFP8RL_SERVE_TOKEN`)
requires `Authorization: Bearer T` on every route but /health; JSON only, never pickle.
"""

from __future__ import annotations

import hmac
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from rollout_bridge.backend import RolloutError
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server import openai_format as oaf
from rollout_bridge.server.openai_format import ApiError

_MAX_BODY = 256 * 2**20


class ServerState:
    """The engine, the served model name, the token, and the pause gate.

    `pause()` closes the gate for new generations and waits until in-flight ones finish (vLLM's
    `mode=wait`); `resume()` reopens it. Weight routes run while the gate is closed.
    """

    def __init__(
        self,
        engine: EmbeddedBackend,
        *,
        model_name: str,
        token: str | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.token = token
        self.tokenizer = tokenizer
        self.init_info: dict[str, Any] | None = None
        self._gate = threading.Condition()
        self._paused = False
        self._in_flight = 0

    def enter(self) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._paused)
            self._in_flight += 1

    def leave(self) -> None:
        with self._gate:
            self._in_flight -= 1
            self._gate.notify_all()

    def pause(self) -> None:
        with self._gate:
            self._paused = True
            self._gate.wait_for(lambda: self._in_flight == 0)

    def resume(self) -> None:
        with self._gate:
            self._paused = False
            self._gate.notify_all()


def completions(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/completions` response for one request (module docstring)."""
    req = oaf.parse_completion_request(body, model_name=state.model_name, tokenizer=state.tokenizer)
    state.enter()
    try:
        results = state.engine.generate(req.prompts, req.sampling, seed_indices=req.seed_indices)
        scored = state.engine.score_with_ranks(req.prompts) if req.want_prompt_logprobs else None
    except RolloutError as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, str(e)) from e
    finally:
        state.leave()
    return oaf.completion_body(
        req, results, scored, model_name=state.model_name, tokenizer=state.tokenizer
    )


def update_weights(state: ServerState, body: dict[str, Any]) -> None:
    """Loads the export folder named by `update_info` (verified by `load_export`)."""
    info = body.get("update_info")
    if not isinstance(info, dict) or not isinstance(info.get("path"), str):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "/update_weights needs {'update_info': {'path': <export dir>, 'version': str, "
            "'manifest_sha256': str}}",
        )
    try:
        state.engine.load_export_dir(
            info["path"], version=info.get("version"), manifest_sha256=info.get("manifest_sha256")
        )
    except (ValueError, OSError) as e:  # ExportError is a ValueError
        raise ApiError(HTTPStatus.BAD_REQUEST, f"update_weights refused {info['path']}: {e}") from e


class Handler(BaseHTTPRequestHandler):
    """Routes requests to `ServerState` (set on the server as `.state`)."""

    protocol_version = "HTTP/1.1"
    server_version = "rollout_bridge.serve"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per error only
        pass

    @property
    def state(self) -> ServerState:
        return self.server.state  # type: ignore[attr-defined]

    def _send(self, status: HTTPStatus, payload: Any = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if payload is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        self._send(status, oaf.error_body(status, message, param))

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        if n > _MAX_BODY:
            self.close_connection = True
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {_MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def _authorized(self, path: str) -> bool:
        token = self.state.token
        if not token or path == "/health":
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            if not self._authorized(path):
                self.close_connection = True  # the unread body must not reach the next request
                raise ApiError(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            body = self._body() if method == "POST" else {}
            route = _ROUTES.get((method, path))
            if route is None:
                raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
            status, payload = route(self.state, body)
            self._send(status, payload)
        except ApiError as e:
            self._error(e.status, str(e), e.param)
        except Exception as e:  # noqa: BLE001 (the server must answer, not die)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")


def _ok(payload: Any = None) -> tuple[HTTPStatus, Any]:
    return HTTPStatus.OK, payload


def _models(state: ServerState, _body: dict[str, Any]) -> tuple[HTTPStatus, Any]:
    return _ok(oaf.models_body(state.model_name, state.engine.max_len))


def _finish(state: ServerState, body: dict[str, Any]) -> tuple[HTTPStatus, Any]:
    version = body.get("weight_version")
    if version is not None:
        state.engine.set_weight_version(str(version))
    return _ok()


def _init_transfer(state: ServerState, body: dict[str, Any]) -> tuple[HTTPStatus, Any]:
    state.init_info = dict(body.get("init_info") or {})
    return _ok()


_ROUTES = {
    ("GET", "/health"): lambda s, b: _ok(None) if s.engine.health() else (503, None),
    ("GET", "/v1/models"): _models,
    ("POST", "/v1/completions"): lambda s, b: _ok(completions(s, b)),
    ("POST", "/pause"): lambda s, b: (s.pause(), _ok())[1],
    ("POST", "/resume"): lambda s, b: (s.resume(), _ok())[1],
    ("POST", "/init_weight_transfer_engine"): _init_transfer,
    ("POST", "/start_weight_update"): lambda s, b: _ok(),
    ("POST", "/update_weights"): lambda s, b: (update_weights(s, b), _ok())[1],
    ("POST", "/finish_weight_update"): _finish,
    ("GET", "/weight_info"): lambda s, b: _ok({"weight_version": s.engine.weight_version()}),
}


def make_server(state: ServerState, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A threaded HTTP server for `state` (port 0 picks a free port: `server.server_port`).
    Run it with `serve_forever()`; stop it with `shutdown()` then `server_close()`."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.state = state  # type: ignore[attr-defined]
    return server
