"""Hopper (sm90) kernels for `models.fp8`'s block recipe: `Recipe(backend="pallas")`.

- `gemm`: the block-scaled FP8 NT GEMM in Pallas Mosaic GPU (wgmma per 128-wide K block into
  a zeroed f32 accumulator, promoted into the f32 result with the two operands' scales; two
  compute warpgroups + one TMA warpgroup; the interpreter runs it on CPU).
- `block_matmul`: fprop, dgrad and wgrad of the block recipe on that GEMM; quantization and the
  transposed FP8 copies stay in XLA.

`models.fp8` imports this package lazily (only when a pallas recipe runs), because
`block_matmul` reuses `models.fp8`'s quantizer.
"""

from models.fp8_kernels.block_matmul import dgrad, fprop, wgrad
from models.fp8_kernels.gemm import DEFAULT_CONFIG, GemmConfig, scaled_matmul_nt

__all__ = ["DEFAULT_CONFIG", "GemmConfig", "dgrad", "fprop", "scaled_matmul_nt", "wgrad"]
