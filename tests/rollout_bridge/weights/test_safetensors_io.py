"""The tensor file: the stock safetensors reader loads ours, digests are over each tensor's
bytes (checked with each hash package's own API), and a streamed export's header."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import numpy as np
import pytest
import xxhash
from bridge_support import small_hf_state
from safetensors import safe_open

from rollout_bridge.export import export_weights, to_rollout_format
from rollout_bridge.weights import MANIFEST, TENSOR_FILE, safetensors_io
from rollout_bridge.weights.reader import load_export
from rollout_bridge.weights.store import write_export

_REFERENCE_DIGEST = {
    "xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(),
    "blake3": lambda b: blake3.blake3(b).hexdigest(),
    "sha256": lambda b: hashlib.sha256(b).hexdigest(),
}


@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake3", "sha256"])
def test_manifest_hashes_and_safetensors_compatibility(tmp_path: Path, hash_name: str) -> None:
    st = small_hf_state()
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


@pytest.mark.parametrize("reserve", [None, 64])
def test_streamed_export_bounded_header_and_moved_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserve: int | None
) -> None:
    """`export_weights` streams (name, array) pairs: the header is written last into a
    reserved region (padded with spaces), or, when it does not fit (reserve 64 bytes), the
    data is moved once. Either way the stock safetensors reader and `load_export` read back
    exactly a dict export's tensors and hashes."""
    if reserve is not None:
        monkeypatch.setattr(safetensors_io, "_HEADER_RESERVE", reserve)
    st = small_hf_state()
    streamed = export_weights(iter(list(st.items())), "s", fmt="bf16", root=tmp_path / "a")
    ref = write_export(tmp_path / "b", "s", to_rollout_format(st, "bf16")[0], fmt="bf16")
    got, man = load_export(streamed)
    want, man_ref = load_export(ref)
    assert man["tensors"] == man_ref["tensors"]
    with safe_open(str(streamed / TENSOR_FILE), framework="np") as f:
        assert list(f.keys()) == sorted(st)
    for name in st:
        np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))
    _, start, _ = safetensors_io.read_safetensors_header(ref / TENSOR_FILE)
    assert start % 8 == 0 and start < 2048  # a dict export's header is exactly sized
    _, start, _ = safetensors_io.read_safetensors_header(streamed / TENSOR_FILE)
    assert start % 8 == 0 and start == (
        safetensors_io._HEADER_RESERVE if reserve is None else start
    )
