"""The jitted step's static settings (`StepSettings`): the recipes, the loss algorithm, the
calibration, the rollout correction and rejection, and the micro-batch layout of the update.
`jfp8rl.trainer.settings.step_settings` builds them from a config; `default_settings` from names,
as tests and benchmarks do."""

from __future__ import annotations

from typing import NamedTuple

from losses import calibrated as cal
from losses import rollout_rejection as rej
from losses.registry import Algorithm
from models.fp8 import Recipe, get_recipe


class StepSettings(NamedTuple):
    """Static settings of the jitted functions (from the config)."""

    train_recipe: Recipe
    shadow_recipe: Recipe  # BF16 recipe of the calibration shadow pass
    algo: Algorithm
    calibrated: bool
    calib_cfg: cal.CalibConfig
    correction: str  # tis | icepop | mis | none (losses.rollout_correction.CORRECTIONS)
    correction_level: str
    tis_cap: float
    group_size: int
    micro_batch_size: int = 0  # sequences per forward/backward; 0 = the whole (mini-)batch
    correction_lower: float = 0.5  # IcePop's lower bound
    correction_batch_norm: bool = False  # IS weights divided by their batch mean
    rejection: tuple[rej.RejectionRule, ...] = ()  # losses.rollout_rejection.parse_rejection
    # Token-budget micro-batches of the update (`jfp8rl.trainer.token_budget`): tokens per
    # device per micro-batch (0 = off) and the padded lengths they may take.
    max_tokens_per_micro_batch: int = 0
    length_buckets: tuple[int, ...] = ()
    temperature: float = 1.0  # rollout.temperature: logprobs are scored at logits / temperature
    # rollout.on_policy=exact: the rollout's log-probs are the old log-probs (no recompute).
    old_logp_from_rollout: bool = False
    # algorithm.moe_aux_loss_coef: weight of an MoE policy's load-balancing loss in the update.
    moe_aux_loss_coef: float = 0.0


def default_settings(
    algo: Algorithm,
    *,
    train_recipe: str,
    calibrated: bool,
    calib_cfg: cal.CalibConfig,
    correction: str,
    correction_level: str,
    tis_cap: float,
    group_size: int,
    micro_batch_size: int = 0,
    grad_format: str = "e4m3",
    correction_lower: float = 0.5,
    correction_batch_norm: bool = False,
    rejection: tuple[rej.RejectionRule, ...] = (),
    max_tokens_per_micro_batch: int = 0,
    length_buckets: tuple[int, ...] = (),
    temperature: float = 1.0,
    old_logp_from_rollout: bool = False,
    moe_aux_loss_coef: float = 0.0,
) -> StepSettings:
    """`StepSettings` from config names (recipes by name, BF16 as the shadow); `grad_format`
    (`train.grad_format`) is the train recipe's output-gradient format in the backward GEMMs."""
    return StepSettings(
        train_recipe=get_recipe(train_recipe, bwd_format=grad_format),
        shadow_recipe=get_recipe("bf16"),
        algo=algo,
        calibrated=calibrated,
        calib_cfg=calib_cfg,
        correction=correction,
        correction_level=correction_level,
        tis_cap=tis_cap,
        group_size=group_size,
        micro_batch_size=micro_batch_size,
        correction_lower=correction_lower,
        correction_batch_norm=correction_batch_norm,
        rejection=rejection,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        length_buckets=tuple(length_buckets),
        temperature=temperature,
        old_logp_from_rollout=old_logp_from_rollout,
        moe_aux_loss_coef=moe_aux_loss_coef,
    )
