"""Which export formats a vLLM server's linear layers can take, and the `vllm serve` flags that
make a server take each one.

The formats of `rollout_bridge.export` fall in two layouts:
  - high precision (`fp32`, `bf16`, `fp8_fp32`): one float tensor per linear weight. vLLM's
    unquantized layers load it as is; layers that vLLM quantizes online (`--quantization
    fp8_per_tensor`, `fp8_per_channel`, `fp8_per_block`, and the older `--quantization fp8` on a
    checkpoint without a `quantization_config`, which vLLM 0.32 treats as `fp8_per_tensor`)
    quantize it themselves after each load.
  - block FP8 (`fp8`): per linear an e4m3 `weight` and an f32 `weight_scale_inv` per B x B
    block. Only vLLM's FP8 checkpoint layers (`Fp8Config` with `weight_block_size: [B, B]`)
    hold these tensors, and only with the same B: the scales are indexed by block.

Any other pairing loads wrong numbers rather than failing: high-precision values cast into
e4m3 parameters without scales, or e4m3 values and block scales fed to layers that expect
something else. `check_export_layout` refuses such a push from the manifest alone, before the
plugin reads a tensor. `serve_flags` gives the flags that serve each layout: for block FP8
vLLM's FP8 checkpoint config passed with `--hf-overrides` (the base policy's checkpoint is
BF16 and declares none) and `--load-format dummy`, because vLLM would otherwise cast that BF16
checkpoint into the FP8 parameters without scales; the trainer pushes its weights before the
first rollout (`step-0`), so the placeholder weights never serve a request.

Imports neither jax nor (at module level) vllm: the plugin runs it inside vLLM's venv, the
trainer and the launch docs use `serve_flags`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from rollout_bridge.weights import ExportError

HIGH_PRECISION_FORMATS = ("fp32", "bf16", "fp8_fp32")
BLOCK_FP8_FORMAT = "fp8"


def fp8_quantization_config(block_size: int) -> dict[str, Any]:
    """The `quantization_config` of a block-FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 style), as
    its config.json declares it and as `--hf-overrides` hands it to vLLM."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block_size, block_size],
    }


def serve_flags(fmt: str, block_size: int = 128) -> list[str]:
    """The `vllm serve` arguments whose linear layers take exports in `fmt` (module docstring):
    none for the high-precision formats, vLLM's block-FP8 checkpoint layers for `fp8`."""
    if fmt in HIGH_PRECISION_FORMATS:
        return []
    if fmt != BLOCK_FP8_FORMAT:
        raise ExportError(
            f"unknown export format {fmt!r}; choose one of "
            f"{(*HIGH_PRECISION_FORMATS, BLOCK_FP8_FORMAT)}"
        )
    overrides = {"quantization_config": fp8_quantization_config(block_size)}
    return ["--quantization", "fp8", "--load-format", "dummy",
            "--hf-overrides", json.dumps(overrides)]  # fmt: skip


def serve_flags_text(fmt: str, block_size: int = 128) -> str:
    """`serve_flags` as one shell-quoted line (what the docs and config headers show)."""
    return shlex.join(serve_flags(fmt, block_size))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One side's weight layout: `kind` is "high" (float weights), "block_fp8" (e4m3 + scale
    per `block`), or "other" (`name` says which vLLM quantization: nothing we export fits)."""

    kind: str
    block: tuple[int, int] | None = None
    name: str = ""

    def __str__(self) -> str:
        if self.kind == "block_fp8" and self.block is not None:
            b = f"{self.block[0]}x{self.block[1]}"
            return f"block FP8 {b} (e4m3 weight + f32 weight_scale_inv per {b} block)"
        if self.kind == "high":
            return self.name or "high-precision float weights"
        return self.name


def export_layout(manifest: dict[str, Any]) -> Layout:
    """The layout of an export from its manifest's `format` and `quantization_config`."""
    fmt = manifest.get("format")
    if fmt in HIGH_PRECISION_FORMATS:
        return Layout("high", name=f"{fmt} (one float tensor per linear weight)")
    qc = manifest.get("quantization_config") or {}
    block = qc.get("weight_block_size")
    if fmt != BLOCK_FP8_FORMAT or not (isinstance(block, list) and len(block) == 2):
        raise ExportError(
            f"manifest format {fmt!r} with quantization_config {qc!r} is no export format of "
            "this version; export with the same jfp8rl version as the server"
        )
    return Layout("block_fp8", block=(int(block[0]), int(block[1])))


def served_layout(quant_config: Any) -> Layout:
    """The layout of vLLM's linear layers from `vllm_config.quant_config`: None (unquantized),
    vLLM's online quantization (it quantizes float weights itself), `Fp8Config` (FP8
    checkpoint layers, block or per tensor) or any other method."""
    if quant_config is None:
        return Layout("high", name="unquantized (float weights)")
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config  # vLLM's venv only
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    if isinstance(quant_config, OnlineQuantizationConfig):
        return Layout("high", name="quantized online by vLLM from float weights")
    if isinstance(quant_config, Fp8Config):
        block = quant_config.weight_block_size
        if block is not None:
            return Layout("block_fp8", block=(int(block[0]), int(block[1])))
        return Layout("other", name="per-tensor FP8 checkpoint (e4m3 weight + weight_scale)")
    return Layout("other", name=f"quantized by vLLM's {quant_config.get_name()!r} method")


def _fix(export: Layout, served: Layout) -> str:
    """What to do when `export` does not fit `served`."""
    if export.kind == "block_fp8" and served.kind == "block_fp8":
        return (
            f"export with block size {served.block[0]} or restart vLLM with "
            f"`{serve_flags_text('fp8', export.block[0])}`"
        )
    if export.kind == "block_fp8":
        return (
            f"restart vLLM with `{serve_flags_text('fp8', export.block[0])}`, or set "
            "rollout.export_format: bf16 (fp8_fp32 on a CPU server)"
        )
    if served.kind == "block_fp8":
        return (
            f"set rollout.export_format: fp8 (block {served.block[0]}), or restart vLLM "
            "without the FP8 quantization_config (unquantized, or --quantization fp8_per_tensor)"
        )
    return (
        "restart vLLM unquantized, with an online method (--quantization fp8_per_tensor), or "
        f"with `{serve_flags_text('fp8')}` for rollout.export_format: fp8"
    )


def check_export_layout(path: Path, manifest: dict[str, Any], quant_config: Any) -> None:
    """Refuses (`ExportError`, naming both layouts and the fix) an export whose layout the
    served linear layers cannot take; returns quietly when they can."""
    export, served = export_layout(manifest), served_layout(quant_config)
    fits = (export.kind == "high" and served.kind == "high") or (
        export.kind == "block_fp8" and served.kind == "block_fp8" and export.block == served.block
    )
    if not fits:
        raise ExportError(
            f"{path} holds {export} but the server's linear layers are {served}; "
            f"{_fix(export, served)}"
        )
