"""The rollout batch: one RL step's samples as fixed-shape [N, T] host arrays.

Layout of a batch of N = B * n samples (prompt-major: the n samples of prompt 0 first):

    tokens          int32 [N, P + R]  prompt, response, then pad (right padded; the prompt
                                      starts at position 0, so causal attention never sees pad)
    attention_mask  int32 [N, P + R]  1 on prompt and response tokens
    prompt_lens     int32 [N]         where the response starts in `tokens`
    response_mask   f32   [N, R]      1 on response tokens of groups that take part in the loss
    rollout_logp    f32   [N, R]      the rollout engine's logprobs of the response tokens
    routing         int16 [N, P + R, L, k]  with routing replay (MoE): the experts each layer
                                      routed each token to in the rollout, -1 where unknown
                                      (pads, a response's unfed last token); else None

Prompt ids come from `jfp8rl.data.templates.PromptFormat` (prompt / chat template, no special tokens
added) and generation stops on all of its stop ids; the same ids are packed here, so the
trainer scores exactly what the backend saw.

P = data.max_prompt_tokens and R = rollout.max_tokens are fixed, so every step has the same
shapes and the jitted functions compile once. Response-aligned [N, R] arrays are what the loss
takes (verl's `responses` layout); `jfp8rl.trainer.forward.gather_response` moves [N, T] per-token values there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rollout_bridge.backend import Completion, RolloutError


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Host-side arrays of one step's samples (module docstring for the layout)."""

    tokens: np.ndarray
    attention_mask: np.ndarray
    prompt_lens: np.ndarray
    response_mask: np.ndarray
    rollout_logp: np.ndarray
    rewards: np.ndarray  # f32 [N], verifier correctness + overlong shaping
    correct: np.ndarray  # f32 [N], verifier correctness in {0, 1}
    response_lens: np.ndarray  # int32 [N], tokens generated (eos included)
    truncated: np.ndarray  # bool [N], finish_reason == "length"
    completions: tuple[Completion, ...]  # the backend's answers (ids, finish, weight version)
    texts: tuple[str, ...]  # response texts up to the first stop token (what was scored)
    answers: tuple[str, ...]  # reference answers
    unparsed: np.ndarray  # bool [N], no answer the verifier could extract (math: no \boxed{})
    routing: np.ndarray | None = None  # int16 [N, P + R, L, k], routing replay (module doc)


def pack(
    completions: Sequence[Completion],
    rewards: np.ndarray,
    correct: np.ndarray,
    keep: np.ndarray,
    *,
    max_prompt_tokens: int,
    max_tokens: int,
    pad_id: int,
    texts: Sequence[str] = (),
    answers: Sequence[str] = (),
    unparsed: np.ndarray | None = None,
    routing: bool = False,
) -> RolloutBatch:
    """Right-padded [N, P + R] tokens and [N, R] response arrays; `keep[i]` = 0 zeroes sample
    i's response mask (a filler group of dynamic sampling). `texts` / `answers` / `unparsed`
    (per sample) ride along for metrics and rollout dumps. `routing`: pack the completions'
    routed experts (routing replay; `pack_routing`)."""
    n_samples = len(completions)
    P, R = max_prompt_tokens, max_tokens
    tokens = np.full((n_samples, P + R), pad_id, np.int32)
    attn = np.zeros((n_samples, P + R), np.int32)
    resp_mask = np.zeros((n_samples, R), np.float32)
    rollout_logp = np.zeros((n_samples, R), np.float32)
    prompt_lens = np.zeros((n_samples,), np.int32)
    resp_lens = np.zeros((n_samples,), np.int32)
    truncated = np.zeros((n_samples,), bool)
    for i, c in enumerate(completions):
        p, r = len(c.prompt_ids), len(c.response_ids)
        if p > P or r > R:
            raise RolloutError(
                f"completion {i}: prompt {p} / response {r} tokens exceed the fixed lengths "
                f"{P} / {R}; the backend ignored max_tokens or the prompt was not checked"
            )
        tokens[i, :p] = c.prompt_ids
        tokens[i, p : p + r] = c.response_ids
        attn[i, : p + r] = 1
        resp_mask[i, :r] = float(keep[i])
        rollout_logp[i, :r] = c.logprobs
        prompt_lens[i], resp_lens[i] = p, r
        truncated[i] = c.finish_reason == "length"
    if not np.all(np.isfinite(rollout_logp)):
        raise RolloutError("the rollout backend returned non-finite logprobs")
    return RolloutBatch(
        tokens, attn, prompt_lens, resp_mask, rollout_logp,
        rewards.astype(np.float32), correct.astype(np.float32), resp_lens, truncated,
        tuple(completions), tuple(texts), tuple(answers),
        np.zeros(n_samples, bool) if unparsed is None else np.asarray(unparsed, bool),
        pack_routing(completions, P + R) if routing else None,
    )  # fmt: skip


def pack_routing(completions: Sequence[Completion], length: int) -> np.ndarray:
    """The completions' recorded experts (`Completion.routed_experts`) as int16 [N, length,
    L, k], token-aligned with `tokens`, -1 past each sample. Every completion must carry them
    (rollout.routing_replay=record asked the backend to record)."""
    missing = sum(c.routed_experts is None for c in completions)
    if missing:
        raise RolloutError(
            f"{missing} of {len(completions)} completions carry no routed experts, which "
            "rollout.routing_replay=record needs: an HTTP server must return them (vLLM: "
            "start it with --enable-return-routed-experts, a GPU build; rollout_bridge.serve: "
            "the same flag), or set rollout.routing_replay=off"
        )
    first = completions[0].routed_experts
    out = np.full((len(completions), length, *first.shape[1:]), -1, np.int16)
    for i, c in enumerate(completions):
        n = len(c.prompt_ids) + len(c.response_ids)
        if c.routed_experts.shape != (n, *first.shape[1:]):
            raise RolloutError(
                f"completion {i}: routed experts of shape {c.routed_experts.shape} for {n} "
                f"tokens (expected {(n, *first.shape[1:])})"
            )
        out[i, :n] = c.routed_experts
    return out
