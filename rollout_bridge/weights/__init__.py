"""The on-disk form of one exported weight version: safetensors + `manifest.json`.

This package only moves bytes (numpy, hashlib, json; torch where the reader is asked for torch
tensors): the vLLM plugin imports it inside vLLM's own venv, which has neither jax nor
ml_dtypes. The conversion from trainer params to the rollout format is `rollout_bridge.export`.

Modules: `hashing` (tensor digests), `safetensors_io` (the tensor file), `store` (writing
versions into an export root, listing and cleaning them), `reader` (checking and loading one).

Layout of an export root (default `/dev/shm/jfp8rl/run-<pid>`, shared memory so a "copy" to
the server is a page-cache read):

    <root>/<version>/model.safetensors   tensors, HF names
    <root>/<version>/manifest.json       the manifest (below)
    <root>/.partial-<version>-<pid>-<n>/ a version being written (never read)

Manifest (`FORMAT_VERSION`; the reader refuses any other):

    {"format_version": 2, "version": str, "format": "fp32" | "bf16" | "fp8" | "fp8_fp32",
     "created_ns": int, "quantization_config": {...} | null, "hash": one of `hashing.HASHES`,
     "files": {file name: {"size": int}},
     "tensors": {HF name: {"file": str, "dtype": safetensors tag, "shape": [int],
                           <hash>: hex digest of the tensor's raw little-endian bytes}}}

A version is written into a `.partial-*` folder and renamed into place only when complete
(`os.rename` is atomic within one filesystem), so a crash mid-write never leaves a folder a
server would load; the manifest is written last. A flipped byte, a truncated file or a stale
or mixed export is refused by the reader. The server is handed the sha256 of the manifest
itself, so the chain of digests starts at the trainer.
"""

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
TENSOR_FILE = "model.safetensors"


class ExportError(ValueError):
    """An export folder is missing, incomplete, tampered with, or of the wrong version."""
