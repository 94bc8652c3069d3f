"""Multi-process JAX (docs/design.md section 9): two trainer processes x 2 forced CPU
devices == one process x 4 devices, and a two-process run resumes exactly.

Real processes on 127.0.0.1 (`scripts/launch_cluster.sh --local 2`: `jax.distributed` with a
free coordinator port, CPU collectives through gloo), the tiny config in f32 compute with the
BF16 training recipe on a data=2 x fsdp=2 mesh (the data axis spans the two processes, FSDP
stays inside each), 3 RL steps with the embedded rollout engine on process 0:

* 2 x 2 against 1 x 4 (the same mesh in one process): every step's metrics (loss, grad norm,
  clip fractions, calibrated bounds, rewards) within 1e-5 relative and the final params
  (`hf_final`, gathered from both processes and written by process 0) within 1e-5; measured
  on jax 0.11.2: params equal bit for bit, metrics within 1.2e-7 (gloo sums in another order);
* a run killed after checkpoint 2 (its folder as the kill leaves it: checkpoint 3 and the
  export not there yet; orbax saves are atomic) and resumed by two new processes equals the
  uninterrupted two-process run exactly: step 3's metrics and the final params;
* process 0 alone wrote the run folder: one metrics record per step;
* the final export failing on process 0 (before its first tensor, while process 1 waits in the
  export's per-tensor gathers) stops both processes with exit 1 and the export command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_run import REPO, TINY, small

from jfp8rl.observe.metrics import read_metrics
from models.hf_io import read_safetensors

SUPPORT = Path(__file__).resolve().parents[1]  # tests/jfp8rl: tiny_run.py
LAUNCH = REPO / "scripts" / "launch_cluster.sh"
TIMING_PREFIXES = ("timing/", "throughput/")
OVERRIDES = (
    "train.recipe=bf16", "train.steps=3", "train.ppo_epochs=1", "train.eval_every=0",
    "checkpoint.every=1", "train.mesh.data=2", "train.mesh.fsdp=2", "logging.console=line",
    "algorithm.clip=plain",
)  # fmt: skip


def env(devices: int) -> dict[str, str]:
    return dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
        PYTHONPATH=os.pathsep.join([str(REPO), str(SUPPORT)]),
    )


def start(
    procs: int, run_dir: Path, cache_dir: Path, *flags: str, last: tuple[str, ...] = ()
) -> subprocess.Popen:
    """The trainer on `run_dir`: one process with 4 devices, or `procs` processes (launcher)
    with 4 / procs devices each; output in `run_dir`.log (or .log/proc-i.log). `last`:
    overrides after OVERRIDES (they win)."""
    train = ["--config", str(TINY), *flags, *small(run_dir, cache_dir, *OVERRIDES, *last)]
    log = Path(f"{run_dir}.log")
    if procs == 1:
        cmd = [sys.executable, "-m", "jfp8rl.train", *train]
        return subprocess.Popen(cmd, env=env(4), stdout=log.open("w"), stderr=subprocess.STDOUT)
    cmd = [
        str(LAUNCH), "--local", str(procs), "--port", "0", "--python", sys.executable,
        "--log-dir", str(log), "--", *train,
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env(4 // procs))


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    rc = proc.wait(timeout=900)
    log = Path(f"{run_dir}.log")
    files = sorted(log.glob("proc-*.log")) if log.is_dir() else [log]
    text = "\n".join(f"== {f}\n{f.read_text()[-3000:]}" for f in files)
    assert rc == 0, text


def compare(a: Path, b: Path) -> tuple[float, float, float]:
    """(max relative diff of the non-timing metrics over steps 1.., the same for
    actor/pg_loss, max |diff| of the final params) between runs a and b."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [0, 1, 2, 3]
    metrics = loss = 0.0
    for x, y in zip(ra[1:], rb[1:], strict=True):
        assert x.keys() == y.keys(), (x["step"], x.keys() ^ y.keys())
        for k, v in x.items():
            if k.startswith(TIMING_PREFIXES) or v is None:
                assert k.startswith(TIMING_PREFIXES) or y[k] is None, (x["step"], k)
                continue
            d = abs(v - y[k]) / max(1.0, abs(v))
            metrics = max(metrics, d)
            loss = max(loss, d) if k == "actor/pg_loss" else loss
    pa = read_safetensors(a / "hf_final" / "model.safetensors")
    pb = read_safetensors(b / "hf_final" / "model.safetensors")
    assert pa.keys() == pb.keys()
    params = max(float(np.max(np.abs(pa[k].astype(np.float64) - pb[k]))) for k in pa)
    return metrics, loss, params


@pytest.mark.slow
def test_two_processes_match_one_and_resume_exactly(
    base_policy_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    one, two, resumed = tmp_path / "one_x4", tmp_path / "two_x2", tmp_path / "resumed"
    jobs = [(start(1, one, cache_dir), one), (start(2, two, cache_dir), two)]
    for proc, run_dir in jobs:
        finish(proc, run_dir)
    logs = [(two.with_suffix(".log") / f"proc-{i}.log").read_text() for i in (0, 1)]
    for i, text in enumerate(logs):
        assert f"jfp8rl: process {i} of 2, 2 local of 4 devices (cpu)" in text, text[-2000:]
    metrics, loss, params = compare(one, two)
    print(f"2x2 vs 1x4: metrics {metrics:.3g}, pg_loss {loss:.3g}, params max|diff| {params:.3g}")
    assert metrics <= 1e-5 and loss <= 1e-5 and params <= 1e-5, (metrics, loss, params)
    # Process 0 alone logged: a second writer would have doubled the records.
    assert [r["step"] for r in read_metrics(two)] == [0, 1, 2, 3]

    # The folder a kill during step 3 leaves: checkpoint 3 and the export never written.
    shutil.copytree(two, resumed)
    for leftover in ("checkpoints/3", "hf_final", "summary.json"):
        path = resumed / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["2"]
    finish(start(2, resumed, cache_dir, "--resume"), resumed)
    log0, log1 = ((resumed.with_suffix(".log") / f"proc-{i}.log").read_text() for i in (0, 1))
    assert f"resuming {resumed} from step 2 of 3" in log0, log0[-2000:]
    assert "step 3/3" in log0 and "step 3/3" not in log1  # the console is process 0's
    ra, rb = read_metrics(two), read_metrics(resumed)
    for x, y in zip(ra, rb, strict=True):
        for k, v in x.items():
            if not k.startswith(TIMING_PREFIXES):
                assert y[k] == v, (x["step"], k, v, y[k])
    pa = read_safetensors(two / "hf_final" / "model.safetensors")
    pb = read_safetensors(resumed / "hf_final" / "model.safetensors")
    for k in pa:
        assert (pa[k] == pb[k]).all(), k
    _export_failure_stops_both(two, tmp_path / "broken", cache_dir)


def _export_failure_stops_both(done: Path, run_dir: Path, cache_dir: Path) -> None:
    """The final export fails on process 0 before its first tensor (hf_final is a file)
    while process 1 is in the export's per-tensor gathers: both must stop with the error
    (exit 1, the export command). Resumed at the last step (setup, sync, export only) on an
    fsdp=4 mesh, so each gather crosses the processes (with data=2 x fsdp=2 it stays inside
    each); main's code before the fix hung there (both processes idle until killed)."""
    shutil.copytree(done, run_dir)
    shutil.rmtree(run_dir / "hf_final")
    (run_dir / "summary.json").unlink()
    (run_dir / "hf_final").write_text("a file where the export folder goes")
    mesh = ("train.mesh.data=1", "train.mesh.fsdp=4")
    proc = start(2, run_dir, cache_dir, "--resume", last=mesh)
    try:
        rc = proc.wait(timeout=300)  # a sanity bound: a hang, not a speed target
    except subprocess.TimeoutExpired:
        # SIGTERM does not end a jax.distributed process (JAX takes it as a preemption
        # notice): kill the hung trainers themselves.
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()
        rc = None
    log0, log1 = ((Path(f"{run_dir}.log") / f"proc-{i}.log").read_text() for i in (0, 1))
    assert rc == 1, f"rc {rc}\n{log0[-2000:]}\n{log1[-2000:]}"
    why = f"the final HF export to {run_dir}/hf_final failed"
    assert f"error: {why}" in log0 and f"python -m jfp8rl.export {run_dir} --step 3" in log0
    assert "error: process 0 stopped the run: RunStopped: " + why in log1, log1[-2000:]
    assert (run_dir / "hf_final").read_text() == "a file where the export folder goes"


@pytest.mark.slow
def test_rollout_failure_on_process_0_stops_both(
    base_policy_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Nothing listens on the rollout URL: process 0's error reaches process 1 (no hang), both
    exit 1 naming the server and the resume command."""
    run_dir = tmp_path / "down"
    proc = start(2, run_dir, cache_dir, "rollout.backend=http", "rollout.url=http://127.0.0.1:9")
    assert proc.wait(timeout=600) == 1
    logs = [(tmp_path / "down.log" / f"proc-{i}.log").read_text() for i in (0, 1)]
    down = "rollout server(s) http://127.0.0.1:9 not answering /health"
    assert f"error: {down}" in logs[0]
    assert f"error: process 0 stopped the run: RunStopped: {down}" in logs[1]
    assert all("--resume" in text for text in logs)


@pytest.mark.parametrize(
    ("coordinator", "num", "pid", "match"),
    [
        ("127.0.0.1:1234", 2, -1, "go together"),
        ("", 2, 0, "go together"),
        ("127.0.0.1", 2, 0, "expected host:port"),
        ("127.0.0.1:1234", 2, 2, "must be below --num-processes=2"),
    ],
)
def test_distributed_flags_are_checked(coordinator: str, num: int, pid: int, match: str) -> None:
    from jfp8rl.config import ConfigError
    from jfp8rl.parallel.distributed import initialize

    with pytest.raises(ConfigError, match=match):
        initialize(coordinator, num, pid)


def test_single_process_needs_no_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    from jfp8rl.parallel.distributed import detected_cluster, initialize

    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task allocation stays single-process
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert detected_cluster() == ""
    assert initialize() is False
    assert initialize("127.0.0.1:1234", 1, 0) is False
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert detected_cluster() == ""  # the batch script of a 4-task job: not an srun step
    for var, value in (("SLURM_JOB_ID", "7"), ("SLURM_STEP_NODELIST", "n[0-3]"),
                       ("SLURM_PROCID", "1"), ("SLURM_LOCALID", "0")):  # fmt: skip
        monkeypatch.setenv(var, value)
    assert detected_cluster() == "SLURM"


def test_launcher_dry_run_prints_one_command_per_process(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(LAUNCH), "--dry-run", "--hosts", "n0,n1,n2", "--port", "7000",
         "--vllm", "n3:8000,n4:8001", "--vllm-model", "/m", "--export-root", "/shared/x",
         "--python", "/venv/bin/python", "--", "--config", "c.yaml", "run_dir=/shared/r"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    serve = [line for line in out if "vllm serve /m" in line]
    assert [line.split()[3] for line in serve] == ["n3", "n4"]
    assert all("jfp8rl_shm" in line and "VLLM_SERVER_DEV_MODE=1" in line for line in serve)
    train = [line for line in out if "-m jfp8rl.train" in line]
    assert [line.split()[3] for line in train] == ["n0", "n1", "n2"]
    for i, line in enumerate(train):
        assert line.endswith(f"--coordinator n0:7000 --num-processes 3 --process-id {i}'")
        assert "rollout.backend=http" in line and "rollout.export_root=/shared/x" in line
        assert 'rollout.urls=\\[\\"http://n3:8000\\"\\,\\"http://n4:8001\\"\\]' in line
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key")
    keyed = subprocess.run(
        [str(LAUNCH), "--dry-run", "--hosts", "n0", "--vllm", "n3:8000", "--vllm-model", "/m",
         "--api-key-file", str(key_file), "--", "--config", "c.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "s3cret-key" not in keyed  # read from the file on each host, on no command line
    (serve,) = [line for line in keyed.splitlines() if "vllm serve /m" in line]
    assert f"VLLM_API_KEY=$(cat {key_file})" in serve
    assert "--middleware rollout_bridge.vllm_auth.RequireApiKey" in serve
    assert f"JFP8RL_ROLLOUT_API_KEY=$(cat {key_file})" in keyed
    local = subprocess.run(
        [str(LAUNCH), "--dry-run", "--local", "2", "--port", "0", "--", "--config", "c.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert len(local) == 2 and all("--coordinator 127.0.0.1:" in line for line in local)
    bad = subprocess.run([str(LAUNCH), "--local", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no trainer arguments" in bad.stderr
