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
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

# Files of the base policy's folder that carry prompt / stop-token behaviour.
_TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def restore_params(run_dir: str | Path, step: int, like: object) -> object:
    """The params of checkpoint `step` of `run_dir`, shaped like `like` (the base params)."""
    directory = (Path(run_dir) / "checkpoints").absolute()
    manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    try:
        steps = list(manager.all_steps())
        if step not in steps:
            raise FileNotFoundError(
                f"{directory}: no checkpoint for step {step}; saved steps: {sorted(steps)}"
            )
        abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, like)}
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        out = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=restore_args, partial_restore=True
                )
            ),
        )
        return out["state"]["params"]
    finally:
        manager.close()


def save_policy_folder(
    out: str | Path, policy: object, params: object, tensors: Iterable[Any] | None = None
) -> Path:
    """`save_hf` of `params` (`tensors`: their `iter_hf_state`, when the caller makes it) with
    the base policy's tokenizer, then its tokenizer config, chat template and generation
    config copied over (save_hf writes generic ones), so the folder renders prompts and stops
    like the run. Used for `hf_final` and exports."""
    from models.hf_io import save_hf

    tok = policy.tokenizer  # type: ignore[attr-defined]
    out = save_hf(out, policy.cfg, params, tok, tensors=tensors)  # type: ignore[attr-defined]
    for name in _TOKENIZER_FILES:
        src = Path(policy.path) / name  # type: ignore[attr-defined]
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)
    return out


def export_checkpoint(run_dir: str | Path, step: int, out_dir: str | Path | None = None) -> Path:
    """Writes checkpoint `step` of `run_dir` as an HF folder (module docstring); returns it."""
    from jfp8rl.config import load_config
    from jfp8rl.loop import load_policy

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    policy = load_policy(cfg, log=lambda msg: print(msg, file=sys.stderr))
    params = restore_params(run_dir, step, policy.params)
    out = Path(out_dir) if out_dir else run_dir / f"hf_step_{step}"
    return save_policy_folder(out, policy, params)


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (0 done, 2 bad run folder or step)."""
    parser = argparse.ArgumentParser(
        prog="python -m jfp8rl.export", description="Export a run checkpoint as an HF folder."
    )
    parser.add_argument("run_dir", help="run folder (holds config.yaml and checkpoints/)")
    parser.add_argument("--step", type=int, required=True, help="checkpoint step to export")
    parser.add_argument("--out", default="", help="output folder (default RUN_DIR/hf_step_S)")
    args = parser.parse_args(argv)
    from jfp8rl.config import ConfigError

    try:
        out = export_checkpoint(args.run_dir, args.step, args.out or None)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
