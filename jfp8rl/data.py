"""Prompt data: JSONL / Parquet files and the built-in arithmetic task, with a resumable order.

Files (`load_examples`): `.jsonl` (one JSON object per line, blank lines skipped) or `.parquet`
(one row per example, read with pyarrow). Each record is recognised on its own:

- flat: `{"prompt": str, "answer": str | number, ...}` (numbers become their text);
- verl's layout (verl `examples/data_preprocess`, DeepScaleR / DAPO-Math-17K as verl ships
  them): `prompt` is a list of chat messages `[{"role": str, "content": str}, ...]` and the
  answer sits at `reward_model.ground_truth`;
- anything else: `data.prompt_key` / `data.answer_key` name dotted paths into the record
  (`"extra_info.question"`), which replace the two defaults above.

Every other top-level field (`data_source`, `ability`, `extra_info`, ...) is kept in
`Example.meta`. Problems raise `DataError` naming the record: `file:line` for JSONL (1-based
line numbers) and `file row i` for Parquet (0-based row index, as pyarrow / pandas count), and
the key.

The built-in task ("arithmetic"): prompt `"{a}+{b}="` with both operands zero-padded to
max_digits digits (`"07+45="`: fixed digit positions, which a 2-layer model learns far faster
than variable-width operands), answer `str(a + b)` without padding (`"52"`). The eval set is `eval_size` problems drawn with a fixed seed; the training
set is every other pair, so eval problems are never trained on.

The built-in long-response task ("scratchpad", issue 12): the same prompt, but the policy is
warm-started to write a column-addition scratchpad before the answer, least significant digit
first, one step `a_i+b_i+c=ss;` per digit (c the incoming carry, ss the two-digit column sum),
then `#` and the sum zero-padded to max_digits + 1 digits:

    "123+459=" -> "3+9+0=12;2+5+1=08;1+4+0=05;#0582"   (9 * max_digits + max_digits + 2 chars)

32 characters (+ eos: 33 response tokens of the byte tokenizer) at 3 digits. `Example.answer`
is `str(a + b)` (what the verifier checks); `Example.meta["target"]` holds the scratchpad (what
the warm start trains on). With 3 digits there are 10^6 pairs, so the training set is a fixed
draw of at most `SCRATCHPAD_TRAIN_SIZE` pairs disjoint from the eval set.

Order: `PromptStream` yields training examples epoch by epoch, each epoch a permutation drawn
from (seed, epoch). Its whole state is one integer, the number of prompts consumed so far
(`position`), which the checkpoint stores; `take(position, k)` is a pure function of it, so a
resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


class DataError(ValueError):
    """A prompt file or example is malformed; the message names file:line or the example."""


Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; `meta` holds the record's other fields.

    `prompt` is the prompt text; for a chat-message prompt (verl's layout) it is the content of
    the last user message and `messages` holds the whole list.
    """

    prompt: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    messages: tuple[Message, ...] | None = None


def _lookup(record: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted path (`reward_model.ground_truth`) in nested dicts; a null
    value (Parquet's missing field) counts as absent."""
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return False, None
        node = node[part]
    return True, node


def _messages(value: list[Any], where: str, key: str) -> tuple[Message, ...]:
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(
                f"{where}: {key}[{j}] must be a chat message {{role, content}}, "
                f"got {type(m).__name__}"
            )
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = "missing" if m.get(field) is None else type(m[field]).__name__
                raise DataError(f"{where}: {key}[{j}].{field} must be a string, got {got}")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise DataError(f"{where}: {key} is an empty message list")
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{where}: {key} holds no message with role 'user'")
    return tuple(out)


def parse_record(record: Any, where: str, *, prompt_key: str = "", answer_key: str = "") -> Example:
    """One record (a JSON object / Parquet row) as an `Example` (module docstring for the
    layouts); `where` (`file:line`, `file row i`) prefixes every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    pkey = prompt_key or "prompt"
    found, prompt = _lookup(record, pkey)
    if not found:
        hint = "" if prompt_key else " (set data.prompt_key for another layout)"
        raise DataError(f"{where}: missing required field {pkey!r}{hint}")
    if answer_key:
        akey = answer_key
        found, answer = _lookup(record, akey)
    else:
        akey = "answer"
        found, answer = _lookup(record, "answer")
        if not found:
            akey = "reward_model.ground_truth"  # verl's layout
            found, answer = _lookup(record, akey)
            if not found:
                raise DataError(
                    f"{where}: missing required field 'answer' (nor verl's "
                    "'reward_model.ground_truth'; set data.answer_key for another layout)"
                )
    if not found:
        raise DataError(f"{where}: missing required field {akey!r} (data.answer_key)")
    messages = None
    if isinstance(prompt, list | tuple):
        messages = _messages(list(prompt), where, pkey)
        prompt = [m for m in messages if m["role"] == "user"][-1]["content"]
    elif not isinstance(prompt, str):
        raise DataError(
            f"{where}: field {pkey!r} must be a string or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    # Numbers as answers are common in math sets; accept them as their text.
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DataError(f"{where}: field {akey!r} must be a string, got {type(answer).__name__}")
    # A top-level prompt / answer field is consumed; nested ones (verl's reward_model) stay.
    meta = {k: v for k, v in record.items() if k not in (pkey, akey)}
    return Example(prompt, answer, meta, messages)


def _jsonl_records(p: Path) -> Iterator[tuple[str, Any]]:
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{p}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from e


def _parquet_records(p: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{p}: not a readable Parquet file ({e})") from e
    for i, row in enumerate(table.to_pylist()):
        yield f"{p} row {i}", row


def load_examples(path: str | Path, *, prompt_key: str = "", answer_key: str = "") -> list[Example]:
    """The examples of a `.jsonl` or `.parquet` file (module docstring); errors name the
    file, the line or row, and the key."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: prompt file not found (set data.train_file / data.eval_file)")
    if p.suffix == ".jsonl":
        records = _jsonl_records(p)
    elif p.suffix == ".parquet":
        records = _parquet_records(p)
    else:
        raise DataError(f"{p}: unknown data file type {p.suffix!r}; use .jsonl or .parquet")
    out = [
        parse_record(rec, where, prompt_key=prompt_key, answer_key=answer_key)
        for where, rec in records
    ]
    if not out:
        raise DataError(f"{p}: no examples (the file is empty)")
    return out


def arithmetic_prompt(a: int, b: int, width: int) -> Example:
    """The built-in task's example for a + b, operands zero-padded to `width` digits."""
    return Example(f"{a:0{width}d}+{b:0{width}d}=", str(a + b), {"a": a, "b": b})


def scratchpad_text(a: int, b: int, width: int) -> str:
    """The scratchpad of a + b with `width`-digit operands (module docstring)."""
    steps, carry = [], 0
    for i in range(width):
        da, db = a // 10**i % 10, b // 10**i % 10
        s = da + db + carry
        steps.append(f"{da}+{db}+{carry}={s:02d};")
        carry = s // 10
    return "".join(steps) + f"#{a + b:0{width + 1}d}"


def scratchpad_prompt(a: int, b: int, width: int) -> Example:
    """The long-response task's example: the arithmetic prompt, the scratchpad as target."""
    ex = arithmetic_prompt(a, b, width)
    return dataclasses.replace(ex, meta={**ex.meta, "target": scratchpad_text(a, b, width)})


# Training pairs of the scratchpad task (a fixed draw; 3 digits have 10^6 pairs in all).
SCRATCHPAD_TRAIN_SIZE = 65536

# Tasks whose data (and warm-started base policy) are built in: data.task names.
BUILTIN_TASKS = ("arithmetic", "scratchpad")


def arithmetic_split(
    max_digits: int,
    eval_size: int,
    seed: int = 1234,
    *,
    make: Callable[[int, int, int], Example] = arithmetic_prompt,
    max_train: int = 0,
) -> tuple[list[Example], list[Example]]:
    """(train, eval) for a built-in task: pairs in [0, 10^max_digits)^2, eval held out; the
    training set is every other pair, or a fixed draw of `max_train` of them (0 = all)."""
    hi = 10**max_digits
    n_pairs = hi * hi
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_pairs)
    if eval_size >= n_pairs:
        raise DataError(f"data.eval_size={eval_size} leaves no training pairs ({n_pairs} in all)")
    rest = perm[eval_size:]
    eval_idx, train_idx = perm[:eval_size], np.sort(rest[:max_train] if max_train else rest)
    train = [make(int(i // hi), int(i % hi), max_digits) for i in train_idx]
    evals = [make(int(i // hi), int(i % hi), max_digits) for i in eval_idx]
    return train, evals


class PromptStream:
    """Deterministic epoch-wise shuffled order over `examples`; state = prompts consumed."""

    def __init__(self, examples: Sequence[Example], seed: int) -> None:
        if not examples:
            raise DataError("no training examples")
        self.examples = list(examples)
        self.seed = seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = {epoch: rng.permutation(len(self.examples))}
        return self._perm_cache[epoch]

    def take(self, position: int, k: int) -> tuple[list[Example], int]:
        """The k examples after `position` prompts consumed, and the new position."""
        n = len(self.examples)
        out = []
        for pos in range(position, position + k):
            epoch, i = divmod(pos, n)
            out.append(self.examples[int(self._perm(epoch)[i])])
        return out, position + k


def encode_texts(texts: Sequence[str], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """Token ids of each text with no special tokens added (what transformers does with a
    rendered chat template); a prompt longer than `max_tokens` is an error naming it, since
    truncating a prompt would change the task."""
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > max_tokens:
            raise DataError(
                f"prompt {i} ({text[:40]!r}...) has {len(ids)} tokens > "
                f"data.max_prompt_tokens={max_tokens}; raise it or shorten the prompt"
            )
        if not ids:
            raise DataError(f"prompt {i} is empty after tokenization")
        out.append(list(ids))
    return out


def encode_prompts(examples: Sequence[Example], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    """`encode_texts` of the examples' raw prompt texts (no template)."""
    return encode_texts([ex.prompt for ex in examples], tokenizer, max_tokens)


def build_datasets(
    task: str,
    train_file: str,
    eval_file: str,
    max_digits: int,
    eval_size: int,
    *,
    prompt_key: str = "",
    answer_key: str = "",
) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for the configured task (`jfp8rl.config.DataConfig` fields)."""
    if task == "arithmetic":
        return arithmetic_split(max_digits, eval_size)
    if task == "scratchpad":
        return arithmetic_split(
            max_digits, eval_size, make=scratchpad_prompt, max_train=SCRATCHPAD_TRAIN_SIZE
        )
    train = load_examples(train_file, prompt_key=prompt_key, answer_key=answer_key)
    evals = (
        load_examples(eval_file, prompt_key=prompt_key, answer_key=answer_key)
        if eval_file
        else train
    )
    return train, evals[:eval_size]
