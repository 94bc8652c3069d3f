"""The whole run configuration: `Config`, its sections, and the checks across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from jfp8rl.config.checks import ConfigError
from jfp8rl.config.rollout import RolloutConfig, check_exact_on_policy
from jfp8rl.config.sections import (
    AlgorithmConfig,
    CalibrationConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    PolicyConfig,
    RewardConfig,
    TrainConfig,
    WarmStartConfig,
)


@dataclasses.dataclass
class Config:
    # Run folder: config.yaml, metrics.jsonl, tb/, checkpoints/, hf_final/.
    run_dir: str = "runs/tiny_cpu"
    model: PolicyConfig = field(default_factory=PolicyConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        a, c = self.algorithm, self.calibration
        if c.range_lo > 1 - a.eps_low or c.range_hi < 1 + a.eps_high:
            raise ConfigError(
                f"calibration.range_lo={c.range_lo} / range_hi={c.range_hi} must contain the plain "
                f"bounds [1 - algorithm.eps_low, 1 + algorithm.eps_high] = "
                f"[{1 - a.eps_low:g}, {1 + a.eps_high:g}]"
            )
        samples = self.data.batch_size * self.rollout.n
        if samples % self.train.mini_batches:
            raise ConfigError(
                f"train.mini_batches={self.train.mini_batches} must divide "
                f"data.batch_size * rollout.n = {samples}"
            )
        budget, seq_len = self.train.max_tokens_per_micro_batch, self.max_sequence_tokens
        if budget and self.rollout.routing_replay == "record":
            raise ConfigError(
                f"rollout.routing_replay=record with train.max_tokens_per_micro_batch={budget}: "
                "the token-budget micro-batches do not carry the recorded routing; set "
                "train.max_tokens_per_micro_batch=0"
            )
        if budget and budget < seq_len:
            raise ConfigError(
                f"train.max_tokens_per_micro_batch={budget} cannot hold one full-length sequence "
                f"of data.max_prompt_tokens + rollout.max_tokens = {seq_len} tokens; set it to "
                f">= {seq_len} (or 0: fixed micro-batches)"
            )
        m = self.train.mesh
        if -1 not in (m.data, m.fsdp, m.expert):
            check_batch_split(self, m.data * m.fsdp * m.expert)
        check_exact_on_policy(self.rollout, self.train.recipe, m.tensor)

    @property
    def max_sequence_tokens(self) -> int:
        """The padded length of every sequence: data.max_prompt_tokens + rollout.max_tokens."""
        return self.data.max_prompt_tokens + self.rollout.max_tokens

    @property
    def mini_batch_size(self) -> int:
        """Samples per optimizer update: data.batch_size * rollout.n / train.mini_batches."""
        return self.data.batch_size * self.rollout.n // self.train.mini_batches


def check_batch_split(cfg: Config, batch_devices: int) -> None:
    """Mini- and micro-batches must split evenly: micro | mini, and both are multiples of the
    `batch_devices` = data x fsdp x expert devices that share the samples (a -1 mesh axis is checked
    once the mesh is built)."""
    mini, micro = cfg.mini_batch_size, cfg.train.micro_batch_size
    if micro and micro < mini and mini % micro:
        raise ConfigError(
            f"train.micro_batch_size={micro} must divide the mini-batch size {mini} "
            "(data.batch_size * rollout.n / train.mini_batches)"
        )
    per_forward = micro if micro and micro < mini else mini
    if per_forward % batch_devices:
        what = "train.micro_batch_size" if per_forward == micro else "the mini-batch size"
        raise ConfigError(
            f"{what} {per_forward} must be a multiple of the {batch_devices} devices of "
            "train.mesh data x fsdp x expert that split the samples"
        )
