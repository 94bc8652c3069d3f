"""The decoder's architecture: one frozen dataclass for Qwen2/Qwen2.5, Qwen3, Llama 3 and the
Mixture-of-Experts Qwen3-MoE, Qwen2-MoE (a shared expert beside the routed ones) and Mixtral.

`ModelConfig` is hashable (it lives in the NNX graphdef, which is a static jit argument), so the
Llama-3 `rope_scaling` dict is frozen into a tuple of items on construction and handed back as a
dict by `rope_scaling_dict()`. `from_hf_config` / `to_hf_config` translate to and from an HF
`config.json` (the classic `rope_theta` + `rope_scaling` layout, which transformers 4.x, 5.x and
vLLM all read; transformers 5's `rope_parameters` is accepted on input).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp

Arch = Literal["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "llama"]
RematPolicy = Literal["none", "full", "save_dots"]
AttentionImpl = Literal["auto", "reference", "chunked", "cudnn"]
REMAT_CHOICES: tuple[str, ...] = ("none", "full", "save_dots")
ATTENTION_CHOICES: tuple[str, ...] = ("auto", "reference", "chunked", "cudnn")

# HF class / model_type per architecture (transformers and vLLM both key on these).
HF_ARCHITECTURES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llama": "LlamaForCausalLM",
}
# The Mixture-of-Experts architectures: every decoder layer's MLP is a `models.layers.SparseMoE`.
MOE_ARCHES = ("qwen3_moe", "qwen2_moe", "mixtral")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture hyper-parameters, named as in this code base (HF names in `to_hf_config`)."""

    arch: Arch  # the HF class and weight name map (HF_ARCHITECTURES)
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU hidden width (of a dense MLP)
    num_layers: int  # decoder blocks (HF: num_hidden_layers)
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); num_heads % num_kv_heads == 0
    head_dim: int  # per-head width (Qwen3 decouples it from hidden_size / num_heads)
    rope_theta: float = 10000.0  # RoPE base
    # None, or HF's dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; stored frozen.
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm's rsqrt
    tie_word_embeddings: bool = False  # LM head = embedding^T (no lm_head.weight tensor)
    qkv_bias: bool = False  # bias on q/k/v projections (always on in Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096  # context the model was trained for (metadata)
    bos_token_id: int | None = None  # written to config.json when known
    eos_token_id: int | None = None  # written to config.json when known
    param_dtype: Any = jnp.float32  # master weights
    compute_dtype: Any = jnp.bfloat16  # activations and matmul inputs
    # Decoder-layer rematerialisation in the backward pass (`decoder.REMAT_POLICIES`):
    # "none" keeps every activation, "full" recomputes the layer, "save_dots" keeps matmul outputs.
    remat: RematPolicy = "none"
    # Self-attention implementation (`models.attention`): "reference" builds [B, H, T, T] scores
    # (tests); "chunked" is blockwise online softmax in plain XLA (memory linear in T); "cudnn"
    # is cuDNN flash attention (GPU, bf16/fp16); "auto" = cudnn on GPU when it applies, else
    # chunked. The one-token decode step always reads its cache directly ([B, H, 1, S]).
    attention: AttentionImpl = "auto"
    attention_chunk: int = 512  # query and key block length of "chunked" (tokens)
    # Batch-invariant numerics (`models.invariant`): a token's numbers do not depend on its
    # batch, padding, sequence length or KV-cache size, so the rollout engine's log-probs equal
    # the trainer's bit for bit. Attention runs by position-aligned key chunks (`attention` is
    # then not used) and token GEMMs get at least 64 rows. Set by `rollout.on_policy: exact`.
    batch_invariant: bool = False
    # Mixture-of-Experts (MOE_ARCHES, `models.moe`): every decoder layer's MLP is
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`, `num_experts_per_tok` of
    # them per token, picked by a softmax router (their weights renormalised to sum 1 when
    # `norm_topk_prob`; Mixtral always does). `router_aux_loss_coef` is the checkpoint's
    # load-balancing coefficient, kept for config.json (the RL loss uses its own,
    # `algorithm.moe_aux_loss_coef`, default 0). Qwen2-MoE adds a shared SwiGLU expert of width
    # `shared_expert_intermediate_size` that every token goes through, gated by
    # sigmoid(x . w_gate).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    shared_expert_intermediate_size: int = 0
    # Which layers of a Qwen3-MoE / Qwen2-MoE model are sparse (HF's rule): layer i is an MoE
    # layer when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the
    # others are dense SwiGLU MLPs of width `intermediate_size` (`sparse_layers`). The defaults
    # make every layer sparse, as in every released Qwen3-MoE and Qwen2-MoE checkpoint.
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    @property
    def is_moe(self) -> bool:
        """Whether the decoder layers' MLPs are Mixture-of-Experts blocks (all of them, or those
        of `sparse_layers` in a mixed model)."""
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per decoder layer, whether its MLP is an MoE block (HF Qwen3-MoE's rule: not in
        `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0)."""
        only = set(self.mlp_only_layers)
        return tuple(
            self.is_moe and i not in only and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def is_mixed(self) -> bool:
        """An MoE model some of whose layers are dense (`sparse_layers`): its MoE and dense
        MLPs are two stacks (`models.decoder`)."""
        return self.is_moe and not all(self.sparse_layers)

    @property
    def mlp_slots(self) -> tuple[int, ...]:
        """Per decoder layer, the index of its MLP's params in their stack: i in a model whose
        layers are all alike; in a mixed model its rank among the layers of its kind (MoE
        layers in `mlp`, dense in `dense_mlp`: `models.decoder.stacked_layers`)."""
        kinds = self.sparse_layers
        return tuple(kinds[:i].count(kinds[i]) for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        """How many layers are MoE layers: the leading axis of the experts' params, of routing
        records and of router loads."""
        return sum(self.sparse_layers)

    def __post_init__(self) -> None:
        if self.arch not in HF_ARCHITECTURES:
            raise ValueError(f"ModelConfig.arch={self.arch!r}: use one of {list(HF_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.remat not in REMAT_CHOICES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}: use one of {REMAT_CHOICES}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"ModelConfig.attention={self.attention!r}: use one of {ATTENTION_CHOICES}"
            )
        if self.attention_chunk < 1:
            raise ValueError(f"ModelConfig.attention_chunk={self.attention_chunk} must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.arch in ("qwen2", "qwen2_moe"):
            # HF Qwen2 hard-codes q/k/v biases and derives head_dim; vLLM's Qwen2 and Qwen2-MoE
            # do the same (HF Qwen2-MoE's `qkv_bias` key aside), so a model vLLM would load
            # with other shapes or random biases is refused here.
            if not self.qkv_bias:
                raise ValueError(
                    f"ModelConfig(arch={self.arch!r}) needs qkv_bias=True (HF Qwen2 and vLLM's "
                    "Qwen2 / Qwen2-MoE have q/k/v biases)"
                )
            if self.head_dim * self.num_heads != self.hidden_size:
                raise ValueError(
                    f"ModelConfig(arch={self.arch!r}): head_dim={self.head_dim} must equal "
                    f"hidden_size/num_heads={self.hidden_size}/{self.num_heads}"
                )
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(map(int, self.mlp_only_layers))))
        self._check_moe()
        if self.qk_norm and self.arch not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"ModelConfig: qk_norm is a Qwen3 feature, arch={self.arch!r}")
        if self.rope_scaling is not None:
            items = (
                self.rope_scaling.items()
                if isinstance(self.rope_scaling, Mapping)
                else self.rope_scaling
            )
            frozen = tuple(sorted((str(k), v) for k, v in items))
            rope_type = dict(frozen).get("rope_type", dict(frozen).get("type", "default"))
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"ModelConfig.rope_scaling: rope_type={rope_type!r} is not supported; "
                    f"use one of {_SUPPORTED_ROPE_TYPES} or None"
                )
            object.__setattr__(self, "rope_scaling", frozen)
        for name in ("param_dtype", "compute_dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)))

    def _check_moe(self) -> None:
        if (self.arch in MOE_ARCHES) != self.is_moe:
            raise ValueError(
                f"ModelConfig: arch={self.arch!r} with num_experts={self.num_experts}: the "
                f"archs {MOE_ARCHES} need num_experts >= 1, and no other arch has experts"
            )
        if (self.arch == "qwen2_moe") != (self.shared_expert_intermediate_size > 0):
            raise ValueError(
                f"ModelConfig: arch={self.arch!r} with shared_expert_intermediate_size="
                f"{self.shared_expert_intermediate_size}: qwen2_moe needs a shared expert "
                "(width >= 1), and no other arch has one"
            )
        if self.arch == "mixtral" and not (
            self.norm_topk_prob and not self.qkv_bias
            and self.intermediate_size == self.moe_intermediate_size
            and all(self.sparse_layers)
        ):  # fmt: skip
            raise ValueError(
                "ModelConfig(arch='mixtral'): Mixtral renormalises the top-k (norm_topk_prob="
                "True), has no q/k/v bias, one expert width (intermediate_size == "
                "moe_intermediate_size) and experts in every layer (no mlp_only_layers, "
                "decoder_sparse_step=1)"
            )
        if not self.is_moe:
            if self.mlp_only_layers or self.decoder_sparse_step != 1:
                raise ValueError(
                    f"ModelConfig: mlp_only_layers / decoder_sparse_step are MoE settings, "
                    f"arch={self.arch!r} has no experts"
                )
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig: {self.arch} needs moe_intermediate_size >= 1")
        if self.decoder_sparse_step < 1 or not set(self.mlp_only_layers) <= set(
            range(self.num_layers)
        ):
            raise ValueError(
                f"ModelConfig: decoder_sparse_step={self.decoder_sparse_step} must be >= 1 and "
                f"mlp_only_layers={list(self.mlp_only_layers)} layer indices in "
                f"0..{self.num_layers - 1}"
            )
        if not any(self.sparse_layers):
            raise ValueError(
                f"ModelConfig: {self.arch} with mlp_only_layers={list(self.mlp_only_layers)} and "
                f"decoder_sparse_step={self.decoder_sparse_step} has no MoE layer; use the dense "
                "arch instead"
            )

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """The RoPE scaling as HF's dict (or None)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (e.g. `cfg.replace(compute_dtype=jnp.float32)`)."""
        if "rope_scaling" not in changes and self.rope_scaling is not None:
            changes["rope_scaling"] = self.rope_scaling_dict()
        return dataclasses.replace(self, **changes)

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count (embedding counted once when tied); `active`: an MoE model's
        parameters one token uses (its `num_experts_per_tok` experts, not all of them)."""
        if active and self.is_moe:
            return self.replace(num_experts=self.num_experts_per_tok).num_params()
        d, f, h, k, hd = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = d * hd * (h + 2 * k) + h * hd * d + (hd * (h + 2 * k) if self.qkv_bias else 0)
        attn += 2 * hd if self.qk_norm else 0
        dense = 3 * d * f
        sparse = d * self.num_experts + self.num_experts * 3 * d * self.moe_intermediate_size
        if self.shared_expert_intermediate_size:
            sparse += 3 * d * self.shared_expert_intermediate_size + d
        n_sparse = self.num_moe_layers
        mlps = n_sparse * sparse + (self.num_layers - n_sparse) * dense
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * (attn + 2 * d) + mlps + d + head

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Builds a config from an HF `config.json` dict; `overrides` set non-HF fields
        (param_dtype, compute_dtype, remat, attention, attention_chunk)."""
        model_type = hf.get("model_type")
        if model_type not in HF_ARCHITECTURES:
            raise ValueError(
                f"config.json: model_type={model_type!r} is not supported; "
                f"supported: {list(HF_ARCHITECTURES)}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json ({model_type}): missing keys {missing}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' is built")
        num_heads = int(hf["num_attention_heads"])
        # transformers 5 folds theta and scaling into `rope_parameters`.
        rope_params = dict(hf.get("rope_parameters") or {})
        theta_in_params = rope_params.pop("rope_theta", None)
        rope_theta = float(hf.get("rope_theta") or theta_in_params or 10000.0)
        rope_scaling = hf.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type == "default":
                rope_scaling = None
        moe = _moe_fields(hf, model_type) if model_type in MOE_ARCHES else {}
        if model_type == "qwen2":
            qkv_bias = True
        elif model_type == "qwen2_moe":
            qkv_bias = bool(hf.get("qkv_bias", True))
        else:
            qkv_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias", False):
            raise ValueError("config.json: mlp_bias=true is not supported")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # Llama 3.1 instruct lists several; keep the first
            eos = eos[0] if eos else None
        fields: dict[str, Any] = dict(
            arch=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            **moe,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """The HF `config.json` dict (transformers and vLLM load it); `dtype` names the tensors'
        dtype as saved."""
        hf: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
            "torch_dtype": dtype,
        }
        if self.arch == "qwen2":
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        elif self.arch == "qwen2_moe":
            hf.update(qkv_bias=self.qkv_bias)
        else:
            hf.update(attention_bias=self.qkv_bias)
        if self.arch in ("qwen3", "qwen3_moe", "qwen2_moe"):
            hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        if self.arch == "mixtral":
            hf.update(
                num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                router_aux_loss_coef=self.router_aux_loss_coef, router_jitter_noise=0.0,
                sliding_window=None, output_router_logits=False,
            )  # fmt: skip
        elif self.is_moe:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        if self.shared_expert_intermediate_size:
            hf.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.arch == "llama":
            hf.update(mlp_bias=False, pretraining_tp=1)
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            hf["eos_token_id"] = self.eos_token_id
        return hf


def _moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral config.json (transformers 5 writes
    `num_experts` as `num_local_experts`, Mixtral's own name; Mixtral's experts have the width
    `intermediate_size` and always renormalise the top-k). Qwen3-MoE and Qwen2-MoE may mix
    dense and MoE layers (`mlp_only_layers`, `decoder_sparse_step`; Mixtral has neither key).
    Every layer must attend to the whole context (no sliding window)."""
    mixtral = model_type == "mixtral"
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    width = "intermediate_size" if mixtral else "moe_intermediate_size"
    keys = ("num_experts_per_tok", width)
    keys += ("shared_expert_intermediate_size",) if model_type == "qwen2_moe" else ()
    missing = [k for k, v in (("num_experts", experts), *((k, hf.get(k)) for k in keys))
               if v is None]  # fmt: skip
    if missing:
        raise ValueError(f"config.json ({model_type}): missing keys {missing}")
    if hf.get("use_sliding_window") or (mixtral and hf.get("sliding_window")):
        raise ValueError(f"config.json ({model_type}): sliding-window attention is not built")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf[width]),
        norm_topk_prob=mixtral or bool(hf.get("norm_topk_prob", False)),  # HF configs' default
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
    )
