"""`python -m jfp8rl.mismatch --config C [--pairings R/S,...] [overrides] --out DIR`: where the
rollout-vs-trainer mismatch comes from.

For each (rollout recipe, trainer recipe) pairing, with the same weights on both sides: the
trainer's `rollout_corr/kl` on one rollout batch, split into KV-cache decode vs full forward,
micro-batch shape and recipe terms (`jfp8rl.analysis.mismatch` says what each column is).
Writes `DIR/mismatch.json` and `DIR/mismatch.md` and prints the latter's path. Exit codes:
0 done, 2 bad config, data or flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jfp8rl.analysis.mismatch import PAIRINGS, parse_pairings, run_mismatch
from jfp8rl.config import ConfigError
from jfp8rl.data.records import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.mismatch",
        description="Rollout-vs-trainer mismatch KL per recipe pairing, split into its sources.",
    )
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--out", required=True, help="output folder (mismatch.json, .md)")
    parser.add_argument(
        "--pairings",
        default=",".join(f"{r}/{s}" for r, s in PAIRINGS),
        help="comma-separated ROLLOUT/TRAINER recipes; an FP8 recipe may carry +pow2 "
        "(power-of-two scales), e.g. fp8_block+pow2/fp8_block+pow2 (default: %(default)s)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.key=value")
    args = parser.parse_args(argv)
    try:
        pairings = parse_pairings(args.pairings)
        run_mismatch(args.config, args.overrides, args.out, pairings,
                     log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(args.out) / "mismatch.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
