"""Fuzzed prompt files: each one loads into examples of text, or is a one-line `DataError`
naming the file and, for a record, its line (JSONL, 1-based) or row (Parquet, 0-based);
never another exception, never a traceback.

JSONL files mix records of the supported layouts with wrong types in every field, cut
records, random text and bytes (bad UTF-8), deep nesting and over-long numbers. Parquet
files hold columns of every type under the expected names (over good ones, or alone), and
some are cut or have a byte flipped. Deterministic (derandomized, no example database) and bounded: CASES files of
each kind, each within DEADLINE.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jfp8rl.data.records import DataError, Example, load_examples

CASES = {"jsonl": 300, "parquet": 200}
DEADLINE = timedelta(seconds=2)
FUZZ = {"deadline": DEADLINE, "derandomize": True, "database": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}  # fmt: skip

KEYS = ["prompt", "answer", "reward_model", "ground_truth", "role", "content", "extra_info"]
SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=8)
)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4),
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant"]) | SCALAR,
        "content": st.text(max_size=8) | SCALAR,
    },
)
RECORD = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {},
        optional={
            "prompt": st.one_of(st.text(max_size=8), SCALAR, st.lists(MESSAGE, max_size=3), JSON),
            "answer": st.one_of(st.text(max_size=8), SCALAR, JSON),
            "reward_model": st.fixed_dictionaries({}, optional={"ground_truth": SCALAR}) | JSON,
            "extra_info": JSON,
        },
    ),
)
ODD_LINES = [
    "[" * 100_000,  # deeper than the JSON decoder's recursion limit
    '{"prompt": "a", "answer": ' + "1" * 5000 + "}",  # over Python's 4300-digit int limit
    "\ufeff{}",
    '{"prompt": "\\ud800", "answer": 1}',
    "",
    "   ",
]
GOOD = st.fixed_dictionaries(
    {"prompt": st.text(max_size=8), "answer": st.text(max_size=4) | st.integers()}
)
LINE = st.one_of(
    GOOD.map(json.dumps),
    RECORD.map(json.dumps),
    RECORD.map(lambda r: json.dumps(r)[: max(1, len(json.dumps(r)) // 2)]),  # cut
    st.sampled_from(ODD_LINES),
    st.text(max_size=12).filter(lambda s: "\n" not in s),
)
JSONL_BYTES = st.one_of(
    st.lists(LINE, max_size=5).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")),
    st.binary(max_size=40),
)


def column(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.none() | values, min_size=2, max_size=2)


COLUMN = st.one_of(
    column(st.text(max_size=6)),
    column(st.integers(-5, 5)),
    column(st.floats()),
    column(st.binary(max_size=4)),
    column(st.booleans()),
    column(st.lists(MESSAGE.map(lambda m: {k: str(v) for k, v in m.items()}), max_size=2)),
    column(st.fixed_dictionaries({"ground_truth": st.text(max_size=4) | st.none()})),
)


def check_outcome(path: Path, rows: range, load: Callable[[], list[Example]], row_word: str) -> str:
    """'loaded' or 'error' (asserting the error's form: one line, the file, the line or row
    within `rows` when it names one); any other exception fails the test."""
    try:
        examples = load()
    except DataError as e:
        msg = str(e)
        assert "\n" not in msg and "\r" not in msg, msg
        assert msg.startswith(f"{path}"), msg
        where = re.match(re.escape(str(path)) + row_word + r"(\d+): ", msg)
        if where:
            assert int(where.group(1)) in rows, msg
        else:
            assert msg.startswith(f"{path}: "), msg
        return "error"
    assert all(isinstance(e.prompt, str) and isinstance(e.answer, str) for e in examples)
    return "loaded"


def test_jsonl_files_load_or_name_file_and_line(tmp_path: Path) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    path = tmp_path / "data.jsonl"

    @settings(max_examples=CASES["jsonl"], **FUZZ)
    @given(JSONL_BYTES)
    def one(data: bytes) -> None:
        path.write_bytes(data)
        lines = range(1, data.count(b"\n") + 2)
        outcomes[check_outcome(path, lines, lambda: load_examples(path), ":")] += 1

    one()
    print(f"JSONL fuzz: {sum(outcomes.values())} files, {dict(outcomes)}")
    assert sum(outcomes.values()) >= CASES["jsonl"]


def test_parquet_files_load_or_name_file_and_row(tmp_path: Path) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    path = tmp_path / "data.parquet"
    names = st.sampled_from(["prompt", "answer", "reward_model", "extra_info"])

    good = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}

    @settings(max_examples=CASES["parquet"], **FUZZ)
    @given(
        st.booleans(), st.dictionaries(names, COLUMN, max_size=4),
        st.sampled_from(["", "", "cut", "flip"]),
    )  # fmt: skip
    def one(start_good: bool, columns: dict[str, list], damage: str) -> None:
        columns = (good if start_good else {}) | columns
        try:
            table = pa.table({k: pa.array(v) for k, v in columns.items()} or {"x": [1, 2]})
            pq.write_table(table, path)
        except pa.ArrowException:  # a column pyarrow cannot write (a struct with no field)
            outcomes["unwritable"] += 1
            return
        data = bytearray(path.read_bytes())
        if damage == "cut":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        rows = range(table.num_rows)
        outcomes[check_outcome(path, rows, lambda: load_examples(path), " row ")] += 1

    one()
    print(f"Parquet fuzz: {sum(outcomes.values())} files, {dict(outcomes)}")
    assert sum(outcomes.values()) >= CASES["parquet"]
