"""FP8 KV-cache scales as checkpoint tensors: their names, and splitting them off an export.

A pushed export may carry one f32 scalar per attention layer and kind,

    model.layers.<l>.self_attn.k_scale      model.layers.<l>.self_attn.v_scale

the names FP8 checkpoints use for vLLM's per-layer KV-cache scales (vLLM remaps them onto
`model.layers.<l>.self_attn.attn.k_scale`). The cache stores e4m3(k / k_scale) and attention
reads q * k_scale (`models.kv_quant`). numpy only: the vLLM plugin imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from rollout_bridge.weights import ExportError

_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def kv_scale_name(layer: int, kind: str) -> str:
    """The tensor name of layer `layer`'s `kind` ("k" or "v") scale."""
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def is_kv_scale(name: str) -> bool:
    """Whether `name` is a per-layer K or V cache scale."""
    return _KV_SCALE.match(name) is not None


def kv_scale_tensors(k_scale: Iterable[float], v_scale: Iterable[float]) -> dict[str, np.ndarray]:
    """{name: f32 scalar} of per-layer K and V scales (sequences of one float per layer)."""
    out = {}
    for kind, scales in (("k", k_scale), ("v", v_scale)):
        for layer, s in enumerate(np.asarray(list(scales), np.float32).reshape(-1)):
            out[kv_scale_name(layer, kind)] = np.asarray(s, np.float32).reshape(())
    return out


def split_kv_scales(
    tensors: Mapping[str, Any], num_layers: int
) -> tuple[dict[str, Any], tuple[np.ndarray, np.ndarray] | None]:
    """(the other tensors, (k_scale [L], v_scale [L]) f32 or None when there are none).

    Raises ExportError naming what is wrong when only some layers' scales are there, or a
    scale is not a positive finite scalar."""
    rest = {n: x for n, x in tensors.items() if not is_kv_scale(n)}
    found = {n: x for n, x in tensors.items() if is_kv_scale(n)}
    if not found:
        return rest, None
    out = np.zeros((2, num_layers), np.float32)
    for i, kind in enumerate("kv"):
        for layer in range(num_layers):
            name = kv_scale_name(layer, kind)
            if name not in found:
                raise ExportError(
                    f"export has KV-cache scales but lacks {name}; push one k_scale and one "
                    f"v_scale for each of the {num_layers} layers"
                )
            s = np.asarray(found.pop(name), np.float32)
            if s.size != 1 or not np.isfinite(s).all() or float(s.reshape(())) <= 0:
                raise ExportError(f"{name} = {s!r}: a KV-cache scale is one positive float")
            out[i, layer] = s.reshape(())
    if found:
        raise ExportError(
            f"KV-cache scales {sorted(found)[:3]} name layers beyond the model's {num_layers}"
        )
    return rest, (out[0], out[1])
