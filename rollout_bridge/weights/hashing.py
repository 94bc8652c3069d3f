"""Tensor digests of an export: which hashes exist, the default, and computing one.

Both sides hash every push (the trainer when it writes, the server when it loads), so the
hash's speed is part of the push's cost: xxh3_128 is the default for that reason
(`benchmarks/weight_sync.py --compare-hash blake3,sha256` times full pushes with each).

xxh3_128 is not cryptographic: it catches corruption, truncation and staleness with odds of
2^-128 of a miss, but a writer who means to can craft bytes with a given digest. That buys
such a writer nothing on one host: vLLM's `/update_weights` is not behind `--api-key` (which
guards `/v1` routes only), so whoever can write the export folder and reach the server can
push an export of their own. Where the export folder is a shared filesystem that others can
write but not the route, choose a cryptographic digest: `rollout.export_hash: blake3`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
from pathlib import Path
from typing import Any

from rollout_bridge.weights import ExportError

HASHES = ("xxh3_128", "blake3", "sha256")  # default_hash(): the first whose package imports
_PACKAGES = {"xxh3_128": "xxhash", "blake3": "blake3"}  # sha256: hashlib


@functools.cache
def hash_module(hash_name: str) -> Any:
    """The package computing `hash_name` (None for sha256, hashlib's), imported once.

    Raises `ExportError` with the install command where the package is missing."""
    package = _PACKAGES.get(hash_name)
    if package is None:
        return None
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ExportError(
            f"tensor hash {hash_name} needs the {package} package, not installed here: "
            f"pip install {package} (a dependency of this project; in vLLM's venv "
            "scripts/setup_vllm_env.sh installs it), or export with another hash "
            f"(rollout.export_hash, one of {HASHES})"
        ) from e


def default_hash() -> str:
    """The tensor digest an export records unless told otherwise: the first of `HASHES` whose
    package imports (xxh3_128: xxhash is a dependency of this project)."""
    for name in HASHES:
        with contextlib.suppress(ExportError):
            hash_module(name)
            return name
    return HASHES[-1]


def check_hash(hash_name: str, fix: str, *, where: str = "") -> str:
    """`hash_name` if it is one of `HASHES`, else an `ExportError` saying what to do (`fix`)."""
    if hash_name not in HASHES:
        raise ExportError(f"{where}unknown tensor hash {hash_name!r} (known: {HASHES}); {fix}")
    return hash_name


def hasher(hash_name: str) -> Any:
    """A fresh incremental hasher of `hash_name` (one of `HASHES`): `update(bytes)` any number
    of times, then `hexdigest()`, equal to `digest` of the bytes joined (all release the GIL)."""
    module = hash_module(check_hash(hash_name, "use one of them"))
    if hash_name == "xxh3_128":
        return module.xxh3_128()
    if hash_name == "blake3":
        return module.blake3(max_threads=1)
    return hashlib.sha256()


def digest(view: memoryview, hash_name: str) -> str:
    """Hex digest of `view` with `hash_name` (one of `HASHES`)."""
    h = hasher(hash_name)
    h.update(view)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a whole file (a manifest: the digest a push hands to the server)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
