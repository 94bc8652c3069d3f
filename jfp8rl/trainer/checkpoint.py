"""Run checkpoints: one orbax `CheckpointManager` under `<run_dir>/checkpoints/`.

Each checkpoint `<step>/` holds two items:

    state  params (FP32 masters), optimizer state, calibration state and the PRNG key data,
           as one pytree (orbax StandardSave: array files + metadata)
    meta   JSON: step, data position (prompts consumed), weight version, consecutive
           non-finite updates, the resolved config's YAML

Saves are synchronous and atomic (orbax writes a temporary folder and renames it when
complete), so a crash or a dying rollout server never leaves a half-written latest checkpoint:
`latest_step()` only sees finished ones. The newest `keep` are kept.

Several trainer processes (`jfp8rl.parallel.distributed`, docs/cluster.md): every process calls `save`
and `restore` with the same step and its own shards of the global state; `run_dir` must be on a
filesystem they all see. Orbax's manager is multi-process aware: each process writes the
shards it owns (replica 0 of each), the primary host (process 0) alone writes the meta JSON
and, after a barrier that every process reaches once its shards are on disk, renames the
temporary folder; so the atomic guarantee holds across processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save / restore the trainer state of a run folder."""

    def __init__(self, run_dir: str | Path, *, keep: int) -> None:
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=False,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Writes checkpoint `step` (overwrites nothing: a step is saved once)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of checkpoint `step`; `like` is a state pytree of the same structure
        (arrays or `jax.ShapeDtypeStruct`s) giving shapes, dtypes and shardings."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint {self.directory}/{step} does not match this run's state (model or "
                f"optimizer changed?): {e}"
            ) from e
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


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
