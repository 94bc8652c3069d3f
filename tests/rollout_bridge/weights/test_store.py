"""Export roots: old versions deleted, a version replaced, the oldest version's file recycled
(never the served one), a killed writer leaving nothing loadable, dead processes' roots reaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from bridge_support import ROOT, bf16_reference, small_hf_state

from rollout_bridge.export import export_weights
from rollout_bridge.weights import MANIFEST, TENSOR_FILE, ExportError
from rollout_bridge.weights.reader import load_export
from rollout_bridge.weights.store import cleanup_exports, default_root, list_exports, write_export


def test_old_versions_are_cleaned_up_and_same_version_is_replaced(tmp_path: Path) -> None:
    st = small_hf_state()
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
    st = small_hf_state()
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
        np.testing.assert_array_equal(got[name].astype(np.float64), bf16_reference(w + 2))
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


def test_default_root_reaps_folders_of_dead_processes(monkeypatch: pytest.MonkeyPatch) -> None:
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
