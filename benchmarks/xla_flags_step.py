"""XLA:CPU flags against the default on a real model's forward+backward, side by side.

    .venv/bin/python benchmarks/xla_flags_step.py --model DIR [--recipe bf16] [--rounds 3] \
        -- "--xla_cpu_prefer_vector_width=512" ...

XLA reads `XLA_FLAGS` once per process, so each variant (the default first, then each argument)
is its own worker process holding its compiled step: the loss and the forward+backward of
`model_step.py --peer torch` (minus the mean token log-prob, chunk 128, f32 compute, the same
random tokens). The workers stay alive and are timed in turns (`--rounds` rounds of `--steps`
passes each, medians), so the machine's load falls on all alike. Prints, per variant,

    xla_flags_step: X.XXXx default (Y.YYY s/step, Z.ZZ CPU s/step, loss L)  FLAGS
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(model: str, recipe_name: str, batch: int, seq: int) -> None:
    """Compiles the step, prints its loss, then times `{"steps": n}` requests from stdin."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from model_step import _jax_step

    from models import fp8
    from models.hf_io import load_hf

    cfg, graphdef, params = load_hf(model, compute_dtype=jnp.float32)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    compiled, loss = _jax_step(graphdef, params, jnp.asarray(tokens), fp8.get_recipe(recipe_name))
    print(json.dumps({"loss": loss}), flush=True)
    for line in sys.stdin:
        steps = json.loads(line)["steps"]
        if steps == 0:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            _, g = compiled(params)
        jax.block_until_ready(g)
        n = float(steps)
        print(json.dumps({"s": (time.perf_counter() - t0) / n, "cpu": (time.process_time() - c0) / n}),
              flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="an HF model folder")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "flags", nargs="*", help="XLA_FLAGS of each variant beside the default (after --)"
    )
    args = ap.parse_args()
    model = str(Path(args.model).expanduser())
    if args.worker:
        worker(model, args.recipe, args.batch, args.seq)
        return
    base = os.environ.get("XLA_FLAGS", "")
    variants = ["", *args.flags]
    procs, losses = {}, {}
    for v in variants:
        cmd = [sys.executable, __file__, "--worker", "--model", model, "--recipe", args.recipe,
               "--batch", str(args.batch), "--seq", str(args.seq)]  # fmt: skip
        env = dict(os.environ, XLA_FLAGS=f"{base} {v}".strip())
        procs[v] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True)  # fmt: skip
        losses[v] = json.loads(procs[v].stdout.readline())["loss"]
    times: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v, p in procs.items():
            p.stdin.write(json.dumps({"steps": args.steps}) + "\n")
            p.stdin.flush()
            times[v].append(json.loads(p.stdout.readline()))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v or 'default'} {t[-1]['s']:.3f} s/step" for v, t in times.items()), flush=True)  # fmt: skip
    for p in procs.values():
        p.stdin.write(json.dumps({"steps": 0}) + "\n")
        p.stdin.close()
        p.wait(timeout=60)
    med = {v: statistics.median(x["s"] for x in t) for v, t in times.items()}
    cpu = {v: statistics.median(x["cpu"] for x in t) for v, t in times.items()}
    print(f"forward+backward, {model}: recipe {args.recipe}, B={args.batch}, T={args.seq}, "
          f"f32 compute, medians of {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    for v in variants:
        print(f"xla_flags_step: {med[''] / med[v]:.3f}x default ({med[v]:.3f} s/step, "
              f"{cpu[v]:.2f} CPU s/step, loss {losses[v]:.6f})  {v or 'default'}")  # fmt: skip


if __name__ == "__main__":
    main()
