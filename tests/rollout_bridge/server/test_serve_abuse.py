"""One live `python -m rollout_bridge.serve` (a subprocess, as deployed) against what a client
may send: vLLM's admission rules, a request that asks for more than the server can hold, the
API key on every route, many clients at once, and a hypothesis fuzz of the HTTP API.

Every answer must be a valid 200 or a 4xx JSON error, the server must stay up, and its
resident memory (VmRSS / VmHWM of the server process, /proc/<pid>/status) must stay bounded.
The server runs with small limits so that every bound is reached: max_model_len 16,
max_num_seqs 8 (larger requests decode in chunks), max_pending_seqs 32, a key from the
environment (VLLM_API_KEY, as vLLM reads it).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from bridge_support import ServeProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import functional as mf
from models.config import get_config
from models.hf_io import save_hf
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.server.limits import MAX_CONNECTIONS

KEY = "k3y-for-tests"
MAX_LEN, MAX_SEQS, MAX_PENDING, VOCAB = 16, 8, 32, 512
# Peak resident memory of the server process over the whole module (jax, the tiny model, a
# few compiled shapes). Before the bounds, one request of n = 100000 grew it past 24 GB.
MAX_HWM_MIB = 1024
FUZZ_EXAMPLES, FUZZ_CLIENTS = 60, 8
STATS: Counter[str] = Counter()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    d = tmp_path_factory.mktemp("serve_abuse")
    cfg = get_config("tiny_qwen2")
    _, params = mf.init_model(cfg, 0)
    save_hf(d / "model", cfg, params, build_byte_tokenizer())
    args = ("--max-model-len", str(MAX_LEN), "--max-num-seqs", str(MAX_SEQS),
            "--max-pending-seqs", str(MAX_PENDING))  # fmt: skip
    srv = ServeProcess(
        d / "model", d / "serve.log", recipe="bf16", args=args, env={"VLLM_API_KEY": KEY}
    )
    try:
        yield srv.wait_healthy()
    finally:
        srv.kill()


def call(
    srv: ServeProcess,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = KEY,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """(status, parsed JSON or None for an empty body); `body` bytes are sent as they are."""
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request(method, path, body=raw, headers=h)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    return resp.status, json.loads(data) if data.strip() else None


def complete(srv: ServeProcess, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    return call(srv, "POST", "/v1/completions", body, **kw)


def check_answer(status: int, payload: Any, request: Any = None) -> None:
    """A valid 200 (for a completion: choices consistent with the request) or a 4xx JSON
    error (vLLM's shapes: {"error": {...}}, or {"error": "Unauthorized"} for 401)."""
    if status == 200:
        if isinstance(payload, dict) and "choices" in payload:
            check_completion(payload, request)
        return
    assert 400 <= status < 500, (status, payload)
    assert isinstance(payload, dict) and "error" in payload, payload
    if status == 401:
        assert payload == {"error": "Unauthorized"}
    else:
        err = payload["error"]
        assert err["code"] == status and isinstance(err["message"], str) and err["message"]


def check_completion(payload: dict[str, Any], request: Any) -> None:
    choices = payload["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    n_out = 0
    for c in choices:
        assert c["finish_reason"] in ("stop", "length")
        ids = c["token_ids"]
        if ids is not None:
            assert all(0 <= t < VOCAB for t in ids) and 1 <= len(ids) <= MAX_LEN - 1
            assert len(c["prompt_token_ids"]) + len(ids) <= MAX_LEN
            n_out += len(ids)
        if c["logprobs"] is not None:
            lps = c["logprobs"]["token_logprobs"]
            assert all(isinstance(x, float) and math.isfinite(x) and x <= 1e-6 for x in lps)
            assert ids is None or len(lps) == len(ids)
    if all(c["token_ids"] is not None for c in choices):
        assert payload["usage"]["completion_tokens"] == n_out
    prompt = request.get("prompt") if isinstance(request, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        n = request.get("n")
        assert len(choices) == len(prompt) * (1 if n is None else int(float(n)))


def memory_mib(srv: ServeProcess) -> dict[str, float]:
    return {k: v / 1024 for k, v in srv.memory_kib().items()}


# -- what a client may ask -------------------------------------------------------------------


def test_one_request_cannot_exhaust_memory(server: ServeProcess) -> None:
    """`n: 100000` (was: allocation until the OOM killer) is refused at once; so are the
    other requests vLLM refuses; the server stays up, its memory does not move."""
    before = memory_mib(server)["VmRSS"]
    t0 = time.monotonic()
    status, body = complete(server, {"prompt": [[1], [2]], "n": 100000})
    assert status == 400 and "--max-pending-seqs" in body["error"]["message"]
    assert body["error"]["param"] == "n" and time.monotonic() - t0 < 5
    for request, message in [
        ({"prompt": [[1]], "n": 0}, "n must be at least 1, got 0."),
        ({"prompt": [[1]], "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"prompt": [[1]], "max_tokens": 17}, "cannot be greater than max_model_len=16"),
        ({"prompt": [[1] * 17]}, "maximum context length is 16 tokens"),
        ({"prompt": [[1] * 16]}, "max_tokens must be at least 1, got 0."),
        ({"prompt": [[1] * 8] * 5, "n": 7}, "35 sequences (5 prompts x n=7)"),
        ({"prompt": [[VOCAB]]}, f"outside [0, {VOCAB})"),
        ({"prompt": [[1]], "stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"prompt": [[1]], "n": 2.5}, "'n' must be an integer"),
    ]:
        status, body = complete(server, request)
        assert status == 400 and message in body["error"]["message"], (request, body)
    after = memory_mib(server)["VmRSS"]
    assert after - before < 50, (before, after)
    status, _ = call(server, "GET", "/health", key=None)
    assert status == 200


def test_chunks_and_lowered_max_tokens(server: ServeProcess) -> None:
    """12 sequences decode in chunks of 8; a prompt of 12 tokens with max_tokens 10 gets 4
    (vLLM lowers max_tokens to what max_model_len leaves); seeded answers repeat."""
    body = {"prompt": [[5, 6], [7] * 12, [8, 9, 10]], "n": 4, "max_tokens": 10, "seed": 3,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}  # fmt: skip
    status, first = complete(server, body)
    assert status == 200
    check_completion(first, body)
    lengths = [len(c["token_ids"]) for c in first["choices"]]
    assert lengths == [10] * 4 + [4] * 4 + [10] * 4
    assert all(c["finish_reason"] == "length" for c in first["choices"])
    # The prompt whose max_tokens was lowered samples the start of what it would sample.
    status, again = complete(server, body)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in first["choices"]]
    alone = {**body, "prompt": [[7] * 12], "max_tokens": 4, "jfp8rl_seed_indices": [1]}
    status, alone = complete(server, alone)
    assert [c["token_ids"] for c in alone["choices"]] == [
        c["token_ids"] for c in first["choices"][4:8]
    ]


def test_malformed_http_gets_json_errors(server: ServeProcess) -> None:
    cases = [
        (b"{not json", 400),
        (b'{"prompt": [[1]], "temperature": NaN}', 400),
        (b"[" * 100000 + b"]" * 100000, 400),
        (b'"a string"', 400),
    ]
    for raw, want in cases:
        status, body = complete(server, raw)
        assert status == want and "error" in body, (raw[:30], status, body)
    status, body = call(server, "POST", "/v1/completions", b"{}", headers={"Content-Length": "-5"})
    assert status == 400 and "Content-Length" in body["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:  # a huge declared body is refused before it is read
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {KEY}")
        conn.putheader("Content-Length", str(2**40))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == 413
    finally:
        conn.close()
    for method, path, want in [("PUT", "/v1/completions", 405), ("GET", "/nowhere", 404),
                               ("OPTIONS", "/health", 405), ("BREW", "/", 405)]:  # fmt: skip
        status, body = call(server, method, path)
        assert status == want and body["error"]["code"] == want, (method, path, body)
    assert call(server, "HEAD", "/health") == (405, None)
    status, body = call(server, "POST", "/init_weight_transfer_engine", {"init_info": "x"})
    assert status == 400


def test_connections_beyond_the_cap_get_503(server: ServeProcess) -> None:
    """64 idle connections hold every slot: the next request gets 503 (which clients retry)
    without its body being read; once they close, requests are served again."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # every idle connection has its handler thread
        status, body = complete(server, {"prompt": [[1]], "max_tokens": 1})
        assert status == 503 and "busy" in body["error"]["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while complete(server, {"prompt": [[1]], "max_tokens": 1})[0] == 503:
        assert time.monotonic() < deadline, "slots not released"
        time.sleep(0.1)


def test_api_key_guards_every_route_but_health(server: ServeProcess) -> None:
    """vLLM's --api-key guards /v1/... only; ours also the weight routes, so that nobody
    without the key loads a folder of their choosing or pauses the server."""
    routes = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/weight_info"),
              ("POST", "/pause"), ("POST", "/resume"), ("POST", "/init_weight_transfer_engine"),
              ("POST", "/start_weight_update"), ("POST", "/update_weights"),
              ("POST", "/finish_weight_update")]  # fmt: skip
    for method, path in routes:
        for key in (None, "wrong", KEY + " "):
            status, body = call(server, method, path, {"update_info": {"path": "/tmp"}}, key=key)
            assert (status, body) == (401, {"error": "Unauthorized"}), (method, path, key)
    assert call(server, "GET", "/health", key=None) == (200, None)
    assert call(server, "GET", "/weight_info") == (200, {"weight_version": "default"})
    lower = {"Authorization": f"bearer {KEY}"}  # the scheme in any case, as vLLM
    assert call(server, "GET", "/v1/models", key=None, headers=lower)[0] == 200


def test_requests_beyond_the_pending_limit_wait(server: ServeProcess) -> None:
    """8 clients x 16 sequences against max_pending_seqs 32: at most two are held at once,
    the others wait; every answer equals the same request sent alone."""
    bodies = [{"prompt": [[k + 1], [k + 2, 3]], "n": 8, "max_tokens": 5, "seed": k,
               "return_token_ids": True, "ignore_eos": True} for k in range(8)]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: complete(server, b), bodies))
    for body, (status, payload) in zip(bodies, answers, strict=True):
        assert status == 200
        check_completion(payload, body)
    status, alone = complete(server, bodies[5])
    assert [c["token_ids"] for c in alone["choices"]] == [
        c["token_ids"] for c in answers[5][1]["choices"]
    ]


# -- fuzz ------------------------------------------------------------------------------------

_scalar = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
)
_flat = (
    _scalar
    | st.lists(_scalar, max_size=4)
    | st.dictionaries(st.text(max_size=6), _scalar, max_size=4)
)
_json = (
    _flat | st.lists(_flat, max_size=3) | st.dictionaries(st.text(max_size=6), _flat, max_size=3)
)
_token = st.integers(-2, VOCAB + 2) | st.sampled_from([2**31, 2**64, -(2**63)]) | _json
_ids = st.lists(st.integers(0, VOCAB - 1), max_size=18) | st.lists(_token, max_size=18)
_prompt = st.one_of(
    st.lists(_ids, min_size=1, max_size=5), _ids, st.text(max_size=20),
    st.lists(st.text(max_size=8), max_size=3), _json,
)  # fmt: skip
_int = st.integers(-3, 40) | st.sampled_from([100000, 2**63, -(2**63)])
_count = st.one_of(_int, st.floats(-2, 50), st.text(max_size=4), _json)
_unit = st.floats(-1, 3) | st.sampled_from([0, 1, 1e308, -0.0]) | _json
_fields = {
    "model": st.sampled_from([None, "x"]) | _json,
    "prompt": _prompt,
    "n": _count,
    "max_tokens": _count,
    "temperature": _unit,
    "top_p": _unit,
    "top_k": _count,
    "seed": _int | _json,
    "logprobs": st.sampled_from([0, None, 1]) | _json,
    "prompt_logprobs": st.sampled_from([0, None]) | _json,
    "return_token_ids": st.booleans() | _json,
    "return_tokens_as_token_ids": st.booleans(),
    "ignore_eos": st.booleans() | _json,
    "stop_token_ids": st.lists(_token, max_size=10) | _json,
    "jfp8rl_seed_indices": st.lists(_int, max_size=5) | _json,
    "stream": st.sampled_from([False, None]) | _json,
}
# Mostly well-formed requests (each field valid or not), so that generation runs often.
_valid = st.fixed_dictionaries(
    {"prompt": st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
                        min_size=1, max_size=4)},
    optional={"n": st.integers(1, 6), "max_tokens": st.integers(1, 8),
              "temperature": st.floats(0.1, 2), "top_p": st.floats(0.05, 1),
              "top_k": st.integers(-1, 600), "seed": st.integers(0, 2**64),
              "logprobs": st.just(0), "prompt_logprobs": st.just(0),
              "return_token_ids": st.booleans(), "ignore_eos": st.booleans()},
)  # fmt: skip
_completion = _valid | st.fixed_dictionaries({}, optional=_fields)
_paths = st.sampled_from(
    ["/v1/completions", "/v1/models", "/health", "/weight_info", "/update_weights",
     "/init_weight_transfer_engine", "/finish_weight_update", "/start_weight_update",
     "/v1/completions/", "/v1/completions?x=1", "/", "/v1"]
) | st.text("abcdefgh/_-.%0123456789", max_size=16).map(lambda s: "/" + s)  # fmt: skip
_case = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/completions"), _completion, st.just(KEY)),
    st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"]), _paths,
              _json | _completion | st.binary(max_size=64), st.sampled_from([KEY, None, "x"])),
)  # fmt: skip


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # a fixed, bounded set of cases in CI; drop it to explore further
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)  # fmt: skip
@given(cases=st.lists(_case, min_size=FUZZ_CLIENTS // 2, max_size=2 * FUZZ_CLIENTS))
def test_fuzz_http_api(server: ServeProcess, cases: list[tuple[str, str, Any, str | None]]) -> None:
    """Random JSON shapes, types and sizes from 8 concurrent clients; every answer a
    valid 200 or a 4xx JSON error, the server up, its peak memory under MAX_HWM_MIB."""

    def one(case: tuple[str, str, Any, str | None]) -> None:
        method, path, body, key = case
        if method == "GET":
            body = None
        status, payload = call(server, method, path, body, key=key)
        STATS["requests"] += 1
        STATS[str(status)] += 1
        check_answer(status, payload, body if path == "/v1/completions" else None)

    t0 = time.monotonic()
    with ThreadPoolExecutor(FUZZ_CLIENTS) as pool:
        list(pool.map(one, cases))
    STATS["seconds_x1000"] += int(1000 * (time.monotonic() - t0))
    STATS["examples"] += 1
    assert server.proc.poll() is None, server.log_tail()
    assert call(server, "GET", "/health", key=None)[0] == 200
    hwm = memory_mib(server)["VmHWM"]
    assert hwm < MAX_HWM_MIB, f"server peak resident memory {hwm:.0f} MiB"


def test_fuzz_report(server: ServeProcess) -> None:
    """The fuzz's counts (printed; run with -s to see them) and the server's final memory."""
    mem = memory_mib(server)
    print(
        f"\nserve fuzz: {STATS['examples']} examples, {STATS['requests']} requests in "
        f"{STATS['seconds_x1000'] / 1000:.1f} s; answers by status "
        f"{dict(sorted((k, v) for k, v in STATS.items() if k.isdigit()))}; server VmRSS "
        f"{mem['VmRSS']:.0f} MiB, VmHWM {mem['VmHWM']:.0f} MiB"
    )
    assert STATS["examples"] == FUZZ_EXAMPLES and mem["VmHWM"] < MAX_HWM_MIB
