"""Token-budget micro-batches against fixed ones on a long-tailed (lognormal) length mix.

Two parts, side by side in one run:

* plan (no model, up to 16K tokens): a mini-batch of sequences with lognormal response lengths
  (median `--median`, sigma `--sigma`, capped at the generation budget) behind prompts of
  `--prompt` tokens, as `train.micro_batch_size` packs it (every row padded to T = prompt +
  budget) and as `train.max_tokens_per_micro_batch` packs it (`--budget` tokens per device over
  `--ranks` devices, `--buckets` bucket lengths). Printed: micro-batches, the share of computed
  tokens that are padding, computed tokens against fixed (what the update's GEMMs scale with;
  attention grows faster with length, so the time ratio is lower still) and the shapes compiled.
* measured (CPU, a small model): the same comparison at T = `--cpu-tokens` on one device, the
  real jitted update (`jfp8rl.trainer.step`, BF16 recipe, f32 compute) of one mini-batch,
  fixed micro-batches of `--cpu-micro` sequences against a budget of `--cpu-micro` x T tokens
  (the same activation memory): padding share and median update seconds, runs interleaved so
  load from other jobs hits both alike.

    python benchmarks/token_budget.py [--n 256] [--ranks 8] [--budget 16384] [--cpu-n 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.parallel.mesh import make_mesh, put_batch, replicated_layout
from jfp8rl.trainer.forward import UPDATE_INPUTS, present
from jfp8rl.trainer.microbatch import length_buckets, pack_token_budget, padding_share
from jfp8rl.trainer.optimizer import OptimSettings
from jfp8rl.trainer.step import make_step_fns
from jfp8rl.trainer.step_settings import default_settings
from losses.calibrated import CalibConfig, init_calib_state
from losses.registry import get_algorithm
from models import functional as mf
from models.config import get_config


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> np.ndarray:
    """n response lengths, lognormal around `median`, in [1, cap] (the cap: truncation)."""
    x = np.random.default_rng(seed).lognormal(np.log(median), sigma, size=n)
    return np.clip(np.round(x), 1, cap).astype(np.int64)


def fixed_padding(lengths: np.ndarray, seq_len: int) -> float:
    """Fixed micro-batches pad every row to the full sequence length."""
    return 1.0 - lengths.sum() / (lengths.size * seq_len)


def plan_part(a: argparse.Namespace) -> None:
    seq_len = a.prompt + a.max_tokens
    lengths = a.prompt + lognormal_lengths(a.n, a.median, a.sigma, a.max_tokens, seed=0)
    fixed_micro = a.ranks * (a.budget // seq_len)
    print(f"plan: {a.n} sequences of T = {seq_len}: prompt {a.prompt} + lognormal response "
          f"(median {a.median}, sigma {a.sigma}, cap {a.max_tokens}; mean length "
          f"{lengths.mean():.0f}, {np.mean(lengths == seq_len):.1%} at the cap); {a.ranks} ranks, "
          f"{a.budget} tokens per device")  # fmt: skip
    print("| packing | buckets | micro-batches | padding share | computed tokens x fixed |")
    print("|---|---|---|---|---|")
    fixed_tokens = a.n * seq_len
    print(f"| fixed, {fixed_micro} sequences | 1 | {-(-a.n // fixed_micro)} | "
          f"{fixed_padding(lengths, seq_len):.1%} | 1.00 |")  # fmt: skip
    for n_buckets in a.buckets:
        buckets = length_buckets(seq_len, n_buckets)
        p = pack_token_budget(lengths, a.budget, a.ranks, buckets)
        tokens = sum(m.rows.size * m.length for m in p)
        used = sorted({m.length for m in p})
        print(f"| token budget | {len(used)} of {len(buckets)}: {', '.join(map(str, used))} | "
              f"{len(p)} | {padding_share(p, lengths):.1%} | {tokens / fixed_tokens:.2f} |")  # fmt: skip


def cpu_batch(a: argparse.Namespace) -> tuple[dict[str, np.ndarray], int, int]:
    """A packed batch ([N, P + R] right padded) with lognormal response lengths."""
    p_len, r_len = a.cpu_prompt, a.cpu_tokens - a.cpu_prompt
    rng = np.random.default_rng(1)
    rlen = lognormal_lengths(a.cpu_n, a.cpu_median, a.sigma, r_len, seed=1)
    n, t = a.cpu_n, p_len + r_len
    attn = (np.arange(t)[None, :] < (p_len + rlen)[:, None]).astype(np.int32)
    resp = (np.arange(r_len)[None, :] < rlen[:, None]).astype(np.float32)
    batch = {
        "tokens": rng.integers(0, 256, size=(n, t)).astype(np.int32) * attn,
        "attention_mask": attn,
        "prompt_lens": np.full(n, p_len, np.int32),
        "response_mask": resp,
        "rollout_logp": (-rng.uniform(0.5, 8.0, size=(n, r_len)) * resp).astype(np.float32),
        "rewards": rng.integers(0, 2, size=n).astype(np.float32),
        "response_lens": rlen.astype(np.int32),
    }
    return batch, p_len, r_len


def cpu_part(a: argparse.Namespace) -> None:
    cfg = get_config("tiny_qwen3", compute_dtype=jnp.float32, num_layers=a.cpu_layers,
                     hidden_size=a.cpu_hidden, intermediate_size=2 * a.cpu_hidden)  # fmt: skip
    graphdef, params = mf.init_model(cfg, 0)
    mesh = make_mesh()
    layout = replicated_layout(mesh, params)
    calib_cfg = CalibConfig(eps_low=0.2, eps_high=0.28)
    batch, _, _ = cpu_batch(a)
    seq_len = batch["tokens"].shape[1]
    opt = OptimSettings(1e-6, 0, 0.0, 1.0, 0.9, 0.999)
    fns = {}
    for name, micro, budget in (("fixed", a.cpu_micro, 0),
                                ("token budget", 0, a.cpu_micro * seq_len)):  # fmt: skip
        s = default_settings(
            get_algorithm("dapo"), train_recipe="bf16", calibrated=True, calib_cfg=calib_cfg,
            correction="none", correction_level="token", tis_cap=2.0, group_size=4,
            micro_batch_size=micro, max_tokens_per_micro_batch=budget,
            length_buckets=length_buckets(seq_len, a.cpu_buckets),
        )  # fmt: skip
        fns[name] = make_step_fns(graphdef, s, opt, layout)
    out, _ = fns["fixed"].prepare(params, None, put_batch(batch, mesh), calibrate=False)
    mb = present(batch, UPDATE_INPUTS) | {k: np.asarray(v) for k, v in out.items()}
    lengths = batch["attention_mask"].sum(axis=1)
    plan = fns["token budget"].token_budget.plan(mb)[1]
    shares = {
        "fixed": fixed_padding(lengths, seq_len),
        "token budget": padding_share(plan, lengths),
    }
    states = {
        k: {"params": jax.tree.map(jnp.copy, params), "opt_state": f.optimizer.init(params),
            "calib": init_calib_state(calib_cfg)}
        for k, f in fns.items()
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(a.repeats + 1):  # the first: compiles
        for k, f in fns.items():
            t0 = time.perf_counter()
            sub, mets = f.update(states[k], put_batch(mb, mesh), calibrate=False)
            jax.block_until_ready(sub)
            states[k] = sub
            if rep:
                times[k].append(time.perf_counter() - t0)
    print(f"\nmeasured: {a.cpu_n} sequences of T = {seq_len} (prompt {a.cpu_prompt}, lognormal "
          f"response median {a.cpu_median}), mean length {lengths.mean():.0f}; tiny_qwen3 "
          f"hidden {a.cpu_hidden}, {a.cpu_layers} layers, one CPU device, median of "
          f"{a.repeats} updates")  # fmt: skip
    print("| packing | micro-batches | padding share | update s | x fixed |")
    print("|---|---|---|---|---|")
    base = statistics.median(times["fixed"])
    counts = {"fixed": a.cpu_n // a.cpu_micro, "token budget": len(plan)}
    for k in fns:
        t = statistics.median(times[k])
        print(f"| {k} | {counts[k]} | {shares[k]:.1%} | {t:.3f} | {t / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256, help="plan: sequences per mini-batch")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=15872)
    ap.add_argument("--median", type=float, default=1000)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per device")
    ap.add_argument("--buckets", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--cpu-n", type=int, default=32)
    ap.add_argument("--cpu-tokens", type=int, default=512)
    ap.add_argument("--cpu-prompt", type=int, default=32)
    ap.add_argument("--cpu-median", type=float, default=48)
    ap.add_argument("--cpu-micro", type=int, default=4)
    ap.add_argument("--cpu-buckets", type=int, default=4)
    ap.add_argument("--cpu-hidden", type=int, default=256)
    ap.add_argument("--cpu-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-cpu", action="store_true", help="the plan only")
    a = ap.parse_args()
    plan_part(a)
    if not a.skip_cpu:
        cpu_part(a)


if __name__ == "__main__":
    main()
