"""Writes tests/models/golden/<preset>.npz: transformers' f32 logits for the tiny presets.

Weights come from `models.hf_state.random_hf_state_dict(cfg, seed)` (numpy RandomState, stable
across versions), so a fixture stores only the seed, the input tokens/mask and the logits.
transformers runs in the vLLM venv (tests/reference/client.py; the project venv has no torch),
so build that first:

    scripts/setup_vllm_env.sh && .venv/bin/python scripts/make_model_golden.py [PRESET ...]

(default: every preset of GOLDEN_PRESETS, and `load_balancing`: transformers' Qwen3-MoE
`load_balancing_loss_func` and its gradient on random router logits with a padded mask).
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
GOLDEN_PRESETS = (
    "tiny_qwen2", "tiny_qwen3", "tiny_llama", "tiny_qwen3_moe", "tiny_qwen2_moe", "tiny_mixtral",
    "tiny_qwen3_moe_mixed",
)  # fmt: skip
BALANCE = "load_balancing"  # the MoE load-balancing loss fixture
BALANCE_SHAPE = dict(layers=3, batch=3, seq=7, experts=8, top_k=2)
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


def balance_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Router logits [L, B * T, E] (expert 0 favoured, so the load is uneven) and a mask [B, T]
    with a left-padded and a right-padded row."""
    d = BALANCE_SHAPE
    rng = np.random.RandomState(11)
    logits = rng.standard_normal((d["layers"], d["batch"] * d["seq"], d["experts"]))
    logits[..., 0] += 1.0
    mask = np.ones((d["batch"], d["seq"]), np.int64)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    return logits.astype(np.float32), mask


def write_balance_golden() -> None:
    logits, mask = balance_inputs()
    d = BALANCE_SHAPE
    meta, out = run_reference(
        "load_balancing", arrays={"gate_logits": logits, "mask": mask},
        num_experts=d["experts"], top_k=d["top_k"],
    )  # fmt: skip
    path = GOLDEN_DIR / f"{BALANCE}.npz"
    np.savez_compressed(
        path, gate_logits=logits, mask=mask, top_k=np.int64(d["top_k"]),
        loss=np.float32(out["loss"]), grad=out["grad"].astype(np.float32),
        transformers_version=np.array(meta["versions"]["transformers"]),
    )  # fmt: skip
    print(f"wrote {path}: loss {float(out['loss']):.6f}")


def main(names: list[str]) -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in names or (*GOLDEN_PRESETS, BALANCE):
        if name == BALANCE:
            write_balance_golden()
            continue
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
