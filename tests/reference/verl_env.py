"""The verl reference venv (verl 0.9.1 from PyPI, built and cached by scripts/setup_verl_env.sh),
where tests/reference/verl_ref.py runs. Used by the test process, never inside that venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

SETUP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_verl_env.sh"


def ensure_verl_env(timeout_s: float = 1800) -> Path:
    """The venv's python, after the (cached, idempotent) setup script. Raises RuntimeError
    with the script's output when it cannot build the venv (no index, no python3.11, ...)."""
    try:
        proc = subprocess.run(
            ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{SETUP_SCRIPT} ran past {timeout_s:.0f} s") from e
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"{SETUP_SCRIPT} failed (exit {proc.returncode}): {last}\n{proc.stderr[-2000:]}"
        )
    return Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"
