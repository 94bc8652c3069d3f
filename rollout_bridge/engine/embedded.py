"""`EmbeddedBackend`: the default `RolloutBackend` (docs/design.md section 6), in-process.

It runs the same `models` decoder as the trainer, under the rollout recipe (`fp8_block` by
default: W8A8 with 128 x 128 weight blocks and 1 x 128 activation tiles, as vLLM serves FP8
block checkpoints).

Generation, one jitted call (`programs.generate_rows`) per chunk of at most `max_num_seqs`
rows (a `generate`'s prompts x n samples, prompt-major, padded: `batching`): `prefill` fills
the KV cache once per distinct prompt (its n samples copy that row, as vLLM's parallel
sampling shares the prompt's KV blocks), then a `lax.while_loop` runs `decode_step` + sampling
until every row has stopped (stop/eos token or its max_tokens). Every sampling knob is a traced
per-row array, so steps of similar shapes reuse one executable. Sampling and the logprob
convention are `sampling`'s: a sampled token's logprob is that of the distribution actually
sampled from; greedy (temperature 0) gives the argmax and its raw logprob.

Weights. `push_weights(hf_state, version)` goes the way an external server's weights go:
`rollout_bridge.export.export_weights` writes the rollout format into the shared-memory export
folder, `weights.reader.load_export` reads it back verified (a digest per tensor, the version),
and `load_export_dir` installs it (`params`; the server's `/update_weights` ends there too). The
default format is "fp8" for a block-FP8 recipe (what a GPU vLLM FP8 server receives: e4m3
linears + f32 `weight_scale_inv` per 128 x 128 block, the quantizer the trainer uses;
embeddings, norms, biases bf16) and "fp32" otherwise; any export format can be chosen.

KV cache (`kv_cache_dtype`): "auto" keeps keys and values in the compute dtype, "bf16" in
bfloat16, "fp8" as E4M3 with one K and one V scale per layer (`models.kv_quant`, vLLM's
`--kv-cache-dtype fp8` numerics). FP8 scales follow the installed weights: an export that
carries `model.layers.<l>.self_attn.k_scale` / `v_scale` (the trainer's push) installs those;
otherwise every install recalibrates them on the sequences (prompt ++ response) of the
engine's latest generation under the new weights (`models.kv_calibration`, amax / 448), and
before any generation the first call calibrates on its own prompts before it decodes. So no
generation runs on the scales of older weights, nor on vLLM's default 1.0.

Against the trainer's recipe on the f32 masters: "fp8_fp32" holds the trainer's FP8 values
exactly, "fp8" also rounds embeddings, norms and biases to bf16 (the engine tests bound both). With bf16 compute the model's `Linear` casts its kernel to
bf16 *before* quantizing: the trainer's FP8 weights are Q(bf16(W)), every export holds Q(W).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.fp8 import Recipe, get_recipe
from models.hf_io import load_hf
from models.kv_quant import KVScales
from models.tokenizer import stop_token_ids
from rollout_bridge.backend import (
    Completion,
    HFTensors,
    RolloutBackend,
    RolloutError,
    SamplingParams,
)
from rollout_bridge.engine import params as engine_params
from rollout_bridge.engine import sampling as smp
from rollout_bridge.engine.batching import (
    DEFAULT_MAX_NUM_SEQS,
    GenerateBatch,
    check_ids,
    completions,
    generate_batch,
    row_chunks,
    score_batch,
)
from rollout_bridge.engine.kv_cache import KVCacheScales
from rollout_bridge.engine.programs import generate_rows, score_logprobs, score_ranks
from rollout_bridge.export import export_weights
from rollout_bridge.weights.kv_scales import split_kv_scales
from rollout_bridge.weights.reader import load_export
from rollout_bridge.weights.store import default_root


def default_export_format(recipe: Recipe) -> str:
    """The export format of an engine without `export_format`: FP8 checkpoint format for the
    block-FP8 E4M3 recipe (the engine then serves the trainer's own FP8 weights), else fp32."""
    block_fp8 = recipe.fwd_format == "e4m3" and recipe.weight_granularity == "block"
    return "fp8" if block_fp8 else "fp32"


class EmbeddedBackend(RolloutBackend):
    """The in-process JAX rollout engine (module docstring).

    Args:
      cfg: the model config (from `models.config` or `models.hf_io.load_hf`).
      graphdef, params: the NNX split of the policy (`models.functional.init_model`, `load_hf`);
        params are copied, so the caller may donate or delete its own buffers. params=None:
        no weights (generate / score refuse) until the first `push_weights`.
      recipe: rollout recipe name or `Recipe` ("fp8_block" default, "bf16", "fp8_tensor", ...).
      eos_id: the model's end-of-turn ids, one int or several (`models.tokenizer.stop_token_ids`
        of its folder: the tokenizer's eos and every `eos_token_id` of config.json and
        generation_config.json); generation stops on any of them unless `ignore_eos`, also for
        a request that names no stop ids, as vLLM does. None: no eos.
      max_len: longest prompt + response, in tokens (default `cfg.max_position_embeddings`).
      weight_version: version label of `params` ("default", as vLLM reports before any push).
      export_root: where `push_weights` writes its exports (one version is kept). Default: a
        private folder under `weights.store.default_root()` (shared memory), gone at `close()`.
      export_format: the format `push_weights` exports ("fp32" | "bf16" | "fp8" | "fp8_fp32",
        `rollout_bridge.export`). Default: "fp8" (block-FP8 checkpoint format, what a GPU vLLM
        FP8 server receives) for a block-FP8 recipe, "fp32" for any other recipe.
      max_num_seqs: the most sequences one jitted call decodes or scores (vLLM's
        `--max-num-seqs`); larger calls run in chunks of it, so the KV cache holds at most
        max_num_seqs x (bucketed prompt + new tokens) entries whatever a call asks.
      kv_cache_dtype: "auto" (compute dtype), "bf16" or "fp8" (E4M3 with per-layer scales,
        recalibrated at every install: module docstring).
      record_routing: a Mixture-of-Experts model's completions carry the experts every layer
        routed each token to (`Completion.routed_experts`, routing replay); the decode loop
        keeps them beside the KV cache (2 bytes per token, layer and expert slot).

    Thread-safe: one lock serialises the jitted calls and installs (the HTTP server runs
    threads); it is taken per chunk, so concurrent calls take turns chunk by chunk.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: Any,
        params: Any | None,
        *,
        recipe: str | Recipe = "fp8_block",
        eos_id: int | Iterable[int] | None,
        max_len: int | None = None,
        weight_version: str = "default",
        export_root: str | Path | None = None,
        export_format: str | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        kv_cache_dtype: str = "auto",
        record_routing: bool = False,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"EmbeddedBackend: max_num_seqs={max_num_seqs} must be >= 1")
        self.kv_cache_dtype = kv_cache_dtype
        self.record_routing = bool(record_routing) and cfg.is_moe
        self.cfg = cfg
        self.graphdef = graphdef
        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        # Weights are fake-quantized once when installed (`params.install`), so the forward
        # runs with prequantized_weights=True (the emulated FP8 GEMM; Pallas quantizes itself).
        self._forward_recipe = (
            dataclasses.replace(self.recipe, prequantized_weights=True)
            if self.recipe.quantized and self.recipe.backend == "emulate"
            else self.recipe
        )
        self._kv = KVCacheScales(kv_cache_dtype, graphdef, self._forward_recipe)
        self._lock = threading.Lock()
        # Own buffers: the trainer donates its train-state params to its update, and a
        # `device_put` to the same placement returns the same buffers, so holding the caller's
        # arrays could leave the engine with deleted ones. None: no weights until a push.
        self.params = None if params is None else jax.tree.map(jnp.copy, params)
        ids = [] if eos_id is None else [eos_id] if np.ndim(eos_id) == 0 else list(eos_id)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids))
        self.max_len = int(max_len or cfg.max_position_embeddings)
        self.max_num_seqs = int(max_num_seqs)
        # The engine loads an export right after writing it, so one version on disk is enough;
        # a private default folder under shared memory is removed by close().
        self._owns_root = export_root is None
        self.export_root = (
            default_root() / f"embedded-{secrets.token_hex(4)}"
            if export_root is None
            else Path(export_root)
        )
        self.export_format = export_format or default_export_format(self.recipe)
        self._version = weight_version
        self._closed = False

    @classmethod
    def from_hf_dir(
        cls,
        model_dir: str | Path,
        *,
        recipe: str | Recipe = "fp8_block",
        config_overrides: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> EmbeddedBackend:
        """Loads an HF folder (config.json, safetensors, tokenizer.json), as vLLM would.

        `config_overrides` set non-HF config fields (e.g. {"compute_dtype": jnp.float32});
        other keyword arguments go to the constructor (eos_id defaults to the folder's
        end-of-turn ids, `models.tokenizer.stop_token_ids`)."""
        cfg, graphdef, params = load_hf(model_dir, **dict(config_overrides or {}))
        kwargs.setdefault("eos_id", stop_token_ids(model_dir))
        return cls(cfg, graphdef, params, recipe=recipe, **kwargs)

    # -- RolloutBackend --------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        seed_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """All prompts x n samples, completions prompt-major, decoded in chunks of at most
        `max_num_seqs` rows, one jitted loop each (`batching.row_chunks`): row r of the call is
        sample r % n of prompt r // n, and chunk c decodes rows [c * max_num_seqs, (c + 1) *
        max_num_seqs). Sample j of prompt i is keyed by (seed, seed_indices[i], j) (default
        seed index: i) whatever chunk it lands in, so a call that fits one chunk is exactly the
        unchunked decode, and a larger one samples the same tokens (logprobs equal up to the
        float rounding of another batch shape). A seedless call draws one seed for all chunks."""
        sp = sampling
        self._check_weights()
        prompts = [tuple(int(t) for t in p) for p in prompts]
        if not prompts:
            return []
        seed_idx = list(range(len(prompts))) if seed_indices is None else list(seed_indices)
        if len(seed_idx) != len(prompts) or any(not 0 <= k < 2**31 for k in seed_idx):
            raise RolloutError(
                f"embedded: seed_indices needs one index in [0, 2^31) per prompt "
                f"({len(prompts)}), got {seed_idx[:5]}..."
            )
        for i, p in enumerate(prompts):
            if not p:
                raise RolloutError(f"embedded: prompt {i} is empty; give at least one token")
            if len(p) + sp.max_tokens > self.max_len:
                raise RolloutError(
                    f"embedded: prompt {i} has {len(p)} tokens + max_tokens={sp.max_tokens} > "
                    f"max_len={self.max_len}; shorten it or raise max_len"
                )
            check_ids(p, self.cfg.vocab_size, f"prompt {i}")
        check_ids(sp.stop_token_ids, self.cfg.vocab_size, "stop_token_ids")
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.eos_ids)
        seed = secrets.randbits(64) if sp.seed is None else int(sp.seed) % (1 << 64)
        out: list[Completion] = []
        for rows in row_chunks(len(prompts) * sp.n, self.max_num_seqs):
            batch = generate_batch(prompts, seed_idx, sp, stops, rows)
            out += self._decode(prompts, batch, sp, seed, stops)
        return out

    def _decode(
        self,
        prompts: list[tuple[int, ...]],
        batch: GenerateBatch,
        sp: SamplingParams,
        seed: int,
        stops: set[int],
    ) -> list[Completion]:
        """One chunk's jitted decode (`programs.generate_rows`) -> its completions."""
        b = batch.prompt.shape[0]
        keys = smp.row_keys(
            jnp.full((b,), seed & 0xFFFFFFFF, jnp.uint32),
            jnp.full((b,), seed >> 32, jnp.uint32),
            jnp.asarray(batch.key_index),
            jnp.asarray(batch.sample_index),
        )
        prompt, mask = jnp.asarray(batch.prompt), jnp.asarray(batch.mask)
        with self._lock:
            version = self._version
            toks, lps, lens, routing = generate_rows(
                self.graphdef,
                self.params,
                jnp.asarray(batch.prefill_prompt),
                jnp.asarray(batch.prefill_mask),
                jnp.asarray(batch.source),
                keys,
                jnp.full((b,), sp.temperature, jnp.float32),
                jnp.full((b,), min(sp.top_k, self.cfg.vocab_size), jnp.int32),  # >= V: off
                jnp.full((b,), sp.top_p, jnp.float32),
                jnp.asarray(batch.stop_ids),
                jnp.asarray(batch.max_new),
                self._kv.current(self.params, prompt, mask, batch.max_new > 0),
                cfg=self.cfg,
                recipe=self._forward_recipe,
                cache_len=batch.cache_len,
                kv_cache_dtype=self.kv_cache_dtype,
                record_routing=self.record_routing,
            )
            toks, lps, lens = np.asarray(toks), np.asarray(lps), np.asarray(lens)
            routing = None if routing is None else np.asarray(routing)
            self._kv.keep_rows(batch.prompt, batch.mask, toks, lens, batch.max_new > 0)
        return completions(prompts, batch, toks, lps, lens, routing, stops, version)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced logprobs under the rollout recipe, temperature 1; entry 0 = 0
        (`models.functional.token_logprobs`, chunked over the vocabulary head), at most
        `max_num_seqs` sequences per jitted call."""
        out = []
        for tokens, mask, lengths in self._score_chunks(sequences):
            with self._lock:
                tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
                lp = score_logprobs(
                    self.graphdef,
                    self.params,
                    tokens,
                    mask,
                    self._kv.current(
                        self.params, tokens, mask, np.arange(len(mask)) < len(lengths)
                    ),
                    recipe=self._forward_recipe,
                    kv_cache_dtype=self.kv_cache_dtype,
                )
                lp = np.asarray(lp)
            out += [lp[r, :n].copy() for r, n in enumerate(lengths)]
        return out

    def score_with_ranks(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`score` plus each token's rank (1 = the argmax), as vLLM's `prompt_logprobs`.
        Builds the [B, T, V] logits of a chunk (B <= max_num_seqs) at once: meant for the
        server's small scoring requests."""
        out = []
        for tokens, mask, lengths in self._score_chunks(sequences):
            with self._lock:
                tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
                lp, rank = score_ranks(
                    self.graphdef,
                    self.params,
                    tokens,
                    mask,
                    self._kv.current(
                        self.params, tokens, mask, np.arange(len(mask)) < len(lengths)
                    ),
                    recipe=self._forward_recipe,
                    kv_cache_dtype=self.kv_cache_dtype,
                )
                lp, rank = np.asarray(lp), np.asarray(rank)
            out += [(lp[r, :n].copy(), rank[r, :n].copy()) for r, n in enumerate(lengths)]
        return out

    def _score_chunks(
        self, sequences: Sequence[Sequence[int]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, list[int]]]:
        """Right-padded, bucketed (tokens, mask) and the true lengths of at most `max_num_seqs`
        sequences at a time, after the checks of all of them."""
        self._check_weights()
        seqs = [tuple(int(t) for t in s) for s in sequences]
        for i, s in enumerate(seqs):
            if not s or len(s) > self.max_len:
                raise RolloutError(
                    f"embedded: sequence {i} has {len(s)} tokens; need 1..max_len={self.max_len}"
                )
            check_ids(s, self.cfg.vocab_size, f"sequence {i}")
        for rows in row_chunks(len(seqs), self.max_num_seqs):
            yield score_batch(seqs[rows.start : rows.stop])

    def push_weights(self, hf_state: HFTensors, version: str) -> None:
        """Exports `hf_state` in `self.export_format` to the shared-memory export root, loads
        it back with the manifest verified, and installs it (the path an external server's
        weights take)."""
        self._check_open()
        export_dir = export_weights(
            hf_state, version, fmt=self.export_format, root=self.export_root, keep=1
        )
        self.load_export_dir(export_dir, version=version)

    def load_export_dir(
        self,
        export_dir: str | Path,
        *,
        version: str | None = None,
        manifest_sha256: str | None = None,
    ) -> None:
        """Installs the weights of one export folder, verified against its manifest (and the
        expected version / manifest hash when given); `push_weights` and the server's
        `/update_weights` route both end here. Labels them `version` when given."""
        self._check_open()
        tensors, manifest = load_export(
            export_dir,
            verify=True,
            expected_version=version,
            expected_manifest_sha256=manifest_sha256,
        )
        tensors, pushed = split_kv_scales(tensors, self.cfg.num_layers)
        served = engine_params.served_params(self.cfg, tensors, manifest.get("quantization_config"))
        del tensors
        self._install(served, pushed, version)

    def _install(self, served: Any | None, pushed: Any, version: str | None = None) -> None:
        """Installs `served` (None: no weights). The previous weights go before the new ones
        are built (under the lock: no decode runs meanwhile), so the engine never holds two
        installs at once."""
        with self._lock:
            self._params, self._kv.scales = None, None
            if served is not None:
                params = engine_params.install(served, self.cfg, self.recipe)
                self._params, self._kv.scales = params, self._kv.for_install(params, pushed)
            if version is not None:
                self._version = version

    @property
    def params(self) -> Any | None:
        """The installed weights: the export's tensors, with every decoder linear kernel
        replaced by its operand values (`params.install`). Assigning params (f32 masters, or
        `params.served_params` of an export) installs them."""
        return self._params

    @params.setter
    def params(self, params: Any | None) -> None:
        self._install(params, None)

    def release_weights(self) -> None:
        """Drops the installed weights and KV scales (the version stays) until the next push."""
        self._install(None, None)

    @property
    def kv_scales(self) -> KVScales | None:
        """The FP8 KV-cache scales of the installed weights (None: none yet, or no FP8 cache)."""
        return self._kv.scales

    def set_weight_version(self, version: str) -> None:
        """Labels the installed weights (the server's `/finish_weight_update`)."""
        with self._lock:
            self._version = version

    def weight_version(self) -> str:
        return self._version

    def health(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Marks the backend closed and removes its private export folder (idempotent)."""
        self._closed = True
        if self._owns_root:
            shutil.rmtree(self.export_root, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("embedded: the backend was closed; create a new EmbeddedBackend")

    def _check_weights(self) -> None:
        self._check_open()
        if self.params is None:
            raise RolloutError(
                "embedded: no weights (none pushed yet, or released); call push_weights first"
            )
