"""vLLM plugin: a weight-transfer backend that loads our shared-memory exports (ROLLOUT.md 4).

Runs inside vLLM's own venv (torch + vllm, no jax): it imports only vllm, torch and
`rollout_bridge.weight_files` (numpy/hashlib). vLLM calls `register()` in every process
through the `vllm.general_plugins` entry point declared in pyproject.toml; start the server with

    VLLM_SERVER_DEV_MODE=1 vllm serve <hf_dir> --weight-transfer-config '{"backend": "jfp8rl_shm"}'

Update protocol (the client is `rollout_bridge.http_client.HttpBackend`):
  /init_weight_transfer_engine {"init_info": {"root": <export root or null>}}
  /start_weight_update                 -> nothing yet (see below)
  /update_weights {"update_info": {"path": <version dir>, "version": str,
                                   "manifest_sha256": str | null}}
                                       -> `load_export(path, framework="pt")` verifies the
                                          manifest (sha256, version, sizes, per-tensor blake3);
                                          only then is vLLM's layerwise reload initialised and
                                          the tensors go to `model.load_weights` (vLLM fuses
                                          q/k/v and gate/up itself); the tensors are
                                          views of the mapped file (`mapped=True`),
                                          hashed in place: no host copy of the model
  /finish_weight_update {"weight_version": str}
                                       -> layerwise reload finalised, plus the CPU fix below.

The reload is initialised only after verification because initialising it moves the layers'
parameters to the meta device: a refused (tampered, truncated, wrong-version) export then
leaves the served weights untouched and the server keeps serving the old version (vLLM ends
the update session when `update_weights` raises; the route answers HTTP 500).

CPU tied-LM-head fix (measured bug in vLLM 0.32's CPU backend): each linear keeps a packed
private copy `layer.cpu_linear`; with tied embeddings the LM head receives no tensor of its own,
so the reload never re-packs it and logits keep the old embedding. After finalising we re-run
`quant_method.process_weights_after_loading` on every `VocabParallelEmbedding` that has
`cpu_linear` (the LM head is one), which re-packs it from the new weight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout_bridge.weight_files import ExportError, load_export

ENGINE_NAME = "jfp8rl_shm"
logger = logging.getLogger("vllm.jfp8rl_shm")


def register() -> None:
    """Registers the `jfp8rl_shm` weight-transfer engine with vLLM (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            ENGINE_NAME, "rollout_bridge.vllm_plugin", "ShmWeightTransferEngine"
        )
    except ValueError:  # already registered in this process
        pass


@dataclasses.dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """root: if set, every update path must lie under it (refuses stray paths)."""

    root: str | None = None


@dataclasses.dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One exported version: its folder, its label, and the sha256 of its manifest.json."""

    path: str
    version: str
    manifest_sha256: str | None = None


def repack_cpu_embeddings(model: torch.nn.Module) -> int:
    """Re-packs `cpu_linear` of every vocab embedding / LM head; returns how many were."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            n += 1
    return n


def engine_cores() -> frozenset[int]:
    """The cores vLLM's engine process (this worker's parent) may run on: the set before vLLM's
    CPU backend pins its workers (`VLLM_CPU_OMP_THREADS_BIND`; the default reserves a core for
    the API server, `VLLM_CPU_NUM_OF_RESERVED_CPU`). This process's own set where the parent
    is gone or not ours to ask."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        return frozenset(os.sched_getaffinity(0))


@contextlib.contextmanager
def on_cores(cores: frozenset[int]) -> Iterator[None]:
    """The calling thread on `cores` (and with it every thread it starts, which inherit its
    set), then back on its own set. A no-op where it already may run on all of them."""
    own = os.sched_getaffinity(0)
    if own >= cores:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads `rollout_bridge.export` folders from shared memory into the served model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._root: Path | None = None
        self._reloading = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._root = Path(init_info.root).resolve() if init_info.root else None

    def start_weight_update(self) -> None:
        self._reloading = False

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        path = Path(update_info.path).resolve()
        if self._root is not None and self._root not in path.parents:
            raise ExportError(
                f"update path {path} is outside the export root {self._root} given at "
                "/init_weight_transfer_engine"
            )
        t0 = time.perf_counter()
        # Generation is paused: the verifying threads may use the engine's cores, also the one
        # vLLM's CPU backend reserves for its idle API server, rather than the one core OpenMP
        # pinned this thread to (measured, 100M bf16 export, 2 cores: 0.073 -> 0.044 s).
        with on_cores(engine_cores()):
            cores = sorted(os.sched_getaffinity(0))
            tensors, manifest = load_export(
                path,
                verify=True,
                framework="pt",
                expected_version=update_info.version,
                expected_manifest_sha256=update_info.manifest_sha256,
                mapped=True,  # `model.load_weights` copies each tensor into the model's own
            )  # parameters; the mapping goes when the last view does
        quantized = manifest.get("quantization_config") is not None
        served_quant = getattr(self.model_config, "quantization", None)
        if quantized and served_quant != "fp8":
            raise ExportError(
                f"{path} is in FP8 checkpoint format but the server runs quantization="
                f"{served_quant!r}; start vLLM on an FP8 checkpoint (quantization_config in "
                "config.json) or export with fmt='bf16' / 'fp8_fp32'"
            )
        if not self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
        t1 = time.perf_counter()
        self.model.load_weights(list(tensors.items()))
        logger.info(
            "jfp8rl_shm: %s mapped+verified in %.3f s, loaded in %.3f s (verified on cores %s, worker on %s)",
            update_info.version,
            t1 - t0,
            time.perf_counter() - t1,
            cores,
            sorted(os.sched_getaffinity(0)),
        )

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return  # no verified update arrived: the served weights are unchanged
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False
        t1 = time.perf_counter()
        if self.device.type == "cpu":
            repack_cpu_embeddings(self.model)
        logger.info(
            "jfp8rl_shm: finalized in %.3f s, embeddings repacked in %.3f s",
            t1 - t0,
            time.perf_counter() - t1,
        )

    def shutdown(self) -> None:
        self._root = None
