"""HF tensor names <-> the model's params: one explicit name map per architecture.

Tensors in HF layout are [out, in]; our `Linear.kernel` is [in, out] and our untied `lm_head`
is [D, V], so those are transposed both ways; everything else is copied as is. Layer params are
stacked on a leading layer axis ([L, ...]) and map to one HF tensor per layer; an MoE layer's
expert weights are stacked on a second axis ([L, E, ...]) and map to one HF tensor per layer
and expert (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, as Qwen3-MoE and Qwen2-MoE
checkpoints and vLLM's loader lay them out; Mixtral's are
`model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight`). Files and
folders are `models.hf_io`'s concern; this module converts between in-memory state dicts
({HF name: numpy array}) and params.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.functional import Params, abstract_model
from models.sharding import host_array

# One row per tensor kind: (HF name with {i} for the layer and {e} for the expert, our path,
# transposed?). Layer paths are relative to `model.layers`, whose params are stacked on a leading
# layer axis (and the experts' on a second, expert axis).
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
# Qwen3-MoE's sparse MLP: the router and each expert's SwiGLU (HF modeling_qwen3_moe).
_MOE = [(_L + "mlp.gate.weight", ("mlp", "gate", "kernel"), True)] + [
    (_L + f"mlp.experts.{{e}}.{n}_proj.weight", ("mlp", "experts", f"{n}_proj"), True)
    for n in ("gate", "up", "down")
]
# Qwen2-MoE's shared expert (a SwiGLU every token goes through) and its sigmoid gate [1, D].
_SHARED = [
    (_L + f"mlp.shared_expert.{n}_proj.weight", ("mlp", "shared_expert", f"{n}_proj", "kernel"),
     True)
    for n in ("gate", "up", "down")
] + [(_L + "mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), True)]  # fmt: skip
# Mixtral's names for the same router and experts: w1 the gate, w3 the up, w2 the down proj.
_MIXTRAL_MOE = [(_L + "block_sparse_moe.gate.weight", ("mlp", "gate", "kernel"), True)] + [
    (_L + f"block_sparse_moe.experts.{{e}}.{w}.weight", ("mlp", "experts", f"{n}_proj"), True)
    for w, n in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
]
# Per-architecture layer tables (HF modeling_qwen2 / qwen3 / qwen3_moe / qwen2_moe / mixtral /
# llama). Qwen2 always has q/k/v biases; Qwen2-MoE with `qkv_bias` (default true), Llama and
# Qwen3 with `attention_bias` (`hf_name_map` adds them).
LAYER_NAME_MAPS: dict[str, list[tuple[str, tuple[str, ...], bool]]] = {
    "qwen2": _NORMS + _ATTN + _QKV_BIAS + _MLP,
    "qwen3": _NORMS + _ATTN + _QK_NORM + _MLP,
    "qwen3_moe": _NORMS + _ATTN + _QK_NORM + _MOE,
    "qwen2_moe": _NORMS + _ATTN + _MOE + _SHARED,
    "mixtral": _NORMS + _ATTN + _MIXTRAL_MOE,
    "llama": _NORMS + _ATTN + _MLP,
}


class HFTensor(NamedTuple):
    """One HF tensor: `name` <-> `params[path]` (with `[layer]` on the leading axis of a stacked
    layer param, `layer` None otherwise, and `[layer, expert]` for an MoE expert's weight),
    transposed ([out, in] <-> our [in, out]) or not. `layer` is the index in the param's stack:
    the layer's own, but in a mixed model's MLP stacks its `cfg.mlp_slots` entry."""

    name: str
    path: tuple[str, ...]
    layer: int | None
    transposed: bool
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """The leading indices of the param this tensor is a slice of: (), (layer,) or
        (layer, expert)."""
        if self.layer is None:
            return ()
        return (self.layer,) if self.expert is None else (self.layer, self.expert)


# Tensors some HF checkpoints carry that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name_map(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the model in HF order (embedding; layer 0's tensors, layer 1's, ...;
    final norm; LM head). Stacked layer params map to one HF name per layer."""
    rows = [HFTensor(hf, ours, None, t) for hf, ours, t in _EMBED]
    layer_rows = list(LAYER_NAME_MAPS[cfg.arch])
    if cfg.arch != "qwen2" and cfg.qkv_bias:
        layer_rows += _QKV_BIAS
    # A mixed model's dense layers hold a dense MLP (HF `mlp.*_proj`) in the `dense_mlp` stack;
    # its MLP params are indexed by the layer's slot in its kind's stack (`cfg.mlp_slots`).
    dense_rows = [r for r in layer_rows if r[1][0] != "mlp"]
    dense_rows += [(hf, ("dense_mlp", *ours[1:]), t) for hf, ours, t in _MLP]
    for i, (sparse, slot) in enumerate(zip(cfg.sparse_layers, cfg.mlp_slots, strict=True)):
        for hf, ours, transposed in layer_rows if sparse or not cfg.is_mixed else dense_rows:
            path = (*LAYERS_PATH, *ours)
            index = slot if ours[0] in ("mlp", "dense_mlp") else i
            if "{e}" not in hf:
                rows.append(HFTensor(hf.format(i=i), path, index, transposed))
                continue
            for e in range(cfg.num_experts):
                rows.append(HFTensor(hf.format(i=i, e=e), path, index, transposed, e))
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
    """The HF tensor's shape for a param of `param_shape` (stacked: [L, ...] or [L, E, ...])."""
    shape = param_shape[len(row.index) :]
    return shape[::-1] if row.transposed else shape


def hf_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape in HF layout) of every tensor of the model, in `hf_name_map` order (no
    weights made: the shapes come from the abstract model)."""
    pure = nnx.to_pure_dict(abstract_model(cfg)[1])
    return [
        (row.name, _hf_shape(row, tuple(_get(pure, row.path).shape))) for row in hf_name_map(cfg)
    ]


@functools.partial(jax.jit, static_argnames=("transposed", "dtype"))
def _hf_tensor(
    x: jax.Array, index: tuple[jax.Array, ...], *, transposed: bool, dtype: Any
) -> jax.Array:
    """One tensor in HF layout and `dtype`, made on the device(s) holding `x` into a fresh
    buffer: the slice `x[index]` (layer, expert) and the cast (one elementwise pass), then the
    transpose. An
    optimization barrier keeps the transpose apart: XLA:CPU fuses a slice or a cast into a
    transpose as an elementwise loop that is slower than the two passes apart (the export stage
    of `benchmarks/weight_sync.py` includes this fetch)."""
    y = x
    for i in index:
        y = jax.lax.dynamic_index_in_dim(y, i, keepdims=False)
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
    asynchronously); the devices hold at most `prefetch` + 1 tensors beyond the params. The
    result is a fresh device buffer: on CPU `device_get` is zero-copy and the array caches that
    numpy view, so fetching the caller's own buffer (embedding, final norm) would leave it
    undonatable, and the trainer's next update would copy it."""
    pure = nnx.to_pure_dict(params)
    dtype = jnp.dtype(dtype)
    made = (
        (
            row.name,
            _hf_tensor(
                _get(pure, row.path),
                # Host scalars: jnp.int32 would run a device program of its own per tensor.
                tuple(np.int32(i) for i in row.index),
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
            f"{_all_sources(source)}: {len(unexpected)} unexpected tensor(s), e.g. "
            f"{sorted(unexpected)[:5]}; the checkpoint does not match arch={cfg.arch!r} with {cfg.num_layers} layers"
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
    """One param from its HF tensor(s): transposed back, stacked over layers (and experts) when
    `rows` are the L (x E) slices of a stacked param, cast to `dtype` (via f32), placed by
    `sharding`."""

    def block(index: tuple[slice, ...]) -> np.ndarray:
        # The [index] block of the param, built from only the HF tensors it touches.
        def ours(row: HFTensor) -> np.ndarray:
            x = np.asarray(tensors[row.name])
            return x.T if row.transposed else x

        lead = len(rows[0].index)
        if lead == 0:
            x = ours(rows[0])[index]
        else:
            # rows in (layer, expert) order: the [L, E] grid of slices, cut to `index`.
            by_index = {r.index: r for r in rows}
            ids = [range(n)[index[a]] if index else range(n) for a, n in enumerate(shape[:lead])]
            rest = index[lead:]
            grid = np.empty([len(r) for r in ids], dtype=object)
            for pos in np.ndindex(*grid.shape):
                key = tuple(ids[a][p] for a, p in enumerate(pos))
                grid[pos] = ours(by_index[key])[rest]
            x = np.stack([grid[pos] for pos in np.ndindex(*grid.shape)]).reshape(
                *grid.shape, *grid.flat[0].shape
            )
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


def random_hf_state_dict(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random HF-layout float32 weights from numpy's legacy `RandomState` (its stream is frozen
    across numpy versions), so golden fixtures store a seed instead of weights.

    Weights ~ N(0, 0.02) (linears, embeddings), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.02);
    filled in the order of `hf_name_map`.
    """
    rng = np.random.RandomState(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in hf_shapes(cfg):
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            x = 0.02 * rng.standard_normal(shape)
        out[name] = x.astype(np.float32)
    return out
