"""Where one `generate` (or `score`) call of the embedded engine spends its time: XLA:CPU's own
op timings.

Loads an HF folder (e.g. scripts/get_smollm2.sh's) with f32 compute under one rollout recipe,
runs `--batch` prompts of `--prompt-len`/2..`--prompt-len` random tokens x `--new-tokens` new
tokens (temperature 1, ignore_eos) once to compile, once timed, then once under
`jax.profiler`, and sums the profiler's per-op events by what the op is: its kind (a GEMM is a
`ynn_fusion` dot_general, a copy a `*copy*` / `dynamic-slice` fusion, ...), its output shape and
the JAX primitive it came from (read from the compiled program's HLO, dumped for the purpose).
The sums are thread seconds (two threads on a 2-core machine: they add up to more than the
wall time); the prefill's GEMMs have the prompt rows x length as their first dimension, the
decode loop's the rows alone. `--score` profiles the teacher-forced scoring of the prompts ++
`--new-tokens` random tokens instead (the `score_logprobs` program). The last line sums the
ops whose output has the vocabulary's size (the LM head, log-softmax, sampling): what the
vocabulary costs a call.

    .venv/bin/python benchmarks/profile_generate.py --model DIR [--recipe fp8_block]
        [--batch 36] [--prompt-len 48] [--new-tokens 64] [--top 30] [--score]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path


def _hlo_ops(dump_dir: Path, program: str) -> dict[str, str]:
    """Instruction name -> "kind shape primitive" of the compiled `program`."""
    files = sorted(dump_dir.glob(f"*{program}.cpu_after_optimizations.txt"))
    ops: dict[str, str] = {}
    for line in files[-1].read_text().splitlines() if files else []:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) [\w\-]+\(", line)
        if m:
            prim = re.search(r'op_name="([^"]*)"', line)
            kind = re.sub(r"\.\d+$", "", m.group(1))
            tail = prim.group(1).split("/")[-1] if prim else ""
            ops[m.group(1)] = f"{kind} {m.group(2).split('{')[0]} {tail}"
    return ops


def _op_seconds(trace_dir: Path) -> tuple[collections.Counter, collections.Counter]:
    """Thread seconds and call counts per op name, from the XLA:CPU thread lines of a trace."""
    import jax

    (pb,) = trace_dir.glob("**/*.xplane.pb")
    secs: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(str(pb)).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):
                continue
            for ev in line.events:
                if ev.name != "ThunkExecutor::Execute":
                    secs[ev.name] += ev.duration_ns / 1e9
                    calls[ev.name] += 1
    return secs, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an HF model folder")
    parser.add_argument("--recipe", default="fp8_block")
    parser.add_argument("--batch", type=int, default=36)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--score", action="store_true", help="profile a score call instead")
    args = parser.parse_args()
    program = "score_logprobs" if args.score else "generate_rows"
    dump = Path(tempfile.mkdtemp(prefix="jfp8rl-hlo-"))
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*{program}.*"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rollout_bridge.backend import SamplingParams
    from rollout_bridge.engine.embedded import EmbeddedBackend

    engine = EmbeddedBackend.from_hf_dir(
        Path(args.model).expanduser(),
        recipe=args.recipe,
        config_overrides={"compute_dtype": jnp.float32},
        max_len=1024,
    )
    rng = np.random.default_rng(0)
    lo = max(1, args.prompt_len // 2)
    prompts = [
        rng.integers(32, 127, size=int(rng.integers(lo, args.prompt_len + 1))).tolist()
        for _ in range(args.batch)
    ]

    seqs = [p + rng.integers(0, engine.cfg.vocab_size, args.new_tokens).tolist() for p in prompts]

    def call(seed: int) -> float:
        sp = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=seed, ignore_eos=True)
        t0 = time.perf_counter()
        engine.score(seqs) if args.score else engine.generate(prompts, sp)
        return time.perf_counter() - t0

    print(f"compile + first call {call(0):.2f} s; timed call {call(1):.2f} s", flush=True)
    trace = Path(tempfile.mkdtemp(prefix="jfp8rl-trace-"))
    jax.profiler.start_trace(str(trace))
    wall = call(2)
    jax.profiler.stop_trace()
    secs, calls = _op_seconds(trace)
    ops = _hlo_ops(dump, program)
    by_what: collections.Counter = collections.Counter()
    n_what: collections.Counter = collections.Counter()
    for name, s in secs.items():
        what = ops.get(name, name)
        by_what[what] += s
        n_what[what] += calls[name]
    print(f"profiled call {wall:.2f} s wall, {sum(secs.values()):.2f} thread s in XLA ops")
    print(f"{'thread s':>9} {'calls':>7}  op kind, output shape, primitive")
    for what, s in by_what.most_common(args.top):
        print(f"{s:9.3f} {n_what[what]:7d}  {what}")
    vocab = engine.cfg.vocab_size
    head = sum(s for what, s in by_what.items() if re.search(rf"\b{vocab}\b", what))
    total = sum(by_what.values())
    print(f"profile_generate: ops with a vocabulary-sized output (V={vocab}: LM head, "
          f"log-softmax, sampling) {head:.2f} of {total:.2f} thread s ({100 * head / total:.0f}%)")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
