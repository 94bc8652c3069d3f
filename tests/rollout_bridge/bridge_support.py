"""Shared helpers of the rollout_bridge tests (and of the trainer tests and benchmarks that run
rollout servers).

Servers, each a context manager that always tears its server down:
  `VllmServer`    a real `vllm serve` from the isolated venv built by
                  `scripts/setup_vllm_env.sh` (docs/rollout.md section 5), on 127.0.0.1, in its
                  own process group (vLLM forks an engine core process; killing only the parent
                  would leak it);
  `ServeProcess`  `python -m rollout_bridge.serve` as a real subprocess;
  `FakeServer`    a stdlib stand-in for the failure paths a real server cannot show on demand
                  (an aborted request, a 503, a hang, a dropped connection, malformed JSON).
Data: `small_hf_state` (an HF-named state with awkward shapes), `sharp_hf_state` (a tiny
model's random weights, sharpened), `flip_tensor_bit` (tamper with one tensor of an export),
`bf16_reference` (bfloat16 rounding by bit arithmetic, independent of ml_dtypes and jax).
Checks: `our_logprobs` (the project's teacher-forced log-probs, what a server's `score` is
compared with), `max_diff`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from models import fp8
from models.functional import token_logprobs
from models.hf_io import random_hf_state_dict
from rollout_bridge.weights import TENSOR_FILE
from rollout_bridge.weights.safetensors_io import read_safetensors_header

ROOT = Path(__file__).resolve().parents[2]  # the checkout under test
SETUP_SCRIPT = ROOT / "scripts" / "setup_vllm_env.sh"
TINY_VLLM_KEY = "tiny-vllm-key"  # the API key of the session's tiny vLLM (conftest.py)


# -- a real vLLM ------------------------------------------------------------------------------


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
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.env = dict(env or {})
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
        env.update(self.env)
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


# -- `python -m rollout_bridge.serve` ------------------------------------------------------


class ServeProcess:
    """One `rollout_bridge.serve` process on a free loopback port, in its own process group.

    srv = ServeProcess(model_dir, log_path)   # starts it
    srv.wait_healthy()                        # polls /health; start several, then wait
    srv.url, srv.kill()                       # SIGKILL of its process group (a crash)
    srv.memory_kib()                          # its resident memory, now and at peak
    """

    def __init__(
        self,
        model_dir: Path,
        log: Path,
        *,
        recipe: str = "fp8_block",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_bridge.serve", "--model", str(model_dir),
             "--port", str(self.port), "--recipe", recipe, *args],
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

    def memory_kib(self) -> dict[str, int]:
        """The server process's VmRSS (resident now) and VmHWM (peak resident), in KiB, from
        /proc/<pid>/status."""
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
        return out

    def kill(self) -> None:
        """SIGKILL to its process group (idempotent): the server dies as in a crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


# -- a stand-in server -----------------------------------------------------------------------

# (status, body): a JSON-able body, or bytes sent as they are. None: no answer, the connection
# is closed unanswered.
Answer = tuple[int, Any] | None


class FakeServer:
    """`url`; `log` of (method, path with query, headers, JSON body) per request; `version`."""

    def __init__(self, version: str = "base", model: dict[str, Any] | None = None) -> None:
        self.version = version
        self.model = model or {"id": "fake"}
        self.log: list[tuple[str, str, dict[str, str], Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._stopped = False
        threading.Thread(  # a short poll: `stop` returns at once
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    @property
    def hits(self) -> Counter[str]:
        """Requests per route (the path without its query)."""
        return Counter(path.split("?")[0] for _, path, _, _ in self.log)

    def answer(self, route: str, body: Any) -> Answer:
        """The answer to a request on `route` (the path without its query)."""
        if route == "/v1/models":
            return 200, {"data": [self.model]}
        if route == "/weight_info":
            return 200, {"weight_version": self.version}
        if route == "/finish_weight_update":
            self.version = body["weight_version"]
        return 200, {}

    def stop(self) -> None:
        """Stops serving and closes the listening socket (a later connect is refused)."""
        if not self._stopped:
            self._stopped = True
            self.server.shutdown()
            self.server.server_close()

    def close(self) -> None:
        self.stop()


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            fake.log.append((self.command, self.path, dict(self.headers), body))
            out = fake.answer(self.path.split("?")[0], body)
            if out is None:
                self.close_connection = True
                return
            status, payload = out
            raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = _answer

    return Handler


# -- data ------------------------------------------------------------------------------------


def small_hf_state(seed: int = 0) -> dict[str, np.ndarray]:
    """A small HF-named state with linears of non-multiple-of-128 shapes, a bias and a norm."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.normal(size=(40, 24)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(200, 300)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.normal(size=(200,)).astype(np.float32),
        "model.layers.0.mlp.down_proj.weight": (
            rng.normal(size=(130, 129)) * np.geomspace(1e-3, 1e2, 129)
        ).astype(np.float32),
        "model.layers.0.input_layernorm.weight": rng.normal(size=(24,)).astype(np.float32),
        "model.norm.weight": np.ones((24,), np.float32),
    }


def sharp_hf_state(cfg: Any, seed: int) -> dict[str, np.ndarray]:
    """`models.hf_io.random_hf_state_dict`, sharpened: HF init N(0, 0.02) gives near-uniform
    logits (greedy ties, dull samples); the embedding (the tied head) x 8 and the other
    matrices x 4 give a mean sampled logprob of ~ -5 instead of ~ -ln(512), samples still
    diverse."""
    hf = random_hf_state_dict(cfg, seed)
    return {k: v * (8.0 if "embed" in k else 4.0) if v.ndim == 2 else v for k, v in hf.items()}


def flip_tensor_bit(export_dir: Path, which: str | int, *, bit: int = 0x40) -> str:
    """Flips one bit in the middle of a tensor of an export's file: "first", "middle", "last"
    (in file order) or the index in file order; returns the tensor's name."""
    path = export_dir / TENSOR_FILE
    header, start, _ = read_safetensors_header(path)
    names = sorted(
        (n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"]
    )
    picks = {"first": 0, "middle": len(names) // 2, "last": len(names) - 1}
    name = names[picks[which] if isinstance(which, str) else which]
    lo, hi = header[name]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + (lo + hi) // 2] ^= bit
    path.write_bytes(bytes(data))
    return name


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float64 by bit arithmetic (round to nearest, ties to even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


@contextlib.contextmanager
def serve_processes(model_dir: Path, logs: Path, n: int) -> Iterator[list[ServeProcess]]:
    """`n` `rollout_bridge.serve` processes of `model_dir` started together (logs
    `logs/serve<k>.log`), healthy on entry, killed on exit."""
    procs = [ServeProcess(model_dir, logs / f"serve{k}.log") for k in range(n)]
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.kill()


# -- checks against a server's scores -----------------------------------------------------------


def our_logprobs(
    graphdef: Any, params: Any, seqs: Sequence[Sequence[int]], recipe: str = "bf16"
) -> list[np.ndarray]:
    """Teacher-forced logprobs of our model on right-padded sequences, entry 0 = 0 (the layout
    of `HttpBackend.score`)."""
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros_like(tokens)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = 1
    lp = token_logprobs(
        graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), recipe=fp8.get_recipe(recipe)
    )
    lp = np.asarray(lp)
    return [lp[i, : len(s)] for i, s in enumerate(seqs)]


def max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))
