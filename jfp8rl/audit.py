"""`python -m jfp8rl.audit --config C [--checkpoint RUN] [overrides] --out DIR`: the FP8 audit.

Measures, on one rollout batch of the configured policy and for every training recipe, the
FP8 noise in the policy ratio, the clip shares it moves and Calibrated Clipping's bounds
(`jfp8rl.analysis.audit` says what each column is). Writes `DIR/audit.json` and
`DIR/audit.md` and prints the latter's path. Exit codes: 0 done, 2 bad config, data or flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jfp8rl.analysis.audit import AUDITED_RECIPES, UPDATES, checkpoint_step, run_audit
from jfp8rl.config import ConfigError
from jfp8rl.data.records import DataError
from jfp8rl.trainer.errors import CheckpointDamaged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.audit",
        description="The FP8 audit: FP8 noise in the policy ratio per training recipe.",
    )
    parser.add_argument(
        "--config", default="", help="YAML run config (default with --checkpoint: RUN/config.yaml)"
    )
    parser.add_argument(
        "--checkpoint",
        default="",
        help="start from a run's checkpoint: its run_dir (latest) or RUN/checkpoints/<step>",
    )
    parser.add_argument("--out", required=True, help="output folder (audit.json, audit.md)")
    parser.add_argument(
        "--recipes",
        default="",
        help="comma-separated recipe/grad pairs, e.g. bf16/-,fp8_block/e4m3 (default: all)",
    )
    parser.add_argument(
        "--updates",
        default=",".join(map(str, UPDATES)),
        help="comma-separated optimizer-update counts of the rows (default: %(default)s)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.key=value")
    args = parser.parse_args(argv)
    recipes = AUDITED_RECIPES
    if args.recipes:
        recipes = tuple(tuple(p.split("/")) for p in args.recipes.split(","))  # type: ignore[misc]
        bad = [p for p in recipes if p not in AUDITED_RECIPES]
        if bad:
            print(f"error: --recipes {bad} not in {list(AUDITED_RECIPES)}", file=sys.stderr)
            return 2
    try:
        updates = tuple(sorted({int(u) for u in args.updates.split(",")}))
        if not updates or updates[0] < 0:
            raise ValueError(args.updates)
    except ValueError:
        print(f"error: --updates {args.updates!r}: need comma-separated ints >= 0, e.g. 0,1,2,4",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        config = args.config
        if not config:
            if not args.checkpoint:
                raise ConfigError("pass --config configs/<name>.yaml (or --checkpoint RUN_DIR)")
            config = str(checkpoint_step(args.checkpoint)[0] / "config.yaml")
        run_audit(
            config, args.overrides, args.out, recipes, log=lambda m: print(m, file=sys.stderr),
            checkpoint=args.checkpoint or None, updates=updates,
        )  # fmt: skip
    except (ConfigError, DataError, CheckpointDamaged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(args.out) / "audit.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
