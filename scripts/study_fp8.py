"""The FP8 study's RL arms and its tables (docs/fp8_study.md), from commands.

    python scripts/study_fp8.py commands [--seeds 0,1] [--config C] [--set "k=v k=v"]
        One `python -m jfp8rl.train` command per arm (configs/study_scratchpad.yaml, or
        `--config`, + the arm's overrides + `--set`'s, which come last).
    python scripts/study_fp8.py run --jobs 3 [--arms a,b] [--seeds 0] [--nice 10]
        Runs the arms' commands (at `nice -n NICE`), `--jobs` at a time, logging each to
        runs/study/<arm>_s<seed>.log; skips arms whose run folder has a summary.json.
    python scripts/study_fp8.py collect [--root runs/study] [--dest results/study/arms]
        Copies each finished run's metrics.jsonl, config.yaml, summary.json (no checkpoints).
    python scripts/study_fp8.py table [--root runs/study] [--arms a,b] [--seeds 0,1]
        The final table per arm (mean and spread over seeds: final and best greedy eval
        accuracy, peak entropy, garbled rate, clip shares by sign, L / H, mismatch KL, wall
        time) from each run's metrics.jsonl, in markdown; `--arms` / `--seeds` keep only those
        runs (matched seeds for a side-by-side comparison).
    python scripts/study_fp8.py steps [--root runs/study] [--arms a,b]
        One row per run and step (reward, mismatch KL, clip shares by sign, L / H, entropy,
        eval accuracy where the step evaluated), in markdown: short runs step by step.
    python scripts/study_fp8.py audit-diff DIR_A DIR_B [DIR_C ...]
        `python -m jfp8rl.audit` outputs side by side (e.g. the base policy and RL
        checkpoints), matched by (recipe, grad, updates): noise floor, ratio spreads, and the
        FP8-minus-BF16-shadow differences of the clip shares (also in tokens) and balances.

Arms: BF16; FP8 tensor and FP8 block, each with plain clipping, calibrated `track`,
calibrated `hold`, and lower-only (`hold`, `upper_rule: plain`); FP8 tensor plain and hold
again with E5M2 output gradients (`<arm>_e5m2`: `train.grad_format=e5m2`, the backward GEMMs'
gradient operand; the E4M3 arms keep the default); FP8 block plain and hold with exact
on-policy rollouts (`fp8_block_exact_<clip>`: `rollout.on_policy=exact`). Token TIS (C = 2)
in all; the rollout engine uses the arm's recipe (BF16 rollouts for the BF16 arm).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CONFIG = "configs/study_scratchpad.yaml"
ROOT = "runs/study"

CLIPS: dict[str, list[str]] = {
    "plain": ["algorithm.clip=plain"],
    "track": ["algorithm.clip=calibrated", "calibration.mode=track"],
    "hold": ["algorithm.clip=calibrated", "calibration.mode=hold"],
    "lower": ["algorithm.clip=calibrated", "calibration.mode=hold", "calibration.upper_rule=plain"],
}
# The key arms first (they get the second seed when time allows).
ARMS: dict[str, list[str]] = {"bf16": ["train.recipe=bf16", "rollout.recipe=bf16", *CLIPS["plain"]]}
for _recipe in ("fp8_tensor", "fp8_block"):
    for _clip, _sets in CLIPS.items():
        ARMS[f"{_recipe}_{_clip}"] = [
            f"train.recipe={_recipe}",
            f"rollout.recipe={_recipe}",
            *_sets,
        ]
# E5M2 gradients (the study's stress list): the per-tensor arms, plain and hold.
for _clip in ("plain", "hold"):
    ARMS[f"fp8_tensor_{_clip}_e5m2"] = [*ARMS[f"fp8_tensor_{_clip}"], "train.grad_format=e5m2"]
# Exact on-policy rollouts (`rollout.on_policy=exact`: the engine's log-probs equal the
# trainer's bit for bit, and the trainer takes them as the old log-probs), plain and `hold`.
for _clip in ("plain", "hold"):
    ARMS[f"fp8_block_exact_{_clip}"] = [*ARMS[f"fp8_block_{_clip}"], "rollout.on_policy=exact"]
KEY_ARMS = ("bf16", "fp8_tensor_plain", "fp8_tensor_hold")


def command(
    arm: str, seed: int, root: str = ROOT, config: str = CONFIG, extra: tuple[str, ...] = ()
) -> list[str]:
    """The training command of one arm and seed (`extra`: overrides after the arm's)."""
    return [
        "python", "-m", "jfp8rl.train", "--config", config, f"run_dir={root}/{arm}_s{seed}",
        f"train.seed={seed}", *ARMS[arm], *extra,
    ]  # fmt: skip


def run_all(
    jobs: list[tuple[str, int]],
    parallel: int,
    root: str,
    nice: int = 10,
    config: str = CONFIG,
    extra: tuple[str, ...] = (),
) -> None:
    """Runs the commands, `parallel` at a time, at `nice -n nice`, each logging to its own
    file."""
    pending, live = list(jobs), []
    t0 = time.time()
    while pending or live:
        while pending and len(live) < parallel:
            arm, seed = pending.pop(0)
            if (Path(root) / f"{arm}_s{seed}" / "summary.json").is_file():
                continue
            log = Path(root) / f"{arm}_s{seed}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            argv = command(arm, seed, root, config, extra)
            cmd = ["nice", "-n", str(nice), sys.executable, *argv[1:]]
            print(f"[study] start {arm} s{seed}: {shlex.join(argv)}", flush=True)
            live.append(
                (
                    arm,
                    seed,
                    time.time(),
                    subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT),
                )
            )
        time.sleep(5)
        for item in list(live):
            arm, seed, start, proc = item
            if proc.poll() is not None:
                live.remove(item)
                print(f"[study] done {arm} s{seed} rc={proc.returncode} in {(time.time() - start) / 60:.1f} min "
                      f"({len(pending)} pending, {len(live)} running, {(time.time() - t0) / 60:.1f} min so far)",
                      flush=True)  # fmt: skip


def _records(run_dir: Path) -> list[dict]:
    return [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]


def run_summary(run_dir: Path) -> dict[str, float]:
    """The per-run numbers of the final table."""
    recs = _records(run_dir)
    steps = [r for r in recs if r["step"] >= 1]

    def series(key: str) -> np.ndarray:
        return np.array([r[key] for r in steps if r.get(key) is not None], dtype=np.float64)

    evals = [(r["step"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    last = steps[-1]["step"] if steps else 0
    late = [r for r in steps if r["step"] > last - 10]  # the last 10 steps

    def late_mean(key: str) -> float:
        v = [r[key] for r in late if r.get(key) is not None]
        return float(np.mean(v)) if v else float("nan")

    def stat(fn, key: str) -> float:
        v = series(key)
        return float(fn(v)) if len(v) else float("nan")

    return {
        "steps": float(last),
        "eval_base": evals[0][1] if evals else float("nan"),
        "eval_final": evals[-1][1] if evals else float("nan"),
        "eval_best": max(e[1] for e in evals) if evals else float("nan"),
        "acc_last10": late_mean("reward/accuracy"),
        "entropy_start": stat(lambda v: v[0], "actor/entropy"),
        "entropy_peak": stat(np.max, "actor/entropy"),
        "garbled_last10": late_mean("reward/unparsed_frac"),
        "garbled_peak": stat(np.max, "reward/unparsed_frac"),
        "len_last10": late_mean("response_length/mean"),
        "clip_neg_lower": stat(np.mean, "actor/clipfrac_neg_lower_of_neg"),
        "clip_pos_upper": stat(np.mean, "actor/clipfrac_pos_upper_of_pos"),
        "L_mean": stat(np.mean, "calib/lower"),
        "H_mean": stat(np.mean, "calib/upper"),
        "mkl_mean": stat(np.mean, "rollout_corr/kl"),
        # Calibration steps only (calibrated arms): the BF16 shadow on the same tokens.
        "cal_fp8_neg_lower": stat(np.mean, "calib/fp8_clipfrac_neg_lower_plain"),
        "cal_bf16_neg_lower": stat(np.mean, "calib/bf16_clipfrac_neg_lower"),
        "cal_fp8_neg_below_L": stat(np.mean, "calib/fp8_clipfrac_neg_lower_calibrated"),
        # Sum of the step times (compiles and evals included; the warm start, cached, not):
        # the wall time of the run on the shared machine, from its own log.
        "wall_min": stat(np.sum, "timing/step_s") / 60,
    }


# Two tables: outcomes, then the clipping mechanism. (column header, summary key, digits)
OUTCOMES = (
    ("steps", "steps", 0),
    ("eval acc base", "eval_base", 3),
    ("eval acc final", "eval_final", 3),
    ("eval acc best", "eval_best", 3),
    ("sampled acc (last 10 steps)", "acc_last10", 3),
    ("entropy step 1", "entropy_start", 3),
    ("peak entropy", "entropy_peak", 3),
    ("garbled rate (last 10)", "garbled_last10", 3),
    ("peak garbled rate", "garbled_peak", 3),
    ("response length (last 10)", "len_last10", 1),
    ("sum of step times (min)", "wall_min", 1),
)
MECHANISM = (
    ("A<0 below lower bound (of N)", "clip_neg_lower", 3),
    ("A>0 above upper bound (of P)", "clip_pos_upper", 3),
    ("L mean", "L_mean", 3),
    ("H mean", "H_mean", 3),
    ("mismatch KL mean", "mkl_mean", 5),
    ("calibration steps: A<0 with r8 < 1-eps_low", "cal_fp8_neg_lower", 3),
    ("same tokens, BF16 shadow r16 < 1-eps_low", "cal_bf16_neg_lower", 3),
    ("same tokens, r8 < L", "cal_fp8_neg_below_L", 3),
)


def table(root: str, arms: list[str] | None = None, seeds: list[str] | None = None) -> str:
    """Markdown: one row per arm, mean (+- spread = half the range over seeds when > 1 seed);
    the outcome table, then the mechanism table. `arms` / `seeds`: keep only those runs."""
    groups: dict[str, list[Path]] = {}
    for p in sorted(Path(root).iterdir()):
        if (p / "metrics.jsonl").is_file():  # `<arm>_s<seed>`, or any other run folder alone
            arm, _, seed = p.name.rpartition("_s")
            arm = arm if arm and seed.isdigit() else p.name
            if (arms and arm not in arms) or (seeds and seed not in seeds):
                continue
            groups.setdefault(arm, []).append(p)
    order = [a for a in ARMS if a in groups] + [a for a in groups if a not in ARMS]
    summaries = {}
    for arm in order:
        runs = groups[arm]
        seeds = [p.name.rpartition("_s")[2] if p.name != arm else "-" for p in runs]
        summaries[arm] = (seeds, [run_summary(p) for p in runs])
    out = []
    for columns in (OUTCOMES, MECHANISM):
        lines = [
            "| arm | seeds | " + " | ".join(h for h, _, _ in columns) + " |",
            "|" + "---|" * (len(columns) + 2),
        ]
        for arm, (seeds, sums) in summaries.items():
            cells = []
            for _, key, d in columns:
                v = np.array([x[key] for x in sums])
                cell = "-" if np.all(np.isnan(v)) else f"{np.mean(v):.{d}f}"
                if len(v) > 1 and not np.all(np.isnan(v)):
                    cell += f" ± {(v.max() - v.min()) / 2:.{d}f}"
                cells.append(cell)
            lines.append(f"| {arm} | {','.join(seeds)} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


# Per-step columns of `steps`: (header, metrics key, format).
STEP_COLUMNS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("rollout_corr/kl", "rollout_corr/kl", "{:.2e}"),
    ("k3", "rollout_corr/k3_kl", "{:.2e}"),
    ("A<0 below L (of N)", "actor/clipfrac_neg_lower_of_neg", "{:.3f}"),
    ("A>0 above H (of P)", "actor/clipfrac_pos_upper_of_pos", "{:.3f}"),
    ("L", "calib/lower", "{:.3f}"),
    ("H", "calib/upper", "{:.3f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
    ("eval acc", "eval/accuracy", "{:.3f}"),
    ("step s", "timing/step_s", "{:.0f}"),
)


def steps_table(root: str, arms: list[str] | None = None) -> str:
    """Markdown: one row per (run, step) of every run folder under `root` (`arms`: only the
    folders whose arm is listed), STEP_COLUMNS; "-" where the step did not log the key."""
    lines = [
        "| run | step | " + " | ".join(h for h, _, _ in STEP_COLUMNS) + " |",
        "|" + "---|" * (len(STEP_COLUMNS) + 2),
    ]
    for p in sorted(Path(root).iterdir()):
        if not (p / "metrics.jsonl").is_file():
            continue
        if arms and p.name.rpartition("_s")[0] not in arms:
            continue
        for r in _records(p):
            cells = [f.format(r[k]) if r.get(k) is not None else "-" for _, k, f in STEP_COLUMNS]
            lines.append(f"| {p.name} | {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# (column header, function of one audit row, format): the FP8 effect on one batch.
AUDIT_DIFF = (
    ("noise floor", lambda r: r["noise_floor"], "{:.2e}"),
    ("std log r", lambda r: r["std_log_r"], "{:.3f}"),
    ("std (log r - log r16)", lambda r: r["std_log_r_fp8_minus_bf16"], "{:.3f}"),
    ("N<1-eps BF16", lambda r: r["clip_neg_lower_bf16"], "{:.4f}"),
    ("N<1-eps FP8 / BF16",
     lambda r: r["clip_neg_lower_fp8"] / r["clip_neg_lower_bf16"]
     if r["clip_neg_lower_bf16"] > 0 else float("nan"), "{:.2f}"),
    ("N<1-eps FP8 - BF16 (tokens)",
     lambda r: (r["clip_neg_lower_fp8"] - r["clip_neg_lower_bf16"]) * r["n_neg"], "{:+.0f}"),
    ("P>1+eps FP8 - BF16 (tokens)",
     lambda r: (r["clip_pos_upper_fp8"] - r["clip_pos_upper_bf16"]) * r["n_pos"], "{:+.0f}"),
    ("balance FP8 - BF16", lambda r: r["balance_fp8"] - r["balance_bf16"], "{:+.4f}"),
    ("L", lambda r: r["L"], "{:.3f}"),
    ("H", lambda r: r["H"], "{:.3f}"),
    ("|N|", lambda r: r["n_neg"], "{:.0f}"),
)  # fmt: skip


def _cell(fmt: str, v: float) -> str:
    return "-" if np.isnan(v) else fmt.format(v)


def audit_diff(dirs: list[str]) -> str:
    """Markdown: the rows (recipe, grad, updates) present in every audit of `dirs`, each cell
    the values in the order of `dirs`, separated by ` / `."""

    def load(d: str) -> dict[tuple, dict]:
        rows = json.loads((Path(d) / "audit.json").read_text())
        return {(r["recipe"], r["grad_format"], r["updates"]): r for r in rows}

    audits = [load(d) for d in dirs]
    lines = [
        "each cell: " + " / ".join(dirs),
        "",
        "| recipe | grad | updates | " + " | ".join(h for h, _, _ in AUDIT_DIFF) + " |",
        "|" + "---|" * (len(AUDIT_DIFF) + 3),
    ]
    for key in [k for k in audits[0] if all(k in a for a in audits)]:
        cells = [" / ".join(_cell(fmt, fn(a[key])) for a in audits) for _, fn, fmt in AUDIT_DIFF]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def collect(root: str, dest: str) -> None:
    """The small files of every finished run (summary.json) under `root`, to `dest/<run>/`."""
    import shutil

    for p in sorted(Path(root).iterdir()):
        if not (p / "summary.json").is_file():  # finished runs only
            continue
        out = Path(dest) / p.name
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml", "summary.json"):
            if (p / name).is_file():
                shutil.copy2(p / name, out / name)
        print(f"{p} -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/study_fp8.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("commands", "run"):
        p = sub.add_parser(name)
        p.add_argument("--arms", default=",".join(ARMS))
        p.add_argument("--seeds", default="0")
        p.add_argument("--root", default=ROOT)
        p.add_argument("--config", default=CONFIG, help="run config (default: %(default)s)")
        p.add_argument("--set", default="", help="space-separated overrides after the arm's")
        if name == "run":
            p.add_argument("--jobs", type=int, default=3)
            p.add_argument("--nice", type=int, default=10, help="niceness of the runs")
    t = sub.add_parser("table")
    t.add_argument("--root", default=ROOT)
    t.add_argument("--arms", default="", help="comma-separated arms to keep (default: all)")
    t.add_argument("--seeds", default="", help="comma-separated seeds to keep (default: all)")
    st = sub.add_parser("steps")
    st.add_argument("--root", default=ROOT)
    st.add_argument("--arms", default="", help="comma-separated arms to keep (default: all)")
    c = sub.add_parser("collect")
    c.add_argument("--root", default=ROOT)
    c.add_argument("--dest", default="results/study/arms")
    d = sub.add_parser("audit-diff")
    d.add_argument("dirs", nargs="+", metavar="DIR", help="`python -m jfp8rl.audit --out` folders")
    args = parser.parse_args(argv)
    if args.cmd == "audit-diff":
        print(audit_diff(args.dirs), end="")
        return 0
    if args.cmd == "steps":
        print(steps_table(args.root, [x for x in args.arms.split(",") if x] or None), end="")
        return 0
    if args.cmd == "collect":
        collect(args.root, args.dest)
        return 0
    if args.cmd == "table":
        keep = [x for x in args.arms.split(",") if x] or None
        print(table(args.root, keep, [x for x in args.seeds.split(",") if x] or None), end="")
        return 0
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"error: unknown arms {unknown}; arms: {list(ARMS)}", file=sys.stderr)
        return 2
    jobs = [(a, int(s)) for s in args.seeds.split(",") for a in arms]
    extra = tuple(args.set.split())
    if args.cmd == "commands":
        for arm, seed in jobs:
            print(f"PYTHONPATH=. {shlex.join(command(arm, seed, args.root, args.config, extra))}")
        return 0
    run_all(jobs, args.jobs, args.root, args.nice, args.config, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
