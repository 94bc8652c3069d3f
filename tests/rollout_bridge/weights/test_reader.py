"""Reading an export: every refusal (tampered, truncated, mismatched, stale, another format
version), the verified stream and its early close, and the mapped load (the vLLM plugin's)."""

from __future__ import annotations

import functools
import json
import mmap
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bridge_support import ROOT, flip_tensor_bit, small_hf_state

from rollout_bridge.export import export_weights
from rollout_bridge.weights import MANIFEST, TENSOR_FILE, ExportError, reader
from rollout_bridge.weights.hashing import sha256_file
from rollout_bridge.weights.store import write_export


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake3", "sha256"])
def test_tampered_truncated_and_mismatched_exports_are_refused(
    tmp_path: Path, hash_name: str, mapped: bool
) -> None:
    """Read into memory, or mapped (the vLLM plugin's path): the same refusals."""
    load_export = functools.partial(reader.load_export, mapped=mapped)
    st = small_hf_state()
    d = write_export(tmp_path, "v1", st, fmt="fp32", hash_name=hash_name)
    good_manifest_sha = sha256_file(d / MANIFEST)
    load_export(d, expected_version="v1", expected_manifest_sha256=good_manifest_sha)

    with pytest.raises(ExportError, match="holds version 'v1', expected 'v2'"):
        load_export(d, expected_version="v2")
    with pytest.raises(ExportError, match="sha256 .* != expected"):
        load_export(d, expected_manifest_sha256="0" * 64)

    victim = flip_tensor_bit(d, "last")
    with pytest.raises(ExportError, match=rf"{hash_name} of tensor '{re.escape(victim)}'"):
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

    man["format_version"] = 1
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ExportError, match="format_version 1, this reader needs 2"):
        load_export(d)
    del man["hash"]
    man["format_version"] = 2
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ExportError, match="unknown tensor hash None"):
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
    st = small_hf_state()
    d = write_export(tmp_path, "v1", st, fmt="fp32")
    names = list(json.loads((d / MANIFEST).read_text())["tensors"])  # file order
    assert names == list(st)
    victim = flip_tensor_bit(d, 3)  # a tensor in the middle: three verified ones come before it
    assert victim == names[3]
    assert reader.check_export_files(d)["version"] == "v1"

    stream, manifest = reader.open_export(d, mapped=mapped)
    assert manifest["version"] == "v1"
    got = []
    with pytest.raises(ExportError, match=rf"of tensor '{re.escape(victim)}' does not match"):
        for name, arr in stream:
            got.append(name)
            np.testing.assert_array_equal(arr, st[name])
    assert got == names[:3]

    # Closing a stream early is clean (its readers stop, its file closes), and a manifest
    # check still fails before any tensor is read.
    stream, _ = reader.open_export(d, mapped=mapped)
    assert next(stream)[0] == names[0]
    stream.close()
    with pytest.raises(ExportError, match="expected 'v2'"):
        reader.open_export(d, expected_version="v2", mapped=mapped)
    data = (d / TENSOR_FILE).read_bytes()
    (d / TENSOR_FILE).write_bytes(data[:-10])
    with pytest.raises(ExportError, match="truncated"):
        reader.check_export_files(d)


def test_mapped_load_views_the_file_and_equals_the_read(tmp_path: Path) -> None:
    """`load_export(mapped=True)` (the vLLM plugin's path) returns the same values as a read,
    as views of a mapping of the tensor file (no copy)."""
    st = {**small_hf_state(), "model.empty": np.zeros((0, 3), np.float32)}
    d = export_weights(st, "a", fmt="fp32", root=tmp_path)
    read, _ = reader.load_export(d)
    mapped, manifest = reader.load_export(d, mapped=True)
    assert manifest["version"] == "a" and set(mapped) == set(st)
    for name, w in st.items():
        np.testing.assert_array_equal(mapped[name], w)
        np.testing.assert_array_equal(read[name], w)
    base = mapped["model.norm.weight"]
    while not isinstance(base, memoryview):
        base = base.base
    assert isinstance(base.obj, mmap.mmap)


def test_weights_package_imports_no_jax() -> None:
    """The vLLM plugin imports `rollout_bridge.weights` in vLLM's venv, which has neither jax
    nor ml_dtypes: no module of the package may pull them in (tests/rollout_bridge/
    test_vllm_plugin.py imports the plugin itself there)."""
    code = (
        "import sys; import rollout_bridge.weights.reader, rollout_bridge.weights.store; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'ml_dtypes')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
