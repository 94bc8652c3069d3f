"""The rollout side of jfp8rl: backends, the embedded engine, HTTP client/server, FP8 weight
export and the vLLM plugin.

This package's `__init__` must not import jax: the vLLM plugin (`rollout_bridge.vllm_plugin`)
is imported inside vLLM's own environment, which has torch and vllm but not jax.
"""
