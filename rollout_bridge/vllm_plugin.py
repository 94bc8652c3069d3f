"""vLLM plugin: a weight-transfer backend that loads our shared-memory exports
(docs/rollout.md section 4).

Runs inside vLLM's own venv (torch + vllm, no jax): it imports only vllm, torch and
`rollout_bridge.weights` (numpy/hashlib). vLLM calls `register()` in every process
through the `vllm.general_plugins` entry point declared in pyproject.toml; start the server with

    VLLM_SERVER_DEV_MODE=1 vllm serve <hf_dir> --weight-transfer-config '{"backend": "jfp8rl_shm"}'

Update protocol (the client is `rollout_bridge.client.http_backend.HttpBackend`):
  /init_weight_transfer_engine {"init_info": {"root": <export root or null>}}
  /start_weight_update                 -> nothing yet (see below)
  /update_weights {"update_info": {"path": <version dir>, "version": str,
                                   "manifest_sha256": str | null}}
                                       -> `weights.reader.open_export(path, framework="pt",
                                          mapped=True)`
                                          checks the manifest (sha256, version, sizes,
                                          headers) and starts hashing every tensor (the
                                          manifest's `hash`, xxh3_128 by default; its
                                          package must be in vLLM's venv) in file order
                                          on the engine's cores other than the worker
                                          thread's (`hashing_cores`); vLLM's
                                          layerwise reload is initialised and the tensors go
                                          to `model.load_weights` (vLLM fuses q/k/v and
                                          gate/up itself) each as soon as its digest matched,
                                          so verifying overlaps loading; the tensors are views
                                          of the mapped file, hashed in place: no host copy
  /finish_weight_update {"weight_version": str}
                                       -> layerwise reload finalised, plus the CPU fix below.

A refused export leaves the server serving the old weights and version (vLLM ends the update
session when `update_weights` raises; the route answers HTTP 500):
  - an export whose layout the served linear layers cannot take (`rollout_bridge.vllm_layout`:
    block FP8 into unquantized or online-quantized layers, float weights into FP8 checkpoint
    layers, another FP8 block size) is refused from its manifest, before a tensor is read;
  - a wrong manifest, version, size or header is refused before any weight is touched;
  - a digest mismatch (a tampered or corrupt tensor) can surface only after earlier tensors
    were loaded, so the plugin rolls back: it closes the broken reload and reloads the weights
    of the last finished update (its export folders, verified again) or, before the first
    one, the model's own checkpoint (vLLM's loader on `--model`; not under `--load-format
    dummy`, part of the block-FP8 serving flags, whose placeholder weights are not worth
    restoring). It loads tensor by tensor only when that rollback source is there (`check_export_files`: manifest and sizes; the
    trainer keeps the served version when it writes the next, `keep` >= 2); otherwise it
    verifies the whole export first and loads after, so a refused export touches no weight.
    A rollback that itself fails stops the server process (exit code 70) rather than serve a
    mix of two versions.
Each update logs its stage times (open; verify + load), which `benchmarks/weight_sync.py`
collects from the server log.

FP8 KV-cache scales (`apply_kv_scales`): on a server started with `--kv-cache-dtype fp8`,
every export must carry `model.layers.<l>.self_attn.k_scale` / `v_scale` (the trainer's scales
of the pushed weights, `rollout_bridge.weights.kv_scales`); they are taken out of the stream
given to `model.load_weights` and written into each attention layer's `_k_scale` /
`_v_scale` (tensors and their float copies, which vLLM's attention backends read) when the
update finishes, so a refused update leaves the old weights with their old scales. An export
without them is refused before any byte loads on such a server (it would keep scales of older
weights, or vLLM's uncalibrated 1.0), and one with them on a server without an FP8 cache too.

CPU tied-LM-head fix (a bug of vLLM 0.32's CPU backend): each linear keeps a packed
private copy `layer.cpu_linear`; with tied embeddings the LM head receives no tensor of its own,
so the reload never re-packs it and logits keep the old embedding. After finalising we re-run
`quant_method.process_weights_after_loading` on every `VocabParallelEmbedding` that has
`cpu_linear` (the LM head is one), which re-packs it from the new weight.

CPU MoE fix (another bug of vLLM 0.32's CPU backend): its unquantized MoE kernel reads each
layer's experts (`w13_weight`, `w2_weight`) in a pre-packed layout that only the first load
writes; a reload copies the new weights in unpacked and skips the packing, so the experts
compute with scrambled weights (logprob errors of 1e-2 on a tiny Qwen3-MoE even when the same
weights are pushed again). For every such layer that took weights in the update, the plugin
re-runs the kernel's own `process_weights_after_loading` after finalising, which packs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rollout_bridge.vllm_layout import check_export_layout
from rollout_bridge.weights import ExportError
from rollout_bridge.weights.kv_scales import is_kv_scale, kv_scale_name
from rollout_bridge.weights.reader import (
    check_export_files,
    load_export,
    open_export,
    read_manifest,
)

ENGINE_NAME = "jfp8rl_shm"
ROLLBACK_FAILED_EXIT = 70  # the process exits with this when it cannot restore its weights
logger = logging.getLogger("vllm.jfp8rl_shm")


def register() -> None:
    """Registers the `jfp8rl_shm` weight-transfer engine with vLLM (idempotent)."""
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
    # vLLM's model executor takes seconds to import; of the processes that import this plugin
    # only the worker loading weights needs it (also below).
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            n += 1
    return n


def reloaded_cpu_moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers run by vLLM's CPU unquantized experts kernel that took weights in the open
    layerwise reload: processed already (all their tensors arrived) or about to be by its
    finalisation (some did). Ask before `finalize_layerwise_reload`: layers that took none get
    their packed tensors back there and must not be packed again."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if not isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            continue
        info = get_layerwise_info(module)
        if not info.can_load() or info.load_numel > 0:
            layers.append(module)
    return layers


def repack_cpu_moe_experts(layers: Iterable[torch.nn.Module]) -> int:
    """Packs the reloaded expert weights of `layers` (`reloaded_cpu_moe_layers`, after the
    reload is finalised) into the CPU kernel's layout; returns how many layers."""
    n = 0
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
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


def hashing_cores() -> frozenset[int]:
    """Where the plugin hashes an export while this thread loads it: the engine's cores other
    than this thread's own (on a 2-core host, the API server's idle core), or all of the
    engine's where this thread may already run on every one."""
    return (engine_cores() - os.sched_getaffinity(0)) or engine_cores()


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


def without_kv_scales(
    tensors: Iterable[tuple[str, Any]], taken: dict[str, float]
) -> Iterator[tuple[str, Any]]:
    """The tensors other than FP8 KV-cache scales, which go into `taken` ({name: float})."""
    for name, x in tensors:
        if is_kv_scale(name):
            taken[name] = float(x.reshape(()).item())
        else:
            yield name, x


def apply_kv_scales(model: torch.nn.Module, scales: dict[str, float]) -> int:
    """Writes pushed K/V scales into the attention layers `model.layers.<l>.self_attn.attn`
    (`_k_scale` / `_v_scale`, their `_float` and `_cpu` copies); returns how many layers.
    Raises ExportError naming the first layer that has none."""
    from vllm.model_executor.layers.attention.attention import Attention  # worker only, heavy

    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        values = []
        for kind in "kv":
            key = kv_scale_name(layer, kind)
            if key not in scales:
                raise ExportError(f"the pushed KV-cache scales lack {key} (attention {name})")
            values.append(scales[key])
        for kind, value in zip("kv", values, strict=True):
            getattr(module, f"_{kind}_scale").fill_(value)
            setattr(module, f"_{kind}_scale_float", value)
            if hasattr(module, f"_{kind}_scale_cpu"):
                getattr(module, f"_{kind}_scale_cpu").fill_(value)
        n += 1
    return n


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads `rollout_bridge.export` folders (`rollout_bridge.weights` format) from shared
    memory into the served model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._root: Path | None = None
        self._reloading = False
        self._session: list[Path] = []  # export folders loaded in the open update session
        self._served: list[Path] | None = None  # those of the last finished one (None: --model)
        self._kv_scales: dict[str, float] = {}  # FP8 KV-cache scales of the open session

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._root = Path(init_info.root).resolve() if init_info.root else None

    def start_weight_update(self) -> None:
        self._reloading = False
        self._session = []
        self._kv_scales = {}

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        path = Path(update_info.path).resolve()
        if self._root is not None and self._root not in path.parents:
            raise ExportError(
                f"update path {path} is outside the export root {self._root} given at "
                "/init_weight_transfer_engine"
            )
        t0 = time.perf_counter()
        try:
            self._check_layout(path)
            # Generation is paused: the hashing threads run on the engine's other cores (the
            # one vLLM's CPU backend reserves for its idle API server) while this thread loads
            # on the core OpenMP pinned it to, so verifying overlaps loading. They start inside
            # `on_cores` and keep its set; this thread goes back to its own core.
            with on_cores(hashing_cores()):
                cores = sorted(os.sched_getaffinity(0))
                stream, manifest = open_export(
                    path,
                    verify=True,
                    framework="pt",
                    expected_version=update_info.version,
                    expected_manifest_sha256=update_info.manifest_sha256,
                    mapped=True,  # `model.load_weights` copies each tensor into the model's
                )  # own parameters; the mapping goes when the last view does
            with contextlib.closing(stream):
                self._check_kv_scales(path, manifest)
                overlap = self._rollback_source_ok()
                # Without a way back, every digest is checked before a weight is touched.
                tensors: Iterable[tuple[str, Any]] = stream if overlap else list(stream)
                t1 = time.perf_counter()
                self._begin_reload()
                self.model.load_weights(without_kv_scales(tensors, self._kv_scales))
        except BaseException as e:
            if self._reloading:  # some weights of this session are in: restore the old ones
                self._roll_back(path, e)
            raise
        self._session.append(path)
        logger.info(
            "jfp8rl_shm: %s opened in %.3f s, verified+loaded (%s) in %.3f s "
            "(verified on cores %s, worker on %s)",
            update_info.version,
            t1 - t0,
            "overlapped" if overlap else "verified first",
            time.perf_counter() - t1,
            cores,
            sorted(os.sched_getaffinity(0)),
        )

    def _check_layout(self, path: Path) -> None:
        """Refuses, from the manifest alone (before a tensor is read), an export whose format
        or FP8 block size the served linear layers cannot take (`vllm_layout`)."""
        check_export_layout(path, read_manifest(path), self.vllm_config.quant_config)

    def _check_kv_scales(self, path: Path, manifest: dict[str, Any]) -> None:
        """An FP8-cache server takes only exports with KV-cache scales, others only without."""
        fp8_cache = str(self.vllm_config.cache_config.cache_dtype).startswith("fp8")
        pushed = any(is_kv_scale(n) for n in manifest.get("tensors", {}))
        if fp8_cache and not pushed:
            raise ExportError(
                f"{path} has no KV-cache scales but the server runs --kv-cache-dtype "
                f"{self.vllm_config.cache_config.cache_dtype}; set rollout.kv_cache_dtype: fp8 "
                "so the trainer pushes the scales of its weights"
            )
        if pushed and not fp8_cache:
            raise ExportError(
                f"{path} carries FP8 KV-cache scales but the server's KV cache is not FP8; "
                "start vLLM with --kv-cache-dtype fp8 or set rollout.kv_cache_dtype: auto"
            )

    def _begin_reload(self) -> None:
        if not self._reloading:
            from vllm.model_executor.model_loader.reload import (  # worker only, heavy
                initialize_layerwise_reload,
            )

            initialize_layerwise_reload(self.model)
            self._reloading = True

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import (  # worker only, heavy
            finalize_layerwise_reload,
        )

        cpu = self.device.type == "cpu"
        moe_layers = reloaded_cpu_moe_layers(self.model) if cpu else []
        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False
        if cpu:
            repack_cpu_embeddings(self.model)
            repack_cpu_moe_experts(moe_layers)

    def _rollback_source_ok(self) -> bool:
        """Whether the weights served before this session can be loaded again: the export
        folders of the last finished update still complete (manifest, sizes; not digests), or,
        before any, `--model` a local folder."""
        if self._served is None:  # `--load-format dummy` would restore random weights
            dummy = self.vllm_config.load_config.load_format == "dummy"
            return Path(self.model_config.model).is_dir() and not dummy
        try:
            for d in self._served:
                check_export_files(d)
        except (ExportError, OSError, KeyError):
            return False
        return True

    def _rollback_weights(self) -> Iterator[tuple[str, Any]]:
        if self._served is None:
            from vllm.model_executor.model_loader import get_model_loader  # worker only, heavy

            loader = get_model_loader(self.vllm_config.load_config)
            yield from loader.get_all_weights(self.model_config, self.model)
            return
        for d in self._served:
            tensors, _ = load_export(d, verify=True, framework="pt", mapped=True)
            yield from tensors.items()

    def _roll_back(self, path: Path, cause: BaseException) -> None:
        """Closes the broken reload (called only while one is open) and loads the weights
        served before this session again; exits the process where even that fails (it would
        serve a mix of two versions)."""
        source = "the model checkpoint" if self._served is None else [str(d) for d in self._served]
        try:
            self._end_reload()  # layers not yet loaded get their old tensors back
            self._begin_reload()
            self.model.load_weights(without_kv_scales(self._rollback_weights(), {}))
            self._end_reload()
        except BaseException:
            logger.exception(
                "jfp8rl_shm: %s failed mid-load (%s) and restoring %s failed too: the weights "
                "are a mix of two versions; exiting",
                path,
                cause,
                source,
            )
            os._exit(ROLLBACK_FAILED_EXIT)
        self._session, self._kv_scales = [], {}
        logger.warning("jfp8rl_shm: %s refused mid-load (%s); restored %s", path, cause, source)

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return  # no verified update arrived: the served weights are unchanged
        t0 = time.perf_counter()
        self._end_reload()
        if self._kv_scales:
            apply_kv_scales(self.model, self._kv_scales)
        self._served, self._session = self._session, []
        logger.info(
            "jfp8rl_shm: finalized and embeddings repacked in %.3f s", time.perf_counter() - t0
        )

    def shutdown(self) -> None:
        self._root = None
