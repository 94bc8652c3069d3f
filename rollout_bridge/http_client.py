"""`HttpBackend`: a `RolloutBackend` talking to a vLLM-compatible server over HTTP.

The same client talks to a real vLLM (ROLLOUT.md section 5) and to `python -m
rollout_bridge.serve`. Only the stdlib (`urllib.request`) is used; JSON only, never pickle.
Every request carries `Authorization: Bearer <token>` when a token is given.

Exact requests sent and fields read (the server contract; ROLLOUT.md sections 2 and 3):

`GET /health` -> 200 (body ignored). `GET /v1/models` -> reads `data[0].id` (the model name
sent in completions requests) and `data[0].max_model_len` (optional).

`POST /v1/completions` (generate), body:
    {"model": <data[0].id>, "prompt": [[int, ...], ...], "n": int, "max_tokens": int,
     "temperature": float, "top_p": float, "top_k": int (-1 = off), "seed": int (omitted if None),
     "logprobs": 0, "return_token_ids": true, "return_tokens_as_token_ids": true,
     "ignore_eos": bool, "stop_token_ids": [int, ...], "skip_special_tokens": false,
     "include_stop_str_in_output": true}
  reads: `choices` (exactly n * len(prompts) entries, prompt-major: prompt i sample j at
  position i * n + j; the `index` field must equal that position), and per choice:
  `token_ids` [int], `logprobs.token_logprobs` [float] (same length as token_ids),
  `finish_reason` ("stop" | "length"; "abort" or anything else is an error).
  `prompt_token_ids`, when present, must equal the prompt sent.

`POST /v1/completions` (score, teacher forced), body:
    {"model": ..., "prompt": [[int, ...], ...], "n": 1, "max_tokens": 1, "temperature": 1.0,
     "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": true,
     "return_tokens_as_token_ids": true}
  reads per choice i: `prompt_logprobs` = [null, {"<id>": {"logprob": float, "rank": int,
  "decoded_token": str}}, ...] (len = len(prompt i)); entry t must contain the key
  str(prompt[i][t]) (more keys = top-k alternatives, ignored). Entry 0 is reported as 0.0.

Weight push (vLLM 0.32 routes, need VLLM_SERVER_DEV_MODE=1 on vLLM):
  1. `POST /pause?mode=wait` (no body)
  2. once per client/server: `POST /init_weight_transfer_engine` {"init_info": {"root": <dir>}}
  3. `POST /start_weight_update` (no body or {})
  4. `POST /update_weights` {"update_info": {"path": <export dir>, "version": <str>,
       "manifest_sha256": <sha256 hex of manifest.json>}}
     The server loads `<path>` through `rollout_bridge.export.load_export(path)` (verifies the
     manifest's per-file sha256 and version; refuses a mismatch with HTTP 4xx/5xx).
  5. `POST /finish_weight_update` {"weight_version": <str>}
  6. `POST /resume` (no body)
  7. `GET /weight_info` -> reads `weight_version` (must equal the pushed version).
  Any non-2xx answer to 1-6 raises `RolloutError`; after a failure in 3-5 the client still
  sends `/resume` so the server is not left paused.

Errors: connection refused / reset / timeouts and HTTP 502/503/504 are retried with exponential
backoff (bounded attempts); everything else, and the last failure, raises `RolloutError`
naming the URL and how to start the server. NaN logprobs, logprobs <= -9999 (vLLM's clamp),
length mismatches between token_ids and logprobs and wrong choice counts are errors.
"""
