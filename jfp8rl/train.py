"""`python -m jfp8rl.train --config configs/tiny_cpu.yaml [section.key=value ...] [--resume |
--fresh] [--print-config]`.

Loads the config (`jfp8rl.config`: YAML + dotted overrides, the algorithm's preset for the
`algorithm.*` keys left unset) and runs `jfp8rl.trainer.loop.run`. `--print-config` prints the
resolved config as YAML (what the run folder's `config.yaml` would hold) and exits.

A run folder that already holds a checkpoint is resumed automatically when its config (saved in
the checkpoint) equals this one but for the keys that may change between runs
(`jfp8rl.config.compare`: `train.steps` to extend a run, logging, eval, backend URLs, ...);
otherwise the run stops before loading anything, naming each differing key. A complete run
says so and exits 0. `--resume` insists on a checkpoint; `--fresh` starts over at step 0,
moving the folder's previous run aside first (`<run_dir>.replaced-<k>`).

Several hosts (docs/cluster.md): one process per host, each started with
`--coordinator host:port --num-processes N --process-id i` (process 0 binds host:port), or with
no flags under SLURM `srun` / `mpirun`, where JAX finds its processes itself
(`jfp8rl.parallel.distributed.initialize`). Every process gets the same config and overrides.

Exit codes: 0 done; 2 bad configuration or data, or no intact checkpoint to resume from; 1 the
run stopped (rollout backend failure, too many non-finite updates, a failed checkpoint save):
the message names the last checkpoint and the resume command.
"""

from __future__ import annotations

import argparse
import sys

from jfp8rl.config import ConfigError, load_config, to_yaml
from jfp8rl.data.records import DataError
from jfp8rl.parallel import distributed
from jfp8rl.trainer.errors import CheckpointDamaged, RunStopped
from jfp8rl.trainer.loop import run
from rollout_bridge.backend import RolloutError


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.train",
        description="FP8 RL training (GRPO/DAPO with Calibrated Clipping).",
    )
    parser.add_argument(
        "--config", required=True, help="YAML run config, e.g. configs/tiny_cpu.yaml"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    group.add_argument(
        "--fresh",
        action="store_true",
        help="start over at step 0; a previous run in run_dir is moved to <run_dir>.replaced-<k>",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.key=value")
    dist = parser.add_argument_group("multi-process (one trainer process per host)")
    dist.add_argument("--coordinator", default="", help="host:port of process 0, e.g. node0:6379")
    dist.add_argument("--num-processes", type=int, default=0, help="trainer processes in all")
    dist.add_argument("--process-id", type=int, default=-1, help="this process, 0..N-1")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        # Before any JAX computation (loading the config does none).
        if distributed.initialize(args.coordinator, args.num_processes, args.process_id):
            print(distributed.describe(), file=sys.stderr, flush=True)
        run(cfg, resume="require" if args.resume else "never" if args.fresh else "auto")
    except (ConfigError, DataError, CheckpointDamaged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RunStopped, RolloutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
