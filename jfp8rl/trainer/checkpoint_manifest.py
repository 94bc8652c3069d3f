"""The digest manifest of a checkpoint, written inside its atomic commit, and its check.

`<step>/digests.json` lists every file of the step folder (the `state` item's array data and
metadata, the `meta` item's JSON, orbax's per-item markers) with its size and its digest
(xxh3_128 by default, as the weight exports: `rollout_bridge.weights.hashing`):

    {"hash": "xxh3_128", "files": {"state/_METADATA": {"size": 22612, "digest": "..."}, ...},
     "check": <the digest of the "files" object as sorted JSON>}

Two files are left out: orbax's `_CHECKPOINT_METADATA` and `commit_success.txt` at the top of
the step folder, which orbax stamps and writes after the manifest, as part of the commit
itself; a restore reads neither (it names its items), so their damage cannot hurt a resume.

Where it is written: `StepWithManifest`, orbax's temporary step folder (the one renamed to
`<step>/` at commit), writes the manifest as the first act of its commit, after every item is
finalized and before the rename. A folder `<step>/` therefore always carries its manifest,
and a save that fails at any point, the manifest included, leaves no `<step>/` at all. With
several processes orbax commits on process 0 after a barrier that every process reaches once
its files are on disk, so process 0 hashes every process's files.

`check(step_dir, mode)` reads the manifest back: "size" checks that every listed file is
there with its size, "full" also recomputes the digests (every byte read once). With
several processes each process checks every size (what its own view of the filesystem
holds) and the digests of its share of the files, so each byte is hashed once in all;
`jfp8rl.trainer.checkpoint.newest_intact` agrees on the verdicts.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jfp8rl.config import ConfigError
from rollout_bridge.weights import ExportError
from rollout_bridge.weights.hashing import check_hash, default_hash, digest, hash_module, hasher

MANIFEST = "digests.json"
# orbax's own markers at the top of a step folder, written at commit, after the manifest.
UNLISTED = ("_CHECKPOINT_METADATA", "commit_success.txt")
_HASH_THREADS = min(8, os.cpu_count() or 1)  # the reads and digests release the GIL
_READ_CHUNK = 16 << 20  # bytes each hashing thread reads at a time


def file_digest(path: Path, hash_name: str) -> str:
    """The digest of a whole file, read in `_READ_CHUNK` pieces into one buffer. Not through a
    memory map: the mapped pages of every file being hashed would count in this process's
    resident memory (gigabytes for a large state) until unmapped; read() leaves them to the
    page cache."""
    h, buf = hasher(hash_name), bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def listed_files(step_dir: Path) -> list[str]:
    """The files of a step folder that its manifest covers, as sorted relative paths."""
    top = {*UNLISTED, MANIFEST}
    return sorted(
        rel
        for p in step_dir.rglob("*")
        if p.is_file() and (rel := p.relative_to(step_dir).as_posix()) not in top
    )


def _files_check(files: dict[str, Any], hash_name: str) -> str:
    return digest(memoryview(json.dumps(files, sort_keys=True).encode()), hash_name)


def write_manifest(step_dir: Path, hash_name: str | None = None) -> Path:
    """Writes `step_dir/digests.json` (module docstring) and syncs it to disk; its path."""
    hash_name = hash_name or default_hash()
    rels = listed_files(step_dir)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = list(pool.map(lambda r: file_digest(step_dir / r, hash_name), rels))
    files = {
        rel: {"size": (step_dir / rel).stat().st_size, "digest": d}
        for rel, d in zip(rels, digests, strict=True)
    }
    body = {"hash": hash_name, "files": files, "check": _files_check(files, hash_name)}
    out = step_dir / MANIFEST
    with out.open("w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return out


def read_manifest(step_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """(the manifest's hash name and files, "") or (None, what is wrong with it)."""
    path = step_dir / MANIFEST
    try:
        body = json.loads(path.read_bytes())
        hash_name = check_hash(body["hash"], "the manifest is damaged")
        files = body["files"]
        if not isinstance(files, dict) or _files_check(files, hash_name) != body["check"]:
            return None, f"{MANIFEST}: damaged (its own check digest does not match)"
        return {"hash": hash_name, "files": files}, ""
    except FileNotFoundError:
        return None, f"{MANIFEST}: missing (the checkpoint is incomplete)"
    except Exception as e:  # unreadable JSON, missing or mistyped fields: all mean damaged
        return None, f"{MANIFEST}: damaged ({type(e).__name__}: {e})"


def _my_share(files: dict[str, Any], share: tuple[int, int]) -> list[str]:
    """Process `index`'s files of `count` (largest first, dealt round-robin)."""
    index, count = share
    by_size = sorted(files, key=lambda r: (-int(files[r]["size"]), r))
    return by_size[index::count]


def check(step_dir: Path, mode: str, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when `step_dir` is intact under `mode` ("full" / "size"; "none" checks nothing),
    else its first problem, one line: "<file>: <what is wrong>". `share` = (this process,
    processes): the digests this process recomputes (module docstring). A file that cannot
    be read is a problem too; a digest whose package is not installed is a `ConfigError`."""
    if mode == "none":
        return None
    if not step_dir.is_dir():
        return "the step folder is missing"
    manifest, problem = read_manifest(step_dir)
    if manifest is None:
        return problem
    files, hash_name = manifest["files"], manifest["hash"]
    if mode == "full":
        try:
            hash_module(hash_name)
        except ExportError as e:
            raise ConfigError(f"{step_dir / MANIFEST}: {e}; or checkpoint.verify=size") from e
    rel = MANIFEST
    try:
        for rel in sorted(files):
            path = step_dir / rel
            if not path.is_file():
                return f"{rel}: missing"
            size, want = path.stat().st_size, int(files[rel]["size"])
            if size != want:
                return f"{rel}: {size} bytes, the manifest says {want}"
        if mode == "full":
            mine = _my_share(files, share)
            with ThreadPoolExecutor(_HASH_THREADS) as pool:
                got = list(pool.map(lambda r: file_digest(step_dir / r, hash_name), mine))
            for rel, d in zip(mine, got, strict=True):
                if d != files[rel]["digest"]:
                    return f"{rel}: contents differ from the manifest ({hash_name} digest)"
    except OSError as e:  # an unreadable file (EACCES, EIO); the digests name theirs
        where = Path(e.filename).relative_to(step_dir).as_posix() if e.filename else rel
        return f"{where}: unreadable ({e.strerror or e})"
    return None


class StepWithManifest(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """orbax's temporary folder renamed at commit (the default on local and network
    filesystems) that writes the digest manifest of a step folder just before its commit.
    orbax uses the class for the items inside the step folder too (`state`, `meta`): those,
    committed before their step folder, are left as orbax makes them."""

    async def finalize(self) -> None:
        if self.get_final().name.isdigit():  # the step folder `<step>/`, not an item
            await asyncio.to_thread(write_manifest, Path(self.get()))  # epath -> pathlib
        await super().finalize()
