#!/usr/bin/env bash
# Creates .venv on Python 3.12 and installs the project with its test extra, pinned by
# scripts/constraints-py312.txt (jax 0.11.2 as on the GPU machines). Idempotent.
# Usage: scripts/bootstrap.sh          (PYTHON=/path/to/python3.12 to choose the interpreter)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
WANT="3.12"
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3 python3; do
    if command -v "$cand" >/dev/null 2>&1 && is_312 "$cand"; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ] || ! is_312 "$PY"; then
  echo "[bootstrap] error: Python $WANT not found (looked for python3.12 on PATH, then" >&2
  echo "  ~/.pyenv/versions/3.12*/bin/python3). Install it, e.g. 'pyenv install 3.12' or your" >&2
  echo "  distribution's python3.12 + python3.12-venv, or set PYTHON=/path/to/python3.12." >&2
  exit 1
fi
if [ -x .venv/bin/python ] && ! is_312 .venv/bin/python; then
  echo "[bootstrap] .venv is not Python $WANT: recreating it"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
fi
# pip byte-compiles what it installs on one core (about two thirds of a fresh install's time);
# installed without it, the packages are byte-compiled on every core afterwards. A file that
# does not compile is skipped, as pip skips it (its module compiles when imported, if ever).
.venv/bin/pip install -q --disable-pip-version-check --no-compile -c scripts/constraints-py312.txt \
  -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
.venv/bin/python -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, chex; print('[bootstrap] python', __import__('sys').version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)"
