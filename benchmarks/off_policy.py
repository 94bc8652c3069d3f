"""One-step off-policy rollout (`rollout.max_staleness` 1) against on-policy (0), one run.

Two `python -m rollout_bridge.serve` processes on loopback serve the tiny default's base policy
(`configs/tiny_cpu.yaml`, its warm-started policy built or taken from the cache); the trainer
runs the same config over them (`rollout.urls`) for `--steps` steps at `max_staleness` 0, then
at 1 (`--order 0,1`; `--order 0,1,1,0` alternates, so that a machine whose load drifts weighs
on both alike), each run in a fresh run folder under `--out` and with fresh servers (so no run
inherits another's pushed weights). Printed per run, and the medians pooled per setting:

  s/step      median `timing/step_s` over steps 2..N (rollout, update, wait, weight push; the
              first step's compiles and the greedy evals are left out)
  rollout_s   median time the trainer waited for its batch (at 1: what sampling ahead hid)
  train_s     median prepare + update time
  eval        greedy eval accuracy at step 0 and every `--eval-every` steps (the learning)

and the last line

    off_policy: s/step max_staleness=1 / max_staleness=0 = X.XXx (< 1: faster)

The trainer and both servers share this machine's cores: on a CPU the overlap saves at most
what the cores left idle by the serial loop, much less than on separate GPUs.

    .venv/bin/python benchmarks/off_policy.py [--steps 50] [--eval-every 25] [--order 0,1]
        [--out /tmp/off_policy] [--extra key=value ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from jfp8rl.config import load_config
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.trainer.loop import run
from jfp8rl.trainer.policy import load_policy

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
sys.path.insert(0, str(ROOT / "tests" / "rollout_bridge"))
from bridge_support import ServeProcess  # noqa: E402


def one_run(
    i: int, staleness: int, policy: Path, out: Path, args: argparse.Namespace
) -> tuple[list[dict], float]:
    """The metrics records of run `i` at `staleness` over two fresh servers; its wall seconds."""
    run_dir = out / f"run{i}_staleness{staleness}"
    shutil.rmtree(run_dir, ignore_errors=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [ServeProcess(policy, logs / f"serve{i}_{k}.log") for k in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        urls = ",".join(s.url for s in servers)
        cfg = load_config(TINY, [
            f"run_dir={run_dir}", f"model.path={policy}", "rollout.backend=http",
            f"rollout.urls=[{urls}]", f"rollout.max_staleness={staleness}",
            f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
            "logging.console=none", *args.extra,
        ])  # fmt: skip
        t0 = time.perf_counter()
        run(cfg)
        return read_metrics(run_dir), time.perf_counter() - t0
    finally:
        for s in servers:
            s.kill()


def median(runs: list[list[dict]], key: str) -> float:
    """The median of `key` over steps 2..N of `runs`."""
    return statistics.median(r[key] for recs in runs for r in recs[2:] if key in r)


def row(name: str, runs: list[list[dict]], wall: str, evals: str) -> str:
    return (f"{name:>16} {median(runs, 'timing/step_s'):8.3f} "
            f"{median(runs, 'timing/rollout_s'):9.3f} {median(runs, 'timing/train_s'):8.3f} "
            f"{wall:>7}  {evals}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--order", default="0,1", help="max_staleness of each run, in order")
    ap.add_argument("--out", type=Path, default=Path("/tmp/off_policy"))
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides")
    args = ap.parse_args()
    cfg = load_config(TINY, [f"run_dir={args.out / 'base'}", *args.extra])
    policy = Path(load_policy(cfg, log=print).path)  # the warm-started base policy (cached)
    order = [int(x) for x in args.order.split(",")]
    runs = [(s, *one_run(i, s, policy, args.out, args)) for i, s in enumerate(order)]
    print(
        f"{'max_staleness':>16} {'s/step':>8} {'rollout_s':>9} {'train_s':>8} {'wall_s':>7}  eval"
    )
    for s, recs, wall in runs:
        evals = " ".join(f"{r['step']}:{r['eval/accuracy']:.3f}"
                         for r in recs if r.get("eval/accuracy") is not None)  # fmt: skip
        print(row(str(s), [recs], f"{wall:.1f}", evals))
    pooled = {s: [recs for t, recs, _ in runs if t == s] for s in sorted(set(order))}
    for s, group in pooled.items():
        print(row(f"{s} (all runs)", group, "", ""))
    ratio = median(pooled[1], "timing/step_s") / median(pooled[0], "timing/step_s")
    print(f"off_policy: s/step max_staleness=1 / max_staleness=0 = {ratio:.2f}x (< 1: faster)")


if __name__ == "__main__":
    main()
