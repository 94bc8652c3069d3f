"""Weight export: HF-named float32 masters -> rollout format -> safetensors in shared memory.

Formats (`fmt`):
  "fp32"      every tensor as float32 (a CPU fp32 server matches the trainer to float rounding).
  "bf16"      every tensor rounded to bfloat16 (round to nearest even; verl's default).
  "fp8"       block-FP8 checkpoint format (DeepSeek-V3 / Qwen3-FP8, docs/rollout.md section 6): each
              decoder linear weight W [out, in] becomes an e4m3 `<name>` = q and an f32
              `<name minus .weight>.weight_scale_inv` = s [ceil(out/B), ceil(in/B)], with
              W ~= q * s per B x B block (s = amax / 448), B = 128; embeddings, norms, biases
              and the LM head stay bf16. The manifest carries `quantization_config`
              {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
              for the server's config.json, which a vLLM server started with
              `vllm_layout.serve_flags("fp8")` declares. For GPU servers (vLLM's CPU build
              has block-FP8 kernels only for CPUs with AMX tiles).
  "fp8_fp32"  the same FP8 values dequantized to float32 (q * s): what a CPU server can load
              while still computing with exactly the trainer's FP8 weights.

FP8 KV-cache scales (`model.layers.<l>.self_attn.k_scale` / `v_scale`,
`rollout_bridge.weights.kv_scales`) pass through every format as f32 scalars.

q and s come from `models.fp8.quantize_weight`, the quantizer the training forward uses, so
the server holds bit-for-bit the trainer's FP8 weights. The conversions run in JAX; the bytes
are written by `rollout_bridge.weights` (jax-free, shared with the vLLM plugin).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8
from rollout_bridge.backend import HFTensors
from rollout_bridge.vllm_layout import fp8_quantization_config
from rollout_bridge.weights import ExportError
from rollout_bridge.weights.kv_scales import is_kv_scale
from rollout_bridge.weights.store import default_root, write_export

ExportFormat = Literal["fp32", "bf16", "fp8", "fp8_fp32"]
EXPORT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp8", "fp8_fp32")
FP8_BLOCK_SIZE = 128
# Decoder linears only: the embedding / LM head stay high precision as in DeepSeek-V3 and
# Qwen3-FP8 checkpoints, and vLLM's Fp8LinearMethod only covers these layers. An MoE layer's
# experts are FP8 one [out, in] weight per expert (as Qwen3-MoE FP8 checkpoints hold them and
# vLLM's Fp8MoEMethod loads them; Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`), and so is
# a shared expert (Qwen2-MoE); its router (`mlp.gate`) and shared expert's gate stay high
# precision.
_FP8_LINEAR = re.compile(
    r"^model\.layers\.\d+\.((self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert)\.\w+_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the HF tensor `name` is a decoder linear weight that the FP8 format quantizes."""
    return len(shape) == 2 and _FP8_LINEAR.match(name) is not None


@functools.cache
def _fp8_quantizer(block_size: int):
    """jit(models.fp8.quantize_weight) for the block recipe: W [out, in] -> (q e4m3, s f32)."""
    recipe = fp8.get_recipe("fp8_block", block_size=block_size)
    return jax.jit(functools.partial(fp8.quantize_weight, recipe=recipe))


@functools.cache
def _fp8_dequantizer(block_size: int):
    """jit(q, s -> q * s) per block, by `models.fp8.dequantize` with the weight's tile."""
    recipe = fp8.get_recipe("fp8_block", block_size=block_size)
    return jax.jit(functools.partial(fp8.dequantize, tile=fp8.weight_tile(recipe)))


@functools.cache
def _bf16_converter():
    """jit(f32 -> bf16), round to nearest even (as ml_dtypes' astype)."""
    return jax.jit(lambda w: w.astype(jnp.bfloat16))


def fetch_dtype(fmt: ExportFormat) -> str:
    """The dtype to fetch trainer params in for a push in `fmt` (the `dtype` of
    `models.hf_io.iter_hf_state`): "bfloat16" for a bf16 push, which is then rounded on the
    trainer's devices and moves half the bytes to the host; "float32" otherwise (the FP8
    quantizer and the fp32 format need the float32 masters)."""
    return "bfloat16" if fmt == "bf16" else "float32"


def iter_rollout_format(
    hf_state: HFTensors, fmt: ExportFormat, *, block_size: int = FP8_BLOCK_SIZE
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, numpy array) of the rollout format, one converted tensor at a time.

    Conversions run in JAX (on the device holding a jax array; numpy input goes to the
    default device): bf16 rounding and FP8 quantization there, then the result is fetched,
    so a trainer on a GPU moves half (bf16) or a quarter (fp8) of the f32 bytes."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {EXPORT_FORMATS}")
    items = hf_state.items() if isinstance(hf_state, Mapping) else hf_state
    for name, value in items:
        if is_kv_scale(name):  # FP8 KV-cache scales stay f32 scalars in every format
            yield name, np.asarray(value, dtype=np.float32).reshape(())
            continue
        if fmt == "fp32":
            yield name, np.asarray(value, dtype=np.float32)
            continue
        if fmt == "bf16" and getattr(value, "dtype", None) == jnp.bfloat16:
            yield name, np.asarray(value)  # made bf16 where it lives (`fetch_dtype`)
            continue
        w = jnp.asarray(value, dtype=jnp.float32)
        if fmt == "bf16" or not is_fp8_linear(name, w.shape):
            yield name, np.asarray(_bf16_converter()(w) if fmt != "fp8_fp32" else w)
            continue
        q, s = _fp8_quantizer(block_size)(w)
        if fmt == "fp8":
            yield name, np.asarray(q)
            yield name.removesuffix(".weight") + ".weight_scale_inv", np.asarray(s, np.float32)
        else:
            yield name, np.asarray(_fp8_dequantizer(block_size)(q, s), dtype=np.float32)


def to_rollout_format(
    hf_state: HFTensors, fmt: ExportFormat, *, block_size: int = FP8_BLOCK_SIZE
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Converts HF-named weights ([out, in] linears, any float dtype) to the rollout format.

    Returns ({name: numpy array}, quantization_config or None). See the module docstring;
    `export_weights` streams `iter_rollout_format` instead of holding this dict."""
    out = dict(iter_rollout_format(hf_state, fmt, block_size=block_size))
    return out, (fp8_quantization_config(block_size) if fmt == "fp8" else None)


def export_weights(
    hf_state: HFTensors,
    version: str,
    *,
    fmt: ExportFormat = "bf16",
    root: str | Path | None = None,
    keep: int = 2,
    block_size: int = FP8_BLOCK_SIZE,
    hash_name: str | None = None,
) -> Path:
    """Converts `hf_state` to `fmt` and writes it as version `version` under `root`.

    Args:
      hf_state: {HF name: array}, or (name, array) pairs read once (e.g.
        `models.hf_io.iter_hf_state(cfg, params)`: one tensor fetched at a time).
      version: the weight version label, also the folder name (e.g. "step-12").
      fmt: "fp32" | "bf16" | "fp8" | "fp8_fp32" (module docstring).
      root: export root; default `weights.store.default_root()` (/dev/shm/jfp8rl/run-<pid>).
      keep: how many versions to keep (older ones are deleted after the write).
      hash_name: the per-tensor digest (`weights.hashing.HASHES`; default
        `weights.hashing.default_hash()`, xxh3_128).

    Returns:
      The complete version folder; pass it to `weights.reader.load_export` or to a server's
      update route.
    """
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {EXPORT_FORMATS}")
    return write_export(
        Path(root) if root is not None else default_root(),
        version,
        iter_rollout_format(hf_state, fmt, block_size=block_size),
        fmt=fmt,
        quantization_config=fp8_quantization_config(block_size) if fmt == "fp8" else None,
        keep=keep,
        hash_name=hash_name,
    )
