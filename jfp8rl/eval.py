"""Evaluation of a policy on a data set: pass@1, avg@K, pass@K and mean response length.

    python -m jfp8rl.eval --model DIR --data FILE [--n K --temperature T --max-tokens L]
        [--max-prompt-tokens P --reward math] [--url URL] [--config RUN_DIR/config.yaml]
        [--limit L --out FILE] [section.key=value ...]

DIR is an HF folder: a run's `hf_final`, or a checkpoint exported with
`python -m jfp8rl.export RUN_DIR --step S`. FILE is a `.jsonl` / `.parquet` data file in any
layout `jfp8rl.data.records` reads. Everything else (prompt and chat templates, reward kind, prompt
length, compute dtype, rollout recipe) comes from `--config` (a run's `config.yaml` reproduces
that run's evaluation) and dotted overrides, with the config defaults otherwise.

Without `--url` the embedded engine serves DIR's weights through the run's own weight-push
path; with `--url` a running server is asked as it is (`jfp8rl.trainer.evaluation`, which also
defines the metrics). Prints the metrics as JSON.

Exit codes: 0 done, 2 bad config or data, 1 the rollout server failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jfp8rl.config import ConfigError, load_config
from jfp8rl.data.records import DataError
from jfp8rl.trainer.evaluation import evaluate_folder
from rollout_bridge.backend import RolloutError


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


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides the flags stand for, after the user's own (flags win)."""
    sets = [f"model.path={args.model}", "data.task=file", f"data.train_file={args.data}"]
    flags = {
        "eval.n": args.n, "eval.temperature": args.temperature,
        "rollout.max_tokens": args.max_tokens, "data.max_prompt_tokens": args.max_prompt_tokens,
        "reward.kind": args.reward,
    }  # fmt: skip
    sets += [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.url:
        sets += ["rollout.backend=http", f"rollout.url={args.url}"]
    else:
        sets.append("rollout.backend=embedded")
    return [*args.overrides, *sets]


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (module docstring)."""
    args = _parser().parse_args(argv)

    def progress(done: int, total: int) -> None:
        print(f"eval: {done}/{total} problems", file=sys.stderr, flush=True)

    try:
        cfg = load_config(args.config, config_overrides(args))
        out = evaluate_folder(cfg, args.data, limit=args.limit, progress=progress)
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
