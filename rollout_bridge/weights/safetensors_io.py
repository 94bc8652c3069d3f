"""The tensor file of an export: a safetensors writer and header reader, and the dtype table.

The format is 8 bytes of little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}}` (plus an optional `__metadata__`), then the data. The writer is ours because
the `safetensors` numpy API has no bfloat16/float8 arrays; its files load unchanged with
`safetensors.safe_open`.

Tensor bytes are written, read and hashed by worker threads (os.pwrite / os.preadv and the
digests release the GIL), several tensors at once.
"""

from __future__ import annotations

import collections
import json
import os
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rollout_bridge.weights import ExportError
from rollout_bridge.weights.hashing import digest

# safetensors dtype tag -> (numpy and torch dtype name, bytes per element). bfloat16 / float8
# are ml_dtypes types on the trainer side and torch types on the vLLM side.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_TAGS = {name: tag for tag, (name, _) in DTYPES.items()}
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # not numpy's own

IO_THREADS = max(2, min(8, os.cpu_count() or 1))
_IN_FLIGHT = 2 * IO_THREADS  # arrays the writer holds at most
# Header room of a streamed export (tensors unknown until produced): ~150 bytes per tensor,
# so 1 MiB fits ~7000 tensors; a larger header moves the data once (`_fit_header`).
_HEADER_RESERVE = 1 << 20


def st_dtype(arr: np.ndarray) -> str:
    """The safetensors dtype tag of a numpy array (ml_dtypes bfloat16/float8 included)."""
    try:
        return _TAGS[arr.dtype.name]
    except KeyError:
        raise ExportError(
            f"dtype {arr.dtype} cannot be exported; use one of {sorted(_TAGS)}"
        ) from None


def itemsize(tag: str) -> int:
    """Bytes per element of the safetensors dtype `tag`."""
    return DTYPES[tag][1]


def tensor_view(
    view: memoryview, tag: str, shape: list[int], framework: Literal["np", "pt"]
) -> Any:
    """The bytes `view` as an array of dtype `tag` and `shape`, without a copy: numpy
    (bf16/fp8 as ml_dtypes) for "np", torch for "pt" (the vLLM side)."""
    name = DTYPES[tag][0]
    if framework == "pt":
        import torch  # the vLLM side only: the trainer's venv has no torch

        dtype = getattr(torch, name)
        if view.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(view, dtype=dtype).reshape(shape)
    if name in _ML_DTYPES:
        import ml_dtypes  # the trainer side only: vLLM's venv has no ml_dtypes

        return np.frombuffer(view, dtype=getattr(ml_dtypes, name)).reshape(shape)
    return np.frombuffer(view, dtype=name).reshape(shape)


def _le_bytes(arr: np.ndarray) -> memoryview:
    """The raw little-endian bytes of `arr` (what is written and hashed)."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    # ml_dtypes arrays (bfloat16, float8) do not export the buffer protocol: view the bytes.
    return memoryview(a.reshape(-1).view(np.uint8))


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
    # Opened without truncating: a recycled file (`store.write_export`) keeps its pages, so the
    # writes below overwrite memory instead of faulting fresh pages in; cut to size at the end.
    with (
        open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as f,
        ThreadPoolExecutor(IO_THREADS) as pool,
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
