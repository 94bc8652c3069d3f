"""Checkpoints of the pre-stacking layout (per-layer params) fail with a message that names it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jfp8rl.checkpoint import Checkpointer


def test_per_layer_checkpoint_fails_clearly(tmp_path: Path) -> None:
    w = np.zeros((4, 4), np.float32)
    old = {"params": {"model": {"layers": {"0": {"w": w}, "1": {"w": w}}}}}
    ck = Checkpointer(tmp_path, keep=1)
    ck.save(1, old, {"step": 1})
    like = {"params": {"model": {"layers": {"w": np.zeros((2, 4, 4), np.float32)}}}}
    with pytest.raises(ValueError, match=r"per-layer params.*stack_per_layer_layers"):
        ck.restore(1, like)
    ck.close()
