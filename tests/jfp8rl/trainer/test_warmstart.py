"""The warm start: carry-less labels by hand, the stop at the accuracy target, the scratchpad's
supervised arrays."""

from __future__ import annotations

from jfp8rl.data.tasks import arithmetic_prompt
from jfp8rl.trainer.warmstart import carryless_sum, with_carry_habit


def test_carryless_sum_by_hand() -> None:
    assert carryless_sum(58, 67) == 15  # 8+7=15 -> 5, 5+6=11 -> 1
    assert carryless_sum(45, 32) == 77  # no carry: the true sum
    assert carryless_sum(99, 1) == 90
    assert carryless_sum(5, 5) == 0
    ex = with_carry_habit([arithmetic_prompt(58, 67, 2), arithmetic_prompt(12, 30, 2)])
    assert [(e.prompt, e.answer) for e in ex] == [("58+67=", "15"), ("12+30=", "42")]


def test_warm_start_stops_at_the_first_check_reaching_the_target() -> None:
    """The rule: stop at the first multiple of check_every whose train-check accuracy reaches
    the target. Reference: the same (deterministic) run without a target, measured at every
    check point by hand."""
    import jax.numpy as jnp

    from jfp8rl.data.stream import build_datasets
    from jfp8rl.trainer.warmstart import (
        _check_split,
        greedy_correct,
        supervised_arrays,
        warm_start,
    )
    from models.config import PRESETS
    from models.fp8 import get_recipe
    from models.tokenizer import build_byte_tokenizer, eos_token_id

    train, evals = build_datasets("arithmetic", "", "", 1, 16)
    cfg = PRESETS["tiny_arith"]
    kw = dict(batch_size=32, lr=3e-3, seed=0, prompt_len=8, answer_len=6, log=None)
    tok = build_byte_tokenizer()
    check = [
        jnp.asarray(a)
        for a in supervised_arrays(_check_split(train, 256, 0), tok, eos_token_id(tok), 8, 6)
    ]
    curve = []
    for steps in (10, 20, 30):
        graphdef, params, _ = warm_start(cfg, train, evals, steps=steps, **kw)
        curve.append(
            float(jnp.mean(greedy_correct(graphdef, params, *check, recipe=get_recipe("bf16"))))
        )
    target = max(curve[1:])  # reached first at a later check, not at the first
    first = curve.index(target)
    assert first > 0 and target > 0, curve
    _, _, stats = warm_start(
        cfg, train, evals, steps=30, target_accuracy=target, check_every=10, **kw
    )
    assert stats["steps_run"] == 10 * (first + 1)
    assert stats["train_check_accuracy"] == curve[first]


def test_supervised_arrays_train_on_the_scratchpad() -> None:
    """The scratchpad task's warm-start target is the worked steps then the answer, + eos."""
    from jfp8rl.data.tasks import scratchpad_prompt
    from jfp8rl.trainer.warmstart import supervised_arrays
    from models.tokenizer import build_byte_tokenizer, eos_token_id

    tok = build_byte_tokenizer()
    eos = eos_token_id(tok)
    ex = scratchpad_prompt(123, 459, 3)
    tokens, attn, target = supervised_arrays([ex], tok, eos, 8, 40)
    want = list(b"123+459=3+9+0=12;2+5+1=08;1+4+0=05;#0582") + [eos]
    assert tokens[0, : len(want)].tolist() == want
    assert attn[0].sum() == len(want)
    assert target[0].tolist() == [0.0] * 8 + [1.0] * 33 + [0.0] * (48 - 41)
