"""Evaluation of a policy on a data set: pass@1, avg@K, pass@K and mean response length.

`evaluate` samples and scores through any rollout backend (a training run's `eval/accuracy` is
its avg@K with K = eval.n at eval.temperature, greedy by default); `evaluate_folder` evaluates
an HF policy folder as `python -m jfp8rl.eval` does: without `rollout.url` the embedded engine
loads the folder and then receives its weights through the same export as a training run's
weight push (`rollout.export_format`, FP8 for the FP8 block recipe), so its numbers are the
run's own eval numbers; with a server URL a running vLLM (or `python -m rollout_bridge.serve`)
is asked as it is, its weights untouched.

Metrics, over P problems with K samples each and c_i correct samples of problem i:
- `avg@K` = (1/P) sum_i c_i / K: the mean accuracy over all samples (the paper's Avg@16/32).
- `pass@1`: at temperature 0 (K must be 1) the greedy accuracy; at temperature > 0 the
  unbiased estimator of Chen et al. 2021 (HumanEval), 1 - C(K - c, 1) / C(K, 1) = c / K per
  problem, so pass@1 = avg@K there: both are reported because papers quote both names.
- `pass@K` = the fraction of problems with at least one correct sample (the same estimator at
  k = K).
- `response_length/mean`: mean response tokens per sample (stop token included);
  `reward/unparsed_frac` for verifiers that extract an answer (math: no parsable \\boxed{}).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jfp8rl.config import Config
from jfp8rl.data.records import DataError, Example, load_examples
from jfp8rl.data.rewards import ANSWER_PARSERS, Reward, judge
from jfp8rl.data.templates import PromptFormat
from jfp8rl.trainer.backends import make_backend
from jfp8rl.trainer.policy import load_policy
from jfp8rl.trainer.settings import reward_of
from models.hf_io import to_hf_state_dict
from rollout_bridge.backend import RolloutBackend, SamplingParams


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-sample results of `evaluate`, problem-major ([P, K] arrays)."""

    correct: np.ndarray  # f32 [P, K], verifier correctness
    lengths: np.ndarray  # int32 [P, K], response tokens
    unparsed: np.ndarray | None  # bool [P, K], None when the verifier extracts no answer
    temperature: float

    @property
    def avg(self) -> float:
        """avg@K: mean accuracy over every sample."""
        return float(self.correct.mean())

    def metrics(self) -> dict[str, float]:
        """pass@1, avg@K, pass@K, mean length (module docstring), keyed by name."""
        k = self.correct.shape[1]
        out = {
            "problems": float(self.correct.shape[0]),
            "pass@1": self.avg,  # greedy accuracy (T = 0) or the unbiased c / K (T > 0)
            f"avg@{k}": self.avg,
            f"pass@{k}": float((self.correct.max(axis=1) > 0).mean()),
            "response_length/mean": float(self.lengths.mean()),
        }
        if self.unparsed is not None:
            out["reward/unparsed_frac"] = float(self.unparsed.mean())
        return out


def evaluate(
    backend: RolloutBackend,
    examples: Sequence[Example],
    fmt: PromptFormat,
    verifier: Reward,
    *,
    n: int,
    temperature: float,
    max_prompt_tokens: int,
    max_tokens: int,
    chunk: int = 128,
    seed: int = 0,
    progress: Any = None,
) -> EvalResult:
    """Samples n responses per example (greedy at temperature 0) and scores them.

    Requests hold `chunk // n` prompts (n * that many rows); with chunk = the rollout's rows
    per request (B * n) the embedded engine reuses the training rollout's compiled executable.
    `progress(done, total)` is called after each request.
    """
    if not examples:
        raise DataError("no eval examples")
    if temperature == 0 and n != 1:
        raise ValueError(f"n={n} greedy samples would be identical; use n=1 at temperature 0")
    prompts = fmt.encode(examples, max_prompt_tokens)
    per_call = max(1, chunk // n)
    comps = []
    for i in range(0, len(prompts), per_call):
        sampling = SamplingParams(
            n=n, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
            stop_token_ids=fmt.stop_ids,
        )  # fmt: skip
        comps += backend.generate(prompts[i : i + per_call], sampling)
        if progress is not None:
            progress(min(i + per_call, len(prompts)), len(prompts))
    texts = [fmt.response_text(c.response_ids) for c in comps]
    correct = judge(verifier, texts, [examples[j // n] for j in range(len(comps))])[0]
    correct = correct.astype(np.float32)
    lengths = np.array([len(c.response_ids) for c in comps], np.int32)
    parser = ANSWER_PARSERS.get(verifier)
    unparsed = None if parser is None else np.array([not parser(t) for t in texts], bool)
    shape = (len(examples), n)
    return EvalResult(
        correct.reshape(shape),
        lengths.reshape(shape),
        None if unparsed is None else unparsed.reshape(shape),
        temperature,
    )


def evaluate_folder(
    cfg: Config,
    data: str | Path,
    *,
    limit: int = 0,
    progress: Callable[[int, int], Any] | None = None,
) -> dict[str, Any]:
    """Evaluates the policy of `cfg.model.path` on the data file `data` (its first `limit`
    problems; 0 = all) with the config's prompt format, reward, sampling and backend; returns
    the metrics with what they were measured on."""
    examples = load_examples(data, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
    if limit:
        examples = examples[:limit]
    policy = load_policy(cfg, log=lambda msg: None)
    fmt = PromptFormat.from_config(policy.path, policy.tokenizer, cfg.data)
    backend = make_backend(cfg, policy, Path(cfg.run_dir))
    try:
        if cfg.rollout.backend == "embedded":
            # The run's own path: the weights go through the rollout export (FP8 block).
            backend.push_weights(to_hf_state_dict(policy.cfg, policy.params), "eval")
        res = evaluate(
            backend, examples, fmt, reward_of(cfg),
            n=cfg.eval.n, temperature=cfg.eval.temperature,
            max_prompt_tokens=cfg.data.max_prompt_tokens, max_tokens=cfg.rollout.max_tokens,
            chunk=cfg.data.batch_size * cfg.rollout.n, progress=progress,
        )  # fmt: skip
    finally:
        backend.close()
    return {
        "model": str(cfg.model.path),
        "data": str(data),
        "n": cfg.eval.n,
        "temperature": cfg.eval.temperature,
        "max_tokens": cfg.rollout.max_tokens,
        "backend": (
            ",".join(cfg.rollout.server_urls()) if cfg.rollout.backend == "http" else "embedded"
        ),
        **res.metrics(),
    }
