"""FP8 recipes: how the linear layers' GEMMs quantize their operands, and the preset registry.

`RECIPES` maps each preset name to its `Recipe`; it is the one list of recipe names (configs
validate against it). `get_recipe` returns a preset, optionally with fields overridden.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Format = Literal["e4m3", "e5m2"]
Granularity = Literal["tensor", "row", "block"]
Role = Literal["act", "weight", "grad"]
Backend = Literal["emulate", "pallas"]

FP8_DTYPES: dict[str, jnp.dtype] = {
    "e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "e5m2": jnp.dtype(jnp.float8_e5m2),
}
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
BACKENDS: tuple[str, ...] = ("emulate", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """How the linear layers' GEMMs are computed. Hashable: pass it as a static jit argument.

    Attributes:
      name: label used in logs and configs.
      fwd_format: format of activations and weights in every GEMM; None = no quantization
        (plain `dot_general` in the compute dtype: the BF16 baseline).
      bwd_format: format of the output gradient in the dgrad and wgrad GEMMs.
      act_granularity: tiles of activations ("tensor" | "row" | "block").
      weight_granularity: tiles of weights.
      grad_granularity: tiles of output gradients.
      block_size: B of the 1 x B and B x B tiles.
      pow2_scales: round scales up to powers of two (UE8M0).
      backend: "emulate" (f32 dot of dequantized operands) or "pallas" (the Hopper kernel of
        `models.fp8.kernels`; block recipe with block_size 128 only; Mosaic GPU interpreter
        off a GPU).
      prequantized_weights: the weights given to the forward already hold their FP8 values
        (`fake_quantize_weight`, done once when they arrive: the rollout engine); the emulated
        forward then skips quantizing them, with the same result. Inference only.
    """

    name: str
    fwd_format: Format | None = "e4m3"
    bwd_format: Format = "e4m3"
    act_granularity: Granularity = "block"
    weight_granularity: Granularity = "block"
    grad_granularity: Granularity = "block"
    block_size: int = 128
    pow2_scales: bool = False
    backend: Backend = "emulate"
    prequantized_weights: bool = False

    def __post_init__(self) -> None:
        for field in ("act_granularity", "weight_granularity", "grad_granularity"):
            if getattr(self, field) not in GRANULARITIES:
                raise ValueError(
                    f"Recipe {self.name!r}: {field}={getattr(self, field)!r}; "
                    f"expected one of {GRANULARITIES}"
                )
        for field in ("fwd_format", "bwd_format"):
            value = getattr(self, field)
            if value is not None and value not in FP8_DTYPES:
                raise ValueError(
                    f"Recipe {self.name!r}: {field}={value!r}; expected 'e4m3' or 'e5m2'"
                )
        if self.prequantized_weights and self.backend != "emulate":
            raise ValueError(f"Recipe {self.name!r}: prequantized_weights needs backend='emulate'")
        if self.block_size < 1:
            raise ValueError(f"Recipe {self.name!r}: block_size must be >= 1")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"Recipe {self.name!r}: backend={self.backend!r}; expected one of {BACKENDS}"
            )
        grans = (self.act_granularity, self.weight_granularity, self.grad_granularity)
        if (
            self.backend == "pallas"
            and self.quantized
            and (grans != ("block",) * 3 or self.block_size != 128)
        ):
            raise ValueError(
                f"Recipe {self.name!r}: backend='pallas' runs the block recipe only (act, "
                f"weight and grad granularity 'block', block_size 128), got granularities "
                f"{grans} and block_size {self.block_size}; use backend='emulate' for this "
                f"recipe, or get_recipe('fp8_block', backend='pallas')"
            )

    @property
    def quantized(self) -> bool:
        return self.fwd_format is not None


BF16 = Recipe(name="bf16", fwd_format=None)
FP8_TENSOR = Recipe(
    name="fp8_tensor",
    act_granularity="tensor",
    weight_granularity="tensor",
    grad_granularity="tensor",
)
FP8_ROW = Recipe(
    name="fp8_row", act_granularity="row", weight_granularity="row", grad_granularity="row"
)
FP8_BLOCK = Recipe(name="fp8_block")
# The preset recipes by name: the registry of recipe names.
RECIPES: dict[str, Recipe] = {r.name: r for r in (BF16, FP8_TENSOR, FP8_ROW, FP8_BLOCK)}


def get_recipe(name: str, **overrides: object) -> Recipe:
    """A preset recipe by name (a key of `RECIPES`), with optional field overrides, e.g.
    `get_recipe("fp8_block", bwd_format="e5m2", pow2_scales=True)`."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose one of {sorted(RECIPES)}")
    return dataclasses.replace(RECIPES[name], **overrides) if overrides else RECIPES[name]
