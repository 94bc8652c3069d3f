"""Writes tests/models/golden/<preset>.npz: transformers' f32 logits for the tiny presets.

Weights come from `models.hf_state.random_hf_state_dict(cfg, seed)` (numpy RandomState, stable
across versions), so a fixture stores only the seed, the input tokens/mask and the logits.
transformers runs in the vLLM venv (tests/reference/client.py; the project venv has no torch),
so build that first:

    scripts/setup_vllm_env.sh && .venv/bin/python scripts/make_model_golden.py [PRESET ...]

(default: every preset of GOLDEN_PRESETS).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from models.config import get_config
from models.hf_state import random_hf_state_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))
from client import run_reference  # noqa: E402

GOLDEN_DIR = ROOT / "tests" / "models" / "golden"
GOLDEN_PRESETS = ("tiny_qwen2", "tiny_qwen3", "tiny_llama", "tiny_qwen3_moe")
SEED = 1234
T = 24  # longer than the tiny llama's original_max_position_embeddings (16): exercises scaling


def golden_inputs(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two rows: one full, one left-padded by 5 (pads hold token 0)."""
    rng = np.random.RandomState(7)
    tokens = rng.randint(0, vocab_size, size=(2, T)).astype(np.int32)
    mask = np.ones((2, T), np.int32)
    mask[1, :5] = 0
    tokens[1, :5] = 0
    return tokens, mask


def write_hf_folder(folder: Path, cfg_dict: dict, tensors: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main(names: list[str]) -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in names or GOLDEN_PRESETS:
        cfg = get_config(name)
        tensors = random_hf_state_dict(cfg, SEED)
        tokens, mask = golden_inputs(cfg.vocab_size)
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_folder(Path(tmp), cfg.to_hf_config(), tensors)
            meta, out = run_reference("logits", folder=tmp, arrays={"tokens": tokens, "mask": mask})
            logits = out["logits"]
        out = GOLDEN_DIR / f"{name}.npz"
        np.savez_compressed(
            out,
            seed=np.int64(SEED),
            tokens=tokens,
            mask=mask,
            logits=logits.astype(np.float32),
            transformers_version=np.array(meta["versions"]["transformers"]),
            torch_version=np.array(meta["versions"]["torch"]),
        )
        print(f"wrote {out} ({out.stat().st_size} bytes), logits {logits.shape}")


if __name__ == "__main__":
    main(sys.argv[1:])
