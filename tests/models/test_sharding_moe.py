"""Partition specs of a Mixture-of-Experts model's params (`models.sharding`): the experts over
`expert` (E), `fsdp` (D) and `tensor` (I) like the dense MLP's, the router's D over the FSDP
axes only, the `expert` axis one more FSDP axis for every other param, and a mesh without an
expert axis unchanged."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import functional as F
from models.config import get_config
from models.sharding import param_partition_specs

L = "model.layers."


def _specs(name: str, mesh: dict[str, int]) -> dict[str, P]:
    cfg = get_config(name)
    _, params = F.abstract_model(cfg)
    flat = nnx.to_flat_state(param_partition_specs(cfg, params, mesh))
    return {".".join(map(str, k)): v.get_value() for k, v in flat}


def test_qwen3_30b_a3b_on_expert_fsdp_tensor() -> None:
    specs = _specs("qwen3_30b_a3b", {"data": 1, "fsdp": 2, "expert": 8, "tensor": 2})
    # [L, E, D, I] and [L, E, I, D]: 128 experts / 8, D 2048 / 2, I 768 / 2.
    assert specs[L + "mlp.experts.gate_proj"] == P(None, "expert", "fsdp", "tensor")
    assert specs[L + "mlp.experts.up_proj"] == P(None, "expert", "fsdp", "tensor")
    assert specs[L + "mlp.experts.down_proj"] == P(None, "expert", "tensor", "fsdp")
    # The router [L, D, E]: every device routes over all experts; D over both FSDP axes.
    assert specs[L + "mlp.gate.kernel"] == P(None, ("fsdp", "expert"), None)
    # The other params: the embed dim over fsdp x expert, the tensor roles as without experts.
    assert specs[L + "self_attn.q_proj.kernel"] == P(None, ("fsdp", "expert"), "tensor")
    assert specs[L + "self_attn.k_proj.kernel"] == P(None, ("fsdp", "expert"), "tensor")
    assert specs[L + "self_attn.o_proj.kernel"] == P(None, "tensor", ("fsdp", "expert"))
    assert specs["model.embed_tokens.embedding"] == P("tensor", ("fsdp", "expert"))
    assert specs["lm_head"] == P(("fsdp", "expert"), "tensor")
    assert specs[L + "post_attention_layernorm.weight"] == P()
    for spec in specs.values():  # each mesh axis at most once per spec
        named = [a for s in spec if s is not None for a in ((s,) if isinstance(s, str) else s)]
        assert len(named) == len(set(named)), spec


def test_expert_axis_alone_and_without_it() -> None:
    # expert=8 alone: the experts split 8 ways, every other matrix FSDP-sharded over it.
    alone = _specs("qwen3_30b_a3b", {"expert": 8})
    assert alone[L + "mlp.experts.gate_proj"] == P(None, "expert", None, None)
    assert alone[L + "mlp.experts.down_proj"] == P(None, "expert", None, None)
    assert alone[L + "mlp.gate.kernel"] == P(None, "expert", None)
    assert alone[L + "self_attn.q_proj.kernel"] == P(None, "expert", None)
    # No expert axis: the experts as the dense MLP (E replicated), nothing names `expert`.
    dense = _specs("qwen3_30b_a3b", {"data": 2, "fsdp": 8, "tensor": 2})
    assert dense[L + "mlp.experts.gate_proj"] == P(None, None, "fsdp", "tensor")
    assert dense[L + "mlp.experts.down_proj"] == P(None, None, "tensor", "fsdp")
    assert dense[L + "mlp.gate.kernel"] == P(None, "fsdp", None)
    assert dense[L + "self_attn.q_proj.kernel"] == P(None, "fsdp", "tensor")
    # A dense model's specs do not change with an expert axis of size 1.
    for name in ("qwen3_8b", "tiny_qwen2"):
        mesh = {"data": 2, "fsdp": 4, "tensor": 2}
        assert _specs(name, mesh) == _specs(name, {**mesh, "expert": 1}), name


def test_indivisible_expert_and_embed_dims_fall_back() -> None:
    # tiny_qwen3_moe: 8 experts, D 64, I 32. expert=3 divides neither E nor D: E replicated,
    # D over fsdp alone. expert=16 does not divide E = 8 (no expert parallelism: the axis only
    # splits the batch) but fsdp x expert = 32 divides D, the experts' D too.
    specs = _specs("tiny_qwen3_moe", {"fsdp": 2, "expert": 3})
    assert specs[L + "mlp.experts.gate_proj"] == P(None, None, "fsdp", None)
    assert specs[L + "self_attn.q_proj.kernel"] == P(None, "fsdp", None)
    specs = _specs("tiny_qwen3_moe", {"fsdp": 2, "expert": 16})
    assert specs[L + "mlp.experts.gate_proj"] == P(None, None, ("fsdp", "expert"), None)
    assert specs[L + "self_attn.q_proj.kernel"] == P(None, ("fsdp", "expert"), None)


def test_adam_moments_of_the_experts_get_their_specs() -> None:
    cfg = get_config("tiny_qwen3_moe")
    _, params = F.abstract_model(cfg)
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
    specs = param_partition_specs(cfg, opt_state, {"fsdp": 2, "expert": 4})
    mu = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(specs[0].mu)}
    assert mu[L + "mlp.experts.up_proj"] == P(None, "expert", "fsdp", None)
    assert mu[L + "mlp.gate.kernel"] == P(None, ("fsdp", "expert"), None)


def test_mixed_model_stacks_its_dense_mlps_apart() -> None:
    """A mixed model (layers 0 and 2 MoE, 1 dense): the MoE stack's leading axis is its 2 MoE
    layers, the dense stack's its 1 dense layer, and the dense MLP's D and I split as a dense
    model's (D over fsdp x expert, I over tensor)."""
    cfg = get_config("tiny_qwen3_moe_mixed")
    _, params = F.abstract_model(cfg)
    shapes = {".".join(map(str, k)): v.get_value().shape for k, v in nnx.to_flat_state(params)}
    assert shapes[L + "mlp.experts.gate_proj"] == (2, 8, 64, 32)
    assert shapes[L + "dense_mlp.gate_proj.kernel"] == (1, 64, 128)
    assert shapes[L + "self_attn.q_proj.kernel"] == (3, 64, 128)
    specs = _specs("tiny_qwen3_moe_mixed", {"fsdp": 2, "expert": 4, "tensor": 2})
    assert specs[L + "mlp.experts.gate_proj"] == P(None, "expert", "fsdp", "tensor")
    assert specs[L + "dense_mlp.gate_proj.kernel"] == P(None, ("fsdp", "expert"), "tensor")
    assert specs[L + "dense_mlp.down_proj.kernel"] == P(None, "tensor", ("fsdp", "expert"))
