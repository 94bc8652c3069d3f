"""The RL loop (DESIGN.md section 7): `run(cfg)` drives one run folder from start or resume.

Per step: B prompts -> rollout (n each, `rollout.collect`: rewards, DAPO dynamic sampling) ->
`step.prepare` (old logprobs under the training recipe, BF16 shadow, advantages, TIS weights)
-> PPO epochs x mini-batches of `step.update` (calibrated or plain bounds, AdamW) -> push the
new weights to the rollout backend (`models.hf_io.to_hf_state_dict`, version "step-<k>") ->
metrics -> checkpoint every `checkpoint.every` steps. The pieces live in their own modules
(config, data, rewards, rollout, step, checkpoint, metrics, warmstart); the CLI is
`jfp8rl.train`.

Determinism: prompts come from `data.PromptStream` at the checkpointed position, rollout seeds
and mini-batch shuffles are derived from (train.seed, step, epoch), so a resumed run repeats
an uninterrupted one exactly on CPU (tests/jfp8rl/test_train_e2e.py).

Failures: a rollout backend error (server gone, stale weights, malformed answer) or
`train.max_nonfinite` steps in a row whose updates were all skipped raise `RunStopped`,
naming the last checkpoint (saves are synchronous and atomic) and the resume command.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl import mesh as mesh_lib
from jfp8rl.checkpoint import Checkpointer
from jfp8rl.config import Config, ConfigError, save_config, to_yaml
from jfp8rl.data import PromptStream, build_datasets
from jfp8rl.eval import evaluate
from jfp8rl.export import save_policy_folder
from jfp8rl.metrics import MetricsLogger
from jfp8rl.rewards import get_verifier
from jfp8rl.rollout import RolloutSettings, collect
from jfp8rl.rollout_dump import write_rollouts
from jfp8rl.step import OptimSettings, default_settings, make_step_fns
from jfp8rl.templates import PromptFormat, stop_token_ids
from losses import calibrated as cal
from losses.registry import get_algorithm
from models.hf_io import load_hf, to_hf_state_dict
from models.tokenizer import load_tokenizer
from rollout_bridge.backend import RolloutBackend, RolloutError

# Metrics that only a calibrating mini-batch computes (`losses.calibrated.calibrate`); between
# calibrations the last values stay in force and are logged as such.
CALIBRATION_ONLY = (
    "calib/bf16_clipfrac_neg_lower",
    "calib/bf16_clipfrac_pos_upper",
    "calib/balance_bf16",
)


class RunStopped(RuntimeError):
    """The run stopped early with its last checkpoint intact; the message says how to resume."""


@dataclasses.dataclass
class Policy:
    """The base policy as loaded from its HF folder."""

    cfg: Any  # models.config.ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Any
    eos_id: int
    path: Path


def load_policy(cfg: Config, log: Any) -> Policy:
    """The base policy: `model.path`, or the cached warm-started tiny policy."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path}: no config.json there (need an HF folder)")
    else:
        if cfg.data.task != "arithmetic":
            raise ConfigError(
                "model.path is empty: the built-in base policy needs data.task=arithmetic"
            )
        from jfp8rl.warmstart import ensure_base_policy

        train, evals = build_datasets("arithmetic", "", "", cfg.data.max_digits, cfg.data.eval_size)
        w = cfg.warmstart
        path = ensure_base_policy(
            w.cache_dir, cfg.model.preset, train, evals,
            task_tag=f"arithmetic-{cfg.data.max_digits}-{cfg.data.eval_size}",
            steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=w.seed,
            prompt_len=cfg.data.max_prompt_tokens, answer_len=cfg.rollout.max_tokens,
            carry_noise=w.carry_noise, target_accuracy=w.target_accuracy, log=log,
        )  # fmt: skip
    mcfg, graphdef, params = load_hf(path, compute_dtype=jnp.dtype(cfg.model.compute_dtype))
    tok = load_tokenizer(path)
    return Policy(mcfg, graphdef, params, tok, stop_token_ids(path, tok)[0], path)


def make_backend(cfg: Config, policy: Policy, run_dir: Path) -> RolloutBackend:
    """The configured rollout backend, holding the base policy's weights."""
    r = cfg.rollout
    if r.backend == "embedded":
        from rollout_bridge.engine import EmbeddedBackend

        return EmbeddedBackend(
            policy.cfg, policy.graphdef, policy.params,
            recipe=r.recipe, eos_id=policy.eos_id,
            weight_version="base", export_format=r.export_format or None,
        )  # fmt: skip
    from rollout_bridge.http_client import HttpBackend

    kw: dict[str, Any] = {"token": r.api_key or None, "timeout_s": r.timeout_s}
    if r.export_format:
        kw["export_format"] = r.export_format
    backend = HttpBackend(r.url, **kw)
    if not backend.health():
        raise RolloutError(
            f"rollout server {r.url} is not answering /health; start it, e.g. "
            f"`python -m rollout_bridge.serve --model {policy.path} --port <port>`, "
            "and set rollout.url"
        )
    return backend


def _resume_hint(cfg: Config) -> str:
    return f"python -m jfp8rl.train --config {Path(cfg.run_dir) / 'config.yaml'} --resume"


def run(cfg: Config, *, resume: str = "auto", stream: Any = None) -> dict[str, Any]:
    """Runs (or resumes) the RL loop of `cfg`; returns the run summary (also summary.json)."""
    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = stream or sys.stdout
    console = cfg.logging.console != "none"

    def log(msg: str) -> None:
        if console:
            print(msg, file=out, flush=True)

    if cfg.train.jax_cache_dir:
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.train.jax_cache_dir).absolute())
        )
    policy = load_policy(cfg, log)
    train_set, eval_set = build_datasets(
        cfg.data.task,
        cfg.data.train_file,
        cfg.data.eval_file,
        cfg.data.max_digits,
        cfg.data.eval_size,
        prompt_key=cfg.data.prompt_key,
        answer_key=cfg.data.answer_key,
    )
    fmt = PromptFormat.from_config(policy.path, policy.tokenizer, cfg.data)
    stream_ = PromptStream(train_set, cfg.data.seed)
    verifier = get_verifier(cfg.reward.kind)
    settings = RolloutSettings(
        batch_size=cfg.data.batch_size, n=cfg.rollout.n,
        max_prompt_tokens=cfg.data.max_prompt_tokens, max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        dynamic_sampling=cfg.rollout.dynamic_sampling, max_rounds=cfg.rollout.max_rounds,
        overlong=cfg.reward.overlong, overlong_buffer=cfg.reward.overlong_buffer,
        overlong_penalty=cfg.reward.overlong_penalty,
    )  # fmt: skip

    ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep)
    latest = ckpt.latest_step()
    if resume == "require" and latest is None:
        ckpt.close()
        raise ConfigError(f"--resume: {run_dir}/checkpoints holds no checkpoint")
    if resume == "never" and latest is not None:
        ckpt.close()
        raise ConfigError(f"--fresh: {run_dir} already holds checkpoints; pick another run_dir")
    save_config(cfg, run_dir)

    a = cfg.algorithm
    algo = dataclasses.replace(
        get_algorithm(a.name),
        eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip or None,
        use_kl_loss=a.kl_coef > 0, kl_coef=a.kl_coef, entropy_coef=a.entropy_coef,
    )  # fmt: skip
    c = cfg.calibration
    calib_cfg = cal.CalibConfig(
        eps_low=a.eps_low, eps_high=a.eps_high, every=c.every, ema=c.ema,
        range=(c.range_lo, c.range_hi), mode=c.mode, upper_rule=c.upper_rule, balance=c.balance,
    )  # fmt: skip
    n_samples = cfg.data.batch_size * cfg.rollout.n
    updates_per_step = cfg.train.ppo_epochs * cfg.train.mini_batches
    o = cfg.optim
    opt = OptimSettings(
        o.lr, o.warmup_steps * updates_per_step, o.weight_decay, o.grad_clip, o.b1, o.b2
    )
    try:
        mesh = mesh_lib.make_mesh(cfg.train.num_devices)
    except ValueError as e:
        raise ConfigError(f"train.num_devices={cfg.train.num_devices}: {e}") from e
    fns = make_step_fns(
        policy.graphdef,
        default_settings(
            algo, train_recipe=cfg.train.recipe, calibrated=a.clip == "calibrated",
            calib_cfg=calib_cfg, correction=a.correction, correction_level=a.correction_level,
            tis_cap=a.tis_cap, group_size=cfg.rollout.n,
        ),
        opt,
        mesh,
    )  # fmt: skip
    optimizer = fns.optimizer
    rep = mesh_lib.replicated(mesh)
    params = jax.device_put(policy.params, rep)
    # The KL reference is the base policy; a copy, since the train state's buffers are donated.
    ref_params = jax.tree.map(jnp.copy, params) if algo.use_kl_loss else None
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "calib": cal.init_calib_state(calib_cfg),
        "rng": jax.random.key_data(jax.random.key(cfg.train.seed)),
    }
    step, position, nonfinite_run = 0, 0, 0
    carried_init: dict[str, float] = {}
    if latest is not None:
        state, meta = ckpt.restore(latest, state)
        state = jax.device_put(state, rep)
        step, position, nonfinite_run = meta["step"], meta["data_position"], meta["nonfinite_run"]
        carried_init = dict(meta.get("carried", {}))
        log(f"resumed from {ckpt.directory}/{latest} (step {step}, data position {position})")

    try:
        backend = make_backend(cfg, policy, run_dir)
    except RolloutError as e:
        ckpt.close()
        last = latest if latest is not None else "none yet"
        raise RunStopped(f"{e}\nLast checkpoint: {last}; resume: {_resume_hint(cfg)}") from e
    metrics = MetricsLogger(
        run_dir, total_steps=cfg.train.steps, start_step=step,
        tensorboard=cfg.logging.tensorboard, console=console, stream=out,
    )  # fmt: skip
    stop_at = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)

    def version(k: int) -> str:
        return f"step-{k}"

    def push(k: int) -> float:
        t = time.perf_counter()
        backend.push_weights(to_hf_state_dict(policy.cfg, state["params"]), version(k))
        return time.perf_counter() - t

    def run_eval() -> float:
        return evaluate(
            backend, eval_set, fmt, verifier, n=cfg.eval.n, temperature=cfg.eval.temperature,
            max_prompt_tokens=cfg.data.max_prompt_tokens, max_tokens=cfg.rollout.max_tokens,
            chunk=cfg.data.batch_size * cfg.rollout.n,
        ).avg  # fmt: skip

    carried_now: dict[str, float] = dict(carried_init)

    def save(k: int) -> None:
        meta = {
            "step": k,
            "data_position": position,
            "nonfinite_run": nonfinite_run,
            "weight_version": version(k),
            "carried": carried_now,
            "config": to_yaml(cfg),
        }
        ckpt.save(k, state, meta)

    summary: dict[str, Any] = {"run_dir": str(run_dir), "base_policy": str(policy.path)}
    try:
        push(step)
        if step == 0:
            acc0 = run_eval()
            metrics.log(0, {"eval/accuracy": acc0})
            log(
                f"base policy {policy.path}: greedy eval accuracy {acc0:.3f} on {len(eval_set)} prompts"
            )
            save(0)
        rng_base = np.random.default_rng  # shuffles are seeded by (seed, step, epoch)
        carried: dict[str, float] = dict(carried_init)
        while step < stop_at:
            step += 1
            t0 = time.perf_counter()
            batch, position, rstats = collect(
                backend, stream_, position, fmt, verifier, settings,
                seed=cfg.train.seed * 1_000_003 + step * 101, version=version(step - 1),
            )  # fmt: skip
            t_roll = time.perf_counter() - t0

            t1 = time.perf_counter()
            calib_now = a.clip == "calibrated" and calib_cfg.is_calibration_step(step - 1)
            host = {
                "tokens": batch.tokens,
                "attention_mask": batch.attention_mask,
                "prompt_lens": batch.prompt_lens,
                "response_mask": batch.response_mask,
                "rollout_logp": batch.rollout_logp,
                "rewards": batch.rewards,
                "response_lens": batch.response_lens,
            }
            dev = mesh_lib.put_batch(host, mesh)
            prep = fns.prepare(state["params"], ref_params, dev)
            step_metrics: dict[str, float] = {k: float(v) for k, v in prep.pop("metrics").items()}
            full = {**host, **{k: np.asarray(v) for k, v in prep.items()}}
            full.pop("rewards")
            full.pop("response_lens")
            if cfg.logging.rollout_samples:
                write_rollouts(run_dir, step, batch, full["advantages"], fmt,
                               cfg.logging.rollout_samples, cfg.rollout.n)  # fmt: skip
            mb_size = n_samples // cfg.train.mini_batches
            state["rng"] = jax.random.key_data(
                jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
            )
            upd: list[dict[str, float]] = []
            for epoch in range(cfg.train.ppo_epochs):
                perm = rng_base([cfg.train.seed, step, epoch]).permutation(n_samples)
                for m in range(cfg.train.mini_batches):
                    # On a calibration step every mini-batch but the very first calibrates:
                    # the first one's ratios are all 1 (on-policy) and carry no FP8 noise.
                    first = epoch == 0 and m == 0 and updates_per_step > 1
                    calib_mb = calib_now and not first
                    idx = perm[m * mb_size : (m + 1) * mb_size]
                    mb = {k: v[idx] for k, v in full.items()}
                    sub = {k: state[k] for k in ("params", "opt_state", "calib")}
                    on_policy = epoch == 0 and m == 0  # params still equal the old params
                    new, mets = fns.update(sub, mesh_lib.put_batch(mb, mesh), calib_mb, on_policy)
                    state.update(new)
                    mets = {k: float(v) for k, v in mets.items()}
                    if not calib_mb:  # reference stats exist on calibrating mini-batches only
                        mets = {k: v for k, v in mets.items() if k not in CALIBRATION_ONLY}
                    upd.append(mets)
            t_train = time.perf_counter() - t1

            keys = set().union(*upd) - set(step_metrics)  # entropy: all tokens, from prepare
            for k in keys:
                vals = [u[k] for u in upd if k in u]
                step_metrics[k] = float(np.mean(vals))
            # BF16 reference stats exist on calibration steps only; between calibrations the
            # last ones stay in force, so log those (as calib/alpha is, from the state).
            for k in CALIBRATION_ONLY:
                if k in step_metrics:
                    carried[k] = step_metrics[k]
                elif k in carried:
                    step_metrics[k] = carried[k]
            skipped = sum(u["actor/nonfinite"] for u in upd)
            nonfinite_run = nonfinite_run + 1 if skipped == len(upd) else 0

            t_sync = push(step)
            wall = time.perf_counter() - t0
            n_tokens = int(batch.attention_mask.sum())
            kept = batch.response_mask.any(axis=1)
            step_metrics.update(
                {
                    "reward/mean": float(batch.rewards.mean()),
                    "reward/accuracy": float(batch.correct.mean()),
                    "response_length/mean": float(batch.response_lens.mean()),
                    "response_length/clip_ratio": float(batch.truncated.mean()),
                    "actor/nonfinite_updates": float(skipped),
                    "actor/lr": float(o.lr * min(1.0, step / max(o.warmup_steps, 1))),
                    "data/kept_samples": float(kept.sum()),
                    "timing/rollout_s": t_roll,
                    "timing/train_s": t_train,
                    "timing/sync_s": t_sync,
                    "timing/step_s": wall,
                    "throughput/tokens_per_s": n_tokens / wall,
                    **rstats,
                }
            )
            if (
                cfg.train.eval_every
                and step % cfg.train.eval_every == 0
                and step != cfg.train.steps
            ):
                step_metrics["eval/accuracy"] = run_eval()
            if step == cfg.train.steps:
                step_metrics["eval/accuracy"] = run_eval()
            metrics.log(step, step_metrics)
            carried_now.clear()
            carried_now.update(carried)
            if step % cfg.checkpoint.every == 0 or step == stop_at:
                save(step)
            if nonfinite_run >= cfg.train.max_nonfinite:
                save(step)
                raise RunStopped(
                    f"{nonfinite_run} steps in a row had only non-finite losses/gradients "
                    f"(updates skipped); stopped at step {step} with checkpoint "
                    f"{ckpt.directory}/{step}. Lower optim.lr or check the data, then resume: "
                    + _resume_hint(cfg)
                )
    except RolloutError as e:
        last = ckpt.latest_step()
        raise RunStopped(
            f"rollout backend failed at step {step}: {e}\nLast checkpoint: "
            f"{ckpt.directory}/{last} (step {last}). Fix the server, then resume: "
            + _resume_hint(cfg)
        ) from e
    finally:
        metrics.close()
        backend.close()
        ckpt.close()

    if step == cfg.train.steps and cfg.checkpoint.export_hf:
        hf_dir = run_dir / "hf_final"
        save_policy_folder(hf_dir, policy, state["params"])
        summary["hf_final"] = str(hf_dir)
    from jfp8rl.metrics import read_metrics

    recs = read_metrics(run_dir)
    evals = [(r["step"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    summary.update(
        {
            "steps": step,
            "eval_accuracy": evals,
            "wall_s_this_invocation": time.perf_counter() - t_start,
        }
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if evals:
        log(
            f"done: step {step}, greedy eval accuracy {evals[0][1]:.3f} (step {evals[0][0]}) -> "
            f"{evals[-1][1]:.3f} (step {evals[-1][0]}); run folder {run_dir}"
        )
    return summary
