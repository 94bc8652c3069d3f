"""`python -m jfp8rl.report <run_dir> [<run_dir> ...] [--out report.png]`: PNG plots of runs.

One panel per quantity, every run overlaid (`jfp8rl.observe.plots` lists the panels). Default
output: `<first run_dir>/report.png`; prints its path. Exit codes: 0 done, 2 bad run folder.
"""

from __future__ import annotations

import argparse
import sys

from jfp8rl.observe.plots import make_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.report", description="PNG plots of runs, overlaid."
    )
    parser.add_argument("run_dirs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default <first run>/report.png)")
    args = parser.parse_args(argv)
    try:
        path = make_report(args.run_dirs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
