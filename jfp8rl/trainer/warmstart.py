"""The tiny base policy: a small Qwen3-style model, briefly supervised on the built-in task.

RL from a random model would need far more than the 10-minute CPU budget; a policy that has
never produced a correct answer gets no signal. So the default run starts from a policy
warm-started by cross-entropy on `prompt -> answer<eos>` (until `warmstart.target_accuracy`,
at most `warmstart.steps` steps): weak but
not useless (it knows the format and gets some sums right), which is the regime where RL's gain
is visible (like an RL run starting from a base model that already follows the format).

Loss: mean over answer tokens (answer bytes and eos) of -log p(token | prefix), BF16 recipe
(no FP8) with AdamW. Greedy accuracy is measured exactly by teacher forcing: greedy decoding
reproduces the answer iff the argmax at every answer position is the target token, eos
included.

The result is an HF folder (config.json, model.safetensors, tokenizer.json) cached under
`warmstart.cache_dir/<key>` where key hashes everything that determines it, so the warm start
runs once per machine and later runs (and the tests) reuse it. Writes are atomic (a temporary
folder renamed into place).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from jfp8rl.data.records import Example
from jfp8rl.data.stream import encode_prompts
from models import functional as mf
from models.config import PRESETS, ModelConfig
from models.fp8 import Recipe, get_recipe
from models.hf_io import save_hf
from models.tokenizer import build_byte_tokenizer, eos_token_id, save_tokenizer


def carryless_sum(a: int, b: int) -> int:
    """a + b with every carry dropped: digit i is (a_i + b_i) mod 10 (e.g. 58 + 67 -> 15)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def with_carry_habit(examples: Sequence[Example]) -> list[Example]:
    """The same prompts labelled with the carry-less sum (the base policy's bad habit)."""
    return [
        Example(ex.prompt, str(carryless_sum(ex.meta["a"], ex.meta["b"])), ex.meta)
        for ex in examples
    ]


def supervised_target(ex: Example) -> str:
    """The text the warm start trains on: the scratchpad task's `meta["target"]` (the worked
    steps, then the answer), else the answer itself."""
    return ex.meta["target"] if "target" in ex.meta else ex.answer


def supervised_arrays(
    examples: Sequence[Example], tokenizer: Any, eos_id: int, prompt_len: int, answer_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, attention_mask [N, P + R] (right padded) and target_mask (target + eos)."""
    prompts = encode_prompts(examples, tokenizer, prompt_len)
    n, t = len(examples), prompt_len + answer_len
    tokens = np.full((n, t), eos_id, np.int32)
    attn = np.zeros((n, t), np.int32)
    target = np.zeros((n, t), np.float32)
    for i, (p, ex) in enumerate(zip(prompts, examples, strict=True)):
        a = tokenizer.encode(supervised_target(ex), add_special_tokens=False).ids + [eos_id]
        if len(a) > answer_len:
            raise ValueError(f"answer {ex.answer!r} needs {len(a)} tokens > {answer_len}")
        tokens[i, : len(p)] = p
        tokens[i, len(p) : len(p) + len(a)] = a
        attn[i, : len(p) + len(a)] = 1
        target[i, len(p) : len(p) + len(a)] = 1
    return tokens, attn, target


@functools.partial(jax.jit, static_argnames=("graphdef", "recipe"))
def greedy_correct(
    graphdef: Any,
    params: Any,
    tokens: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    target_mask: Float[Array, "B T"],
    *,
    recipe: Recipe,
) -> Float[Array, " B"]:
    """1.0 where greedy decoding reproduces the target tokens (teacher-forced argmax)."""
    logits = mf.forward(graphdef, params, tokens, attention_mask, recipe=recipe)
    pred = jnp.argmax(logits[:, :-1], axis=-1)
    hit = (pred == tokens[:, 1:]) | (target_mask[:, 1:] == 0)
    return jnp.all(hit, axis=1).astype(jnp.float32)


def _ce_loss(graphdef, params, tokens, attn, target, recipe):
    logp = mf.token_logprobs(graphdef, params, tokens, attn, recipe=recipe)
    return -jnp.sum(logp * target) / jnp.maximum(jnp.sum(target), 1.0)


def _check_split(train: Sequence[Example], n: int, seed: int) -> list[Example]:
    """`n` training problems (a fixed draw) on which the stopping rule measures accuracy, so
    the held-out eval set never selects the base policy."""
    idx = np.random.default_rng(seed + 1).choice(len(train), min(n, len(train)), replace=False)
    return [train[i] for i in idx]


def warm_start(
    cfg: ModelConfig,
    train: Sequence[Example],
    evals: Sequence[Example],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    prompt_len: int,
    answer_len: int,
    carry_noise: float = 0.0,
    target_accuracy: float = 0.0,
    check_every: int = 10,
    recipe: Recipe | None = None,
    log: Any = print,
) -> tuple[Any, Any, dict[str, float]]:
    """Initialises `cfg` and trains it up to `steps` AdamW steps; returns (graphdef, params,
    stats).

    With `target_accuracy` = a > 0 training stops at the first multiple of `check_every` steps
    where the greedy accuracy on 256 training problems (`_check_split`) reaches a. The
    supervised curve of the tiny task has a cliff (greedy accuracy ~0.1 -> ~0.7 within 100
    steps), so a fixed step count lands on different sides of it with tiny numeric differences
    (jax versions); a target accuracy gives the same starting point. `steps` bounds the cost.

    With `carry_noise` = p > 0 each training label is, with probability p, the carry-less sum
    instead of the true one (only problems with a carry differ): the policy learns both answers,
    preferring the wrong one when p > 0.5.
    """
    recipe = recipe or get_recipe("bf16")
    tok = build_byte_tokenizer()
    eos = eos_token_id(tok)
    graphdef, params = mf.init_model(cfg, seed)
    tokens, attn, target = supervised_arrays(train, tok, eos, prompt_len, answer_len)
    noisy = supervised_arrays(with_carry_habit(train), tok, eos, prompt_len, answer_len)

    def accuracy_fn(examples: Sequence[Example]):
        arrays = [
            jnp.asarray(a) for a in supervised_arrays(examples, tok, eos, prompt_len, answer_len)
        ]
        return lambda p: float(jnp.mean(greedy_correct(graphdef, p, *arrays, recipe=recipe)))

    check_acc = accuracy_fn(_check_split(train, 256, seed))
    opt = optax.adamw(optax.linear_schedule(0.0, lr, min(20, steps)))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tok_b, attn_b, tgt_b):
        loss, grads = jax.value_and_grad(
            lambda p: _ce_loss(graphdef, p, tok_b, attn_b, tgt_b, recipe)
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    loss, done, train_acc = float("nan"), 0, float("nan")
    while done < steps:
        idx = rng.integers(0, len(train), batch_size)
        flip = (rng.random(batch_size) < carry_noise)[:, None]
        batch = [
            np.where(flip, b[idx], a[idx])
            for a, b in zip((tokens, attn, target), noisy, strict=True)
        ]
        params, opt_state, loss = step(params, opt_state, *batch)
        done += 1
        if target_accuracy > 0 and done % check_every == 0:
            train_acc = check_acc(params)
            if train_acc >= target_accuracy:
                break
        if log is not None and done % 50 == 0:
            log(f"[warmstart] step {done}/{steps} loss {float(loss):.3f} "
                f"greedy acc (train check) {check_acc(params):.3f}")  # fmt: skip
    acc = accuracy_fn(evals)(params) if evals else float("nan")
    stats = {"loss": float(loss), "accuracy": acc, "steps_run": done}
    if target_accuracy > 0:
        stats["train_check_accuracy"] = train_acc
        if train_acc < target_accuracy and log is not None:
            log(f"[warmstart] warning: target accuracy {target_accuracy} not reached in "
                f"{steps} steps (train check {train_acc:.3f}); raise warmstart.steps")  # fmt: skip
    return graphdef, params, stats


def cache_key(settings: dict[str, Any]) -> str:
    """A short hash of everything that determines the base policy."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def ensure_base_policy(
    cache_dir: str | Path,
    preset: str,
    train: Sequence[Example],
    evals: Sequence[Example],
    *,
    task_tag: str,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    prompt_len: int,
    answer_len: int,
    carry_noise: float = 0.0,
    target_accuracy: float = 0.0,
    log: Any = print,
) -> Path:
    """The HF folder of the warm-started base policy: cached, or trained now and cached."""
    cfg = PRESETS[preset]
    settings = {
        "preset": preset,
        "model": dataclasses.asdict(cfg),
        "task": task_tag,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "prompt_len": prompt_len,
        "answer_len": answer_len,
        "carry_noise": carry_noise,
        "target_accuracy": target_accuracy,
        "version": 3,
    }
    out = Path(cache_dir) / f"{preset}-{cache_key(settings)}"
    if (out / "config.json").is_file() and (out / "warmstart.json").is_file():
        return out
    if log is not None:
        log(f"[warmstart] building the base policy ({steps} supervised steps) -> {out}")
    graphdef, params, stats = warm_start(
        cfg, train, evals, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
        prompt_len=prompt_len, answer_len=answer_len, carry_noise=carry_noise,
        target_accuracy=target_accuracy, log=log,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        tok = build_byte_tokenizer()
        save_hf(tmp, cfg, params, tok)
        save_tokenizer(tok, tmp)
        (tmp / "warmstart.json").write_text(
            json.dumps({**settings, **stats}, indent=2, default=str)
        )
        if out.exists():  # a concurrent builder won; its folder is equivalent
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if log is not None:
        log(f"[warmstart] base policy after {stats['steps_run']} steps: greedy accuracy "
            f"{stats['accuracy']:.3f} (eval set)")  # fmt: skip
    return out
