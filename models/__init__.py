"""The model side: FP8 numerics (`fp8`), the decoder (`config`, `attention`, `decoder`,
`functional`, `sharding`), HF checkpoints (`hf_state`, `hf_io`) and tokenizers (`tokenizer`).

Import the submodules directly; this package imports nothing so that light users (e.g. the
vLLM plugin) pay for nothing."""
