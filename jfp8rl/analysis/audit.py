"""The FP8 audit (`python -m jfp8rl.audit`): where FP8 noise enters the policy ratio.

For the configured policy and ONE rollout batch (sampled by the configured rollout backend),
per training recipe (bf16, fp8_tensor, fp8_row, fp8_block; the FP8 ones with E4M3 and with
E5M2 output gradients), on the same samples, everything computed by the trainer's own programs
(`jfp8rl.trainer.step`: `prepare` for the old logprobs, `update` for the optimizer updates; the loop's
stages for the rollout; `losses.calibrated` for shares, balances and bounds):

* noise floor: std over the batch's response tokens of log r = logp_new - logp_old at
  theta = theta_old, with logp_old from `prepare` (whole batch, its micro-batches) and logp_new
  as an update computes it (the mini-batches of the PPO schedule's first epoch, through
  `step.map_micro`). Per-tensor scales take the amax over the whole activation tensor of
  one forward, so the same token quantizes differently in the whole batch and in a mini-batch:
  a real floor (3-4e-2 on the tiny policies, docs/fp8_study.md). BF16 and the per-row /
  per-1 x B-tile FP8 scales are batch-invariant; what remains is float32 summation order
  (XLA:CPU picks dot kernels by row count: ~5e-7 for BF16, exactly 0 at small shapes) and, for
  FP8, the rare element that this moves across an FP8 rounding boundary (1e-7..2e-4).
* after u = 1, 2, 4 optimizer updates (the trainer's `update` on the first u mini-batches of
  the step's schedule, at the configured lr without warm-up, plain bounds): std of log r (FP8 recipe), of the
  BF16 shadow's log r16 = logp16_new - logp16_old (same params, BF16 recipe), and of
  log r - log r16 (the FP8 noise in the ratio itself); row u = 0 is the noise floor.
* clip shares by sign at the plain bounds, FP8 ratios vs the BF16 shadow: the share of A < 0
  tokens below 1 - eps_low (`clip_neg_lower_*`) and of A > 0 tokens above 1 + eps_high
  (`clip_pos_upper_*`); the balance p = balance(1 - eps_low, 1 + eps_high, r) (docs/design.md
  section 5) for both;
* Calibrated Clipping's (L, H) solved from these FP8 ratios against the BF16 reference
  (`reference_stats`, `solve_bounds`, the configured upper rule and balance), and the shares
  and balance they give (`*_calibrated`); `n_neg_tied_at_cut`, how many A < 0 tokens share
  the FP8 ratio at the lower bound's cut (`tied_at_cut`: where it is not 0 no L can leave the
  BF16 count below it).

The rollout's FP8 KV cache (`jfp8rl.analysis.kv_mismatch`): every row also carries
`kv_fp8_kl_mean` / `kv_fp8_kl_max` / `kv_fp8_abs_dlogp_mean`, the mismatch KL that reading K/V
from an FP8 (E4M3, per-layer amax / 448 scales) cache adds to the rollout recipe on the
batch's sequences with the start params, whatever `rollout.kv_cache_dtype` the run uses.

Start state: by default the configured base policy with a fresh Adam state (updates at the
configured lr without warm-up: the first update is a sign step). `--checkpoint RUN_DIR` (its
latest checkpoint) or `--checkpoint RUN_DIR/checkpoints/STEP` starts instead from that
checkpoint's params, Adam moments and calibration state (held L, H under `hold`), at the run's
lr schedule and data position: the batch is the run's next step's. The recipe of each row comes
from the trainer's own keys (`train.recipe`, `train.grad_format`). Rows also carry
`start_step`, `param_norm` and `opt_state_norm` (float64 L2 norms) of the state they measure.

Writes `DIR/audit.json` (a list of rows, one per (recipe, grad format, updates)) and
`DIR/audit.md` (the same as a markdown table); `DIR/run/` holds the resolved config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.analysis.kv_mismatch import kv_cache_mismatch
from jfp8rl.analysis.tables import markdown_table
from jfp8rl.config import ConfigError, load_config
from jfp8rl.data.batch import RolloutBatch
from jfp8rl.observe.memory import objects_before_frozen
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer.checkpoint import Checkpointer, require_intact
from jfp8rl.trainer.forward import MODEL_INPUTS, present, response_logprobs
from jfp8rl.trainer.loop import setup
from jfp8rl.trainer.microbatch import map_micro, num_micro_batches
from jfp8rl.trainer.settings import step_settings
from jfp8rl.trainer.stages import stage_prepare, stage_rollout, stage_sync
from jfp8rl.trainer.state import Progress, Trainer, abstract_array
from jfp8rl.trainer.step import make_step_fns
from losses import calibrated as cal
from models.fp8 import get_recipe

# (recipe, output-gradient format) pairs audited; BF16 has no FP8 gradient.
AUDITED_RECIPES: tuple[tuple[str, str], ...] = (
    ("bf16", "-"),
    ("fp8_tensor", "e4m3"),
    ("fp8_tensor", "e5m2"),
    ("fp8_row", "e4m3"),
    ("fp8_row", "e5m2"),
    ("fp8_block", "e4m3"),
    ("fp8_block", "e5m2"),
)
UPDATES = (0, 1, 2, 4)

# Markdown columns: (header, row key, digits).
COLUMNS = (
    ("recipe", "recipe", None),
    ("grad", "grad_format", None),
    ("updates", "updates", None),
    ("noise floor std log r", "noise_floor", 2),
    ("std log r", "std_log_r", 4),
    ("std log r16", "std_log_r_bf16", 4),
    ("std (log r - log r16)", "std_log_r_fp8_minus_bf16", 2),
    ("N<1-eps FP8", "clip_neg_lower_fp8", 4),
    ("N<1-eps BF16", "clip_neg_lower_bf16", 4),
    ("P>1+eps FP8", "clip_pos_upper_fp8", 4),
    ("P>1+eps BF16", "clip_pos_upper_bf16", 4),
    ("balance FP8", "balance_fp8", 4),
    ("balance BF16", "balance_bf16", 4),
    ("L", "L", 4),
    ("H", "H", 4),
    ("N<L FP8", "clip_neg_lower_calibrated", 4),
    ("P>H FP8", "clip_pos_upper_calibrated", 4),
    ("balance (L,H) FP8", "balance_calibrated", 4),
    ("N tied at cut", "n_neg_tied_at_cut", 0),
    ("KL kv fp8", "kv_fp8_kl_mean", 2),
    ("|N|", "n_neg", 0),
    ("|P|", "n_pos", 0),
)


def tied_at_cut(values: np.ndarray, k: int) -> int:
    """How many of `values` (N's FP8 ratios) equal both the k-th and the (k+1)-th smallest;
    0 when those two differ (or k is 0 or all of N). Only then can the calibrated lower bound
    leave exactly k tokens of N below it; inside a run of equal ratios (a group's identical
    responses share their ratios token for token) it leaves the run's start below it, up to
    the run's size - 1 tokens fewer."""
    s = np.sort(np.asarray(values).reshape(-1))
    if k <= 0 or k >= s.size or s[k - 1] != s[k]:
        return 0
    return int(np.sum(s == s[k]))


def ratio_stats(
    log_r: np.ndarray,
    log_r16: np.ndarray,
    adv: np.ndarray,
    mask: np.ndarray,
    calib_cfg: cal.CalibConfig,
) -> dict[str, float]:
    """The audit's columns for one set of FP8 log-ratios and their BF16 shadow (all [N, R],
    response-aligned); std over the response tokens (float64)."""
    on = mask > 0
    lo, hi = calib_cfg.plain_bounds
    r8, r16 = jnp.exp(jnp.asarray(log_r)), jnp.exp(jnp.asarray(log_r16))
    a, m = jnp.asarray(adv), jnp.asarray(mask)
    fp8 = cal.clip_stats(lo, hi, r8, a, m)
    bf16 = cal.clip_stats(lo, hi, r16, a, m)
    big_l, big_h = cal.solve_bounds(cal.reference_stats(r16, a, m, calib_cfg), r8, a, m, calib_cfg)
    calib = cal.clip_stats(big_l, big_h, r8, a, m)
    neg = on & (np.asarray(adv) < 0)
    k_bf16 = int(np.sum(np.asarray(r16)[neg] < lo))  # the BF16 count the lower rule aims at
    diff = (log_r.astype(np.float64) - log_r16)[on]
    out = {
        "std_log_r": float(np.std(log_r.astype(np.float64)[on])),
        "std_log_r_bf16": float(np.std(log_r16.astype(np.float64)[on])),
        "std_log_r_fp8_minus_bf16": float(np.std(diff)),
        "clip_neg_lower_fp8": fp8["neg_lower"],
        "clip_neg_lower_bf16": bf16["neg_lower"],
        "clip_pos_upper_fp8": fp8["pos_upper"],
        "clip_pos_upper_bf16": bf16["pos_upper"],
        "balance_fp8": fp8["balance"],
        "balance_bf16": bf16["balance"],
        "L": big_l,
        "H": big_h,
        "clip_neg_lower_calibrated": calib["neg_lower"],
        "clip_pos_upper_calibrated": calib["pos_upper"],
        "balance_calibrated": calib["balance"],
        "n_neg_tied_at_cut": tied_at_cut(np.asarray(r8)[neg], k_bf16),
        "n_neg": fp8["n_neg"],
        "n_pos": fp8["n_pos"],
    }
    return {k: float(v) for k, v in out.items()}


def _schedule(n_samples: int, mini_batches: int, epochs: int, seed: int, step: int) -> list:
    """Sample indices of each mini-batch, in the trainer's order (`jfp8rl.trainer.stages.stage_update`)."""
    size = n_samples // mini_batches
    out = []
    for epoch in range(epochs):
        perm = np.random.default_rng([seed, step, epoch]).permutation(n_samples)
        out += [perm[m * size : (m + 1) * size] for m in range(mini_batches)]
    return out


def tree_norm(tree: Any) -> float:
    """L2 norm in float64 of a pytree's floating-point leaves (integer counters left out), on
    host: the audit rows' `param_norm` / `opt_state_norm`, which show where the updates
    started (a checkpoint's state or a fresh one)."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    sq = [
        np.sum(np.square(x.astype(np.float64)))
        for x in leaves
        if np.issubdtype(x.dtype, np.floating)
    ]
    return float(math.sqrt(sum(sq)))


def audit_recipe(
    t: Trainer,
    start: dict[str, Any],
    batch: RolloutBatch,
    recipe: str,
    grad_format: str,
    updates: tuple[int, ...] = UPDATES,
    step: int = 1,
) -> list[dict[str, Any]]:
    """The audit rows of one recipe (module docstring): `t` the `Trainer` (its policy, mesh,
    settings), `start` the train state the updates start from (params = the old params, Adam
    moments, calibration state: fresh, or a checkpoint's), `batch` step `step`'s
    `RolloutBatch`."""
    # The trainer's own recipe from its config keys (train.recipe, train.grad_format).
    grad = "e4m3" if grad_format == "-" else grad_format
    train_cfg = dataclasses.replace(t.cfg.train, recipe=recipe, grad_format=grad)
    cfg = dataclasses.replace(t.cfg, train=train_cfg)
    settings, opt = step_settings(cfg)
    train_recipe = settings.train_recipe
    # Calibrated programs (the prepare pass computes the BF16 shadow old logprobs); in hold
    # mode before any calibration the updates use the plain bounds.
    settings = settings._replace(
        calibrated=True,
        calib_cfg=dataclasses.replace(settings.calib_cfg, mode="hold"),
    )
    layout = mesh_lib.param_layout(t.mesh, t.policy.cfg, start["params"])
    fns = make_step_fns(t.policy.graphdef, settings, opt, layout)
    tr = dataclasses.replace(t, fns=fns, settings=settings)
    # A copy: `update` donates its state, and every recipe starts from the same state.
    keys = ("params", "opt_state", "calib")
    sh = fns.state_shardings(start["calib"])
    state = {k: jax.device_put(jax.tree.map(jnp.copy, start[k]), sh[k]) for k in keys}
    full, prep_metrics = stage_prepare(tr, state, batch, calibrate=True)
    n = full["tokens"].shape[0]
    tc = cfg.train
    epochs = max(tc.ppo_epochs, -(-max(updates) // tc.mini_batches))
    sched = _schedule(n, tc.mini_batches, epochs, tc.seed, step)
    k = num_micro_batches(len(sched[0]), settings.micro_batch_size)
    graphdef, shadow, dat = t.policy.graphdef, settings.shadow_recipe, layout.batch()

    @jax.jit
    def new_logp(p, mb):
        def fwd(m):
            return {
                "fp8": response_logprobs(graphdef, p, m, train_recipe, settings.temperature)[0],
                "bf16": response_logprobs(graphdef, p, m, shadow, settings.temperature)[0],
            }

        return map_micro(fwd, mb, k, dat)

    def log_ratios(p) -> tuple[np.ndarray, np.ndarray]:
        """log r (train recipe) and log r16 (BF16 shadow) of every sample, each computed in the
        mini-batch it falls in during the first epoch (as an update computes it)."""
        lr8 = np.zeros_like(full["old_logp"])
        lr16 = np.zeros_like(full["old_logp"])
        with fns.mesh_context():
            for idx in sched[: tc.mini_batches]:
                mb = mesh_lib.put_batch(
                    {n_: v[idx] for n_, v in present(full, MODEL_INPUTS).items()}, t.mesh
                )
                out = new_logp(p, mb)
                lr8[idx] = np.asarray(out["fp8"]) - full["old_logp"][idx]
                lr16[idx] = np.asarray(out["bf16"]) - full["old_logp_bf16"][idx]
        mask = full["response_mask"] > 0
        return np.where(mask, lr8, 0.0), np.where(mask, lr16, 0.0)

    adv, mask = full["advantages"], full["response_mask"]
    sub = state
    rows, done, floor = [], 0, float("nan")
    for u in sorted(updates):
        while done < u:
            idx = sched[done]
            mb = {key: v[idx] for key, v in full.items() if key != "old_logp_bf16"}
            sub, _ = fns.update(sub, mesh_lib.put_batch(mb, t.mesh), False, done == 0)
            done += 1
        lr8, lr16 = log_ratios(sub["params"])
        stats = ratio_stats(lr8, lr16, adv, mask, settings.calib_cfg)
        if u == 0:
            floor = stats["std_log_r"]
        rows.append(
            {
                "recipe": recipe,
                "grad_format": grad_format,
                "updates": u,
                "noise_floor": floor,
                **stats,
                "mismatch_kl": prep_metrics.get("rollout_corr/kl", float("nan")),
                "start_step": step - 1,
                "param_norm": tree_norm(sub["params"]),
                "opt_state_norm": tree_norm(sub["opt_state"]),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table (COLUMNS)."""

    def cell(v: Any, d: int | None) -> str:
        if d is None:
            return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return "nan"
        if d == 2:  # std of log ratios: small numbers, scientific
            return f"{v:.2e}"
        return f"{v:.{d}f}"

    return markdown_table(
        [h for h, _, _ in COLUMNS], ([cell(r[k], d) for _, k, d in COLUMNS] for r in rows)
    )


def checkpoint_step(path: str | Path) -> tuple[Path, int]:
    """(run folder, step) of `--checkpoint PATH`: a run folder (its latest checkpoint) or a
    step folder `RUN/checkpoints/<step>`; ConfigError naming PATH otherwise."""
    p = Path(path)
    if p.parent.name == "checkpoints" and p.name.isdigit():
        run_dir, step = p.parent.parent, int(p.name)
    elif (p / "checkpoints").is_dir():
        run_dir, step = p, None
    else:
        raise ConfigError(
            f"--checkpoint {p}: neither a run folder holding checkpoints/ nor a step folder "
            "RUN/checkpoints/<step>; pass the run_dir of a `python -m jfp8rl.train` run"
        )
    ckpt = Checkpointer(run_dir, keep=1_000_000)  # reads only: keep deletes nothing
    try:
        steps = ckpt.all_steps()
    finally:
        ckpt.close()
    step = max(steps) if step is None and steps else step
    if step not in steps:
        raise ConfigError(f"--checkpoint {p}: no checkpoint {step} in {run_dir}/checkpoints "
                          f"(it holds {sorted(steps)})")  # fmt: skip
    return run_dir, step


def restore_checkpoint(t: Trainer, state: dict[str, Any], run_dir: Path, step: int) -> tuple:
    """(the train state of `run_dir`'s checkpoint `step`, restored in the layout of `state`;
    the run's `Progress` there). The audit's updates then start from its params, Adam
    moments and calibration state, and its rollout is the run's next step's. A checkpoint
    that fails its manifest check (`checkpoint.verify`) raises `CheckpointDamaged`."""
    require_intact(run_dir, step, t.cfg.checkpoint.verify)
    ckpt = Checkpointer(run_dir, keep=1_000_000)
    try:
        restored, meta = ckpt.restore(step, jax.tree.map(abstract_array, state))
    finally:
        ckpt.close()
    progress = Progress(meta["step"], meta["data_position"], meta["nonfinite_run"])
    t.log(f"[audit] from {run_dir}/checkpoints/{step} (step {progress.step})")
    return restored, progress


@objects_before_frozen()  # the stages' collections walk this call's objects only
def run_audit(
    config: str,
    overrides: list[str],
    out: str | Path,
    recipes: tuple[tuple[str, str], ...] = AUDITED_RECIPES,
    log: Any = print,
    checkpoint: str | Path | None = None,
    updates: tuple[int, ...] = UPDATES,
) -> list[dict[str, Any]]:
    """One rollout batch of the configured policy, every recipe's rows; writes
    `out/audit.json` and `out/audit.md` and returns the rows. With `checkpoint` (a run folder
    or one of its step folders, `checkpoint_step`) the policy, the Adam moments and the
    calibration state are that checkpoint's and the batch is the run's next step's; without
    it, the configured base policy with a fresh optimizer."""
    t0 = time.perf_counter()
    out = Path(out)
    # Fresh: no lr warm-up, the audited updates run at the configured lr (a warm-up would make
    # the first update a no-op). From a checkpoint: the run's schedule at its optimizer count
    # (its optimizer state has the schedule's structure).
    source = checkpoint_step(checkpoint) if checkpoint else None
    fresh = [] if source else ["optim.warmup_steps=0"]
    sets = [*overrides, f"run_dir={out / 'run'}", *fresh, "logging.console=none",
            "logging.tensorboard=false"]  # fmt: skip
    cfg = load_config(config, sets)
    t, state, progress = setup(cfg, None, log, sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        if source:
            state, progress = restore_checkpoint(t, state, *source)
        stage_sync(t, state, progress.step)
        batch, _ = stage_rollout(t, progress, progress.step + 1)
        n_tok = int(np.sum(batch.response_mask))
        kv = kv_cache_mismatch(
            t.policy.graphdef, state["params"], batch.tokens, batch.attention_mask,
            batch.prompt_lens, batch.response_mask, get_recipe(cfg.rollout.recipe),
        )  # fmt: skip
        for i, (recipe, grad) in enumerate(recipes):
            new = audit_recipe(t, state, batch, recipe, grad, updates, progress.step + 1)
            rows += [{**row, **kv} for row in new]
            elapsed = time.perf_counter() - t0
            log(f"[audit] {recipe}/{grad} done ({i + 1}/{len(recipes)}, {elapsed:.0f} s)")
            # Written after every recipe: a long audit interrupted keeps what it measured.
            start = (f"from {source[0]}/checkpoints/{source[1]} (Adam and calibration state "
                     "restored)" if source else "fresh optimizer")  # fmt: skip
            header = (
                f"audit: {config} {' '.join(overrides)}; {start}; one rollout batch of "
                f"{len(batch.tokens)} samples ({n_tok} response tokens), rollout recipe "
                f"{cfg.rollout.recipe}, lr {cfg.optim.lr} "
                f"{'(the run schedule)' if source else '(no warm-up)'}, "
                f"{cfg.train.mini_batches} mini-batches; {elapsed:.0f} s"
            )
            (out / "audit.json").write_text(json.dumps(rows, indent=1) + "\n")
            (out / "audit.md").write_text(header + "\n\n" + markdown(rows))
    finally:
        t.backend.close()
        t.ckpt.close()
        t.metrics.close()
    return rows
