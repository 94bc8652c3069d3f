"""The run configuration's sections, one dataclass each, with a comment on every field.

Sections: model, warmstart, data, rollout (its own module, `rollout`), reward, algorithm, calibration, train (with its
mesh), optim, checkpoint, eval, logging. Hyperparameter names follow verl where one exists
(`eps_low`/`eps_high` = verl's `clip_ratio_low`/`clip_ratio_high`). Each `__post_init__` checks
its values and raises `ConfigError` naming the full key; choice lists come from the module that
owns the choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from jfp8rl.config.checks import ConfigError, check_choice, check_positive
from jfp8rl.data.rewards import VERIFIERS
from jfp8rl.data.tasks import BUILTIN_TASKS
from jfp8rl.data.templates import check_prompt_template
from losses.calibrated import BALANCES, MODES, UPPER_RULES
from losses.checks import AGG_MODES
from losses.registry import ALGORITHMS
from losses.rollout_correction import CORRECTION_LEVELS, CORRECTIONS
from losses.rollout_rejection import parse_rejection
from models.config import PRESETS
from models.fp8 import RECIPES


@dataclasses.dataclass
class PolicyConfig:
    # HF folder of the base policy (config.json + safetensors + tokenizer.json). Empty: build
    # (once, then cached) the built-in tiny base policy with a supervised warm start.
    path: str = ""
    # Architecture preset (models.config.PRESETS) of the built-in base policy; unused with path.
    preset: str = "tiny_arith"
    # Activation / matmul-input dtype ("bfloat16" as in the paper; "float32" is faster on CPU).
    compute_dtype: str = "bfloat16"
    # Decoder-layer rematerialisation in the backward pass: "none" keeps every activation,
    # "full" recomputes each layer (long sequences), "save_dots" keeps the matmul outputs.
    remat: str = "none"
    # Self-attention (models.attention): "auto" (cuDNN flash on GPU, chunked elsewhere),
    # "chunked" (blockwise online softmax, memory linear in T), "cudnn", "reference" (T x T).
    attention: str = "auto"

    def __post_init__(self) -> None:
        check_choice("model", "preset", self.preset, PRESETS)
        check_choice("model", "compute_dtype", self.compute_dtype, ("bfloat16", "float32"))
        check_choice("model", "remat", self.remat, ("none", "full", "save_dots"))
        check_choice(
            "model", "attention", self.attention, ("auto", "reference", "chunked", "cudnn")
        )


@dataclasses.dataclass
class WarmStartConfig:
    # Supervised steps on the built-in task (the most, when target_accuracy is set).
    steps: int = 150
    # Stop the warm start once greedy accuracy on 256 training problems reaches this (checked
    # every 10 steps; 0 = always run `steps`). A target, not a step count, makes the base
    # policy the same across jax versions: the supervised curve has a cliff.
    target_accuracy: float = 0.0
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    # Built-in task: probability that a warm-start label is the carry-less sum (58+67 -> "15")
    # instead of the true one: a systematic bad habit for RL to remove (0 = clean labels).
    carry_noise: float = 0.0
    # Base policies are cached here under a hash of (preset, task, warm start) settings.
    cache_dir: str = "runs/.base_policies"

    def __post_init__(self) -> None:
        check_positive("warmstart", "steps", self.steps, allow_zero=True)
        check_positive("warmstart", "batch_size", self.batch_size)
        check_positive("warmstart", "lr", self.lr)
        if not 0 <= self.carry_noise <= 1:
            raise ConfigError(f"warmstart.carry_noise={self.carry_noise} must be in [0, 1]")
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(
                f"warmstart.target_accuracy={self.target_accuracy} must be in [0, 1] (0 = off)"
            )


@dataclasses.dataclass
class DataConfig:
    # "arithmetic": the built-in a+b task; "scratchpad": the same sums answered after a
    # column-addition scratchpad (>= 32 response tokens at max_digits 3; jfp8rl/data/tasks.py);
    # "file": `train_file` / `eval_file`, .jsonl or .parquet, flat {prompt, answer} or
    # verl-layout records (jfp8rl/data/records.py); "python": the examples handed to
    # `jfp8rl.api.train` (docs/python_api.md).
    task: str = "arithmetic"
    train_file: str = ""
    # Empty: a held-out share of the training file (`eval_share`), never trained on.
    eval_file: str = ""
    # Dotted paths of the prompt / answer in each record; empty = "prompt" and "answer" (or
    # verl's "reward_model.ground_truth").
    prompt_key: str = ""
    answer_key: str = ""
    # Python format string around the prompt text with one field {prompt}; write literal
    # braces doubled: "{prompt} Let's think step by step and output the final answer within
    # \\boxed{{}}." Empty = the prompt as is. For chat prompts it wraps the last user message.
    prompt_template: str = ""
    # "auto": render with the model folder's chat template (tokenizer_config.json
    # `chat_template` or chat_template.jinja) when it has one, add_generation_prompt on (a
    # message-list prompt without one is an error); "none": raw prompt text.
    chat_template: str = "auto"
    # Extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Built-in task: operands have 1..max_digits digits; eval_size held-out problems.
    max_digits: int = 2
    # Eval problems: at most eval_size (the first of eval_file). Without an eval_file,
    # ceil(eval_share x the training examples), at most eval_size, are drawn (seeded by
    # data.seed) from the training set and left out of training.
    eval_size: int = 256
    eval_share: float = 0.05
    # Prompts per RL step (before the n samples each).
    batch_size: int = 16
    # Prompts are padded (or rejected, naming the example) to this many tokens.
    max_prompt_tokens: int = 8
    # Seed of the per-epoch shuffle of the training prompts.
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("data", "task", self.task, (*BUILTIN_TASKS, "file", "python"))
        if self.task == "file" and not self.train_file:
            raise ConfigError(
                f"data.task={self.task} needs data.train_file=<path to a .jsonl / .parquet file>"
            )
        check_choice("data", "chat_template", self.chat_template, ("auto", "none"))
        if self.prompt_template:
            try:
                check_prompt_template(self.prompt_template)
            except ValueError as e:
                raise ConfigError(f"data.prompt_template: {e}") from e
        check_positive("data", "batch_size", self.batch_size)
        check_positive("data", "max_prompt_tokens", self.max_prompt_tokens)
        check_positive("data", "eval_size", self.eval_size, allow_zero=True)
        if not 0 < self.eval_share < 1:
            raise ConfigError(f"data.eval_share={self.eval_share} must be in (0, 1)")
        if not 1 <= self.max_digits <= 6:
            raise ConfigError(f"data.max_digits={self.max_digits} must be in [1, 6]")


@dataclasses.dataclass
class RewardConfig:
    # "task": the built-in task's verifier; "exact": exact string match after stripping;
    # "math": math-verify equivalence of the last boxed / final answer; "math_natural": the
    # same on the last boxed answer, else the last number ("12 + 7 = 19"); "scratchpad": the
    # scratchpad task's format and final sum (an off-format response counts as garbled,
    # reward/unparsed_frac); "function": the user's functions `name` of the Python file `path`,
    # called as verl calls a custom reward: compute_score(data_source, solution_str,
    # ground_truth, extra_info) -> float, or a dict with "score" whose other numeric entries are
    # logged as reward/<key> (jfp8rl/data/rewards.py).
    kind: str = "task"
    # reward.kind function: the file (verl's custom_reward_function.path), the function name or
    # several comma-separated (summed with `weights`, TRL's reward_weights; empty = 1 each).
    path: str = ""
    name: str = "compute_score"
    weights: list[float] = field(default_factory=list)
    # DAPO soft overlong punishment over the last `overlong_buffer` tokens of max_tokens.
    overlong: bool = False
    overlong_buffer: int = 2
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_choice("reward", "kind", self.kind, (*VERIFIERS, "function"))
        if self.kind == "function" and not self.name.strip():
            raise ConfigError("reward.name is empty; name the reward function (compute_score)")
        check_positive("reward", "overlong_buffer", self.overlong_buffer)


# verl's advantage estimators that this trainer implements (`algorithm.adv_estimator`).
ADV_ESTIMATORS = ("grpo", "rloo")


def algorithm_preset(name: str) -> dict[str, Any]:
    """The `algorithm.*` values of registry algorithm `name` (losses.registry), in the config's
    terms: every key of `PRESET_KEYS`. A config key left unset takes its value from here."""
    algo = ALGORITHMS[name]
    return {
        "eps_low": algo.eps_low,
        "eps_high": algo.eps_high,
        "dual_clip": algo.dual_clip or 0.0,
        "kl_coef": algo.kl_coef if algo.use_kl_loss else 0.0,
        "entropy_coef": algo.entropy_coef,
        "loss_agg_mode": algo.agg_mode,
        "adv_estimator": "grpo" if algo.adv_estimator == "dr_grpo" else algo.adv_estimator,
        "norm_adv_by_std_in_grpo": algo.adv_estimator != "dr_grpo",
    }


@dataclasses.dataclass
class AlgorithmConfig:
    # Loss family (losses.registry): grpo | dapo | dr_grpo | gspo. It selects the preset of
    # every key below marked "preset": a key the YAML and the overrides leave unset (or set to
    # null) takes the algorithm's own value, an explicit one wins (`algorithm_preset`;
    # `python -m jfp8rl.train --config C --print-config` shows the values a run uses).
    name: str = "grpo"
    # "plain": fixed [1 - eps_low, 1 + eps_high]; "calibrated": Calibrated Clipping bounds.
    clip: str = "calibrated"
    # preset: plain ratio bounds 1 - eps_low, 1 + eps_high (verl's clip_ratio_low / _high).
    eps_low: float | None = None
    eps_high: float | None = None
    # preset: dual-clip constant for A < 0 (verl's clip_ratio_c); 0 disables it.
    dual_clip: float | None = None
    # preset: verl's actor.loss_agg_mode: token-mean | seq-mean-token-mean |
    # seq-mean-token-sum | seq-mean-token-sum-norm (losses/masked.py).
    loss_agg_mode: str | None = None
    # preset: verl's algorithm.adv_estimator: grpo | rloo (losses/advantages.py), and verl's
    # algorithm.norm_adv_by_std_in_grpo (false: Dr.GRPO's R - mean_G; grpo only).
    adv_estimator: str | None = None
    norm_adv_by_std_in_grpo: bool | None = None
    # Rollout correction (losses.rollout_correction, verl's rollout_is), rho = pi_old / pi_rollout:
    # "tis" min(rho, C), "icepop" 0 outside [correction_lower, C], "mis" 0 above C; C = tis_cap.
    correction: str = "tis"
    correction_level: str = "token"
    tis_cap: float = 2.0
    correction_lower: float = 0.5
    correction_batch_norm: bool = False  # weights / their batch mean
    # Rejection (losses.rollout_rejection, verl's rollout_rs): modes and thresholds; "" = off.
    rejection: str = ""
    rejection_threshold: str = ""
    # preset: k3 KL to the base policy as a loss term (0 disables it and the reference forward).
    kl_coef: float | None = None
    # preset: weight of the entropy bonus.
    entropy_coef: float | None = None
    # Weight of an MoE policy's load-balancing loss (models.moe.load_balancing_loss, logged as
    # actor/moe_aux_loss). 0 keeps RL off the router's balance: docs/design.md section 4.
    moe_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        check_choice("algorithm", "name", self.name, ALGORITHMS)
        for key, value in algorithm_preset(self.name).items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        check_choice("algorithm", "clip", self.clip, ("plain", "calibrated"))
        check_choice("algorithm", "loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        check_choice("algorithm", "adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_choice("algorithm", "correction", self.correction, CORRECTIONS)
        check_choice("algorithm", "correction_level", self.correction_level, CORRECTION_LEVELS)
        check_positive("algorithm", "eps_low", self.eps_low)
        check_positive("algorithm", "eps_high", self.eps_high)
        if self.eps_low >= 1:
            raise ConfigError(f"algorithm.eps_low={self.eps_low} must be < 1")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or 0: off)")
        check_positive("algorithm", "dual_clip", self.dual_clip, allow_zero=True)
        check_positive("algorithm", "tis_cap", self.tis_cap)
        if self.correction == "icepop" and not 0 < self.correction_lower <= self.tis_cap:
            raise ConfigError(
                f"algorithm.correction_lower={self.correction_lower} not in (0, tis_cap]"
            )
        try:
            parse_rejection(self.rejection, self.rejection_threshold)
        except ValueError as e:
            raise ConfigError(f"algorithm.rejection / rejection_threshold: {e}") from e
        check_positive("algorithm", "kl_coef", self.kl_coef, allow_zero=True)
        check_positive("algorithm", "moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)
        if self.name == "gspo" and self.clip == "calibrated":
            # GSPO clips sequence-level ratios (bounds ~1 +- 4e-4); Calibrated Clipping matches
            # token-level clip shares, so its bounds would mean nothing there.
            raise ConfigError(
                "algorithm.clip=calibrated is not defined for algorithm.name=gspo (it clips "
                "sequence-level ratios); set algorithm.clip=plain"
            )


# The `algorithm.*` keys an algorithm's preset fills (`algorithm_preset`).
PRESET_KEYS = tuple(algorithm_preset("grpo"))


@dataclasses.dataclass
class CalibrationConfig:
    # Recalibrate (BF16 shadow logprobs) every `every` steps, starting at step 1.
    every: int = 20
    # EMA factor beta for the bounds: L <- beta * L_prev + (1 - beta) * L_new.
    ema: float = 0.9
    # Clamp range [range_lo, range_hi] of the calibrated bounds.
    range_lo: float = 0.6
    range_hi: float = 1.8
    # "hold" (default): L, H from calibrating mini-batches, kept between calibrations;
    # "track": recompute L, H every mini-batch from stored alpha, p_ref (docs/fp8_study.md).
    mode: str = "hold"
    # "balance" (match BF16's positive/negative balance), "quantile", or "plain" (keep
    # 1 + eps_high, calibrate L only: the paper's Fig. 5 lower-only ablation).
    upper_rule: str = "balance"
    # Target of the balance rule: "absolute" (BF16 balance) or "relative" (BF16 share of kept
    # P over kept N mass, independent of the mini-batch's advantage mix; losses/calibrated/solve.py).
    balance: str = "absolute"

    def __post_init__(self) -> None:
        check_positive("calibration", "every", self.every)
        if not 0 <= self.ema < 1:
            raise ConfigError(f"calibration.ema={self.ema} must be in [0, 1)")
        if not 0 < self.range_lo <= 1 <= self.range_hi:
            raise ConfigError(
                f"calibration.range_lo={self.range_lo}, range_hi={self.range_hi}: "
                "need 0 < range_lo <= 1 <= range_hi"
            )
        check_choice("calibration", "mode", self.mode, MODES)
        check_choice("calibration", "upper_rule", self.upper_rule, UPPER_RULES)
        check_choice("calibration", "balance", self.balance, BALANCES)


@dataclasses.dataclass
class MeshConfig:
    # Devices per axis of the (data, fsdp, expert, tensor) mesh (jfp8rl.parallel.mesh); one may
    # be -1 = the remaining devices. data: params replicated, samples split; fsdp: params and
    # optimizer state sharded (models.sharding), samples split; tensor: attention/MLP
    # projections split; expert: a Mixture-of-Experts model's experts split (expert
    # parallelism, models.expert_parallel: tokens exchanged all-to-all), samples split, the
    # other params sharded as over fsdp (a dense model: one more FSDP axis).
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert}
        for name, v in sizes.items():
            if v == 0 or v < -1:
                raise ConfigError(f"train.mesh.{name}={v} must be a positive int or -1 (the rest)")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ConfigError(
                f"train.mesh={sizes}: at most one axis may be -1 (the remaining devices)"
            )


@dataclasses.dataclass
class TrainConfig:
    # FP8 recipe of the trainer's forward/backward (models.fp8.get_recipe names).
    recipe: str = "fp8_block"
    # Format of the output gradient, the operand the backward GEMMs (dgrad and wgrad) quantize,
    # of an FP8 train.recipe: "e4m3" (as the forward) or "e5m2" (wider range, 2 mantissa bits:
    # the usual FP8 training choice for gradients). The BF16 recipe has no FP8 gradient.
    grad_format: str = "e4m3"
    steps: int = 60
    ppo_epochs: int = 1
    # Mini-batches per PPO epoch (each one optimizer update); must divide the sample count.
    mini_batches: int = 4
    # Sequences per forward/backward (gradients accumulated over a mini-batch's micro-batches
    # in one program, `prepare` runs micro-batch by micro-batch); 0 = the whole mini-batch.
    # Must divide the mini-batch and be a multiple of train.mesh data x fsdp x expert.
    micro_batch_size: int = 0
    # Token-budget micro-batches of the update (jfp8rl/trainer/token_budget.py): at most this
    # many tokens per device per micro-batch, sequences sorted by length and each micro-batch
    # padded only to its longest one rounded up to one of `length_buckets` lengths (T, T / 2,
    # T / 4, ... with T = data.max_prompt_tokens + rollout.max_tokens: one compiled shape per
    # bucket). 0 = off (fixed micro-batches of train.micro_batch_size, which `prepare` keeps
    # using either way). Must hold one full-length sequence (>= T).
    max_tokens_per_micro_batch: int = 0
    length_buckets: int = 6
    seed: int = 0
    # Greedy accuracy on the eval set every `eval_every` steps (0 = only before and after).
    eval_every: int = 20
    # Non-finite loss, grads or updated params skip the update; this many in a row stop the run.
    max_nonfinite: int = 3
    # Stop after this many steps even if train.steps is larger (tests of resume); 0 = off.
    stop_after: int = 0
    # JAX persistent compilation cache folder (reruns skip compiling); empty = off.
    jax_cache_dir: str = ""
    # The device mesh; the default is a single device.
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        check_choice("train", "recipe", self.recipe, RECIPES)
        check_choice("train", "grad_format", self.grad_format, ("e4m3", "e5m2"))
        if self.recipe == "bf16" and self.grad_format != "e4m3":
            raise ConfigError(
                f"train.grad_format={self.grad_format} needs an FP8 train.recipe (bf16 has no FP8 "
                "gradient); set train.recipe=fp8_tensor|fp8_row|fp8_block or train.grad_format=e4m3"
            )
        check_positive("train", "steps", self.steps)
        check_positive("train", "ppo_epochs", self.ppo_epochs)
        check_positive("train", "mini_batches", self.mini_batches)
        check_positive("train", "micro_batch_size", self.micro_batch_size, allow_zero=True)
        check_positive(
            "train", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, allow_zero=True
        )
        check_positive("train", "length_buckets", self.length_buckets)
        check_positive("train", "eval_every", self.eval_every, allow_zero=True)
        check_positive("train", "max_nonfinite", self.max_nonfinite)


@dataclasses.dataclass
class OptimConfig:
    # AdamW on FP32 masters, global-norm clip, linear warmup then constant.
    lr: float = 2e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        check_positive("optim", "lr", self.lr)
        check_positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("optim", "weight_decay", self.weight_decay, allow_zero=True)
        check_positive("optim", "grad_clip", self.grad_clip)
        check_positive("optim", "eps", self.eps)


@dataclasses.dataclass
class CheckpointConfig:
    # Save every `every` steps and at the end; keep the newest `keep`.
    every: int = 20
    keep: int = 2
    # Write the final policy as an HF folder `<run_dir>/hf_final` (vLLM can serve it).
    export_hf: bool = True
    # Check of the checkpoint a run resumes from, against the size and xxh3_128 digest of
    # each file recorded at save (jfp8rl/trainer/checkpoint_manifest.py): "full" (sizes and
    # digests: reads the whole checkpoint once), "size" (sizes only), "none". A damaged one is
    # named with its file and set aside, and the run resumes from the newest intact one.
    verify: str = "full"

    def __post_init__(self) -> None:
        check_positive("checkpoint", "every", self.every)
        check_positive("checkpoint", "keep", self.keep)
        check_choice("checkpoint", "verify", self.verify, ("full", "size", "none"))


@dataclasses.dataclass
class EvalConfig:
    # Samples per eval problem and their temperature (jfp8rl/trainer/evaluation.py): eval/accuracy is the
    # mean accuracy over all samples (greedy accuracy at temperature 0, avg@n otherwise).
    n: int = 1
    temperature: float = 0.0

    def __post_init__(self) -> None:
        check_positive("eval", "n", self.n)
        check_positive("eval", "temperature", self.temperature, allow_zero=True)
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(
                f"eval.n={self.n} with eval.temperature=0: greedy samples are identical; "
                "set eval.temperature > 0 (e.g. 0.6) or eval.n=1"
            )


@dataclasses.dataclass
class LoggingConfig:
    # "line": one line per step with rate and ETA; "none": silent (metrics.jsonl still written).
    console: str = "line"
    tensorboard: bool = True
    # Samples per step written to <run_dir>/rollouts/step_<step>.jsonl (jfp8rl/observe/rollout_dump.py),
    # rounded up to whole groups of rollout.n; 0 = none.
    rollout_samples: int = 0

    def __post_init__(self) -> None:
        check_choice("logging", "console", self.console, ("line", "none"))
        check_positive("logging", "rollout_samples", self.rollout_samples, allow_zero=True)
