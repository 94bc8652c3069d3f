"""The trainer's settings derived from the config: the jitted step's static settings, the
rollout settings and the device mesh. Every error names the config key."""

from __future__ import annotations

import dataclasses

import jax

from jfp8rl.config import AlgorithmConfig, Config, ConfigError, check_batch_split
from jfp8rl.data.rewards import Reward, get_verifier, load_reward_functions
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer.microbatch import length_buckets
from jfp8rl.trainer.on_policy import require_backend
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.rollout import RolloutSettings
from jfp8rl.trainer.step_settings import StepSettings, default_settings
from losses import calibrated as cal
from losses.registry import Algorithm, get_algorithm
from losses.rollout_rejection import parse_rejection


def loss_algorithm(a: AlgorithmConfig) -> Algorithm:
    """The loss's `Algorithm`: the registry's entry of `algorithm.name` with every value the
    config resolved (its preset, or the explicit keys); verl's grpo estimator without the std
    normalisation is the registry's `dr_grpo` estimator."""
    dr_grpo = a.adv_estimator == "grpo" and not a.norm_adv_by_std_in_grpo
    return dataclasses.replace(
        get_algorithm(a.name),
        eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip or None,
        use_kl_loss=a.kl_coef > 0, kl_coef=a.kl_coef, entropy_coef=a.entropy_coef,
        agg_mode=a.loss_agg_mode, adv_estimator="dr_grpo" if dr_grpo else a.adv_estimator,
    )  # fmt: skip


def step_settings(cfg: Config) -> tuple[StepSettings, OptimSettings]:
    """The jitted step's static settings from the config (algorithm, calibration, AdamW)."""
    require_backend(cfg)
    a = cfg.algorithm
    algo = loss_algorithm(a)
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
        correction_lower=a.correction_lower, correction_batch_norm=a.correction_batch_norm,
        rejection=parse_rejection(a.rejection, a.rejection_threshold),
        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
        length_buckets=length_buckets(cfg.max_sequence_tokens, cfg.train.length_buckets),
        temperature=cfg.rollout.temperature,
        old_logp_from_rollout=cfg.rollout.on_policy == "exact",
        moe_aux_loss_coef=a.moe_aux_loss_coef,
    )  # fmt: skip
    o = cfg.optim
    updates_per_step = cfg.train.ppo_epochs * cfg.train.mini_batches
    opt = OptimSettings(
        o.lr, o.warmup_steps * updates_per_step, o.weight_decay, o.grad_clip, o.b1, o.b2, o.eps
    )
    return s, opt


def rollout_settings(cfg: Config) -> RolloutSettings:
    """What `rollout.collect` needs from the config (batch, sampling, overlong shaping)."""
    d, r, w = cfg.data, cfg.rollout, cfg.reward
    return RolloutSettings(
        batch_size=d.batch_size, n=r.n, max_prompt_tokens=d.max_prompt_tokens,
        max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        dynamic_sampling=r.dynamic_sampling, max_rounds=r.max_rounds, overlong=w.overlong,
        overlong_buffer=w.overlong_buffer, overlong_penalty=w.overlong_penalty,
        routing_replay=r.routing_replay == "record",
    )  # fmt: skip


def build_mesh(cfg: Config) -> jax.sharding.Mesh:
    """The configured (data, fsdp, expert, tensor) mesh; errors name `train.mesh`."""
    mesh = mesh_lib.mesh_for_config(cfg.train.mesh)
    check_batch_split(cfg, mesh_lib.batch_size_divisor(mesh))
    return mesh


def reward_of(cfg: Config) -> Reward:
    """The run's reward: the built-in verifier `reward.kind`, or (kind "function") the user's
    functions loaded from `reward.path`; a missing file or function is a `ConfigError`
    naming the key."""
    r = cfg.reward
    if r.kind != "function":
        return get_verifier(r.kind)
    try:
        return load_reward_functions(r.path, r.name, r.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from e
