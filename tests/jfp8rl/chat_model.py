"""A tiny random Qwen3 HF folder that looks like a real chat model, built offline for tests.

- tokenizer: a byte-level BPE trained here with the `tokenizers` package on a small math /
  chat corpus (about 400 tokens), with Qwen's special tokens `<|endoftext|>`, `<|im_start|>`,
  `<|im_end|>` and the `<think>` / `</think>` pair;
- tokenizer_config.json: eos `<|im_end|>`, pad `<|endoftext|>`, and a Qwen3-like chat template
  (system / user / assistant turns, the `enable_thinking` switch of Qwen3's template, a
  `raise_exception` on unknown roles, a `tools | tojson` branch, block tags on their own lines
  so that trim_blocks / lstrip_blocks matter);
- generation_config.json: eos_token_id [<|im_end|>, <|endoftext|>] as Qwen3 instruct has;
- weights: random (numpy seed), a Qwen3 shape a CPU vLLM serves (head_dim 32).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Block tags stand on their own lines (trim_blocks / lstrip_blocks remove those newlines and
# indents), as in Qwen's own template.
QWEN_LIKE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{% for message in messages %}
    {% if message.role == 'system' and loop.first %}
    {% elif message.role in ['user', 'system', 'assistant'] %}
        {{ '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
    {% else %}
        {{ raise_exception('unknown role: ' + message.role) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{% endif %}
"""

CORPUS = [
    "What is 12 + 30? Let's think step by step and output the final answer within \\boxed{}.",
    "Compute the sum of the first ten positive integers.",
    "The answer is \\boxed{42}. Therefore x = 7 and y = -3.",
    "You are a helpful assistant. Solve the problem carefully.",
    "Find all real numbers x such that x^2 - 5x + 6 = 0. The roots are 2 and 3.",
    "système: réponds en français, s'il te plaît. 数学",
] * 20


def build_chat_tokenizer(vocab_size: int = 400):
    """The byte-level BPE (module docstring); special tokens take ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_chat_model(folder: Path, seed: int = 0) -> Path:
    """Writes the folder (module docstring); returns it."""
    from models.config import get_config
    from models.hf_io import from_hf_state_dict, random_hf_state_dict, save_hf

    tok = build_chat_tokenizer()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = get_config(
        "tiny_qwen3",
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        eos_token_id=im_end,
        compute_dtype=jnp.float32,
    )
    params = from_hf_state_dict(cfg, random_hf_state_dict(cfg, seed))
    save_hf(folder, cfg, params, tok)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.update(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok_cfg["chat_template"] = QWEN_LIKE_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"eos_token_id": [im_end, eot], "pad_token_id": eot}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return folder


def write_verl_parquet(path: Path, rows: list[tuple[str, str]], system: str = "") -> Path:
    """A Parquet file in verl's layout: prompt = chat messages, reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = []
    for i, (question, answer) in enumerate(rows):
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
        records.append(
            {
                "data_source": "tiny_math",
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    pq.write_table(pa.Table.from_pylist(records), path)
    return path
