"""Time bf16, per-tensor FP8 (XLA), block FP8 (emulate) and the Hopper kernel, side by side.

    python benchmarks/fp8_matmul.py                  # GPU: 4096^3 + Qwen3-8B shapes; CPU: small
    python benchmarks/fp8_matmul.py --shapes 4096    # one shape
    python benchmarks/fp8_matmul.py --small          # the small shape (the CPU default)
    python benchmarks/fp8_matmul.py --sweep          # + kernel-only GEMM over tile configs

Rows, per shape (x [M, K] and w [K, N] in bf16, output bf16):
  bf16          `lax.dot_general` in bf16 (cuBLAS on a GPU)
  fp8_tensor    per-tensor FP8 through XLA: quantize, dequantize -> dot with scalar scales,
                which XLA's GEMM rewriter may turn into a cuBLASLt FP8 GEMM on a GPU
  fp8_block     the block recipe (1x128 / 128x128) on the emulate backend: f32 dot
  fp8_block_pallas  the block recipe on the Mosaic GPU kernel (models/fp8/kernels), including
                the quantizers and transposed FP8 copies that stay in XLA
  kernel_only   the kernel's forward GEMM alone, on pre-quantized operands (forward only)
Each row gives the median time of the jitted forward and forward+backward, TFLOP/s
(2MKN per forward, 6MKN per forward+backward) and the speedup over bf16 (bf16 time / time;
> 1 is faster). The `gemm` column names the GEMM that the compiled HLO calls (cublasLt-f8,
cublas, mosaic, interpreter, or xla): it shows whether the FP8 paths hit FP8 GEMMs at all. It
asserts nothing: only ratios measured in the same run mean anything. On CPU the kernel runs in the
Mosaic GPU interpreter (a correctness tool, orders of magnitude slower): the CPU run only
checks that the benchmark works.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from timing import median_seconds  # benchmarks/timing.py (scripts run from this folder)

from models import fp8
from models.fp8.kernels import gemm

SHAPES = {  # name -> (M, K, N)
    "small": (256, 384, 256),
    "4096": (4096, 4096, 4096),
    # 16384 tokens through Qwen3-8B (hidden 4096, MLP 12288): gate/up, down, q/o projections.
    "qwen3_8b_up": (16384, 4096, 12288),
    "qwen3_8b_down": (16384, 12288, 4096),
    "qwen3_8b_attn": (16384, 4096, 4096),
}
GPU_SHAPES = ("4096", "qwen3_8b_up", "qwen3_8b_down", "qwen3_8b_attn")
LINEAR_DN = (((1,), (0,)), ((), ()))
# The table's rows: three recipes of the registry, then the block recipe on the Hopper kernel.
ROW_RECIPES = {
    **{name: fp8.RECIPES[name] for name in ("bf16", "fp8_tensor", "fp8_block")},
    "fp8_block_pallas": fp8.get_recipe("fp8_block", backend="pallas"),
}
SWEEP = (  # kernel configs tried by --sweep (bf16 output; all fit gemm.SMEM_BYTES)
    gemm.GemmConfig(tile_n=128, max_concurrent_steps=3),
    gemm.GemmConfig(tile_n=128, max_concurrent_steps=4),
    gemm.GemmConfig(tile_n=128, max_concurrent_steps=5),
    gemm.GemmConfig(tile_n=64, max_concurrent_steps=6),
    # Wider N tiles: fewer re-reads of x per FLOP; 2 x 96 f32 registers per thread for the
    # accumulator and the promoted result (tile_n = 256 would need all 255).
    gemm.GemmConfig(tile_n=192, max_concurrent_steps=3),
    gemm.GemmConfig(tile_n=192, max_concurrent_steps=4),
)


def _gemm_kind(compiled) -> str:
    """Which GEMM the optimized HLO calls."""
    hlo = compiled.as_text()
    if "mosaic_gpu" in hlo:
        return "mosaic"
    if "__cublas$lt$matmul$f8" in hlo:
        return "cublasLt-f8"
    if "__cublas" in hlo:
        return "cublas"
    if "callback" in hlo:  # off a GPU the kernel is the interpreter, a host callback
        return "interpreter"
    return "xla"


def _timed(fn, *args, repeats: int) -> tuple[float, str]:
    compiled = jax.jit(fn).lower(*args).compile()
    return median_seconds(compiled, *args, repeats=repeats), _gemm_kind(compiled)


def bench_shape(m: int, k: int, n: int, repeats: int, sweep: bool) -> list[tuple]:
    """Rows (label, fwd s, fwd+bwd s or None, gemm kind)."""
    kx, kw, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    # A random cotangent passed as an argument: a constant one would be folded.
    cot = jax.random.normal(kc, (m, n), jnp.bfloat16)
    rows = []
    for label, recipe in ROW_RECIPES.items():
        dot = fp8.make_dot_general(recipe)

        def fwd(a, b, dot=dot):
            return dot(a, b, LINEAR_DN)

        def loss(a, b, c, dot=dot):
            return jnp.sum(dot(a, b, LINEAR_DN).astype(jnp.float32) * c.astype(jnp.float32))

        t_fwd, kind = _timed(fwd, x, w, repeats=repeats)
        t_bwd, _ = _timed(jax.value_and_grad(loss, argnums=(0, 1)), x, w, cot, repeats=repeats)
        rows.append((label, t_fwd, t_bwd, kind))
    # The kernel alone: operands quantized once, outside the timed function.
    qx, sx = fp8.quantize(x, "e4m3", (1, 128))
    qw, sw = fp8.quantize(w.T, "e4m3", (128, 128))
    sw_rows = jnp.repeat(sw, 128, axis=0)[:n]
    configs = SWEEP if sweep else (gemm.DEFAULT_CONFIG,)
    for cfg in configs:

        def kernel(a, b, sa, sb, cfg=cfg):
            return gemm.scaled_matmul_nt(a, b, sa, sb, jnp.bfloat16, cfg)

        label = "kernel_only" if not sweep else f"kernel n{cfg.tile_n} s{cfg.max_concurrent_steps}"
        try:
            t, kind = _timed(kernel, qx, qw, sx, sw_rows, repeats=repeats)
        except Exception as e:  # noqa: BLE001 (a sweep point that fails to compile is reported)
            print(f"{label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append((label, t, None, kind))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    parser.add_argument("--small", action="store_true", help="only the small shape")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--sweep", action="store_true", help="kernel-only GEMM per tile config")
    args = parser.parse_args()
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    shapes = ["small"] if args.small else args.shapes or (GPU_SHAPES if on_gpu else ["small"])
    repeats = args.repeats or (20 if on_gpu else 1)
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    print(f"kernel default {dataclasses.asdict(gemm.DEFAULT_CONFIG)}; repeats {repeats}")
    for name in shapes:
        m, k, n = SHAPES[name]
        flops = 2.0 * m * k * n
        rows = bench_shape(m, k, n, repeats, args.sweep)
        base_f, base_b = rows[0][1], rows[0][2]
        print(f"\nshape {name}: M={m} K={k} N={n}")
        print(
            f"{'case':<20}{'gemm':>12}{'fwd ms':>10}{'TFLOP/s':>9}{'x bf16':>8}"
            f"{'f+b ms':>10}{'TFLOP/s':>9}{'x bf16':>8}"
        )
        for label, t_fwd, t_bwd, kind in rows:
            line = (
                f"{label:<20}{kind:>12}{t_fwd * 1e3:>10.3f}{flops / t_fwd / 1e12:>9.1f}"
                f"{base_f / t_fwd:>8.2f}"
            )
            if t_bwd is not None:
                line += (
                    f"{t_bwd * 1e3:>10.3f}{3 * flops / t_bwd / 1e12:>9.1f}{base_b / t_bwd:>8.2f}"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
