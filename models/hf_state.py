"""HF checkpoint folders <-> (ModelConfig, params), with one explicit name map per architecture.

A folder holds `config.json`, `model.safetensors` or shards (`model-0000k-of-0000n.safetensors`
+ `model.safetensors.index.json`), and the tokenizer files (`models.tokenizer`). Nothing is
downloaded. Tensors in HF layout are [out, in]; our `Linear.kernel` is [in, out] and our untied
`lm_head` is [D, V], so those are transposed both ways; everything else is copied as is.
safetensors headers are parsed here (a small, documented format) so that BF16/FP8 shards read
through ml_dtypes without monkey-patching `safetensors.numpy`; writing uses `safetensors.numpy`.
"""

from __future__ import annotations

import collections
import functools
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from models import tokenizer as tokenizer_io
from models.config import ModelConfig
from models.functional import Params, abstract_model
from models.sharding import host_array, param_shardings

# One row per tensor kind: (HF name with {i} for the layer, our path, transposed?). Layer paths are
# relative to `model.layers`, whose params are stacked on a leading layer axis.
_EMBED = [("model.embed_tokens.weight", ("model", "embed_tokens", "embedding"), False)]
_FINAL = [("model.norm.weight", ("model", "norm", "weight"), False)]
_LM_HEAD = [("lm_head.weight", ("lm_head",), True)]
_L = "model.layers.{i}."
LAYERS_PATH = ("model", "layers")  # where the stacked [L, ...] layer params live
_NORMS = [
    (_L + "input_layernorm.weight", ("input_layernorm", "weight"), False),
    (_L + "post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), False),
]
_ATTN = [
    (_L + f"self_attn.{n}_proj.weight", ("self_attn", f"{n}_proj", "kernel"), True)
    for n in ("q", "k", "v", "o")
]
_QKV_BIAS = [
    (_L + f"self_attn.{n}_proj.bias", ("self_attn", f"{n}_proj", "bias"), False)
    for n in ("q", "k", "v")
]
_QK_NORM = [
    (_L + f"self_attn.{n}_norm.weight", ("self_attn", f"{n}_norm", "weight"), False)
    for n in ("q", "k")
]
_MLP = [
    (_L + f"mlp.{n}_proj.weight", ("mlp", f"{n}_proj", "kernel"), True)
    for n in ("gate", "up", "down")
]
# Per-architecture layer tables (HF modeling_qwen2 / modeling_qwen3 / modeling_llama).
# Qwen2 always has q/k/v biases; Llama and Qwen3 get them only with `attention_bias`.
LAYER_NAME_MAPS: dict[str, list[tuple[str, tuple[str, ...], bool]]] = {
    "qwen2": _NORMS + _ATTN + _QKV_BIAS + _MLP,
    "qwen3": _NORMS + _ATTN + _QK_NORM + _MLP,
    "llama": _NORMS + _ATTN + _MLP,
}


class HFTensor(NamedTuple):
    """One HF tensor: `name` <-> `params[path]` (with `[layer]` on the leading axis of a stacked
    layer param, `layer` None otherwise), transposed ([out, in] <-> our [in, out]) or not."""

    name: str
    path: tuple[str, ...]
    layer: int | None
    transposed: bool


# Tensors some HF checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

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


def hf_name_map(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the model in HF order (embedding; layer 0's tensors, layer 1's, ...;
    final norm; LM head). Stacked layer params map to one HF name per layer."""
    rows = [HFTensor(hf, ours, None, t) for hf, ours, t in _EMBED]
    layer_rows = list(LAYER_NAME_MAPS[cfg.arch])
    if cfg.arch != "qwen2" and cfg.qkv_bias:
        layer_rows += _QKV_BIAS
    for i in range(cfg.num_layers):
        for hf, ours, transposed in layer_rows:
            rows.append(HFTensor(hf.format(i=i), (*LAYERS_PATH, *ours), i, transposed))
    rows += [HFTensor(hf, ours, None, t) for hf, ours, t in _FINAL]
    if not cfg.tie_word_embeddings:
        rows += [HFTensor(hf, ours, None, t) for hf, ours, t in _LM_HEAD]
    return rows


def _get(tree: Mapping[Any, Any], path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _hf_shape(row: HFTensor, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for a param of `param_shape` (stacked: [L, ...])."""
    shape = param_shape[1:] if row.layer is not None else param_shape
    return shape[::-1] if row.transposed else shape


@functools.partial(jax.jit, static_argnames=("transposed", "dtype"))
def _hf_tensor(x: jax.Array, layer: jax.Array | None, *, transposed: bool, dtype: Any) -> jax.Array:
    """One tensor in HF layout and `dtype`, made on the device(s) holding `x` into a fresh
    buffer: the layer slice and the cast (one elementwise pass), then the transpose. An
    optimization barrier keeps the transpose apart: XLA:CPU fuses a slice or a cast into a
    transpose as a slow elementwise loop (measured on a 768 x 3072 layer slice to bf16: 6.2 ms
    fused, 2.4 ms apart; the 100M model's bf16 fetch 0.25 -> ~0.1 s)."""
    y = x if layer is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
    y = y.astype(dtype)
    if transposed:
        y = jax.lax.optimization_barrier(y).T
    return jnp.copy(y) if y is x else y  # jit forwards an unchanged input as the same buffer


def iter_hf_state(
    cfg: ModelConfig, params: Params, *, dtype: Any = np.float32, prefetch: int = 2
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, numpy array in HF layout) one tensor at a time, in `hf_name_map` order.

    Each tensor is made on the device(s) holding it (layer slice, transpose to HF layout, cast
    to `dtype`: float32, or bfloat16 for a bf16 weight push, which then fetches half the bytes)
    and only the result is fetched, so host memory holds one tensor (the caller decides what to
    keep). The programs of the next `prefetch` tensors are dispatched before a tensor is
    fetched, so the devices make them while the caller writes this one (JAX dispatches
    asynchronously; measured on the 100M model's bf16 push, 2 cores: 0.215 -> 0.157 s); the
    devices hold at most `prefetch` + 1 tensors beyond the params. The result is a fresh device
    buffer: on CPU `device_get` is zero-copy and the array caches that numpy view, so fetching
    the caller's own buffer (embedding, final norm) would leave it undonatable, and the
    trainer's next update would copy it (measured: the 0.6 GB qwen3_0.6b embedding)."""
    pure = nnx.to_pure_dict(params)
    dtype = jnp.dtype(dtype)
    made = (
        (
            row.name,
            _hf_tensor(
                _get(pure, row.path),
                # A host scalar: jnp.int32 would run a device program of its own per tensor
                # (measured: 0.03 s of the 100M model's 0.15 s bf16 fetch).
                None if row.layer is None else np.int32(row.layer),
                transposed=row.transposed,
                dtype=dtype,
            ),
        )
        for row in hf_name_map(cfg)
    )
    for name, y in _ahead(made, prefetch):
        yield name, np.asarray(host_array(y))  # a collective across processes


def _ahead(items: Iterator[Any], n: int) -> Iterator[Any]:
    """The items of `items` in order, each taken from it `n` items before it is handed on (so
    the work that makes them, e.g. a dispatched device program, runs ahead of the consumer)."""
    queue: collections.deque[Any] = collections.deque()
    for item in items:
        queue.append(item)
        if len(queue) > n:
            yield queue.popleft()
    yield from queue


def to_hf_state_dict(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Params -> {HF name: float32 numpy array in HF layout ([out, in] for linears)}."""
    return dict(iter_hf_state(cfg, params))


def from_hf_state_dict(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    source: str | Mapping[str, str] = "state dict",
    shardings: Any = None,
    keep_dtype: bool = False,
) -> Params:
    """{HF name: array} -> params (`cfg.param_dtype`, layers stacked [L, ...]). Missing,
    unexpected or mis-shaped tensors raise a ValueError naming the tensor, the expected and
    found shapes and the file (`source`: a description, or {HF name: file} when loading a
    folder).

    `shardings`: None (default device), or a pytree like the params of `jax.sharding.Sharding`s
    (e.g. `models.sharding.param_shardings`): each array is then assembled shard by shard
    (`jax.make_array_from_callback`), so no device ever holds an unsharded copy.
    `keep_dtype`: keep each tensor's own dtype (bf16, FP8 codes) instead of `cfg.param_dtype`.
    """
    _, abstract = abstract_model(cfg)
    pure = nnx.to_pure_dict(abstract)
    by_path: dict[tuple[str, ...], list[HFTensor]] = {}
    for row in hf_name_map(cfg):
        want_hf = _hf_shape(row, tuple(_get(pure, row.path).shape))
        if row.name not in tensors:
            raise ValueError(
                f"{_all_sources(source)}: tensor {row.name!r} is missing (expected shape "
                f"{want_hf} for {cfg.arch}, tie_word_embeddings={cfg.tie_word_embeddings}, "
                f"qkv_bias={cfg.qkv_bias}); check config.json against the weights"
            )
        found = tuple(np.shape(tensors[row.name]))
        if found != want_hf:
            raise ValueError(
                f"{_source_of(source, row.name)}: tensor {row.name!r} has shape {found}, "
                f"expected {want_hf} (HF layout) from config.json"
            )
        by_path.setdefault(row.path, []).append(row)
    expected_names = {row.name for rows in by_path.values() for row in rows}
    unexpected = [
        n
        for n in tensors
        if n not in expected_names
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    ]
    if unexpected:
        raise ValueError(
            f"{_all_sources(source)}: {len(unexpected)} unexpected tensor(s), e.g. {sorted(unexpected)[:5]}; "
            f"the checkpoint does not match arch={cfg.arch!r} with {cfg.num_layers} layers"
        )
    pure_shardings = None if shardings is None else nnx.to_pure_dict(shardings)
    for path, rows in by_path.items():
        leaf = _get(pure, path)
        sharding = None if pure_shardings is None else _get(pure_shardings, path)
        dtype = np.asarray(tensors[rows[0].name]).dtype if keep_dtype else cfg.param_dtype
        _set(pure, path, _assemble(rows, tensors, leaf.shape, dtype, sharding))
    nnx.replace_by_pure_dict(abstract, pure)
    return abstract


def _assemble(
    rows: list[HFTensor],
    tensors: Mapping[str, np.ndarray],
    shape: tuple[int, ...],
    dtype: Any,
    sharding: Any,
) -> jax.Array:
    """One param from its HF tensor(s): transposed back, stacked over layers when `rows` are the
    L layers of a stacked param, cast to `dtype` (via f32), placed by `sharding`."""

    def block(index: tuple[slice, ...]) -> np.ndarray:
        # The [index] block of the param, built from only the HF tensors it touches.
        def ours(row: HFTensor) -> np.ndarray:
            x = np.asarray(tensors[row.name])
            return x.T if row.transposed else x

        if rows[0].layer is None:
            x = ours(rows[0])[index]
        else:
            layer_ids = range(len(rows))[index[0]] if index else range(len(rows))
            x = np.stack([ours(rows[i])[index[1:]] for i in layer_ids])
        # Via f32 (exact from any float format); f32 -> bf16 rounds to nearest even, as jax.
        same = x.dtype == jnp.dtype(dtype)
        return x if same else x.astype(np.float32).astype(jnp.dtype(dtype))

    full = tuple(slice(None) for _ in shape)
    if sharding is None:
        return jnp.asarray(block(full))
    return jax.make_array_from_callback(shape, sharding, lambda index: block(index or full))


def _source_of(source: str | Mapping[str, str], name: str) -> str:
    """The file a tensor came from, when `source` maps names to files."""
    if isinstance(source, Mapping):
        return str(source.get(name, "checkpoint"))
    return str(source)


def _all_sources(source: str | Mapping[str, str]) -> str:
    if isinstance(source, Mapping):
        return ", ".join(sorted(set(source.values()))) or "checkpoint"
    return str(source)


# ----------------------------------------------------------------------------------------------
# safetensors reading (header: u64 little-endian length, JSON {name: {dtype, shape,
# data_offsets}}, then the raw little-endian data)
# ----------------------------------------------------------------------------------------------


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
    # done: wait, so the mapped pages (the whole file: 2.3 GB for qwen3_0.6b, measured) leave
    # the resident set before the caller allocates the optimizer state.
    jax.block_until_ready(params)
    return cfg, graphdef, params


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
    failed write: `jfp8rl.distributed.consume_on_main`) and each shard is written as soon as
    it is full, so host memory holds at most one shard (5 GiB by default), not the model."""
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
    # Shards are written under temporary names (not *.safetensors, so a reader never takes a
    # half-saved folder's shards) and renamed once their count is known.
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush(shard: dict[str, np.ndarray]) -> None:
        path = folder / f"model.partial-{len(written):05d}"
        save_file(shard, str(path), metadata=meta)
        written.append((path, list(shard)))

    for name, x in iter_hf_state(cfg, params) if tensors is None else tensors:
        if shard and size + x.nbytes > max_shard_bytes:
            flush(shard)
            shard, size = {}, 0
        shard[name] = x
        size += x.nbytes
        total += x.nbytes
    flush(shard)
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


def random_hf_state_dict(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random HF-layout float32 weights from numpy's legacy `RandomState` (its stream is frozen
    across numpy versions), so golden fixtures store a seed instead of weights.

    Weights ~ N(0, 0.02) (linears, embeddings), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.02);
    filled in the order of `hf_name_map`.
    """
    _, abstract = abstract_model(cfg)
    pure = nnx.to_pure_dict(abstract)
    rng = np.random.RandomState(seed)
    out: dict[str, np.ndarray] = {}
    for row in hf_name_map(cfg):
        shape = _hf_shape(row, tuple(_get(pure, row.path).shape))
        if row.name.endswith("norm.weight"):
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            x = 0.02 * rng.standard_normal(shape)
        out[row.name] = x.astype(np.float32)
    return out
