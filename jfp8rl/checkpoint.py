"""Run checkpoints: one orbax `CheckpointManager` under `<run_dir>/checkpoints/`.

Each checkpoint `<step>/` holds two items:

    state  params (FP32 masters), optimizer state, calibration state and the PRNG key data,
           as one pytree (orbax StandardSave: array files + metadata)
    meta   JSON: step, data position (prompts consumed), weight version, consecutive
           non-finite updates, the resolved config's YAML

Saves are synchronous and atomic (orbax writes a temporary folder and renames it when
complete), so a crash or a dying rollout server never leaves a half-written latest checkpoint:
`latest_step()` only sees finished ones. The newest `keep` are kept.
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
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
