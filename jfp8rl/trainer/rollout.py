"""Rollout for one RL step: sample, score, DAPO dynamic sampling, and pack into a
`jfp8rl.data.batch.RolloutBatch` (its docstring gives the layout).

DAPO dynamic sampling (Yu et al. 2025, section 3.2): a group whose n rewards are all equal has
zero advantage everywhere and only dilutes the batch. With `rollout.dynamic_sampling` such
groups are dropped and more prompts are sampled, at most `rollout.max_rounds` extra rounds;
slots still empty are filled with dropped groups whose response mask is zeroed, so shapes stay
static and they add nothing to the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jfp8rl.data.batch import RolloutBatch, pack
from jfp8rl.data.records import Example
from jfp8rl.data.rewards import ANSWER_PARSERS, Reward, score_responses
from jfp8rl.data.stream import PromptStream
from jfp8rl.data.templates import PromptFormat
from jfp8rl.parallel.distributed import broadcast_from_main, on_main
from rollout_bridge.backend import Completion, RolloutBackend, RolloutError, SamplingParams


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
    routing_replay: bool = False  # the batch carries the rollout's routed experts


Group = tuple[list[Completion], np.ndarray, np.ndarray, list[str], list[str]]


def _sample_round(
    backend: RolloutBackend,
    examples: Sequence[Example],
    fmt: PromptFormat,
    verifier: Reward,
    s: RolloutSettings,
    seed: int,
    version: str,
) -> tuple[Group, dict[str, np.ndarray]]:
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
    per_sample = [examples[i // s.n] for i in range(len(comps))]
    answers = [ex.answer for ex in per_sample]
    lens = np.array([len(c.response_ids) for c in comps])
    rewards, correct, extras = score_responses(
        texts, per_sample, lens,
        verifier=verifier, max_tokens=s.max_tokens, overlong=s.overlong,
        overlong_buffer=s.overlong_buffer, overlong_penalty_coef=s.overlong_penalty,
    )  # fmt: skip
    return (comps, rewards, correct, texts, answers), extras


def collect(
    backend: RolloutBackend,
    stream: PromptStream,
    position: int,
    fmt: PromptFormat,
    verifier: Reward,
    s: RolloutSettings,
    *,
    seed: int,
    version: str,
) -> tuple[RolloutBatch, int, dict[str, float]]:
    """Samples one step's batch; returns it, the new data position and rollout stats (with the
    mean of each reward function metric over the samples scored, `reward/<key>`).

    `seed` fixes the samples (round k uses seed + k), so a resumed run redraws the same ones.
    """
    n = s.n
    kept: list[Group] = []  # one entry per group
    dropped: list[Group] = []
    sampled_groups = 0
    extras: dict[str, list[np.ndarray]] = {}
    rounds = 1 + (s.max_rounds if s.dynamic_sampling else 0)
    for k in range(rounds):
        need = s.batch_size - len(kept)
        if need == 0:
            break
        examples, position = stream.take(position, need if k == 0 else s.batch_size)
        (comps, rewards, correct, texts, answers), round_extras = _sample_round(
            backend, examples, fmt, verifier, s, seed + k, version
        )
        for key, values in round_extras.items():
            extras.setdefault(key, []).append(values)
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
        routing=s.routing_replay,
    )  # fmt: skip
    stats = {
        "rollout/sampled_groups": float(sampled_groups),
        "rollout/filled_groups": float(filled),
        "rollout/truncated_frac": float(batch.truncated.mean()),
    }
    if parser is not None:
        stats["reward/unparsed_frac"] = float(unparsed.mean())
    for key, values in extras.items():
        stats[f"reward/{key}"] = float(np.nanmean(np.concatenate(values)))
    return batch, position, stats


# Batch fields that only process 0 needs (texts for dumps, the backend's answers).
_MAIN_ONLY = ("completions", "texts", "answers")


def share_rollout(
    collect: Callable[[], tuple[RolloutBatch, int, dict[str, float]]],
) -> tuple[RolloutBatch, int, dict[str, float]]:
    """`collect()` (batch, data position, stats) on process 0; on the others the same batch
    arrays, position and stats (the texts and completions stay on process 0)."""
    if jax.process_count() == 1:
        return collect()
    got = on_main(collect)
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {}
    if got is not None:
        batch, position, stats = got
        arrays = {
            f.name: getattr(batch, f.name)
            for f in dataclasses.fields(RolloutBatch)
            if f.name not in _MAIN_ONLY and getattr(batch, f.name) is not None
        }
        info = {"position": position, "stats": stats}
    arrays, info = broadcast_from_main(arrays, info)
    if got is not None:
        return got
    batch = RolloutBatch(**arrays, completions=(), texts=(), answers=())
    return batch, int(info["position"]), {k: float(v) for k, v in info["stats"].items()}
