"""Writing versions into an export root, listing them, and deleting old and dead ones.

Layout, manifest and atomicity: the package docstring (`rollout_bridge.weights`).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bridge.weights import FORMAT_VERSION, MANIFEST, TENSOR_FILE, ExportError
from rollout_bridge.weights.hashing import check_hash, default_hash
from rollout_bridge.weights.safetensors_io import write_safetensors

PARTIAL_PREFIX = ".partial-"
_partial_counter = itertools.count()


def default_root() -> Path:
    """`$JFP8RL_EXPORT_ROOT`, else `/dev/shm/jfp8rl/run-<pid>` (tmp dir without /dev/shm).

    Shared memory is RAM: `run-<pid>` folders of processes that died without cleaning up are
    deleted here, whenever a process asks for its default root."""
    env = os.environ.get("JFP8RL_EXPORT_ROOT")
    if env:
        return Path(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    base = base / "jfp8rl"
    for d in base.glob("run-*") if base.is_dir() else []:
        try:
            pid = int(d.name.removeprefix("run-"))
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
    return base / f"run-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def safe_version_dir(version: str) -> str:
    """The folder name of `version`; refuses names that could escape the root."""
    if not version or version.startswith(".") or any(c in version for c in "/\\\0"):
        raise ExportError(
            f"weight version {version!r} cannot be a folder name: use letters, digits, "
            "'-', '_' (e.g. 'step-12')"
        )
    return version


def write_export(
    root: Path,
    version: str,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    fmt: str,
    quantization_config: Mapping[str, Any] | None = None,
    keep: int = 2,
    hash_name: str | None = None,
) -> Path:
    """Writes one version under `root` atomically and keeps only the newest `keep` versions.
    `tensors` may stream (`write_safetensors`: a few tensors in host memory at a time).
    `hash_name`: the tensor digest (one of `hashing.HASHES`; default `default_hash()`).

    Returns the version folder `<root>/<version>` (it replaces an older folder of the same name).
    """
    root = Path(root)
    final = root / safe_version_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{PARTIAL_PREFIX}{version}-{os.getpid()}-{next(_partial_counter)}"
    _recycle_or_mkdir(root, tmp, keep=keep, final=final)
    try:
        hash_name = check_hash(hash_name or default_hash(), "choose one of them")
        infos = write_safetensors(tmp / TENSOR_FILE, tensors, {"format": "pt"}, hash_name=hash_name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "version": version,
            "format": fmt,
            "created_ns": time.time_ns(),
            "quantization_config": dict(quantization_config) if quantization_config else None,
            "hash": hash_name,
            "files": {TENSOR_FILE: {"size": (tmp / TENSOR_FILE).stat().st_size}},
            "tensors": {name: {"file": TENSOR_FILE, **info} for name, info in infos.items()},
        }
        # Manifest last: a folder without one is never complete.
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if final.exists():
            trash = root / f"{PARTIAL_PREFIX}old-{version}-{os.getpid()}-{next(_partial_counter)}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cleanup_exports(root, keep=keep)
    return final


def _recycle_or_mkdir(root: Path, tmp: Path, *, keep: int, final: Path) -> None:
    """Creates the partial folder `tmp`, from the oldest version when the write will delete it.

    With `keep` versions already there, the oldest is deleted after this write anyway; renaming
    it to `tmp` first (it is then a partial folder no server loads, its manifest removed) lets
    the new tensor file overwrite its pages in place: on tmpfs (/dev/shm) a fresh file costs a
    page fault and a zeroed page per 4 KiB, as much as the copy itself. The newest version (the
    one being served) is never recycled, so a failed write leaves it complete."""
    versions = list_exports(root)
    others = [d for d in versions if d != final]  # what is left beside the new version
    old = [d for d in others if d != versions[-1]]
    if len(others) + 1 > keep and old:
        try:
            os.rename(old[0], tmp)
            (tmp / MANIFEST).unlink(missing_ok=True)
            for extra in tmp.iterdir():
                if extra.name != TENSOR_FILE:
                    shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
            return
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # raced with a cleanup: start empty
    tmp.mkdir()


def list_exports(root: Path) -> list[Path]:
    """Complete version folders under `root`, oldest first (by the manifest's `created_ns`)."""
    found = []
    for d in Path(root).iterdir() if Path(root).is_dir() else []:
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        try:
            created = json.loads((d / MANIFEST).read_text())["created_ns"]
        except (ValueError, KeyError, OSError):
            created = 0
        found.append((created, d))
    return [d for _, d in sorted(found)]


def cleanup_exports(root: Path, *, keep: int) -> None:
    """Deletes all but the newest `keep` versions, and partial folders of dead writers."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the served version), got {keep}")
    for d in list_exports(root)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)
    for d in Path(root).glob(f"{PARTIAL_PREFIX}*"):
        try:
            pid = int(d.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
