"""Run checkpoints: one orbax `CheckpointManager` under `<run_dir>/checkpoints/`.

Each checkpoint `<step>/` holds two items and a manifest:

    state         params (FP32 masters), optimizer state, calibration state and the PRNG key
                  data, as one pytree (orbax StandardSave: array files + metadata)
    meta          JSON: step, data position (prompts consumed), weight version, consecutive
                  non-finite updates, the resolved config's YAML
    digests.json  the size and digest of every file (`jfp8rl.trainer.checkpoint_manifest`)

No rollout batch is ever in flight at a checkpoint: with `rollout.max_staleness` 1 a step that
saves one starts no batch ahead (`jfp8rl.trainer.overlap`), so the step after it samples with
the checkpointed weights whether the run goes on or resumes, and a resume is exact.

Saves are synchronous and atomic (orbax writes a temporary folder and renames it when
complete, the manifest being the last file written before the rename), so a crash, a dying
rollout server or a failed write never leaves a half-written latest checkpoint. A save that
fails (disk full, a file-size limit) raises after removing its temporary folder; the older
checkpoints stay (orbax deletes the oldest only after a save succeeded). The newest `keep`
are kept.

Resume (`newest_intact`): the newest checkpoint that passes its manifest check
(`checkpoint.verify`: "full" sizes and digests, "size" sizes only, "none" no check) on every
process; the newer damaged ones are moved to `<run_dir>/checkpoints.damaged/` (`set_aside`),
so that the run's next saves replace them and no later resume tries them again.

Several trainer processes (`jfp8rl.parallel.distributed`, docs/cluster.md): every process calls `save`
and `restore` with the same step and its own shards of the global state; `run_dir` must be on a
filesystem they all see. Orbax's manager is multi-process aware: each process writes the
shards it owns (replica 0 of each), the primary host (process 0) alone writes the meta JSON
and, after a barrier that every process reaches once its shards are on disk, writes the
manifest and renames the temporary folder; so the atomic guarantee holds across processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jfp8rl.config import ConfigError
from jfp8rl.observe.memory import release_free_heap
from jfp8rl.parallel import distributed
from jfp8rl.trainer.checkpoint_manifest import StepWithManifest, check
from jfp8rl.trainer.errors import CheckpointDamaged


def checkpoints_dir(run_dir: str | Path) -> Path:
    return (Path(run_dir) / "checkpoints").absolute()


def steps_on_disk(directory: Path) -> list[int]:
    """The committed steps in a checkpoints folder (orbax's temporary folders are not)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def agree(reports: list[str | None]) -> str | None:
    """One step's verdict from every process's `check` report (in process order): intact
    (None) only where every process found it intact; else the first problem reported, naming
    the process that saw it when there are several."""
    for i, problem in enumerate(reports):
        if problem is not None:
            return problem if len(reports) == 1 else f"{problem} (seen by process {i})"
    return None


def newest_intact(
    directory: Path,
    mode: str,
    gather: Callable[[Any], list[Any]] = distributed.all_gather_json,
) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest step intact on every process, or None; the newer damaged steps with their
    problems). A collective: process 0's list of steps is the one checked, newest first, and
    each step's reports are gathered (`gather`) and agreed (`agree`) before the next."""
    _, info = distributed.broadcast_from_main({}, {"steps": steps_on_disk(directory)})
    share = (jax.process_index(), jax.process_count())
    rejected: list[tuple[int, str]] = []
    for step in sorted(info["steps"], reverse=True):
        verdict = agree(gather(check(directory / str(step), mode, share)))
        if verdict is None:
            return step, rejected
        rejected.append((step, verdict))
    return None, rejected


def saved_meta(run_dir: str | Path, step: int) -> dict[str, Any]:
    """The meta JSON of checkpoint `step` (its step, data position and resolved config YAML),
    read without restoring anything."""
    path = checkpoints_dir(run_dir) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"checkpoint {path.parent.parent}: unreadable meta ({e})") from e


def set_aside(directory: Path, step: int) -> Path:
    """Moves checkpoint `step` out of the checkpoints folder into `<run_dir>/checkpoints.damaged`
    (as `<step>`, or `<step>.<k>` when taken); its new path."""
    out = directory.with_name(directory.name + ".damaged")
    out.mkdir(exist_ok=True)
    dest, k = out / str(step), 0
    while dest.exists():
        k += 1
        dest = out / f"{step}.{k}"
    (directory / str(step)).rename(dest)
    return dest


def require_intact(run_dir: str | Path, step: int, mode: str) -> None:
    """`CheckpointDamaged` naming the file and the problem unless checkpoint `step` of
    `run_dir` passes its manifest check (one process: the commands that read one step)."""
    directory = checkpoints_dir(run_dir)
    problem = check(directory / str(step), mode)
    if problem is not None:
        raise CheckpointDamaged(f"checkpoint {directory}/{step} is damaged: {problem}")


def save_limit_gb(state: Any) -> int:
    """The bytes (in whole GB, as orbax takes them) a save of `state` may hold in flight: the
    least that still admits its largest array. orbax's default (96 GB) starts every array's
    write at once, and each write holds its encoded chunks in memory until they are on disk:
    a transient near the size of the state's non-zero data (all-zero chunks, e.g. a fresh
    optimizer state, are not stored). Under this limit an array's write starts when the
    budget frees up, so the transient stays under the limit (the largest array plus less than 1 GB); tensorstore's threads still
    write each array's chunks in parallel. The step's atomic commit is unchanged."""
    largest = max((getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)), default=0)
    return largest // 10**9 + 1  # orbax refuses an array of the limit's size or more


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def terse_write_errors() -> Iterator[None]:
    """While saving, orbax's own reports of a failed write lose their tracebacks: its ERROR
    log of each writer thread's exception keeps its one line, and tensorstore's callbacks into
    the event loop of the aborted save ("Event loop is closed", reported as unraisable, tens
    of them) are dropped. The save's error itself is raised as it is."""
    log = logging.getLogger("absl")
    terse, previous = _NoTraceback(), sys.unraisablehook

    def hook(u: Any) -> None:
        if not (
            isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        ):
            previous(u)

    log.addFilter(terse)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        log.removeFilter(terse)


class Checkpointer:
    """Save / restore the trainer state of a run folder."""

    def __init__(self, run_dir: str | Path, *, keep: int) -> None:
        self.directory = checkpoints_dir(run_dir)
        self.options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=False,
            temporary_path_class=StepWithManifest,
        )
        self.save_gb: int | None = None  # the manager's in-flight limit (`save_limit_gb`)
        self.manager = ocp.CheckpointManager(
            self.directory, options=self.options, item_names=("state", "meta")
        )

    def limit_saves(self, state: Any) -> None:
        """Reopens the manager with the in-flight limit of saving `state` (`save_limit_gb`),
        unless it has it already: the state's shapes are the same at every save of a run."""
        gb = save_limit_gb(state)
        if gb == self.save_gb:
            return
        self.manager.close()
        handlers = {
            "state": ocp.StandardCheckpointHandler(save_concurrent_gb=gb),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            self.directory, options=self.options, item_handlers=handlers
        )
        self.save_gb = gb

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Writes checkpoint `step` (overwrites nothing: a step is saved once). On a failed
        write the partial temporary folder is removed and the error raised."""
        if step in self.manager.all_steps():
            return
        self.limit_saves(state)
        try:
            with terse_write_errors():
                self.manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                    ),
                    force=True,
                )
                self.manager.wait_until_finished()
        except BaseException:
            if distributed.is_main():  # the space it took, on the filesystem all processes see
                for tmp in self.directory.glob(f"{step}{ocp.path.atomicity.TMP_DIR_SUFFIX}*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            release_free_heap()  # the writer threads' freed encode buffers

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
            raise ConfigError(
                f"checkpoint {self.directory}/{step} does not match this run's state (model or "
                f"optimizer changed?): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from e
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


def restore_params(run_dir: str | Path, step: int, like: object, *, verify: str) -> object:
    """The params of checkpoint `step` of `run_dir`, shaped like `like` (the base params),
    after its manifest check (`verify`, `require_intact`)."""
    directory = checkpoints_dir(run_dir)
    steps = steps_on_disk(directory)
    if step not in steps:
        raise FileNotFoundError(f"{directory}: no checkpoint for step {step}; saved steps: {steps}")
    require_intact(run_dir, step, verify)
    manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    try:
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
