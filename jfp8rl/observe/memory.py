"""Host memory of this process: logged per stage with JFP8RL_DEBUG_MEMORY=1, and the C heap's
free pages handed back to the OS after a burst of allocations (`release_free_heap`)."""

from __future__ import annotations

import ctypes
import functools
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


@functools.cache
def _glibc_malloc_trim() -> object | None:
    """glibc's `malloc_trim`, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Hands the free pages of the C heap back to the OS (glibc's `malloc_trim(0)`; nothing
    elsewhere). glibc keeps the blocks that threads free in their own arenas for reuse, and
    returns only large ones (over 32 MiB) at once: after many threads allocated and freed
    many mid-sized blocks, such as a checkpoint save's tensorstore writers encoding chunks,
    the resident set stays at the burst's height, and the next stage's peak adds to it.
    Nothing allocated is touched."""
    trim = _glibc_malloc_trim()
    if trim is not None:
        trim(0)
