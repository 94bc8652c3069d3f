"""The rollout side of jfp8rl: backends, the embedded engine, HTTP client/server, FP8 weight
export and the vLLM plugin.

  backend.py      the `RolloutBackend` interface every backend implements
  engine/         the embedded JAX engine (`EmbeddedBackend`, the default backend)
  client/         clients of vLLM-compatible servers (`HttpBackend`, `ServerPool`)
  server/         the embedded engine behind vLLM's routes; `serve.py` is its command
  export.py       trainer weights -> rollout format (bf16, FP8 block, ...), written to disk
  weights/        the on-disk export format: write, list, check and load versions
  vllm_plugin.py  vLLM's weight-transfer backend that loads those exports

This package's `__init__` must not import jax, nor may `weights/` or `vllm_plugin.py`: the
plugin is imported inside vLLM's own environment, which has torch and vllm but not jax.
"""
