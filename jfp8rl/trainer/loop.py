"""The RL loop: `run(cfg)` drives one run folder from start or resume.

Before anything is loaded, `resume_point` decides what the run folder holds: nothing (a new
run), a run to resume (its newest intact checkpoint, whose saved config must equal this one but
for `jfp8rl.config.compare.RESUMABLE`; otherwise a `ConfigError` naming each differing key),
or a complete run (`run` says so and returns without writing anything). `setup` then builds a
`Trainer` (policy, rollout backend, mesh, compiled step programs, checkpoint manager, metrics
sinks) and the sharded train state; every step runs the stages of `jfp8rl.trainer.stages` in
order (rollout, prepare, update, sync, log, checkpoint), and `finish` writes the final HF folder
and the run summary. The command is `jfp8rl.train`; the Python API is `jfp8rl.api`.

Determinism: prompts come from `jfp8rl.data.stream.PromptStream` at the checkpointed position,
rollout seeds and mini-batch shuffles are derived from (train.seed, step, epoch), so a resumed
run repeats an uninterrupted one exactly on CPU (tests/jfp8rl/trainer/test_train_e2e.py), also
with one-step off-policy rollout (`rollout.max_staleness` 1, `jfp8rl.trainer.overlap`: no batch
is in flight at a checkpoint).

Failures: a rollout backend error (server gone, stale weights, malformed answer), a user
reward function that fails (`jfp8rl.data.rewards.RewardError`: before the step's update) or
`train.max_nonfinite` steps in a row whose updates were all skipped raise `RunStopped`,
naming the last checkpoint (saves are synchronous and atomic) and the resume command.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax

from jfp8rl.config import Config, ConfigError, save_config
from jfp8rl.config.compare import differences
from jfp8rl.config.loading import config_from_yaml
from jfp8rl.data.records import Example
from jfp8rl.data.rewards import Reward, RewardError
from jfp8rl.data.stream import PromptStream, build_datasets
from jfp8rl.data.templates import PromptFormat
from jfp8rl.observe.memory import log_memory, objects_before_frozen
from jfp8rl.observe.metrics import MetricsLogger, read_metrics
from jfp8rl.parallel import distributed
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer.backends import make_backend
from jfp8rl.trainer.checkpoint import (
    Checkpointer,
    checkpoints_dir,
    newest_intact,
    saved_meta,
    set_aside,
)
from jfp8rl.trainer.errors import CheckpointDamaged, RunStopped, resume_hint
from jfp8rl.trainer.overlap import RolloutAhead
from jfp8rl.trainer.policy import Policy, load_policy
from jfp8rl.trainer.settings import build_mesh, reward_of, rollout_settings, step_settings
from jfp8rl.trainer.stages import (
    log_base_eval,
    stage_checkpoint,
    stage_export,
    stage_sync,
    train_step,
)
from jfp8rl.trainer.state import Progress, Trainer, build_state
from jfp8rl.trainer.step import make_step_fns
from rollout_bridge.backend import RolloutBackend, RolloutError

# A run's (train, eval) examples.
Datasets = tuple[list[Example], list[Example]]


def open_run_dir(cfg: Config) -> Path:
    """Creates the run folder; points JAX's persistent compilation cache at
    `train.jax_cache_dir` when set."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.train.jax_cache_dir:
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.train.jax_cache_dir).absolute())
        )
    return run_dir


def resume_point(cfg: Config, run_dir: Path, resume: str) -> int | None:
    """The step to resume from: the newest checkpoint that passes its manifest check
    (`checkpoint.verify`), or None. Each newer damaged one is named on stderr in one line (its
    file, what is wrong) and set aside; with checkpoints but none intact the run stops
    (`CheckpointDamaged`). The checkpoint's config must equal `cfg` but for the resumable keys
    (`same_run`). Enforces `--resume`; `--fresh` ("never") first moves a previous run aside."""
    directory = checkpoints_dir(run_dir)
    if resume == "never" and run_dir.is_dir() and any(run_dir.iterdir()):
        moved = distributed.on_main(lambda: move_aside(run_dir))
        if moved is not None:
            print(f"--fresh: moved the previous run in {run_dir} to {moved}", file=sys.stderr)
    latest, rejected = newest_intact(directory, cfg.checkpoint.verify)
    if rejected and latest is None:
        problems = "; ".join(f"{directory}/{step}: {problem}" for step, problem in rejected)
        raise CheckpointDamaged(
            f"no intact checkpoint to resume from in {directory}: {problems}. Restore the "
            "damaged files, or start afresh in another run_dir"
        )
    if resume == "require" and latest is None:
        raise ConfigError(f"--resume: {run_dir}/checkpoints holds no checkpoint")
    if latest is not None:
        same_run(cfg, run_dir, latest)

    def set_aside_damaged() -> None:
        for step, problem in rejected:
            moved = set_aside(directory, step)
            msg = f"warning: checkpoint {directory}/{step} is damaged ({problem}); moved it to"
            print(f"{msg} {moved}, resuming from {directory}/{latest}", file=sys.stderr)

    distributed.on_main(set_aside_damaged)
    return latest


def same_run(cfg: Config, run_dir: Path, step: int) -> None:
    """`ConfigError` naming every key (checkpoint's value -> this one) in which `cfg` differs
    from the config checkpoint `step` was trained with, but for the resumable keys."""
    where = f"{checkpoints_dir(run_dir)}/{step}"
    old = config_from_yaml(saved_meta(run_dir, step)["config"], f"the config saved in {where}")
    diffs = differences(old, cfg)
    if not diffs:
        return
    changed = ", ".join(f"{key}: {a!r} -> {b!r}" for key, a, b in diffs)
    raise ConfigError(
        f"{run_dir} holds a run trained to step {step} with another config ({changed}). "
        f"Train this config in another folder (run_dir={free_name(run_dir, '-')}), or start "
        f"over here with --fresh (the previous run is moved to {free_name(run_dir, '.replaced-')}"
        f"); to resume the run as it was: python -m jfp8rl.train --config {run_dir}/config.yaml"
    )


def free_name(run_dir: Path, sep: str) -> Path:
    """`<run_dir><sep><k>` for the first k >= 1 not taken."""
    k = 1
    while run_dir.with_name(f"{run_dir.name}{sep}{k}").exists():
        k += 1
    return run_dir.with_name(f"{run_dir.name}{sep}{k}")


def move_aside(run_dir: Path) -> Path:
    """Renames the run folder to `<run_dir>.replaced-<k>` (nothing is deleted); the new path."""
    dest = free_name(run_dir, ".replaced-")
    run_dir.rename(dest)
    return dest


def load_datasets(cfg: Config) -> Datasets:
    """The (train, eval) examples of `cfg.data` (`jfp8rl.data.stream.build_datasets`)."""
    d = cfg.data
    if d.task == "python":
        raise ConfigError(
            "data.task=python: the examples are handed to jfp8rl.api.train (docs/python_api.md); "
            "on the command line use data.task=file with data.train_file=<.jsonl / .parquet>"
        )
    return build_datasets(
        d.task, d.train_file, d.eval_file, d.max_digits, d.eval_size,
        prompt_key=d.prompt_key, answer_key=d.answer_key, eval_share=d.eval_share, seed=d.seed,
    )  # fmt: skip


def build_trainer(
    cfg: Config,
    log: Any,
    policy: Policy,
    mesh: jax.sharding.Mesh,
    ckpt: Checkpointer,
    datasets: Datasets,
    reward: Reward,
) -> Trainer:
    """Data, prompt format, step programs; the backend and metrics sinks come later
    (`connect_backend`, `open_metrics`)."""
    d = cfg.data
    train_set, eval_set = datasets
    settings, opt = step_settings(cfg)
    layout = mesh_lib.param_layout(mesh, policy.cfg, policy.params)
    fns = make_step_fns(policy.graphdef, settings, opt, layout)
    return Trainer(
        cfg=cfg, log=log, policy=policy, backend=None, fns=fns, mesh=mesh,  # type: ignore[arg-type]
        settings=settings, ckpt=ckpt, metrics=None, verifier=reward,  # type: ignore[arg-type]
        stream=PromptStream(train_set, d.seed), eval_set=eval_set,
        fmt=PromptFormat.from_config(policy.path, policy.tokenizer, d),
        rollout_settings=rollout_settings(cfg), ref_params=None,
    )  # fmt: skip


def connect_backend(t: Trainer, latest: int | None) -> RolloutBackend:
    """`make_backend`, its failure turned into `RunStopped` naming the last checkpoint."""
    try:
        return make_backend(t.cfg, t.policy, Path(t.cfg.run_dir))
    except RolloutError as e:
        t.ckpt.close()
        last = latest if latest is not None else "none yet"
        raise RunStopped(f"{e}\nLast checkpoint: {last}; resume: {resume_hint(t.cfg)}") from e


def open_metrics(t: Trainer, p: Progress, out: Any) -> MetricsLogger:
    """The metrics sinks (jsonl, console, TensorBoard), counting from step `p.step`."""
    lg = t.cfg.logging
    return MetricsLogger(
        Path(t.cfg.run_dir), total_steps=t.cfg.train.steps, start_step=p.step,
        tensorboard=lg.tensorboard, console=lg.console != "none", stream=out,
    )  # fmt: skip


def setup(
    cfg: Config,
    latest: int | None,
    log: Any,
    out: Any,
    datasets: Datasets | None = None,
    reward: Reward | None = None,
) -> tuple[Trainer, dict[str, Any], Progress]:
    """Builds the trainer and its state (fresh, or from checkpoint `latest`), stage by stage;
    the config's data and reward unless `datasets` / `reward` are given."""
    datasets = datasets if datasets is not None else load_datasets(cfg)
    reward = reward if reward is not None else reward_of(cfg)
    log_memory(log, "start")
    run_dir = open_run_dir(cfg)
    mesh = build_mesh(cfg)
    policy = load_policy(cfg, log, mesh)
    log_memory(log, "loaded")
    ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep)
    if distributed.is_main():
        save_config(cfg, run_dir)
    t = build_trainer(cfg, log, policy, mesh, ckpt, datasets, reward)
    state, p = build_state(t, latest)
    log_memory(log, "state")
    # Process 0 alone talks to the backend and writes metrics (None on the others).
    t.backend = distributed.on_main(lambda: connect_backend(t, latest))  # type: ignore[assignment]
    t.metrics = open_metrics(t, p, out) if distributed.is_main() else None  # type: ignore[assignment]
    t.ahead = RolloutAhead() if cfg.rollout.max_staleness else None
    return t, state, p


def run_steps(t: Trainer, state: dict[str, Any], p: Progress, stop_at: int) -> None:
    """The first sync (at step 0 after the base checkpoint, then the base policy's eval), then
    the steps up to `stop_at`; a rollout backend failure or a failed write becomes `RunStopped`."""
    try:
        if p.step == 0:  # saved before the engine holds weights: the save's buffers beside less
            stage_checkpoint(t, state, p, force=True)
        stage_sync(t, state, p.step)
        log_memory(t.log, f"sync {p.step}")
        if p.step == 0:
            distributed.on_main(lambda: log_base_eval(t))
            log_memory(t.log, "eval 0")
        while p.step < stop_at:
            train_step(t, state, p, stop_at)
    except RewardError as e:
        last = t.ckpt.latest_step()
        raise RunStopped(
            f"the reward failed at step {p.step}, before its update: {e}\nLast checkpoint: "
            f"{t.ckpt.directory}/{last} (step {last}). Fix the reward function, then resume: "
            + resume_hint(t.cfg)
        ) from e
    except RolloutError as e:
        last = t.ckpt.latest_step()
        raise RunStopped(
            f"rollout backend failed at step {p.step}: {e}\nLast checkpoint: "
            f"{t.ckpt.directory}/{last} (step {last}). Fix the server, then resume: "
            + resume_hint(t.cfg)
        ) from e
    except OSError as e:  # a write of the run (weight export, metrics, dumps): disk full, ...
        last = t.ckpt.latest_step()
        raise RunStopped(
            f"a write failed at step {p.step}: {e}\nLast checkpoint: {t.ckpt.directory}/{last} "
            f"(step {last}). Fix the cause (disk full? a file-size limit?), then resume: "
            + resume_hint(t.cfg)
        ) from e


def finish(t: Trainer, state: dict[str, Any], p: Progress, t_start: float) -> dict[str, Any]:
    """The final HF export (when configured) and the run summary (summary.json)."""
    cfg, run_dir = t.cfg, Path(t.cfg.run_dir)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "base_policy": str(t.policy.path)}
    if p.step == cfg.train.steps and cfg.checkpoint.export_hf:
        summary["hf_final"] = str(stage_export(t, state, p))
        log_memory(t.log, "export")
    if not distributed.is_main():
        return summary
    recs = read_metrics(run_dir)
    evals = [(r["step"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    wall_s = time.perf_counter() - t_start
    summary.update({"steps": p.step, "eval_accuracy": evals, "wall_s_this_invocation": wall_s})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if evals:
        t.log(
            f"done: step {p.step}, greedy eval accuracy {evals[0][1]:.3f} (step {evals[0][0]}) -> "
            f"{evals[-1][1]:.3f} (step {evals[-1][0]}); run folder {run_dir}"
        )
    return summary


def run(
    cfg: Config,
    *,
    resume: str = "auto",
    stream: Any = None,
    datasets: Datasets | None = None,
    reward: Reward | None = None,
) -> dict[str, Any]:
    """Runs (or resumes) the RL loop of `cfg`; returns the run summary (also summary.json).

    `datasets` (train, eval examples) and `reward` replace the config's data and reward when
    given (`jfp8rl.api`). A run folder whose run is complete (its last checkpoint and its
    summary.json written) is left as it is: one line says so and how to extend it, and the
    summary has `complete: True`."""
    t_start = time.perf_counter()
    out = stream or sys.stdout
    console = cfg.logging.console != "none" and distributed.is_main()

    def log(msg: str) -> None:
        if console:
            print(msg, file=out, flush=True)

    # Everything that can be wrong with the request fails here, before a policy is loaded.
    reward = reward if reward is not None else reward_of(cfg)
    datasets = datasets if datasets is not None else load_datasets(cfg)
    run_dir, steps = Path(cfg.run_dir), cfg.train.steps
    latest = resume_point(cfg, run_dir, resume)
    # A run stopped after its last checkpoint but before its summary (the final export did
    # not finish) resumes there and writes them; only a run with both is complete.
    if latest is not None and latest >= steps and (run_dir / "summary.json").is_file():
        if distributed.is_main():
            print(
                f"{run_dir} is complete (step {latest} of {steps}); to train it further, rerun "
                f"with train.steps=<more than {latest}>, or use another run_dir (or --fresh) "
                "for a new run",
                file=out,
                flush=True,
            )
        return {"run_dir": str(run_dir), "steps": latest, "complete": True}
    if latest is not None and distributed.is_main():
        print(f"resuming {run_dir} from step {latest} of {steps}", file=out, flush=True)
    with objects_before_frozen():  # each stage's collection walks the run's objects only
        t, state, p = setup(cfg, latest, log, out, datasets, reward)
        stop_at = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
        try:
            run_steps(t, state, p, stop_at)
        finally:
            if t.ahead is not None:
                t.ahead.close()  # a batch still in flight finishes before the backend closes
            if distributed.is_main():
                t.metrics.close()
                t.backend.close()
            t.ckpt.close()
        return finish(t, state, p, t_start)
