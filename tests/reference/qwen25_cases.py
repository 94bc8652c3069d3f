"""The Qwen2.5-Coder-0.5B-Instruct reference cases (scripts/get_qwen25_coder_05b.sh): SmolLM2's
strings plus code, Chinese and Qwen's own special tokens, conversations with and without a
system message, and short greedy prompts, answered by transformers' model of the folder in one
job per test session (fixture `qwen25_ref`, tests/conftest.py). Few new tokens: the model is
4x SmolLM2's compute and its 151,936-entry head dominates a decode step."""

from __future__ import annotations

from smollm2_cases import CONVERSATIONS
from smollm2_cases import TEXTS as SMOLLM2_TEXTS

TEXTS = (
    *SMOLLM2_TEXTS[:2],
    "def add(a, b):\n    return a + b  # 加法\n",
    *SMOLLM2_TEXTS[2:],
    "请用中文回答：二加三等于几？",
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|endoftext|><|fim_prefix|>x<|fim_suffix|>",
)
GREEDY = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Name a color."},
    ],  # fmt: skip
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
)
MAX_NEW_TOKENS = 12
__all__ = ["CONVERSATIONS", "GREEDY", "MAX_NEW_TOKENS", "TEXTS"]
