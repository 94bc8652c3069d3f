"""The stages of one RL step, each a function of its own (`train_step` runs them in order):

    rollout     B prompts -> n samples each (`jfp8rl.trainer.rollout.collect`: rewards, DAPO
                dynamic sampling); with `rollout.max_staleness` 1 the batch started during
                the previous step, and the next step's batch starts on a worker thread
                (`jfp8rl.trainer.overlap`); otherwise the embedded engine then drops its
                weights until the sync (`rollout.free_cache_engine`)
    prepare     `step.prepare`: old logprobs under the training recipe (BF16 shadow on
                calibration steps), advantages, TIS weights
    update      PPO epochs x mini-batches of `step.update` (calibrated or plain bounds, AdamW)
    sync        push the new weights to the rollout backend (version "step-<k>")
    log         step metrics (+ greedy eval) to every sink
    checkpoint  every `checkpoint.every` steps, and at the end

and `stage_export`, the final HF folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jfp8rl.config import to_yaml
from jfp8rl.data.batch import RolloutBatch
from jfp8rl.observe.memory import log_memory, release_free_heap
from jfp8rl.observe.rollout_dump import write_rollouts
from jfp8rl.parallel import distributed
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer import on_policy
from jfp8rl.trainer.backends import kv_scale_push, push_format, push_params, version
from jfp8rl.trainer.errors import RunStopped, resume_hint
from jfp8rl.trainer.evaluation import evaluate
from jfp8rl.trainer.forward import UPDATE_INPUTS, present
from jfp8rl.trainer.overlap import Collected
from jfp8rl.trainer.policy import save_policy_folder
from jfp8rl.trainer.rollout import collect, share_rollout
from jfp8rl.trainer.state import Progress, Trainer, buffer_view
from jfp8rl.trainer.step import CALIBRATION_ONLY
from models.hf_io import iter_hf_state
from models.sharding import host_array


def rollout_job(t: Trainer, position: int, step: int, weights: int) -> Callable[[], Collected]:
    """Step `step`'s batch from data position `position`, sampled with the weights of step
    `weights` (each completion must carry that version), as a call for process 0."""
    seed = t.cfg.train.seed * 1_000_003 + step * 101
    return lambda: collect(
        t.backend, t.stream, position, t.fmt, t.verifier, t.rollout_settings,
        seed=seed, version=version(weights),
    )  # fmt: skip


def stage_rollout(t: Trainer, p: Progress, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """n samples for each of the step's B prompts, with rewards; advances the data position.
    Process 0 collects; every process gets the batch arrays (`jfp8rl.trainer.rollout.share_rollout`).
    With `rollout.max_staleness` 1: the batch sampled ahead during the previous step when there
    is one, and the stats `rollout/weight_version` (the step whose weights sampled the batch)
    and `rollout/staleness` (updates since: 0 or 1)."""
    ahead = t.ahead.take(step) if t.ahead is not None else None
    if ahead is None:
        collected, used = share_rollout(rollout_job(t, p.position, step, step - 1)), step - 1
    else:
        collected, used = ahead
    batch, p.position, rstats = collected
    release_free_heap()  # the decode loop's freed blocks (glibc keeps them), before prepare
    if t.ahead is not None:
        rstats = rstats | {"rollout/weight_version": float(used),
                           "rollout/staleness": float(step - 1 - used)}  # fmt: skip
    return batch, rstats


def checkpoint_due(t: Trainer, step: int, stop_at: int) -> bool:
    """Whether step `step` saves a checkpoint (`stage_checkpoint`, the run's last step)."""
    return step == stop_at or step % t.cfg.checkpoint.every == 0


def stage_start_ahead(t: Trainer, p: Progress, stop_at: int) -> None:
    """With `rollout.max_staleness` 1: starts the next step's batch on the worker thread, with
    the weights the backend serves now (step p.step - 1), unless this step is the last or
    saves a checkpoint (`jfp8rl.trainer.overlap`: a checkpoint has no batch in flight)."""
    if t.ahead is None or checkpoint_due(t, p.step, stop_at):
        return
    nxt = p.step + 1
    t.ahead.start(nxt, p.step - 1, rollout_job(t, p.position, nxt, p.step - 1))


def stage_settle(t: Trainer) -> float:
    """Waits until the batch sampled ahead (if any) is complete, so that the backend never
    samples and loads new weights at once; seconds waited."""
    t0 = time.perf_counter()
    if t.ahead is not None:
        t.ahead.settle()
    return time.perf_counter() - t0


def stage_prepare(
    t: Trainer, state: dict[str, Any], batch: RolloutBatch, calibrate: bool
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(the per-sample arrays the update reads, on host; prepare's metrics)."""
    host = {
        "tokens": batch.tokens,
        "attention_mask": batch.attention_mask,
        "prompt_lens": batch.prompt_lens,
        "response_mask": batch.response_mask,
        "rollout_logp": batch.rollout_logp,
        "rewards": batch.rewards,
        "response_lens": batch.response_lens,
    }
    if batch.routing is not None:  # routing replay: the rollout's experts
        host["routing"] = batch.routing
    out, mets = t.fns.prepare(
        state["params"], t.ref_params, mesh_lib.put_batch(host, t.mesh), calibrate
    )
    full = present(host, UPDATE_INPUTS) | {k: host_array(v) for k, v in out.items()}
    return full, {k: float(v) for k, v in mets.items()}


def stage_on_policy_check(
    t: Trainer, state: dict[str, Any], full: dict[str, np.ndarray]
) -> dict[str, float]:
    """`rollout.on_policy: exact`'s check on one mini-batch (`jfp8rl.trainer.on_policy`)."""
    rows = full["tokens"].shape[0] // t.cfg.train.mini_batches
    mets = on_policy.on_policy_check(
        t.policy.graphdef, t.settings, t.fns, t.mesh, state["params"], full, rows
    )
    if mets["rollout_corr/exact_share"] < 1.0:
        t.log(
            f"warning: rollout.on_policy=exact but only {mets['rollout_corr/exact_share']:.4f} of "
            f"the rollout's log-probs equal the trainer's (max |dlogp| "
            f"{mets['rollout_corr/max_abs_dlogp']:.3g}); the old log-probs are the rollout's"
        )
    return mets


def stage_update(
    t: Trainer, state: dict[str, Any], full: dict[str, np.ndarray], step: int, calibrate: bool
) -> list[dict[str, float]]:
    """PPO epochs x mini-batches of optimizer updates (in place on `state`); their metrics."""
    tc = t.cfg.train
    n_samples = full["tokens"].shape[0]
    mb_size = n_samples // tc.mini_batches
    updates_per_step = tc.ppo_epochs * tc.mini_batches
    state["rng"] = jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)
    )
    upd: list[dict[str, float]] = []
    for epoch in range(tc.ppo_epochs):
        perm = np.random.default_rng([tc.seed, step, epoch]).permutation(n_samples)
        for m in range(tc.mini_batches):
            # On a calibration step every mini-batch but the very first calibrates: the first
            # one's ratios are all 1 (on-policy) and carry no FP8 noise.
            on_policy = epoch == 0 and m == 0  # params still equal the old params
            calib_mb = calibrate and not (on_policy and updates_per_step > 1)
            idx = perm[m * mb_size : (m + 1) * mb_size]
            # Only a calibrating program reads the BF16 shadow logprobs.
            mb = {k: v[idx] for k, v in full.items() if calib_mb or k != "old_logp_bf16"}
            sub = {k: state[k] for k in ("params", "opt_state", "calib")}
            new, mets = t.fns.update(sub, mesh_lib.put_batch(mb, t.mesh), calib_mb, on_policy)
            state.update(new)
            mets = {k: float(v) for k, v in mets.items()}
            if not calib_mb:  # reference stats exist on calibrating mini-batches only
                mets = {k: v for k, v in mets.items() if k not in CALIBRATION_ONLY}
            upd.append(mets)
    return upd


def stage_sync(
    t: Trainer, state: dict[str, Any], step: int, batch: RolloutBatch | None = None
) -> float:
    """Pushes the params to the rollout backend as version `step-<step>`, with the FP8
    KV-cache scales servers need (`kv_scale_push`, calibrated on `batch`'s sequences, before
    any rollout on the eval prompts); seconds taken."""
    t0 = time.perf_counter()
    r = t.cfg.rollout
    seqs = None if batch is None else (batch.tokens, batch.attention_mask)
    first = batch is None and r.backend == "http" and r.kv_cache_dtype == "fp8"
    examples = t.eval_set[: r.max_num_seqs] if first else []
    prompts = t.fmt.encode(examples, t.cfg.data.max_prompt_tokens) if examples else []
    kv = kv_scale_push(r, t.policy.graphdef, state["params"], seqs, prompts)
    push_params(t.backend, t.policy.cfg, state["params"], version(step), push_format(r), kv)
    release_free_heap()  # the export's host copies, read and installed
    return time.perf_counter() - t0


def run_eval(t: Trainer) -> float:
    """avg@`eval.n` accuracy (greedy at `eval.temperature` 0) of the backend's current weights
    on the eval set."""
    c = t.cfg
    return evaluate(
        t.backend, t.eval_set, t.fmt, t.verifier, n=c.eval.n, temperature=c.eval.temperature,
        max_prompt_tokens=c.data.max_prompt_tokens, max_tokens=c.rollout.max_tokens,
        chunk=c.data.batch_size * c.rollout.n,
    ).avg  # fmt: skip


def step_metrics(
    t: Trainer,
    p: Progress,
    batch: RolloutBatch,
    rstats: dict[str, float],
    prep: dict[str, float],
    upd: list[dict[str, float]],
    timings: dict[str, float],
) -> dict[str, float]:
    """One step's record: prepare's metrics, the mean over updates, rollout stats, timings.
    Updates `p.carried` (calibration-only stats) and `p.nonfinite_run`."""
    out = dict(prep)
    for k in set().union(*upd) - set(prep):  # entropy: all tokens, from prepare
        out[k] = float(np.mean([u[k] for u in upd if k in u]))
    # BF16 reference stats exist on calibration steps only; between calibrations the last
    # ones stay in force, so log those (as calib/alpha is, from the state).
    for k in CALIBRATION_ONLY:
        if k in out:
            p.carried[k] = out[k]
        elif k in p.carried:
            out[k] = p.carried[k]
    skipped = sum(u["actor/nonfinite"] for u in upd)
    p.nonfinite_run = p.nonfinite_run + 1 if skipped == len(upd) else 0
    o = t.cfg.optim
    wall = timings["step_s"]
    out.update(
        {
            "reward/mean": float(batch.rewards.mean()),
            "reward/accuracy": float(batch.correct.mean()),
            "response_length/mean": float(batch.response_lens.mean()),
            "response_length/clip_ratio": float(batch.truncated.mean()),
            "actor/nonfinite_updates": float(skipped),
            "actor/lr": float(o.lr * min(1.0, p.step / max(o.warmup_steps, 1))),
            "data/kept_samples": float(batch.response_mask.any(axis=1).sum()),
            **{f"timing/{k}": v for k, v in timings.items()},
            "throughput/tokens_per_s": int(batch.attention_mask.sum()) / wall,
            **rstats,
        }
    )
    return out


def stage_log(t: Trainer, p: Progress, record: dict[str, float]) -> None:
    """Adds the greedy eval when due and writes the record to every sink (process 0)."""
    every, last = t.cfg.train.eval_every, t.cfg.train.steps

    def log_on_main() -> None:
        if p.step == last or (every and p.step % every == 0):
            record["eval/accuracy"] = run_eval(t)
            log_memory(t.log, f"eval {p.step}")
        t.metrics.log(p.step, record)

    distributed.on_main(log_on_main)


def stage_checkpoint(t: Trainer, state: dict[str, Any], p: Progress, force: bool = False) -> None:
    """Saves checkpoint `p.step` when due (every `checkpoint.every` steps) or `force`d.

    A failed save (disk full, a file-size limit) stops the run with `RunStopped` naming the
    error, the last checkpoint and the resume command. It does not go on to retry at the next
    checkpoint: the storage that refused this one will most likely refuse the next (and the
    metrics and the final export after it), steps trained meanwhile would be lost with the
    process anyway, and a resume repeats them exactly once space is freed."""
    if not (force or p.step % t.cfg.checkpoint.every == 0):
        return
    meta = {
        "step": p.step,
        "data_position": p.position,
        "nonfinite_run": p.nonfinite_run,
        "weight_version": version(p.step),
        "carried": dict(p.carried),
        "config": to_yaml(t.cfg),
    }
    try:
        t.ckpt.save(p.step, jax.tree.map(buffer_view, state), meta)
    except Exception as e:
        last = t.ckpt.latest_step()
        why = (str(e).splitlines() or [type(e).__name__])[0]
        fix, hint = "Fix the cause (disk full? a file-size limit?), then", resume_hint(t.cfg)
        then = (
            f"Last checkpoint: {t.ckpt.directory}/{last}. {fix} resume: {hint}"
            if last is not None
            else f"No checkpoint yet. {fix} start again: {hint.removesuffix(' --resume')}"
        )
        raise RunStopped(
            f"saving checkpoint {t.ckpt.directory}/{p.step} failed, nothing of it kept: {why}\n"
            + then
        ) from e
    log_memory(t.log, f"checkpoint {p.step}")


def stage_free_engine(t: Trainer) -> None:
    """`rollout.free_cache_engine`: the engine drops its weights until this step's sync, unless
    it samples the next batch meanwhile (`rollout.max_staleness` 1)."""
    if t.cfg.rollout.free_cache_engine and t.ahead is None and t.backend is not None:
        t.backend.release_weights()
        release_free_heap()  # the per-layer weights below glibc's mmap threshold


def train_step(t: Trainer, state: dict[str, Any], p: Progress, stop_at: int) -> None:
    """One RL step, stage by stage (module docstring); advances `p` and `state` in place."""
    p.step += 1
    t0 = time.perf_counter()
    batch, rstats = stage_rollout(t, p, p.step)
    t_roll = time.perf_counter() - t0
    log_memory(t.log, f"rollout {p.step}")
    stage_start_ahead(t, p, stop_at)
    stage_free_engine(t)
    t1 = time.perf_counter()
    calibrate = t.is_calibration_step(p.step)
    full, prep = stage_prepare(t, state, batch, calibrate)
    jax.block_until_ready(full)  # so that prepare_s holds prepare's compute, not update_s
    t_prep = time.perf_counter() - t1
    if on_policy.check_due(t.cfg, p.step):
        prep |= stage_on_policy_check(t, state, full)
    if t.cfg.logging.rollout_samples and distributed.is_main():
        write_rollouts(t.cfg.run_dir, p.step, batch, full["advantages"], t.fmt,
                       t.cfg.logging.rollout_samples, t.cfg.rollout.n)  # fmt: skip
    log_memory(t.log, f"prepare {p.step}")
    t2 = time.perf_counter()
    upd = stage_update(t, state, full, p.step, calibrate)
    t_update = time.perf_counter() - t2
    t_train = time.perf_counter() - t1
    log_memory(t.log, f"update {p.step}")
    t_settle = stage_settle(t)
    t_sync = stage_sync(t, state, p.step, batch)
    log_memory(t.log, f"sync {p.step}")
    timings = {
        "rollout_s": t_roll,
        "train_s": t_train,  # prepare + update (+ writing the rollout samples)
        "prepare_s": t_prep,  # the batch's old and reference logprobs, advantages
        "update_s": t_update,  # the optimizer updates
        "sync_s": t_sync,
        "step_s": time.perf_counter() - t0,
    }
    if t.ahead is not None:
        timings["settle_s"] = t_settle  # waiting, after the update, for the batch ahead
    stage_log(t, p, step_metrics(t, p, batch, rstats, prep, upd, timings))
    stage_checkpoint(t, state, p, force=p.step == stop_at)
    if p.nonfinite_run >= t.cfg.train.max_nonfinite:
        stage_checkpoint(t, state, p, force=True)
        raise RunStopped(
            f"{p.nonfinite_run} steps in a row had only non-finite losses/gradients "
            f"(updates skipped); stopped at step {p.step} with checkpoint "
            f"{t.ckpt.directory}/{p.step}. Lower optim.lr or check the data, then resume: "
            + resume_hint(t.cfg)
        )


def log_base_eval(t: Trainer) -> None:
    """Step 0's record: the base policy's greedy eval accuracy."""
    acc0 = run_eval(t)
    t.metrics.log(0, {"eval/accuracy": acc0})
    n = len(t.eval_set)
    t.log(f"base policy {t.policy.path}: greedy eval accuracy {acc0:.3f} on {n} prompts")


def stage_export(t: Trainer, state: dict[str, Any], p: Progress) -> Path:
    """Writes the final params as `<run_dir>/hf_final` (process 0; the others take part in
    its per-tensor gathers, all of them even when the write fails part-way). A failed write
    raises `RunStopped` on every process, naming the folder and the export command."""
    run_dir = Path(t.cfg.run_dir)
    hf_dir = run_dir / "hf_final"

    def write(tensors: Iterator[tuple[str, np.ndarray]]) -> None:
        try:
            save_policy_folder(hf_dir, t.policy, state["params"], tensors)
        except OSError as e:
            raise RunStopped(
                f"the final HF export to {hf_dir} failed ({e}); the run itself is complete, "
                f"with checkpoint {t.ckpt.directory}/{p.step}. Free the folder, then write "
                f"the export: python -m jfp8rl.export {run_dir} --step {p.step}"
            ) from e

    distributed.consume_on_main(write, iter_hf_state(t.policy.cfg, state["params"]))
    return hf_dir
