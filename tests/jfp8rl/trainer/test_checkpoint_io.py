"""Checkpoint writes that bound host memory: the manifest's file digests read in pieces (equal
to the one-shot digests of the whole file), and orbax's in-flight limit (the least whole GB
above the largest array; a save under it restores bit for bit)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import jax.numpy as jnp
import numpy as np
import pytest
import xxhash

from jfp8rl.trainer import checkpoint_manifest
from jfp8rl.trainer.checkpoint import Checkpointer, save_limit_gb
from jfp8rl.trainer.checkpoint_manifest import check, file_digest


def reference_digest(data: bytes, hash_name: str) -> str:
    """The digest of `data` in one call of each hash's own package."""
    if hash_name == "xxh3_128":
        return xxhash.xxh3_128(data).hexdigest()
    if hash_name == "blake3":
        return blake3.blake3(data).hexdigest()
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake3", "sha256"])
def test_file_digest_read_in_pieces_equals_the_one_shot_digest(
    hash_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files shorter than, equal to, and several pieces plus a remainder longer than the read
    size (shrunk to 1000 bytes here), and the empty file."""
    monkeypatch.setattr(checkpoint_manifest, "_READ_CHUNK", 1000)
    rng = np.random.default_rng(0)
    for size in (0, 1, 999, 1000, 1001, 7 * 1000 + 13):
        path = tmp_path / f"f{size}"
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path.write_bytes(data)
        assert file_digest(path, hash_name) == reference_digest(data, hash_name), size


def test_save_limit_admits_the_largest_array_by_less_than_a_gb() -> None:
    """orbax refuses an array of its limit's size or more: the limit is the next whole GB
    above the largest array (broadcast arrays: the sizes without the memory)."""

    def sized(nbytes: int) -> np.ndarray:
        return np.broadcast_to(np.uint8(0), (nbytes,))

    assert save_limit_gb({"a": sized(10), "b": {"c": sized(622_329_856)}}) == 1
    assert save_limit_gb({"a": sized(999_999_999)}) == 1
    assert save_limit_gb({"a": sized(1_000_000_000), "s": 3}) == 2
    assert save_limit_gb({"emb": sized(2_489_319_424), "mu": sized(5)}) == 3
    assert save_limit_gb({}) == 1


def test_saves_under_the_limit_restore_bit_for_bit_and_verify(tmp_path: Path) -> None:
    """Two saves of a state under the in-flight limit (random and all-zero arrays, as params
    and a fresh optimizer state) restore equal to what was saved, and pass the full manifest
    check; the limit is set once, from the state."""
    rng = np.random.default_rng(1)
    state = {
        "params": {"w": jnp.asarray(rng.standard_normal((64, 48), dtype=np.float32))},
        "opt": {"mu": jnp.zeros((64, 48)), "count": jnp.asarray(3, jnp.int32)},
    }
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2):
        ckpt.save(step, state, {"step": step})
        assert ckpt.save_gb == 1
    manager = ckpt.manager
    ckpt.save(3, state, {"step": 3})
    assert ckpt.manager is manager  # reopened at the first save only
    for step in (2, 3):
        restored, meta = ckpt.restore(step, state)
        assert meta == {"step": step}
        for key, leaf in (("params", "w"), ("opt", "mu"), ("opt", "count")):
            got, want = np.asarray(restored[key][leaf]), np.asarray(state[key][leaf])
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        assert check(ckpt.directory / str(step), "full") is None
    assert ckpt.all_steps() == [2, 3]
    ckpt.close()
    files = json.loads((ckpt.directory / "3" / "digests.json").read_text())["files"]
    assert any(rel.startswith("state/") for rel in files)
