"""FP8 numerics (docs/design.md section 3): recipes, quantization, and the FP8 `dot_general`.

- `recipe`: `Recipe`, the presets and their registry `RECIPES`, `get_recipe`.
- `quantization`: current per-tile scaling (the scaling rules), quantize / dequantize, GEMM
  operand tiles, FP8-stored weights.
- `matmul`: `fp8_dot_general` with its custom VJP (fprop, dgrad, wgrad), `make_dot_general`, and
  `RecipeDot` (a recipe's dense and grouped GEMMs, as the model's layers call them).
- `kernels`: the Hopper Pallas kernels of the block recipe (`backend="pallas"`).
- `grouped`: `grouped_dot`, the FP8 grouped GEMM of Mixture-of-Experts layers (tokens sorted by
  expert, one weight per expert; every expert's GEMMs quantized as the dense ones).

The public names of `recipe`, `quantization`, `matmul` and `grouped` are re-exported here:
`from models import fp8; fp8.quantize(...)`.
"""

from models.fp8.grouped import grouped_dot
from models.fp8.matmul import DimensionNumbers, RecipeDot, fp8_dot_general, make_dot_general
from models.fp8.quantization import (
    StoredFP8Weight,
    compute_scale,
    dense_weights,
    dequantize,
    fake_quantize,
    fake_quantize_operand,
    fake_quantize_weight,
    nonfinite_count,
    operand_tile,
    quantize,
    quantize_operand,
    quantize_weight,
    round_to_format,
    scale_shape,
    weight_tile,
)
from models.fp8.recipe import (
    BACKENDS,
    BF16,
    FP8_BLOCK,
    FP8_DTYPES,
    FP8_MAX,
    FP8_ROW,
    FP8_TENSOR,
    GRANULARITIES,
    RECIPES,
    Backend,
    Format,
    Granularity,
    Recipe,
    Role,
    get_recipe,
)

__all__ = [
    "BACKENDS",
    "BF16",
    "FP8_BLOCK",
    "FP8_DTYPES",
    "FP8_MAX",
    "FP8_ROW",
    "FP8_TENSOR",
    "GRANULARITIES",
    "RECIPES",
    "Backend",
    "DimensionNumbers",
    "Format",
    "Granularity",
    "Recipe",
    "RecipeDot",
    "Role",
    "StoredFP8Weight",
    "compute_scale",
    "dense_weights",
    "dequantize",
    "fake_quantize",
    "fake_quantize_operand",
    "fake_quantize_weight",
    "fp8_dot_general",
    "grouped_dot",
    "get_recipe",
    "make_dot_general",
    "nonfinite_count",
    "operand_tile",
    "quantize",
    "quantize_operand",
    "quantize_weight",
    "round_to_format",
    "scale_shape",
    "weight_tile",
]
