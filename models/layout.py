"""Converting trees in the per-layer param layout to the stacked one the model uses.

Per-layer: `model.layers.{i}.<...>` with integer keys 0..L-1 (orbax writes them back as strings
"0".."L-1"), each leaf one layer's tensor. Stacked: `model.layers.<...>` with every leaf on a
leading layer axis [L, ...] (`models.decoder.stacked_layers`). The conversion is exact (a
`numpy.stack`) and applies wherever such a `layers` dict sits, so the params and an optimizer
state's moments (`mu`, `nu`, which mirror the params) convert alike.

Use: restore a per-layer checkpoint without a target (raw nested dicts of arrays), check
`has_per_layer_layers`, convert with `stack_per_layer_layers`, then restore into the new
structure from the converted tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _layer_index(key: Any) -> int | None:
    """The layer number of a per-layer key (0, "0"), else None."""
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


def _is_per_layer_dict(node: Any) -> bool:
    """A dict whose keys are exactly the layer numbers 0..L-1 (int or digit strings)."""
    if not isinstance(node, Mapping) or not node:
        return False
    ids = [_layer_index(k) for k in node]
    return None not in ids and sorted(ids) == list(range(len(ids)))


def has_per_layer_layers(tree: Any) -> bool:
    """Whether any `layers` entry of a nested dict/list tree is in the per-layer layout."""
    if isinstance(tree, Mapping):
        return any(
            (key == "layers" and _is_per_layer_dict(value)) or has_per_layer_layers(value)
            for key, value in tree.items()
        )
    if isinstance(tree, (list, tuple)):
        return any(has_per_layer_layers(x) for x in tree)
    return False


def _stack(layers: Mapping[Any, Any]) -> Any:
    """{i: subtree_i} -> one subtree whose leaves are stacked over i (in layer order)."""
    ordered = [layers[k] for k in sorted(layers, key=_layer_index)]
    first = ordered[0]
    if isinstance(first, Mapping):
        missing = [k for k in first if not all(k in x for x in ordered)]
        if missing or any(set(x) != set(first) for x in ordered):
            raise ValueError(
                f"per-layer checkpoint: the layers do not hold the same params (e.g. {missing}); "
                "the checkpoint is damaged or not from this model"
            )
        return {k: _stack({i: x[k] for i, x in enumerate(ordered)}) for k in first}
    return np.stack([np.asarray(x) for x in ordered])


def stack_per_layer_layers(tree: Any) -> Any:
    """The tree with every per-layer `layers` dict replaced by its stacked form (module
    docstring); everything else is returned as it is. Lists and tuples are walked too."""
    if isinstance(tree, Mapping):
        return {
            key: _stack(value)
            if key == "layers" and _is_per_layer_dict(value)
            else stack_per_layer_layers(value)
            for key, value in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        items = [stack_per_layer_layers(x) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree
