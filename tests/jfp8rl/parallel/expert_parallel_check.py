"""Run by tests/jfp8rl/parallel/test_expert_parallel.py in a subprocess with 8 forced host
devices: expert parallelism (`models.expert_parallel`) against one device. Prints one JSON line:

* `quantize_split`: the grouped FP8 quantizer with each expert's rows split unevenly over 4
  devices (empty runs, runs shorter than a tile, tiles spanning 3 devices) equals the quantizer
  over the whole rows, bit for bit, for every tiling along the tokens (`exact`: all equal).
* `block:<recipe>:<mesh>`: `moe_block`'s output and gradients (input, router, experts) under
  the mesh against one device, its grouped GEMMs as the tiled loop (`models.fp8.ragged`), max difference relative to each array's largest entry.
* `model:<recipe>:<mesh>`: the tiny Qwen3-MoE model's per-token log-probs and the gradients of
  a weighted sum of them (every param), the same measure, and the share of gradient entries
  off by more than 1e-4 of their leaf's largest; layout facts of the experts' params.

f32 compute everywhere, so the differences are f32 summation order (and, under FP8, what an
order-dependent f32 rounding of a value that is quantized next changes).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jfp8rl.parallel.mesh import BATCH_AXES, make_mesh, param_layout
from models import fp8
from models import functional as mf
from models.config import get_config
from models.fp8 import ragged
from models.fp8.grouped import fake_quantize_grouped
from models.moe import moe_block

DENSE_LIMIT, ROW_TILE = ragged.DENSE_LIMIT_BYTES, ragged.ROW_TILE
# (data, fsdp, tensor, expert)
MESHES = {"expert4_fsdp2": (1, 2, 1, 4), "expert2_data2_fsdp2": (2, 2, 1, 2)}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tree_rel(a, b) -> float:
    return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def off_share(a, b, tol: float = 1e-4) -> float:
    """The share of all entries that differ by more than `tol` of their leaf's largest entry:
    an FP8 rounding flip changes a few, an error in the split computation most."""
    off = total = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        off += int(np.sum(np.abs(x - y) > tol * np.abs(y).max()))
        total += y.size
    return off / total


def quantize_split() -> bool:
    devices, experts, cols, slots = 4, 3, 6, 40
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 12, (devices, experts))
    counts[1, 0] = counts[2, 2] = 0
    parts = [
        rng.standard_normal((c, cols)) * np.exp(rng.standard_normal((c, 1))) for c in counts.sum(1)
    ]

    def by_expert(rows_of):  # expert e's rows: device 0's, then device 1's, ...
        return np.concatenate([
            rows_of(r)[counts[r, :e].sum() : counts[r, : e + 1].sum()]
            for e in range(experts) for r in range(devices)
        ])  # fmt: skip

    local = np.zeros((devices, slots, cols), np.float32)
    for r in range(devices):
        local[r, : counts[r].sum()] = parts[r]
    offsets = np.concatenate([np.zeros((1, experts), int), np.cumsum(counts, 0)[:-1]])
    tilings = [(None, None), (None, 1), (1, 4), (4, 1), (5, 2), (128, 1)]

    def split(x, s, o):
        return jnp.stack([
            fake_quantize_grouped(x[0], s[0], "e4m3", tt, ct, pow2=False, row_offsets=o[0],
                                  row_axes=("d",))
            for tt, ct in tilings
        ])[None]  # fmt: skip

    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    spec = PartitionSpec("d")
    f = jax.jit(jax.shard_map(split, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    got = np.asarray(f(local, counts.astype(np.int32), offsets.astype(np.int32)))

    @jax.jit
    def unsplit(x, sizes):  # every tiling in one program (eager, each op would compile alone)
        return jnp.stack([
            fake_quantize_grouped(x, sizes, "e4m3", tt, ct, pow2=False) for tt, ct in tilings
        ])  # fmt: skip

    want = np.asarray(unsplit(by_expert(lambda r: parts[r]).astype(np.float32), counts.sum(0)))
    return all(
        np.array_equal(by_expert(lambda r, i=i: got[r, i]), want[i]) for i in range(len(tilings))
    )


def block(recipe, shape):
    """moe_block (64 tokens, top-2 of 8 experts, D = 256, I = 160: partial 128-blocks) under
    `shape` (None: one device): (output, grads)."""
    n, d, f, e, k = 64, 256, 160, 8, 2
    rng = np.random.default_rng(0)
    x, ct = rng.standard_normal((2, n, d)).astype(np.float32)
    router = (rng.standard_normal((d, e)) * 0.3).astype(np.float32)
    ws = [
        (rng.standard_normal(s) * 0.1).astype(np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))
    ]

    def loss(*args):
        y, _ = moe_block(*args, top_k=k, norm_topk_prob=True, recipe=recipe)
        return jnp.sum(y * ct), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    if shape is None:
        (_, y), grads = fn(x, router, *ws)
        return y, grads
    mesh = make_mesh(*shape[:3], expert=shape[3])
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))  # noqa: E731
    args = [put(x, BATCH_AXES), put(router), put(ws[0], "expert", "fsdp"),
            put(ws[1], "expert", "fsdp"), put(ws[2], "expert", None, "fsdp")]  # fmt: skip
    with jax.set_mesh(mesh):
        (_, y), grads = fn(*args)
    return y, grads


def model(recipe, shape, cfg, graphdef, params0, inputs):
    """The model's log-probs and grads under `shape` (None: one device), layout facts."""

    def loss(params, tokens, mask, weights):
        logp = mf.token_logprobs(graphdef, params, tokens, mask, recipe=recipe)
        return jnp.sum(logp * weights), logp

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if shape is None:
        (_, logp), grads = fn(params0, *inputs)
        return logp, grads, {}
    mesh = make_mesh(*shape[:3], expert=shape[3])
    params = jax.device_put(params0, param_layout(mesh, cfg, params0).params())
    batch = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    with jax.set_mesh(mesh):
        (_, logp), grads = fn(params, *(jax.device_put(a, batch) for a in inputs))
    w = params["model"]["layers"]["mlp"]["experts"]["gate_proj"][...]
    facts = {
        "experts_spec": str(w.sharding.spec),
        "experts_shard": list(w.sharding.shard_shape(w.shape)),
    }
    return logp, grads, facts


def main() -> None:
    report = {"devices": jax.device_count(), "quantize_split_exact": quantize_split()}
    # The block's grouped GEMMs as the tiled loop CPUs run at scale (`models.fp8.ragged`), in
    # tiles of 16 rows: inside the exchange and on one device.
    ragged.DENSE_LIMIT_BYTES, ragged.ROW_TILE = 0, 16
    y1, g1 = block(fp8.FP8_BLOCK, None)
    y, g = block(fp8.FP8_BLOCK, MESHES["expert2_data2_fsdp2"])
    ragged.DENSE_LIMIT_BYTES, ragged.ROW_TILE = DENSE_LIMIT, ROW_TILE
    report["block:fp8_block:expert2_data2_fsdp2"] = {"out": rel(y, y1), "grads": tree_rel(g, g1)}
    # 16 x 40 tokens, top-2 of 8 experts: ~160 rows per expert, so with 2 expert groups an
    # expert's first 128-row wgrad tile spans both groups' rows.
    cfg = get_config("tiny_qwen3_moe_mixed").replace(compute_dtype=jnp.float32)
    graphdef, params0 = mf.init_model(cfg, 0)
    params0 = jax.tree.map(np.asarray, params0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (16, 40)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[:8, :10] = 0  # left padding on half the rows
    inputs = (tokens, mask, rng.standard_normal(tokens.shape).astype(np.float32))
    for name, mesh in [("bf16", "expert2_data2_fsdp2"), ("fp8_block", "expert4_fsdp2")]:
        recipe = fp8.get_recipe(name)
        logp1, g1, _ = model(recipe, None, cfg, graphdef, params0, inputs)
        logp, g, facts = model(recipe, MESHES[mesh], cfg, graphdef, params0, inputs)
        report[f"model:{name}:{mesh}"] = {
            "logp": rel(logp, logp1),
            "grads": tree_rel(g, g1),
            "grads_off": off_share(g, g1),
            **facts,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
