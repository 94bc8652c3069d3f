"""The run's rollout backend from its config, and the weight pushes to it.

`make_backend` builds the embedded engine or an HTTP client (one server, or a `ServerPool` over
several); `push_params` streams the params to it one tensor at a time in the push format
(`push_format`), labelled with the weight version of the step (`version`); with
`rollout.kv_cache_dtype: fp8` and servers, `kv_scale_push` adds the FP8 KV-cache scales of the
pushed params (calibrated on the step's rollout sequences) to the push.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jfp8rl.config import Config, RolloutConfig
from jfp8rl.config.rollout import API_KEY_ENV
from jfp8rl.parallel import distributed
from jfp8rl.trainer.policy import Policy
from models.config import ModelConfig
from models.fp8 import get_recipe
from models.hf_io import iter_hf_state
from models.kv_calibration import calibrate_kv_scales
from rollout_bridge.backend import RolloutBackend, RolloutError
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.pool import ServerPool
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.engine.embedded import EmbeddedBackend, default_export_format
from rollout_bridge.export import fetch_dtype
from rollout_bridge.weights.kv_scales import kv_scale_tensors

_calibrate = jax.jit(calibrate_kv_scales, static_argnums=0, static_argnames="recipe")


def version(k: int) -> str:
    """Weight version label of the params after step k ("step-0" = the base policy)."""
    return f"step-{k}"


def push_format(r: RolloutConfig) -> str:
    """The rollout format of the weight pushes: `rollout.export_format`, else bf16 for servers
    and the engine's own default for the embedded backend (`default_export_format`). Every
    process of a run decides it the same way: it sets the dtype the params are fetched in.
    `rollout.on_policy: exact` pushes fp32: the engine then holds the trainer's own f32 norms,
    embedding and head (the fp8 format rounds them to bf16) and quantizes the linears from the
    same masters by the same function as the trainer's forward."""
    if r.export_format:
        return r.export_format
    if r.on_policy == "exact":
        return "fp32"
    if r.backend == "embedded":
        return default_export_format(get_recipe(r.recipe))
    return "bf16"


def api_key(r: RolloutConfig) -> str | None:
    """The servers' API key: `rollout.api_key`, else $JFP8RL_ROLLOUT_API_KEY, else None."""
    return r.api_key or os.environ.get(API_KEY_ENV) or None


def make_backend(cfg: Config, policy: Policy, run_dir: Path) -> RolloutBackend:
    """The configured rollout backend; it serves weights from the first `stage_sync` on.

    backend "http": one `HttpBackend` for `rollout.url`, a `ServerPool` for `rollout.urls`
    (servers that do not answer /health at start are dropped with a warning)."""
    r = cfg.rollout
    root = r.export_root or None
    if r.backend == "embedded":
        # No weights at construction (an f32 copy of the model): the run's first sync pushes
        # the weights it serves, before any sampling.
        return EmbeddedBackend(
            policy.cfg, policy.graphdef, None,
            recipe=r.recipe, eos_id=policy.stop_ids, weight_version="base",
            export_format=push_format(r), export_root=root, max_num_seqs=r.max_num_seqs,
            kv_cache_dtype=r.kv_cache_dtype, record_routing=r.routing_replay == "record",
        )  # fmt: skip
    settings = ClientSettings(
        api_key=api_key(r), timeout_s=r.timeout_s, max_retries=r.max_retries,
        export_format=push_format(r), export_root=root, export_hash=r.export_hash or None,
    )  # fmt: skip
    urls = r.server_urls()
    backend: RolloutBackend = (
        ServerPool(urls, settings) if r.urls else HttpBackend(urls[0], settings)
    )
    if not backend.health():
        backend.close()
        raise RolloutError(
            f"rollout server(s) {', '.join(urls)} not answering /health; start them, e.g. "
            f"`python -m rollout_bridge.serve --model {policy.path} --port <port>`, "
            "and set rollout.url (one server) or rollout.urls (several)"
        )
    return backend


def kv_scale_push(
    r: RolloutConfig,
    graphdef: Any,
    params: Any,
    sequences: tuple[np.ndarray, np.ndarray] | None,
    prompts: Sequence[Sequence[int]],
) -> dict[str, np.ndarray]:
    """The FP8 KV-cache scale tensors to push with `params` to vLLM-compatible servers
    (`rollout_bridge.weights.kv_scales`): {} unless backend "http" with kv_cache_dtype "fp8".

    Scales are amax / 448 per layer of the keys and values `params` compute under the rollout
    recipe (`models.kv_calibration`), on `sequences` (tokens, attention_mask: the step's
    rollout, its first `max_num_seqs` rows), or before any rollout on `prompts` (left-padded).
    The embedded engine calibrates itself on its own latest generation at every install."""
    if r.backend != "http" or r.kv_cache_dtype != "fp8":
        return {}
    if sequences is None:
        if not prompts:
            raise RolloutError(
                "rollout.kv_cache_dtype=fp8 with servers calibrates its first push on the eval "
                "prompts, and the eval set is empty; give eval examples (eval.data / eval.n)"
            )
        width = max(len(p) for p in prompts)
        tokens = np.zeros((len(prompts), width), np.int32)
        mask = np.zeros_like(tokens)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
        sequences = (tokens, mask)
    tokens, mask = (np.asarray(x)[: r.max_num_seqs] for x in sequences)
    scales = _calibrate(graphdef, params, tokens, mask, recipe=get_recipe(r.recipe))
    return kv_scale_tensors(np.asarray(scales.k), np.asarray(scales.v))


def push_params(
    backend: RolloutBackend | None,
    cfg: ModelConfig,
    params: Any,
    version: str,
    fmt: str,
    extra: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Pushes `params` to `backend` as `version` in the rollout format `fmt`, and the `extra`
    tensors with them (FP8 KV-cache scales, `kv_scale_push`).

    One tensor at a time (a layer slice made on the devices, in HF layout and the push's dtype
    `fetch_dtype(fmt)`, then fetched): the host never holds a full copy of the model. Process 0
    pushes (`backend` is None on the others); every process takes part in the per-tensor
    gathers of a multi-process run."""
    distributed.consume_on_main(
        lambda tensors: backend.push_weights(tensors, version),
        itertools.chain(iter_hf_state(cfg, params, dtype=fetch_dtype(fmt)), (extra or {}).items()),
    )
