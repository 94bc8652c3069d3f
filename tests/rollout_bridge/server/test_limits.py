"""`server.limits` and the request parsing of `server.openai_format`, without a server.

The messages are vLLM 0.32's, as a real vLLM answered them (`test_vllm_parity` checks the same
requests against one); the admission queue is checked with threads against its capacity.
"""

from __future__ import annotations

import threading
import time

import pytest

from rollout_bridge.server.limits import Admission, ServerLimits, max_tokens_per_prompt
from rollout_bridge.server.openai_format import ApiError, parse_sampling

LIMITS = ServerLimits(max_model_len=64, max_pending_seqs=100)


def _refusal(fn, *args) -> tuple[int, str, str | None]:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return int(e.value.status), str(e.value), e.value.param


def test_sampling_fields_follow_vllm() -> None:
    assert _refusal(parse_sampling, {"n": 0}) == (400, "n must be at least 1, got 0.", None)
    assert _refusal(parse_sampling, {"n": -1})[1] == "n must be at least 1, got -1."
    assert _refusal(parse_sampling, {"max_tokens": 0}) == (
        400,
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "max_tokens",
    )
    assert _refusal(parse_sampling, {"top_k": -2})[1] == (
        "top_k must be 0 (disable), or at least 1, got -2."
    )
    # ints as vLLM's pydantic models take them: integral floats and integer strings, not 2.5
    assert parse_sampling({"n": "2", "max_tokens": 3.0}).n == 2
    for bad in (2.5, "two", [2], {"n": 2}, True, float("inf")):
        status, message, param = _refusal(parse_sampling, {"n": bad})
        assert (status, param) == (400, "n") and "'n' must be an integer" in message
    assert _refusal(parse_sampling, {"temperature": "hot"})[2] == "temperature"
    assert _refusal(parse_sampling, {"top_p": 0})[0] == 400  # SamplingParams' own check
    assert _refusal(parse_sampling, {"stop_token_ids": [1, "x"]})[0] == 400


def test_max_tokens_follow_vllm_and_the_pending_limit() -> None:
    prompts = [[1] * 10, [2] * 40, [3] * 63]
    # prompt + max_tokens over max_model_len: max_tokens lowered to what is left (vLLM: 200)
    assert max_tokens_per_prompt(prompts, 2, 30, LIMITS) == [30, 24, 1]
    assert _refusal(max_tokens_per_prompt, [[1] * 70], 1, 1, LIMITS) == (
        400,
        "This model's maximum context length is 64 tokens. However, your prompt contains 70 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt. (parameter=input_tokens, value=70)",
        "input_tokens",
    )
    assert _refusal(max_tokens_per_prompt, [[1] * 64], 1, 1, LIMITS)[1] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    assert _refusal(max_tokens_per_prompt, [[1]], 1, 100, LIMITS)[1] == (
        "max_tokens=100 cannot be greater than max_model_len=64. Please request fewer output "
        "tokens. (parameter=max_tokens, value=100)"
    )
    assert max_tokens_per_prompt([[1], [2]], 50, 4, LIMITS) == [4, 4]  # 100 sequences fit
    status, message, param = _refusal(max_tokens_per_prompt, [[1], [2]], 100000, 4, LIMITS)
    assert (status, param) == (400, "n") and "--max-pending-seqs" in message
    assert "200000 sequences (2 prompts x n=100000)" in message


def test_admission_holds_at_most_its_capacity_first_come_first_served() -> None:
    adm = Admission(10)
    peak, order, lock = [0], [], threading.Lock()

    def job(name: str, k: int) -> None:
        adm.acquire(k)
        with lock:
            peak[0] = max(peak[0], adm.held)
            order.append(name)
        time.sleep(0.05)
        adm.release(k)

    adm.acquire(8)  # held until the others queue up
    threads = []
    for name, k in (("a", 6), ("b", 1), ("c", 4)):
        threads.append(threading.Thread(target=job, args=(name, k)))
        threads[-1].start()
        time.sleep(0.05)  # queue in this order
    assert order == []  # "b" would fit next to the 8 but waits its turn behind "a"
    adm.release(8)
    for t in threads:
        t.join(10)
    assert order == ["a", "b", "c"] and peak[0] <= 10 and adm.held == 0
    with pytest.raises(ValueError, match="1..10"):
        adm.acquire(11)
