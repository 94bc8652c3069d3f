"""Mesh shapes from `train.mesh` (one axis -1 = the remaining devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_resolve_mesh_shape() -> None:
    from jfp8rl.parallel.mesh import resolve_mesh_shape

    assert resolve_mesh_shape(1, -1, 2, 8) == (1, 4, 2)
    assert resolve_mesh_shape(2, 2, 1, 8) == (2, 2, 1)  # the first 4 of 8 devices
    with pytest.raises(ValueError, match="not a multiple"):
        resolve_mesh_shape(3, -1, 1, 8)
    with pytest.raises(ValueError, match="needs 16 devices, only 8"):
        resolve_mesh_shape(1, 16, 1, 8)
