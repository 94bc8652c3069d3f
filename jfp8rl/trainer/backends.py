"""The run's rollout backend from its config, and the weight pushes to it.

`make_backend` builds the embedded engine or an HTTP client (one server, or a `ServerPool` over
several); `push_params` streams the params to it one tensor at a time in the push format
(`push_format`), labelled with the weight version of the step (`version`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jfp8rl.config import Config, RolloutConfig
from jfp8rl.config.sections import API_KEY_ENV
from jfp8rl.parallel import distributed
from jfp8rl.trainer.policy import Policy
from models.config import ModelConfig
from models.fp8 import get_recipe
from models.hf_io import iter_hf_state
from rollout_bridge.backend import RolloutBackend, RolloutError
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.pool import ServerPool
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.engine.embedded import EmbeddedBackend, default_export_format
from rollout_bridge.export import fetch_dtype


def version(k: int) -> str:
    """Weight version label of the params after step k ("step-0" = the base policy)."""
    return f"step-{k}"


def push_format(r: RolloutConfig) -> str:
    """The rollout format of the weight pushes: `rollout.export_format`, else bf16 for servers
    and the engine's own default for the embedded backend (`default_export_format`). Every
    process of a run decides it the same way: it sets the dtype the params are fetched in."""
    if r.export_format:
        return r.export_format
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


def push_params(
    backend: RolloutBackend | None, cfg: ModelConfig, params: Any, version: str, fmt: str
) -> None:
    """Pushes `params` to `backend` as `version` in the rollout format `fmt`.

    One tensor at a time (a layer slice made on the devices, in HF layout and the push's dtype
    `fetch_dtype(fmt)`, then fetched): the host never holds a full copy of the model. Process 0
    pushes (`backend` is None on the others); every process takes part in the per-tensor
    gathers of a multi-process run."""
    distributed.consume_on_main(
        lambda tensors: backend.push_weights(tensors, version),
        iter_hf_state(cfg, params, dtype=fetch_dtype(fmt)),
    )
