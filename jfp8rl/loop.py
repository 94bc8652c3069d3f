"""The RL loop (DESIGN.md section 7): `run(cfg)` drives one run folder from start or resume.

`setup` builds a `Trainer` (policy, rollout backend, mesh, compiled step programs, checkpoint
manager, metrics sinks) and the sharded train state; then every step is the same sequence of
named stages, each a function of its own:

    rollout     B prompts -> n samples each (`rollout.collect`: rewards, DAPO dynamic sampling)
    prepare     `step.prepare`: old logprobs under the training recipe (BF16 shadow on
                calibration steps), advantages, TIS weights
    update      PPO epochs x mini-batches of `step.update` (calibrated or plain bounds, AdamW)
    sync        push the new weights to the rollout backend (version "step-<k>")
    log         step metrics (+ greedy eval) to every sink
    checkpoint  every `checkpoint.every` steps, and at the end

The pieces live in their own modules (config, data, rewards, rollout, step, mesh, checkpoint,
metrics, warmstart); the CLI is `jfp8rl.train`.

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
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl import distributed
from jfp8rl import mesh as mesh_lib
from jfp8rl.checkpoint import Checkpointer
from jfp8rl.config import (
    Config,
    ConfigError,
    RolloutConfig,
    check_batch_split,
    save_config,
    to_yaml,
)
from jfp8rl.data import BUILTIN_TASKS, Example, PromptStream, build_datasets
from jfp8rl.eval import evaluate
from jfp8rl.export import save_policy_folder
from jfp8rl.metrics import MetricsLogger, read_metrics
from jfp8rl.rewards import Verifier, get_verifier
from jfp8rl.rollout import RolloutBatch, RolloutSettings, collect
from jfp8rl.rollout_dump import write_rollouts
from jfp8rl.step import OptimSettings, StepFns, StepSettings, default_settings, make_step_fns
from jfp8rl.templates import PromptFormat, stop_token_ids
from losses import calibrated as cal
from losses.registry import get_algorithm
from models.config import ModelConfig
from models.fp8 import get_recipe
from models.hf_io import iter_hf_state, load_hf
from models.sharding import host_array
from models.tokenizer import load_tokenizer
from rollout_bridge.backend import RolloutBackend, RolloutError
from rollout_bridge.export import fetch_dtype

# Metrics that only a calibrating mini-batch computes (`losses.calibrated.calibrate`); between
# calibrations the last values stay in force and are logged as such.
CALIBRATION_ONLY = (
    "calib/bf16_clipfrac_neg_lower",
    "calib/bf16_clipfrac_pos_upper",
    "calib/balance_bf16",
)
# Batch arrays the update reads per mini-batch (rewards / lengths only feed `prepare`).
UPDATE_INPUTS = ("tokens", "attention_mask", "prompt_lens", "response_mask", "rollout_logp")


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


def load_policy(cfg: Config, log: Any, mesh: jax.sharding.Mesh | None = None) -> Policy:
    """The base policy: `model.path`, or the cached warm-started tiny policy. With `mesh`,
    each param is loaded straight into its sharding (no full model on one device)."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path}: no config.json there (need an HF folder)")
    else:
        if cfg.data.task not in BUILTIN_TASKS:
            raise ConfigError(
                f"model.path is empty: the built-in base policy needs data.task in {BUILTIN_TASKS}"
            )
        from jfp8rl.warmstart import ensure_base_policy

        train, evals = build_datasets(
            cfg.data.task, "", "", cfg.data.max_digits, cfg.data.eval_size
        )
        w = cfg.warmstart
        ensure = lambda: ensure_base_policy(  # noqa: E731
            w.cache_dir, cfg.model.preset, train, evals,
            task_tag=f"{cfg.data.task}-{cfg.data.max_digits}-{cfg.data.eval_size}",
            steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=w.seed,
            prompt_len=cfg.data.max_prompt_tokens, answer_len=cfg.rollout.max_tokens,
            carry_noise=w.carry_noise, target_accuracy=w.target_accuracy, log=log,
        )  # fmt: skip
        # Process 0 trains and caches it; the others then read that cache (a shared folder).
        path = distributed.on_main(ensure) or ensure()
    m = cfg.model
    mcfg, graphdef, params = load_hf(
        path, mesh=mesh, compute_dtype=jnp.dtype(m.compute_dtype), remat=m.remat,
        attention=m.attention,
    )  # fmt: skip
    tok = load_tokenizer(path)
    return Policy(mcfg, graphdef, params, tok, stop_token_ids(path, tok)[0], path)


def push_format(r: RolloutConfig) -> str:
    """The rollout format of the weight pushes: `rollout.export_format`, else bf16 for servers
    and the engine's own default for the embedded backend (`default_export_format`). Every
    process of a run decides it the same way: it sets the dtype the params are fetched in."""
    if r.export_format:
        return r.export_format
    if r.backend == "embedded":
        from rollout_bridge.engine.embedded import default_export_format

        return default_export_format(get_recipe(r.recipe))
    return "bf16"


def make_backend(cfg: Config, policy: Policy, run_dir: Path) -> RolloutBackend:
    """The configured rollout backend; it serves weights from the first `stage_sync` on.

    backend "http": one `HttpBackend` for `rollout.url`, a `ServerPool` for `rollout.urls`
    (servers that do not answer /health at start are dropped with a warning)."""
    r = cfg.rollout
    root = r.export_root or None
    if r.backend == "embedded":
        from rollout_bridge.engine.embedded import EmbeddedBackend

        # No weights at construction (an f32 copy of the model): the run's first sync pushes
        # the weights it serves, before any sampling.
        return EmbeddedBackend(
            policy.cfg, policy.graphdef, None,
            recipe=r.recipe, eos_id=policy.eos_id, weight_version="base",
            export_format=push_format(r), export_root=root,
        )  # fmt: skip
    from rollout_bridge.client.http_backend import HttpBackend
    from rollout_bridge.client.pool import ServerPool
    from rollout_bridge.client.settings import ClientSettings

    settings = ClientSettings(
        token=r.api_key or None, timeout_s=r.timeout_s, max_retries=r.max_retries,
        export_format=push_format(r), export_root=root, export_hash=r.export_hash or None,
    )  # fmt: skip
    urls = r.server_urls()
    backend: RolloutBackend = (
        ServerPool(urls, settings) if r.urls else HttpBackend(urls[0], settings)
    )
    if not backend.health():
        backend.close()
        raise RolloutError(
            f"rollout server(s) {', '.join(urls)} not answering /health; start them, e.g. "
            f"`python -m rollout_bridge.serve --model {policy.path} --port <port>`, "
            "and set rollout.url (one server) or rollout.urls (several)"
        )
    return backend


def _resume_hint(cfg: Config) -> str:
    return f"python -m jfp8rl.train --config {Path(cfg.run_dir) / 'config.yaml'} --resume"


def version(k: int) -> str:
    """Weight version label of the params after step k ("step-0" = the base policy)."""
    return f"step-{k}"


def step_settings(cfg: Config) -> tuple[StepSettings, OptimSettings]:
    """The jitted step's static settings from the config (algorithm, calibration, AdamW)."""
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
    s = default_settings(
        algo, train_recipe=cfg.train.recipe, calibrated=a.clip == "calibrated",
        calib_cfg=calib_cfg, correction=a.correction, correction_level=a.correction_level,
        tis_cap=a.tis_cap, group_size=cfg.rollout.n,
        micro_batch_size=cfg.train.micro_batch_size, grad_format=cfg.train.grad_format,
    )  # fmt: skip
    o = cfg.optim
    updates_per_step = cfg.train.ppo_epochs * cfg.train.mini_batches
    opt = OptimSettings(
        o.lr, o.warmup_steps * updates_per_step, o.weight_decay, o.grad_clip, o.b1, o.b2, o.eps
    )
    return s, opt


def build_mesh(cfg: Config) -> jax.sharding.Mesh:
    """The configured (data, fsdp, tensor) mesh; errors name `train.mesh`."""
    m = cfg.train.mesh
    try:
        mesh = mesh_lib.make_mesh(m.data, m.fsdp, m.tensor)
    except ValueError as e:
        raise ConfigError(
            f"train.mesh={{data: {m.data}, fsdp: {m.fsdp}, tensor: {m.tensor}}}: {e}"
        ) from e
    check_batch_split(cfg, mesh_lib.batch_size_divisor(mesh))
    return mesh


@dataclasses.dataclass
class Trainer:
    """What the stages share; built once by `setup`."""

    cfg: Config
    log: Any
    policy: Policy
    backend: RolloutBackend
    fns: StepFns
    mesh: jax.sharding.Mesh
    settings: StepSettings
    ckpt: Checkpointer
    metrics: MetricsLogger
    verifier: Verifier
    stream: PromptStream
    eval_set: list[Example]
    fmt: PromptFormat  # prompt / chat template and stop tokens (jfp8rl.templates)
    rollout_settings: RolloutSettings
    ref_params: Any  # the base policy (KL loss) or None

    @property
    def calibrated(self) -> bool:
        return self.settings.calibrated

    def is_calibration_step(self, step: int) -> bool:
        return self.calibrated and self.settings.calib_cfg.is_calibration_step(step - 1)


@dataclasses.dataclass
class Progress:
    """The run's position: what a checkpoint's meta holds besides the state."""

    step: int = 0
    position: int = 0  # prompts drawn from the stream so far
    nonfinite_run: int = 0  # steps in a row whose updates were all skipped
    carried: dict[str, float] = dataclasses.field(default_factory=dict)  # CALIBRATION_ONLY


def init_state(t: Trainer, params: Any) -> dict[str, Any]:
    """The sharded train state (params, optimizer state, calibration state, PRNG key data)."""
    sh = t.fns.state_shardings(cal.init_calib_state(t.settings.calib_cfg))
    params = jax.device_put(params, sh["params"])
    return {
        "params": params,
        # Initialised in place in its sharding: no full optimizer state on one device.
        "opt_state": jax.jit(t.fns.optimizer.init, out_shardings=sh["opt_state"])(params),
        "calib": jax.device_put(cal.init_calib_state(t.settings.calib_cfg), sh["calib"]),
        # Replicated on the mesh (one global array, also across processes).
        "rng": jax.device_put(
            jax.random.key_data(jax.random.key(t.cfg.train.seed)), t.fns.layout.replicated()
        ),
    }


# ---------------------------------------------------------------------------------- stages


def stage_rollout(t: Trainer, p: Progress, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """n samples for each of the step's B prompts, with rewards; advances the data position.
    Process 0 collects; every process gets the batch arrays (`distributed.share_rollout`)."""
    seed = t.cfg.train.seed * 1_000_003 + step * 101

    def collect_on_main() -> tuple[RolloutBatch, int, dict[str, float]]:
        return collect(
            t.backend, t.stream, p.position, t.fmt, t.verifier, t.rollout_settings,
            seed=seed, version=version(step - 1),
        )  # fmt: skip

    batch, p.position, rstats = distributed.share_rollout(collect_on_main)
    return batch, rstats


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
    out, mets = t.fns.prepare(
        state["params"], t.ref_params, mesh_lib.put_batch(host, t.mesh), calibrate
    )
    full = {k: host[k] for k in UPDATE_INPUTS} | {k: host_array(v) for k, v in out.items()}
    return full, {k: float(v) for k, v in mets.items()}


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


def push_params(
    backend: RolloutBackend | None, cfg: ModelConfig, params: Any, version: str, fmt: str
) -> None:
    """Pushes `params` to `backend` as `version` in the rollout format `fmt`.

    One tensor at a time (a layer slice made on the devices, in HF layout and the push's dtype
    `fetch_dtype(fmt)`, then fetched): the host never holds a full copy of the model. Process 0
    pushes (`backend` is None on the others); every process takes part in the per-tensor
    gathers of a multi-process run."""
    distributed.consume_on_main(
        lambda tensors: backend.push_weights(tensors, version),
        iter_hf_state(cfg, params, dtype=fetch_dtype(fmt)),
    )


def stage_sync(t: Trainer, state: dict[str, Any], step: int) -> float:
    """Pushes the params to the rollout backend as version `step-<step>`; seconds taken."""
    t0 = time.perf_counter()
    push_params(t.backend, t.policy.cfg, state["params"], version(step), push_format(t.cfg.rollout))
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
        t.metrics.log(p.step, record)

    distributed.on_main(log_on_main)


def stage_checkpoint(t: Trainer, state: dict[str, Any], p: Progress, force: bool = False) -> None:
    """Saves checkpoint `p.step` when due (every `checkpoint.every` steps) or `force`d."""
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
    t.ckpt.save(p.step, jax.tree.map(buffer_view, state), meta)


def buffer_view(x: Any) -> Any:
    """A second `jax.Array` over the same device buffers (no copy), for a reader that leaves
    references behind: orbax's save caches per-shard arrays on the arrays it saves (jax's
    fully-replicated-shard / addressable-shards caches), and a buffer with such a reference
    cannot be donated, so the next update would copy the whole train state (measured:
    +6.7 GiB for qwen3_0.6b on one CPU device). Saving views leaves the state's own arrays
    clean; the views (and their caches) die after the save."""
    if not isinstance(x, jax.Array):
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def train_step(t: Trainer, state: dict[str, Any], p: Progress, stop_at: int) -> None:
    """One RL step, stage by stage (module docstring); advances `p` and `state` in place."""
    p.step += 1
    t0 = time.perf_counter()
    batch, rstats = stage_rollout(t, p, p.step)
    t_roll = time.perf_counter() - t0
    log_memory(t.log, f"rollout {p.step}")
    t1 = time.perf_counter()
    calibrate = t.is_calibration_step(p.step)
    full, prep = stage_prepare(t, state, batch, calibrate)
    if t.cfg.logging.rollout_samples and distributed.is_main():
        write_rollouts(t.cfg.run_dir, p.step, batch, full["advantages"], t.fmt,
                       t.cfg.logging.rollout_samples, t.cfg.rollout.n)  # fmt: skip
    log_memory(t.log, f"prepare {p.step}")
    upd = stage_update(t, state, full, p.step, calibrate)
    t_train = time.perf_counter() - t1
    log_memory(t.log, f"update {p.step}")
    t_sync = stage_sync(t, state, p.step)
    log_memory(t.log, f"sync {p.step}")
    timings = {
        "rollout_s": t_roll,
        "train_s": t_train,
        "sync_s": t_sync,
        "step_s": time.perf_counter() - t0,
    }
    stage_log(t, p, step_metrics(t, p, batch, rstats, prep, upd, timings))
    stage_checkpoint(t, state, p, force=p.step == stop_at)
    if p.nonfinite_run >= t.cfg.train.max_nonfinite:
        stage_checkpoint(t, state, p, force=True)
        raise RunStopped(
            f"{p.nonfinite_run} steps in a row had only non-finite losses/gradients "
            f"(updates skipped); stopped at step {p.step} with checkpoint "
            f"{t.ckpt.directory}/{p.step}. Lower optim.lr or check the data, then resume: "
            + _resume_hint(t.cfg)
        )


# ------------------------------------------------------------------------------ the run


def host_rss_gib() -> dict[str, float]:
    """This process's resident memory in GiB from /proc/self/status: `rss` (VmRSS), `peak`
    (VmHWM), `anon` (RssAnon: heap, device buffers on CPU) and `file` (RssFile: mapped files,
    e.g. memory-mapped safetensors); empty where there is no /proc."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    names = {"rss": "VmRSS", "peak": "VmHWM", "anon": "RssAnon", "file": "RssFile"}
    return {k: float(fields.get(v, "0 kB").split()[0]) / 2**20 for k, v in names.items()}


def log_memory(log: Any, stage: str) -> None:
    """With JFP8RL_DEBUG_MEMORY=1, one line `memory: <stage> rss X GiB peak Y GiB (anon A,
    file F)` (what benchmarks/host_memory.py prints to attribute the peak to a stage)."""
    if os.environ.get("JFP8RL_DEBUG_MEMORY") == "1":
        m = host_rss_gib()
        log(
            f"memory: {stage} rss {m.get('rss', 0):.2f} GiB peak {m.get('peak', 0):.2f} GiB "
            f"(anon {m.get('anon', 0):.2f}, file {m.get('file', 0):.2f})"
        )


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


def open_checkpoints(cfg: Config, run_dir: Path, resume: str) -> tuple[Checkpointer, int | None]:
    """The run's checkpoint manager and its latest step; enforces `--resume` / `--fresh`."""
    ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep)
    latest = ckpt.latest_step()
    if resume == "require" and latest is None:
        ckpt.close()
        raise ConfigError(f"--resume: {run_dir}/checkpoints holds no checkpoint")
    if resume == "never" and latest is not None:
        ckpt.close()
        raise ConfigError(f"--fresh: {run_dir} already holds checkpoints; pick another run_dir")
    return ckpt, latest


def rollout_settings(cfg: Config) -> RolloutSettings:
    """What `rollout.collect` needs from the config (batch, sampling, overlong shaping)."""
    d, r, w = cfg.data, cfg.rollout, cfg.reward
    return RolloutSettings(
        batch_size=d.batch_size, n=r.n, max_prompt_tokens=d.max_prompt_tokens,
        max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        dynamic_sampling=r.dynamic_sampling, max_rounds=r.max_rounds, overlong=w.overlong,
        overlong_buffer=w.overlong_buffer, overlong_penalty=w.overlong_penalty,
    )  # fmt: skip


def build_trainer(
    cfg: Config, log: Any, policy: Policy, mesh: jax.sharding.Mesh, ckpt: Checkpointer
) -> Trainer:
    """Data, prompt format, step programs; the backend and metrics sinks come later
    (`connect_backend`, `open_metrics`)."""
    d = cfg.data
    train_set, eval_set = build_datasets(
        d.task, d.train_file, d.eval_file, d.max_digits, d.eval_size,
        prompt_key=d.prompt_key, answer_key=d.answer_key,
    )  # fmt: skip
    settings, opt = step_settings(cfg)
    layout = mesh_lib.param_layout(mesh, policy.cfg, policy.params)
    fns = make_step_fns(policy.graphdef, settings, opt, layout)
    return Trainer(
        cfg=cfg, log=log, policy=policy, backend=None, fns=fns, mesh=mesh,  # type: ignore[arg-type]
        settings=settings, ckpt=ckpt, metrics=None, verifier=get_verifier(cfg.reward.kind),  # type: ignore[arg-type]
        stream=PromptStream(train_set, d.seed), eval_set=eval_set,
        fmt=PromptFormat.from_config(policy.path, policy.tokenizer, d),
        rollout_settings=rollout_settings(cfg), ref_params=None,
    )  # fmt: skip


def build_state(t: Trainer, latest: int | None) -> tuple[dict[str, Any], Progress]:
    """The train state (fresh from the base policy, or checkpoint `latest`) and the run's
    position. The loaded params become the state's (no copy; the policy keeps none, since
    the update donates them); the KL reference, if any, is the only second copy."""
    state = init_state(t, t.policy.params)
    t.policy.params = None
    if t.settings.algo.use_kl_loss:
        copy = jax.jit(lambda x: jax.tree.map(jnp.copy, x), out_shardings=t.fns.layout.params())
        t.ref_params = copy(state["params"])
    if latest is None:
        return state, Progress()
    # Restore into abstract arrays once the fresh state is gone: one state in memory.
    like = jax.tree.map(abstract_array, state)
    del state
    state, meta = t.ckpt.restore(latest, like)
    p = Progress(
        meta["step"], meta["data_position"], meta["nonfinite_run"], dict(meta.get("carried", {}))
    )
    t.log(f"resumed from {t.ckpt.directory}/{latest} (step {p.step}, data position {p.position})")
    return state, p


def abstract_array(x: Any) -> Any:
    """An array -> its `jax.ShapeDtypeStruct` with the same sharding (no memory)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def connect_backend(t: Trainer, latest: int | None) -> RolloutBackend:
    """`make_backend`, its failure turned into `RunStopped` naming the last checkpoint."""
    try:
        return make_backend(t.cfg, t.policy, Path(t.cfg.run_dir))
    except RolloutError as e:
        t.ckpt.close()
        last = latest if latest is not None else "none yet"
        raise RunStopped(f"{e}\nLast checkpoint: {last}; resume: {_resume_hint(t.cfg)}") from e


def open_metrics(t: Trainer, p: Progress, out: Any) -> MetricsLogger:
    """The metrics sinks (jsonl, console, TensorBoard), counting from step `p.step`."""
    lg = t.cfg.logging
    return MetricsLogger(
        Path(t.cfg.run_dir), total_steps=t.cfg.train.steps, start_step=p.step,
        tensorboard=lg.tensorboard, console=lg.console != "none", stream=out,
    )  # fmt: skip


def setup(
    cfg: Config, resume: str, log: Any, out: Any
) -> tuple[Trainer, dict[str, Any], Progress, int | None]:
    """Builds the trainer and its state (fresh or from the latest checkpoint), stage by stage."""
    run_dir = open_run_dir(cfg)
    mesh = build_mesh(cfg)
    policy = load_policy(cfg, log, mesh)
    log_memory(log, "loaded")
    ckpt, latest = open_checkpoints(cfg, run_dir, resume)
    if distributed.is_main():
        save_config(cfg, run_dir)
    t = build_trainer(cfg, log, policy, mesh, ckpt)
    state, p = build_state(t, latest)
    log_memory(log, "state")
    # Process 0 alone talks to the backend and writes metrics (None on the others).
    t.backend = distributed.on_main(lambda: connect_backend(t, latest))  # type: ignore[assignment]
    t.metrics = open_metrics(t, p, out) if distributed.is_main() else None  # type: ignore[assignment]
    return t, state, p, latest


def run_steps(t: Trainer, state: dict[str, Any], p: Progress, stop_at: int) -> None:
    """The first sync (and at step 0 the base policy's eval and checkpoint), then the steps
    up to `stop_at`; a rollout backend failure becomes `RunStopped`."""
    try:
        stage_sync(t, state, p.step)
        log_memory(t.log, f"sync {p.step}")
        if p.step == 0:
            distributed.on_main(lambda: log_base_eval(t))
            log_memory(t.log, "eval 0")
            stage_checkpoint(t, state, p, force=True)
            log_memory(t.log, "checkpoint 0")
        while p.step < stop_at:
            train_step(t, state, p, stop_at)
    except RolloutError as e:
        last = t.ckpt.latest_step()
        raise RunStopped(
            f"rollout backend failed at step {p.step}: {e}\nLast checkpoint: "
            f"{t.ckpt.directory}/{last} (step {last}). Fix the server, then resume: "
            + _resume_hint(t.cfg)
        ) from e


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


def finish(t: Trainer, state: dict[str, Any], p: Progress, t_start: float) -> dict[str, Any]:
    """The final HF export (when configured) and the run summary (summary.json)."""
    cfg, run_dir = t.cfg, Path(t.cfg.run_dir)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "base_policy": str(t.policy.path)}
    if p.step == cfg.train.steps and cfg.checkpoint.export_hf:
        summary["hf_final"] = str(stage_export(t, state, p))
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


def run(cfg: Config, *, resume: str = "auto", stream: Any = None) -> dict[str, Any]:
    """Runs (or resumes) the RL loop of `cfg`; returns the run summary (also summary.json)."""
    t_start = time.perf_counter()
    out = stream or sys.stdout
    console = cfg.logging.console != "none" and distributed.is_main()

    def log(msg: str) -> None:
        if console:
            print(msg, file=out, flush=True)

    t, state, p, _ = setup(cfg, resume, log, out)
    stop_at = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    try:
        run_steps(t, state, p, stop_at)
    finally:
        if distributed.is_main():
            t.metrics.close()
            t.backend.close()
        t.ckpt.close()
    return finish(t, state, p, t_start)
