"""`python -m rollout_bridge.serve --model <hf_dir>`: the embedded engine behind vLLM's routes.

Routes, wire format and security: `rollout_bridge.server.http_server`. This command loads the
HF folder into an `EmbeddedBackend` and serves it until interrupted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from models.tokenizer import load_tokenizer
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server.http_server import ServerState, make_server


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_bridge.serve",
        description="Serve the embedded JAX engine behind vLLM's OpenAI-compatible routes.",
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
        "--token",
        default=os.environ.get("JFP8RL_SERVE_TOKEN"),
        help="bearer token (default: env JFP8RL_SERVE_TOKEN; none = open)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id in /v1/models (default: --model)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + response")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="compute dtype of activations (auto: the model config's, bfloat16)",
    )
    parser.add_argument(
        "--export-format", default=None, help="format of in-process pushes (default by recipe)"
    )
    args = parser.parse_args(argv)

    overrides = {} if args.dtype == "auto" else {"compute_dtype": args.dtype}
    engine = EmbeddedBackend.from_hf_dir(
        args.model,
        recipe=args.recipe,
        config_overrides=overrides,
        max_len=args.max_model_len,
        export_format=args.export_format,
    )
    state = ServerState(
        engine,
        model_name=args.served_model_name or args.model,
        token=args.token,
        tokenizer=load_tokenizer(args.model),
    )
    server = make_server(state, args.host, args.port)
    print(
        f"rollout_bridge.serve: {args.model} (recipe {engine.recipe.name}) on "
        f"http://{args.host}:{server.server_port}",
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
