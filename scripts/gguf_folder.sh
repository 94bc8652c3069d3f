#!/usr/bin/env bash
# An HF model folder from a GGUF file, for the get_* scripts: transformers' GGUF loader
# (scripts/gguf_to_hf.py) run in the vLLM venv, which this script builds first if it is missing
# (scripts/setup_vllm_env.sh: torch, transformers, gguf, accelerate). DIR is written whole or
# not at all (a temporary folder renamed at the end) and marked complete by DIR/.complete.
# Usage: scripts/gguf_folder.sh GGUF DIR   (prints DIR last)
set -euo pipefail
GGUF="$1"
DIR="$2"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${JFP8RL_VLLM_VENV:-$HOME/.cache/jfp8rl/vllm-venv}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import gguf, accelerate, transformers" >/dev/null 2>&1; then
  echo "[gguf_folder] building the vLLM venv it converts in (scripts/setup_vllm_env.sh)" >&2
  "$ROOT/scripts/setup_vllm_env.sh" "$VENV" >&2
fi
mkdir -p "$(dirname "$DIR")"
TMP="$(mktemp -d "${DIR%/}.partial.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
echo "[gguf_folder] converting $(basename "$GGUF") with transformers' GGUF loader (a minute or two)" >&2
CUDA_VISIBLE_DEVICES="" "$VENV/bin/python" "$ROOT/scripts/gguf_to_hf.py" "$GGUF" "$TMP/hf" \
  2>"$TMP/convert.log" || { tail -n 30 "$TMP/convert.log" >&2; exit 1; }
touch "$TMP/hf/.complete"
rm -rf "$DIR"
mv "$TMP/hf" "$DIR"
echo "$DIR"
