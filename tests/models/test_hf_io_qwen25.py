"""Qwen2.5-Coder-0.5B-Instruct as scripts/get_qwen25_coder_05b.sh writes it (transformers' GGUF
loader's dequantized values), against transformers' model of the folder (fixture `qwen25_ref`,
tests/reference/qwen25_cases.py): the folder's logits through `models.hf_io.load_hf` + forward
(f32; Qwen2's q/k/v biases, the 151,936-entry vocabulary), its tokenizer ids on code, Chinese
and special tokens, its chat template ids with and without a system message, its end-of-turn
ids, and the embedded engine's greedy answers against transformers' `generate`. The weights are
the Q4_K_M GGUF's, dequantized: a degraded stand-in for the original model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import forward
from qwen25_cases import CONVERSATIONS, MAX_NEW_TOKENS, TEXTS
from smollm2_cases import logits_batch

from jfp8rl.data.records import Example
from jfp8rl.data.templates import PromptFormat
from models import fp8
from models.hf_io import load_hf, read_safetensors_header
from models.tokenizer import load_tokenizer, stop_token_ids
from rollout_bridge.backend import SamplingParams
from rollout_bridge.engine.embedded import EmbeddedBackend

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]

IM_END, END_OF_TEXT = 151645, 151643


@pytest.fixture(scope="module")
def qwen25_model(qwen25_dir):
    """(cfg, graphdef, params) of the folder through `load_hf` (f32), read once for the
    module: its 2 GB of weights serve the forward and the engine (which copies them)."""
    return load_hf(qwen25_dir, compute_dtype=jnp.float32)


def test_folder_logits_equal_transformers(qwen25_dir, qwen25_model, qwen25_ref) -> None:
    _, ref = qwen25_ref
    cfg, graphdef, params = qwen25_model
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "qwen2", 24, 896, 14, 2,
    )  # fmt: skip
    assert cfg.vocab_size == 151936 and cfg.head_dim == 64
    header = read_safetensors_header(qwen25_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in header
    assert {v["dtype"] for k, v in header.items() if k != "__data_start__"} == {"F32"}
    tokens, mask = logits_batch(load_tokenizer(qwen25_dir), TEXTS)
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    real = mask.astype(bool)
    err = np.abs(ours - ref["logits"])[real].max()
    assert err < 1e-3, f"max |logit diff| {err:.2e}"
    top2 = np.sort(ref["logits"][real], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2e-3
    np.testing.assert_array_equal(
        ours[real].argmax(-1)[clear], ref["logits"][real].argmax(-1)[clear]
    )


def test_tokenizer_and_chat_template_ids_equal_transformers(qwen25_dir, qwen25_ref) -> None:
    meta, _ = qwen25_ref
    tok = load_tokenizer(qwen25_dir)
    assert [tok.encode(t).ids for t in TEXTS] == meta["input_ids"]
    assert [tok.decode(i, skip_special_tokens=False) for i in meta["input_ids"]] == list(TEXTS)
    fmt = PromptFormat(qwen25_dir, tok)
    ours = [
        fmt.encode([Example(c[-1]["content"], "", {}, tuple(c))], 512)[0] for c in CONVERSATIONS
    ]
    assert ours == meta["chat_ids"]
    # Qwen's default system message is there when the conversation has none.
    assert "You are Qwen, created by Alibaba Cloud" in fmt.decode(ours[0])
    assert "You are Qwen" not in fmt.decode(ours[1])


def test_end_of_turn_ids(qwen25_dir, qwen25_ref) -> None:
    meta, _ = qwen25_ref
    tok = load_tokenizer(qwen25_dir)
    assert tok.token_to_id("<|im_end|>") == IM_END == meta["eos_token_id"]
    assert tok.token_to_id("<|endoftext|>") == END_OF_TEXT
    gen = meta["generation_eos_token_id"]
    assert set(stop_token_ids(qwen25_dir)) == set(gen if isinstance(gen, list) else [gen])
    assert IM_END in stop_token_ids(qwen25_dir)


def test_engine_greedy_answers_equal_transformers_generate(
    qwen25_dir, qwen25_model, qwen25_ref
) -> None:
    """The engine as `EmbeddedBackend.from_hf_dir(qwen25_dir, ...)` builds it (the folder's
    weights in f32, its end-of-turn ids), from the module's loaded copy."""
    meta, _ = qwen25_ref
    cfg, graphdef, params = qwen25_model
    engine = EmbeddedBackend(
        cfg, graphdef, params, recipe="bf16", eos_id=stop_token_ids(qwen25_dir), max_len=128
    )
    try:
        out = engine.generate(
            meta["prompts"], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        )
    finally:
        engine.close()
    assert [c.response_ids.tolist() for c in out] == meta["greedy"]
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert all(c.response_ids[-1] in engine.eos_ids for c in stopped)
