"""`python -m rollout_bridge.serve --model <hf_dir>`: the embedded engine behind vLLM's routes.

The routes and JSON are those of vLLM 0.32 that `rollout_bridge.http_client.HttpBackend` uses
(ROLLOUT.md sections 2 and 3), so the client cannot tell this server from a real vLLM:

  GET  /health                      200, empty body (no token needed, as in vLLM)
  GET  /v1/models                   {"object": "list", "data": [{"id", "max_model_len", ...}]}
  POST /v1/completions              token-id prompts (a list, or a list of lists), n, max_tokens,
                                    temperature, top_p, top_k, seed, logprobs (0),
                                    return_token_ids, return_tokens_as_token_ids,
                                    prompt_logprobs (0), stop_token_ids, ignore_eos,
                                    skip_special_tokens; choices prompt-major (p0 x n, p1 x n..)
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
processed_logprobs`; `rollout_bridge.sampling`). Only `logprobs: 0` / `prompt_logprobs: 0`
(the chosen token's own logprob, no alternatives) are served; larger values are refused with
HTTP 400 naming the field. Errors use vLLM's body `{"error": {"message", "type", "code"}}`.

Security: binds 127.0.0.1 unless told otherwise; `--token T` (or env `JFP8RL_SERVE_TOKEN`)
requires `Authorization: Bearer T` on every route but /health; JSON only, never pickle.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from tokenizers.decoders import DecodeStream

from rollout_bridge.backend import RolloutError, SamplingParams
from rollout_bridge.engine import EmbeddedBackend

_MAX_BODY = 256 * 2**20
_LOGPROB_CLAMP = -9999.0  # vLLM's floor for -inf
_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy (and then refuses n > 1)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}


class ApiError(Exception):
    """An error answered to the client as vLLM does: HTTP status + {"error": {...}}."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


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

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        """One token (or a few) as text, e.g. `decoded_token` ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def detokenize(self, prompt: Sequence[int], ids: Sequence[int], skip_special: bool) -> str:
        """A response's `text` as vLLM's incremental detokenizer builds it: a
        `tokenizers.decoders.DecodeStream` primed with the prompt, one step per token, so
        bytes of an unfinished UTF-8 character are held back (and dropped at the end)."""
        if self.tokenizer is None:
            return ""
        try:
            stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special)
        except TypeError:  # tokenizers < 0.22 has no `ids` priming
            stream = DecodeStream(skip_special_tokens=skip_special)
        parts = []
        for t in ids:
            try:
                parts.append(stream.step(self.tokenizer, int(t)) or "")
            except Exception:  # noqa: BLE001 (vLLM resets the stream on invalid UTF-8 prefixes)
                stream = DecodeStream(skip_special_tokens=skip_special)
        return "".join(parts)

    def token_str(self, tid: int, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids or self.tokenizer is None else self.decode([tid], False)


def _int_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    ):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{what} must be a list of token ids (ints)")
    return list(x)


def _prompts(body: dict[str, Any], state: ServerState) -> list[list[int]]:
    """`prompt`: token ids, a list of token-id lists, a string or a list of strings."""
    p = body.get("prompt")
    if isinstance(p, str):
        p = [p]
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return [_int_list(p, "prompt")]
    if not isinstance(p, list) or not p:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'prompt' must be token ids or a non-empty list")
    out = []
    for i, item in enumerate(p):
        if isinstance(item, str):
            if state.tokenizer is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, "text prompts need a tokenizer; send ids")
            out.append(state.tokenizer.encode(item).ids)
        else:
            out.append(_int_list(item, f"prompt[{i}]"))
    return out


def _sampling(body: dict[str, Any]) -> SamplingParams:
    for field in ("logprobs", "prompt_logprobs"):
        k = body.get(field)
        if k is not None and k != 0:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"'{field}': {k} is not served by rollout_bridge.serve; use 0 (the chosen "
                "token's logprob only)",
            )
    if body.get("stream"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stream': true is not supported; use false")
    top_k = body.get("top_k")
    n, temperature = body.get("n") or 1, body.get("temperature")
    if n != 1 and temperature is not None and temperature < _GREEDY_EPS:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"n must be 1 when using greedy sampling, got {n}.")
    try:
        return SamplingParams(
            n=int(body.get("n") or 1),
            max_tokens=int(body.get("max_tokens") or 16),
            temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
            top_p=float(1.0 if body.get("top_p") is None else body["top_p"]),
            top_k=-1 if top_k is None else int(top_k),
            seed=None if body.get("seed") is None else int(body["seed"]),
            stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except (TypeError, ValueError) as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"bad sampling parameter: {e}") from e


def completions(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/completions` response for one request (module docstring)."""
    if body.get("model") not in (None, state.model_name):
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"The model `{body.get('model')}` does not exist; this server serves "
            f"`{state.model_name}` (GET /v1/models)",
            param="model",
        )
    prompts = _prompts(body, state)
    sp = _sampling(body)
    as_ids = bool(body.get("return_tokens_as_token_ids", False))
    with_ids = bool(body.get("return_token_ids", False))
    skip_special = bool(body.get("skip_special_tokens", True))
    want_lp = body.get("logprobs") is not None
    want_plp = body.get("prompt_logprobs") is not None
    state.enter()
    try:
        results = state.engine.generate(prompts, sp)
        scored = state.engine.score_with_ranks(prompts) if want_plp else None
    except RolloutError as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, str(e)) from e
    finally:
        state.leave()
    stop_set = set(sp.stop_token_ids)
    choices = []
    for k, c in enumerate(results):
        ids = [int(t) for t in c.response_ids]
        last = ids[-1] if ids else None
        choice: dict[str, Any] = {
            "index": k,
            "text": state.detokenize(c.prompt_ids, ids, skip_special),
            "logprobs": None,
            "finish_reason": c.finish_reason,
            # vLLM: the stop token id when a stop_token_ids entry ended it; None for eos.
            "stop_reason": last if c.finish_reason == "stop" and last in stop_set else None,
            "token_ids": ids if with_ids else None,
            "prompt_token_ids": list(c.prompt_ids) if with_ids else None,
            "prompt_logprobs": None,
            "routed_experts": None,
        }
        if want_lp:
            lps = [max(float(x), _LOGPROB_CLAMP) for x in c.logprobs]
            toks = [state.token_str(t, as_ids) for t in ids]
            # vLLM's offsets advance by the length of each reported token string.
            offsets, pos = [], 0
            for tok in toks:
                offsets.append(pos)
                pos += len(tok)
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": lps,
                "tokens": toks,
                "top_logprobs": [{s: v} for s, v in zip(toks, lps, strict=True)],
            }
        if scored is not None:
            lp, rank = scored[c.prompt_index]
            entries: list[Any] = [None]
            for t in range(1, len(c.prompt_ids)):
                tid = c.prompt_ids[t]
                entries.append(
                    {
                        str(tid): {
                            "logprob": max(float(lp[t]), _LOGPROB_CLAMP),
                            "rank": int(rank[t]),
                            # vLLM decodes here even with return_tokens_as_token_ids.
                            "decoded_token": state.decode([tid], False),
                        }
                    }
                )
            choice["prompt_logprobs"] = entries
        choices.append(choice)
    n_prompt = sum(len(p) for p in prompts) * sp.n
    n_out = sum(len(c.response_ids) for c in results)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": "rollout_bridge",
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


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
        kind = _ERROR_TYPES.get(int(status), status.phrase.replace(" ", ""))
        err = {"message": message, "type": kind, "param": param, "code": int(status)}
        self._send(status, {"error": err})

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
    now = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    entry = {
        "id": state.model_name,
        "object": "model",
        "created": now,
        "owned_by": "rollout_bridge",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.engine.max_len,
        "permission": [permission],
    }
    return _ok({"object": "list", "data": [entry]})


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_bridge.serve",
        description="Serve the embedded JAX engine behind vLLM's OpenAI-compatible routes.",
    )
    parser.add_argument(
        "--model", required=True, help="HF folder (config.json, safetensors, tokenizer.json)"
    )
    parser.add_argument(
        "--recipe",
        default="fp8_block",
        help="rollout recipe: bf16 | fp8_tensor | fp8_row | fp8_block",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--token",
        default=os.environ.get("JFP8RL_SERVE_TOKEN"),
        help="bearer token (default: env JFP8RL_SERVE_TOKEN; none = open)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id in /v1/models (default: --model)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + response")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="compute dtype of activations (auto: the model config's, bfloat16)",
    )
    parser.add_argument(
        "--export-format", default=None, help="format of in-process pushes (default by recipe)"
    )
    args = parser.parse_args(argv)

    from models.tokenizer import load_tokenizer

    overrides = {} if args.dtype == "auto" else {"compute_dtype": args.dtype}
    engine = EmbeddedBackend.from_hf_dir(
        args.model,
        recipe=args.recipe,
        config_overrides=overrides,
        max_len=args.max_model_len,
        export_format=args.export_format,
    )
    state = ServerState(
        engine,
        model_name=args.served_model_name or args.model,
        token=args.token,
        tokenizer=load_tokenizer(args.model),
    )
    server = make_server(state, args.host, args.port)
    print(
        f"rollout_bridge.serve: {args.model} (recipe {engine.recipe.name}) on "
        f"http://{args.host}:{server.server_port}",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()


if __name__ == "__main__":
    main()
