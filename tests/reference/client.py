"""Runs transformers reference jobs (tests/reference/transformers_ref.py) in the vLLM venv.

The project venv has no torch (Python 3.12; PyTorch's CPU wheel here is for 3.11 only), the
vLLM venv (`scripts/setup_vllm_env.sh`, Python 3.11) has torch 2.13 cpu and transformers. Files
in, files out, no pickle. `run_reference` runs one job in its own subprocess (~5 s of
torch/transformers import; `scripts/make_model_golden.py` uses it); `ReferenceWorker` keeps one
subprocess for many jobs (the test session's, fixture `transformers_ref` in tests/conftest.py),
paying the import once.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout_bridge"))
from bridge_support import SETUP_SCRIPT, vllm_venv  # noqa: E402  (one owner of the venv's path)

SCRIPT = Path(__file__).resolve().parent / "transformers_ref.py"
# verl's rollout-correction reference (same protocol), run in the verl venv (verl_env.py).
VERL_SCRIPT = Path(__file__).resolve().parent / "verl_ref.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}


def reference_python() -> Path:
    py = vllm_venv() / "bin" / "python"
    if not py.is_file():
        raise FileNotFoundError(
            f"{py} not found: the transformers references run in the vLLM venv; build it with "
            f"{SETUP_SCRIPT} (or set JFP8RL_VLLM_VENV to an existing one)"
        )
    return py


def _write_job(tmp_dir: Path, kind: str, arrays: dict | None, fields: dict) -> Path:
    job = {"kind": kind, **fields}
    for name, value in (arrays or {}).items():
        path = tmp_dir / f"{name}.npy"
        np.save(path, np.asarray(value), allow_pickle=False)
        job[name] = str(path)
    (tmp_dir / "job.json").write_text(json.dumps(job))
    return tmp_dir / "job.json"


def _read_result(tmp_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads((tmp_dir / "result.json").read_text())
    with np.load(tmp_dir / "result.npz", allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    return meta, out


def run_reference(
    kind: str,
    *,
    arrays: dict[str, np.ndarray] | None = None,
    timeout_s: float = 600,
    script: Path = SCRIPT,
    python: Path | None = None,
    **fields: Any,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Runs job `kind` of `script` (transformers_ref.py unless given) with JSON `fields` and
    .npy `arrays` under `python` (the vLLM venv's unless given); returns (meta, result
    arrays)."""
    with tempfile.TemporaryDirectory(prefix="transformers_ref_") as tmp:
        tmp_dir = Path(tmp)
        job = _write_job(tmp_dir, kind, arrays, fields)
        proc = subprocess.run(
            [str(python or reference_python()), str(script), str(job), str(tmp_dir)],
            capture_output=True, text=True, timeout=timeout_s, env=ENV,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"reference job {kind!r} of {script.name} failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-4000:]}"
            )
        return _read_result(tmp_dir)


class ReferenceWorker:
    """`worker(kind, arrays=..., **fields)`, as `run_reference`, in one long-lived
    `transformers_ref.py --serve` process (started at the first job; `close` ends it). Its
    stderr goes to a log file, quoted when a job fails."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkstemp(prefix="transformers_ref_", suffix=".log")[1])

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            with self.log.open("a") as log:
                self.proc = subprocess.Popen(
                    [str(reference_python()), str(SCRIPT), "--serve"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, text=True, env=ENV,
                )  # fmt: skip
        return self.proc

    def _answer(self, proc: subprocess.Popen, kind: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                self.close()
                raise TimeoutError(
                    f"transformers reference job {kind!r}: no answer in {timeout_s:.0f} s; "
                    f"log {self.log}"
                )
            line = proc.stdout.readline()
            if line:
                return line.rstrip("\n")
            self.close()
            raise RuntimeError(
                f"transformers reference worker exited (job {kind!r}); log {self.log}:\n"
                f"{self.log.read_text()[-4000:]}"
            )

    def __call__(
        self,
        kind: str,
        *,
        arrays: dict[str, np.ndarray] | None = None,
        timeout_s: float = 600,
        **fields: Any,
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        proc = self._start()
        with tempfile.TemporaryDirectory(prefix="transformers_ref_") as tmp:
            tmp_dir = Path(tmp)
            job = _write_job(tmp_dir, kind, arrays, fields)
            proc.stdin.write(json.dumps([str(job), str(tmp_dir)]) + "\n")
            proc.stdin.flush()
            answer = self._answer(proc, kind, timeout_s)
            if answer != "ok":
                error = json.loads(answer.removeprefix("error "))
                raise RuntimeError(f"transformers reference job {kind!r} failed:\n{error}")
            return _read_result(tmp_dir)

    def close(self) -> None:
        """Ends the worker (idempotent): stdin closed, killed if it does not exit."""
        if self.proc is None:
            return
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
