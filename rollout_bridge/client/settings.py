"""`ClientSettings`: how a client reaches its server(s) and exports the weights it pushes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollout_bridge.export import EXPORT_FORMATS, ExportFormat
from rollout_bridge.weights.hashing import HASHES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSettings:
    """The settings `HttpBackend` and `ServerPool` share (`jfp8rl.trainer.backends.make_backend` builds
    them from `rollout.*`)."""

    # API key sent on every request as `Authorization: Bearer <key>` (the server's
    # `--api-key`, vLLM's or `rollout_bridge.serve`'s); None: no Authorization header.
    api_key: str | None = None
    # Rollout format of pushed weights (`rollout_bridge.export`); a CPU vLLM needs "fp32",
    # "bf16" or "fp8_fp32" (its CPU build has no FP8 kernels).
    export_format: ExportFormat = "bf16"
    # Folder the exports are written to, readable by every server: /dev/shm on the same host,
    # a shared filesystem otherwise. None: `weights.store.default_root()`, which the client
    # owns and removes in `close()`.
    export_root: Path | None = None
    # Exported versions kept on disk: the served one and the one being pushed (the vLLM
    # plugin reloads the served one when a push is refused mid-load).
    keep_versions: int = 2
    # Per-tensor digest of the exports (`weights.hashing.HASHES`); None: `default_hash()`,
    # xxh3_128. A cryptographic one (blake3) where others can write the export folder.
    export_hash: str | None = None
    # Socket timeout per request, in seconds (generating a large batch may be slow).
    timeout_s: float = 600.0
    # Extra attempts after a transient failure (refused / reset connection, timeout, HTTP
    # 429/502/503/504); attempt k + 1 waits `backoff_s * 2**k` seconds first.
    max_retries: int = 3
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.export_root is not None:
            object.__setattr__(self, "export_root", Path(self.export_root))
        if self.export_format not in EXPORT_FORMATS:
            raise ValueError(
                f"ClientSettings.export_format={self.export_format!r}; choose one of "
                f"{EXPORT_FORMATS}"
            )
        if self.export_hash is not None and self.export_hash not in HASHES:
            raise ValueError(
                f"ClientSettings.export_hash={self.export_hash!r}; choose one of {HASHES} "
                "(None: the default)"
            )
        if self.keep_versions < 1:
            raise ValueError(
                f"ClientSettings.keep_versions={self.keep_versions}; keep at least the served "
                "version (>= 1)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"ClientSettings.timeout_s={self.timeout_s} must be > 0")
        if self.max_retries < 0 or self.backoff_s < 0:
            raise ValueError(
                f"ClientSettings.max_retries={self.max_retries}, backoff_s={self.backoff_s}: "
                "both must be >= 0"
            )
