"""`python -m rollout_bridge.serve --model <hf_dir>`: the embedded engine behind vLLM's routes.

Routes, wire format and keys: `rollout_bridge.server.http_server`; what a request may ask and
how much memory the server holds: `rollout_bridge.server.limits`. This command loads the HF
folder into an `EmbeddedBackend` and serves it until interrupted. As vLLM, every request
stops at the folder's end-of-turn ids (`models.tokenizer.stop_token_ids`: the tokenizer's eos
and each `eos_token_id` of config.json and generation_config.json) unless it sets
`ignore_eos`, also one that names no `stop_token_ids`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from models.kv_quant import KV_CACHE_DTYPES
from models.tokenizer import load_tokenizer
from rollout_bridge.engine.batching import DEFAULT_MAX_NUM_SEQS
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server.http_server import ServerState, make_server
from rollout_bridge.server.limits import DEFAULT_MAX_PENDING_SEQS, ServerLimits

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_bridge.serve",
        description="Serve the embedded JAX engine behind vLLM's OpenAI-compatible routes.",
        epilog="Beyond loopback (--host 0.0.0.0), give a key: docs/cluster.md.",
    )
    parser.add_argument(
        "--model", required=True, help="HF folder (config.json, safetensors, tokenizer.json)"
    )
    parser.add_argument(
        "--recipe",
        default="fp8_block",
        help="rollout recipe: bf16 | fp8_tensor | fp8_row | fp8_block",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=[os.environ.get("VLLM_API_KEY", "")],
        help="as vLLM: every route but /health then needs 'Authorization: Bearer <one of "
        "them>' (401 otherwise), the weight routes included (default: env VLLM_API_KEY; "
        "none = open). Prefer the environment: arguments are visible to every user of the host",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id in /v1/models (default: --model)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + response in tokens, as vLLM: a longer prompt or a larger "
        "max_tokens is refused (400), a prompt + max_tokens over it gets max_tokens lowered "
        "(default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help="sequences decoded at once, as vLLM; larger requests run in chunks of it, so the "
        f"KV cache holds at most this many (default {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--max-pending-seqs",
        type=int,
        default=DEFAULT_MAX_PENDING_SEQS,
        help="sequences (prompts x n, all requests) held at once, decoding or waiting; a request "
        "that does not fit waits, one that never can is refused with 400 "
        f"(default {DEFAULT_MAX_PENDING_SEQS})",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="compute dtype of activations (auto: the model config's, bfloat16)",
    )
    parser.add_argument(
        "--export-format", default=None, help="format of in-process pushes (default by recipe)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="as vLLM: fp8 stores K/V as E4M3 with per-layer scales, the pushed ones or else "
        "recalibrated at every weight install (docs/rollout.md section 10; default auto)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="as vLLM: each completion choice carries the experts every layer routed each fed "
        "token to (routed_experts, base64 .npy), for routing replay; MoE models only",
    )
    args = parser.parse_args(argv)
    for flag in ("max_model_len", "max_num_seqs", "max_pending_seqs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    keys = [k for k in args.api_key if k]

    overrides = {} if args.dtype == "auto" else {"compute_dtype": args.dtype}
    engine = EmbeddedBackend.from_hf_dir(
        args.model,
        recipe=args.recipe,
        config_overrides=overrides,
        max_len=args.max_model_len,
        export_format=args.export_format,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        record_routing=args.enable_return_routed_experts,
    )
    limits = ServerLimits(max_model_len=engine.max_len, max_pending_seqs=args.max_pending_seqs)
    state = ServerState(
        engine,
        model_name=args.served_model_name or args.model,
        api_keys=keys,
        tokenizer=load_tokenizer(args.model),
        limits=limits,
    )
    server = make_server(state, args.host, args.port)
    print(
        f"rollout_bridge.serve: {args.model} (recipe {engine.recipe.name}) on "
        f"http://{args.host}:{server.server_port}; max_model_len {engine.max_len}, "
        f"max_num_seqs {engine.max_num_seqs}, max_pending_seqs {limits.max_pending_seqs}, "
        f"{'API key required' if keys else 'no API key'}",
        flush=True,
    )
    if not keys and args.host not in _LOOPBACK:
        print(
            f"rollout_bridge.serve: warning: listening on {args.host} without an API key: "
            "anyone who reaches the port can load weights from any folder it can read; set "
            "VLLM_API_KEY (docs/cluster.md)",
            flush=True,
        )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()


if __name__ == "__main__":
    main()
