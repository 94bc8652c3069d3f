"""The Python API: load a config, hand it examples and reward functions, train, read the
metrics and the final policy (docs/python_api.md).

    from jfp8rl import api

    cfg = api.load_config("configs/tiny_cpu.yaml", ["run_dir=runs/mine", "train.steps=10"])
    result = api.train(cfg, train_data=records, reward_fns=[compute_score])
    result.metrics[-1]["reward/mean"], result.policy_dir

`train` runs the same loop as `python -m jfp8rl.train` (`jfp8rl.trainer.loop.run`), with the
same run folder: it resumes a run it finds there with the same config, refuses one with another,
and leaves a complete one as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from jfp8rl.config import Config, load_config
from jfp8rl.data.records import Example, parse_record
from jfp8rl.data.rewards import RewardFunctions
from jfp8rl.data.stream import hold_out
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.trainer.loop import run
from jfp8rl.trainer.settings import reward_of

__all__ = ["TrainResult", "load_config", "train"]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run left: its folder, one metrics record per step (`metrics.jsonl`: step 0 is
    the base policy's eval), the final policy as an HF folder (None when
    `checkpoint.export_hf` is off) and the run summary."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    policy_dir: Path | None
    summary: dict[str, Any]


def examples_of(records: Iterable[dict[str, Any]], name: str, cfg: Config) -> list[Example]:
    """The records (a list of dicts in the data files' layout, or a `datasets.Dataset`) as
    examples; errors name `name[i]` and the field."""
    d = cfg.data
    return [
        parse_record(dict(rec), f"{name}[{i}]", prompt_key=d.prompt_key, answer_key=d.answer_key)
        for i, rec in enumerate(records)
    ]


def train(
    cfg: Config,
    *,
    train_data: Iterable[dict[str, Any]] | None = None,
    eval_data: Iterable[dict[str, Any]] | None = None,
    reward_fns: Sequence[Callable[..., Any]] = (),
    reward_weights: Sequence[float] = (),
    resume: str = "auto",
) -> TrainResult:
    """Trains `cfg`, on `train_data` when given (else the config's data), scored by
    `reward_fns` when given (else the config's reward).

    train_data, eval_data: records as in a data file (`{"prompt", "answer"}` or verl's layout,
      `data.prompt_key` / `data.answer_key` apply), a list of dicts or a `datasets.Dataset`.
      Without eval_data, a held-out share of train_data (`data.eval_share`, at most
      `data.eval_size`) is the eval set and is not trained on.
    reward_fns: functions called as verl calls a custom reward, `f(data_source=...,
      solution_str=..., ground_truth=..., extra_info=...)`, returning a float or a dict with
      `score` (jfp8rl/data/rewards.py); summed with `reward_weights` (empty: 1 each).
    resume: "auto" (resume a run of the same config found in `run_dir`), "require", or
      "never" (start over; a previous run is moved to `<run_dir>.replaced-<k>`).
    """
    datasets = None
    if train_data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="python"))
        train_set = examples_of(train_data, "train_data", cfg)
        d = cfg.data
        datasets = (
            hold_out(train_set, d.eval_size, d.eval_share, d.seed)
            if eval_data is None
            else (train_set, examples_of(eval_data, "eval_data", cfg)[: d.eval_size])
        )
    elif eval_data is not None:
        raise ValueError("eval_data needs train_data (or give data.eval_file in the config)")
    if reward_fns:
        names = ",".join(getattr(f, "__name__", type(f).__name__) for f in reward_fns)
        weights = [float(w) for w in reward_weights] or [1.0] * len(reward_fns)
        reward_cfg = dataclasses.replace(
            cfg.reward, kind="function", path="", name=names, weights=weights
        )
        cfg = dataclasses.replace(cfg, reward=reward_cfg)
        reward = RewardFunctions(tuple(reward_fns), tuple(weights), tuple(names.split(",")))
    else:
        reward = reward_of(cfg)
    summary = run(cfg, resume=resume, datasets=datasets, reward=reward)
    run_dir = Path(cfg.run_dir)
    final = run_dir / "hf_final"
    return TrainResult(
        run_dir=run_dir,
        metrics=read_metrics(run_dir),
        policy_dir=final if (final / "config.json").is_file() else None,
        summary=summary,
    )
