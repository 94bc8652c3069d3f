"""Data files (JSONL / Parquet, verl's layout, dotted keys), prompt templates, stop tokens, the
math reward's unparsed count, rollout-dump rounding and eval metrics, against hand-written
expectations (no model runs; the transformers comparison is in test_chat_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_model import write_chat_model, write_verl_parquet

from jfp8rl.config import ConfigError, load_config
from jfp8rl.data import DataError, Example, load_examples
from jfp8rl.eval import EvalResult
from jfp8rl.rewards import ANSWER_PARSERS, last_boxed, math_answer_parsed, math_verify_reward
from jfp8rl.rollout_dump import dump_groups
from jfp8rl.templates import PromptFormat, check_prompt_template, stop_token_ids
from models.tokenizer import build_byte_tokenizer, load_tokenizer, save_tokenizer

REPO = Path(__file__).resolve().parents[2]
DEEPSCALER = "{prompt} Let's think step by step and output the final answer within \\boxed{{}}."


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


def _raises(path: Path, match: str, **keys: str) -> None:
    with pytest.raises(DataError, match=match):
        load_examples(path, **keys)


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


def test_prompt_template_checks_and_config(tmp_path: Path) -> None:
    check_prompt_template(DEEPSCALER)
    for bad, msg in [
        ("{question} x", r"must hold the field \{prompt\} and no other"),
        ("no field", r"must hold the field \{prompt\}"),
        ("{prompt} \\boxed{}", r"and no other \(found \['\{prompt\}', '\{\}'\]\)"),
        ("{prompt", "is not a valid format string"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_prompt_template(bad)
    with pytest.raises(ConfigError, match=r"data\.prompt_template: '\{q\}'"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["data.prompt_template='{q}'"])
    with pytest.raises(ConfigError, match="its value is not valid YAML.*quote it"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["data.prompt_template={prompt} x"])
    with pytest.raises(ConfigError, match=r"data\.chat_template='jinja' is not one of"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", ["data.chat_template=jinja"])
    cfg = load_config(
        REPO / "configs" / "tiny_cpu.yaml",
        [f'data.prompt_template="{DEEPSCALER}"', "data.chat_template_kwargs.enable_thinking=false"],
    )
    assert cfg.data.prompt_template == DEEPSCALER.replace("\\b", "\b")  # YAML "\b" is backspace
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    # The README's YAML form: single quotes keep the backslash, '' is an apostrophe.
    y = tmp_path / "run.yaml"
    y.write_text(
        "data:\n  task: file\n  train_file: d.parquet\n  prompt_template: '{prompt} Let''s think "
        "step by step and output the final answer within \\boxed{{}}.'\n"
        "  chat_template_kwargs: {enable_thinking: false}\n"
    )
    cfg = load_config(y)
    assert cfg.data.prompt_template == DEEPSCALER
    assert cfg.data.prompt_template.format(prompt="Q") == (
        "Q Let's think step by step and output the final answer within \\boxed{}."
    )


def test_plain_folder_prompt_ids_and_stop_tokens(tmp_path: Path) -> None:
    # The built-in byte tokenizer: id b is byte b, so the ids are the UTF-8 bytes of the text.
    tok = build_byte_tokenizer()
    save_tokenizer(tok, tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 256}')
    fmt = PromptFormat(tmp_path, tok, prompt_template=DEEPSCALER)
    ex = Example("2+3=", "5")
    want = "2+3= Let's think step by step and output the final answer within \\boxed{}."
    assert fmt.render(ex) == want
    assert fmt.encode([ex], 200) == [list(want.encode())]
    assert fmt.stop_ids == (256,)
    assert PromptFormat(tmp_path, tok).encode([ex], 8) == [list(b"2+3=")]  # today's ids
    msg = Example("2+3?", "5", {}, ({"role": "user", "content": "2+3?"},))
    with pytest.raises(DataError, match="needs a chat template, but .* has no chat_template"):
        fmt.render(msg)
    with pytest.raises(DataError, match="has 4 tokens > data.max_prompt_tokens=3"):
        PromptFormat(tmp_path, tok).encode([ex], 3)


def test_chat_folder_stop_tokens_and_none(tmp_path: Path) -> None:
    folder = write_chat_model(tmp_path / "chat")
    tok = load_tokenizer(folder)
    ids = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    assert stop_token_ids(folder, tok) == ids == (2, 0)
    fmt = PromptFormat(folder, tok)
    # response_text cuts at the first stop token of either kind.
    body = tok.encode("x = 7", add_special_tokens=False).ids
    assert fmt.response_text([*body, 0, *body]) == "x = 7"
    assert fmt.response_text([*body, 2]) == "x = 7"
    plain = PromptFormat(folder, tok, chat_template="none")
    assert plain.render(Example("hi", "1")) == "hi"
    with pytest.raises(DataError, match="but data.chat_template=none"):
        plain.render(Example("hi", "1", {}, ({"role": "user", "content": "hi"},)))


def test_math_reward_boxed_and_unparsed() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert last_boxed("no box 42") is None
    cases = [  # (response, answer, reward, parsed)
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0, True),
        ("\\boxed{12}", "12", 1.0, True),
        ("\\boxed{13}", "12", 0.0, True),
        ("the answer is 12", "12", 0.0, False),  # no box: unparsed, scores 0
        ("\\boxed{}", "12", 0.0, False),
        ("\\boxed{\\frac{1}{2", "0.5", 0.0, False),
    ]
    for response, answer, reward, parsed in cases:
        assert math_verify_reward(response, answer) == reward, response
        assert math_answer_parsed(response) is parsed, response
    assert ANSWER_PARSERS[math_verify_reward] is math_answer_parsed


def test_dump_rounding_and_eval_metrics() -> None:
    # k samples -> ceil(k / n) whole groups, capped at the batch's groups.
    assert [dump_groups(k, 4, 3) for k in (1, 4, 5, 8, 100)] == [1, 1, 2, 2, 3]
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    lengths = np.array([[3, 4, 5, 6], [1, 1, 1, 1], [2, 2, 2, 2]], np.int32)
    m = EvalResult(correct, lengths, np.zeros((3, 4), bool), 1.0).metrics()
    assert m["avg@4"] == m["pass@1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["response_length/mean"] == pytest.approx(30 / 12)
    assert m["reward/unparsed_frac"] == 0.0 and m["problems"] == 3


def test_chat_template_sources_and_token_dicts(tmp_path: Path) -> None:
    tok = build_byte_tokenizer()
    save_tokenizer(tok, tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers >= 4.43 may save the template as chat_template.jinja beside the config.
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0].content }}|{{ eos_token }}]")
    assert PromptFormat(tmp_path, tok).render(Example("hi", "1")) == "[hi|<|endoftext|>]"
    # A list of named templates: "default" is used; special tokens as AddedToken dicts.
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "<{{ messages[-1].content }}{{ bos_token }}>"},
    ]
    cfg["bos_token"] = {"content": "<|endoftext|>", "__type": "AddedToken"}
    cfg_path.write_text(json.dumps(cfg))
    fmt = PromptFormat(tmp_path, tok, prompt_template="Q: {prompt}")
    assert fmt.render(Example("hi", "1")) == "<Q: hi<|endoftext|>>"
    assert fmt.encode([Example("hi", "1")], 16) == [[*b"<Q: hi", 256, *b">"]]
    cfg["chat_template"] = "{{ raise_exception('no system role') }}"
    cfg_path.write_text(json.dumps(cfg))
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        PromptFormat(tmp_path, tok).render(Example("hi", "1"))


def test_rollout_dump_fields(tmp_path: Path) -> None:
    from jfp8rl.rollout import pack
    from jfp8rl.rollout_dump import write_rollouts
    from rollout_bridge.backend import Completion

    tok = build_byte_tokenizer()
    save_tokenizer(tok, tmp_path)
    fmt = PromptFormat(tmp_path, tok)

    def comp(i: int, resp: bytes, eos: bool) -> Completion:
        ids = [*resp, 256] if eos else list(resp)
        return Completion(
            prompt_index=i, prompt_ids=tuple(b"1+2="), response_ids=np.array(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            finish_reason="stop" if eos else "length", weight_version="step-4",
        )  # fmt: skip

    comps = [comp(0, b"3", True), comp(0, b"4", True), comp(1, b"77", False), comp(1, b"7", True)]
    rewards = np.array([1.0, 0.0, 0.0, 0.0])
    keep = np.array([True, True, False, False])  # group 1: a dynamic-sampling filler
    batch = pack(
        comps, rewards, rewards, keep, max_prompt_tokens=4, max_tokens=3, pad_id=256,
        texts=["3", "4", "77", "7"], answers=["3"] * 4, unparsed=np.zeros(4, bool),
    )  # fmt: skip
    adv = np.array([[0.7, 0.7, 0], [-0.7, -0.7, 0], [0, 0, 0], [0, 0, 0]], np.float32)
    path = write_rollouts(tmp_path / "run", 5, batch, adv, fmt, samples=3, n=2)
    assert path == tmp_path / "run" / "rollouts" / "step_5.jsonl"
    rows = [json.loads(x) for x in path.open()]
    assert len(rows) == 4  # 3 samples -> 2 whole groups of 2
    assert rows[0] == {
        "step": 5, "group": 0, "sample": 0, "prompt_ids": list(b"1+2="), "prompt_text": "1+2=",
        "response_ids": [ord("3"), 256], "response_text": "3", "answer": "3", "reward": 1.0,
        "correct": 1.0, "advantage": pytest.approx(0.7), "in_loss": True, "unparsed": False,
        "finish_reason": "stop", "weight_version": "step-4",
    }  # fmt: skip
    assert rows[2]["finish_reason"] == "length" and rows[2]["response_ids"] == list(b"77")
    assert [r["in_loss"] for r in rows] == [True, True, False, False]
    assert [r["advantage"] for r in rows[2:]] == [0.0, 0.0]
