"""Weight export formats against independent numpy references (bit arithmetic for bf16 and
e4m3) and the trainer's own FP8 quantizer; the push format each backend fetches params in."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from bridge_support import bf16_reference, small_hf_state

from jfp8rl.config import RolloutConfig
from jfp8rl.trainer.backends import push_format
from models import fp8
from rollout_bridge.export import export_weights, fetch_dtype, is_fp8_linear, to_rollout_format
from rollout_bridge.weights import TENSOR_FILE
from rollout_bridge.weights.reader import load_export


def _e4m3_round(y: np.ndarray) -> np.ndarray:
    """Rounds float64 values in [-448, 448] to the e4m3fn grid (3 mantissa bits, min normal
    exponent -6, subnormal quantum 2^-9), ties to even."""
    a = np.abs(y)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = 2.0 ** (np.maximum(e, -6) - 3)
    return np.sign(y) * np.round(a / quantum) * quantum  # np.round: ties to even


def _fp8_block_reference(w: np.ndarray, b: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(q as float64, scale) per b x b block: s = amax * f32(1/448), q = e4m3(w / s)."""
    n, k = w.shape
    s = np.zeros((-(-n // b), -(-k // b)), np.float32)
    q = np.zeros_like(w, dtype=np.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b : (i + 1) * b, j * b : (j + 1) * b]
            amax = np.float32(np.abs(blk).max())
            s[i, j] = amax * np.float32(1.0 / 448.0) if amax > 0 else np.float32(1.0)
            y = np.clip(blk.astype(np.float32) / s[i, j], -448.0, 448.0).astype(np.float64)
            q[i * b : (i + 1) * b, j * b : (j + 1) * b] = _e4m3_round(y)
    return q, s


def _expand(s: np.ndarray, shape: tuple[int, int], b: int = 128) -> np.ndarray:
    return np.repeat(np.repeat(s.astype(np.float64), b, 0), b, 1)[: shape[0], : shape[1]]


def test_fp32_and_bf16_formats(tmp_path: Path) -> None:
    st = small_hf_state()
    d32 = export_weights(st, "v32", fmt="fp32", root=tmp_path)
    got, man = load_export(d32)
    assert man["version"] == "v32" and man["format"] == "fp32"
    assert man["quantization_config"] is None
    for name, w in st.items():
        np.testing.assert_array_equal(got[name], w)
    d16 = export_weights(st, "v16", fmt="bf16", root=tmp_path)
    got, man = load_export(d16)
    for name, w in st.items():
        assert got[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[name].astype(np.float64), bf16_reference(w))
        assert man["tensors"][name] == {
            "file": TENSOR_FILE,
            "dtype": "BF16",
            "shape": list(w.shape),
            "xxh3_128": man["tensors"][name]["xxh3_128"],
        }


def test_fp8_format_matches_numpy_reference_and_models_fp8(tmp_path: Path) -> None:
    st = small_hf_state()
    d = export_weights(st, "v8", fmt="fp8", root=tmp_path)
    got, man = load_export(d)
    assert man["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    linears = [n for n, w in st.items() if is_fp8_linear(n, w.shape)]
    assert linears == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    recipe = fp8.get_recipe("fp8_block")
    for name in linears:
        w = st[name]
        q, s = got[name], got[name.removesuffix(".weight") + ".weight_scale_inv"]
        assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
        assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        q_ref, s_ref = _fp8_block_reference(w)
        np.testing.assert_array_equal(s, s_ref)
        np.testing.assert_array_equal(q.astype(np.float64), q_ref)
        deq = q.astype(np.float64) * _expand(s, w.shape)
        # Exactly what the trainer's quantizer holds.
        tq, ts = fp8.quantize_weight(w, recipe)
        trainer = np.asarray(fp8.dequantize(tq, ts, fp8.weight_tile(recipe)), np.float64)
        np.testing.assert_array_equal(deq.astype(np.float32), trainer.astype(np.float32))
        assert np.abs(deq - w).max() <= np.abs(w).max() / 16  # e4m3: 3 mantissa bits
    for name, w in st.items():  # everything else stays bf16
        if name not in linears:
            np.testing.assert_array_equal(got[name].astype(np.float64), bf16_reference(w))
    # fp8_fp32: the same FP8 values, dequantized, for servers without FP8 kernels.
    tensors, qcfg = to_rollout_format(st, "fp8_fp32")
    assert qcfg is None and set(tensors) == set(st)
    for name in linears:
        q_ref, s_ref = _fp8_block_reference(st[name])
        expected = (q_ref * _expand(s_ref, st[name].shape)).astype(np.float32)
        np.testing.assert_array_equal(tensors[name], expected)


def test_push_format_and_fetch_dtype_per_backend() -> None:
    """The format a run pushes (`rollout.export_format`, else the backend's default) fixes the
    dtype every process fetches the params in: bf16 is rounded on device, FP8 and fp32 pushes
    need the float32 masters."""
    cases = [
        (RolloutConfig(backend="http"), "bf16", "bfloat16"),
        (RolloutConfig(backend="embedded"), "fp8", "float32"),  # recipe fp8_block
        (RolloutConfig(backend="embedded", recipe="fp8_tensor"), "fp32", "float32"),
        (RolloutConfig(backend="embedded", export_format="bf16"), "bf16", "bfloat16"),
        (RolloutConfig(backend="http", export_format="fp8_fp32"), "fp8_fp32", "float32"),
    ]
    for r, fmt, dtype in cases:
        assert (push_format(r), fetch_dtype(push_format(r))) == (fmt, dtype), r


def test_fp8_linears_of_every_moe_naming() -> None:
    """Routed experts (Qwen3-MoE / Qwen2-MoE names and Mixtral's w1/w2/w3) and a shared expert
    are FP8 linears; routers (`mlp.gate`, `block_sparse_moe.gate`), the shared expert's gate,
    norms and the embedding are not."""
    fp8_names = [
        "model.layers.3.mlp.experts.7.gate_proj.weight",
        "model.layers.3.mlp.shared_expert.down_proj.weight",
        "model.layers.0.block_sparse_moe.experts.1.w1.weight",
        "model.layers.0.block_sparse_moe.experts.1.w2.weight",
        "model.layers.0.block_sparse_moe.experts.1.w3.weight",
    ]
    high = [
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.1.w4.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
    ]
    assert all(is_fp8_linear(n, (8, 8)) for n in fp8_names)
    assert not any(is_fp8_linear(n, (8, 8)) for n in high)
