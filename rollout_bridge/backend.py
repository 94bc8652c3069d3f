"""The rollout interface shared by every backend (docs/design.md section 6, docs/rollout.md
section 1).

The trainer talks to a `RolloutBackend` and never knows whether it is the embedded JAX engine
or an HTTP client of a vLLM-compatible server. Everything crossing this interface is plain
Python / numpy, never jax arrays: what an HTTP server answers and what the embedded engine
returns look the same.

Logprob convention: `Completion.logprobs[i]` is log p(response_ids[i] | prompt, response[:i])
under the distribution the token was *actually sampled from* (temperature / top-k / top-p
applied; vLLM needs `--logprobs-mode processed_logprobs` for that, docs/rollout.md section 2).
At temperature 1 with no truncation this equals the model's raw log-softmax.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import numpy as np

# HF-named tensors ([out, in] linears): a dict, or (name, array) pairs consumed once, e.g.
# `models.hf_io.iter_hf_state`, which fetches one tensor at a time (bounded host memory).
HFTensors = Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]

FinishReason = Literal["stop", "length"]


class RolloutError(RuntimeError):
    """A rollout backend failed in a way the caller must not treat as data.

    The message names the server URL (or "embedded") and says what to do.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; names and meanings follow vLLM's `SamplingParams`.

    Attributes:
      n: samples per prompt; completions come back prompt-major (p0 x n, p1 x n, ...).
      max_tokens: maximum number of new tokens per sample.
      temperature: softmax temperature; 0 means greedy.
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; -1 (or 0) disables it.
      seed: the same seed reproduces the same samples. None draws fresh randomness. The
        embedded engine derives sample j of prompt i's key from (seed, i, j) alone, so samples
        do not depend on batching. vLLM seeds per request: the n samples of one prompt differ,
        but two identical prompts in one call get identical samples (give them different
        prompts, or n > 1, for a GRPO group).
      stop_token_ids: generation stops after emitting one of these (it is kept in the
        response, finish reason "stop"). The tokenizer's eos is added by the backend.
      ignore_eos: keep generating past eos until max_tokens.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled response.

    Attributes:
      prompt_index: index of its prompt in the `generate` call.
      prompt_ids: the prompt's token ids.
      response_ids: sampled token ids, int32 [L].
      logprobs: float32 [L], log-prob of each response token under the sampling distribution.
      finish_reason: "stop" (eos / stop token emitted) or "length" (max_tokens reached).
      weight_version: the weight version the backend held when it sampled this.
      routed_experts: Mixture-of-Experts models, from a backend that records routing: int16
        [len(prompt_ids) + len(response_ids), L, k], the experts each layer routed each token
        to while sampling (routing replay); -1 for a token the model was never fed (a
        response's last token, when decoding stopped at it). None otherwise.
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    response_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: FinishReason
    weight_version: str
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.response_ids.shape != self.logprobs.shape:
            raise RolloutError(
                f"completion of prompt {self.prompt_index}: {self.response_ids.shape[0]} tokens "
                f"but {self.logprobs.shape[0]} logprobs; the server's response is malformed"
            )


def encode_routed_experts(routed: np.ndarray) -> str:
    """A completion's routed experts on the wire, as vLLM's `--enable-return-routed-experts`
    returns them in a choice's `routed_experts`: base64 of the `.npy` bytes of the first
    num_tokens - 1 rows (the last token was never fed), uint8 for up to 256 experts."""
    rows = np.asarray(routed)[:-1]
    small = rows.size == 0 or int(rows.max(initial=0)) < 256
    buf = io.BytesIO()
    np.save(buf, rows.astype(np.uint8 if small else np.int32), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routed_experts(text: str, num_tokens: int) -> np.ndarray:
    """`encode_routed_experts`'s inverse (also what vLLM sends): int16 [num_tokens, L, k], the
    last token's row -1 (unknown). No pickles are read. Raises ValueError on a malformed
    field."""
    rows = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    if rows.ndim != 3 or rows.shape[0] != num_tokens - 1:
        raise ValueError(
            f"routed_experts of shape {rows.shape} for {num_tokens} tokens (expected "
            f"({num_tokens - 1}, layers, experts per token))"
        )
    out = np.full((num_tokens, *rows.shape[1:]), -1, np.int16)
    out[:-1] = rows
    return out


class RolloutBackend(abc.ABC):
    """A rollout engine: samples, scores, and receives new policy weights."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        seed_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Samples `sampling.n` completions per prompt; returns them prompt-major
        (`Completion.prompt_index` = position in `prompts`).

        `seed_indices[i]` is the index prompt i's samples are seeded with (default i): a pool
        that splits one batch over several servers passes each prompt's index in the whole
        batch, so the samples do not depend on the split (`rollout_bridge.client.pool`)."""

    @abc.abstractmethod
    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced logprobs: for each sequence s, float32 [len(s)] with entry t =
        log p(s[t] | s[:t]) at temperature 1, entry 0 = 0.0."""

    @abc.abstractmethod
    def push_weights(self, hf_state: HFTensors, version: str) -> None:
        """Installs new policy weights, given in HF names and layout ([out, in], float32
        masters), as a dict or as (name, array) pairs read once (`HFTensors`). The backend
        converts them to its rollout format (bf16 / fp32 / FP8 block) through
        `rollout_bridge.export`, so every backend holds the same numbers. After it returns,
        `weight_version()` is `version` and every later sample uses the new weights."""

    @abc.abstractmethod
    def weight_version(self) -> str:
        """The version of the weights currently served."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the backend can serve requests now."""

    def release_weights(self) -> None:
        """Frees the served weights until the next `push_weights` (vLLM's sleep mode, level 2),
        for a trainer that shares this host's memory and pushes before the next rollout.
        Default: nothing (a server on hardware of its own keeps them)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the backend's resources (idempotent)."""

    def __enter__(self) -> RolloutBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
