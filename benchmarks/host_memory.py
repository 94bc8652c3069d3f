"""Peak host RSS of GRPO steps on a random-weight model (target <= 14 GB for
qwen3_0.6b, 2 prompts x 4 samples x 16 tokens, 2 steps).

    python benchmarks/host_memory.py                      # qwen3_0.6b, the target's run
    python benchmarks/host_memory.py --preset tiny_qwen3  # seconds, for development
    python benchmarks/host_memory.py --steps 6            # is the resident set flat?

Builds the random HF folder once (scripts/make_random_hf.py, cached under --work), then runs

    /usr/bin/time -v python -m jfp8rl.train --config configs/tiny_cpu.yaml model.path=<folder>
        algorithm.name=grpo data.batch_size=2 rollout.n=4 rollout.max_tokens=16
        rollout.dynamic_sampling=false train.steps=2 train.mini_batches=2 train.ppo_epochs=1
        [--extra overrides]

in a fresh run folder with JFP8RL_DEBUG_MEMORY=1, so the trainer logs its RSS at every stage
boundary (`memory: <stage> rss X GiB peak Y GiB`, jfp8rl/observe/memory.py). Prints those lines, then
`host_memory: <preset> peak RSS X.XX GB (target 14 GB) ...` from `/usr/bin/time -v`'s maximum
resident set size (GB = 1e9 bytes). With `--steps N` (N > 2) it also prints a table of the
resident set at each stage boundary (rollout, prepare, update, sync, ...) of every step and
`host_memory: steady ... spread X.XX GiB (target 0.25 GiB)`: the largest difference between
steps 2..N at the same stage; a leak (anything kept alive from one step into the next) grows
it step by step. `--extra data.eval_size=8` cuts
the two greedy evals (256 prompts, slow at 0.6B on a CPU) without
changing the peak: the eval generates in chunks of data.batch_size x rollout.n prompts, the
rollout's own size. Refuses to start when the machine
has less available memory than the target plus a margin (`--min-available-gb`): the box is
shared.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.make_random_hf import make_random_hf  # noqa: E402

RUN_OVERRIDES = (
    "algorithm.name=grpo",
    "data.batch_size=2",
    "rollout.n=4",
    "rollout.max_tokens=16",
    "rollout.dynamic_sampling=false",
    "train.mini_batches=2",
    "train.ppo_epochs=1",
)
MEMORY_LINE = re.compile(r"memory: (?P<stage>[a-z]+) (?P<step>\d+) rss (?P<rss>[\d.]+) GiB")
STEADY_TARGET_GIB = 0.25


def stage_table(stdout: str, steps: int) -> tuple[str, float]:
    """(markdown table of the resident set per stage and step, the largest spread over
    steps 2..N of one stage), from the trainer's `memory: <stage> <step> rss X GiB` lines."""
    rss: dict[str, dict[int, float]] = {}
    for m in MEMORY_LINE.finditer(stdout):
        rss.setdefault(m["stage"], {})[int(m["step"])] = float(m["rss"])
    cols = list(range(1, steps + 1))
    lines = ["| stage | " + " | ".join(f"step {c}" for c in cols) + " | spread 2..N |",
             "|---|" + "---|" * (len(cols) + 1)]  # fmt: skip
    worst = 0.0
    for stage, by_step in rss.items():
        later = [by_step[c] for c in cols[1:] if c in by_step]
        spread = max(later) - min(later) if len(later) > 1 else 0.0
        if len(later) == steps - 1:
            worst = max(worst, spread)
        cells = [f"{by_step[c]:.2f}" if c in by_step else "" for c in cols]
        lines.append(f"| {stage} | " + " | ".join(cells) + f" | {spread:.2f} |")
    return "\n".join(lines), worst


def available_gb() -> float:
    """MemAvailable of /proc/meminfo in GB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def tree_rss_gb(pid: int) -> float:
    """Summed VmRSS (GB) of process `pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024 / 1e9
        except OSError:
            pass
    return total


def run_watched(cmd: list[str], env: dict[str, str], kill_above_gb: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cmd`; killed (exit -9) if its process tree's RSS passes
    `kill_above_gb` or the machine has under 1.5 GB available, so a regression cannot push the
    shared machine into swap or the OOM killer."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=err, text=True, cwd=ROOT, start_new_session=True
        )
        while proc.poll() is None:
            if (rss := tree_rss_gb(proc.pid)) > kill_above_gb or available_gb() < 1.5:
                print(f"host_memory: RSS {rss:.1f} GB (limit {kill_above_gb} GB), "
                      f"{available_gb():.1f} GB left: killing the run", flush=True)  # fmt: skip
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the run's tree only
            time.sleep(0.5)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_0.6b")
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: all)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "host_memory"))
    ap.add_argument("--extra", nargs="*", default=[], help="more dotted overrides")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps (> 2: the steady table)")
    ap.add_argument("--target-gb", type=float, default=14.0)
    ap.add_argument("--min-available-gb", type=float, default=18.0)
    ap.add_argument("--kill-above-gb", type=float, default=17.0)
    a = ap.parse_args()

    work = Path(a.work)
    name = a.preset + (f"_{a.layers}layers" if a.layers else "")
    folder = work / f"random_{name}"
    if not (folder / "model.safetensors").is_file():
        print(f"writing {folder} ...", flush=True)
        make_random_hf(a.preset, folder, layers=a.layers)
    if a.preset.startswith("tiny") or a.layers:
        a.min_available_gb = min(a.min_available_gb, 8.0)
    if (avail := available_gb()) < a.min_available_gb:
        print(f"host_memory: only {avail:.1f} GB available (< {a.min_available_gb}); not run")
        return 3
    run_dir = work / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.path={folder}", f"run_dir={run_dir}", *RUN_OVERRIDES,
                 f"train.steps={a.steps}", *a.extra]  # fmt: skip
    cmd = [
        "/usr/bin/time", "-v", "nice", "-n", "10", sys.executable, "-m", "jfp8rl.train",
        "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), *overrides,
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "JFP8RL_DEBUG_MEMORY": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    rc, stdout, stderr = run_watched(cmd, env, a.kill_above_gb)
    wall = time.perf_counter() - t0
    for line in stdout.splitlines():
        if line.startswith(("memory:", "base policy", "done:")) or "step" in line[:12]:
            print("  " + line)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    peak_gb = int(m.group(1)) * 1024 / 1e9 if m else float("nan")
    if rc:
        print(stderr[-3000:])
    ok = rc == 0 and peak_gb <= a.target_gb
    if a.steps > 2:
        table, spread = stage_table(stdout, a.steps)
        print("resident set (GiB) at each stage boundary:\n" + table)
        steady = spread <= STEADY_TARGET_GIB
        print(
            f"host_memory: steady {name} steps 2..{a.steps} same-stage spread {spread:.2f} GiB "
            f"(target {STEADY_TARGET_GIB} GiB): {'met' if steady else 'NOT met'}"
        )
        ok = ok and steady
    print(
        f"host_memory: {name} peak RSS {peak_gb:.2f} GB (target {a.target_gb:g} GB) "
        f"exit {rc} wall {wall:.0f} s: {'met' if ok else 'NOT met'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
