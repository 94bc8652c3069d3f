"""The block-scaled FP8 "NT" GEMM on Hopper, written in Pallas Mosaic GPU.

    out[m, n] = sum_j  sa[m, j] * sb[n, j] * sum_{k in block j} a[m, k] * b[n, k]

a [M, K] and b [N, K] are FP8 (E4M3 or E5M2, mixed allowed) and both K-major: FP8 `wgmma` on
sm90 takes 8-bit operands only K-major in shared memory (no transposed 8-bit operand), so every
GEMM is brought to this NT form by the caller (`block_matmul.py`). sa [M, ceil(K/128)] and
sb [N, ceil(K/128)] are f32 scales, one per row and 128-wide K block: the 1x128 scales of
activations and gradients directly, the 128x128 weight scales repeated along their rows (so one
kernel serves DeepGEMM's 1d2d fprop/dgrad and 1d1d wgrad; the per-row weight scale costs a
[tile_n] vector load per K step instead of a scalar).

The promotion (DeepSeek-V3 section 3.3.2, "increasing accumulation precision"): per 128-wide K
step, `wgmma` into a fresh zeroed f32 accumulator, then `result += acc * sa[:, None] * sb[None, :]`
in f32 registers. Tensor-core partial sums thus never span more than 128 products, and each
block's scales are applied exactly once, in f32.

Kernel structure (after jax's `hopper_matmul_mgpu.py` / `attention_mgpu.py`):
  - grid (M / (2 tile_m), N / tile_n), one output tile per CTA (not persistent);
  - three warpgroups: one memory warpgroup issues the TMA copies of the a, b, sa, sb blocks
    into a `max_concurrent_steps`-deep shared-memory ring (`emit_pipeline_warp_specialized`);
    two compute warpgroups each own tile_m rows of the CTA tile and run the wgmma + promotion.
    While one compute warpgroup does its promotion FMAs, the other's wgmma can use the tensor
    cores: that is the overlap DeepGEMM gets from its two math warpgroups;
  - epilogue: the f32 result is cast to the output dtype in registers, stored to shared memory
    and copied to global memory with TMA.
Operand tiles are 128-byte swizzled (TilingTransform (8, 128) + SwizzleTransform(128)).

Edges: the wrapper zero-pads M, N to whole CTA tiles and K to whole 128 blocks (padded scales
are 1), so the kernel never reads out of bounds; the padding is sliced off the result.
Off a GPU (`jax.default_backend() != "gpu"`) the kernel runs in Mosaic GPU's interpreter on
the CPU: that checks the math and the indexing, not the swizzles, the layouts or the speed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Shaped

BLOCK_K = 128  # the K step: one scale block (the recipe's block_size must be 128)
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Tiles of the kernel.

    Attributes:
      tile_m: rows per compute warpgroup (a multiple of 64, the wgmma M); the CTA covers
        2 * tile_m rows. 64 keeps the two f32 [tile_m, tile_n] register arrays (the wgmma
        accumulator and the promoted result) within the 255 registers of a thread.
      tile_n: columns of the CTA tile (a multiple of 8; 128 by default).
      max_concurrent_steps: depth of the shared-memory ring of K blocks.
    """

    tile_m: int = 64
    tile_n: int = 128
    max_concurrent_steps: int = 4

    def __post_init__(self) -> None:
        if self.tile_m % 64:
            raise ValueError(f"GemmConfig.tile_m={self.tile_m}: must be a multiple of 64")
        if self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"GemmConfig.tile_n={self.tile_n}: must be a multiple of 8, <= 256")
        if self.max_concurrent_steps < 1:
            raise ValueError("GemmConfig.max_concurrent_steps must be >= 1")


DEFAULT_CONFIG = GemmConfig()
SMEM_BYTES = 227 * 1024  # the opt-in shared memory of one sm90 CTA


def smem_bytes(config: GemmConfig, out_dtype: jnp.dtype) -> int:
    """Shared memory of one CTA: the ring of K blocks (a, b and their scales) + the two
    warpgroups' output tiles (barriers are noise)."""
    cta_m, tn = 2 * config.tile_m, config.tile_n
    step = (cta_m + tn) * BLOCK_K + 4 * (cta_m + tn)  # FP8 tiles + f32 scale rows
    return config.max_concurrent_steps * step + cta_m * tn * jnp.dtype(out_dtype).itemsize


def _swizzled(minor_elems: int, dtype: jnp.dtype) -> tuple[plgpu.Transform, ...]:
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, cfg: GemmConfig):
    """One CTA: out tile [2 tile_m, tile_n]. sa_gmem [Kb, Mp], sb_gmem [Kb, Np] (K block major,
    so that each K step's scales are one contiguous row for the TMA)."""
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_m = 2 * tm
    k_steps = a_gmem.shape[1] // BLOCK_K
    m_slice = pl.ds(lax.axis_index("m") * cta_m, cta_m)
    n_slice = pl.ds(lax.axis_index("n") * tn, tn)
    out_dtype = out_gmem.dtype

    def mma_step(_, a_smem, b_smem, sa_smem, sb_smem, result):
        rows = pl.ds(lax.axis_index("wg") * tm, tm)

        def mma(acc_ref):
            # b_smem is [tile_n, 128], K-major; its transposed view is the [128, tile_n]
            # operand wgmma wants, still K-major in memory (required for 8-bit operands).
            plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.T)
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((tm, tn), jnp.float32))
        sa = plgpu.load(sa_smem.at[0, rows], layout=plgpu.Layout.WGMMA.reduce(1))
        sb = plgpu.load(sb_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
        sa = lax.broadcast_in_dim(sa, (tm, tn), [0])
        sb = lax.broadcast_in_dim(sb, (tm, tn), [1])
        return result + acc * sa * sb

    def make_pipeline(body, compute_context):
        operand = _swizzled(BLOCK_K, a_gmem.dtype)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, BLOCK_K), lambda k: (0, k), transforms=operand),
                plgpu.BlockSpec((tn, BLOCK_K), lambda k: (0, k), transforms=operand),
                plgpu.BlockSpec((1, cta_m), lambda k: (k, 0)),
                plgpu.BlockSpec((1, tn), lambda k: (k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=min(cfg.max_concurrent_steps, k_steps),
            compute_context=compute_context,
        )

    gmem_args = (
        a_gmem.at[m_slice, :],
        b_gmem.at[n_slice, :],
        sa_gmem.at[:, m_slice],
        sb_gmem.at[:, n_slice],
    )
    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(*gmem_args),
        out_smem=plgpu.SMEM((2, tm, tn), out_dtype, transforms=_swizzled(tn, out_dtype)),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        def compute_context(run_pipeline):
            wg = lax.axis_index("wg")
            zeros = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)
            result = run_pipeline(zeros)
            out_smem[wg] = result.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg], out_gmem.at[m_slice, n_slice].at[pl.ds(wg * tm, tm)]
            )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        make_pipeline(mma_step, compute_context)(*gmem_args, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_to(x: Array, shape: tuple[int, ...], value: float) -> Array:
    pads = [(0, t - d) for d, t in zip(x.shape, shape, strict=True)]
    return jnp.pad(x, pads, constant_values=value) if any(p for _, p in pads) else x


def use_interpreter() -> bool:
    """The Mosaic GPU interpreter runs the kernels off a GPU (CPU tests and CI)."""
    return jax.default_backend() != "gpu"


def scaled_matmul_nt(
    a: Shaped[Array, "M K"],
    b: Shaped[Array, "N K"],
    sa: Float[Array, "M Kb"],
    sb: Float[Array, "N Kb"],
    out_dtype: jnp.dtype = jnp.float32,
    config: GemmConfig = DEFAULT_CONFIG,
    interpret: plgpu.InterpretGPUParams | None = None,
) -> Shaped[Array, "M N"]:
    """out [M, N] = sum over 128-blocks j of (a[:, j] . b[:, j]^T) * sa[:, j, None] * sb[None, :, j].

    Args:
      a: [M, K] FP8 (E4M3 or E5M2), K contiguous.
      b: [N, K] FP8 (E4M3 or E5M2, may differ from a's format), K contiguous.
      sa: [M, ceil(K / 128)] f32 scales of a's 1x128 groups.
      sb: [N, ceil(K / 128)] f32 scales of b's 1x128 groups (repeat a 128x128 block scale over
        its 128 rows).
      out_dtype: f32, bf16 or f16; the f32 result is rounded once, in the epilogue.
      config: tiles.
      interpret: interpreter parameters (e.g. `InterpretGPUParams(detect_races=True)`);
        None = the default interpreter off a GPU, compiled on a GPU.

    Returns:
      [M, N] in out_dtype. Any M, N, K >= 1: the operands are zero-padded to whole tiles here.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"scaled_matmul_nt: need a [M, K] and b [N, K], got {a.shape} and {b.shape}"
        )
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise ValueError(
            f"scaled_matmul_nt: operands must be float8_e4m3fn or float8_e5m2, got "
            f"{a.dtype} and {b.dtype}; quantize them first (models.fp8.quantize)"
        )
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"scaled_matmul_nt: out_dtype {out_dtype} not in {OUT_DTYPES}")
    (m, k), n = a.shape, b.shape[0]
    kb = -(-k // BLOCK_K)
    if sa.shape != (m, kb) or sb.shape != (n, kb):
        raise ValueError(
            f"scaled_matmul_nt: scales {sa.shape}, {sb.shape}; expected {(m, kb)} and "
            f"{(n, kb)} (one per row and 128-wide K block)"
        )
    if smem_bytes(config, out_dtype) > SMEM_BYTES:
        raise ValueError(
            f"scaled_matmul_nt: {config} with {out_dtype} output needs "
            f"{smem_bytes(config, out_dtype)} bytes of shared memory, more than the "
            f"{SMEM_BYTES} of a CTA: lower max_concurrent_steps or tile_n"
        )
    mp, np_, kp = _round_up(m, 2 * config.tile_m), _round_up(n, config.tile_n), kb * BLOCK_K
    a = _pad_to(a, (mp, kp), 0)
    b = _pad_to(b, (np_, kp), 0)
    # K-block-major scales: each K step's scales are one contiguous TMA row.
    sa_t = _pad_to(sa.astype(jnp.float32).T, (kb, mp), 1.0)
    sb_t = _pad_to(sb.astype(jnp.float32).T, (kb, np_), 1.0)
    call = plgpu.kernel(
        functools.partial(_kernel, cfg=config),
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // (2 * config.tile_m), np_ // config.tile_n),
        grid_names=("m", "n"),
        num_threads=3,  # two compute warpgroups + the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or (plgpu.InterpretGPUParams() if use_interpreter() else False),
    )
    out = call(a, b, sa_t, sb_t)
    return out[:m, :n] if (mp, np_) != (m, n) else out
