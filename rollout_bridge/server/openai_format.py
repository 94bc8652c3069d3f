"""vLLM 0.32's OpenAI-compatible JSON, built and parsed: the wire format of our server.

Pure functions (no HTTP, no engine calls): a `/v1/completions` request body -> validated
`CompletionRequest`; engine `Completion`s (+ prompt scores) -> the response body; the
`/v1/models` body; vLLM's error body `{"error": {"message", "type", "param", "code"}}`.
Key order, values and defaults follow a real vLLM, field by field
(`tests/rollout_bridge/server/test_vllm_parity.py` compares the two servers' JSON).

Text fields need a `tokenizers.Tokenizer`; without one (`tokenizer=None`) text is "" and
tokens are reported as "token_id:<id>".
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import numpy as np
from tokenizers.decoders import DecodeStream

from rollout_bridge.backend import Completion, SamplingParams, encode_routed_experts

SEED_INDICES = "jfp8rl_seed_indices"  # request extension field (CompletionRequest)
LOGPROB_CLAMP = -9999.0  # vLLM's floor for -inf
_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy (and then refuses n > 1)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}


class ApiError(Exception):
    """An error answered to the client as vLLM does: HTTP status + {"error": {...}}."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def invalid(message: str, param: str | None = None, value: Any = None) -> ApiError:
    """A 400 worded as vLLM's validation errors: with `param`, the message ends in
    "(parameter=<param>, value=<value>)" and the body's `param` names the field."""
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    return ApiError(HTTPStatus.BAD_REQUEST, message, param)


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body; `type` is the OpenAI error class name for the status."""
    kind = _ERROR_TYPES.get(int(status), status.phrase.replace(" ", ""))
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


# -- text ------------------------------------------------------------------------------------


def decode(tokenizer: Any, ids: Sequence[int], skip_special: bool) -> str:
    """One token (or a few) as text, e.g. `decoded_token` ("" without a tokenizer)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def detokenize(
    tokenizer: Any, prompt: Sequence[int], ids: Sequence[int], skip_special: bool
) -> str:
    """A response's `text` as vLLM's incremental detokenizer builds it: a
    `tokenizers.decoders.DecodeStream` primed with the prompt, one step per token, so
    bytes of an unfinished UTF-8 character are held back (and dropped at the end)."""
    if tokenizer is None:
        return ""
    try:
        stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special)
    except TypeError:  # tokenizers < 0.22 has no `ids` priming
        stream = DecodeStream(skip_special_tokens=skip_special)
    parts = []
    for t in ids:
        try:
            parts.append(stream.step(tokenizer, int(t)) or "")
        except Exception:  # noqa: BLE001 (vLLM resets the stream on invalid UTF-8 prefixes)
            stream = DecodeStream(skip_special_tokens=skip_special)
    return "".join(parts)


def token_str(tokenizer: Any, tid: int, as_ids: bool) -> str:
    """A token as `logprobs.tokens` reports it: "token_id:<id>" or its decoded text."""
    return f"token_id:{tid}" if as_ids or tokenizer is None else decode(tokenizer, [tid], False)


# -- request ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` request."""

    prompts: list[list[int]]  # token ids, one list per prompt
    sampling: SamplingParams
    as_ids: bool  # return_tokens_as_token_ids: tokens reported as "token_id:<id>"
    with_ids: bool  # return_token_ids: choices carry token_ids / prompt_token_ids
    skip_special: bool  # skip_special_tokens when building `text`
    want_logprobs: bool  # `logprobs` given (only 0 is served)
    want_prompt_logprobs: bool  # `prompt_logprobs` given (only 0 is served)
    # `jfp8rl_seed_indices` (our extension; vLLM accepts and ignores unknown fields, and its
    # samples depend on the seed alone): the index each prompt's samples are seeded with.
    seed_indices: list[int] | None = None


def _int_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    ):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{what} must be a list of token ids (ints)")
    return list(x)


def parse_prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """`prompt`: token ids, a list of token-id lists, a string or a list of strings."""
    p = body.get("prompt")
    if isinstance(p, str):
        p = [p]
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return [_int_list(p, "prompt")]
    if not isinstance(p, list) or not p:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'prompt' must be token ids or a non-empty list")
    out = []
    for i, item in enumerate(p):
        if isinstance(item, str):
            if tokenizer is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, "text prompts need a tokenizer; send ids")
            out.append(tokenizer.encode(item).ids)
        else:
            out.append(_int_list(item, f"prompt[{i}]"))
    return out


def _number(body: dict[str, Any], name: str, default: Any, kind: type) -> Any:
    """Field `name` as an int (kind int: ints, integral floats and integer strings, as
    vLLM's pydantic models take them) or a finite float; `default` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    try:
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise ValueError(v)
        if kind is float:
            x = float(v)
        elif isinstance(v, float):
            if not v.is_integer():
                raise ValueError(v)
            x = int(v)
        else:
            x = int(v)
        if kind is float and not math.isfinite(x):
            raise ValueError(v)
    except (ValueError, OverflowError) as e:
        what = "an integer" if kind is int else "a finite number"
        raise ApiError(
            HTTPStatus.BAD_REQUEST, f"'{name}' must be {what}, got {str(v)[:40]!r}", param=name
        ) from e
    return x


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    """The sampling fields with vLLM's defaults and its messages for n < 1 and max_tokens < 1;
    refuses what the engine does not serve. Limits that depend on the server (max_model_len,
    how many sequences it holds) are `rollout_bridge.server.limits`."""
    for field in ("logprobs", "prompt_logprobs"):
        k = body.get(field)
        if k is not None and k != 0:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"'{field}': {str(k)[:40]} is not served by rollout_bridge.serve; use 0 (the "
                "chosen token's logprob only)",
            )
    if body.get("stream"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stream': true is not supported; use false")
    n = _number(body, "n", 1, int)
    max_tokens = _number(body, "max_tokens", 16, int)
    temperature = _number(body, "temperature", 1.0, float)
    if n < 1:
        raise invalid(f"n must be at least 1, got {n}.")
    if max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if n != 1 and temperature < _GREEDY_EPS:
        raise invalid(f"n must be 1 when using greedy sampling, got {n}.")
    top_k = _number(body, "top_k", -1, int)
    if top_k < -1:
        raise invalid(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    seed = _number(body, "seed", None, int)
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=_number(body, "top_p", 1.0, float),
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except ValueError as e:  # SamplingParams' own checks (temperature, top_p)
        raise ApiError(HTTPStatus.BAD_REQUEST, f"bad sampling parameter: {e}") from e


def parse_completion_request(
    body: dict[str, Any], *, model_name: str, tokenizer: Any
) -> CompletionRequest:
    """Validates a `/v1/completions` body (model, prompts, sampling, output flags);
    raises `ApiError` (404 for another model, 400 otherwise) naming the field."""
    if body.get("model") not in (None, model_name):
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"The model `{body.get('model')}` does not exist; this server serves "
            f"`{model_name}` (GET /v1/models)",
            param="model",
        )
    prompts = parse_prompts(body, tokenizer)
    sampling = parse_sampling(body)
    seed_indices = body.get(SEED_INDICES)
    if seed_indices is not None:
        seed_indices = _int_list(seed_indices, SEED_INDICES)
        if len(seed_indices) != len(prompts):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"'{SEED_INDICES}' has {len(seed_indices)} entries for {len(prompts)} prompts",
                param=SEED_INDICES,
            )
    return CompletionRequest(
        prompts=prompts,
        sampling=sampling,
        as_ids=bool(body.get("return_tokens_as_token_ids", False)),
        with_ids=bool(body.get("return_token_ids", False)),
        skip_special=bool(body.get("skip_special_tokens", True)),
        want_logprobs=body.get("logprobs") is not None,
        want_prompt_logprobs=body.get("prompt_logprobs") is not None,
        seed_indices=seed_indices,
    )


# -- response --------------------------------------------------------------------------------


def _logprobs_entry(tokenizer: Any, ids: list[int], logprobs: np.ndarray, as_ids: bool) -> dict:
    """A choice's `logprobs` for `logprobs: 0`: each sampled token's own logprob, floored at
    `LOGPROB_CLAMP`, with `text_offset` advancing by the length of each reported token string
    (as vLLM's do)."""
    lps = [max(float(x), LOGPROB_CLAMP) for x in logprobs]
    toks = [token_str(tokenizer, t, as_ids) for t in ids]
    offsets, pos = [], 0
    for tok in toks:
        offsets.append(pos)
        pos += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": lps,
        "tokens": toks,
        "top_logprobs": [{s: v} for s, v in zip(toks, lps, strict=True)],
    }


def _prompt_logprobs_entry(
    tokenizer: Any, prompt_ids: Sequence[int], lp: np.ndarray, rank: np.ndarray
) -> list[Any]:
    """A choice's `prompt_logprobs` for `prompt_logprobs: 0`: None for the first token, then
    {str(id): {"logprob", "rank", "decoded_token"}} per prompt token."""
    entries: list[Any] = [None]
    for t in range(1, len(prompt_ids)):
        tid = prompt_ids[t]
        entries.append(
            {
                str(tid): {
                    "logprob": max(float(lp[t]), LOGPROB_CLAMP),
                    "rank": int(rank[t]),
                    # vLLM decodes here even with return_tokens_as_token_ids.
                    "decoded_token": decode(tokenizer, [tid], False),
                }
            }
        )
    return entries


def completion_body(
    req: CompletionRequest,
    results: Sequence[Completion],
    scored: Sequence[tuple[np.ndarray, np.ndarray]] | None,
    *,
    model_name: str,
    tokenizer: Any,
) -> dict[str, Any]:
    """The `/v1/completions` response: one choice per completion (prompt-major), `scored` the
    engine's (logprob, rank) per prompt when prompt logprobs were asked for."""
    stop_set = set(req.sampling.stop_token_ids)
    choices = []
    for k, c in enumerate(results):
        ids = [int(t) for t in c.response_ids]
        last = ids[-1] if ids else None
        choice: dict[str, Any] = {
            "index": k,
            "text": detokenize(tokenizer, c.prompt_ids, ids, req.skip_special),
            "logprobs": None,
            "finish_reason": c.finish_reason,
            # vLLM: the stop token id when a stop_token_ids entry ended it; None for eos.
            "stop_reason": last if c.finish_reason == "stop" and last in stop_set else None,
            "token_ids": ids if req.with_ids else None,
            "prompt_token_ids": list(c.prompt_ids) if req.with_ids else None,
            "prompt_logprobs": None,
            # vLLM's --enable-return-routed-experts field (`rollout_bridge.serve` flag of the
            # same name): the experts of every fed token, base64 .npy.
            "routed_experts": (
                None if c.routed_experts is None else encode_routed_experts(c.routed_experts)
            ),
        }
        if req.want_logprobs:
            choice["logprobs"] = _logprobs_entry(tokenizer, ids, c.logprobs, req.as_ids)
        if scored is not None:
            lp, rank = scored[c.prompt_index]
            choice["prompt_logprobs"] = _prompt_logprobs_entry(tokenizer, c.prompt_ids, lp, rank)
        choices.append(choice)
    n_prompt = sum(len(p) for p in req.prompts) * req.sampling.n
    n_out = sum(len(c.response_ids) for c in results)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": "rollout_bridge",
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def models_body(model_name: str, max_model_len: int) -> dict[str, Any]:
    """The `/v1/models` body: one model entry with vLLM's permission record."""
    now = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    entry = {
        "id": model_name,
        "object": "model",
        "created": now,
        "owned_by": "rollout_bridge",
        "root": model_name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [entry]}
