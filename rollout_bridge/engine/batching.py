"""The embedded engine's padded batches, bucketed so that similar RL steps reuse one executable.

Generation: every prompt x n samples is one row; row r of a call is sample r % n of prompt
r // n (prompt-major). A call is decoded in chunks of at most `max_rows` consecutive rows
(`row_chunks`), so the KV cache holds at most `max_rows` rows whatever the call asks; within a
chunk prompts are left-padded to a common length so the last prompt token of every row sits at
the same position. Scoring: sequences right-padded, in chunks of at most `max_rows` too.
New tokens are bucketed to powers of two (>= 16), prompt and scored lengths to four sizes per
octave (>= 16, `length_bucket`), rows to eight (>= 8, `row_bucket`). Buckets and chunks only add padding: samples depend on (seed, prompt
index, sample index) alone, never on the bucket or the chunk (`rollout_bridge.engine.sampling`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from rollout_bridge.backend import Completion, RolloutError, SamplingParams

MIN_ROWS, MIN_PROMPT, MIN_NEW = 8, 16, 16
ROWS_PER_OCTAVE, LENGTHS_PER_OCTAVE = 8, 4
# Rows decoded at once by default (`max_rows`): vLLM's default --max-num-seqs on most GPUs
# (1024 on H100 / H200, 128 on CPU).
DEFAULT_MAX_NUM_SEQS = 256
STOP_SLOTS = 8  # stop ids per row (eos included)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum) (`minimum` a power of two): the compiled
    size for n, one size per octave."""
    return octave_bucket(n, minimum, 1)


def octave_bucket(n: int, minimum: int, per_octave: int) -> int:
    """The compiled size for n: the smallest multiple of `top / (2 * per_octave)` (`top`: the
    power of two >= max(n, minimum)) that is >= max(n, minimum). So `per_octave` sizes per
    octave (per_octave=4: 8, 10, 12, 14, 16, 20, ...) and padding under 1 / per_octave of n."""
    n = max(int(n), minimum)
    top = 1 << (n - 1).bit_length()  # power of two >= n
    step = max(1, top // (2 * per_octave))
    return -(-n // step) * step


def row_bucket(n: int, minimum: int = MIN_ROWS) -> int:
    """The compiled row count for n rows: eight sizes per octave (8, 9, 10, ..., 16, 18, ...,
    32, 36, 40, ...). Every row costs its share of each decode step's GEMMs and LM head, so
    rows pad by less than 12.5% (powers of two would pad 36 rows to 64); a fixed RL batch
    still compiles once."""
    return octave_bucket(n, minimum, ROWS_PER_OCTAVE)


def length_bucket(n: int, minimum: int = MIN_PROMPT) -> int:
    """The compiled length for a longest prompt (or scored sequence) of n tokens: four sizes
    per octave (16, 20, 24, 28, 32, 40, 48, ...). Prefill and scoring run every padded column
    through every layer, so padding costs as much as real tokens; four sizes keep it under 25%
    while a run's varying prompt lengths compile a handful of shapes."""
    return octave_bucket(n, minimum, LENGTHS_PER_OCTAVE)


def check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """`RolloutError` naming `what` unless every id is in [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RolloutError(f"embedded: {what} holds token ids {bad[:5]} outside [0, {vocab_size})")


@dataclasses.dataclass(frozen=True)
class GenerateBatch:
    """One `generate` call as padded rows (B = bucketed rows, P = bucketed prompt length)."""

    prompt: np.ndarray  # int32 [B, P], left-padded; padding rows hold one token 0
    mask: np.ndarray  # int32 [B, P], 1 on real tokens
    prompt_index: np.ndarray  # int32 [B], the row's prompt in the call
    key_index: np.ndarray  # int32 [B], the prompt's seed index (`seed_indices`)
    sample_index: np.ndarray  # int32 [B], j of the prompt's n samples
    max_new: np.ndarray  # int32 [B], max_tokens; 0 on padding rows (done from the start)
    stop_ids: np.ndarray  # int32 [B, STOP_SLOTS], padded with -1
    rows: int  # the real rows (the first `rows` of the batch)
    cache_len: int  # P + bucketed new tokens
    # The prompts the prefill runs, each once (U = bucketed distinct prompts of the rows): the n
    # samples of a prompt share its prefill, their KV-cache rows copied from it (`source`).
    prefill_prompt: np.ndarray  # int32 [U, P], left-padded as `prompt`
    prefill_mask: np.ndarray  # int32 [U, P]
    source: np.ndarray  # int32 [B], the row's prompt in `prefill_prompt` (padding rows: 0)


def row_chunks(total: int, max_rows: int) -> list[range]:
    """Consecutive ranges of at most `max_rows` of the rows [0, total), in order."""
    return [range(lo, min(lo + max_rows, total)) for lo in range(0, total, max_rows)]


def generate_batch(
    prompts: Sequence[tuple[int, ...]],
    seed_indices: Sequence[int],
    sampling: SamplingParams,
    stops: set[int],
    rows: range | None = None,
) -> GenerateBatch:
    """The rows `rows` (default all) of `sampling.n` samples per prompt, prompt-major (row r:
    sample r % n of prompt r // n); batch row k holds row rows[k]."""
    if len(stops) > STOP_SLOTS:
        raise RolloutError(f"embedded: at most {STOP_SLOTS} stop ids, got {len(stops)}")
    n = sampling.n
    rows = range(len(prompts) * n) if rows is None else rows
    b = row_bucket(len(rows))
    plen = length_bucket(max(len(prompts[r // n]) for r in rows))
    prompt = np.zeros((b, plen), np.int32)
    mask = np.zeros((b, plen), np.int32)
    prompt_index = np.zeros((b,), np.int32)
    key_index = np.zeros((b,), np.int32)
    sample_index = np.zeros((b,), np.int32)
    max_new = np.zeros((b,), np.int32)
    # Padding rows hold one real token so that no row attends to nothing.
    prompt[:, -1], mask[:, -1] = 0, 1
    for k, r in enumerate(rows):
        i, j = divmod(r, n)
        p = prompts[i]
        prompt[k, plen - len(p) :], mask[k, plen - len(p) :] = p, 1
        prompt_index[k], key_index[k] = i, seed_indices[i]
        sample_index[k], max_new[k] = j, sampling.max_tokens
    stop_ids = np.full((b, STOP_SLOTS), -1, np.int32)
    stop_ids[:, : len(stops)] = sorted(stops)
    # Cache slots are not positions (RoPE counts real tokens only), so the bucketed cache may
    # exceed the engine's max_len; the caller bounds the real length.
    cache_len = plen + bucket(sampling.max_tokens, MIN_NEW)
    source, prefill_prompt, prefill_mask = _shared_prefill(prompt, mask, prompt_index, len(rows))
    return GenerateBatch(
        prompt,
        mask,
        prompt_index,
        key_index,
        sample_index,
        max_new,
        stop_ids,
        len(rows),
        cache_len,
        prefill_prompt,
        prefill_mask,
        source,
    )


def _shared_prefill(
    prompt: np.ndarray, mask: np.ndarray, prompt_index: np.ndarray, rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, prefill_prompt, prefill_mask) of `GenerateBatch`: each distinct prompt of the
    first `rows` rows once, in order of first appearance, bucketed (`row_bucket`). When that
    bucket is the batch's own, sharing saves nothing: the identity (every row prefilled), so
    `generate_rows` copies cache rows exactly when U < B."""
    b, plen = prompt.shape
    slot: dict[int, int] = {}  # prompt index -> its row in prefill_prompt
    first_rows: list[int] = []  # the batch row each prefill row copies
    source = np.zeros((b,), np.int32)
    for k in range(rows):
        i = int(prompt_index[k])
        if i not in slot:
            slot[i] = len(first_rows)
            first_rows.append(k)
        source[k] = slot[i]
    u = row_bucket(len(first_rows))
    if u == b:  # nothing to share at this bucket: prefill every row (`generate_rows`)
        return np.arange(b, dtype=np.int32), prompt, mask
    prefill_prompt, prefill_mask = np.zeros((u, plen), np.int32), np.zeros((u, plen), np.int32)
    prefill_prompt[:, -1], prefill_mask[:, -1] = 0, 1  # padding rows: one token, as above
    prefill_prompt[: len(first_rows)] = prompt[first_rows]
    prefill_mask[: len(first_rows)] = mask[first_rows]
    return source, prefill_prompt, prefill_mask


def score_batch(seqs: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Right-padded, bucketed (tokens, mask) int32 [B, T] and the true lengths."""
    if not seqs:
        return np.zeros((0, 0), np.int32), np.zeros((0, 0), np.int32), []
    b = row_bucket(len(seqs))
    t = length_bucket(max(len(s) for s in seqs))
    tokens = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.int32)
    mask[:, 0] = 1  # padding rows hold one real token
    for r, s in enumerate(seqs):
        tokens[r, : len(s)], mask[r, : len(s)] = s, 1
    return tokens, mask, [len(s) for s in seqs]


def completions(
    prompts: Sequence[tuple[int, ...]],
    batch: GenerateBatch,
    toks: np.ndarray,
    lps: np.ndarray,
    lens: np.ndarray,
    routing: np.ndarray | None,
    stops: set[int],
    version: str,
) -> list[Completion]:
    """A decoded chunk's rows (`programs.generate_rows`' tokens, logprobs, lengths and recorded
    routing) as completions: each row's first `lens[r]` tokens, "stop" when the last one is a
    stop id, the routing of its prompt and response tokens (`_fed_routing`). A non-finite
    logprob is refused."""
    out = []
    for r in range(batch.rows):
        ids = toks[r, : lens[r]].astype(np.int32)
        lp = lps[r, : lens[r]].astype(np.float32)
        if not np.all(np.isfinite(lp)):
            raise RolloutError(f"embedded: non-finite logprob in row {r}; weights hold NaN/inf?")
        prompt_ids = prompts[batch.prompt_index[r]]
        out.append(
            Completion(
                prompt_index=int(batch.prompt_index[r]),
                prompt_ids=prompt_ids,
                response_ids=ids,
                logprobs=lp,
                finish_reason="stop" if ids.size and int(ids[-1]) in stops else "length",
                weight_version=version,
                routed_experts=(
                    None if routing is None else _fed_routing(routing[r], len(prompt_ids) + lens[r])
                ),
            )
        )
    return out


def _fed_routing(row: np.ndarray, n: int) -> np.ndarray:
    """A row's routing record of its n tokens, the last one's -1: a sample's last token is
    fed only when other rows keep the decode loop going, so it is never part of the record
    (as vLLM's `routed_experts` holds n - 1 tokens)."""
    out = row[:n].copy()
    out[n - 1 :] = -1
    return out
