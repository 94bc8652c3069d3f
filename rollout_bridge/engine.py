"""The embedded rollout engine: the policy model in-process, KV-cache decoding, batched sampling.

`EmbeddedBackend` is the default `RolloutBackend` (DESIGN.md section 6). It runs the same
`models` decoder as the trainer, under the rollout recipe (`fp8_block` by default: W8A8 with
128 x 128 weight blocks and 1 x 128 activation tiles, as vLLM serves FP8 block checkpoints).

Generation, one jitted call per `generate`: every prompt x n samples is one row of a batch;
prompts are left-padded to a common length so the last prompt token of every row sits at the
same position; `prefill` fills the KV cache and gives the first next-token logits, then a
`lax.while_loop` runs `decode_step` + sampling until every row has finished (stop/eos token or
its max_tokens) or the step budget is spent. Those jitted programs are in
`rollout_bridge.engine_jit`; this module pads their batches and reads the results back.
Sampling rules and the logprob convention are in `rollout_bridge.sampling`: the logprob of
each sampled token is that of the distribution actually sampled from (temperature-scaled,
top-k/top-p renormalised), which equals the raw `log_softmax` at temperature 1 without
truncation; greedy (temperature 0) gives the argmax and its raw logprob.

Compiled shapes are bucketed to powers of two (rows >= 8, prompt length >= 16, new tokens
>= 16), and every sampling knob is a traced per-row array, so RL steps with similar shapes
reuse one executable. Buckets only add padding: samples depend on (seed, prompt index, sample
index) alone, never on the bucket (`sampling` module).

Weights. `push_weights(hf_state, version)` goes through the same path as an external server:
`rollout_bridge.export.export_weights` writes the rollout format into the shared-memory export
folder, `weight_files.load_export` reads it back with the manifest verified (a digest per tensor,
version), and `load_export_dir` installs it (the server's `/update_weights` ends there too).
The default format is "fp8" for a block-FP8 recipe (what a GPU vLLM FP8 server receives: e4m3
linears + f32 `weight_scale_inv` per 128 x 128 block, the quantizer the trainer uses;
embeddings, norms, biases bf16) and "fp32" otherwise; any export format can be chosen.

How exports are held and consumed (quantized once per push, issue 13): `served_params` reads
every tensor as exported (bf16 stays bf16; an FP8 linear is e4m3 codes + f32 block scales),
then `engine_jit.install_kernels` turns each decoder linear's kernel, once per install, into
the operand every forward would compute from it: for an FP8 recipe the fake-quantized f32
values `Q(w)` (an FP8 linear first widened to `w = q * s`), for the unquantized recipe the
cast to the compute dtype. The forward then runs with `prequantized_weights=True`, so a decode
step only quantizes its activations. The numbers are those of re-quantizing in every step, bit
for bit (tested); the cost is memory: the installed kernels take 4 bytes per weight (f32
holding FP8 values; embeddings, norms, biases stay as exported), which on CPU is faster than
dequantizing 1-byte codes in every decode step. Re-quantizing `q * s` is not bit-idempotent in
general: the re-derived scale `fl(448 s) * (1/448)` can move s by one f32 ulp. The FP8 codes
are unchanged and scales agree to <= 1 ulp (tested), so the engine computes with q * s' for
|s' - s| <= 1 ulp, exactly as before.
Measured against the trainer's own recipe on the f32 masters (tiny model, N(0, 0.02) weights,
f32 compute, `tests/rollout_bridge/test_engine.py`): max |logprob diff| ~1e-6 with "fp8_fp32"
(the FP8 values, other tensors f32) and ~1e-2 with "fp8" (bf16 embeddings / norms / biases).
With bf16 compute the model's `Linear` casts its kernel to bf16 *before* quantizing, so the
trainer's FP8 weights are Q(bf16(W)) while every export holds Q(W): ~1e-2 apart (measured).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8
from models.config import ModelConfig
from models.fp8 import Recipe, get_recipe
from rollout_bridge import sampling as smp
from rollout_bridge.backend import (
    Completion,
    HFTensors,
    RolloutBackend,
    RolloutError,
    SamplingParams,
)
from rollout_bridge.engine_jit import generate_rows, install_kernels, score_logprobs, score_ranks
from rollout_bridge.weight_files import default_root

_MIN_ROWS, _MIN_PROMPT, _MIN_NEW, _STOP_SLOTS = 8, 16, 16, 8


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum): the compiled size for n."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def default_export_format(recipe: Recipe) -> str:
    """The export format of an engine without `export_format`: FP8 checkpoint format for the
    block-FP8 E4M3 recipe (the engine then serves the trainer's own FP8 weights), else fp32."""
    block_fp8 = recipe.fwd_format == "e4m3" and recipe.weight_granularity == "block"
    return "fp8" if block_fp8 else "fp32"


def served_params(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    quantization_config: Mapping[str, Any] | None,
) -> Any:
    """The params of an export as exported, before `install_kernels` (EmbeddedBackend.params):
    every tensor in its exported dtype (bf16 stays bf16), and each FP8 `weight` +
    `weight_scale_inv` pair as a `models.fp8.StoredFP8Weight` (e4m3 codes [L, in, out] and f32
    block scales [L, in/B, out/B], B from `quantization_config`), which the model expands to
    w = q * s one layer at a time inside its layer scan. The values the model computes with
    are those of the f32 widening, so compact and dense give the same logits bit for bit."""
    from models.hf_io import from_hf_state_dict, hf_name_map

    scale_suffix = ".weight_scale_inv"
    scales = {n: x for n, x in tensors.items() if n.endswith(scale_suffix)}
    block = (quantization_config or {}).get("weight_block_size")
    if scales and not block:
        raise RolloutError(
            f"embedded: export holds {sorted(scales)[0]} but its manifest has no "
            "quantization_config.weight_block_size; re-export with fmt='fp8'"
        )
    plain = {n: x for n, x in tensors.items() if n not in scales}
    params = from_hf_state_dict(cfg, plain, source="export", keep_dtype=True)
    rows_by_path: dict[tuple[str, ...], list[Any]] = {}
    for row in hf_name_map(cfg):
        rows_by_path.setdefault(row.path, []).append(row)
    for path, rows in rows_by_path.items():
        names = [r.name.removesuffix(".weight") + scale_suffix for r in rows]
        if not any(n in scales for n in names):
            continue
        missing = [n for n in names if n not in scales]
        if missing or not all(r.transposed for r in rows):
            raise RolloutError(f"embedded: export lacks FP8 scales {missing[:3]} of {path}")
        # HF [out, in] blocks -> our [in, out] kernel: the scale grid transposes with it.
        s = np.stack([np.asarray(scales[n], np.float32).T for n in names])
        if rows[0].layer is None:
            s = s[0]
        node = _node(params, path)
        node.set_value(fp8.StoredFP8Weight(node.get_value(), jnp.asarray(s), tuple(block)))
    return params


def _node(params: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


class EmbeddedBackend(RolloutBackend):
    """The in-process JAX rollout engine (module docstring).

    Args:
      cfg: the model config (from `models.config` or `models.hf_io.load_hf`).
      graphdef, params: the NNX split of the policy (`models.functional.init_model`, `load_hf`);
        params are copied, so the caller may donate or delete its own buffers. params=None:
        no weights until the first `push_weights` / `load_export_dir`; generate / score
        refuse until then.
      recipe: rollout recipe name or `Recipe` ("fp8_block" default; "bf16", "fp8_tensor",
        "fp8_row" too).
      eos_id: the tokenizer's eos id; generation stops on it unless `ignore_eos`. None: no eos.
      max_len: longest prompt + response, in tokens (default `cfg.max_position_embeddings`).
      weight_version: version label of `params` ("default", as vLLM reports before any push).
      export_root: where `push_weights` writes its exports (one version is kept). Default: a
        private folder under `weight_files.default_root()` (shared memory), removed by
        `close()`.
      export_format: the format `push_weights` exports ("fp32" | "bf16" | "fp8" | "fp8_fp32",
        `rollout_bridge.export`). Default: "fp8" (block-FP8 checkpoint format, what a GPU vLLM
        FP8 server receives) for a block-FP8 recipe, "fp32" for any other recipe.

    Thread-safe: one lock serialises generate / score / push (the HTTP server runs threads).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: Any,
        params: Any | None,
        *,
        recipe: str | Recipe = "fp8_block",
        eos_id: int | None,
        max_len: int | None = None,
        weight_version: str = "default",
        export_root: str | Path | None = None,
        export_format: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.graphdef = graphdef
        # Own buffers: the trainer donates its train-state params to its update, and a
        # `device_put` to the same placement returns the same buffers, so holding the caller's
        # arrays could leave the engine with deleted ones. None: no weights until a push.
        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        # Weights are fake-quantized once when installed (`install_kernels`), so the forward
        # runs with prequantized_weights=True (the emulated FP8 GEMM; Pallas quantizes itself).
        self._forward_recipe = (
            dataclasses.replace(self.recipe, prequantized_weights=True)
            if self.recipe.quantized and self.recipe.backend == "emulate"
            else self.recipe
        )
        self.params = None if params is None else jax.tree.map(jnp.copy, params)
        self.eos_id = eos_id
        self.max_len = int(max_len or cfg.max_position_embeddings)
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
        self._lock = threading.Lock()
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
        other keyword arguments go to the constructor (eos_id defaults to the tokenizer's)."""
        from models.hf_io import load_hf
        from models.tokenizer import eos_token_id, load_tokenizer

        cfg, graphdef, params = load_hf(model_dir, **dict(config_overrides or {}))
        kwargs.setdefault("eos_id", eos_token_id(load_tokenizer(model_dir)))
        return cls(cfg, graphdef, params, recipe=recipe, **kwargs)

    # -- RolloutBackend --------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        seed_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """All prompts x n samples in one jitted loop; completions prompt-major. Sample j of
        prompt i is keyed by (seed, seed_indices[i], j) (default seed index: i)."""
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
            self._check_ids(p, f"prompt {i}")
        stops = set(sp.stop_token_ids)
        if self.eos_id is not None and not sp.ignore_eos:
            stops.add(self.eos_id)
        if len(stops) > _STOP_SLOTS:
            raise RolloutError(f"embedded: at most {_STOP_SLOTS} stop ids, got {len(stops)}")
        seed = secrets.randbits(64) if sp.seed is None else int(sp.seed) % (1 << 64)

        rows = len(prompts) * sp.n
        b = bucket(rows, _MIN_ROWS)
        plen = bucket(max(len(p) for p in prompts), _MIN_PROMPT)
        new = bucket(sp.max_tokens, _MIN_NEW)
        # Cache slots are not positions (RoPE counts real tokens only), so the bucketed cache
        # may exceed max_len; the check above bounds the real length.
        cache_len = plen + new
        prompt = np.zeros((b, plen), np.int32)
        mask = np.zeros((b, plen), np.int32)
        prompt_idx = np.zeros((b,), np.int32)
        key_idx = np.zeros((b,), np.int32)
        sample_idx = np.zeros((b,), np.int32)
        max_new = np.zeros((b,), np.int32)
        # Padding rows hold one real token so that no row attends to nothing.
        prompt[:, -1], mask[:, -1] = 0, 1
        for r in range(rows):
            i, j = divmod(r, sp.n)
            p = prompts[i]
            prompt[r, plen - len(p) :], mask[r, plen - len(p) :] = p, 1
            prompt_idx[r], key_idx[r] = i, seed_idx[i]
            sample_idx[r], max_new[r] = j, sp.max_tokens
        stop_ids = np.full((b, _STOP_SLOTS), -1, np.int32)
        stop_ids[:, : len(stops)] = sorted(stops)
        keys = smp.row_keys(
            jnp.full((b,), seed & 0xFFFFFFFF, jnp.uint32),
            jnp.full((b,), seed >> 32, jnp.uint32),
            jnp.asarray(key_idx),
            jnp.asarray(sample_idx),
        )
        with self._lock:
            version = self._version
            toks, lps, lens = generate_rows(
                self.graphdef,
                self.params,
                jnp.asarray(prompt),
                jnp.asarray(mask),
                keys,
                jnp.full((b,), sp.temperature, jnp.float32),
                jnp.full((b,), sp.top_k, jnp.int32),
                jnp.full((b,), sp.top_p, jnp.float32),
                jnp.asarray(stop_ids),
                jnp.asarray(max_new),
                cfg=self.cfg,
                recipe=self._forward_recipe,
                cache_len=cache_len,
            )
            toks, lps, lens = np.asarray(toks), np.asarray(lps), np.asarray(lens)
        out = []
        for r in range(rows):
            ids = toks[r, : lens[r]].astype(np.int32)
            lp = lps[r, : lens[r]].astype(np.float32)
            if not np.all(np.isfinite(lp)):
                raise RolloutError(
                    f"embedded: non-finite logprob in row {r}; weights hold NaN/inf?"
                )
            stopped = ids.size > 0 and int(ids[-1]) in stops
            out.append(
                Completion(
                    prompt_index=int(prompt_idx[r]),
                    prompt_ids=prompts[prompt_idx[r]],
                    response_ids=ids,
                    logprobs=lp,
                    finish_reason="stop" if stopped else "length",
                    weight_version=version,
                )
            )
        return out

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced logprobs under the rollout recipe, temperature 1; entry 0 = 0
        (`models.functional.token_logprobs`, chunked over the vocabulary head)."""
        tokens, mask, lengths = self._score_batch(sequences)
        if not lengths:
            return []
        with self._lock:
            lp = score_logprobs(
                self.graphdef,
                self.params,
                jnp.asarray(tokens),
                jnp.asarray(mask),
                recipe=self._forward_recipe,
            )
            lp = np.asarray(lp)
        return [lp[r, :n].copy() for r, n in enumerate(lengths)]

    def score_with_ranks(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`score` plus each token's rank (1 = the argmax), as vLLM's `prompt_logprobs`.
        Builds the [B, T, V] logits at once: meant for the server's small scoring requests."""
        tokens, mask, lengths = self._score_batch(sequences)
        if not lengths:
            return []
        with self._lock:
            lp, rank = score_ranks(
                self.graphdef,
                self.params,
                jnp.asarray(tokens),
                jnp.asarray(mask),
                recipe=self._forward_recipe,
            )
            lp, rank = np.asarray(lp), np.asarray(rank)
        return [(lp[r, :n].copy(), rank[r, :n].copy()) for r, n in enumerate(lengths)]

    def _score_batch(
        self, sequences: Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Right-padded, bucketed (tokens, mask) and the true lengths."""
        self._check_weights()
        seqs = [tuple(int(t) for t in s) for s in sequences]
        for i, s in enumerate(seqs):
            if not s or len(s) > self.max_len:
                raise RolloutError(
                    f"embedded: sequence {i} has {len(s)} tokens; need 1..max_len={self.max_len}"
                )
            self._check_ids(s, f"sequence {i}")
        if not seqs:
            return np.zeros((0, 0), np.int32), np.zeros((0, 0), np.int32), []
        b = bucket(len(seqs), _MIN_ROWS)
        t = bucket(max(len(s) for s in seqs), _MIN_PROMPT)
        tokens = np.zeros((b, t), np.int32)
        mask = np.zeros((b, t), np.int32)
        mask[:, 0] = 1  # padding rows hold one real token
        for r, s in enumerate(seqs):
            tokens[r, : len(s)], mask[r, : len(s)] = s, 1
        return tokens, mask, [len(s) for s in seqs]

    def push_weights(self, hf_state: HFTensors, version: str) -> None:
        """Exports `hf_state` in `self.export_format` to the shared-memory export root, loads
        it back with the manifest verified, and installs it (the path an external server's
        weights take)."""
        from rollout_bridge import export

        self._check_open()
        export_dir = export.export_weights(
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
        from rollout_bridge.weight_files import load_export

        self._check_open()
        tensors, manifest = load_export(
            export_dir,
            verify=True,
            expected_version=version,
            expected_manifest_sha256=manifest_sha256,
        )
        params = self._installed(
            served_params(self.cfg, tensors, manifest.get("quantization_config"))
        )
        with self._lock:
            self._params = params
            if version is not None:
                self._version = version

    @property
    def params(self) -> Any | None:
        """The installed weights: the export's tensors, with every decoder linear kernel
        replaced by its operand values (`engine_jit.install_kernels`). Assigning params
        (f32 masters, or `served_params` of an export) installs them."""
        return self._params

    @params.setter
    def params(self, params: Any | None) -> None:
        self._params = None if params is None else self._installed(params)

    def _installed(self, params: Any) -> Any:
        """A copy of `params` with the kernels turned into their operand values."""
        params = jax.tree.map(lambda x: x, params)  # a new State: the caller's is kept
        nodes = [_node(params, path) for path in self._kernel_paths()]
        kernels = install_kernels(
            [n.get_value() for n in nodes], recipe=self.recipe, dtype=self.cfg.compute_dtype
        )
        for node, k in zip(nodes, kernels, strict=True):
            node.set_value(k)
        return params

    def _kernel_paths(self) -> list[tuple[str, ...]]:
        """Param paths of the decoder linears' kernels (the GEMM weights of the recipe)."""
        from models.hf_io import hf_name_map
        from rollout_bridge.export import is_fp8_linear

        rows = hf_name_map(self.cfg)
        return list(dict.fromkeys(r.path for r in rows if is_fp8_linear(r.name, (0, 0))))

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
                "embedded: no weights yet (built with params=None); call push_weights first"
            )

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RolloutError(
                f"embedded: {what} holds token ids {bad[:5]} outside [0, {self.cfg.vocab_size})"
            )
