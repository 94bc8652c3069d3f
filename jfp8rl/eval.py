"""Evaluation of a policy on a data set: pass@1, avg@K, pass@K and mean response length.

    python -m jfp8rl.eval --model DIR --data FILE [--n K --temperature T --max-tokens L]
        [--max-prompt-tokens P --reward math] [--url URL] [--config RUN_DIR/config.yaml]
        [--limit L --out FILE] [section.key=value ...]

DIR is an HF folder: a run's `hf_final`, or a checkpoint exported with
`python -m jfp8rl.export RUN_DIR --step S`. FILE is a `.jsonl` / `.parquet` data file in any
layout `jfp8rl.data` reads. Everything else (prompt and chat templates, reward kind, prompt
length, compute dtype, rollout recipe) comes from `--config` (a run's `config.yaml` reproduces
that run's evaluation) and dotted overrides, with the config defaults otherwise.

Backends: without `--url` the embedded engine loads DIR and then receives DIR's weights through
the same export as a training run's weight push (`rollout.export_format`, FP8 for the FP8 block
recipe), so its numbers are the run's own eval numbers; with `--url` a running vLLM (or
`python -m rollout_bridge.serve`) is asked as it is, its weights untouched.

Metrics, over P problems with K samples each and c_i correct samples of problem i:
- `avg@K` = (1/P) sum_i c_i / K: the mean accuracy over all samples (the paper's Avg@16/32).
- `pass@1`: at temperature 0 (K must be 1) the greedy accuracy; at temperature > 0 the
  unbiased estimator of Chen et al. 2021 (HumanEval), 1 - C(K - c, 1) / C(K, 1) = c / K per
  problem, so pass@1 = avg@K there: both are reported because papers quote both names.
- `pass@K` = the fraction of problems with at least one correct sample (the same estimator at
  k = K).
- `response_length/mean`: mean response tokens per sample (stop token included);
  `reward/unparsed_frac` for verifiers that extract an answer (math: no parsable \\boxed{}).

A training run's `eval/accuracy` is `avg@K` with K = eval.n at eval.temperature (greedy by
default), from this module's `evaluate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jfp8rl.data import DataError, Example
from jfp8rl.rewards import ANSWER_PARSERS, Verifier
from jfp8rl.templates import PromptFormat
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
    verifier: Verifier,
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
    answers = [examples[j // n].answer for j in range(len(comps))]
    correct = np.array([verifier(t, a) for t, a in zip(texts, answers, strict=True)], np.float32)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.eval", description="Evaluate an HF policy folder on a data file."
    )
    parser.add_argument("--model", required=True, help="HF folder (hf_final or an export)")
    parser.add_argument("--data", required=True, help=".jsonl or .parquet data file")
    parser.add_argument("--n", type=int, default=None, help="samples per problem (eval.n)")
    parser.add_argument("--temperature", type=float, default=None, help="eval.temperature")
    parser.add_argument("--max-tokens", type=int, default=None, help="rollout.max_tokens")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="data.max_prompt_tokens"
    )
    parser.add_argument("--reward", default=None, help="reward.kind: math | exact | task")
    parser.add_argument("--url", default="", help="a vLLM-compatible server instead of embedded")
    parser.add_argument("--config", default=None, help="run config (e.g. RUN_DIR/config.yaml)")
    parser.add_argument("--limit", type=int, default=0, help="first L problems only (0 = all)")
    parser.add_argument("--out", default="", help="also write the metrics to this JSON file")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides: section.key=value")
    return parser


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluates as the parsed command line says (module docstring); returns the metrics."""
    from jfp8rl.config import load_config
    from jfp8rl.data import load_examples
    from jfp8rl.loop import load_policy, make_backend
    from jfp8rl.rewards import get_verifier
    from models.hf_io import to_hf_state_dict

    sets = [f"model.path={args.model}", "data.task=file", f"data.train_file={args.data}"]
    if args.n is not None:
        sets.append(f"eval.n={args.n}")
    if args.temperature is not None:
        sets.append(f"eval.temperature={args.temperature}")
    if args.max_tokens is not None:
        sets.append(f"rollout.max_tokens={args.max_tokens}")
    if args.max_prompt_tokens is not None:
        sets.append(f"data.max_prompt_tokens={args.max_prompt_tokens}")
    if args.reward is not None:
        sets.append(f"reward.kind={args.reward}")
    if args.url:
        sets += ["rollout.backend=http", f"rollout.url={args.url}"]
    else:
        sets.append("rollout.backend=embedded")
    cfg = load_config(args.config, [*args.overrides, *sets])
    examples = load_examples(
        args.data, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key
    )
    if args.limit:
        examples = examples[: args.limit]
    policy = load_policy(cfg, log=lambda msg: None)
    fmt = PromptFormat.from_config(policy.path, policy.tokenizer, cfg.data)
    backend = make_backend(cfg, policy, Path(cfg.run_dir))
    try:
        if cfg.rollout.backend == "embedded":
            # The run's own path: the weights go through the rollout export (FP8 block).
            backend.push_weights(to_hf_state_dict(policy.cfg, policy.params), "eval")

        def progress(done: int, total: int) -> None:
            print(f"eval: {done}/{total} problems", file=sys.stderr, flush=True)

        res = evaluate(
            backend, examples, fmt, get_verifier(cfg.reward.kind),
            n=cfg.eval.n, temperature=cfg.eval.temperature,
            max_prompt_tokens=cfg.data.max_prompt_tokens, max_tokens=cfg.rollout.max_tokens,
            chunk=cfg.data.batch_size * cfg.rollout.n, progress=progress,
        )  # fmt: skip
    finally:
        backend.close()
    return {
        "model": str(args.model),
        "data": str(args.data),
        "n": cfg.eval.n,
        "temperature": cfg.eval.temperature,
        "max_tokens": cfg.rollout.max_tokens,
        "backend": (
            ",".join(cfg.rollout.server_urls()) if cfg.rollout.backend == "http" else "embedded"
        ),
        **res.metrics(),
    }


def main(argv: list[str] | None = None) -> int:
    """The CLI; prints the metrics as JSON. Exit codes: 0 done, 2 bad config or data, 1 the
    rollout server failed."""
    from jfp8rl.config import ConfigError
    from rollout_bridge.backend import RolloutError

    args = _parser().parse_args(argv)
    try:
        out = run_cli(args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RolloutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
