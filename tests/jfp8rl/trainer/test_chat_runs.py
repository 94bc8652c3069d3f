"""A user's real run on a tiny chat model: verl-style Parquet data, a Qwen3-like chat template
(thinking on and off), the math reward, rollout dumps, the exported folder.

Reference: transformers' `apply_chat_template(..., tokenize=True, add_generation_prompt=True)`
on the same folder (in the vLLM venv) for every prompt id the trainer sent. The model is
random, so rewards are mostly 0: the point is the ids, the stop tokens, the unparsed count and
the plumbing, checked number by number against the dumps. The same path through a real vLLM
(a chat template, `fp8_fp32` pushes, `jfp8rl.eval --url`) runs on the real chat model:
tests/jfp8rl/trainer/test_smollm2_runs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_model import write_chat_model, write_verl_parquet
from tiny_run import TINY

from jfp8rl.data.records import Example, load_examples
from jfp8rl.data.rewards import math_answer_parsed, math_verify_reward
from jfp8rl.data.templates import PromptFormat
from jfp8rl.observe.metrics import read_metrics
from jfp8rl.train import main as train_main
from models.tokenizer import load_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = "You are a helpful assistant."
PROBLEMS = [(f"What is {a} + {b}?", str(a + b)) for a, b in [(2, 3), (12, 30), (7, 8), (40, 2)]]
PROBLEMS += [("Half of 1?", "\\frac{1}{2}"), ("Solve x^2 - 5x + 6 = 0 for the larger root.", "3")]
PROBLEMS += [(f"Compute {a} * {b}.", str(a * b)) for a, b in [(3, 4), (6, 7)]]
# YAML single quotes: the backslash is literal and '' is an apostrophe (README, "Your own data").
TEMPLATE_YAML = (
    "'{prompt} Let''s think step by step and output the final answer within \\boxed{{}}.'"
)
TEMPLATE = "{prompt} Let's think step by step and output the final answer within \\boxed{{}}."
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "  x^2 - 5x + 6 = 0 数学 "},
    ],
    [
        {"role": "user", "content": "Compute 3 * 4."},
        {"role": "assistant", "content": "The answer is \\boxed{12}."},
        {"role": "user", "content": "And 6 * 7?"},
    ],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_verl_parquet(tmp_path_factory.mktemp("data") / "train.parquet", PROBLEMS, SYSTEM)


def _parquet_conversations(parquet: Path) -> list[list[dict[str, str]]]:
    """The Parquet file's prompts as transformers gets them: the template applied by hand."""
    convs = []
    for ex in load_examples(parquet):
        msgs = [dict(m) for m in ex.messages]
        msgs[-1]["content"] = TEMPLATE.format(prompt=msgs[-1]["content"])
        convs.append(msgs)
    return convs


@pytest.fixture(scope="module")
def refs(chat_dir: Path, parquet: Path, transformers_ref) -> dict[bool, dict]:
    """transformers' chat-template output for CONVERSATIONS + the Parquet prompts, keyed by
    enable_thinking (one reference job each)."""
    convs = CONVERSATIONS + _parquet_conversations(parquet)
    out = {}
    for thinking, kwargs in ((True, {}), (False, {"enable_thinking": False})):
        meta, _ = transformers_ref(
            "chat_template", folder=str(chat_dir), conversations=convs, kwargs=kwargs
        )
        out[thinking] = {"kwargs": kwargs, **meta}
    return out


def _example(messages: list[dict[str, str]]) -> Example:
    return Example(messages[-1]["content"], "", {}, tuple(messages))


def test_chat_template_ids_equal_transformers(
    chat_dir: Path, parquet: Path, refs: dict[bool, dict]
) -> None:
    tok = load_tokenizer(chat_dir)
    convs = CONVERSATIONS + _parquet_conversations(parquet)  # the order of `refs`
    for meta in refs.values():
        fmt = PromptFormat(chat_dir, tok, chat_template_kwargs=meta["kwargs"])
        assert [fmt.render(_example(c)) for c in convs] == meta["text"]
        assert [fmt.encode([_example(c)], 512)[0] for c in convs] == meta["input_ids"]
        # Stop tokens: the tokenizer's eos, then generation_config's eos_token_id list.
        assert fmt.stop_ids[0] == meta["eos_token_id"]
        assert set(fmt.stop_ids) == {meta["eos_token_id"], *meta["generation_eos_token_id"]}
    meta = refs[False]
    assert meta["text"][0].endswith("<think>\n\n</think>\n\n")
    # The comparison can fail: without trim_blocks / lstrip_blocks the text differs.
    import jinja2

    plain = jinja2.Environment().from_string(fmt.template_source)
    text = plain.render(
        messages=CONVERSATIONS[0], add_generation_prompt=True, enable_thinking=False
    )
    assert text != meta["text"][0]
    assert text.split() == meta["text"][0].split()  # only the whitespace differs


def _run(run_dir: Path, chat_dir: Path, parquet: Path, cache: Path, *extra: str) -> None:
    argv = [
        "--config", str(TINY), f"run_dir={run_dir}", f"model.path={chat_dir}",
        "data.task=file", f"data.train_file={parquet}", f"data.eval_file={parquet}",
        "data.eval_size=8", "data.batch_size=4", "data.max_prompt_tokens=96", "rollout.n=4",
        "rollout.max_tokens=16", "rollout.dynamic_sampling=false", "reward.kind=math",
        f"data.prompt_template={TEMPLATE_YAML}", "train.steps=2", "train.mini_batches=2",
        "train.eval_every=0", "algorithm.clip=plain", "checkpoint.every=2",
        "logging.console=none", "logging.tensorboard=false", "logging.rollout_samples=14",
        f"train.jax_cache_dir={cache}", *extra,
    ]  # fmt: skip
    assert train_main(argv) == 0


def _check_dumps(run_dir: Path, chat_dir: Path, ref_ids: list[list[int]], ref_text: list[str]):
    tok = load_tokenizer(chat_dir)
    stops = PromptFormat(chat_dir, tok).stop_ids
    recs = read_metrics(run_dir)
    for step in (1, 2):
        rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step}.jsonl").open()]
        # 14 samples rounded up to whole groups of n = 4: 16, the whole batch.
        assert len(rows) == 16 and [r["sample"] for r in rows[:4]] == [0, 1, 2, 3]
        for r in rows:
            k = ref_ids.index(r["prompt_ids"])  # ValueError: ids transformers would not give
            assert r["prompt_text"] == ref_text[k]
            assert r["weight_version"] == f"step-{step - 1}"
            resp = r["response_ids"]
            assert not set(resp[:-1]) & set(stops), "generation went past a stop token"
            assert (r["finish_reason"] == "stop") == (resp[-1] in stops)
            assert len(resp) <= 16
            body = resp[:-1] if resp[-1] in stops else resp
            assert r["response_text"] == tok.decode(body, skip_special_tokens=False)
            assert r["reward"] == math_verify_reward(r["response_text"], r["answer"])
            assert r["unparsed"] is not math_answer_parsed(r["response_text"])
        for g in range(4):
            rew = np.array([r["reward"] for r in rows[4 * g : 4 * g + 4]], np.float64)
            want = (rew - rew.mean()) / (rew.std(ddof=1) + 1e-6)  # GRPO / DAPO group advantage
            got = [r["advantage"] for r in rows[4 * g : 4 * g + 4]]
            np.testing.assert_allclose(got, want, atol=1e-5)
        m = recs[step]
        assert m["step"] == step
        assert m["reward/unparsed_frac"] == pytest.approx(np.mean([r["unparsed"] for r in rows]))
        assert m["reward/mean"] == pytest.approx(np.mean([r["reward"] for r in rows]))


def test_parquet_math_run(
    chat_dir: Path, parquet: Path, tmp_path: Path, refs: dict[bool, dict]
) -> None:
    # Embedded engine, thinking off (the template's default, thinking on, is in the template
    # test above). Plain clipping: the data / template / reward plumbing checked here does not
    # depend on the bounds, and calibrating steps would compile programs of their own.
    emb = tmp_path / "embedded"
    _run(
        emb, chat_dir, parquet, tmp_path / "jax", "data.chat_template_kwargs.enable_thinking=false"
    )
    k = len(CONVERSATIONS)
    ids_off, text_off = refs[False]["input_ids"][k:], refs[False]["text"][k:]
    assert all(t.endswith("<think>\n\n</think>\n\n") for t in text_off)
    assert refs[True]["input_ids"][k:] != ids_off
    _check_dumps(emb, chat_dir, ids_off, text_off)
    # hf_final keeps the chat template and the stop tokens of the base folder.
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (emb / "hf_final" / name).read_text() == (chat_dir / name).read_text()
