"""Start a real `vllm serve` for tests and benchmarks, and always tear it down.

The server runs from the isolated venv built by `scripts/setup_vllm_env.sh` (ROLLOUT.md
section 5), bound to 127.0.0.1 on a free port, in its own process group (vLLM forks an engine
core process; killing only the parent would leak it). `VllmServer` is a context manager: the
process group is killed on exit, also when start-up fails. `launch()` starts it without
waiting, so that its start-up runs beside other work; `with` (or `start()`) then waits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup_vllm_env.sh"


def vllm_venv() -> Path:
    return Path(os.environ.get("JFP8RL_VLLM_VENV", Path.home() / ".cache" / "jfp8rl" / "vllm-venv"))


# What the setup script leaves in a venv that is ready, checked without importing vllm (the
# script's own check imports it and reinstalls this checkout: seconds to tens of seconds).
READY_PROBE = """
import importlib.metadata as md, importlib.util as u, sys
md.version("vllm")
assert u.find_spec("vllm") and u.find_spec("xxhash")
assert not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec"))
eps = md.entry_points(group="vllm.general_plugins")
assert any(e.value == "rollout_bridge.vllm_plugin:register" for e in eps)
spec = u.find_spec("rollout_bridge")  # the editable install of this checkout
assert spec and spec.origin and spec.origin.startswith(sys.argv[1] + "/")
"""


def ensure_vllm_env() -> Path:
    """The venv folder, once ready: as the setup script leaves it (probed), else after running
    the (idempotent, cached) script."""
    venv = vllm_venv()
    probe = [str(venv / "bin" / "python"), "-c", READY_PROBE, str(ROOT)]
    if (venv / "bin" / "python").is_file() and subprocess.run(
        probe, cwd="/", capture_output=True
    ).returncode == 0:
        return venv
    proc = subprocess.run(
        ["bash", str(SETUP_SCRIPT), str(venv)], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{SETUP_SCRIPT} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}"
        )
    return venv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`with VllmServer(model_dir) as srv: srv.url` -> a healthy vLLM on 127.0.0.1."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        venv: Path | None = None,
        dtype: str = "float32",
        max_model_len: int = 256,
        startup_timeout_s: float = 300.0,
        extra_args: tuple[str, ...] = (),
        log_path: str | Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.venv = venv or vllm_venv()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = extra_args
        self.log_path = Path(log_path or f"/tmp/jfp8rl-vllm-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.deadline = 0.0

    def command(self) -> list[str]:
        return [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            "0",
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--weight-transfer-config",
            json.dumps({"backend": "jfp8rl_shm"}),
            *self.extra_args,
        ]

    def launch(self) -> VllmServer:
        """Starts the process and returns at once (`wait_healthy` waits): start-up is mostly
        one busy thread, which can run beside the tests' own work on a second core."""
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_LOGGING_LEVEL="INFO",
            TOKENIZERS_PARALLELISM="false",
            # the plugin is imported from this checkout, whichever one the venv's editable
            # install points at
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
        )
        env.pop("JAX_PLATFORMS", None)
        log = open(self.log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: stop() kills the engine core too
        )
        log.close()
        self.deadline = time.monotonic() + self.startup_timeout_s
        return self

    def wait_healthy(self) -> VllmServer:
        """Waits for /health (startup_timeout_s from `launch`); stops it and raises with the
        log's tail if it exits or times out first."""
        assert self.proc is not None, "launch() first"
        while True:  # asked at least once: a server launched long ago may be up already
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise RuntimeError(
                    f"vllm serve exited with {rc} during start-up; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= self.deadline:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"vllm serve not healthy after {self.startup_timeout_s:.0f} s; log "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def start(self) -> VllmServer:
        """Launches it (unless launched already) and waits until it is healthy."""
        if self.proc is None:
            self.launch()
        return self.wait_healthy()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the server's whole process group (no-op if it is gone)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 10 s; idempotent."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # the engine core may outlive the API process
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
