"""Runs a transformers reference job (tests/reference/transformers_ref.py) in the vLLM venv.

The project venv has no torch (Python 3.12; PyTorch's CPU wheel here is for 3.11 only), the
vLLM venv (`scripts/setup_vllm_env.sh`, Python 3.11) has torch 2.13 cpu and transformers. One
job = one subprocess (~5 s of torch/transformers import); files in, files out, no pickle.
Used by the tests (fixture `transformers_ref` in tests/conftest.py) and by
`scripts/make_model_golden.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout_bridge"))
from bridge_support import SETUP_SCRIPT, vllm_venv  # noqa: E402  (one owner of the venv's path)

SCRIPT = Path(__file__).resolve().parent / "transformers_ref.py"


def reference_python() -> Path:
    py = vllm_venv() / "bin" / "python"
    if not py.is_file():
        raise FileNotFoundError(
            f"{py} not found: the transformers references run in the vLLM venv; build it with "
            f"{SETUP_SCRIPT} (or set JFP8RL_VLLM_VENV to an existing one)"
        )
    return py


def run_reference(
    kind: str, *, arrays: dict[str, np.ndarray] | None = None, timeout_s: float = 600, **fields: Any
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Runs job `kind` with JSON `fields` and .npy `arrays`; returns (meta, result arrays)."""
    with tempfile.TemporaryDirectory(prefix="transformers_ref_") as tmp:
        tmp_dir = Path(tmp)
        job = {"kind": kind, **fields}
        for name, value in (arrays or {}).items():
            path = tmp_dir / f"{name}.npy"
            np.save(path, np.asarray(value), allow_pickle=False)
            job[name] = str(path)
        (tmp_dir / "job.json").write_text(json.dumps(job))
        proc = subprocess.run(
            [str(reference_python()), str(SCRIPT), str(tmp_dir / "job.json"), str(tmp_dir)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"transformers reference job {kind!r} failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-4000:]}"
            )
        meta = json.loads((tmp_dir / "result.json").read_text())
        with np.load(tmp_dir / "result.npz", allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    return meta, out
