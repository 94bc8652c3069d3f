"""The block-scaled FP8 grouped ("ragged") GEMMs of Mixture-of-Experts layers on Hopper, in
Pallas Mosaic GPU: the kernel of `gemm.py` with the weight operand chosen per row tile (fprop,
dgrad) or the contraction running over one expert's tokens (wgrad).

Both forms keep `gemm.py`'s numerics: per 128-wide K step a `wgmma` into a zeroed f32
accumulator, promoted into the f32 result with the two operands' scales (DeepSeek-V3's
promotion), and a fixed K loop per output tile, no split-K. A row's result is therefore the same
sequence of f32 operations whatever else its expert or the batch holds.

Row layout (`GroupLayout`): the rows [T, .] sorted by expert are gathered into a buffer whose
expert runs each start at a multiple of the CTA's row tile (2 tile_m rows, a multiple of 128)
and are zero-padded to it. A run of r rows then covers ceil(r / tile) whole tiles, each of one
expert, and with at most min(E, T) non-empty experts the buffer needs at most
T + min(E, T) (tile - 1) rows, rounded down to whole tiles: its size is static. Every row
tile has one expert (`tile_experts`, E for the tiles past the last run).

    rows form         out [M, R] = a [M, C] . b[expert of the row tile]^T [C, R]
                      a: the laid-out rows (1 x 128 scales per row), b [E, R, C] per expert
                      (weight scales repeated over their 128 rows, as in `gemm.py`).
                      fprop (C = K, b = Q(w_e)^T) and dgrad (C = N, b = Q(w_e)).
    contraction form  out [E, R, S] = per expert e: a [R, M] . b [S, M]^T over the 128-row
                      token blocks of e's run only (1 x 128 scales along the tokens, 128-token
                      tiles starting at the expert's first row, as in the expert's own GEMM).
                      wgrad: dw_e = Q(x_e)^T . Q(g_e), a = Q(x)^T [K, M], b = Q(g)^T [N, M].

The rows form reads its tile's expert from `tile_experts` in global memory and slices the
expert's weight and scales from there; a tile past the last run runs zero K steps and stores
zeros. The contraction form has a grid over (expert, K tile, N tile) and a K loop of as many
steps as the expert has token blocks (zero for an empty expert, which stores zeros): the
pipeline's trip count is read from global memory, so no CTA streams another expert's tokens.
wgrad as this second grouped form, rather than the dense kernel once per expert, because the
experts' row counts are only known on the device: a per-expert dense call would need a static
row count per expert, i.e. every expert padded to all T rows (E times the work and memory).

Off a GPU the kernels run in Mosaic GPU's interpreter on the CPU (math and indexing only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, Shaped

from models.fp8.kernels import gemm
from models.fp8.kernels.gemm import BLOCK_K, DEFAULT_CONFIG, GemmConfig


def _tile(a_ref, b_ref, sa_ref, sb_ref, out_ref, *, first_step, num_steps, cfg: GemmConfig) -> None:
    """One CTA: out_ref [2 tile_m, tile_n] = sum over the K steps s in
    [first_step, first_step + num_steps) of (a_s . b_s^T) * sa_s * sb_s, f32 promotion per step.

    a_ref [2 tile_m, C] and b_ref [tile_n, C] are K-major FP8 views in global memory, sa_ref
    [C / 128, 2 tile_m] and sb_ref [C / 128, tile_n] their K-block-major scales. `num_steps`
    may be a traced scalar (then the pipeline's trip count is dynamic; 0 stores zeros)."""
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_m = 2 * tm
    out_dtype = out_ref.dtype

    def mma_step(_, a_smem, b_smem, sa_smem, sb_smem, result):
        rows = pl.ds(lax.axis_index("wg") * tm, tm)

        def mma(acc_ref):
            # b_smem [tile_n, 128] is K-major; its transpose is the K-major [128, tile_n]
            # operand FP8 wgmma requires.
            plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.T)
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((tm, tn), jnp.float32))
        sa = plgpu.load(sa_smem.at[0, rows], layout=plgpu.Layout.WGMMA.reduce(1))
        sb = plgpu.load(sb_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
        sa = lax.broadcast_in_dim(sa, (tm, tn), [0])
        sb = lax.broadcast_in_dim(sb, (tm, tn), [1])
        return result + acc * sa * sb

    def make_pipeline(body, compute_context):
        operand = gemm._swizzled(BLOCK_K, a_ref.dtype)
        depth = cfg.max_concurrent_steps
        if isinstance(num_steps, int):
            depth = min(depth, num_steps)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, BLOCK_K), lambda k: (0, first_step + k), transforms=operand
                ),
                plgpu.BlockSpec((tn, BLOCK_K), lambda k: (0, first_step + k), transforms=operand),
                plgpu.BlockSpec((1, cta_m), lambda k: (first_step + k, 0)),
                plgpu.BlockSpec((1, tn), lambda k: (first_step + k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=depth,
            compute_context=compute_context,
        )

    gmem_args = (a_ref, b_ref, sa_ref, sb_ref)
    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(*gmem_args),
        out_smem=plgpu.SMEM((2, tm, tn), out_dtype, transforms=gemm._swizzled(tn, out_dtype)),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        def compute_context(run_pipeline):
            wg = lax.axis_index("wg")
            zeros = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)
            result = run_pipeline(zeros)
            out_smem[wg] = result.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[pl.ds(wg * tm, tm)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        make_pipeline(mma_step, compute_context)(*gmem_args, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0)


def _rows_kernel(experts_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, cfg: GemmConfig):
    """Rows form, one CTA: the row tile's expert from `experts_gmem` picks b and sb."""
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    num_experts, k_steps = b_gmem.shape[0], a_gmem.shape[1] // BLOCK_K
    m, n = lax.axis_index("m"), lax.axis_index("n")
    expert = experts_gmem[m]
    valid = expert < num_experts
    expert = jnp.where(valid, expert, 0)
    m_slice, n_slice = pl.ds(m * cta_m, cta_m), pl.ds(n * tn, tn)
    _tile(
        a_gmem.at[m_slice, :],
        b_gmem.at[expert].at[n_slice, :],
        sa_gmem.at[:, m_slice],
        sb_gmem.at[expert].at[:, n_slice],
        out_gmem.at[m_slice, n_slice],
        first_step=0,
        num_steps=jnp.where(valid, k_steps, 0),
        cfg=cfg,
    )


def _contraction_kernel(
    first_gmem, count_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, cfg: GemmConfig
):
    """Contraction form, one CTA: expert e's token blocks [first[e], first[e] + count[e])."""
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    e, m, n = lax.axis_index("e"), lax.axis_index("m"), lax.axis_index("n")
    m_slice, n_slice = pl.ds(m * cta_m, cta_m), pl.ds(n * tn, tn)
    _tile(
        a_gmem.at[m_slice, :],
        b_gmem.at[n_slice, :],
        sa_gmem.at[:, m_slice],
        sb_gmem.at[:, n_slice],
        out_gmem.at[e].at[m_slice, n_slice],
        first_step=first_gmem[e],
        num_steps=count_gmem[e],
        cfg=cfg,
    )


def _check(name: str, a: Array, b: Array, out_dtype: jnp.dtype, config: GemmConfig) -> None:
    if a.dtype not in gemm._FP8 or b.dtype not in gemm._FP8:
        raise ValueError(
            f"{name}: operands must be float8_e4m3fn or float8_e5m2, got {a.dtype} and "
            f"{b.dtype}; quantize them first (models.fp8.quantize)"
        )
    if jnp.dtype(out_dtype) not in gemm.OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype {out_dtype} not in {gemm.OUT_DTYPES}")
    if gemm.smem_bytes(config, out_dtype) > gemm.SMEM_BYTES:
        raise ValueError(
            f"{name}: {config} with {jnp.dtype(out_dtype)} output needs "
            f"{gemm.smem_bytes(config, out_dtype)} bytes of shared memory, more than the "
            f"{gemm.SMEM_BYTES} of a CTA: lower max_concurrent_steps or tile_n"
        )


def _call(kernel, out_shape, out_dtype, grid, grid_names, interpret):
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=grid,
        grid_names=grid_names,
        num_threads=3,  # two compute warpgroups + the memory warpgroup
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or (plgpu.InterpretGPUParams() if gemm.use_interpreter() else False),
    )


def grouped_rows_nt(
    a: Shaped[Array, "M C"],
    b: Shaped[Array, "E R C"],
    sa: Float[Array, "M Cb"],
    sb: Float[Array, "E R Cb"],
    tile_experts: Int[Array, " Mt"],
    out_dtype: jnp.dtype = jnp.float32,
    config: GemmConfig = DEFAULT_CONFIG,
    interpret: plgpu.InterpretGPUParams | None = None,
) -> Shaped[Array, "M R"]:
    """out[rows of tile i] = the block-scaled NT product of those rows with b[tile_experts[i]].

    Args:
      a: [M, C] FP8 rows, M a multiple of the CTA row tile 2 * config.tile_m (`GroupLayout`).
      b: [E, R, C] FP8, one K-major operand per expert.
      sa: [M, ceil(C / 128)] f32 scales of a's 1 x 128 groups.
      sb: [E, R, ceil(C / 128)] f32 scales of b's rows (a 128 x 128 block scale repeated over
        its rows).
      tile_experts: [M / (2 tile_m)] int32, the expert of each row tile; a value >= E marks a
        tile with no expert (its rows come out 0).
      out_dtype, config, interpret: as `gemm.scaled_matmul_nt`.

    Returns:
      [M, R] in out_dtype; R and C may be any size (zero-padded to whole tiles here).
    """
    name = "grouped_rows_nt"
    (m, c), (e, r) = a.shape, b.shape[:2]
    cta_m, tn = 2 * config.tile_m, config.tile_n
    cb = -(-c // BLOCK_K)
    if b.ndim != 3 or b.shape[2] != c or m % cta_m:
        raise ValueError(
            f"{name}: need a [M, C] with M a multiple of {cta_m} and b [E, R, C], got "
            f"{a.shape} and {b.shape}"
        )
    if sa.shape != (m, cb) or sb.shape != (e, r, cb) or tile_experts.shape != (m // cta_m,):
        raise ValueError(
            f"{name}: scales {sa.shape}, {sb.shape} and tile_experts {tile_experts.shape}; "
            f"expected {(m, cb)}, {(e, r, cb)} and {(m // cta_m,)}"
        )
    _check(name, a, b, out_dtype, config)
    rp, cp = gemm._round_up(r, tn), cb * BLOCK_K
    a = gemm._pad_to(a, (m, cp), 0)
    b = gemm._pad_to(b, (e, rp, cp), 0)
    sa_t = sa.astype(jnp.float32).T  # [Cb, M]: each K step's scales one contiguous row
    sb_t = gemm._pad_to(jnp.swapaxes(sb.astype(jnp.float32), 1, 2), (e, cb, rp), 1.0)
    call = _call(
        functools.partial(_rows_kernel, cfg=config),
        (m, rp),
        jnp.dtype(out_dtype),
        (m // cta_m, rp // tn),
        ("m", "n"),
        interpret,
    )
    out = call(tile_experts.astype(jnp.int32), a, b, sa_t, sb_t)
    return out[:, :r] if rp != r else out


def grouped_contraction_nt(
    a: Shaped[Array, "R M"],
    b: Shaped[Array, "S M"],
    sa: Float[Array, "R Mb"],
    sb: Float[Array, "S Mb"],
    first_block: Int[Array, " E"],
    num_blocks: Int[Array, " E"],
    out_dtype: jnp.dtype = jnp.float32,
    config: GemmConfig = DEFAULT_CONFIG,
    interpret: plgpu.InterpretGPUParams | None = None,
) -> Shaped[Array, "E R S"]:
    """out[e] = sum over the 128-wide blocks j in [first_block[e], first_block[e] +
    num_blocks[e]) of (a_j . b_j^T) * sa[:, j, None] * sb[None, :, j].

    Args:
      a: [R, M] FP8, the contraction (token) axis M contiguous, M a multiple of 128.
      b: [S, M] FP8, likewise.
      sa, sb: [R, M / 128] and [S, M / 128] f32 scales of the 1 x 128 groups along M.
      first_block, num_blocks: [E] int32, each expert's run of 128-row blocks of M (an empty
        expert, num_blocks 0, comes out 0).
      out_dtype, config, interpret: as `gemm.scaled_matmul_nt`.

    Returns:
      [E, R, S] in out_dtype; R and S may be any size (zero-padded to whole tiles here).
    """
    name = "grouped_contraction_nt"
    (r, m), s = a.shape, b.shape[0]
    if b.ndim != 2 or b.shape[1] != m or m % BLOCK_K:
        raise ValueError(
            f"{name}: need a [R, M] and b [S, M] with M a multiple of {BLOCK_K}, got "
            f"{a.shape} and {b.shape}"
        )
    mb, e = m // BLOCK_K, first_block.shape[0]
    if sa.shape != (r, mb) or sb.shape != (s, mb) or num_blocks.shape != (e,):
        raise ValueError(
            f"{name}: scales {sa.shape}, {sb.shape}, runs {first_block.shape} and "
            f"{num_blocks.shape}; expected {(r, mb)}, {(s, mb)} and one per expert"
        )
    _check(name, a, b, out_dtype, config)
    cta_m, tn = 2 * config.tile_m, config.tile_n
    rp, sp = gemm._round_up(r, cta_m), gemm._round_up(s, tn)
    a = gemm._pad_to(a, (rp, m), 0)
    b = gemm._pad_to(b, (sp, m), 0)
    sa_t = gemm._pad_to(sa.astype(jnp.float32).T, (mb, rp), 1.0)
    sb_t = gemm._pad_to(sb.astype(jnp.float32).T, (mb, sp), 1.0)
    call = _call(
        functools.partial(_contraction_kernel, cfg=config),
        (e, rp, sp),
        jnp.dtype(out_dtype),
        (e, rp // cta_m, sp // tn),
        ("e", "m", "n"),
        interpret,
    )
    out = call(first_block.astype(jnp.int32), num_blocks.astype(jnp.int32), a, b, sa_t, sb_t)
    return out[:, :r, :s] if (rp, sp) != (r, s) else out


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where the sorted rows of each expert go in the kernels' padded row buffer (module doc).

    Attributes:
      rows: M, the buffer's static row count (a multiple of the row tile).
      tile: the row tile (2 tile_m of the config, a multiple of 128).
      source: [M] int32, the row of x each buffer row holds; T (no row: zeros) for padding.
      dest: [T] int32, the buffer row of each row of x; M for rows past the groups.
      tile_experts: [M / tile] int32, the expert of each row tile (E past the last run).
      first_block, num_blocks: [E] int32, each expert's run in 128-row blocks (the blocks
        holding its rows; the run's trailing padding blocks are left out).
    """

    rows: int
    tile: int
    source: Array
    dest: Array
    tile_experts: Array
    first_block: Array
    num_blocks: Array

    @classmethod
    def create(
        cls, group_sizes: Int[Array, " E"], num_rows: int, config: GemmConfig = DEFAULT_CONFIG
    ) -> GroupLayout:
        """The layout of `num_rows` rows sorted by expert, group_sizes[e] of expert e (their sum
        at most num_rows; rows past it belong to no expert)."""
        tile = 2 * config.tile_m
        experts = group_sizes.shape[0]
        # sum_e ceil(size_e / tile) <= (T + n (tile - 1)) / tile over the n <= min(E, T)
        # non-empty experts.
        rows = (num_rows + min(experts, num_rows) * (tile - 1)) // tile * tile
        sizes = group_sizes.astype(jnp.int32)
        zero = jnp.zeros(1, jnp.int32)
        ends = jnp.cumsum(sizes)
        starts = jnp.concatenate([zero, ends])  # [E + 1]
        padded_ends = jnp.cumsum(-(-sizes // tile) * tile)
        padded_starts = jnp.concatenate([zero, padded_ends])  # [E + 1]
        # Buffer row p: its expert (E past the last run), its position in the expert's run.
        p = jnp.arange(rows, dtype=jnp.int32)
        p_expert = jnp.searchsorted(padded_ends, p, side="right").astype(jnp.int32)
        p_pos = p - padded_starts[p_expert]
        sizes_ext = jnp.concatenate([sizes, zero])
        source = jnp.where(p_pos < sizes_ext[p_expert], starts[p_expert] + p_pos, num_rows)
        t = jnp.arange(num_rows, dtype=jnp.int32)
        t_expert = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
        dest = jnp.where(t_expert < experts, padded_starts[t_expert] + t - starts[t_expert], rows)
        return cls(
            rows=rows,
            tile=tile,
            source=source.astype(jnp.int32),
            dest=dest.astype(jnp.int32),
            tile_experts=p_expert[::tile],
            first_block=padded_starts[:-1] // BLOCK_K,
            num_blocks=-(-sizes // BLOCK_K),
        )

    def gather(self, x: Shaped[Array, "T C"]) -> Shaped[Array, "M C"]:
        """x's rows in the buffer's order, zero rows as padding."""
        return jnp.take(x, self.source, axis=0, mode="fill", fill_value=0)

    def scatter(self, y: Shaped[Array, "M C"]) -> Shaped[Array, "T C"]:
        """The buffer's rows back in x's order; rows past the groups get 0."""
        return jnp.take(y, self.dest, axis=0, mode="fill", fill_value=0)
