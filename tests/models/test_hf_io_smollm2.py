"""SmolLM2-135M-Instruct as scripts/get_smollm2.sh writes it, against transformers' model
loaded straight from the GGUF (fixture `smollm2_ref`, tests/reference/smollm2_cases.py): the
folder's logits through `models.hf_io.load_hf` + forward (f32), its tokenizer ids and its chat
template ids (`jfp8rl.data.templates.PromptFormat`), and its end-of-turn ids. The weights are
the 4-bit GGUF's, dequantized: a degraded stand-in for the original model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _model_testlib import forward
from smollm2_cases import CONVERSATIONS, TEXTS, logits_batch

from jfp8rl.data.records import Example
from jfp8rl.data.templates import PromptFormat
from models import fp8
from models.hf_io import load_hf, read_safetensors_header
from models.tokenizer import load_tokenizer, stop_token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]


def test_folder_logits_equal_transformers_gguf_model(smollm2_dir, smollm2_ref) -> None:
    _, ref = smollm2_ref
    cfg, graphdef, params = load_hf(smollm2_dir, compute_dtype=jnp.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30, 576, 9, 3, 64,
    )  # fmt: skip
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    header = read_safetensors_header(smollm2_dir / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__data_start__"} == {"F32"}
    tokens, mask = logits_batch(load_tokenizer(smollm2_dir))
    ours = np.asarray(forward(graphdef, params, tokens, mask, recipe=fp8.BF16))
    real = mask.astype(bool)
    err = np.abs(ours - ref["logits"])[real].max()
    assert err < 5e-4, f"max |logit diff| {err:.2e}"
    # Same argmax wherever transformers' top-2 margin is not within the error.
    top2 = np.sort(ref["logits"][real], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3
    np.testing.assert_array_equal(
        ours[real].argmax(-1)[clear], ref["logits"][real].argmax(-1)[clear]
    )


def test_tokenizer_and_chat_template_ids_equal_transformers(smollm2_dir, smollm2_ref) -> None:
    meta, _ = smollm2_ref
    tok = load_tokenizer(smollm2_dir)
    assert [tok.encode(t).ids for t in TEXTS] == meta["input_ids"]
    assert [tok.decode(i, skip_special_tokens=False) for i in meta["input_ids"]] == list(TEXTS)
    fmt = PromptFormat(smollm2_dir, tok)
    ours = [
        fmt.encode([Example(c[-1]["content"], "", {}, tuple(c))], 512)[0] for c in CONVERSATIONS
    ]
    assert ours == meta["chat_ids"]
    # The default system prompt of the template is there when the conversation has none.
    assert "You are a helpful AI assistant named SmolLM" in fmt.decode(ours[0])
    assert "You are a helpful AI assistant" not in fmt.decode(ours[1])


def test_end_of_turn_ids(smollm2_dir, smollm2_ref) -> None:
    meta, _ = smollm2_ref
    tok = load_tokenizer(smollm2_dir)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end == meta["eos_token_id"] == meta["generation_eos_token_id"] == 2
    assert tok.token_to_id("<|endoftext|>") == 0  # not an end of turn of this model
    assert stop_token_ids(smollm2_dir) == (im_end,)
