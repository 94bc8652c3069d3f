"""Our server (`server.http_server`, `python -m rollout_bridge.serve`) over HTTP on loopback,
driven by the real client (`HttpBackend`).

The server must be indistinguishable from vLLM for the client: generate, score, push (the
full pause / update / resume sequence, verified export) and the weight version. Numbers are
checked against the engine itself (the server must add nothing) and against the model's own
`token_logprobs` on the pushed weights (an independent reference).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from bridge_support import ROOT, flip_tensor_bit, sharp_hf_state

from models import functional as mf
from models.config import get_config
from models.fp8 import get_recipe
from models.hf_io import from_hf_state_dict, save_hf
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.backend import RolloutError, SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.export import export_weights
from rollout_bridge.server.http_server import ServerState, make_server

TOKEN = "s3cret"
PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], [7] * 11]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, url, export root) of a server on a free loopback port, shut down at the end."""
    cfg = get_config("tiny_qwen2")
    graphdef, _ = mf.init_model(cfg, 0)
    params = from_hf_state_dict(cfg, sharp_hf_state(cfg, 1))
    engine = EmbeddedBackend(cfg, graphdef, params, recipe="fp8_block", eos_id=256, max_len=256)
    state = ServerState(
        engine, model_name="tiny", api_keys=[TOKEN], tokenizer=build_byte_tokenizer()
    )
    server = make_server(state, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield engine, f"http://127.0.0.1:{server.server_port}", tmp_path_factory.mktemp("exports")
    server.shutdown()
    server.server_close()


def _client(url, root, **kw):
    settings = ClientSettings(api_key=TOKEN, export_root=root, max_retries=1, backoff_s=0.05, **kw)
    return HttpBackend(url, settings)


def _post(url, path, body, token=TOKEN):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_generate_through_client_equals_engine(served):
    engine, url, root = served
    client = _client(url, root)
    for sp in (
        SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=11),
        SamplingParams(n=1, max_tokens=6, temperature=0.0),
        SamplingParams(n=3, max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=3),
    ):
        got = client.generate(PROMPTS, sp)
        want = engine.generate(PROMPTS, sp)
        assert len(got) == len(want) == len(PROMPTS) * sp.n
        for g, w in zip(got, want, strict=True):
            assert g.prompt_index == w.prompt_index and g.prompt_ids == w.prompt_ids
            np.testing.assert_array_equal(g.response_ids, w.response_ids)
            # JSON carries Python floats: float32 -> float64 -> float32 is exact.
            np.testing.assert_array_equal(g.logprobs, w.logprobs)
            assert g.finish_reason == w.finish_reason
            assert g.weight_version == engine.weight_version()


def test_score_through_client_equals_token_logprobs(served):
    engine, url, root = served
    client = _client(url, root)
    seqs = [[1, 2, 3], [65] * 20, [9]]
    got = client.score(seqs)
    tokens = np.zeros((3, 32), np.int32)
    mask = np.zeros_like(tokens)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)], mask[r, : len(s)] = s, 1
    ref = jax.jit(mf.token_logprobs, static_argnums=0, static_argnames="recipe")
    want = np.asarray(ref(engine.graphdef, engine.params, tokens, mask, recipe=engine.recipe))
    for r, s in enumerate(seqs):
        np.testing.assert_allclose(got[r], want[r, : len(s)], atol=1e-4)


def test_wire_format_matches_vllm(served):
    """The fields of docs/rollout.md section 2, checked on the raw JSON."""
    _, url, _ = served
    body = {
        "model": "tiny",
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 4,
        "seed": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "prompt_logprobs": 0,
        "ignore_eos": True,
    }
    resp = _post(url, "/v1/completions", body)
    assert resp["object"] == "text_completion" and resp["model"] == "tiny"
    ch = resp["choices"]
    assert [c["index"] for c in ch] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in ch] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    for c in ch:
        ids = c["token_ids"]
        lp = c["logprobs"]
        assert len(ids) == 4 and c["finish_reason"] == "length" and c["stop_reason"] is None
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert lp["top_logprobs"] == [
            {f"token_id:{t}": v} for t, v in zip(ids, lp["token_logprobs"], strict=True)
        ]
        # vLLM's text_offset advances by the length of each reported token string.
        assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(4)]
        plp = c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(c["prompt_token_ids"])
        for t, entry in zip(c["prompt_token_ids"][1:], plp[1:], strict=True):
            e = entry[str(t)]
            assert e["rank"] >= 1 and e["logprob"] <= 0 and e["decoded_token"] == chr(t)
    assert resp["usage"]["completion_tokens"] == 16
    assert resp["usage"]["prompt_tokens"] == 2 * (len(PROMPTS[0]) + len(PROMPTS[1]))
    models = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        ).read()
    )
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256


def test_errors_are_vllm_shaped(served):
    _, url, _ = served
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2]}, token="wrong")
    assert e.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url, "/v1/completions", {"model": "other", "prompt": [1, 2]})
    assert (
        e.value.code == 404 and "does not exist" in json.loads(e.value.read())["error"]["message"]
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "logprobs": 5})
    assert e.value.code == 400 and "logprobs" in json.loads(e.value.read())["error"]["message"]
    # /health needs no token (as vLLM's --api-key).
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200 and r.read() == b""


def test_push_version_and_new_logprobs(served):
    """Push through the client (fp32 export): /weight_info shows the version, scores equal
    `token_logprobs` on the new weights (not the old), samples carry the version."""
    engine, url, root = served
    cfg = engine.cfg
    client = _client(url, root, export_format="fp32")
    seq = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
    old = client.score(seq)[0]
    new_hf = sharp_hf_state(cfg, 7)
    client.push_weights(new_hf, "step-3")
    assert client.weight_version() == "step-3" == engine.weight_version()
    new_params = from_hf_state_dict(cfg, new_hf)
    tokens = np.asarray(seq, np.int32)
    ref = jax.jit(mf.token_logprobs, static_argnums=0, static_argnames="recipe")
    want = np.asarray(
        ref(
            engine.graphdef,
            new_params,
            tokens,
            np.ones_like(tokens),
            recipe=get_recipe("fp8_block"),
        )
    )[0]
    got = client.score(seq)[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(old - want).max() > 0.1
    out = client.generate(seq, SamplingParams(n=2, max_tokens=3, seed=1))
    assert all(c.weight_version == "step-3" for c in out)


def test_tampered_export_is_refused_and_server_resumes(served):
    engine, url, root = served
    client = _client(url, root, export_format="fp32")
    path = export_weights(sharp_hf_state(engine.cfg, 8), "step-bad", fmt="fp32", root=root / "bad")
    flip_tensor_bit(path, "last")
    before = engine.weight_version()
    with pytest.raises(RolloutError, match="xxh3_128 of tensor .*does not match the manifest"):
        client.push_export(path, "step-bad")
    assert client.weight_version() == before
    # The client resumed the server after the failed update: generation still works.
    assert len(client.generate([[1, 2]], SamplingParams(max_tokens=2, seed=0))) == 1
    shutil.rmtree(path.parent, ignore_errors=True)


def test_cli_serves_an_hf_folder(tmp_path):
    """`python -m rollout_bridge.serve --model <dir>`: loads the folder, answers the client."""
    cfg = get_config("tiny_qwen2")
    graphdef, _ = mf.init_model(cfg, 0)
    params = from_hf_state_dict(cfg, sharp_hf_state(cfg, 2))
    save_hf(tmp_path / "model", cfg, params, build_byte_tokenizer())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "rollout_bridge.serve", "--model", str(tmp_path / "model")]
    cmd += ["--port", str(port), "--recipe", "bf16"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        client = HttpBackend(
            f"http://127.0.0.1:{port}", ClientSettings(export_root=tmp_path / "exp")
        )
        deadline = time.monotonic() + 120
        while not client.health():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "server did not come up in 120 s"
            time.sleep(0.5)
        sp = SamplingParams(n=2, max_tokens=3, seed=4, ignore_eos=True)
        out = client.generate([[104, 105]], sp)
        assert [len(c.response_ids) for c in out] == [3, 3]
        for a, b in zip(out, client.generate([[104, 105]], sp), strict=True):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
        assert client.weight_version() == "default"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_routed_experts_travel_as_vllm_returns_them():
    """A server whose engine records routing (`--enable-return-routed-experts`) returns each
    choice's experts as vLLM does (base64 .npy of the first num_tokens - 1 rows, decoded here
    the way vLLM's protocol documents it), and the client hands the trainer the engine's own
    record, the last token's row unknown (-1)."""
    import base64
    import io

    cfg = get_config("tiny_qwen3_moe")
    graphdef, _ = mf.init_model(cfg, 0)
    params = from_hf_state_dict(cfg, sharp_hf_state(cfg, 1))
    engine = EmbeddedBackend(
        cfg, graphdef, params, recipe="fp8_block", eos_id=None, max_len=64, record_routing=True
    )
    state = ServerState(engine, model_name="moe", api_keys=[], tokenizer=build_byte_tokenizer())
    server = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        sp = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3)
        want = engine.generate(PROMPTS, sp)
        got = HttpBackend(url, ClientSettings(max_retries=0)).generate(PROMPTS, sp)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g.response_ids, w.response_ids)
            n = len(w.prompt_ids) + len(w.response_ids)
            assert g.routed_experts.shape == (n, cfg.num_layers, cfg.num_experts_per_tok)
            np.testing.assert_array_equal(g.routed_experts[:-1], w.routed_experts[:-1])
            assert (g.routed_experts[-1] == -1).all()
        body = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3,
                                             "temperature": 0.0, "return_token_ids": True},
                     token=None)  # fmt: skip
        choice = body["choices"][0]
        rows = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        assert rows.dtype == np.uint8
        assert rows.shape == (len(PROMPTS[0]) + len(choice["token_ids"]) - 1, 2, 2)
    finally:
        server.shutdown()
        server.server_close()
        engine.close()
