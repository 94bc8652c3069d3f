"""Writes a random-weight HF folder of a model preset with the byte tokenizer.

    python scripts/make_random_hf.py --preset qwen3_0.6b --out runs/random_qwen3_0.6b

The folder (config.json, generation_config.json, model.safetensors, tokenizer files) loads with
`models.hf_io.load_hf` and as `model.path` of a run, so a paper-sized model's host memory can
be measured without downloading weights (benchmarks/host_memory.py). Weights are
`models.hf_state.random_hf_state_dict` (N(0, 0.02), norms 1 + N(0, 0.1), numpy's frozen legacy
stream: the same seed gives the same file); eos is the byte tokenizer's <|endoftext|> (256).

Host memory: one tensor's float64 draw at a time plus the float32 tensors written so far
(the whole model in float32, 2.4 GB for qwen3_0.6b), in this process only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.numpy import save_file

from models.config import get_config
from models.hf_state import random_hf_state_dict
from models.tokenizer import build_byte_tokenizer, eos_token_id, save_tokenizer


def make_random_hf(preset: str, out: str | Path, seed: int = 0, layers: int = 0) -> Path:
    """The folder `out` holding preset `preset` with random weights (rewritten if present);
    `layers` > 0 keeps only that many decoder layers (same widths: a cheaper stand-in to
    profile, e.g. qwen3_0.6b with 4 of its 28 layers)."""
    tok = build_byte_tokenizer()
    cfg = get_config(preset).replace(eos_token_id=eos_token_id(tok), bos_token_id=None)
    if layers > 0:
        cfg = cfg.replace(num_layers=layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_config("float32"), indent=2) + "\n")
    gen = {"eos_token_id": cfg.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tmp = out / "model.partial"
    save_file(random_hf_state_dict(cfg, seed), str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    save_tokenizer(tok, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_0.6b", help="a models.config preset name")
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: all)")
    a = ap.parse_args()
    print(make_random_hf(a.preset, a.out, a.seed, a.layers))


if __name__ == "__main__":
    main()
