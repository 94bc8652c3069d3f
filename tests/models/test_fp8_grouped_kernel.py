"""The Hopper grouped FP8 kernels (`grouped_dot` with `backend="pallas"`,
models/fp8/kernels/grouped_gemm.py) against `grouped_dot`'s emulate backend, which
tests/models/test_fp8_grouped.py checks against a float64 loop over the experts.

Both quantize every operand to the same FP8 values and scales, so only the order of the f32
sums differs: relative Frobenius error <= 1e-5 for f32 outputs, as in test_fp8_kernels.py.
Off a GPU the kernels run in Mosaic GPU's interpreter (math and indexing; every warpgroup of
every CTA simulated in Python), so the shapes are as small as show each property: decode-shaped
operands (a few tokens, empty experts) and prefill-shaped ones (hundreds of tokens, uneven
groups, an expert over two row tiles, K and N with partial tiles, rows past the groups).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_fp8_kernels import F32_REL, ON_GPU, _poison_allocator, _rel, _rng

from models import fp8
from models.fp8.grouped import grouped_dot
from models.fp8.kernels import gemm, grouped_gemm


@functools.partial(jax.jit, static_argnames="recipe")
def _fwd_and_grads(x, w, group_sizes, cot, *, recipe):
    y, vjp = jax.vjp(lambda a, b: grouped_dot(a, b, group_sizes, recipe), x, w)
    return (y, *vjp(cot))


def _operands(t, k, n, sizes, dtype, seed):
    rng = _rng(seed, t, k, n)
    x = rng.standard_normal((t, k)) * 2.0 ** rng.uniform(-4, 4, (t, 1))  # per-token magnitudes
    w = rng.standard_normal((len(sizes), k, n)) * k**-0.5
    cot = rng.standard_normal((t, n))
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(sizes, jnp.int32),
        jnp.asarray(cot, dtype),
    )


@pytest.mark.parametrize(
    "t, k, n, sizes, dtype, bwd_format",
    [
        # Decode: 4 tokens, two of four experts empty, one row past the groups.
        (4, 128, 64, (1, 0, 2, 0), jnp.float32, "e4m3"),
        # Prefill: 200 tokens; expert 0 spans two row tiles and two 128-token wgrad blocks,
        # expert 1 is empty, 10 rows past the groups; K = 136 and N = 72 are partial tiles.
        (200, 136, 72, (150, 0, 40), jnp.float32, "e5m2"),
    ],
    ids=["decode", "prefill"],
)
def test_pallas_fwd_dgrad_wgrad_equal_emulate(t, k, n, sizes, dtype, bwd_format):
    x, w, group_sizes, cot = _operands(t, k, n, sizes, dtype, 0)
    recipes = {
        be: fp8.get_recipe("fp8_block", bwd_format=bwd_format, backend=be)
        for be in ("emulate", "pallas")
    }
    ref = _fwd_and_grads(x, w, group_sizes, cot, recipe=recipes["emulate"])
    _poison_allocator()
    out = _fwd_and_grads(x, w, group_sizes, cot, recipe=recipes["pallas"])
    for name, o, r in zip(("forward", "dgrad", "wgrad"), out, ref, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        print(name, "rel err", _rel(o, r))
        assert _rel(o, r) <= F32_REL, (name, _rel(o, r))
    # Rows past the groups: no output, no gradient; empty experts: no weight gradient.
    assert not np.any(np.asarray(out[0])[sum(sizes) :])
    assert not np.any(np.asarray(out[1])[sum(sizes) :])
    empty = [e for e, s in enumerate(sizes) if s == 0]
    assert not np.any(np.asarray(out[2])[empty])


@functools.partial(jax.jit, static_argnames="recipe")
def _forward(x, w, group_sizes, *, recipe):
    return grouped_dot(x, w, group_sizes, recipe)


def test_pallas_rows_do_not_depend_on_the_batch():
    """A token's output row must not depend on what else is in the batch (exact on-policy
    rollouts: decode and the trainer's prefill agree bit for bit). Each row tile holds one
    expert's rows and runs the dense kernel's fixed K loop, so a row is the same f32 operations
    whether its expert has 1 or 150 rows: a few decode rows against the prefill's rows, `==`."""
    x, w, group_sizes, _ = _operands(200, 136, 72, (150, 0, 40), jnp.bfloat16, 1)
    recipe = fp8.get_recipe("fp8_block", backend="pallas")
    whole = np.asarray(_forward(x, w, group_sizes, recipe=recipe))
    rows = np.array([3, 149, 150, 175])  # experts 0, 0, 2, 2
    part = _forward(x[rows], w, jnp.asarray([2, 0, 2], jnp.int32), recipe=recipe)
    np.testing.assert_array_equal(np.asarray(part), whole[rows])


@pytest.mark.skipif(ON_GPU, reason="an interpreter check; on a GPU the kernels run compiled")
def test_grouped_kernels_have_no_races_and_pick_the_right_expert():
    """Both forms under the interpreter's race detector (ring as deep as the K loop, as in
    test_fp8_kernels.py), with unit scales against float64 numpy: the rows form takes each
    tile's expert (and a tile with none runs no K step), the contraction form sums exactly
    its expert's token blocks (an empty expert's pipeline has no step and stores zeros)."""
    rng = _rng(5)
    sizes = np.array([2, 0, 3])
    layout = grouped_gemm.GroupLayout.create(jnp.asarray(sizes), 5)
    rows, mb = layout.rows, layout.rows // 128
    a = jnp.asarray(rng.standard_normal((5, 256)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((3, 64, 256)), jnp.float8_e4m3fn)
    cfg = gemm.GemmConfig(tile_n=64, max_concurrent_steps=2)
    params = plgpu.InterpretGPUParams(detect_races=True)
    y = grouped_gemm.grouped_rows_nt(
        layout.gather(a), b, jnp.ones((rows, 2)), jnp.ones((3, 64, 2)), layout.tile_experts,
        config=cfg, interpret=params,
    )  # fmt: skip
    assert not interpret_pallas_call.get_races().races_found
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    want = np.stack([a64[t] @ b64[e].T for t, e in enumerate(np.repeat([0, 1, 2], sizes))])
    assert _rel(layout.scatter(y), want) <= F32_REL

    at = jnp.asarray(rng.standard_normal((64, rows)), jnp.float8_e4m3fn)
    bt = jnp.asarray(rng.standard_normal((64, rows)), jnp.float8_e4m3fn)
    dw = grouped_gemm.grouped_contraction_nt(
        at, bt, jnp.ones((64, mb)), jnp.ones((64, mb)), layout.first_block, layout.num_blocks,
        config=cfg, interpret=params,
    )  # fmt: skip
    assert not interpret_pallas_call.get_races().races_found
    at64, bt64 = np.asarray(at, np.float64), np.asarray(bt, np.float64)
    first, count = np.asarray(layout.first_block), np.asarray(layout.num_blocks)
    for e in range(3):
        cols = slice(first[e] * 128, (first[e] + count[e]) * 128)
        want = at64[:, cols] @ bt64[:, cols].T
        assert _rel(dw[e], want) <= F32_REL if count[e] else not np.any(np.asarray(dw[e]))


def test_pallas_refuses_what_the_kernels_do_not_run():
    """Non-block recipes are refused with the fix, by the recipe itself (as for the dense
    GEMM) and by grouped_dot for a recipe built around that check; rows split over devices
    (row_axes) are refused too."""
    with pytest.raises(ValueError, match="block recipe only"):
        fp8.get_recipe("fp8_row", backend="pallas")
    row = dataclasses.replace(fp8.FP8_ROW)  # a copy: the preset itself stays as it is
    object.__setattr__(row, "backend", "pallas")
    x, w, sizes = jnp.zeros((4, 128)), jnp.zeros((2, 128, 64)), jnp.asarray([2, 2])
    with pytest.raises(ValueError, match="block recipe only.*backend='emulate'"):
        grouped_dot(x, w, sizes, row)
    block = fp8.get_recipe("fp8_block", backend="pallas")
    with pytest.raises(NotImplementedError, match="row_axes"):
        grouped_dot(x, w, sizes, block, row_offsets=jnp.zeros(2, jnp.int32), row_axes=("ep",))


def test_grouped_kernels_lower_to_mosaic_gpu_for_cuda(monkeypatch):
    """Mosaic GPU's own lowering for CUDA, on this CPU: the rows form (fprop, dgrad: the
    row tile's expert read from global memory) and the contraction form (wgrad: a pipeline
    whose trip count is read from global memory) become `mosaic_gpu` custom calls; bf16
    activations take the bf16 epilogue, e5m2 gradients the mixed-format wgmma."""
    monkeypatch.setattr(gemm, "use_interpreter", lambda: False)
    recipe = fp8.get_recipe("fp8_block", backend="pallas", bwd_format="e5m2")
    x = jax.ShapeDtypeStruct((200, 300), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 300, 260), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    cot = jax.ShapeDtypeStruct((200, 260), jnp.bfloat16)
    fn = jax.jit(lambda *a: _fwd_and_grads(*a, recipe=recipe))
    hlo = fn.trace(x, w, sizes, cot).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @mosaic_gpu") == 3
