"""Rollout for one RL step: sample, score, dynamic sampling, and batching into [N, T] arrays.

Layout of a batch of N = B * n samples (prompt-major: the n samples of prompt 0 first):

    tokens          int32 [N, P + R]  prompt, response, then pad (right padded; the prompt
                                      starts at position 0, so causal attention never sees pad)
    attention_mask  int32 [N, P + R]  1 on prompt and response tokens
    prompt_lens     int32 [N]         where the response starts in `tokens`
    response_mask   f32   [N, R]      1 on response tokens of groups that take part in the loss
    rollout_logp    f32   [N, R]      the rollout engine's logprobs of the response tokens

Prompt ids come from `templates.PromptFormat` (prompt / chat template, no special tokens
added) and generation stops on all of its stop ids; the same ids are packed here, so the
trainer scores exactly what the backend saw.

P = data.max_prompt_tokens and R = rollout.max_tokens are fixed, so every step has the same
shapes and the jitted functions compile once. Response-aligned [N, R] arrays are what the loss
takes (verl's `responses` layout); `step.gather_response` moves [N, T] per-token values there.

DAPO dynamic sampling (Yu et al. 2025, section 3.2): a group whose n rewards are all equal has
zero advantage everywhere and only dilutes the batch. With `rollout.dynamic_sampling` such
groups are dropped and more prompts are sampled, at most `rollout.max_rounds` extra rounds;
slots still empty are filled with dropped groups whose response mask is zeroed, so shapes stay
static and they add nothing to the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jfp8rl.data import Example, PromptStream
from jfp8rl.rewards import ANSWER_PARSERS, Verifier, score_responses
from jfp8rl.templates import PromptFormat
from rollout_bridge.backend import Completion, RolloutBackend, RolloutError, SamplingParams


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


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """What `collect` needs from the config (`rollout`, `data`, `reward` sections)."""

    batch_size: int
    n: int
    max_prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    dynamic_sampling: bool
    max_rounds: int
    overlong: bool
    overlong_buffer: int
    overlong_penalty: float


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
) -> RolloutBatch:
    """Right-padded [N, P + R] tokens and [N, R] response arrays; `keep[i]` = 0 zeroes sample
    i's response mask (a filler group of dynamic sampling). `texts` / `answers` / `unparsed`
    (per sample) ride along for metrics and rollout dumps."""
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
    )  # fmt: skip


Group = tuple[list[Completion], np.ndarray, np.ndarray, list[str], list[str]]


def _sample_round(
    backend: RolloutBackend,
    examples: Sequence[Example],
    fmt: PromptFormat,
    verifier: Verifier,
    s: RolloutSettings,
    seed: int,
    version: str,
) -> Group:
    prompts = fmt.encode(examples, s.max_prompt_tokens)
    sampling = SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=seed,
        stop_token_ids=fmt.stop_ids,
    )
    comps = backend.generate(prompts, sampling)
    if len(comps) != len(prompts) * s.n:
        raise RolloutError(f"asked {len(prompts)} prompts x n={s.n}, got {len(comps)} completions")
    stale = {c.weight_version for c in comps} - {version}
    if stale:
        # On-policy training: a sample from other weights would bias the update silently.
        raise RolloutError(
            f"rollout used weight version(s) {sorted(stale)} but the trainer pushed {version!r}"
        )
    texts = [fmt.response_text(c.response_ids) for c in comps]
    answers = [examples[i // s.n].answer for i in range(len(comps))]
    lens = np.array([len(c.response_ids) for c in comps])
    rewards, correct = score_responses(
        texts, answers, lens,
        verifier=verifier, max_tokens=s.max_tokens, overlong=s.overlong,
        overlong_buffer=s.overlong_buffer, overlong_penalty_coef=s.overlong_penalty,
    )  # fmt: skip
    return comps, rewards, correct, texts, answers


def collect(
    backend: RolloutBackend,
    stream: PromptStream,
    position: int,
    fmt: PromptFormat,
    verifier: Verifier,
    s: RolloutSettings,
    *,
    seed: int,
    version: str,
) -> tuple[RolloutBatch, int, dict[str, float]]:
    """Samples one step's batch; returns it, the new data position and rollout stats.

    `seed` fixes the samples (round k uses seed + k), so a resumed run redraws the same ones.
    """
    n = s.n
    kept: list[Group] = []  # one entry per group
    dropped: list[Group] = []
    sampled_groups = 0
    rounds = 1 + (s.max_rounds if s.dynamic_sampling else 0)
    for k in range(rounds):
        need = s.batch_size - len(kept)
        if need == 0:
            break
        examples, position = stream.take(position, need if k == 0 else s.batch_size)
        comps, rewards, correct, texts, answers = _sample_round(
            backend, examples, fmt, verifier, s, seed + k, version
        )
        sampled_groups += len(examples)
        for g in range(len(examples)):
            sl = slice(g * n, (g + 1) * n)
            group = (comps[sl], rewards[sl], correct[sl], texts[sl], answers[sl])
            informative = not np.all(rewards[sl] == rewards[sl][0])
            if s.dynamic_sampling and not informative:
                dropped.append(group)
            elif len(kept) < s.batch_size:
                kept.append(group)
    filled = s.batch_size - len(kept)
    groups = kept + dropped[:filled]
    if len(groups) < s.batch_size:
        raise AssertionError("dynamic sampling lost groups; this is a bug")
    comps = [c for g in groups for c in g[0]]
    rewards = np.concatenate([g[1] for g in groups])
    correct = np.concatenate([g[2] for g in groups])
    texts = [t for g in groups for t in g[3]]
    answers = [a for g in groups for a in g[4]]
    keep = np.repeat(np.arange(s.batch_size) < len(kept), n)
    parser = ANSWER_PARSERS.get(verifier)
    unparsed = np.array([parser is not None and not parser(t) for t in texts], bool)
    batch = pack(
        comps, rewards, correct, keep, texts=texts, answers=answers, unparsed=unparsed,
        max_prompt_tokens=s.max_prompt_tokens, max_tokens=s.max_tokens, pad_id=fmt.pad_id,
    )  # fmt: skip
    stats = {
        "rollout/sampled_groups": float(sampled_groups),
        "rollout/filled_groups": float(filled),
        "rollout/truncated_frac": float(batch.truncated.mean()),
    }
    if parser is not None:
        stats["reward/unparsed_frac"] = float(unparsed.mean())
    return batch, position, stats
