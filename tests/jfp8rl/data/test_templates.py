"""Prompt templates, chat templates and stop tokens against hand-written expectations (no model
runs; the transformers comparison is in tests/jfp8rl/trainer/test_chat_runs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_model import write_chat_model

from jfp8rl.config import ConfigError, load_config
from jfp8rl.data.records import DataError, Example
from jfp8rl.data.templates import PromptFormat, check_prompt_template
from models.tokenizer import build_byte_tokenizer, load_tokenizer, save_tokenizer, stop_token_ids

REPO = Path(__file__).resolve().parents[3]
DEEPSCALER = "{prompt} Let's think step by step and output the final answer within \\boxed{{}}."


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
    required = ["run_dir=r", "optim.lr=1e-6", "rollout.max_tokens=8", "data.max_prompt_tokens=64"]
    cfg = load_config(y, required)
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
