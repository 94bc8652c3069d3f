"""`python -m rollout_bridge.serve` as a real subprocess on a free loopback port (a fixture).

srv = ServeProcess(model_dir, log_path)   # starts it (own process group)
srv.wait_healthy()                        # polls /health; start several, then wait
srv.url, srv.kill()                       # SIGKILL of its process group (a crash)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_server import free_port

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    """One `rollout_bridge.serve` process (module docstring); a context manager."""

    def __init__(self, model_dir: Path, log: Path, *, recipe: str = "fp8_block") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_bridge.serve", "--model", str(model_dir),
             "--port", str(self.port), "--recipe", recipe],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            env=env,
        )  # fmt: skip

    def wait_healthy(self, timeout_s: float = 300.0) -> ServeProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout_bridge.serve exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"rollout_bridge.serve did not become healthy in {timeout_s:.0f} s")

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:]

    def kill(self) -> None:
        """SIGKILL to its process group (idempotent): the server dies as in a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
