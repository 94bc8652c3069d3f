"""Hopper (sm90) kernels for the block recipe, `Recipe(backend="pallas")`.

- `gemm`: the block-scaled FP8 NT GEMM in Pallas Mosaic GPU (wgmma per 128-wide K block into
  a zeroed f32 accumulator, promoted into the f32 result with the two operands' scales; two
  compute warpgroups + one TMA warpgroup; the interpreter runs it on CPU).
- `block_matmul`: fprop, dgrad and wgrad of the block recipe on that GEMM; quantization and the
  transposed FP8 copies stay in XLA.
- `grouped_gemm`: the same GEMM in the two grouped forms of Mixture-of-Experts layers (rows
  sorted by expert, laid out in whole row tiles per expert): each row tile times its expert's
  weight (fprop, dgrad), and per expert a contraction over its own tokens (wgrad).
- `grouped_block_matmul`: `grouped_dot`'s fprop, dgrad and wgrad on those kernels.

Import the submodules directly (`from models.fp8.kernels import gemm`).
"""
