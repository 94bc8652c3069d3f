"""Hopper (sm90) kernels for the block recipe, `Recipe(backend="pallas")`.

- `gemm`: the block-scaled FP8 NT GEMM in Pallas Mosaic GPU (wgmma per 128-wide K block into
  a zeroed f32 accumulator, promoted into the f32 result with the two operands' scales; two
  compute warpgroups + one TMA warpgroup; the interpreter runs it on CPU).
- `block_matmul`: fprop, dgrad and wgrad of the block recipe on that GEMM; quantization and the
  transposed FP8 copies stay in XLA.

Import the submodules directly (`from models.fp8.kernels import gemm`).
"""
