"""What one request may ask of `rollout_bridge.serve`, and how many sequences it holds at once.

vLLM's admission rules, with its messages (vLLM 0.32, measured): `n` at least 1; `max_tokens`
at least 1 and at most `--max-model-len`; a prompt longer than `--max-model-len` is refused;
a prompt with fewer than `max_tokens` positions left gets `max_tokens` lowered to what is left
(vLLM answers 200 with shorter responses; a prompt of exactly `--max-model-len` tokens leaves 0
and is refused as "max_tokens must be at least 1, got 0."). All refusals are HTTP 400.

Memory, bounded whatever a request asks:
  * the engine decodes at most `--max-num-seqs` sequences at a time (vLLM's flag; its chunks,
    `rollout_bridge.engine.embedded`), so the KV cache holds at most that many rows;
  * the server holds at most `--max-pending-seqs` sequences (prompts x n, over all requests,
    decoding or waiting to). A request that does not fit in what is free waits, first come
    first served; one that could never fit (more than `--max-pending-seqs` alone) is refused
    with 400 naming the flag. vLLM queues without a bound instead (n up to
    VLLM_MAX_N_SEQUENCES = 16384 per prompt, any number of prompts);
  * bodies over `MAX_BODY_BYTES` are refused with 413; at most `MAX_CONNECTIONS` connections
    are served at once, a request on any other gets 503 (clients retry it) before its body is
    read; a client that stalls for `SOCKET_TIMEOUT_S` mid-request is disconnected.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from http import HTTPStatus

from rollout_bridge.server.openai_format import ApiError, invalid

MAX_BODY_BYTES = 32 * 2**20  # about 4M prompt tokens as JSON; split larger batches
MAX_CONNECTIONS = 64
SOCKET_TIMEOUT_S = 60.0
DEFAULT_MAX_PENDING_SEQS = 16384  # vLLM's largest n (VLLM_MAX_N_SEQUENCES) fits one request


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """The bounds of one server (module docstring)."""

    max_model_len: int  # longest prompt + response, in tokens (the engine's max_len)
    max_pending_seqs: int = DEFAULT_MAX_PENDING_SEQS

    def __post_init__(self) -> None:
        if self.max_model_len < 2 or self.max_pending_seqs < 1:
            raise ValueError(
                f"ServerLimits: max_model_len={self.max_model_len} must be >= 2 and "
                f"max_pending_seqs={self.max_pending_seqs} >= 1"
            )


def max_tokens_per_prompt(
    prompts: Sequence[Sequence[int]], n: int, max_tokens: int, limits: ServerLimits
) -> list[int]:
    """Each prompt's `max_tokens` after vLLM's rules (module docstring; n >= 1 and
    max_tokens >= 1 are checked by `openai_format.parse_sampling`); raises `ApiError` 400 for
    a request vLLM refuses or one that could never fit `max_pending_seqs`."""
    seqs = len(prompts) * n
    if seqs > limits.max_pending_seqs:
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"this request asks for {seqs} sequences ({len(prompts)} prompts x n={n}); this "
            f"server holds at most {limits.max_pending_seqs} at once (--max-pending-seqs): "
            "split it into smaller requests",
            param="n",
        )
    ml = limits.max_model_len
    if max_tokens > ml:
        raise invalid(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={ml}. Please "
            "request fewer output tokens.",
            "max_tokens",
            max_tokens,
        )
    out = []
    for p in prompts:
        if len(p) > ml:
            raise invalid(
                f"This model's maximum context length is {ml} tokens. However, your prompt "
                f"contains {len(p)} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                len(p),
            )
        if len(p) == ml:
            raise invalid("max_tokens must be at least 1, got 0.", "max_tokens", 0)
        out.append(min(max_tokens, ml - len(p)))
    return out


class Admission:
    """Sequences held by the server: `acquire(k)` waits, first come first served, until k more
    fit in `capacity`; `release(k)` gives them back. Callers refuse k > capacity first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def acquire(self, k: int) -> None:
        if not 0 < k <= self.capacity:
            raise ValueError(f"Admission.acquire({k}): need 1..{self.capacity}")
        with self._cv:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._cv.wait_for(lambda: self._serving == ticket and self.held + k <= self.capacity)
            self._serving += 1
            self.held += k
            self._cv.notify_all()

    def release(self, k: int) -> None:
        with self._cv:
            self.held -= k
            self._cv.notify_all()
