"""The real-model step with exact on-policy rollouts (the recompute skipped) against the
default (the fast engine, the old log-probs recomputed), one run.

Runs `configs/smollm2_135m_math.yaml` (SmolLM2-135M-Instruct from scripts/get_smollm2.sh) for
`--steps` steps twice in fresh run folders under `--out`, alternating `--order` (default
off,exact,exact,off: a load that drifts weighs on both alike):

  off     `rollout.on_policy: off`: the fast engine samples; `prepare` recomputes the old
          log-probs with the trainer's forward
  exact   `rollout.on_policy: exact`: the batch-invariant engine samples, its log-probs are
          the old log-probs (bit-identical to the trainer's), `prepare` skips the recompute

Greedy evals, checkpoints before the last step and the online check are off
(`train.eval_every=0`, `checkpoint.every=1000`, `rollout.on_policy_check_every=0`): only the
step itself is timed.
Printed per setting, medians over steps 2..N of every run of it (the first step compiles):
`timing/step_s` and its split (rollout, prepare, update, sync), then

    on_policy_step: exact/off step = X.XXx (rollout A.AAx, prepare B.BBx, update C.CCx, sync D.DDx)

(< 1: exact is faster). Same prompts, seeds and weights on both sides; the sampled tokens differ
(the engines' numerics differ), so response lengths are printed too.

    .venv/bin/python benchmarks/on_policy_step.py [--steps 4] [--order off,exact,exact,off]
        [--out /tmp/on_policy_step] [--extra key=value ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jfp8rl.config import load_config  # noqa: E402
from jfp8rl.observe.metrics import read_metrics  # noqa: E402
from jfp8rl.trainer.loop import run  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2_135m_math.yaml"
PARTS = ("step_s", "rollout_s", "prepare_s", "update_s", "sync_s")


def one_run(setting: str, run_dir: Path, steps: int, extra: list[str]) -> list[dict]:
    """The config for `steps` steps at `rollout.on_policy=setting`: its step records."""
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [
        f"run_dir={run_dir}", f"rollout.on_policy={setting}", f"train.steps={steps}",
        "train.eval_every=0", "checkpoint.every=1000", "checkpoint.export_hf=false",
        "rollout.on_policy_check_every=0", "logging.console=line", *extra,
    ]  # fmt: skip
    run(load_config(CONFIG, sets), resume="never")
    return [r for r in read_metrics(run_dir) if "timing/step_s" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--order", default="off,exact,exact,off")
    ap.add_argument("--out", default="/tmp/on_policy_step")
    ap.add_argument("--extra", nargs="*", default=[], help="more dotted overrides")
    a = ap.parse_args()
    order = a.order.split(",")
    if a.steps < 2 or set(order) - {"off", "exact"}:
        ap.error("--steps >= 2 and --order of off / exact")
    pooled: dict[str, dict[str, list[float]]] = {s: {k: [] for k in PARTS} for s in order}
    lengths: dict[str, list[float]] = {s: [] for s in order}
    for i, setting in enumerate(order):
        recs = one_run(setting, Path(a.out) / f"{i}_{setting}", a.steps, a.extra)
        for r in recs:
            if r["step"] >= 2:
                for k in PARTS:
                    pooled[setting][k].append(r[f"timing/{k}"])
                lengths[setting].append(r["response_length/mean"])
    med = {s: {k: statistics.median(v) for k, v in parts.items()} for s, parts in pooled.items()}
    print(f"\n{CONFIG.name}, steps 2..{a.steps} of runs {a.order}; medians, seconds")
    print("| setting | " + " | ".join(PARTS) + " | response length |")
    print("|---|" + "---|" * (len(PARTS) + 1))
    for s in ("off", "exact"):
        cells = " | ".join(f"{med[s][k]:.2f}" for k in PARTS)
        print(f"| {s} | {cells} | {statistics.mean(lengths[s]):.1f} |")
    r = {k: med["exact"][k] / med["off"][k] for k in PARTS}
    print(
        f"on_policy_step: exact/off step = {r['step_s']:.2f}x (rollout {r['rollout_s']:.2f}x, "
        f"prepare {r['prepare_s']:.2f}x, update {r['update_s']:.2f}x, sync {r['sync_s']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
