"""`ServerPool`: several vLLM-compatible rollout servers behind one `RolloutBackend`.

The trainer sees one backend (`rollout.urls` in the config; `jfp8rl.trainer.backends.make_backend`).

generate / score: the prompts (a prompt's n samples never leave its server, so a GRPO group is
sampled on one server with one weight version) are cut into contiguous chunks, about
`chunks_per_server` per live server, and put in a queue; one thread per live server takes the
next chunk whenever its server is free, so a faster or less loaded server takes more chunks.
Each chunk is one batched `/v1/completions` request carrying the prompts' indices in the whole
batch as seed indices (`jfp8rl_seed_indices`), so with a seed the samples equal those of one
server answering the whole batch, however the batch was split (vLLM's samples depend on the
seed alone). Results are put back in prompt order.

push_weights: the weights are exported once (`rollout_bridge.export`, into `export_root`, which
every server must be able to read), then installed on every live server in parallel
(`HttpBackend.push_export`: pause -> update -> resume, then `/weight_info` must report the
version on each).

Failures: a server whose request fails (`RolloutError`: connection refused, timeout after the
client's retries, a malformed answer, a weight version other than the one pushed; any other
exception of its call counts too, so a chunk is never left in flight) is dropped with a
warning naming its URL; its chunk goes back to the queue for the others, and the run goes on.
When no server is left, `RolloutError` lists every server's failure (the trainer then stops
with its checkpoint and the resume command, `jfp8rl.trainer.loop`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from rollout_bridge.backend import (
    Completion,
    HFTensors,
    RolloutBackend,
    RolloutError,
    SamplingParams,
)
from rollout_bridge.client.http_backend import HttpBackend
from rollout_bridge.client.settings import ClientSettings
from rollout_bridge.export import export_weights
from rollout_bridge.weights.store import default_root

log = logging.getLogger(__name__)
T = TypeVar("T")


def chunk_bounds(n_items: int, n_chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of `n_chunks` contiguous, near-equal chunks of `n_items` (none empty)."""
    n_chunks = max(1, min(n_items, n_chunks))
    edges = [round(k * n_items / n_chunks) for k in range(n_chunks + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


class ServerPool(RolloutBackend):
    """Rollout servers behind one backend (module docstring).

    Args:
      urls: server base URLs (at least one, no duplicates).
      settings: as for `HttpBackend`, shared by every server; `export_root` must be readable
        by all of them (a shared filesystem when they run on other hosts; /dev/shm only when
        all share this host). None there: `weights.store.default_root()`, removed by
        `close()`.
      chunks_per_server: queue chunks per live server in one call (more: finer balancing,
        smaller batches per request).
    """

    def __init__(
        self,
        urls: Sequence[str],
        settings: ClientSettings | None = None,
        *,
        chunks_per_server: int = 2,
    ) -> None:
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise RolloutError("rollout pool: no server URLs given; set rollout.urls: [...]")
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise RolloutError(f"rollout pool: server URL(s) {dup} listed twice in rollout.urls")
        settings = settings or ClientSettings()
        self._owns_root = settings.export_root is None
        self.export_root = settings.export_root or default_root()
        # Every server is told the one root the pool exports into.
        self.settings = dataclasses.replace(settings, export_root=self.export_root)
        self.chunks_per_server = max(1, chunks_per_server)
        self.servers = [HttpBackend(u, self.settings) for u in urls]
        self.live: list[HttpBackend] = list(self.servers)
        self.failures: dict[str, str] = {}  # url -> why it was dropped
        self._version: str | None = None  # the version pushed to every live server
        self._lock = threading.Lock()
        self._closed = False

    # ---------------------------------------------------------------------------- failures

    def _drop(self, server: HttpBackend, err: BaseException) -> None:
        with self._lock:
            if server not in self.live:
                return
            self.live.remove(server)
            self.failures[server.url] = str(err)
            left = [s.url for s in self.live]
        log.warning(
            "rollout server %s dropped (%s); %d left%s", server.url, err, len(left),
            f" ({', '.join(left)}): its requests go to them" if left else "",
        )  # fmt: skip

    def _none_left(self, what: str) -> RolloutError:
        why = "; ".join(f"{u}: {e}" for u, e in self.failures.items())
        return RolloutError(
            f"rollout pool: every server failed ({what}): {why}. Restart the servers "
            "(rollout.urls) and resume"
        )

    def _alive(self) -> list[HttpBackend]:
        with self._lock:
            return list(self.live)

    # ---------------------------------------------------------------------------- spreading

    def _spread(
        self,
        n_items: int,
        call: Callable[[HttpBackend, int, int], list[T]],
        what: str,
    ) -> list[list[T]]:
        """Runs `call(server, lo, hi)` for every chunk of `range(n_items)` on the live servers
        (a work queue, one thread per server); returns the results per chunk, in order. A
        failing server is dropped and its chunk re-queued; `RolloutError` when none is left."""
        servers = self._alive()
        if not servers:
            raise self._none_left(what)
        bounds = chunk_bounds(n_items, self.chunks_per_server * len(servers))
        queue = list(range(len(bounds)))[::-1]  # pop() takes the first chunk
        results: list[list[T] | None] = [None] * len(bounds)
        cond = threading.Condition()
        in_flight = [0]

        def worker(server: HttpBackend) -> None:
            while True:
                with cond:
                    cond.wait_for(lambda: queue or in_flight[0] == 0)
                    if not queue:
                        return
                    k = queue.pop()
                    in_flight[0] += 1
                lo, hi = bounds[k]
                try:
                    out = call(server, lo, hi)
                except Exception as e:  # any failure drops the server: its chunk must not hang
                    if not isinstance(e, RolloutError):
                        e = RolloutError(f"{server.url}: {what}: {type(e).__name__}: {e}")
                    self._drop(server, e)
                    with cond:
                        queue.append(k)
                        in_flight[0] -= 1
                        cond.notify_all()
                    return
                with cond:
                    results[k] = out
                    in_flight[0] -= 1
                    cond.notify_all()

        with ThreadPoolExecutor(len(servers), thread_name_prefix="rollout-pool") as ex:
            for f in [ex.submit(worker, s) for s in servers]:
                f.result()
        if queue:
            raise self._none_left(what)
        return [r for r in results if r is not None]

    # ---------------------------------------------------------------------------- interface

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        seed_indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Chunks of prompt groups over the live servers; completions prompt-major, one
        weight version (the pushed one) on all of them."""
        if not prompts:
            return []
        keys = list(range(len(prompts))) if seed_indices is None else list(seed_indices)
        if len(keys) != len(prompts):
            raise RolloutError(f"rollout pool: {len(keys)} seed indices for {len(prompts)} prompts")

        def call(server: HttpBackend, lo: int, hi: int) -> list[Completion]:
            comps = server.generate(prompts[lo:hi], sampling, seed_indices=keys[lo:hi])
            self._check_version(server, {c.weight_version for c in comps}, "sampled")
            return [dataclasses.replace(c, prompt_index=c.prompt_index + lo) for c in comps]

        out = [c for chunk in self._spread(len(prompts), call, "generate") for c in chunk]
        self._one_version({c.weight_version for c in out})
        return out

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Chunks of sequences over the live servers, in order; each server's /weight_info is
        read right before and after its chunk, and all must be one version (the pushed one),
        as for `generate`."""
        if not sequences:
            return []

        def call(server: HttpBackend, lo: int, hi: int) -> list[tuple[str, np.ndarray]]:
            before = server.weight_version()
            scores = server.score(sequences[lo:hi])
            versions = {before, server.weight_version()}
            self._check_version(server, versions, "scored")
            return [(before, x) for x in scores]

        out = [x for chunk in self._spread(len(sequences), call, "score") for x in chunk]
        self._one_version({v for v, _ in out})
        return [x for _, x in out]

    def _check_version(self, server: HttpBackend, got: set[str], what: str) -> None:
        """A server's chunk ran on the pushed version, one version throughout, or
        `RolloutError` (the server is then dropped and its chunk re-sent)."""
        want = self._version
        if want is not None and got != {want}:
            raise RolloutError(
                f"{server.url} {what} with weight version(s) {sorted(got)} but "
                f"{want!r} was pushed (restarted?)"
            )
        if len(got) > 1:
            raise RolloutError(f"{server.url}: its weight version changed while it {what}: "
                               f"{sorted(got)}")  # fmt: skip

    @staticmethod
    def _one_version(versions: set[str]) -> None:
        if len(versions) > 1:  # only without a push: servers started on different weights
            raise RolloutError(
                f"rollout pool: the servers hold different weight versions {sorted(versions)}; "
                "push weights first"
            )

    def push_weights(self, hf_state: HFTensors, version: str) -> None:
        """One export, installed on every live server in parallel; each one's /weight_info
        must then report `version` (`HttpBackend.push_export`)."""
        self._check_open()
        s = self.settings
        path = export_weights(
            hf_state, version, fmt=s.export_format, root=self.export_root,
            keep=s.keep_versions, hash_name=s.export_hash,
        )  # fmt: skip
        self.push_export(path, version)

    def push_export(self, path: str | Path, version: str) -> None:
        """Installs an exported version folder on every live server (in parallel)."""
        servers = self._alive()
        if not servers:
            raise self._none_left(f"push {version}")

        def push(server: HttpBackend) -> None:
            try:
                server.push_export(path, version)
            except RolloutError as e:
                self._drop(server, e)

        with ThreadPoolExecutor(len(servers), thread_name_prefix="rollout-push") as ex:
            list(ex.map(push, servers))
        if not self._alive():
            raise self._none_left(f"push {version}")
        self._version = version

    def weight_version(self) -> str:
        if self._version is not None:
            return self._version
        for server in self._alive():
            try:
                return server.weight_version()
            except RolloutError as e:
                self._drop(server, e)
        raise self._none_left("weight_info")

    def health(self) -> bool:
        """True when at least one server answers /health (the others are dropped)."""
        for server in self._alive():
            if server.health():
                return True
            self._drop(server, RolloutError(f"{server.url}/health does not answer"))
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in self.servers:
            server.close()
        if self._owns_root:
            shutil.rmtree(self.export_root, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("rollout pool: closed; create a new ServerPool")
