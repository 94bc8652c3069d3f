"""Prompt records: `Example`, and JSONL / Parquet prompt files parsed into examples.

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
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
    # Read as bytes and decoded line by line, so that bad UTF-8 is named by its line too.
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            except (ValueError, RecursionError) as e:  # a number over 4300 digits, deep nesting
                raise DataError(f"{where}: unreadable JSON ({_one_line(e)})") from e
            yield where, record


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _parquet_records(p: Path) -> Iterator[tuple[str, Any]]:
    # pyarrow is needed by Parquet files only (a large import): imported when one is read.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{p}: not a readable Parquet file ({_one_line(e)})") from e
    for i, row in enumerate(rows):
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
