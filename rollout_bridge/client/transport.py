"""`Transport`: one JSON request to a rollout server, with bounded retries.

Only the stdlib (`urllib.request`); JSON only, never pickle. Every request carries
`Authorization: Bearer <key>` when an API key is given (all routes: vLLM checks it on /v1/...,
`rollout_bridge.serve` on every route but /health). Answers must be JSON (an empty body
counts as null).

Errors: a refused connection, a reset / dropped connection, a socket timeout, or HTTP
429/502/503/504 are transient: retried `max_retries` times with backoff `backoff_s * 2**k`
(a request that is not idempotent only when the connection was refused, i.e. it was never
delivered). Any other non-2xx status raises `RolloutError` at once with the status and body;
the last transient failure raises `RolloutError` naming the URL and how to start the server.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from rollout_bridge.backend import RolloutError
from rollout_bridge.client.settings import ClientSettings

_TRANSIENT_HTTP = (429, 502, 503, 504)
_START_HINT = (
    "start it with `VLLM_SERVER_DEV_MODE=1 vllm serve <hf_dir> --host 127.0.0.1 --port <port> "
    "--logprobs-mode processed_logprobs --weight-transfer-config "
    '\'{"backend": "jfp8rl_shm"}\'` (vLLM venv: scripts/setup_vllm_env.sh) or '
    "`python -m rollout_bridge.serve --model <hf_dir> --port <port>`"
)


_KEY_HINT = (
    "; the server wants an API key (its --api-key): give the client the same one "
    "(ClientSettings.api_key; the trainer's rollout.api_key or $JFP8RL_ROLLOUT_API_KEY)"
)


class _Transient(Exception):
    """A failure worth retrying; `sent` is False when the request surely never arrived."""

    def __init__(self, cause: BaseException, *, sent: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.sent = sent


class Transport:
    """JSON requests to the server at `url` (token, timeout and retries from `settings`)."""

    def __init__(self, url: str, settings: ClientSettings) -> None:
        self.url = url
        self.settings = settings

    def _once(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.settings.api_key:
            req.add_header("Authorization", f"Bearer {self.settings.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:2000].decode(errors="replace")
            if e.code in _TRANSIENT_HTTP:
                raise _Transient(RuntimeError(f"HTTP {e.code}: {detail}"), sent=True) from e
            hint = _KEY_HINT if e.code == 401 else ""
            raise RolloutError(
                f"{method} {self.url}{path} failed: HTTP {e.code} {e.reason}: {detail}{hint}"
            ) from e
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, ConnectionRefusedError):
                raise _Transient(reason, sent=False) from e
            if isinstance(reason, OSError):
                raise _Transient(reason, sent=True) from e
            raise RolloutError(f"{method} {self.url}{path} failed: {e}; {_START_HINT}") from e
        except (http.client.HTTPException, ConnectionError, TimeoutError) as e:
            # RemoteDisconnected / reset / timeout while waiting: the server died or hung.
            raise _Transient(e, sent=True) from e
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise RolloutError(
                f"{method} {self.url}{path}: response is not JSON: {raw[:200]!r}"
            ) from e

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotent: bool = True,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """One JSON request with bounded retries (module docstring); the parsed answer.
        Non-idempotent requests (weight updates) are only retried when the connection was
        refused, i.e. the server never saw them."""
        retries = self.settings.max_retries if retries is None else retries
        timeout = self.settings.timeout_s if timeout is None else timeout
        for attempt in range(retries + 1):
            try:
                return self._once(method, path, body, timeout)
            except _Transient as t:
                last = t
                if attempt == retries or (t.sent and not idempotent):
                    break
                time.sleep(self.settings.backoff_s * 2**attempt)
        cause = last.cause
        if isinstance(cause, ConnectionRefusedError):
            what = "is not running (connection refused)"
        elif isinstance(cause, TimeoutError):
            what = f"did not answer within {timeout:g} s"
        else:
            what = f"failed ({type(cause).__name__}: {cause})"
        raise RolloutError(
            f"rollout server at {self.url} {what} on {method} {path} after {attempt + 1} "
            f"attempt(s); {_START_HINT}"
        ) from cause
