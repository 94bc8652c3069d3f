"""The on-disk form of one exported weight version: safetensors + `manifest.json`.

This module only moves bytes (numpy, hashlib, json; torch optional): it is imported by the vLLM
plugin inside vLLM's own venv, which has neither jax nor ml_dtypes. The conversion from
trainer params to the rollout format lives in `rollout_bridge.export`.

Layout of an export root (default `/dev/shm/jfp8rl/run-<pid>`, shared memory so a "copy" to
the server is a page-cache read):

    <root>/<version>/model.safetensors   tensors, HF names
    <root>/<version>/manifest.json       {"format_version", "version", "format", "created_ns",
                                          "quantization_config", "hash",
                                          "files": {name: {size}},
                                          "tensors": {name: {file, dtype, shape, <hash>}}}
    <root>/.partial-<version>-<pid>-<n>/ a version being written (never read)

A version is written into a `.partial-*` folder and renamed into place only when complete
(`os.rename` is atomic within one filesystem), so a crash mid-write never leaves a folder a
server would load; the manifest is written last. Each tensor's digest (keyed by the manifest's
`hash`, one of `HASHES`; format_version 1 manifests are sha256) is over its raw little-endian
bytes, so a flipped byte, a truncated file or a stale or mixed export is refused by
`load_export`. The server is handed the manifest's own sha256, so the chain of digests starts
at the trainer. Both sides hash every push, so the hash's speed is part of the push's cost;
measured on 200 MB, one core (AVX2):

    xxh3_128  0.011 s   (the default: `default_hash()`; the `xxhash` package)
    blake3    0.059 s   (cryptographic; the `blake3` package, which vLLM ships)
    sha256    0.11 s    (cryptographic; hashlib, always there)

xxh3_128 is not cryptographic: it catches corruption, truncation and staleness with odds of
2^-128 of a miss, but a writer who means to can craft bytes with a given digest. That buys
such a writer nothing on one host: vLLM's `/update_weights` is not behind `--api-key` (which
guards `/v1` routes only), so whoever can write the export folder and reach the server can
push an export of their own. Where the export folder is a shared filesystem that others can
write but not the route, choose a cryptographic digest: `rollout.export_hash: blake3`.

The safetensors writer/reader are ours (the format is 8 bytes of little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets}}`, then the data) because the `safetensors`
numpy API has no bfloat16/float8 arrays; files load unchanged with `safetensors.safe_open`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib
import itertools
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

FORMAT_VERSION = 2  # 2: per-tensor digests keyed by the manifest's "hash" (1: always sha256)
READABLE_FORMAT_VERSIONS = (1, 2)
HASHES = ("xxh3_128", "blake3", "sha256")  # default_hash(): the first whose package imports
_HASH_PACKAGES = {"xxh3_128": "xxhash", "blake3": "blake3"}  # sha256: hashlib
MANIFEST = "manifest.json"
TENSOR_FILE = "model.safetensors"
PARTIAL_PREFIX = ".partial-"

# numpy dtype name <-> safetensors dtype tag. bfloat16 / float8 come from ml_dtypes on the
# trainer side; the vLLM side reads them as torch tensors (`framework="pt"`).
_NP_TO_ST = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_partial_counter = itertools.count()


class ExportError(ValueError):
    """An export folder is missing, incomplete, tampered with, or of the wrong version."""


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


def safe_version_dir(version: str) -> str:
    """The folder name of `version`; refuses names that could escape the root."""
    if not version or version.startswith(".") or any(c in version for c in "/\\\0"):
        raise ExportError(
            f"weight version {version!r} cannot be a folder name: use letters, digits, "
            "'-', '_' (e.g. 'step-12')"
        )
    return version


def st_dtype(arr: np.ndarray) -> str:
    """The safetensors dtype tag of a numpy array (ml_dtypes bfloat16/float8 included)."""
    try:
        return _NP_TO_ST[arr.dtype.name]
    except KeyError:
        raise ExportError(
            f"dtype {arr.dtype} cannot be exported; use one of {sorted(_NP_TO_ST)}"
        ) from None


def _le_bytes(arr: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    # ml_dtypes arrays (bfloat16, float8) do not export the buffer protocol: view the bytes.
    return memoryview(a.reshape(-1).view(np.uint8))


# Tensor bytes are written, read and hashed by worker threads (os.pwrite / os.preadv and
# hashlib release the GIL), several tensors at once; the writer holds at most _IN_FLIGHT.
_IO_THREADS = max(2, min(8, os.cpu_count() or 1))
_IN_FLIGHT = 2 * _IO_THREADS
# Header room of a streamed export (tensors unknown until produced): ~150 bytes per tensor,
# so 1 MiB fits ~7000 tensors; a larger header moves the data once (`_fit_header`).
_HEADER_RESERVE = 1 << 20


def _header(
    entries: list[tuple[str, str, list[int], int]], metadata: Mapping[str, str] | None
) -> bytes:
    """The safetensors JSON header of (name, dtype tag, shape, nbytes) entries, in order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tag, shape, nbytes in entries:
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return json.dumps(header, separators=(",", ":")).encode()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@functools.cache
def _hash_module(hash_name: str) -> Any:
    """The package computing `hash_name` (None for sha256, hashlib's), imported once.

    Raises `ExportError` with the install command where the package is missing."""
    package = _HASH_PACKAGES.get(hash_name)
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
    """The tensor digest `write_export` records: the first of `HASHES` whose package imports
    (xxh3_128: xxhash is a dependency of this project)."""
    for name in HASHES:
        with contextlib.suppress(ExportError):
            _hash_module(name)
            return name
    return HASHES[-1]


def _known_hash(hash_name: str, fix: str, *, where: str = "") -> str:
    """`hash_name` if it is one of `HASHES`, else an `ExportError` saying what to do (`fix`)."""
    if hash_name not in HASHES:
        raise ExportError(f"{where}unknown tensor hash {hash_name!r} (known: {HASHES}); {fix}")
    return hash_name


def digest(view: memoryview, hash_name: str) -> str:
    """Hex digest of `view` with `hash_name` (one of `HASHES`; all release the GIL)."""
    module = _hash_module(_known_hash(hash_name, "use one of them"))
    if hash_name == "xxh3_128":
        return module.xxh3_128(view).hexdigest()
    if hash_name == "blake3":
        return module.blake3(view, max_threads=1).hexdigest()
    return hashlib.sha256(view).hexdigest()


def _write_and_hash(fd: int, view: memoryview, offset: int, hash_name: str) -> str:
    _pwrite_all(fd, view, offset)
    return digest(view, hash_name)


def write_safetensors(
    path: Path,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
    *,
    hash_name: str,
) -> dict[str, dict[str, Any]]:
    """Writes `tensors` to `path` in safetensors format; returns {name: {dtype, shape,
    <hash_name>}} (the digest of the tensor's raw little-endian bytes), in file order.

    `tensors` may be a dict or (name, array) pairs produced one at a time (an export being
    converted): each tensor is written at its offset and hashed by worker threads while the
    next one is produced, and at most `_IN_FLIGHT` arrays are held, so host memory stays
    bounded by a few tensors. The header goes last: exactly sized for a dict; for a stream,
    into `_HEADER_RESERVE` bytes padded with spaces (JSON allows them; `safe_open` reads it),
    moving the data once if the header does not fit."""
    if isinstance(tensors, Mapping):
        dry = [(n, st_dtype(a), list(a.shape), a.nbytes) for n, a in tensors.items()]
        hlen = len(_header(dry, metadata))
        start = 8 + hlen + (-hlen % 8)  # data 8-byte aligned, as safetensors writes it
        items: Iterable[tuple[str, np.ndarray]] = tensors.items()
    else:
        start, items = _HEADER_RESERVE, tensors
    entries: list[tuple[str, str, list[int], int]] = []
    pending: collections.deque[Future[str]] = collections.deque()
    futures: list[Future[str]] = []
    offset = 0
    # Opened without truncating: a recycled file (`write_export`) keeps its pages, so the
    # writes below overwrite memory instead of faulting fresh pages in; cut to size at the end.
    with (
        open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as f,
        ThreadPoolExecutor(_IO_THREADS) as pool,
    ):
        fd = f.fileno()
        for name, arr in items:
            if name == "__metadata__":
                raise ExportError("'__metadata__' is reserved in safetensors, not a tensor name")
            view = _le_bytes(arr)
            entries.append((name, st_dtype(arr), list(arr.shape), view.nbytes))
            fut = pool.submit(_write_and_hash, fd, view, start + offset, hash_name)
            pending.append(fut)
            futures.append(fut)
            offset += view.nbytes
            while len(pending) > _IN_FLIGHT:
                pending.popleft().result()
        hashes = [fut.result() for fut in futures]
        if len({e[0] for e in entries}) != len(entries):
            raise ExportError("tensor names repeat in the export; each HF name must be unique")
        raw = _header(entries, metadata)
        if 8 + len(raw) > start:
            start = _fit_header(f, start, offset, 8 + len(raw))
        _pwrite_all(fd, memoryview(struct.pack("<Q", start - 8) + raw.ljust(start - 8)), 0)
        os.ftruncate(fd, start + offset)
    return {
        e[0]: {"dtype": e[1], "shape": e[2], hash_name: h}
        for e, h in zip(entries, hashes, strict=True)
    }


def _fit_header(f: Any, start: int, data_len: int, need: int) -> int:
    """Moves `data_len` bytes of data from `start` to a larger 8-aligned start >= need."""
    new_start = need + (-need % 8)
    shift = new_start - start
    fd, chunk = f.fileno(), 64 << 20
    for hi in range(data_len, 0, -chunk):  # back to front: the ranges may overlap
        lo = max(0, hi - chunk)
        _pwrite_all(fd, memoryview(os.pread(fd, hi - lo, start + lo)), start + lo + shift)
    return new_start


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header, data start offset, file size) of a safetensors file.

    Raises `ExportError` naming the file if it is truncated or its header is malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ExportError(f"{path}: {size} bytes, no safetensors header; the file is truncated")
        (hlen,) = struct.unpack("<Q", head)
        if 8 + hlen > size:
            raise ExportError(
                f"{path}: header length {hlen} exceeds the file size {size}; truncated"
            )
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ExportError(f"{path}: malformed safetensors header ({e})") from e
    start = 8 + hlen
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        if start + hi > size:
            raise ExportError(
                f"{path}: tensor {name!r} ends at byte {start + hi} but the file has {size} "
                "bytes; the file is truncated, export it again"
            )
    return header, start, size


def _read_and_hash(
    fd: int | None, view: memoryview, offset: int, hash_name: str | None
) -> str | None:
    """Fills `view` from the file at `offset` (short read: None; `fd` None: `view` is a mapping
    of the file, already its bytes), then its digest ("" when `hash_name` is None: not
    verifying)."""
    done = view.nbytes if fd is None else 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            return None
        done += n
    return digest(view, hash_name) if hash_name else ""


def _map_data(f: Any, start: int, size: int) -> memoryview:
    """The data section (bytes `start`..`size`) of open file `f` as a private, writable mapping
    (copy-on-write: torch.frombuffer wants a writable buffer; the file never changes). The
    mapping lives as long as a view of it."""
    if size == start:
        return memoryview(b"")
    mem = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    if os.fstat(f.fileno()).st_size < size:  # cut since the size check: reading would SIGBUS
        raise ExportError(f"{f.name}: truncated while being loaded; export again")
    return memoryview(mem)[start:size]


def _uninitialized(nbytes: int) -> memoryview:
    """`nbytes` of fresh memory, not zero-filled (every byte is read over by `load_export`)."""
    return memoryview(np.empty(nbytes, np.uint8)).cast("B")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    `hash_name`: the tensor digest (one of `HASHES`; default `default_hash()`).

    Returns the version folder `<root>/<version>` (it replaces an older folder of the same name).
    """
    root = Path(root)
    final = root / safe_version_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{PARTIAL_PREFIX}{version}-{os.getpid()}-{next(_partial_counter)}"
    _recycle_or_mkdir(root, tmp, keep=keep, final=final)
    try:
        hash_name = _known_hash(hash_name or default_hash(), "choose one of them")
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def read_manifest(export_dir: Path) -> dict[str, Any]:
    """The parsed manifest of a version folder; `ExportError` if it is missing or malformed."""
    path = Path(export_dir) / MANIFEST
    if not path.is_file():
        raise ExportError(
            f"{path} not found: {export_dir} is not a complete weight export "
            "(write one with rollout_bridge.export.export_weights)"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ExportError(f"{path}: malformed JSON ({e}); export the weights again") from e
    if manifest.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise ExportError(
            f"{path}: format_version {manifest.get('format_version')!r}, this reader needs "
            f"one of {READABLE_FORMAT_VERSIONS}; export with the same jfp8rl version as the server"
        )
    return manifest


def _np_dtype(tag: str) -> np.dtype:
    if tag in ("BF16", "F8_E4M3", "F8_E5M2"):
        import ml_dtypes  # trainer side only; the vLLM side uses framework="pt"

        return np.dtype(
            {
                "BF16": ml_dtypes.bfloat16,
                "F8_E4M3": ml_dtypes.float8_e4m3fn,
                "F8_E5M2": ml_dtypes.float8_e5m2,
            }[tag]
        )
    inv = {v: k for k, v in _NP_TO_ST.items()}
    return np.dtype(inv[tag])


def _pt_tensor(view: memoryview, tag: str, shape: list[int]) -> Any:
    import torch

    dtypes = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtypes[tag])
    return torch.frombuffer(view, dtype=dtypes[tag]).reshape(shape)


def _checked_manifest(
    export_dir: Path, expected_version: str | None, expected_manifest_sha256: str | None
) -> tuple[dict[str, Any], str]:
    """The manifest of `export_dir` and its tensor hash, after the manifest-level checks."""
    if expected_manifest_sha256 is not None:
        got = sha256_file(export_dir / MANIFEST) if (export_dir / MANIFEST).is_file() else None
        if got != expected_manifest_sha256:
            raise ExportError(
                f"{export_dir / MANIFEST}: sha256 {got} != expected {expected_manifest_sha256}; "
                "the export was replaced or tampered with after the push started"
            )
    manifest = read_manifest(export_dir)
    hash_name = _known_hash(
        manifest.get("hash", "sha256"),  # format_version 1: sha256
        "export with the same jfp8rl version as the server",
        where=f"{export_dir / MANIFEST}: ",
    )
    try:  # a missing hash package refuses the export here, before any tensor is touched
        _hash_module(hash_name)
    except ExportError as e:
        raise ExportError(f"{export_dir / MANIFEST}: {e}") from e
    if expected_version is not None and manifest["version"] != expected_version:
        raise ExportError(
            f"{export_dir / MANIFEST}: holds version {manifest['version']!r}, expected "
            f"{expected_version!r}"
        )
    return manifest, hash_name


def _checked_spans(
    path: Path, names: list[str], manifest: dict[str, Any]
) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(data start, file size, {name: (lo, hi)}) of one tensor file, after checking its size,
    header, names, dtypes and shapes against the manifest."""
    if not path.is_file():
        raise ExportError(f"{path} listed in the manifest is missing; export again")
    want = manifest["files"][path.name]["size"]
    if path.stat().st_size != want:
        raise ExportError(
            f"{path}: {path.stat().st_size} bytes, the manifest says {want}; the file is "
            "truncated or was rewritten, export again"
        )
    header, start, size = read_safetensors_header(path)
    listed = {k for k in header if k != "__metadata__"}
    if listed != set(names):
        raise ExportError(
            f"{path}: tensors {sorted(listed ^ set(names))[:5]} differ between the file "
            "and the manifest"
        )
    spans = {}
    for name in names:
        info, hinfo = manifest["tensors"][name], header[name]
        if hinfo["dtype"] != info["dtype"] or list(hinfo["shape"]) != list(info["shape"]):
            raise ExportError(
                f"{path}: tensor {name!r} is {hinfo['dtype']}{hinfo['shape']} in the file "
                f"but {info['dtype']}{info['shape']} in the manifest"
            )
        lo, hi = hinfo["data_offsets"]
        n_elem = int(np.prod(info["shape"], dtype=np.int64))
        if hi - lo != n_elem * _ST_ITEMSIZE[info["dtype"]]:
            raise ExportError(f"{path}: tensor {name!r} has {hi - lo} bytes, wrong size")
        spans[name] = (lo, hi)
    return start, size, spans


def check_export_files(export_dir: str | Path) -> dict[str, Any]:
    """The manifest of `export_dir` after every check of `open_export` but the digests (cheap:
    no tensor byte is read); `ExportError` otherwise. The vLLM plugin asks this of the export
    it would roll back to before it loads a new one tensor by tensor."""
    export_dir = Path(export_dir)
    manifest, _ = _checked_manifest(export_dir, None, None)
    _checked_files(export_dir, manifest)
    return manifest


def _checked_files(
    export_dir: Path, manifest: dict[str, Any]
) -> list[tuple[Path, list[str], int, int, dict[str, tuple[int, int]]]]:
    """(path, tensor names, data start, size, spans) of each tensor file, all checked
    (`_checked_spans`) before any tensor byte is read."""
    by_file: dict[str, list[str]] = {}
    for name, info in manifest["tensors"].items():
        by_file.setdefault(info["file"], []).append(name)
    return [
        (export_dir / fname, names, *_checked_spans(export_dir / fname, names, manifest))
        for fname, names in by_file.items()
    ]


def open_export(
    export_dir: str | Path,
    *,
    verify: bool = True,
    framework: Literal["np", "pt"] = "np",
    expected_version: str | None = None,
    expected_manifest_sha256: str | None = None,
    mapped: bool = False,
) -> tuple[dict[str, Any], Iterator[tuple[str, Any]]]:
    """Opens one version folder for reading: (manifest, stream of (HF name, array)).

    Before it returns, every check but the digests has passed (each failure raises
    `ExportError` naming the file and tensor):
      - the manifest exists and, if given, its sha256 / version are the expected ones;
      - each tensor file has the manifest's size (a truncated file is refused);
      - the safetensors headers list exactly the manifest's names, dtypes and shapes.
    and worker threads, started here (so they inherit the caller's CPU affinity), are reading
    (or, `mapped`, touching) and hashing every tensor in file order. The stream then yields the
    tensors in that order, each only once its digest equals the manifest's (with `verify`);
    the first mismatch or short read raises `ExportError` from the stream. Close the stream
    (`contextlib.closing`) when abandoning it early: that stops the workers.

    `framework="np"` yields numpy arrays (bf16/fp8 as ml_dtypes); `"pt"` torch tensors (the
    vLLM side). Arrays are views of one buffer per file; copy before mutating.

    `mapped` (the vLLM plugin): the arrays are views of a private mapping of the file, i.e. of
    the page cache (on /dev/shm the very pages the trainer wrote), hashed in place: no read
    pass and no host buffer the size of the model (16 GB at 8B in bf16). Measured on the 100M
    model's bf16 export, 2 cores: read + verify 0.117 s, mapped + verify 0.087 s. What is
    verified is the file as it is during the load; a published version folder is never
    rewritten (a write recycles only versions older than the newest, `_recycle_or_mkdir`), so
    that is what the server loads. The check guards against corrupt, truncated, stale and
    half-written exports; a process rewriting a published file while a server loads it is not
    detected in this mode (without `mapped` the bytes verified are a private copy).
    """
    export_dir = Path(export_dir)
    manifest, hash_name = _checked_manifest(export_dir, expected_version, expected_manifest_sha256)
    files = _checked_files(export_dir, manifest)
    pool = ThreadPoolExecutor(_IO_THREADS)
    opened: list[Any] = []
    jobs: list[tuple[Path, str, memoryview, Future[str | None]]] = []
    try:
        for path, names, start, size, spans in files:
            f = open(path, "rb")  # noqa: SIM115 (closed by the stream, after its readers)
            opened.append(f)
            mem = _map_data(f, start, size) if mapped else _uninitialized(size - start)
            fd = None if mapped else f.fileno()
            for name in names:
                lo, hi = spans[name]
                view = mem[lo:hi]
                fut = pool.submit(
                    _read_and_hash, fd, view, start + lo, hash_name if verify else None
                )
                jobs.append((path, name, view, fut))
    except BaseException:
        _stop_readers(pool, opened)
        raise
    stream = _verified_stream(
        jobs, manifest, hash_name if verify else None, framework, pool, opened
    )
    return manifest, stream


def _stop_readers(pool: ThreadPoolExecutor, opened: list[Any]) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    for f in opened:
        f.close()


def _verified_stream(
    jobs: list[tuple[Path, str, memoryview, Future[str | None]]],
    manifest: dict[str, Any],
    hash_name: str | None,
    framework: str,
    pool: ThreadPoolExecutor,
    opened: list[Any],
) -> Iterator[tuple[str, Any]]:
    """Each job's tensor once its read and digest check passed, in job order; then (also when
    closed early or failing) the readers stopped and the files closed."""
    try:
        for path, name, view, fut in jobs:
            info = manifest["tensors"][name]
            got = fut.result()
            if got is None:
                raise ExportError(f"{path}: short read of tensor {name!r}; the file is truncated")
            if hash_name is not None and got != info.get(hash_name):
                raise ExportError(
                    f"{path}: {hash_name} of tensor {name!r} does not match the manifest; the "
                    "file was modified after export, export again"
                )
            if framework == "pt":
                yield name, _pt_tensor(view, info["dtype"], info["shape"])
            else:
                yield (
                    name,
                    np.frombuffer(view, dtype=_np_dtype(info["dtype"])).reshape(info["shape"]),
                )
    finally:
        _stop_readers(pool, opened)


def load_export(
    export_dir: str | Path,
    *,
    verify: bool = True,
    framework: Literal["np", "pt"] = "np",
    expected_version: str | None = None,
    expected_manifest_sha256: str | None = None,
    mapped: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads one version folder whole: ({HF name: array}, manifest), every check of
    `open_export` passed (with `verify`, every digest) before it returns; same arguments."""
    manifest, stream = open_export(
        export_dir,
        verify=verify,
        framework=framework,
        expected_version=expected_version,
        expected_manifest_sha256=expected_manifest_sha256,
        mapped=mapped,
    )
    with contextlib.closing(stream):
        return dict(stream), manifest
