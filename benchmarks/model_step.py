"""Forward+backward throughput and memory of the decoder under each recipe, and the memory of
chunked `token_logprobs` against the naive full-logits version.

    .venv/bin/python benchmarks/model_step.py [--layers 4 --d 512 --batch 2 --seq 256 --steps 3]
    .venv/bin/python benchmarks/model_step.py --model DIR --peer torch [--batch 4 --seq 256]

Prints tokens/s and XLA's compiled memory estimate (arguments + outputs + temporaries, from
`Compiled.memory_analysis()`) per recipe, as ratios to bf16 measured in the same run, plus the
gradient cosine to bf16. On CPU, FP8 is emulated (quantize -> dequantize -> f32 dot), so the
FP8 recipes are expected to be slower than bf16 here; the numbers that matter are on a GPU.
`fp8_block_pallas` (the Hopper kernel) runs by default on a GPU only; on CPU name it in
`--recipes` to run it through the Mosaic GPU interpreter (a check, not a speed).
The logprobs comparison only compiles (a 152k x 4096 f32 logits block is 2.5 GB per row).

`--model DIR --peer torch`: a real HF folder (f32 compute) against transformers' model of the
same folder (`benchmarks/torch_model_step.py`, in the vLLM venv), the same loss (minus the mean
token log-prob, `token_logprobs` with chunk 128) on the same random tokens, both processes
alive and timed in turns (`--rounds` rounds of `--steps` passes each, medians), so the
machine's load falls on both alike. Prints both losses (they must agree) and

    model_step: jax/torch = X.XXx (bf16 recipe), Y.YYx (fp8_block)

`--model DIR --head-share`: what the vocabulary costs the trainer. The same loss's
forward+backward against the trunk's alone (the final-normed hidden states, no LM head or
log-softmax), both timed in turns, with XLA's compiled memory of each; the difference is the
LM head and chunked log-probs. Prints, per recipe,

    model_step: head share = X% of forward+backward time, Y MiB of Z MiB (V=..., recipe)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import fp8
from models import functional as F
from models.config import ModelConfig

# The registry's recipes, and the block recipe on the Hopper kernel (models/fp8/kernels). Off a
# GPU the kernel runs in the Mosaic GPU interpreter, far too slowly for this model: there it
# runs only when asked (--recipes).
BENCH_RECIPES = {**fp8.RECIPES, "fp8_block_pallas": fp8.get_recipe("fp8_block", backend="pallas")}


def _mem_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    if m is None:
        return -1
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def bench_step(cfg: ModelConfig, batch: int, seq: int, steps: int, recipe_names: list[str]) -> None:
    graphdef, params = F.init_model(cfg, 0)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (batch, seq)), jnp.int32)
    mask = jnp.ones((batch, seq), jnp.int32)
    rows = {}
    grads = {}
    for name in recipe_names:
        recipe = BENCH_RECIPES[name]

        def loss(p, recipe=recipe):
            lp = F.token_logprobs(graphdef, p, tokens, mask, recipe=recipe, chunk_size=128)
            return -lp.mean()

        step = jax.jit(jax.value_and_grad(loss))
        compiled = step.lower(params).compile()
        _, g = compiled(params)
        jax.block_until_ready(g)
        t0 = time.perf_counter()
        for _ in range(steps):
            _, g = compiled(params)
        jax.block_until_ready(g)
        dt = (time.perf_counter() - t0) / steps
        grads[name] = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(g)])
        rows[name] = (batch * seq / dt, _mem_bytes(compiled))
    base_tps, base_mem = rows["bf16"]
    print(
        f"forward+backward, {cfg.num_layers} layers, d={cfg.hidden_size}, V={cfg.vocab_size}, "
        f"B={batch}, T={seq}, compute {cfg.compute_dtype.name}, {jax.default_backend()}"
    )
    print(
        f"{'recipe':<18}{'tokens/s':>12}{'x bf16':>9}{'mem MiB':>10}{'x bf16':>9}{'grad cos':>10}"
    )
    gb = grads["bf16"]
    for name, (tps, mem) in rows.items():
        g = grads[name]
        cos = float(g @ gb / (np.linalg.norm(g) * np.linalg.norm(gb)))
        print(
            f"{name:<18}{tps:>12.1f}{tps / base_tps:>9.2f}{mem / 2**20:>10.1f}"
            f"{mem / base_mem:>9.2f}{cos:>10.5f}"
        )


def _jax_step(graphdef, params, tokens, recipe):
    """The compiled forward+backward of the benchmark's loss and its loss."""
    mask = jnp.ones(tokens.shape, jnp.int32)

    def loss(p):
        return -F.token_logprobs(graphdef, p, tokens, mask, recipe=recipe, chunk_size=128).mean()

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    value, g = compiled(params)
    jax.block_until_ready(g)
    return compiled, float(value)


def bench_against_torch(model: str, batch: int, seq: int, steps: int, rounds: int) -> None:
    from models.hf_io import load_hf

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "rollout_bridge"))
    from bridge_support import ensure_vllm_env

    cfg, graphdef, params = load_hf(model, compute_dtype=jnp.float32)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    progs = {
        name: _jax_step(graphdef, params, jnp.asarray(tokens), fp8.get_recipe(name))
        for name in ("bf16", "fp8_block")
    }
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/tokens.npy", tokens)
        peer = subprocess.Popen(
            [str(ensure_vllm_env() / "bin" / "python"), str(root / "benchmarks" / "torch_model_step.py"),
             "--model", str(model), "--tokens", f"{tmp}/tokens.npy"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

        def ask(msg: dict) -> dict:
            peer.stdin.write(json.dumps(msg) + "\n")
            peer.stdin.flush()
            return json.loads(peer.stdout.readline())

        torch_loss = json.loads(peer.stdout.readline())["loss"]
        times: dict[str, list[float]] = {"torch": [], **{n: [] for n in progs}}
        for r in range(rounds):
            for name, (compiled, _) in progs.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    _, g = compiled(params)
                jax.block_until_ready(g)
                times[name].append((time.perf_counter() - t0) / steps)
            times["torch"].append(ask({"steps": steps})["s_per_step"])
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{k} {v[-1]:.3f} s/step" for k, v in times.items()), flush=True)  # fmt: skip
        peer.stdin.write(json.dumps({"steps": 0}) + "\n")
        peer.stdin.close()
        peer.wait(timeout=60)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"forward+backward, {model}: B={batch}, T={seq}, f32 compute, {jax.default_backend()},"
          f" medians of {rounds} rounds x {steps} steps")  # fmt: skip
    for name, s in med.items():
        loss = torch_loss if name == "torch" else progs[name][1]
        print(f"{name:<12}{s:>9.3f} s/step{1 / s:>9.3f} steps/s   loss {loss:.6f}")
    print(f"model_step: jax/torch = {med['torch'] / med['bf16']:.2f}x (bf16 recipe), "
          f"{med['torch'] / med['fp8_block']:.2f}x (fp8_block)")  # fmt: skip


def bench_head_share(model: str, batch: int, seq: int, steps: int, rounds: int) -> None:
    """The LM head's and log-probs' part of a real model's forward+backward (module doc)."""
    from models.hf_io import load_hf

    cfg, graphdef, params = load_hf(model, compute_dtype=jnp.float32)
    tokens = jnp.asarray(
        np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    )
    mask = jnp.ones(tokens.shape, jnp.int32)
    print(f"forward+backward, {model}: V={cfg.vocab_size}, d={cfg.hidden_size}, "
          f"{cfg.num_layers} layers, B={batch}, T={seq}, f32 compute, {jax.default_backend()}, "
          f"medians of {rounds} rounds x {steps} steps")  # fmt: skip
    for name in ("bf16", "fp8_block"):
        recipe = fp8.get_recipe(name)

        def whole(p, recipe=recipe):
            return -F.token_logprobs(
                graphdef, p, tokens, mask, recipe=recipe, chunk_size=128
            ).mean()

        def trunk(p, recipe=recipe):
            h = F.hidden_states(graphdef, p, tokens, mask, recipe=recipe)
            return h.astype(jnp.float32).mean()

        progs = {k: jax.jit(jax.value_and_grad(f)).lower(params).compile()
                 for k, f in (("whole", whole), ("trunk", trunk))}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in progs}
        for _ in range(rounds):
            for k, compiled in progs.items():
                jax.block_until_ready(compiled(params))  # this round's first: not timed
                t0 = time.perf_counter()
                for _ in range(steps):
                    out = compiled(params)
                jax.block_until_ready(out)
                times[k].append((time.perf_counter() - t0) / steps)
        med = {k: float(np.median(v)) for k, v in times.items()}
        mem = {k: _mem_bytes(c) for k, c in progs.items()}
        share = (med["whole"] - med["trunk"]) / med["whole"]
        print(f"{name:<10} whole {med['whole']:.3f} s/step {mem['whole'] / 2**20:.0f} MiB, "
              f"trunk {med['trunk']:.3f} s/step {mem['trunk'] / 2**20:.0f} MiB")  # fmt: skip
        print(f"model_step: head share = {100 * share:.0f}% of forward+backward time, "
              f"{(mem['whole'] - mem['trunk']) / 2**20:.0f} MiB of {mem['whole'] / 2**20:.0f} MiB "
              f"(V={cfg.vocab_size}, {name})", flush=True)  # fmt: skip


def bench_logprobs_memory(vocab: int, seq: int, d: int, chunk: int) -> None:
    cfg = ModelConfig(
        arch="qwen3",
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=2 * d,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=d // 4,
        qk_norm=True,
        tie_word_embeddings=True,
    )
    graphdef, params = F.abstract_model(cfg)
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def chunked(p, tok, m):
        return F.token_logprobs(graphdef, p, tok, m, recipe=fp8.BF16, chunk_size=chunk).sum()

    def naive(p, tok, m):
        z = F.forward(graphdef, p, tok, m, recipe=fp8.BF16)
        logp = jax.nn.log_softmax(z[:, :-1], -1)
        return jnp.take_along_axis(logp, tok[:, 1:, None], -1).sum()

    def trunk_only(p, tok, m):
        # Baseline without the LM head: attention (O(T^2) scores here) and the embedding.
        return F.hidden_states(graphdef, p, tok, m, recipe=fp8.BF16).astype(jnp.float32).sum()

    print(f"\ntoken_logprobs forward+backward memory, V={vocab}, T={seq}, d={d}, chunk={chunk}")
    mems = {}
    for name, fn in (("naive", naive), ("chunked", chunked), ("no head", trunk_only)):
        compiled = jax.jit(jax.value_and_grad(fn)).lower(params, tokens, mask).compile()
        mems[name] = _mem_bytes(compiled)
    base = mems["no head"]
    for name, mem in mems.items():
        print(
            f"{name:<12}{mem / 2**20:>10.1f} MiB{mem / mems['naive']:>9.3f} x naive"
            f"   head part {(mem - base) / 2**20:>9.1f} MiB"
        )
    print(f"(one f32 [T, V] block is {seq * vocab * 4 / 2**20:.1f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an HF folder: time it against --peer (f32 compute)")
    ap.add_argument("--peer", choices=["torch"], default="torch")
    ap.add_argument("--rounds", type=int, default=3, help="--model: alternating rounds")
    ap.add_argument(
        "--head-share", action="store_true",
        help="--model: the LM head's part of forward+backward time and memory (no peer)",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--recipes",
        nargs="*",
        choices=list(BENCH_RECIPES),
        help="default: all; fp8_block_pallas only on a GPU (bf16 always runs: the baseline)",
    )
    ap.add_argument("--lp-vocab", type=int, default=151936)
    ap.add_argument("--lp-seq", type=int, default=4096)
    ap.add_argument("--lp-chunk", type=int, default=256)
    args = ap.parse_args()
    if args.model and args.head_share:
        bench_head_share(args.model, args.batch, args.seq, args.steps, args.rounds)
        return
    if args.model:
        bench_against_torch(args.model, args.batch, args.seq, args.steps, args.rounds)
        return
    cfg = ModelConfig(
        arch="qwen3",
        vocab_size=args.vocab,
        hidden_size=args.d,
        intermediate_size=3 * args.d,
        num_layers=args.layers,
        num_heads=args.d // 64,
        num_kv_heads=max(1, args.d // 128),
        head_dim=64,
        qk_norm=True,
        compute_dtype=jnp.bfloat16,
    )
    names = args.recipes or [
        n for n in BENCH_RECIPES if jax.default_backend() == "gpu" or n != "fp8_block_pallas"
    ]
    names = ["bf16", *(n for n in names if n != "bf16")]
    bench_step(cfg, args.batch, args.seq, args.steps, names)
    bench_logprobs_memory(args.lp_vocab, args.lp_seq, 256, args.lp_chunk)


if __name__ == "__main__":
    main()
