"""The embedded engine's weights: an export's tensors as model params, and the kernels the
forward multiplies with, made once per install.

`served_params` reads every tensor as exported (bf16 stays bf16; an FP8 linear is e4m3 codes +
f32 block scales). `install` then turns each decoder linear's kernel, once per install, into
the operand every forward would compute from it (`programs.install_kernels`): for an FP8
recipe the fake-quantized f32 values `Q(w)` (an FP8 linear first widened to `w = q * s`), for
the unquantized recipe the cast to the compute dtype. The forward then runs with
`prequantized_weights=True`, so a decode step only quantizes its activations, with the same
numbers bit for bit as quantizing the weights in every step. The cost is memory: installed
kernels take 4 bytes per weight (f32 holding FP8 values), which on CPU is faster than
dequantizing 1-byte codes in every decode step. The installed layers are held per layer
(`models.decoder.unstack_layers`; the kernels come out of `install_kernels` that way), so every
program runs them unrolled and each GEMM reads its layer's weights in place instead of a copy
sliced out of the stacked arrays at every step.

An FP8 linear pushed under the engine's own recipe (the same 128 x 128 blocks and format) is
installed as `q * s` as it is, the trainer's operand bit for bit. Re-quantizing it would not be
idempotent: the re-derived scale `fl(448 s) * (1/448)` can move s by one f32 ulp, so only a
push of another tiling or format is quantized again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8
from models.config import ModelConfig
from models.decoder import unstack_layers
from models.fp8 import Recipe
from models.hf_io import from_hf_state_dict, hf_name_map
from rollout_bridge.backend import RolloutError
from rollout_bridge.engine.programs import install_kernels
from rollout_bridge.export import is_fp8_linear

_SCALE_SUFFIX = ".weight_scale_inv"


def served_params(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    quantization_config: Mapping[str, Any] | None,
) -> Any:
    """The params of an export as exported, before `install`: every tensor in its exported
    dtype (bf16 stays bf16), and each FP8 `weight` + `weight_scale_inv` pair as a
    `models.fp8.StoredFP8Weight` (e4m3 codes [L, in, out] and f32 block scales
    [L, in/B, out/B], B from `quantization_config`; an MoE layer's experts [L, E, in, out] and
    [L, E, in/B, out/B]), which the model expands to w = q * s one
    layer at a time inside its layer scan. The values the model computes with are those of
    the f32 widening, so compact and dense give the same logits bit for bit."""
    scales = {n: x for n, x in tensors.items() if n.endswith(_SCALE_SUFFIX)}
    block = (quantization_config or {}).get("weight_block_size")
    if scales and not block:
        raise RolloutError(
            f"embedded: export holds {sorted(scales)[0]} but its manifest has no "
            "quantization_config.weight_block_size; re-export with fmt='fp8'"
        )
    plain = {n: x for n, x in tensors.items() if n not in scales}
    params = from_hf_state_dict(cfg, plain, source="export", keep_dtype=True)
    rows_by_path: dict[tuple[str, ...], list[Any]] = {}
    for row in hf_name_map(cfg):
        rows_by_path.setdefault(row.path, []).append(row)
    for path, rows in rows_by_path.items():
        names = [r.name.removesuffix(".weight") + _SCALE_SUFFIX for r in rows]
        if not any(n in scales for n in names):
            continue
        missing = [n for n in names if n not in scales]
        if missing or not all(r.transposed for r in rows):
            raise RolloutError(f"embedded: export lacks FP8 scales {missing[:3]} of {path}")
        # HF [out, in] blocks -> our [in, out] kernel: the scale grid transposes with it.
        s = np.stack([np.asarray(scales[n], np.float32).T for n in names])
        # rows in (layer, expert) order -> [L, ...] or [L, E, ...] (unstacked: one scale grid)
        lead = [max(r.index[a] for r in rows) + 1 for a in range(len(rows[0].index))]
        s = s.reshape(*lead, *s.shape[1:])
        leaf = node(params, path)
        # The tile of one layer's slice: an expert axis is tiled one expert at a time.
        tile = (1,) * (len(lead) - 1) + tuple(block)
        leaf.set_value(fp8.StoredFP8Weight(leaf.get_value(), jnp.asarray(s), tile))
    return params


def node(params: Any, path: tuple[str, ...]) -> Any:
    """The param variable at `path` (a `models.hf_io.hf_name_map` row's path)."""
    for key in path:
        params = params[key]
    return params


def kernel_paths(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """Param paths of the decoder linears' kernels (the GEMM weights of the recipe)."""
    rows = hf_name_map(cfg)
    return list(dict.fromkeys(r.path for r in rows if is_fp8_linear(r.name, (0, 0))))


def install(params: Any, cfg: ModelConfig, recipe: Recipe) -> Any:
    """A copy of `params` with the decoder kernels turned into their operand values and the
    layers held per layer (module docstring); the caller's params are kept."""
    params = jax.tree.map(lambda x: x, params)  # a new State
    nodes = [node(params, path) for path in kernel_paths(cfg)]
    kernels = install_kernels(
        [n.get_value() for n in nodes], recipe=recipe, dtype=cfg.compute_dtype
    )
    for leaf, k in zip(nodes, kernels, strict=True):
        leaf.set_value(k)
    return unstack_layers(params)
