"""The embedded rollout engine: the policy model in-process, KV-cache decoding, batched sampling.

Modules: `embedded` (`EmbeddedBackend`, the default `RolloutBackend`), `batching` (padded,
bucketed batches), `programs` (the jitted generate / score / kernel-install programs),
`sampling` (the sampling rules and the logprob convention), `params` (an export's tensors as
the engine's params).
"""
