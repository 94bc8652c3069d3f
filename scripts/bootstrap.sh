#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs the project with its test extra. Idempotent.
# Usage: scripts/bootstrap.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PY"
  "$PY" -m venv .venv
fi
# torch==2.13.0 (CPU) and transformers are test-only references (model logits vs transformers).
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, chex; print('[bootstrap] jax', jax.__version__, 'flax', flax.__version__)"
