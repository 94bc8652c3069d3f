"""The embedded engine's FP8 KV-cache scales: which ones serve the installed weights.

Rules (`EmbeddedBackend` docs): an install takes the scales an export carries (the trainer's
push); otherwise it recalibrates on the rows (prompt ++ response) of the latest generation,
with the new weights (`models.kv_calibration`, amax / 448 per layer); before any generation the
first call calibrates on its own tokens before it runs. So the cache never runs on the scales
of older weights, nor on vLLM's uncalibrated default 1.0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.fp8 import Recipe
from models.kv_quant import KVScales, check_kv_cache_dtype
from rollout_bridge.engine.programs import calibrate


class KVCacheScales:
    """KV-cache dtype, the installed weights' scales (`scales`, None: none yet or no FP8
    cache) and the calibration rows kept from the latest generation. Not locked: the engine
    calls it with its own lock held (`current`, `keep_rows`) or before it takes it."""

    def __init__(self, kv_cache_dtype: str, graphdef: Any, recipe: Recipe) -> None:
        check_kv_cache_dtype(kv_cache_dtype)
        self.fp8 = kv_cache_dtype == "fp8"
        self.graphdef = graphdef
        self.recipe = recipe
        self.scales: KVScales | None = None
        self._rows: tuple[jax.Array, jax.Array] | None = None

    def for_install(
        self, params: Any, pushed: tuple[np.ndarray, np.ndarray] | None
    ) -> KVScales | None:
        """The scales to serve newly installed `params` with: the pushed (k [L], v [L]), else
        a calibration of `params` on the kept rows, else None (the next call calibrates)."""
        if not self.fp8:
            return None
        if pushed is not None:
            return KVScales(jnp.asarray(pushed[0]), jnp.asarray(pushed[1]))
        if self._rows is None:
            return None
        return calibrate(self.graphdef, params, *self._rows, recipe=self.recipe)

    def current(
        self, params: Any, tokens: jax.Array, mask: jax.Array, real_rows: np.ndarray
    ) -> KVScales | None:
        """The scales to run (tokens, mask) with, calibrated first on its `real_rows` (the
        batch's padding rows hold a dummy token) when none are set."""
        if self.fp8 and self.scales is None:
            mask = mask * jnp.asarray(real_rows, mask.dtype)[:, None]
            self.scales = calibrate(self.graphdef, params, tokens, mask, recipe=self.recipe)
        return self.scales

    def keep_rows(
        self,
        prompt: np.ndarray,
        prompt_mask: np.ndarray,
        toks: np.ndarray,
        lens: np.ndarray,
        real_rows: np.ndarray,
    ) -> None:
        """Keeps a decoded chunk's `real_rows` (left-padded prompt ++ response: real tokens
        contiguous) to calibrate the next install on."""
        if not self.fp8:
            return
        live = np.arange(toks.shape[1])[None, :] < lens[:, None]
        tokens = np.concatenate([prompt, np.where(live, toks, 0)], axis=1)
        mask = np.concatenate([prompt_mask, live], axis=1).astype(np.int32)
        rows = np.asarray(real_rows, bool)
        self._rows = (jnp.asarray(tokens[rows]), jnp.asarray(mask[rows]))
