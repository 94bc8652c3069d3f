"""`python -m jfp8rl.export RUN_DIR --step S [--out DIR]`: a run checkpoint -> an HF folder.

Reads `<RUN_DIR>/config.yaml` for the base policy (its architecture and tokenizer files),
restores only the FP32 master params of `<RUN_DIR>/checkpoints/<S>/` (orbax, no optimizer state
is materialised) and writes them with `models.hf_io.save_hf` as `hf_final` is written:
config.json, float32 safetensors, generation_config.json, tokenizer files. The tokenizer config
(chat template, eos) and generation_config.json of the base policy's folder are copied over
too, so prompts and stop tokens stay those of the run. Default output: `<RUN_DIR>/hf_step_<S>`.
`python -m jfp8rl.eval --model <that folder> --data FILE` evaluates it.
"""

from __future__ import annotations

import argparse
import sys

from jfp8rl.config import ConfigError
from jfp8rl.trainer.errors import CheckpointDamaged
from jfp8rl.trainer.policy import export_checkpoint


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (0 done, 2 bad run folder, or a missing or damaged step)."""
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.export", description="Export a run checkpoint as an HF folder."
    )
    parser.add_argument("run_dir", help="run folder (holds config.yaml and checkpoints/)")
    parser.add_argument("--step", type=int, required=True, help="checkpoint step to export")
    parser.add_argument("--out", default="", help="output folder (default RUN_DIR/hf_step_S)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.run_dir, args.step, args.out or None, log=lambda m: print(m, file=sys.stderr)
        )
    except (ConfigError, FileNotFoundError, CheckpointDamaged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
