"""Tensor digests: published test vectors, the default, and a missing hash package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bridge_support import small_hf_state

from rollout_bridge.export import export_weights
from rollout_bridge.weights import MANIFEST, ExportError, hashing
from rollout_bridge.weights.reader import open_export


def test_digest_known_vectors_default_and_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`digest` against published vectors of the empty input (xxHash's sanity test for
    XXH3_128, BLAKE3's and SHA-256's specs); xxh3_128 is the default; an export hashed with a
    package this side lacks is refused with the install command, not loaded unchecked."""
    empty = memoryview(b"")
    assert hashing.digest(empty, "xxh3_128") == "99aa06d3014798d86001c324468d497f"
    assert hashing.digest(empty, "blake3") == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    assert hashing.digest(empty, "sha256") == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )
    assert hashing.default_hash() == "xxh3_128"
    d = export_weights(small_hf_state(), "v", fmt="fp32", root=tmp_path)
    assert json.loads((d / MANIFEST).read_text())["hash"] == "xxh3_128"
    monkeypatch.setitem(sys.modules, "xxhash", None)  # the import now fails
    hashing.hash_module.cache_clear()
    try:
        assert hashing.default_hash() == "blake3"
        with pytest.raises(
            ExportError, match=r"manifest\.json: tensor hash xxh3_128 needs the xxhash package"
        ):
            open_export(d)  # refused before any tensor is read
    finally:
        monkeypatch.undo()
        hashing.hash_module.cache_clear()
