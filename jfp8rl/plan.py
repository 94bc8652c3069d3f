"""`python -m jfp8rl.plan --config C [overrides] [--devices N] [--layers L]`: the step's
memory plan (`jfp8rl.analysis.memory_plan`), ending with exactly one line:

    plan: <preset> mesh data=D fsdp=F tensor=T micro_batch=M tokens=L: per-device peak X.X GiB (state Y.Y GiB), compiled in Z s

(with `expert=X` after `tensor=T` where the mesh has an expert axis of size X > 1)

`--devices N` plans for N forced CPU host devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=N`, set here before jax starts); without it the plan is
for the machine's real devices (on a GPU host: the GPUs). `--layers L` overrides the preset's
depth (to show that compile time does not grow with it). Exit codes: 0 done, 2 bad config.
"""

from __future__ import annotations

import argparse
import os
import sys


def _force_host_devices(n: int) -> None:
    """Must run before jax is imported: XLA reads the flag once."""
    if "jax" in sys.modules:
        raise RuntimeError("--devices must be applied before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.plan",
        description="Ahead-of-time memory plan of the training step (no weights, no allocation).",
    )
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument(
        "--devices", type=int, default=0, help="plan on N forced CPU host devices (0: real ones)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="override the preset's layer count (compile-time scaling)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides: section.key=value")
    args = parser.parse_args(argv)
    if args.devices:
        _force_host_devices(args.devices)
    # Imported only now: XLA reads the forced device count once, when jax starts.
    from jfp8rl.analysis.memory_plan import plan
    from jfp8rl.config import ConfigError, load_config

    try:
        # The paper configs mark the weights and data as mandatory (???): a plan needs neither.
        overrides = ["model.path=", "data.task=arithmetic", "data.train_file=", *args.overrides]
        plan(load_config(args.config, overrides), num_layers=args.layers or None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
