"""Why the calibrated upper bound H swung (docs/fp8_study.md): the evidence, from commands.

    python scripts/study_h_swing.py table RUN_DIR [RUN_DIR ...]
        Markdown tables from each run's metrics.jsonl: the bounds' spread, the share of steps
        with H near a clamp, the A>0 upper clip share, the stored reference stats, accuracy.
    python scripts/study_h_swing.py probe --config configs/tiny_cpu.yaml [overrides ...]
        One rollout batch of the base policy, the trainer's own step functions: every
        mini-batch after the first calibrates (BF16 shadow vs FP8 on the same tokens), for
        `--shuffles` shuffles of the same batch, each from the same start. Prints, per
        position in the PPO schedule (updates done before the mini-batch), the reference stats
        that mini-batch would store; and the spread of the advantage-mix term
        sum_P A / sum_N |A| (the balance at r = 1) over random mini-batches of the batch.

Why the probe matters: in `track` mode the stats stored by a calibration are those of its LAST
mini-batch (after ppo_epochs * mini_batches - 1 updates), then every mini-batch of the next
`every` steps, at any position and with any advantage mix, solves L and H to match them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

# "H at a clamp": the (smoothed) H within this of 1 or of range_hi; the EMA keeps it from
# reaching a clamp exactly.
CLAMP_TOL = 0.05


def _load(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return rows, cfg


def _fmt(x: float, d: int = 3) -> str:
    return f"{x:.{d}f}"


def table(run_dirs: list[str]) -> str:
    """The markdown evidence tables of the given runs."""
    head1 = (
        "| run | steps | mode | balance | H mean | H std | H min..max | steps H<=1.05 | steps H>=1.75 "
        "| L mean | L std | clip A>0 above H (of P) mean / max | clip A<0 below L (of N) mean "
        "| eval acc: final (step) / mean of last 2 / mean of steps >= 100 | sum of step times (min) "
        "| wall clock (min) |"
    )
    head2 = (
        "| run | calibrations | stored p_ref min..max | p_ref CV | stored alpha min..max "
        "| corr(p_ref, mean H of window) | corr(alpha, mean L of window) |"
    )
    t1, t2 = [head1, "|" + "---|" * 16], [head2, "|" + "---|" * 7]
    for rd in run_dirs:
        rows, cfg = _load(Path(rd))
        c = cfg["calibration"]
        plain = cfg["algorithm"]["clip"] == "plain"
        mode = "plain clip" if plain else c["mode"]
        bal = "-" if plain else c.get("balance", "absolute")
        every = int(c["every"])
        lo_hi = (float(c["range_lo"]), float(c["range_hi"]))
        steps = [r for r in rows if "calib/upper" in r]
        # After the first calibration (step 1): the bounds in force.
        steps = [r for r in steps if r["step"] >= 2]
        h = np.array([r["calib/upper"] for r in steps])
        lo = np.array([r["calib/lower"] for r in steps])
        cpu = np.array([r["actor/clipfrac_pos_upper_of_pos"] for r in steps])
        cnl = np.array([r["actor/clipfrac_neg_lower_of_neg"] for r in steps])
        evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        wall = sum(r.get("timing/step_s", 0.0) for r in rows) / 60
        # From the resolved config (written at the start) to the last metrics line: includes
        # the compiles and evals, and the load of the shared machine.
        clock = (
            (Path(rd) / "metrics.jsonl").stat().st_mtime
            - (Path(rd) / "config.yaml").stat().st_mtime
        ) / 60
        late_evals = [e[1] for e in evals if e[0] >= 100]
        late = f"{np.mean(late_evals):.3f}" if late_evals else "-"
        near_lo = np.mean(h <= 1.0 + CLAMP_TOL)
        near_hi = np.mean(h >= lo_hi[1] - CLAMP_TOL)
        t1.append(
            f"| {Path(rd).name} | {steps[-1]['step']} | {mode} | {bal} | {_fmt(h.mean())} "
            f"| {_fmt(h.std())} | {_fmt(h.min())}..{_fmt(h.max())} | {near_lo:.0%} | {near_hi:.0%} "
            f"| {_fmt(lo.mean())} | {_fmt(lo.std())} | {cpu.mean():.1%} / {cpu.max():.1%} "
            f"| {cnl.mean():.1%} | {evals[-1][1]:.3f} ({evals[-1][0]}) / "
            f"{np.mean([e[1] for e in evals[-2:]]):.3f} / {late} | {wall:.1f} | {clock:.1f} |"
        )
        if plain:
            continue
        # The stats stored by calibration k are those in force on the step after it (step
        # k * every + 2), through the window of `every` steps that follows.
        cal_steps = [s for s in range(1, len(rows), every)]
        by_step = {r["step"]: r for r in steps}
        p, a, hw, lw = [], [], [], []
        for s in cal_steps:
            win = [by_step[t] for t in range(s + 1, s + every + 1) if t in by_step]
            if not win:
                continue
            p.append(win[0]["calib/p_ref"])
            a.append(win[0]["calib/alpha"])
            hw.append(np.mean([w["calib/upper"] for w in win]))
            lw.append(np.mean([w["calib/lower"] for w in win]))
        p, a = np.array(p), np.array(a)
        t2.append(
            f"| {Path(rd).name} | {len(p)} | {_fmt(p.min())}..{_fmt(p.max())} "
            f"| {p.std() / p.mean():.2f} | {_fmt(a.min())}..{_fmt(a.max())} "
            f"| {np.corrcoef(p, hw)[0, 1]:+.2f} | {np.corrcoef(a, lw)[0, 1]:+.2f} |"
        )
    return "\n".join(t1) + "\n\n" + "\n".join(t2) + "\n"


def probe(config: str, overrides: list[str], shuffles: int, draws: int, from_run: str = "") -> str:
    """Per-position reference stats of one rollout batch (module docstring)."""
    import dataclasses

    import jax

    from jfp8rl.config import load_config
    from jfp8rl.data.rewards import get_verifier
    from jfp8rl.data.stream import PromptStream, build_datasets
    from jfp8rl.data.templates import PromptFormat
    from jfp8rl.parallel import mesh as mesh_lib
    from jfp8rl.trainer.backends import make_backend
    from jfp8rl.trainer.optimizer import OptimSettings
    from jfp8rl.trainer.policy import load_policy
    from jfp8rl.trainer.rollout import RolloutSettings, collect
    from jfp8rl.trainer.step import make_step_fns
    from jfp8rl.trainer.step_settings import default_settings
    from losses import calibrated as cal
    from losses.registry import get_algorithm
    from models.hf_io import to_hf_state_dict

    t0 = time.perf_counter()
    cfg = load_config(config, overrides)
    if cfg.train.jax_cache_dir:
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.train.jax_cache_dir).absolute())
        )
    policy = load_policy(cfg, lambda m: print(m, file=sys.stderr))
    train_set, _ = build_datasets(
        cfg.data.task, cfg.data.train_file, cfg.data.eval_file, cfg.data.max_digits,
        cfg.data.eval_size,
    )  # fmt: skip
    fmt = PromptFormat.from_config(policy.path, policy.tokenizer, cfg.data)
    r = cfg.rollout
    settings = RolloutSettings(
        batch_size=cfg.data.batch_size, n=r.n, max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        dynamic_sampling=r.dynamic_sampling, max_rounds=r.max_rounds,
        overlong=cfg.reward.overlong, overlong_buffer=cfg.reward.overlong_buffer,
        overlong_penalty=cfg.reward.overlong_penalty,
    )  # fmt: skip
    position, step = 0, 1
    a, c = cfg.algorithm, cfg.calibration
    algo = dataclasses.replace(
        get_algorithm(a.name), eps_low=a.eps_low, eps_high=a.eps_high,
        dual_clip=a.dual_clip or None,
    )  # fmt: skip
    calib_cfg = cal.CalibConfig(
        eps_low=a.eps_low, eps_high=a.eps_high, every=c.every, ema=c.ema,
        range=(c.range_lo, c.range_hi), mode=c.mode, upper_rule=c.upper_rule, balance=c.balance,
    )  # fmt: skip
    n_samples = cfg.data.batch_size * r.n
    mbs, epochs = cfg.train.mini_batches, cfg.train.ppo_epochs
    o = cfg.optim
    opt = OptimSettings(
        o.lr, o.warmup_steps * mbs * epochs, o.weight_decay, o.grad_clip, o.b1, o.b2
    )
    mesh = mesh_lib.make_mesh(1)
    fns = make_step_fns(
        policy.graphdef,
        default_settings(
            algo, train_recipe=cfg.train.recipe, calibrated=True, calib_cfg=calib_cfg,
            correction=a.correction, correction_level=a.correction_level, tis_cap=a.tis_cap,
            group_size=r.n,
        ),
        opt, mesh_lib.replicated_layout(mesh, policy.params),
    )  # fmt: skip
    params0 = jax.device_put(policy.params, mesh_lib.replicated(mesh))
    opt0 = fns.optimizer.init(params0)
    if from_run:  # mid-training: the run's latest checkpoint, its next step's batch
        from jfp8rl.trainer.checkpoint import Checkpointer

        ck = Checkpointer(from_run, keep=1000)
        like = {
            "params": params0, "opt_state": opt0, "calib": cal.init_calib_state(calib_cfg),
            "rng": jax.random.key_data(jax.random.key(0)),
        }  # fmt: skip
        last = ck.latest_step()
        restored, meta = ck.restore(last, like)
        ck.close()
        params0, opt0 = restored["params"], restored["opt_state"]
        position, step = meta["data_position"], meta["step"] + 1
    backend = make_backend(cfg, policy, Path(cfg.run_dir))
    backend.push_weights(to_hf_state_dict(policy.cfg, params0), f"step-{step - 1}")
    batch, _, _ = collect(
        backend, PromptStream(train_set, cfg.data.seed), position, fmt,
        get_verifier(cfg.reward.kind), settings,
        seed=cfg.train.seed * 1_000_003 + step * 101, version=f"step-{step - 1}",
    )  # fmt: skip
    host = {
        "tokens": batch.tokens, "attention_mask": batch.attention_mask,
        "prompt_lens": batch.prompt_lens, "response_mask": batch.response_mask,
        "rollout_logp": batch.rollout_logp, "rewards": batch.rewards,
        "response_lens": batch.response_lens,
    }  # fmt: skip
    prep, _ = fns.prepare(params0, None, mesh_lib.put_batch(host, mesh), calibrate=True)
    full = {**host, **{k: np.asarray(v) for k, v in prep.items()}}
    full.pop("rewards")
    full.pop("response_lens")
    mb_size = n_samples // mbs

    # The advantage-mix term over random mini-batches (r = 1): no model involved.
    adv, mask = full["advantages"], full["response_mask"] > 0
    rng = np.random.default_rng(0)

    def mix(idx: np.ndarray) -> float:
        aa, mm = adv[idx], mask[idx]
        return float(np.sum(aa * (aa > 0) * mm) / np.sum(-aa * (aa < 0) * mm))

    mixes = np.array([mix(rng.permutation(n_samples)[:mb_size]) for _ in range(draws)])
    whole = mix(np.arange(n_samples))

    keys = (
        "calib/bf16_clipfrac_neg_lower", "calib/fp8_clipfrac_neg_lower_plain",
        "calib/balance_bf16", "calib/balance_fp8_plain", "calib/balance_fp8_unclipped",
        "calib/p_ref", "calib/lower_raw", "calib/upper_raw",
    )  # fmt: skip
    per_pos: dict[int, list[dict[str, float]]] = {}
    for sh in range(shuffles):
        state = {
            "params": jax.tree.map(lambda x: x.copy(), params0),
            "opt_state": jax.tree.map(lambda x: x.copy(), opt0),
            "calib": cal.init_calib_state(calib_cfg),
        }
        pos = 0
        for epoch in range(epochs):
            perm = np.random.default_rng([cfg.train.seed, 1000 + sh, epoch]).permutation(n_samples)
            for m in range(mbs):
                idx = perm[m * mb_size : (m + 1) * mb_size]
                mb = mesh_lib.put_batch({k: v[idx] for k, v in full.items()}, mesh)
                first = pos == 0
                new, mets = fns.update(state, mb, calibrate=not first, on_policy=first)
                state.update(new)
                if not first:
                    rec = {k: float(mets[k]) for k in keys}
                    rec["mix"] = mix(idx)
                    per_pos.setdefault(pos, []).append(rec)
                pos += 1
    backend.close()

    out = [
        f"probe: {config} {' '.join(overrides)}"
        f"{f' --from-run {from_run}' if from_run else ''}; step {step}'s batch of {n_samples} samples "
        f"({int(mask.sum())} response tokens), {shuffles} shuffles, mini-batch {mb_size} "
        f"samples; {time.perf_counter() - t0:.0f} s",
        "",
        f"advantage-mix term sum_P A / sum_N |A| (balance at r = 1): whole batch {whole:.3f}; "
        f"over {draws} random mini-batches mean {mixes.mean():.3f}, std {mixes.std():.3f}, "
        f"5-95% {np.quantile(mixes, 0.05):.3f}..{np.quantile(mixes, 0.95):.3f}, "
        f"min..max {mixes.min():.3f}..{mixes.max():.3f}",
        "",
        "| updates before the mini-batch | BF16 share of N below 1-eps_low (alpha) "
        "| FP8 share (plain) | BF16 balance (= absolute p_ref) | FP8 balance (plain) "
        "| mix term (r=1) | BF16 balance / mix | p_ref (configured rule) | raw L | raw H |",
        "|" + "---|" * 10,
    ]
    for p in sorted(per_pos):
        recs = per_pos[p]

        def ms(k: str, recs=recs) -> str:
            v = np.array([rr[k] for rr in recs])
            return f"{v.mean():.3f} ± {v.std():.3f}"

        ratio = np.array([rr["calib/balance_bf16"] / rr["mix"] for rr in recs])
        out.append(
            f"| {p} | {ms('calib/bf16_clipfrac_neg_lower')} "
            f"| {ms('calib/fp8_clipfrac_neg_lower_plain')} | {ms('calib/balance_bf16')} "
            f"| {ms('calib/balance_fp8_plain')} | {ms('mix')} "
            f"| {ratio.mean():.3f} ± {ratio.std():.3f} | {ms('calib/p_ref')} "
            f"| {ms('calib/lower_raw')} | {ms('calib/upper_raw')} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/study_h_swing.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="markdown tables from run folders")
    t.add_argument("run_dirs", nargs="+")
    p = sub.add_parser("probe", help="per-position reference stats of one rollout batch")
    p.add_argument("--config", required=True)
    p.add_argument("--shuffles", type=int, default=4)
    p.add_argument("--draws", type=int, default=2000)
    p.add_argument("--from-run", default="", help="start from this run's latest checkpoint")
    p.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.cmd == "table":
        print(table(args.run_dirs), end="")
    else:
        print(probe(args.config, args.overrides, args.shuffles, args.draws, args.from_run), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
