"""Reading one version folder: the manifest and file checks, then tensors verified by digest.

`open_export` streams the tensors (the vLLM plugin loads each as soon as its digest matched);
`load_export` reads them whole. Both return `(tensors, manifest)`. Every refusal is an
`ExportError` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollout_bridge.weights import FORMAT_VERSION, MANIFEST, ExportError
from rollout_bridge.weights.hashing import check_hash, digest, hash_module, sha256_file
from rollout_bridge.weights.safetensors_io import (
    IO_THREADS,
    itemsize,
    read_safetensors_header,
    tensor_view,
)

Framework = Literal["np", "pt"]
# (tensor file, HF name, the tensor's bytes, its read + digest job)
_Job = tuple[Path, str, memoryview, Future[str | None]]


def read_manifest(export_dir: Path) -> dict[str, Any]:
    """The parsed manifest of a version folder; `ExportError` if it is missing, malformed or of
    another format version."""
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
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            f"{path}: format_version {manifest.get('format_version')!r}, this reader needs "
            f"{FORMAT_VERSION}; export with the same jfp8rl version as the server"
        )
    return manifest


def _checked_manifest(
    export_dir: Path, expected_version: str | None, expected_manifest_sha256: str | None
) -> tuple[dict[str, Any], str]:
    """The manifest of `export_dir` and its tensor hash, after the manifest-level checks."""
    path = export_dir / MANIFEST
    if expected_manifest_sha256 is not None:
        got = sha256_file(path) if path.is_file() else None
        if got != expected_manifest_sha256:
            raise ExportError(
                f"{path}: sha256 {got} != expected {expected_manifest_sha256}; "
                "the export was replaced or tampered with after the push started"
            )
    manifest = read_manifest(export_dir)
    hash_name = check_hash(
        manifest.get("hash"),
        "export with the same jfp8rl version as the server",
        where=f"{path}: ",
    )
    try:  # a missing hash package refuses the export here, before any tensor is touched
        hash_module(hash_name)
    except ExportError as e:
        raise ExportError(f"{path}: {e}") from e
    if expected_version is not None and manifest["version"] != expected_version:
        raise ExportError(
            f"{path}: holds version {manifest['version']!r}, expected {expected_version!r}"
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
        if hi - lo != n_elem * itemsize(info["dtype"]):
            raise ExportError(f"{path}: tensor {name!r} has {hi - lo} bytes, wrong size")
        spans[name] = (lo, hi)
    return start, size, spans


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


def check_export_files(export_dir: str | Path) -> dict[str, Any]:
    """The manifest of `export_dir` after every check of `open_export` but the digests (cheap:
    no tensor byte is read); `ExportError` otherwise. The vLLM plugin asks this of the export
    it would roll back to before it loads a new one tensor by tensor."""
    export_dir = Path(export_dir)
    manifest, _ = _checked_manifest(export_dir, None, None)
    _checked_files(export_dir, manifest)
    return manifest


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
    """`nbytes` of fresh memory, not zero-filled (every byte is read over by the stream)."""
    return memoryview(np.empty(nbytes, np.uint8)).cast("B")


def open_export(
    export_dir: str | Path,
    *,
    verify: bool = True,
    framework: Framework = "np",
    expected_version: str | None = None,
    expected_manifest_sha256: str | None = None,
    mapped: bool = False,
) -> tuple[Iterator[tuple[str, Any]], dict[str, Any]]:
    """Opens one version folder for reading: (stream of (HF name, array), manifest).

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
    pass and no host buffer the size of the model (16 GB at 8B in bf16). What is verified is
    the file as it is during the load; a published version folder is never rewritten (a write
    recycles only versions older than the newest, `store.write_export`), so that is what the
    server loads. The check guards against corrupt, truncated, stale and half-written exports;
    a process rewriting a published file while a server loads it is not detected in this mode
    (without `mapped` the bytes verified are a private copy).
    """
    export_dir = Path(export_dir)
    manifest, hash_name = _checked_manifest(export_dir, expected_version, expected_manifest_sha256)
    files = _checked_files(export_dir, manifest)
    pool = ThreadPoolExecutor(IO_THREADS)
    opened: list[Any] = []
    jobs: list[_Job] = []
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
    return stream, manifest


def _stop_readers(pool: ThreadPoolExecutor, opened: list[Any]) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    for f in opened:
        f.close()


def _verified_stream(
    jobs: list[_Job],
    manifest: dict[str, Any],
    hash_name: str | None,
    framework: Framework,
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
            yield name, tensor_view(view, info["dtype"], info["shape"], framework)
    finally:
        _stop_readers(pool, opened)


def load_export(
    export_dir: str | Path,
    *,
    verify: bool = True,
    framework: Framework = "np",
    expected_version: str | None = None,
    expected_manifest_sha256: str | None = None,
    mapped: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads one version folder whole: ({HF name: array}, manifest), every check of
    `open_export` passed (with `verify`, every digest) before it returns; same arguments."""
    stream, manifest = open_export(
        export_dir,
        verify=verify,
        framework=framework,
        expected_version=expected_version,
        expected_manifest_sha256=expected_manifest_sha256,
        mapped=mapped,
    )
    with contextlib.closing(stream):
        return dict(stream), manifest
