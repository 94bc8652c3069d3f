"""Host memory of this process: logged per stage with JFP8RL_DEBUG_MEMORY=1 (with each stage's
own peak and where the main thread was at that moment), and the C heap's free pages handed
back to the OS after a burst of allocations (`release_free_heap`), with what was alive before a
run kept out of the cyclic collector's walk while it runs (`objects_before_frozen`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]  # the repository: its packages' frames are named
_SAMPLE_S = 0.01


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


def _project_frame(frame: FrameType | None) -> str:
    """`path:line function` of the innermost frame of this repository's code in `frame`'s
    stack (not an installed package's), or "?"."""
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(_ROOT) and "site-packages" not in path.parts:
            rel = path.relative_to(_ROOT).as_posix()
            return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class StagePeak:
    """The highest resident set since the last `take()` and where the main thread was when it
    was seen: a daemon thread reads VmRSS (/proc/self/statm) every 10 ms. A transient that
    lives between two stage lines (and raises the process's peak above both) is named."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.top, self.where = 0.0, "?"
        self.main = threading.main_thread().ident
        self.page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self.run, name="rss-sampler", daemon=True).start()

    def run(self) -> None:
        with open("/proc/self/statm", "rb", buffering=0) as f:
            while True:
                f.seek(0)
                rss = int(f.read().split()[1]) * self.page / 2**30
                if rss > self.top:
                    where = _project_frame(sys._current_frames().get(self.main))
                    with self.lock:
                        self.top, self.where = rss, where
                time.sleep(_SAMPLE_S)

    def take(self) -> tuple[float, str]:
        """(the peak GiB since the last call, where); starts the next interval."""
        with self.lock:
            out = (self.top, self.where)
            self.top, self.where = 0.0, "?"
        return out


@functools.cache
def _stage_peak() -> StagePeak | None:
    return StagePeak() if Path("/proc/self/statm").is_file() else None


def log_memory(log: Any, stage: str) -> None:
    """With JFP8RL_DEBUG_MEMORY=1, one line `memory: <stage> rss X GiB peak Y GiB (anon A,
    file F) stage peak Z GiB at <file:line function>`: the resident set now, the process's
    peak so far (VmHWM), and the highest one sampled since the previous line with the
    place the main thread was then (`StagePeak`, started by the first line). What
    benchmarks/host_memory.py prints to attribute the peak to a stage."""
    if os.environ.get("JFP8RL_DEBUG_MEMORY") == "1":
        m, sampler = host_rss_gib(), _stage_peak()
        top, where = sampler.take() if sampler is not None else (0.0, "?")
        log(
            f"memory: {stage} rss {m.get('rss', 0):.2f} GiB peak {m.get('peak', 0):.2f} GiB "
            f"(anon {m.get('anon', 0):.2f}, file {m.get('file', 0):.2f}) "
            f"stage peak {max(top, m.get('rss', 0)):.2f} GiB at {where}"
        )


@functools.cache
def _glibc_malloc_trim() -> object | None:
    """glibc's `malloc_trim`, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Collects cyclic garbage, then hands the free pages of the C heap back to the OS (glibc's
    `malloc_trim(0)`; nothing elsewhere). glibc keeps the blocks that threads free in their own arenas for reuse, and
    returns only large ones (over 32 MiB) at once: after many threads allocated and freed
    many mid-sized blocks, such as a checkpoint save's tensorstore writers encoding chunks,
    the resident set stays at the burst's height, and the next stage's peak adds to it.
    Nothing allocated is touched."""
    gc.collect()  # arrays held only by reference cycles (NNX graphs) die now, not later
    trim = _glibc_malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def objects_before_frozen() -> Iterator[None]:
    """Runs the body with every object alive at its start (imported modules, compiled programs
    of earlier calls, the caller's data) outside the cyclic collector's walk (`gc.freeze`), and
    hands them back to it at the end (`gc.unfreeze`, also on an error).

    `release_free_heap` runs a full collection after each stage; its cost grows with the number
    of objects tracked, and a freshly imported trainer holds ~0.3 M of them before it builds
    anything (jax, flax, optax, orbax): each collection then takes ~0.3 s where the run's own
    objects need a fraction. Frozen objects are not freed by the collector while frozen (reference
    counting still frees them), so an object alive at the start that becomes cyclic garbage
    during the body is collected only after it; that is why the freeze ends with the body.
    Nested uses keep the outermost freeze. Also a decorator (`@objects_before_frozen()`)."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.collect()  # garbage from before is not frozen
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


_frozen_depth = 0  # open `objects_before_frozen` bodies in this process
