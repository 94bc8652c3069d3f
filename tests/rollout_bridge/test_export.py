"""Weight export: formats against independent numpy references, manifest integrity, atomicity."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np
import pytest
import xxhash
from safetensors import safe_open

from models import fp8
from rollout_bridge import weight_files
from rollout_bridge.export import export_weights, is_fp8_linear, to_rollout_format
from rollout_bridge.weight_files import (
    MANIFEST,
    TENSOR_FILE,
    ExportError,
    cleanup_exports,
    list_exports,
    load_export,
    sha256_file,
    write_export,
)

ROOT = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    """A small HF-named state with linears of non-multiple-of-128 shapes, a bias and a norm."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.normal(size=(40, 24)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(200, 300)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.bias": rng.normal(size=(200,)).astype(np.float32),
        "model.layers.0.mlp.down_proj.weight": (
            rng.normal(size=(130, 129)) * np.geomspace(1e-3, 1e2, 129)
        ).astype(np.float32),
        "model.layers.0.input_layernorm.weight": rng.normal(size=(24,)).astype(np.float32),
        "model.norm.weight": np.ones((24,), np.float32),
    }


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float64 by bit arithmetic (round to nearest, ties to even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


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
    st = _state()
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
        np.testing.assert_array_equal(got[name].astype(np.float64), _bf16_reference(w))
        assert man["tensors"][name] == {
            "file": TENSOR_FILE,
            "dtype": "BF16",
            "shape": list(w.shape),
            "xxh3_128": man["tensors"][name]["xxh3_128"],
        }


def test_fp8_format_matches_numpy_reference_and_models_fp8(tmp_path: Path) -> None:
    st = _state()
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
            np.testing.assert_array_equal(got[name].astype(np.float64), _bf16_reference(w))
    # fp8_fp32: the same FP8 values, dequantized, for servers without FP8 kernels.
    tensors, qcfg = to_rollout_format(st, "fp8_fp32")
    assert qcfg is None and set(tensors) == set(st)
    for name in linears:
        q_ref, s_ref = _fp8_block_reference(st[name])
        expected = (q_ref * _expand(s_ref, st[name].shape)).astype(np.float32)
        np.testing.assert_array_equal(tensors[name], expected)


_REFERENCE_DIGEST = {
    "xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(),
    "blake3": lambda b: blake3.blake3(b).hexdigest(),
    "sha256": lambda b: hashlib.sha256(b).hexdigest(),
}


@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake3", "sha256"])
def test_manifest_hashes_and_safetensors_compatibility(tmp_path: Path, hash_name: str) -> None:
    st = _state()
    d = write_export(tmp_path, "step-3", st, fmt="fp32", hash_name=hash_name)
    man = json.loads((d / MANIFEST).read_text())
    assert man["hash"] == hash_name and man["format_version"] == 2
    assert man["files"][TENSOR_FILE]["size"] == (d / TENSOR_FILE).stat().st_size
    # The stock safetensors reader loads our file; hashes are over each tensor's bytes.
    with safe_open(str(d / TENSOR_FILE), framework="np") as f:
        assert set(f.keys()) == set(st) == set(man["tensors"])
        for name in f.keys():
            x = f.get_tensor(name)
            np.testing.assert_array_equal(x, st[name])
            want = _REFERENCE_DIGEST[hash_name](x.tobytes())
            assert man["tensors"][name][hash_name] == want
            assert man["tensors"][name]["shape"] == list(x.shape)


def test_digest_known_vectors_default_and_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`digest` against published vectors of the empty input (xxHash's sanity test for
    XXH3_128, BLAKE3's and SHA-256's specs); xxh3_128 is the default; an export hashed with a
    package this side lacks is refused with the install command, not loaded unchecked."""
    empty = memoryview(b"")
    assert weight_files.digest(empty, "xxh3_128") == "99aa06d3014798d86001c324468d497f"
    assert weight_files.digest(empty, "blake3") == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    assert weight_files.digest(empty, "sha256") == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert weight_files.default_hash() == "xxh3_128"
    d = export_weights(_state(), "v", fmt="fp32", root=tmp_path)
    assert json.loads((d / MANIFEST).read_text())["hash"] == "xxh3_128"
    monkeypatch.setitem(sys.modules, "xxhash", None)  # the import now fails
    weight_files._hash_module.cache_clear()
    try:
        assert weight_files.default_hash() == "blake3"
        with pytest.raises(
            ExportError, match=r"manifest\.json: tensor hash xxh3_128 needs the xxhash package"
        ):
            weight_files.open_export(d)  # refused before any tensor is read
    finally:
        monkeypatch.undo()
        weight_files._hash_module.cache_clear()


@pytest.mark.parametrize("reserve", [None, 64])
def test_streamed_export_bounded_header_and_moved_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserve: int | None
) -> None:
    """`export_weights` streams (name, array) pairs: the header is written last into a
    reserved region (padded with spaces), or, when it does not fit (reserve 64 bytes), the
    data is moved once. Either way the stock safetensors reader and `load_export` read back
    exactly a dict export's tensors and hashes."""
    import rollout_bridge.weight_files as wf

    if reserve is not None:
        monkeypatch.setattr(wf, "_HEADER_RESERVE", reserve)
    st = _state()
    streamed = export_weights(iter(list(st.items())), "s", fmt="bf16", root=tmp_path / "a")
    ref = wf.write_export(tmp_path / "b", "s", to_rollout_format(st, "bf16")[0], fmt="bf16")
    got, man = load_export(streamed)
    want, man_ref = load_export(ref)
    assert man["tensors"] == man_ref["tensors"]
    with safe_open(str(streamed / TENSOR_FILE), framework="np") as f:
        assert list(f.keys()) == sorted(st)
    for name in st:
        np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))
    _, start, _ = wf.read_safetensors_header(ref / TENSOR_FILE)
    assert start % 8 == 0 and start < 2048  # a dict export's header is exactly sized
    _, start, _ = wf.read_safetensors_header(streamed / TENSOR_FILE)
    assert start % 8 == 0 and start == (wf._HEADER_RESERVE if reserve is None else start)


def _flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake3", "sha256"])
def test_tampered_truncated_and_mismatched_exports_are_refused(
    tmp_path: Path, hash_name: str, mapped: bool
) -> None:
    """Read into memory, or mapped (the vLLM plugin's path): the same refusals."""
    load_export = functools.partial(weight_files.load_export, mapped=mapped)
    st = _state()
    d = write_export(tmp_path, "v1", st, fmt="fp32", hash_name=hash_name)
    good_manifest_sha = sha256_file(d / MANIFEST)
    load_export(d, expected_version="v1", expected_manifest_sha256=good_manifest_sha)

    with pytest.raises(ExportError, match="holds version 'v1', expected 'v2'"):
        load_export(d, expected_version="v2")
    with pytest.raises(ExportError, match="sha256 .* != expected"):
        load_export(d, expected_manifest_sha256="0" * 64)

    # The last tensor in the file is model.norm.weight: flip one bit of its last byte.
    _flip_byte(d / TENSOR_FILE, 1)
    with pytest.raises(ExportError, match=rf"{hash_name} of tensor 'model\.norm\.weight'"):
        load_export(d)
    load_export(d, verify=False)  # sizes still agree: only the hash check catches it

    d = export_weights(st, "v2", fmt="fp32", root=tmp_path)
    data = (d / TENSOR_FILE).read_bytes()
    (d / TENSOR_FILE).write_bytes(data[: len(data) - 10])
    with pytest.raises(ExportError, match="truncated"):
        load_export(d, verify=False)

    d = export_weights(st, "v3", fmt="fp32", root=tmp_path)
    man = json.loads((d / MANIFEST).read_text())
    man["tensors"]["model.norm.weight"]["shape"] = [12, 2]
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ExportError, match=r"model\.norm\.weight.*F32\[24\].*F32\[12, 2\]"):
        load_export(d)

    (d / MANIFEST).unlink()
    with pytest.raises(ExportError, match="not a complete weight export"):
        load_export(d)
    with pytest.raises(ExportError, match="cannot be a folder name"):
        export_weights(st, "../escape", root=tmp_path)


@pytest.mark.parametrize("mapped", [False, True])
def test_open_export_streams_verified_tensors_and_stops_at_the_tampered_one(
    tmp_path: Path, mapped: bool
) -> None:
    """The vLLM plugin's path: every check but the digests before `open_export` returns; the
    stream yields tensors in file order, each equal to the written one, up to the first whose
    digest fails; `check_export_files` reads no tensor byte (a tampered tensor passes it, a
    truncated file does not)."""
    st = _state()
    d = write_export(tmp_path, "v1", st, fmt="fp32")
    names = list(json.loads((d / MANIFEST).read_text())["tensors"])  # file order
    assert names == list(st)
    header, start, _ = weight_files.read_safetensors_header(d / TENSOR_FILE)
    victim = names[3]  # a tensor in the middle: three verified ones come before it
    lo, _hi = header[victim]["data_offsets"]
    data = bytearray((d / TENSOR_FILE).read_bytes())
    data[start + lo + 5] ^= 0x10
    (d / TENSOR_FILE).write_bytes(bytes(data))
    assert weight_files.check_export_files(d)["version"] == "v1"

    manifest, stream = weight_files.open_export(d, mapped=mapped)
    assert manifest["version"] == "v1"
    got = []
    with pytest.raises(ExportError, match=rf"of tensor '{re.escape(victim)}' does not match"):
        for name, arr in stream:
            got.append(name)
            np.testing.assert_array_equal(arr, st[name])
    assert got == names[:3]

    # Closing a stream early is clean (its readers stop, its file closes), and a manifest
    # check still fails before any tensor is read.
    _, stream = weight_files.open_export(d, mapped=mapped)
    assert next(stream)[0] == names[0]
    stream.close()
    with pytest.raises(ExportError, match="expected 'v2'"):
        weight_files.open_export(d, expected_version="v2", mapped=mapped)
    (d / TENSOR_FILE).write_bytes(bytes(data[:-10]))
    with pytest.raises(ExportError, match="truncated"):
        weight_files.check_export_files(d)


def test_old_versions_are_cleaned_up_and_same_version_is_replaced(tmp_path: Path) -> None:
    st = _state()
    for k in range(4):
        export_weights({n: w + k for n, w in st.items()}, f"step-{k}", fmt="fp32", root=tmp_path)
    assert [p.name for p in list_exports(tmp_path)] == ["step-2", "step-3"]
    d = export_weights({n: w + 10 for n, w in st.items()}, "step-3", fmt="fp32", root=tmp_path)
    got, _ = load_export(d)
    np.testing.assert_array_equal(got["model.norm.weight"], st["model.norm.weight"] + 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def test_a_write_recycles_the_oldest_versions_file_and_never_the_newest(tmp_path: Path) -> None:
    """With `keep` versions there, the next write takes over the oldest one's tensor file (same
    inode: its pages are overwritten, not freed and faulted in again) and cuts it to the new
    size; the newest version is never touched. Every version read back equals its input."""
    st = _state()
    d0 = export_weights(st, "v0", fmt="fp32", root=tmp_path)
    ino0 = (d0 / TENSOR_FILE).stat().st_ino
    d1 = export_weights({n: w + 1 for n, w in st.items()}, "v1", fmt="fp32", root=tmp_path)
    ino1 = (d1 / TENSOR_FILE).stat().st_ino
    # A smaller export (bf16) into v0's file: the stale tail is cut off.
    d2 = export_weights({n: w + 2 for n, w in st.items()}, "v2", fmt="bf16", root=tmp_path)
    assert (d2 / TENSOR_FILE).stat().st_ino == ino0 and not d0.exists()
    assert (d1 / TENSOR_FILE).stat().st_ino == ino1
    man = json.loads((d2 / MANIFEST).read_text())
    assert (d2 / TENSOR_FILE).stat().st_size == man["files"][TENSOR_FILE]["size"]
    got, _ = load_export(d2)
    for name, w in st.items():
        np.testing.assert_array_equal(got[name].astype(np.float64), _bf16_reference(w + 2))
    got, _ = load_export(d1)
    for name, w in st.items():
        np.testing.assert_array_equal(got[name], w + 1)
    # keep=1 never recycles the only (served) version: a failed write would leave it intact.
    solo = tmp_path / "solo"
    e0 = export_weights(st, "a", fmt="fp32", root=solo, keep=1)
    ino = (e0 / TENSOR_FILE).stat().st_ino
    with pytest.raises(ExportError, match="unknown tensor hash"):
        write_export(solo, "b", st, fmt="fp32", keep=1, hash_name="md5")
    assert load_export(e0)[1]["version"] == "a" and (e0 / TENSOR_FILE).stat().st_ino == ino


def test_mapped_load_views_the_file_and_equals_the_read(tmp_path: Path) -> None:
    """`load_export(mapped=True)` (the vLLM plugin's path) returns the same values as a read,
    as views of a mapping of the tensor file (no copy)."""
    st = {**_state(), "model.empty": np.zeros((0, 3), np.float32)}
    d = export_weights(st, "a", fmt="fp32", root=tmp_path)
    read, _ = load_export(d)
    mapped, manifest = load_export(d, mapped=True)
    assert manifest["version"] == "a" and set(mapped) == set(st)
    for name, w in st.items():
        np.testing.assert_array_equal(mapped[name], w)
        np.testing.assert_array_equal(read[name], w)
    base = mapped["model.norm.weight"]
    while not isinstance(base, memoryview):
        base = base.base
    assert isinstance(base.obj, mmap.mmap)


def test_format_version_1_manifest_still_loads_and_verifies(tmp_path: Path) -> None:
    """A manifest from before the "hash" key (format_version 1, per-tensor "sha256") loads, and
    a tampered tensor in it is still refused."""
    st = _state()
    d = write_export(tmp_path, "old", st, fmt="fp32", hash_name="sha256")
    man = json.loads((d / MANIFEST).read_text())
    man["format_version"] = 1
    del man["hash"]
    (d / MANIFEST).write_text(json.dumps(man))
    got, _ = load_export(d)
    np.testing.assert_array_equal(got["model.norm.weight"], st["model.norm.weight"])
    _flip_byte(d / TENSOR_FILE, 1)
    with pytest.raises(ExportError, match=r"sha256 of tensor 'model\.norm\.weight'"):
        load_export(d)


def test_push_format_and_fetch_dtype_per_backend() -> None:
    """The format a run pushes (`rollout.export_format`, else the backend's default) fixes the
    dtype every process fetches the params in: bf16 is rounded on device, FP8 and fp32 pushes
    need the float32 masters."""
    from jfp8rl.config import RolloutConfig
    from jfp8rl.trainer.backends import push_format
    from rollout_bridge.export import fetch_dtype

    cases = [
        (RolloutConfig(backend="http"), "bf16", "bfloat16"),
        (RolloutConfig(backend="embedded"), "fp8", "float32"),  # recipe fp8_block
        (RolloutConfig(backend="embedded", recipe="fp8_tensor"), "fp32", "float32"),
        (RolloutConfig(backend="embedded", export_format="bf16"), "bf16", "bfloat16"),
        (RolloutConfig(backend="http", export_format="fp8_fp32"), "fp8_fp32", "float32"),
    ]
    for r, fmt, dtype in cases:
        assert (push_format(r), fetch_dtype(push_format(r))) == (fmt, dtype), r


_CRASH_WRITER = """
import sys, numpy as np
from rollout_bridge.export import export_weights
root = sys.argv[1]
st = {f"model.layers.{i}.mlp.up_proj.weight": np.full((2048, 2048), i, np.float32)
      for i in range(12)}
export_weights(st, "v-small", fmt="fp32", root=root)
print("ready", flush=True)
while True:
    export_weights(st, "v-big", fmt="fp32", root=root, keep=5)
"""


def test_killed_writer_leaves_no_loadable_partial_export(tmp_path: Path) -> None:
    """SIGKILL a process in the middle of exporting 200 MB: every folder a server could pick
    (`list_exports`) still loads and verifies, and the dead writer's partial folder is removed
    by the next cleanup."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".partial-v-big") for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline, "the writer never started the second export"
            time.sleep(0.005)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    complete = list_exports(tmp_path)
    assert "v-small" in [p.name for p in complete]
    for d in complete:
        tensors, man = load_export(d)
        assert set(tensors) == set(man["tensors"])
    cleanup_exports(tmp_path, keep=5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_format_layer_imports_no_jax() -> None:
    """The vLLM side imports `weight_files`; the client modules must not pull in jax either."""
    code = (
        "import sys; import rollout_bridge.weight_files, rollout_bridge.export, "
        "rollout_bridge.http_client; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'flax'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_default_root_reaps_folders_of_dead_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_bridge.weight_files import default_root

    monkeypatch.delenv("JFP8RL_EXPORT_ROOT", raising=False)
    mine = default_root()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = mine.parent / f"run-{int(dead.stdout)}"
    (stale / "step-0").mkdir(parents=True)
    assert default_root() == mine
    assert not stale.exists()
