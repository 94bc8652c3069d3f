"""Data files (JSONL / Parquet, verl's layout, dotted keys) and their errors naming file:line or
file row and key, against hand-written expectations."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_model import write_verl_parquet

from jfp8rl.data.records import DataError, load_examples

REPO = Path(__file__).resolve().parents[3]


def _raises(path: Path, match: str, **keys: str) -> None:
    with pytest.raises(DataError, match=match):
        load_examples(path, **keys)


def test_jsonl_ok_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"prompt": "1+1=", "answer": "2", "src": "x"}\n\n{"prompt": "2+2=", "answer": 4}\n'
    )
    ex = load_examples(p)
    assert [(e.prompt, e.answer) for e in ex] == [("1+1=", "2"), ("2+2=", "4")]
    assert ex[0].meta == {"src": "x"}
    cases = {
        '{"prompt": "a"}\n': ":1: missing required field 'answer'",
        '{"prompt": "a", "answer": "b"}\n{oops\n': ":2: not valid JSON",
        "[1, 2]\n": ":1: expected a JSON object",
        '{"prompt": 3, "answer": "b"}\n': ":1: field 'prompt' must be a string",
    }
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(
            DataError,
            match=str(p).replace(".", r"\.") + msg.replace("[", r"\[").replace("(", r"\("),
        ):
            load_examples(p)
    with pytest.raises(DataError, match="not found"):
        load_examples(tmp_path / "nope.jsonl")


def test_verl_parquet_flat_jsonl_and_dotted_keys(tmp_path: Path) -> None:
    pq_path = write_verl_parquet(
        tmp_path / "train.parquet", [("What is 2+3?", "5"), ("Half of 1?", "\\frac{1}{2}")], "Sys."
    )
    ex = load_examples(pq_path)
    assert [(e.prompt, e.answer) for e in ex] == [
        ("What is 2+3?", "5"),
        ("Half of 1?", "\\frac{1}{2}"),
    ]
    assert ex[0].messages == (
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "What is 2+3?"},
    )
    assert ex[1].meta["data_source"] == "tiny_math"
    assert ex[1].meta["reward_model"] == {"style": "rule", "ground_truth": "\\frac{1}{2}"}
    assert ex[1].meta["extra_info"] == {"index": 1, "split": "train"}
    # Layouts are recognised per record: flat, verl and a numeric answer in one JSONL file.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2, "src": "a"})
        + "\n"
        + json.dumps(
            {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}
        )
        + "\n"
    )
    a, b = load_examples(mixed)
    assert (a.prompt, a.answer, a.messages, a.meta) == ("1+1=", "2", None, {"src": "a"})
    assert (b.prompt, b.answer, b.messages) == ("2+2?", "4", ({"role": "user", "content": "2+2?"},))
    # Other layouts through dotted keys.
    other = tmp_path / "other.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"q": {"text": "3*3?"}, "sol": {"final": 9}, "id": 7}]), other
    )
    (c,) = load_examples(other, prompt_key="q.text", answer_key="sol.final")
    # Only top-level prompt / answer fields are consumed; nested ones stay in meta.
    assert (c.prompt, c.answer, c.meta["id"], c.meta["sol"]) == ("3*3?", "9", 7, {"final": 9})


def test_data_errors_name_file_row_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    _raises(bad, rf"{bad}: not a readable Parquet file")
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]), rows)
    _raises(rows, rf"{rows} row 1: missing required field 'answer' \(nor verl's")
    content = tmp_path / "content.parquet"
    msgs = [{"role": "user", "content": "ok"}]
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": msgs, "reward_model": {"ground_truth": "1"}},
                {"prompt": msgs, "reward_model": {"ground_truth": "1"}},
                {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}},
            ]
        ),
        content,
    )
    _raises(content, rf"{content} row 2: prompt\[0\]\.content must be a string, got missing")
    ints = tmp_path / "ints.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": [{"role": "user", "content": 5}], "answer": "1"}]), ints
    )
    _raises(ints, rf"{ints} row 0: prompt\[0\]\.content must be a string, got int")
    gt = tmp_path / "gt.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "reward_model": {"ground_truth": [1]}}]), gt
    )
    _raises(gt, rf"{gt} row 0: field 'reward_model\.ground_truth' must be a string, got list")
    _raises(
        rows, rf"{rows} row 0: missing required field 'question\.text'", prompt_key="question.text"
    )
    _raises(
        rows, rf"{rows} row 0: missing required field 'sol' \(data\.answer_key\)", answer_key="sol"
    )
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": [], "answer": "1"}\n')
    _raises(jl, rf"{jl}:2: prompt is an empty message list")
    jl.write_text('{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}\n')
    _raises(jl, rf"{jl}:1: prompt holds no message with role 'user'")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    _raises(csv, "unknown data file type '.csv'; use .jsonl or .parquet")
