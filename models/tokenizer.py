"""Tokenizers in HF `tokenizer.json` format, built offline (no hub downloads), and the stop ids
of a model folder.

The built-in tokenizer is byte-level with no merges: token id b (0..255) is the byte b (in
GPT-2's byte-to-unicode alphabet, so transformers and vLLM decode it like any byte-level BPE),
and id 256 is `<|endoftext|>`, used as both eos and pad (as Qwen does). Every string round-trips
exactly, which is what the synthetic arithmetic task needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB_SIZE = 257  # 256 bytes + <|endoftext|>


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (used by HF byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: id b <-> byte b, id 256 = `<|endoftext|>` (eos and pad)."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    if tok.token_to_id(EOS_TOKEN) != 256:
        raise AssertionError("byte tokenizer layout changed: <|endoftext|> must be id 256")
    return tok


def eos_token_id(tok: Tokenizer) -> int:
    """The id of `<|endoftext|>` in `tok`; a clear error if the tokenizer lacks it."""
    tid = tok.token_to_id(EOS_TOKEN)
    if tid is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token; it is needed as eos and pad")
    return tid


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """Writes `tokenizer.json` and a `tokenizer_config.json` that transformers/vLLM accept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos = EOS_TOKEN if tok.token_to_id(EOS_TOKEN) is not None else None
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Loads `<model_dir>/tokenizer.json`; the error names the missing file."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: an HF model folder needs tokenizer.json "
            "(save one with models.tokenizer.save_tokenizer)"
        )
    return Tokenizer.from_file(str(path))


def read_json_file(path: Path) -> dict[str, Any]:
    """A model folder's JSON file as a dict ({} when absent); ValueError naming the file and
    line when it is not valid JSON."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def _id_list(value: Any) -> list[int]:
    """An `eos_token_id` entry (an int, a list of ints, or null) as a list."""
    return (
        [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]
    )


def stop_token_ids(model_dir: str | Path, tok: Tokenizer | None = None) -> tuple[int, ...]:
    """The ids that end a turn of the model in `model_dir`, as vLLM and transformers' `generate`
    decide it: the tokenizer's eos (`eos_token` of tokenizer_config.json, looked up in
    tokenizer.json), then every `eos_token_id` of config.json and of generation_config.json
    (an int or a list), each once, in that order. A chat model's end of turn often differs
    from its tokenizer's eos (SmolLM2: eos and end of turn `<|im_end|>` = 2 against
    `<|endoftext|>` = 0; Qwen3 base: `<|endoftext|>` eos, `<|im_end|>` in the generation config).
    A folder that names none of them falls back to `<|endoftext|>` (`eos_token_id`). The first
    id is the folder's eos, used as padding."""
    folder = Path(model_dir)
    tok = load_tokenizer(folder) if tok is None else tok
    ids: list[int] = []
    eos = read_json_file(folder / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        tid = tok.token_to_id(eos)
        if tid is None:
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: eos_token {eos!r} is not in tokenizer.json"
            )
        ids.append(int(tid))
    for name in ("config.json", "generation_config.json"):
        for tid in _id_list(read_json_file(folder / name).get("eos_token_id")):
            if tid not in ids:
                ids.append(tid)
    if not ids:
        try:
            ids.append(eos_token_id(tok))
        except ValueError as e:
            raise ValueError(
                f"{folder}: no eos token (set eos_token in tokenizer_config.json or "
                f"eos_token_id in config.json / generation_config.json): {e}"
            ) from e
    return tuple(ids)
