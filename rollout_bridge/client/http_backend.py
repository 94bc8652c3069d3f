"""`HttpBackend`: a `RolloutBackend` talking to a vLLM-compatible server over HTTP.

The same client talks to a real vLLM (docs/rollout.md section 5) and to `python -m
rollout_bridge.serve`; requests go through `transport.Transport` (JSON, API key, retries).

Exact requests sent and fields read (the server contract; docs/rollout.md sections 2 and 3).
Request bodies are JSON objects; answers must be JSON (an empty body counts as null).

`GET /health` -> 200 (body ignored). `GET /v1/models` -> reads `data[0].id` (the model name
sent in completions requests) and `data[0].max_model_len` (optional). `GET /weight_info` ->
reads `weight_version` (str, or null before any push; reported as "").

`POST /v1/completions` (generate), body:
    {"model": <data[0].id>, "prompt": [[int, ...], ...], "n": int, "max_tokens": int,
     "temperature": float (0 = greedy), "top_p": float, "top_k": int (-1 = off),
     "seed": int (key omitted when None), "logprobs": 0, "return_token_ids": true,
     "return_tokens_as_token_ids": true, "ignore_eos": bool, "stop_token_ids": [int, ...],
     "skip_special_tokens": false, "include_stop_str_in_output": true,
     "jfp8rl_seed_indices": [int, ...] (only when given: `rollout_bridge.client.pool`)}
  reads `choices`: exactly n * len(prompts) entries, prompt-major (prompt i sample j at
  position i * n + j); if every choice has an int `index` they are sorted by it and must be
  0..N-1. Per choice: `token_ids` [int], `logprobs.token_logprobs` [float] (same length as
  token_ids; the logprob of the distribution sampled from), `finish_reason` ("stop" |
  "length"; anything else, e.g. "abort", is an error); `prompt_token_ids`, if present, must
  equal the prompt sent. Everything else (`text`, `tokens`, `top_logprobs`, `usage`) is ignored.
  Each generate call also sends `GET /weight_info` right before and right after the
  completions request and stamps the completions with that version (they must agree).

`POST /v1/completions` (score, teacher forced), body:
    {"model": ..., "prompt": [[int, ...], ...], "n": 1, "max_tokens": 1, "temperature": 1.0,
     "top_p": 1.0, "top_k": -1, "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": true,
     "return_tokens_as_token_ids": true}
  reads per choice i (sorted by `index`): `prompt_logprobs` = [null, {"<id>": {"logprob":
  float, "rank": int, "decoded_token": str}}, ...] with len = len(prompt i); entry t must hold
  the key str(prompt[i][t]) (other keys = alternatives, ignored). Entry 0 is reported as 0.0.
  The sampled token of a score request is ignored.

Weight push (vLLM 0.32 routes, need VLLM_SERVER_DEV_MODE=1 on vLLM):
  1. `POST /pause?mode=wait` (no body)
  2. once per client: `POST /init_weight_transfer_engine` {"init_info": {"root": <export root>}}
  3. `POST /start_weight_update` {}
  4. `POST /update_weights` {"update_info": {"path": <abs version dir>, "version": <str>,
       "manifest_sha256": <sha256 hex of <path>/manifest.json>}}
     The server loads it with `rollout_bridge.weights.reader.load_export(path,
     expected_version=version, expected_manifest_sha256=...)`, which verifies sizes and
     per-tensor digests (the manifest's `hash`) and raises `ExportError` on any mismatch;
     the route must then answer a non-2xx status (vLLM: 500) and keep serving the old
     weights and version.
  5. `POST /finish_weight_update` {"weight_version": <str>}  (sets the served version)
  6. `POST /resume` (no body; always sent once step 1 succeeded, also after a failure)
  7. `GET /weight_info` -> `weight_version` must equal the pushed version.
  Answers to 1-6 are ignored except for their HTTP status.

Errors: transient failures are retried (`transport`; weight-update steps 3-5 only when the
connection was refused, i.e. never delivered); anything else raises `RolloutError`. NaN or
null logprobs, logprobs <= -9999 (vLLM's clamp), length mismatches and wrong choice counts
are errors, never data.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bridge.backend import (
    Completion,
    HFTensors,
    RolloutBackend,
    RolloutError,
    SamplingParams,
    decode_routed_experts,
)
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.client.transport import Transport
from rollout_bridge.export import export_weights
from rollout_bridge.server.openai_format import SEED_INDICES
from rollout_bridge.weights import MANIFEST
from rollout_bridge.weights.hashing import sha256_file
from rollout_bridge.weights.store import default_root

VLLM_CLAMP = -9999.0  # vLLM clamps -inf logprobs to this; a clamp means a broken distribution


class HttpBackend(RolloutBackend):
    """A client of a vLLM-compatible server (a real vLLM or `rollout_bridge.serve`).

    Args:
      url: server base URL, e.g. "http://127.0.0.1:8000".
      settings: API key, timeouts and retries, and how pushed weights are exported
        (`ClientSettings`; default: its defaults). The export root is resolved here:
        `export_root` below.
    """

    def __init__(self, url: str, settings: ClientSettings | None = None) -> None:
        self.url = url.rstrip("/")
        self.settings = settings or ClientSettings()
        self._owns_root = self.settings.export_root is None
        self.export_root = self.settings.export_root or default_root()
        self._http = Transport(self.url, self.settings)
        self._model: str | None = None
        self.max_model_len: int | None = None
        self._transfer_initialized = False
        self._closed = False

    def _model_name(self) -> str:
        if self._model is None:
            models = self._http.request("GET", "/v1/models")
            try:
                entry = models["data"][0]
                self._model = str(entry["id"])
            except (TypeError, KeyError, IndexError) as e:
                raise RolloutError(
                    f"GET {self.url}/v1/models: expected {{'data': [{{'id': ...}}]}}, got "
                    f"{str(models)[:200]}"
                ) from e
            self.max_model_len = entry.get("max_model_len")
        return self._model

    # ---------------------------------------------------------------------------- checks

    def _check_logprobs(self, values: Sequence[Any], where: str) -> np.ndarray:
        if any(v is None for v in values):
            raise RolloutError(f"{self.url}: {where}: missing logprob (null) in the response")
        out = np.asarray(values, dtype=np.float32)
        if np.isnan(out).any():
            raise RolloutError(f"{self.url}: {where}: NaN logprob; the served weights are bad")
        if (out <= VLLM_CLAMP).any():
            raise RolloutError(
                f"{self.url}: {where}: logprob clamped at {VLLM_CLAMP} (a token of probability "
                "0 under the sampling distribution); refusing it as data"
            )
        return out

    def _choices(self, resp: Any, expected: int, what: str) -> list[dict[str, Any]]:
        choices = resp.get("choices") if isinstance(resp, dict) else None
        if not isinstance(choices, list) or len(choices) != expected:
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            raise RolloutError(f"{self.url}: {what}: expected {expected} choices, got {got}")
        if not all(isinstance(c, dict) for c in choices):
            raise RolloutError(
                f"{self.url}: {what}: choices must be JSON objects, got {choices!r:.200}"
            )
        if all(isinstance(c.get("index"), int) for c in choices):
            choices = sorted(choices, key=lambda c: c["index"])
            if [c["index"] for c in choices] != list(range(expected)):
                raise RolloutError(f"{self.url}: {what}: choice indices are not 0..{expected - 1}")
        return choices

    # ---------------------------------------------------------------------------- interface

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        seed_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """All prompts in one `/v1/completions` request (vLLM batches them; 64 separate
        requests are several times slower). With a seed, the same call reproduces the same
        samples; identical prompts in one call share their random stream (vLLM seeds per
        request, not per prompt). `seed_indices` go out as `jfp8rl_seed_indices` (read by
        `rollout_bridge.serve`; vLLM ignores the field, its samples do not depend on the
        prompt's position anyway)."""
        if not prompts:
            return []
        prompts = [[int(t) for t in p] for p in prompts]
        body: dict[str, Any] = {
            "model": self._model_name(),
            "prompt": prompts,
            "n": sampling.n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids),
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if seed_indices is not None:
            body[SEED_INDICES] = [int(k) for k in seed_indices]
        before = self.weight_version()
        resp = self._http.request("POST", "/v1/completions", body)
        after = self.weight_version()
        if before != after:
            raise RolloutError(
                f"{self.url}: weights changed from {before!r} to {after!r} during generate; "
                "these samples have no single version, generate again"
            )
        choices = self._choices(resp, sampling.n * len(prompts), "generate")
        out = []
        for k, ch in enumerate(choices):
            i = k // sampling.n
            where = f"generate choice {k} (prompt {i})"
            reason = ch.get("finish_reason")
            if reason not in ("stop", "length"):
                raise RolloutError(
                    f"{self.url}: {where}: finish_reason {reason!r} (aborted or unknown); the "
                    "server dropped the request, retry after checking its log"
                )
            ids = ch.get("token_ids")
            lp = (ch.get("logprobs") or {}).get("token_logprobs")
            if ids is None or lp is None:
                raise RolloutError(
                    f"{self.url}: {where}: response lacks token_ids or logprobs.token_logprobs; "
                    "the server must honour return_token_ids and logprobs=0"
                )
            if len(ids) != len(lp):
                raise RolloutError(
                    f"{self.url}: {where}: {len(ids)} token ids but {len(lp)} logprobs"
                )
            pid = ch.get("prompt_token_ids")
            if pid is not None and list(pid) != prompts[i]:
                raise RolloutError(f"{self.url}: {where}: prompt_token_ids differ from the prompt")
            routed = None
            if ch.get("routed_experts") is not None:  # vLLM --enable-return-routed-experts
                try:
                    routed = decode_routed_experts(ch["routed_experts"], len(prompts[i]) + len(ids))
                except ValueError as e:
                    raise RolloutError(f"{self.url}: {where}: {e}") from None
            out.append(
                Completion(
                    prompt_index=i,
                    prompt_ids=tuple(prompts[i]),
                    response_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=self._check_logprobs(lp, where),
                    finish_reason=reason,
                    weight_version=before,
                    routed_experts=routed,
                )
            )
        return out

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced logprobs through `prompt_logprobs: 0` (temperature 1)."""
        if not sequences:
            return []
        seqs = [[int(t) for t in s] for s in sequences]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("score: every sequence needs at least one token")
        body = {
            "model": self._model_name(),
            "prompt": seqs,
            "n": 1,
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "logprobs": 0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        resp = self._http.request("POST", "/v1/completions", body)
        choices = self._choices(resp, len(seqs), "score")
        out = []
        for i, (seq, ch) in enumerate(zip(seqs, choices, strict=True)):
            plp = ch.get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(seq):
                got = len(plp) if isinstance(plp, list) else plp
                raise RolloutError(
                    f"{self.url}: score sequence {i}: {len(seq)} tokens but prompt_logprobs "
                    f"has {got} entries"
                )
            values = [0.0]
            for t in range(1, len(seq)):
                entry = plp[t] or {}
                hit = entry.get(str(seq[t]))
                if hit is None:
                    raise RolloutError(
                        f"{self.url}: score sequence {i}, position {t}: prompt_logprobs lacks "
                        f"the token {seq[t]}"
                    )
                values.append(hit["logprob"] if isinstance(hit, dict) else hit)
            out.append(self._check_logprobs(values, f"score sequence {i}"))
        return out

    def push_weights(self, hf_state: HFTensors, version: str) -> None:
        """export -> pause -> (init) -> start -> update -> finish -> resume -> /weight_info."""
        path = export_weights(
            hf_state,
            version,
            fmt=self.settings.export_format,
            root=self.export_root,
            keep=self.settings.keep_versions,
            hash_name=self.settings.export_hash,
        )
        self.push_export(path, version)

    def push_export(self, path: str | Path, version: str) -> None:
        """Installs an already exported version folder (see `push_weights`)."""
        path = Path(path).resolve()
        update_info = {
            "path": str(path),
            "version": version,
            "manifest_sha256": sha256_file(path / MANIFEST),
        }
        self._http.request("POST", "/pause?mode=wait", idempotent=True)
        try:
            if not self._transfer_initialized:
                root = str(self.export_root.resolve())
                self._http.request(
                    "POST", "/init_weight_transfer_engine", {"init_info": {"root": root}}
                )
                self._transfer_initialized = True
            self._http.request("POST", "/start_weight_update", {}, idempotent=False)
            self._http.request(
                "POST", "/update_weights", {"update_info": update_info}, idempotent=False
            )
            self._http.request(
                "POST", "/finish_weight_update", {"weight_version": version}, idempotent=False
            )
        except BaseException as e:
            # Resume even after a failed update; if that fails too (the server died), the
            # update's error is the one to report, with the resume failure noted.
            try:
                self._http.request("POST", "/resume")
            except RolloutError as resume_err:
                e.add_note(f"and /resume failed too: {resume_err}")
            raise
        self._http.request("POST", "/resume")
        served = self.weight_version()
        if served != version:
            raise RolloutError(
                f"{self.url}/weight_info reports {served!r} after pushing {version!r}; the update "
                "did not take effect, check the server log"
            )

    def weight_version(self) -> str:
        info = self._http.request("GET", "/weight_info")
        version = info.get("weight_version") if isinstance(info, dict) else None
        return "" if version is None else str(version)

    def health(self) -> bool:
        try:
            self._http.request("GET", "/health", timeout=5.0, retries=0)
        except RolloutError:
            return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_root:
            shutil.rmtree(self.export_root, ignore_errors=True)
