"""The policy a run trains: loaded from an HF folder (or the built-in warm-started tiny
policy), and written back as an HF folder that renders prompts and stops like the run
(`hf_final`, `python -m jfp8rl.export`)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jfp8rl.config import Config, ConfigError, load_config
from jfp8rl.data.stream import build_datasets
from jfp8rl.data.tasks import BUILTIN_TASKS
from jfp8rl.parallel import distributed
from jfp8rl.trainer.checkpoint import restore_params
from jfp8rl.trainer.warmstart import ensure_base_policy
from models.config import ModelConfig
from models.hf_io import load_hf, save_hf
from models.tokenizer import load_tokenizer, stop_token_ids

# Files of the base policy's folder that carry prompt / stop-token behaviour.
_TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclasses.dataclass
class Policy:
    """The base policy as loaded from its HF folder."""

    cfg: Any  # models.config.ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Any
    stop_ids: tuple[int, ...]  # end-of-turn ids (`models.tokenizer.stop_token_ids`)
    path: Path


def load_policy(cfg: Config, log: Any, mesh: jax.sharding.Mesh | None = None) -> Policy:
    """The base policy: `model.path`, or the cached warm-started tiny policy. With `mesh`,
    each param is loaded straight into its sharding (no full model on one device)."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()  # `~/...` as a shell would read it
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path}: no config.json there (need an HF folder)")
    else:
        if cfg.data.task == "file":
            raise ConfigError(
                f"model.path is empty: the built-in base policy needs data.task in {BUILTIN_TASKS}"
                " (or examples of its arithmetic task handed to jfp8rl.api.train)"
            )
        # Examples handed to the Python API meet the arithmetic task's base policy.
        task = cfg.data.task if cfg.data.task in BUILTIN_TASKS else "arithmetic"
        train, evals = build_datasets(task, "", "", cfg.data.max_digits, cfg.data.eval_size)
        w = cfg.warmstart
        ensure = lambda: ensure_base_policy(  # noqa: E731
            w.cache_dir, cfg.model.preset, train, evals,
            task_tag=f"{task}-{cfg.data.max_digits}-{cfg.data.eval_size}",
            steps=w.steps, batch_size=w.batch_size, lr=w.lr, seed=w.seed,
            prompt_len=cfg.data.max_prompt_tokens, answer_len=cfg.rollout.max_tokens,
            carry_noise=w.carry_noise, target_accuracy=w.target_accuracy, log=log,
        )  # fmt: skip
        # Process 0 trains and caches it; the others then read that cache (a shared folder).
        path = distributed.on_main(ensure) or ensure()
    m = cfg.model
    mcfg, graphdef, params = load_hf(
        path, mesh=mesh, compute_dtype=jnp.dtype(m.compute_dtype), remat=m.remat,
        attention=m.attention, batch_invariant=cfg.rollout.on_policy == "exact",
    )  # fmt: skip
    if cfg.rollout.routing_replay == "record" and not mcfg.is_moe:
        raise ConfigError(
            f"rollout.routing_replay=record needs a Mixture-of-Experts model; {path} is a dense "
            f"{mcfg.arch} model: set rollout.routing_replay=off"
        )
    check_exact_moe(mcfg, 1 if mesh is None else mesh.size, path)
    if cfg.algorithm.moe_aux_loss_coef and not mcfg.is_moe:
        raise ConfigError(
            f"algorithm.moe_aux_loss_coef={cfg.algorithm.moe_aux_loss_coef} needs a "
            f"Mixture-of-Experts model; {path} is a dense {mcfg.arch} model: set it to 0"
        )
    tok = load_tokenizer(path)
    return Policy(mcfg, graphdef, params, tok, stop_token_ids(path, tok), path)


def save_policy_folder(
    out: str | Path, policy: Policy, params: Any, tensors: Iterable[Any] | None = None
) -> Path:
    """`save_hf` of `params` (`tensors`: their `iter_hf_state`, when the caller makes it) with
    the base policy's tokenizer, then its tokenizer config, chat template and generation
    config copied over (save_hf writes generic ones), so the folder renders prompts and stops
    like the run. Used for `hf_final` and exports."""
    tok = policy.tokenizer
    out = save_hf(out, policy.cfg, params, tok, tensors=tensors)
    for name in _TOKENIZER_FILES:
        src = Path(policy.path) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)
    return out


def export_checkpoint(
    run_dir: str | Path, step: int, out_dir: str | Path | None = None, log: Any = print
) -> Path:
    """Writes checkpoint `step` of `run_dir` as an HF folder (`<run_dir>/hf_step_<step>` by
    default) with the run's base-policy tokenizer files, as `hf_final` is written; returns it.
    Only the FP32 master params are restored (no optimizer state is materialised), after the
    checkpoint's manifest check (`checkpoint.verify` of the run's config)."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    policy = load_policy(cfg, log=log)
    params = restore_params(run_dir, step, policy.params, verify=cfg.checkpoint.verify)
    out = Path(out_dir) if out_dir else run_dir / f"hf_step_{step}"
    return save_policy_folder(out, policy, params)


def check_exact_moe(mcfg: ModelConfig, devices: int, path: Path) -> None:
    """`rollout.on_policy: exact` with a Mixture-of-Experts model holds on one trainer device:
    on a mesh each device runs its own tokens' expert rows (and expert parallelism exchanges
    them), in other groups than the engine's one-device program."""
    if mcfg.is_moe and mcfg.batch_invariant and devices > 1:
        raise ConfigError(
            f"rollout.on_policy=exact with the Mixture-of-Experts model {path}: its layers are "
            f"batch-invariant on one device only, train.mesh has {devices}; set train.mesh to "
            "one device or rollout.on_policy=off"
        )
