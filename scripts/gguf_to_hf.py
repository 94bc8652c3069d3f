"""Converts a GGUF checkpoint into an HF model folder with transformers' GGUF loader.

Run by `scripts/get_smollm2.sh` and `scripts/get_qwen25_coder_05b.sh` in the vLLM venv (torch,
transformers, gguf, accelerate): `python scripts/gguf_to_hf.py GGUF_FILE OUT_DIR`.
transformers dequantizes every tensor (SmolLM2's Q4_1 and Q8_0, Qwen2.5-Coder's Q4_K, Q5_0,
Q6_K and Q8_0) to float32 and reads the vocabulary, merges and chat template
from the GGUF metadata. The folder gets float32 safetensors, a config.json without the GGUF
quantization entry (the weights are plain float32 now), tokenizer.json, tokenizer_config.json
(chat template, eos) and generation_config.json. Imports only torch and transformers, never
the project's packages (they need jax, which this venv does not have).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers


def convert(gguf_file: Path, out: Path) -> None:
    kw = {"gguf_file": gguf_file.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, dtype=torch.float32, **kw
    )
    cfg = quantized.config
    cfg.quantization_config = None
    del cfg.quantization_config
    # A plain model of the same architecture takes the dequantized tensors; the GGUF-loaded one
    # refuses save_pretrained (it still carries the GGUF quantizer).
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # One home for the chat template, tokenizer_config.json, which every reader (transformers,
    # vLLM, jfp8rl.data.templates) looks at; transformers >= 4.43 saves it beside it instead.
    jinja = out / "chat_template.jinja"
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    if jinja.is_file():
        tok_cfg["chat_template"] = jinja.read_text()
        jinja.unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_hf.py GGUF_FILE OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
