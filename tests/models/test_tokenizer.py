"""The byte tokenizer (models/tokenizer.py): ids are bytes, eos is 256, transformers agrees."""

from __future__ import annotations

import pytest

from models import tokenizer as tk

TEXTS = ["07+45=52", "héllo wörld\n\t  x", "", "a<|endoftext|>b", "日本"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_utf8_bytes_and_round_trip(text):
    tok = tk.build_byte_tokenizer()
    plain = text.replace(tk.EOS_TOKEN, "")
    ids = tok.encode(plain).ids
    assert ids == list(plain.encode("utf-8"))  # the independent reference: the raw bytes
    assert tok.decode(ids) == plain


def test_eos_is_256_and_special():
    tok = tk.build_byte_tokenizer()
    assert tk.eos_token_id(tok) == 256 == tk.BYTE_VOCAB_SIZE - 1
    assert tok.encode("a" + tk.EOS_TOKEN).ids == [97, 256]
    assert tok.get_vocab_size() == tk.BYTE_VOCAB_SIZE


@pytest.mark.vllm
def test_saved_folder_loads_in_transformers_with_same_ids(tmp_path, transformers_ref):
    tk.save_tokenizer(tk.build_byte_tokenizer(), tmp_path)
    hf, _ = transformers_ref("tokenize", folder=str(tmp_path), texts=TEXTS)
    ours = tk.load_tokenizer(tmp_path)
    assert hf["input_ids"] == [ours.encode(text).ids for text in TEXTS]
    assert hf["eos_token_id"] == 256 and hf["pad_token_id"] == 256


def test_missing_tokenizer_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tk.load_tokenizer(tmp_path)


def test_stop_token_ids_union_of_tokenizer_config_and_generation_config(tmp_path):
    """Tokenizer eos first, then config.json's and generation_config.json's eos ids (an int or
    a list), each once; a bad eos_token names the file; no eos anywhere: <|endoftext|>."""
    tok = tk.build_byte_tokenizer()
    tok.add_special_tokens(["<|im_end|>", "<|eot|>"])  # ids 257, 258
    tk.save_tokenizer(tok, tmp_path)
    assert tk.stop_token_ids(tmp_path) == (256,)  # tokenizer_config.json: eos <|endoftext|>
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(
        cfg.read_text().replace('"eos_token": "<|endoftext|>"', '"eos_token": "<|im_end|>"')
    )
    (tmp_path / "config.json").write_text('{"eos_token_id": [258, 257]}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [257, 256, 258]}')
    assert tk.stop_token_ids(tmp_path) == (257, 258, 256)
    (tmp_path / "config.json").write_text('{"eos_token_id": 258}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": null}')
    assert tk.stop_token_ids(tmp_path, tok) == (257, 258)
    cfg.write_text('{"eos_token": {"content": "<|nope|>"}}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<\|nope\|>' is not"):
        tk.stop_token_ids(tmp_path)
    cfg.write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    assert tk.stop_token_ids(tmp_path) == (256,)
