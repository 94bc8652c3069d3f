"""HF checkpoint folders on disk <-> (ModelConfig, params).

A folder holds `config.json`, `model.safetensors` or shards (`model-0000k-of-0000n.safetensors`
+ `model.safetensors.index.json`), and the tokenizer files (`models.tokenizer`). Nothing is
downloaded. The tensors go through the name map of `models.hf_state` (whose conversions are
re-exported here). safetensors headers are parsed here (a small, documented format) so that
BF16/FP8 shards read through ml_dtypes without monkey-patching `safetensors.numpy`, and float32
shards are written tensor by tensor as they are fetched.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tokenizers import Tokenizer

from models import tokenizer as tokenizer_io
from models.config import ModelConfig
from models.functional import Params, abstract_model
from models.hf_state import (
    from_hf_state_dict,
    hf_name_map,
    hf_shapes,
    iter_hf_state,
    random_hf_state_dict,
    to_hf_state_dict,
)
from models.sharding import param_shardings

# The state-dict conversions of `models.hf_state` are part of this module's API too (callers
# import them with `load_hf` / `save_hf`).
__all__ = [
    "from_hf_state_dict",
    "hf_name_map",
    "hf_shapes",
    "iter_hf_state",
    "load_hf",
    "load_hf_config",
    "random_hf_state_dict",
    "read_safetensors",
    "read_safetensors_header",
    "save_hf",
    "to_hf_state_dict",
]

# safetensors: a u64 little-endian header length, the JSON header {name: {dtype, shape,
# data_offsets}}, then the raw little-endian data.
_ST_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (without `__metadata__`)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {"__data_start__": 8 + n, **header}


def read_safetensors(path: str | Path, *, copy: bool = True) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays (BF16 and FP8 as ml_dtypes arrays).

    `copy=False` returns read-only views of a memory map of the file: nothing is read until
    used, and the pages are file-backed (the OS can drop them), which bounds a loader's host
    memory; the file must then stay unmodified while the arrays are in use."""
    path = Path(path)
    header = read_safetensors_header(path)
    start = header.pop("__data_start__")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        buf = np.asarray(data[start + lo : start + hi])
        x = buf.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = x.copy() if copy else x
    return out


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder}: no *.safetensors weights found (expected model.safetensors or shards "
            "with model.safetensors.index.json)"
        )
    missing = [f for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{index}: lists shard files that do not exist: {missing}")
    return files


def load_hf_config(folder: str | Path, **overrides: Any) -> ModelConfig:
    """`config.json` of an HF folder as a ModelConfig (`overrides`: compute_dtype, remat...)."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: an HF model folder needs config.json")
    try:
        return ModelConfig.from_hf_config(json.loads(path.read_text()), **overrides)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def load_hf(
    folder: str | Path, *, mesh: Mesh | None = None, **overrides: Any
) -> tuple[ModelConfig, nnx.GraphDef, Params]:
    """Loads an HF folder (config.json + safetensors, one file or shards) into the model.

    `overrides` set non-HF config fields (e.g. `compute_dtype=jnp.float32`, `remat="full"`,
    `attention="chunked"`). With `mesh`, every param is placed straight into its
    `models.sharding.param_shardings` sharding, shard by shard. The files are memory-mapped and
    each param is built from its own tensors only, so host memory stays near one param.
    The tokenizer is loaded separately: `models.tokenizer.load_tokenizer(folder)`.
    """
    folder = Path(folder)
    cfg = load_hf_config(folder, **overrides)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for f in _weight_files(folder):
        for name, x in read_safetensors(f, copy=False).items():
            if name in tensors:
                raise ValueError(f"{f}: tensor {name!r} also appears in {origin[name]}")
            tensors[name], origin[name] = x, str(f)
    graphdef, abstract = abstract_model(cfg)
    shardings = None if mesh is None else param_shardings(cfg, abstract, mesh)
    params = from_hf_state_dict(cfg, tensors, source=origin, shardings=shardings)
    # The host-to-device transfers are asynchronous and hold their memory-mapped sources until
    # done: wait, so the mapped pages (up to the whole file) leave the resident set before the
    # caller allocates the optimizer state.
    jax.block_until_ready(params)
    return cfg, graphdef, params


def write_planned_safetensors(
    path: Path,
    plan: list[tuple[str, tuple[int, ...]]],
    stream: Iterator[tuple[str, np.ndarray]],
    metadata: dict[str, str],
) -> None:
    """Writes the float32 tensors `plan` lists (name, shape), in that order, taking each from
    `stream` as it comes, to the safetensors file `path`. The header is written first (its
    offsets follow from the plan), so no tensor is held after it is written. A tensor that
    is not the next one planned (name, shape or dtype) raises a ValueError naming both."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in plan:
        nbytes = 4 * math.prod(shape)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data 8-byte aligned; the format allows the padding
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in plan:
            got = next(stream, None)
            x = None if got is None else np.asarray(got[1])
            if got is None or got[0] != name or x.shape != shape or x.dtype != np.float32:
                found = "nothing" if got is None else f"{got[0]!r} {x.shape} {x.dtype}"
                raise ValueError(
                    f"{path}: the tensors came out of order: expected {name!r} {shape} float32 "
                    f"(hf_name_map order), got {found}"
                )
            f.write(np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8))


def save_hf(
    folder: str | Path,
    cfg: ModelConfig,
    params: Params,
    tokenizer: Tokenizer | None = None,
    *,
    max_shard_bytes: int = 5 * 2**30,
    tensors: Iterable[tuple[str, np.ndarray]] | None = None,
) -> Path:
    """Writes an HF folder that transformers and vLLM load: config.json, float32 weights
    (`model.safetensors`, or shards + index above `max_shard_bytes`), generation_config.json,
    and the tokenizer files when `tokenizer` is given. Returns the folder.

    Tensors are fetched one at a time (`iter_hf_state(cfg, params)`, or `tensors` when the
    caller passes that iterator itself, e.g. to finish its cross-process gathers after a
    failed write: `jfp8rl.parallel.distributed.consume_on_main`; it must yield the tensors
    of `hf_shapes(cfg)` in that order, as float32) and each is written to its file as it
    comes: the shards and their headers are laid out beforehand from the model's shapes
    (`write_planned_safetensors`), so host memory holds the tensors in flight, not a shard."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config("float32"), indent=2) + "\n")
    gen = {
        k: v
        for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
        if v is not None
    }
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for old in folder.glob("model*.safetensors"):
        old.unlink()  # stale shards from an earlier save would be loaded too
    meta = {"format": "pt"}  # transformers refuses safetensors without this metadata
    # A new shard starts where the next tensor would take the current one past the limit.
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = total = 0
    for name, shape in hf_shapes(cfg):
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
        total += nbytes
    stream = iter(iter_hf_state(cfg, params) if tensors is None else tensors)
    # Shards are written under temporary names (not *.safetensors, so a reader never takes a
    # half-saved folder's shards) and renamed once all are complete.
    written: list[tuple[Path, list[str]]] = []
    for k, shard in enumerate(shards):
        path = folder / f"model.partial-{k:05d}"
        write_planned_safetensors(path, shard, stream, meta)
        written.append((path, [name for name, _ in shard]))
    if (extra := next(stream, None)) is not None:
        raise ValueError(f"save_hf: tensor {extra[0]!r} is not one of {cfg.arch}'s HF tensors")
    index_path = folder / "model.safetensors.index.json"
    if len(written) == 1:
        written[0][0].rename(folder / "model.safetensors")
        index_path.unlink(missing_ok=True)
    else:
        weight_map = {}
        for k, (path, names) in enumerate(written):
            fname = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
            path.rename(folder / fname)
            weight_map.update(dict.fromkeys(names, fname))
        index_path.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if tokenizer is not None:
        tokenizer_io.save_tokenizer(tokenizer, folder)
    return folder
