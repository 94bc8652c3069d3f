"""Time f32, bf16 and every FP8 recipe on GEMM shapes, side by side in one run.

    python benchmarks/fp8_matmul.py                 # all shapes (minutes on a 2-core CPU)
    python benchmarks/fp8_matmul.py --shapes 1024   # one shape
    python benchmarks/fp8_matmul.py --repeats 5

Prints, per shape and recipe, the median time of the jitted forward and forward+backward, the
ratio to bf16 and, on a GPU, TFLOP/s. It asserts nothing: these machines are shared and noisy,
so only the ratios measured in the same run mean anything. On CPU the `emulate` backend
dequantizes to f32 (XLA upcasts float8 dots anyway), so FP8 is expected to be *slower* than
bf16 here; the speed case is for the Hopper kernel (`backend="pallas"`, not built yet).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import median_seconds  # benchmarks/timing.py (scripts run from this folder)

from models import fp8

SHAPES = {  # name -> (M, K, N)
    "1024": (1024, 1024, 1024),
    "4096": (4096, 4096, 4096),
    "qwen3_8b_mlp": (4096, 4096, 12288),  # 4096 tokens through Qwen3-8B's gate/up projection
}
LINEAR_DN = (((1,), (0,)), ((), ()))


def bench_shape(m: int, k: int, n: int, repeats: int) -> list[tuple[str, float, float]]:
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x32 = jax.random.normal(kx, (m, k), jnp.float32)
    w32 = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
    cot = jax.random.normal(jax.random.PRNGKey(1), (m, n), jnp.float32)
    cases = [("f32", fp8.BF16, jnp.float32)] + [
        (name, recipe, jnp.bfloat16) for name, recipe in fp8.RECIPES.items()
    ]
    rows = []
    for label, recipe, dtype in cases:
        dot = fp8.make_dot_general(recipe)
        x, w = x32.astype(dtype), w32.astype(dtype)

        def fwd(a, b, dot=dot):
            return dot(a, b, LINEAR_DN)

        def loss(a, b, c, dot=dot):
            # A random cotangent passed as an argument: a constant one would be folded.
            return jnp.sum(dot(a, b, LINEAR_DN).astype(jnp.float32) * c)

        t_fwd = median_seconds(jax.jit(fwd), x, w, repeats=repeats)
        grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        t_bwd = median_seconds(grad_fn, x, w, cot, repeats=repeats)
        rows.append((label, t_fwd, t_bwd))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    backend = jax.default_backend()
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    for name in args.shapes:
        m, k, n = SHAPES[name]
        flops = 2.0 * m * k * n
        rows = bench_shape(m, k, n, args.repeats)
        base = {label: (f, b) for label, f, b in rows}["bf16"]
        print(f"\nshape {name}: M={m} K={k} N={n}")
        header = f"{'recipe':<12}{'fwd s':>10}{'fwd/bf16':>10}{'fwd+bwd s':>12}{'f+b/bf16':>10}"
        if backend == "gpu":
            header += f"{'fwd TFLOP/s':>13}{'f+b TFLOP/s':>13}"
        print(header)
        for label, t_fwd, t_bwd in rows:
            line = (
                f"{label:<12}{t_fwd:>10.4f}{t_fwd / base[0]:>10.2f}"
                f"{t_bwd:>12.4f}{t_bwd / base[1]:>10.2f}"
            )
            if backend == "gpu":
                line += f"{flops / t_fwd / 1e12:>13.1f}{3 * flops / t_bwd / 1e12:>13.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
