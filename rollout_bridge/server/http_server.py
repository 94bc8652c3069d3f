"""The embedded engine behind vLLM's routes: a threaded HTTP server (`python -m
rollout_bridge.serve` runs it).

The routes and JSON are those of vLLM 0.32 that `rollout_bridge.client.http_backend.HttpBackend`
uses (docs/rollout.md sections 2 and 3), so the client cannot tell this server from a real vLLM:

  GET  /health                      200, empty body (no key needed, as in vLLM)
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
HTTP 400 naming the field. Errors use vLLM's body `{"error": {"message", "type", "param",
"code"}}`, with vLLM's messages for its admission rules; what a request may ask and how much
the server holds at once: `limits`. This module is the HTTP server (routes, keys, the pause
gate, admission); the JSON bodies are built and parsed in `openai_format`.

Keys: binds 127.0.0.1 unless told otherwise. With API keys (`--api-key`, or env VLLM_API_KEY,
as vLLM) every route but /health needs `Authorization: Bearer <key>` (scheme in any case, as
vLLM), answered otherwise with vLLM's 401 body `{"error": "Unauthorized"}`. Unlike vLLM, whose
key guards only /v1/..., the weight routes (pause, update_weights, which reads a folder named
by the request, ...) and /weight_info are guarded too (docs/cluster.md). JSON only, never
pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from rollout_bridge.backend import Completion, RolloutError
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server import openai_format as oaf
from rollout_bridge.server.limits import (
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    SOCKET_TIMEOUT_S,
    Admission,
    ServerLimits,
    max_tokens_per_prompt,
)
from rollout_bridge.server.openai_format import ApiError, CompletionRequest


class ServerState:
    """The engine, the served model name, the API keys, the pause gate and the admission.

    `pause()` closes the gate for new generations and waits until in-flight ones finish (vLLM's
    `mode=wait`); `resume()` reopens it. Weight routes run while the gate is closed.
    `limits` default: the engine's max_len and `limits.DEFAULT_MAX_PENDING_SEQS`.
    """

    def __init__(
        self,
        engine: EmbeddedBackend,
        *,
        model_name: str,
        api_keys: Sequence[str] = (),
        tokenizer: Any = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # sha256 of each key, compared in constant time (as vLLM's AuthenticationMiddleware)
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in api_keys if k]
        self.tokenizer = tokenizer
        self.limits = limits or ServerLimits(max_model_len=engine.max_len)
        self.admission = Admission(self.limits.max_pending_seqs)
        self.init_info: dict[str, Any] | None = None
        self._gate = threading.Condition()
        self._paused = False
        self._in_flight = 0

    def authorized(self, header: str) -> bool:
        """True for no keys, or an `Authorization` header "Bearer <one of the keys>"."""
        if not self.key_digests:
            return True
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = hashlib.sha256(key.encode()).digest()
        match = False
        for digest in self.key_digests:
            match |= hmac.compare_digest(got, digest)
        return match

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


def _generate(
    state: ServerState, req: CompletionRequest, max_tokens: list[int]
) -> list[Completion]:
    """The engine's completions, prompt-major, with each prompt's own `max_tokens` (prompts
    sharing one go in one engine call; a prompt keeps its seed index, so lowering its
    max_tokens only truncates its samples)."""
    seed_idx = req.seed_indices or list(range(len(req.prompts)))
    groups: dict[int, list[int]] = {}
    for i, m in enumerate(max_tokens):
        groups.setdefault(m, []).append(i)
    per_prompt: dict[int, list[Completion]] = {}
    for m, idx in groups.items():
        out = state.engine.generate(
            [req.prompts[i] for i in idx],
            dataclasses.replace(req.sampling, max_tokens=m),
            seed_indices=[seed_idx[i] for i in idx],
        )
        for c in out:
            i = idx[c.prompt_index]
            per_prompt.setdefault(i, []).append(dataclasses.replace(c, prompt_index=i))
    return [c for i in range(len(req.prompts)) for c in per_prompt[i]]


def completions(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/completions` response for one request (module docstring): checked against the
    limits, then it waits until its sequences fit (`limits.Admission`) and the gate is open."""
    req = oaf.parse_completion_request(body, model_name=state.model_name, tokenizer=state.tokenizer)
    sp = req.sampling
    max_tokens = max_tokens_per_prompt(req.prompts, sp.n, sp.max_tokens, state.limits)
    seqs = len(req.prompts) * sp.n
    state.admission.acquire(seqs)
    try:
        state.enter()
        try:
            results = _generate(state, req, max_tokens)
            scored = (
                state.engine.score_with_ranks(req.prompts) if req.want_prompt_logprobs else None
            )
        finally:
            state.leave()
    except RolloutError as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, str(e)) from e
    finally:
        state.admission.release(seqs)
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
    except (ValueError, OSError, TypeError) as e:  # ExportError is a ValueError
        raise ApiError(HTTPStatus.BAD_REQUEST, f"update_weights refused {info['path']}: {e}") from e


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class Handler(BaseHTTPRequestHandler):
    """Routes requests to `ServerState` (set on the server as `.state`)."""

    protocol_version = "HTTP/1.1"
    server_version = "rollout_bridge.serve"
    timeout = SOCKET_TIMEOUT_S  # a client stalled mid-request is disconnected

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per error only
        pass

    @property
    def state(self) -> ServerState:
        return self.server.state  # type: ignore[attr-defined]

    def handle(self) -> None:
        """One connection; at most `MAX_CONNECTIONS` hold a slot, the others are answered 503."""
        slots: threading.BoundedSemaphore = self.server.slots  # type: ignore[attr-defined]
        self.busy = not slots.acquire(blocking=False)
        try:
            super().handle()
        finally:
            if not self.busy:
                slots.release()

    def _send(self, status: HTTPStatus, payload: Any = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if payload is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line, headers too long, an unknown
        method) as JSON, like every other answer; an unknown method is a 405, as vLLM's."""
        self.close_connection = True
        status = HTTPStatus(code)
        if status == HTTPStatus.NOT_IMPLEMENTED:
            status = HTTPStatus.METHOD_NOT_ALLOWED
        self._send(status, oaf.error_body(status, message or status.phrase))

    def do_HEAD(self) -> None:  # noqa: N802 (no body may follow a HEAD answer)
        self.close_connection = True
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body(self) -> dict[str, Any]:
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length, not chunked")
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            self.close_connection = True
            raise ApiError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length[:20]!r}")
        n = int(length)
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {n} bytes is over {MAX_BODY_BYTES}; split the request",
            )
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            self.close_connection = True
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body ended after {len(raw)} of {n} bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw, parse_constant=_json_constant)
        except (ValueError, RecursionError) as e:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            if self.busy:
                self.close_connection = True
                raise ApiError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    f"server busy: {MAX_CONNECTIONS} connections in progress; retry later",
                )
            if path != "/health" and not self.state.authorized(
                self.headers.get("Authorization", "")
            ):
                self.close_connection = True  # the unread body must not reach the next request
                self._send(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})  # vLLM's body
                return
            body = self._body() if method == "POST" else {}
            route = _ROUTES.get((method, path))
            if route is None:
                known = any(p == path for _, p in _ROUTES)
                raise ApiError(
                    HTTPStatus.METHOD_NOT_ALLOWED if known else HTTPStatus.NOT_FOUND,
                    f"no route {method} {path}",
                )
            status, payload = route(self.state, body)
            self._send(status, payload)
        except ApiError as e:
            self._error(e.status, str(e), e.param)
        except TimeoutError:
            self.close_connection = True  # the client stalled; nobody to answer
        except Exception as e:  # noqa: BLE001 (the server must answer, not die)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def _error(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        self._send(status, oaf.error_body(status, message, param))

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")


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
    info = body.get("init_info")
    if info is not None and not isinstance(info, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'init_info' must be a JSON object")
    state.init_info = dict(info or {})
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default is 5)


def make_server(state: ServerState, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A threaded HTTP server for `state` (port 0 picks a free port: `server.server_port`).
    Run it with `serve_forever()`; stop it with `shutdown()` then `server_close()`."""
    server = _Server((host, port), Handler)
    server.state = state  # type: ignore[attr-defined]
    server.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # type: ignore[attr-defined]
    return server
