"""PNG plots of runs (`python -m jfp8rl.report`).

One panel per quantity, every run overlaid (labelled by its folder name; one colour per run):
reward, accuracy (training samples and greedy eval), entropy, the garbled-output rate
(`reward/unparsed_frac`: responses whose answer the verifier could not extract, e.g. off the
scratchpad format), response length, clip shares by advantage sign (of the A < 0 tokens below
the lower bound, of the A > 0 tokens above the upper bound), on calibration steps the same
shares of the FP8 ratios at the plain bounds against the BF16 shadow's, the calibrated bounds
L / H, the trainer-vs-rollout mismatch KL, and the time split per step. Panels whose metrics no
run logged are left out. Default output: `<first run_dir>/report.png`. Overlay the arms of a
study: `python -m jfp8rl.report runs/study/* --out results/study/curves.png`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jfp8rl.observe.metrics import read_metrics

# (title, [(metric, line style label suffix)])
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("reward/mean", "")]),
    ("accuracy", [("reward/accuracy", "sampled"), ("eval/accuracy", "greedy eval")]),
    ("entropy", [("actor/entropy", "")]),
    ("garbled rate (unparsed responses)", [("reward/unparsed_frac", "")]),
    ("response length", [("response_length/mean", "")]),
    (
        "clip shares by sign (of N / of P)",
        [
            ("actor/clipfrac_neg_lower_of_neg", "A<0, r<L"),
            ("actor/clipfrac_pos_upper_of_pos", "A>0, r>H"),
        ],
    ),
    (
        "A<0 below 1-eps_low: FP8 vs BF16 shadow (calibration steps)",
        [
            ("calib/fp8_clipfrac_neg_lower_plain", "FP8"),
            ("calib/bf16_clipfrac_neg_lower", "BF16"),
            ("calib/fp8_clipfrac_neg_lower_calibrated", "FP8 r<L"),
        ],
    ),
    ("calibrated bounds", [("calib/lower", "L"), ("calib/upper", "H")]),
    ("mismatch KL (rollout vs trainer)", [("rollout_corr/kl", "k1"), ("rollout_corr/k3_kl", "k3")]),
    (
        "time per step (s)",
        [("timing/rollout_s", "rollout"), ("timing/train_s", "train"), ("timing/sync_s", "sync")],
    ),
]
_STYLES = ["-", "--", ":", "-."]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def make_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draws the panels for `run_dirs` into one PNG; returns its path."""
    # matplotlib is needed by plots only: imported here, with the headless backend.
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("give at least one run folder")
    runs = [(Path(d).name or str(d), read_metrics(d)) for d in run_dirs]
    panels = [
        (title, keys)
        for title, keys in PANELS
        if any(_series(recs, k)[0] for _, recs in runs for k, _ in keys)
    ]
    cols = 2
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for ri, (name, recs) in enumerate(runs):
            for ki, (key, suffix) in enumerate(keys):
                xs, ys = _series(recs, key)
                if not xs:
                    continue
                label = name + (f" {suffix}" if suffix else "")
                marker = "o" if len(xs) <= 12 else None
                ax.plot(xs, ys, _STYLES[ki % 4], color=colors[ri % len(colors)], marker=marker,
                        markersize=3, label=label)  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        if title.startswith("time"):
            ax.set_yscale("log")  # the first steps include compiles, 100x the steady state
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6 if len(runs) > 4 else 7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(out) if out else Path(run_dirs[0]) / "report.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
