"""Walking a jaxpr with its sub-jaxprs (scan, while, cond, remat, pjit, custom_vjp bodies)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def all_eqns(jaxpr) -> Iterator:
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def max_intermediate_size(jaxpr) -> int:
    """Elements of the largest array any equation (nested ones included) makes."""
    sizes = (int(np.prod(getattr(v.aval, "shape", ()))) for e in all_eqns(jaxpr) for v in e.outvars)
    return max(sizes, default=0)
