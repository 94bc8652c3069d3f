"""Host memory of this process, logged per stage with JFP8RL_DEBUG_MEMORY=1."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def host_rss_gib() -> dict[str, float]:
    """This process's resident memory in GiB from /proc/self/status: `rss` (VmRSS), `peak`
    (VmHWM), `anon` (RssAnon: heap, device buffers on CPU) and `file` (RssFile: mapped files,
    e.g. memory-mapped safetensors); empty where there is no /proc."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    names = {"rss": "VmRSS", "peak": "VmHWM", "anon": "RssAnon", "file": "RssFile"}
    return {k: float(fields.get(v, "0 kB").split()[0]) / 2**20 for k, v in names.items()}


def log_memory(log: Any, stage: str) -> None:
    """With JFP8RL_DEBUG_MEMORY=1, one line `memory: <stage> rss X GiB peak Y GiB (anon A,
    file F)` (what benchmarks/host_memory.py prints to attribute the peak to a stage)."""
    if os.environ.get("JFP8RL_DEBUG_MEMORY") == "1":
        m = host_rss_gib()
        log(
            f"memory: {stage} rss {m.get('rss', 0):.2f} GiB peak {m.get('peak', 0):.2f} GiB "
            f"(anon {m.get('anon', 0):.2f}, file {m.get('file', 0):.2f})"
        )
