"""Partition specs of the params: the tunix / Megatron split, valid specs, divisibility
fallback; an HF load placed straight into its shards and the forward under the mesh (batch
constraint on the residual stream) equal to one device (8 forced CPU devices, subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import functional as F
from models.config import get_config
from models.sharding import param_partition_specs

ROOT = Path(__file__).resolve().parents[2]


def _flat(specs) -> dict[str, P]:
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(specs)}


def test_qwen3_8b_specs_fsdp_and_tensor():
    cfg = get_config("qwen3_8b")
    _, params = F.abstract_model(cfg)
    specs = _flat(param_partition_specs(cfg, params, {"data": 2, "fsdp": 8, "tensor": 2}))
    layers = "model.layers."
    assert specs["model.embed_tokens.embedding"] == P("tensor", "fsdp")
    assert specs["lm_head"] == P("fsdp", "tensor")
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        assert specs[layers + name + ".kernel"] == P(None, "fsdp", "tensor"), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert specs[layers + name + ".kernel"] == P(None, "tensor", "fsdp"), name
    assert specs[layers + "self_attn.q_norm.weight"] == P()
    assert specs["model.norm.weight"] == P()
    for spec in specs.values():  # valid: each mesh axis at most once, never the layer axis
        named = [a for a in spec if a is not None]
        assert len(named) == len(set(named))
    assert all(s[0] is None for k, s in specs.items() if k.startswith(layers) and len(s))


def test_indivisible_dims_and_kv_heads_fall_back_to_replication():
    cfg = get_config("tiny_qwen2")  # vocab 512, d 64, 4 heads, 2 kv heads, ffn 128, qkv bias
    _, params = F.abstract_model(cfg)
    specs = _flat(param_partition_specs(cfg, params, {"fsdp": 3, "tensor": 4}))
    # 64 % 3 != 0: no fsdp anywhere; 4 query heads split over tensor=4, 2 kv heads do not.
    assert specs["model.layers.self_attn.q_proj.kernel"] == P(None, None, "tensor")
    assert specs["model.layers.self_attn.q_proj.bias"] == P(None, "tensor")
    assert specs["model.layers.self_attn.k_proj.kernel"] == P(None, None, None)
    assert specs["model.layers.self_attn.v_proj.bias"] == P(None, None)
    assert specs["model.layers.mlp.down_proj.kernel"] == P(None, "tensor", None)
    # An axis missing from the mesh is never named.
    none = _flat(param_partition_specs(cfg, params, {"data": 8}))
    assert all(a is None for s in none.values() for a in s)


def test_optimizer_state_gets_the_params_specs():
    cfg = get_config("tiny_qwen3")
    _, params = F.abstract_model(cfg)
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
    specs = param_partition_specs(cfg, opt_state, {"fsdp": 2, "tensor": 2})
    mu = _flat(specs[0].mu)
    assert mu["model.layers.mlp.up_proj.kernel"] == P(None, "fsdp", "tensor")
    assert specs[0].count == P()


_SHARDED_LOAD = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import Mesh
    from models import functional as F
    from models.config import get_config
    from models.hf_state import from_hf_state_dict, random_hf_state_dict, to_hf_state_dict
    from models.sharding import param_shardings

    cfg = get_config("tiny_llama")
    mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 2), ("data", "fsdp", "tensor"))
    sd = random_hf_state_dict(cfg, 3)
    _, abstract = F.abstract_model(cfg)
    shardings = param_shardings(cfg, abstract, mesh)
    params = from_hf_state_dict(cfg, sd, shardings=shardings)
    q = params["model"]["layers"]["self_attn"]["q_proj"]["kernel"][...]
    assert q.sharding == shardings["model"]["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.addressable_shards[0].data.shape == (2, 16, 32), q.addressable_shards[0].data.shape
    back = to_hf_state_dict(cfg, params)
    assert list(back) == list(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])

    # Under the mesh context the residual stream is constrained to the batch axes (fsdp here),
    # and the sharded forward equals the single-device one.
    import jax.numpy as jnp
    from models import fp8
    cfg32 = cfg.replace(compute_dtype=jnp.float32)
    graphdef, _ = F.abstract_model(cfg32)
    sharded = from_hf_state_dict(cfg32, sd, shardings=param_shardings(cfg32, abstract, mesh))
    single = from_hf_state_dict(cfg32, sd)
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, 500, (8, 12)), jnp.int32)
    mask = jnp.ones_like(tokens).at[:, :3].set(0)
    fwd = jax.jit(lambda p, t, m: F.forward(graphdef, p, t, m, recipe=fp8.BF16))
    assert "sharding_constraint" not in str(jax.make_jaxpr(fwd)(single, tokens, mask))
    ref = fwd(single, tokens, mask)
    with jax.set_mesh(mesh):
        assert "sharding_constraint" in str(jax.make_jaxpr(fwd.__wrapped__)(sharded, tokens, mask))
        out = jax.jit(fwd.__wrapped__)(sharded, tokens, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    print("ok")
    """
)


def test_hf_load_into_shardings_and_sharded_forward_on_8_devices():
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED_LOAD], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
