#!/usr/bin/env bash
# The one prepared GPU check of the FP8 Hopper kernel (docs/kernels.md), for an H100/H200
# (jax 0.11.2 with CUDA 13, flax, jaxtyping; no network needed). One call does:
#   1. the kernel tests on the GPU, compiled (not interpreted): pytest
#      tests/models/test_fp8_kernels.py and test_fp8_grouped_kernel.py with a fresh random
#      seed (FP8_KERNEL_TEST_SEED) and a NaN-poisoned allocator before each kernel call (see
#      the test files), plus the GPU-only large case;
#   2. the SASS: compiles the kernel at 4096^3 with Mosaic GPU's dump switches and counts the
#      QGMMA (FP8 wgmma) instructions; also the PTX wgmma lines and ptxas' register/spill report;
#   3. benchmarks/fp8_matmul.py --sweep at 4096^3 and the Qwen3-8B shapes (target: the kernel's
#      forward >= 1.3x bf16);
#   4. benchmarks/model_step.py with the pallas recipe.
# Prints a short summary last; full logs and the dumps go to $OUT (or /tmp/gpu_check_out).
#
# Usage, from the repository root (each step has its own timeout; allow about 10 minutes):
#   bash scripts/gpu_check.sh
# Without pytest and network on the GPU machine, bring pytest's wheels (made once elsewhere):
#   python3.12 -m pip download --only-binary=:all: --python-version 3.12 -d .gpu_wheels pytest
#   echo /.gpu_wheels/ >> .git/info/exclude        # then copy .gpu_wheels/ along with the checkout
# Nothing here imports omegaconf, math-verify or vLLM (models/ and benchmarks/ only).
# GPU_CHECK_SMALL=1 runs the same steps at small sizes (a plumbing check, e.g. on a CPU, where
# the kernel runs in the interpreter).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
  --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
"$PY" -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())' \
  2>&1 | tee -a "$SUMMARY"

# 1. Kernel tests on the GPU --------------------------------------------------------------
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  if [ -d .gpu_wheels ]; then
    "$PY" -m pip install -q --no-index --find-links .gpu_wheels pytest >"$OUT/pip.log" 2>&1 \
      || note "pip install of the carried pytest wheels failed (see pip.log)"
  else
    note "pytest missing and no .gpu_wheels carried: see this script's header"
  fi
fi
SMALL="${GPU_CHECK_SMALL:-0}"
if [ "$SMALL" = 1 ]; then
  TEST_ARGS=(-k "gemm_matches or refuses"); SASS_N=256; BENCH_ARGS=(--small --repeats 1)
  MODEL_ARGS=(--layers 1 --d 128 --vocab 512 --batch 1 --seq 32 --steps 1)
else
  TEST_ARGS=(); SASS_N=4096; BENCH_ARGS=(--repeats 10); MODEL_ARGS=()
fi
SEED="${FP8_KERNEL_TEST_SEED:-$RANDOM$RANDOM}"
note "== 1. kernel tests (FP8_KERNEL_TEST_SEED=$SEED)"
FP8_KERNEL_TEST_SEED="$SEED" timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/models/test_fp8_kernels.py tests/models/test_fp8_grouped_kernel.py "${TEST_ARGS[@]}" \
  2>&1 | tee "$OUT/tests.log" | tail -n 15
note "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1)"

# 2. SASS: QGMMA present? ------------------------------------------------------------------
note "== 2. SASS / PTX of the kernel (${SASS_N}^3, e4m3 x e4m3 -> bf16)"
DUMP="$OUT/mosaic_dump"
rm -rf "$DUMP" && mkdir -p "$DUMP"
MOSAIC_GPU_DUMP_TO="$DUMP" MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 \
  SASS_N="$SASS_N" timeout 120 "$PY" - >"$OUT/sass_run.log" 2>&1 <<'EOF'
import os
import jax, jax.numpy as jnp
from models import fp8
from models.fp8.kernels import gemm
n = int(os.environ["SASS_N"])
x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
qa, sa = fp8.quantize(x, "e4m3", (1, 128))
out = gemm.scaled_matmul_nt(qa, qa, sa, sa, jnp.bfloat16)
print("ran", out.shape, out.dtype, bool(jnp.isfinite(out.astype(jnp.float32)).all()))
EOF
tail -n 3 "$OUT/sass_run.log"
# Any cubin/ELF left in the dump is disassembled with whichever CUDA tool is on this machine.
TOOL="$(command -v cuobjdump || command -v nvdisasm || true)"
if [ -z "$TOOL" ]; then
  TOOL="$("$PY" - 2>/dev/null <<'EOF'
import glob, os, site
for d in site.getsitepackages():
    for name in ("cuobjdump", "nvdisasm"):
        for p in glob.glob(os.path.join(d, "nvidia", "**", "bin", name), recursive=True):
            print(p); raise SystemExit
EOF
)"
fi
for f in $(find "$DUMP" -type f \( -name '*.cubin' -o -name '*.elf' -o -name '*.bin' \)); do
  [ -n "$TOOL" ] || break
  case "$TOOL" in
    *cuobjdump) "$TOOL" -sass "$f" >"$f.sass" 2>&1 || true ;;
    *nvdisasm) "$TOOL" "$f" >"$f.sass" 2>&1 || true ;;
  esac
done
# Count over every dump file (any depth) and the run's own output (dumps may go to stdout).
hits() { grep -rahoE "$1" "$DUMP" "$OUT/sass_run.log" 2>/dev/null; }
QGMMA=$(hits 'QGMMA[A-Z0-9_.]*' | wc -l)
HGMMA=$(hits 'HGMMA[A-Z0-9_.]*' | wc -l)
PTX_WGMMA=$(hits 'wgmma\.mma_async[a-z0-9_.]*' | sort | uniq -c | tr -s ' \n' ' ')
SPILLS=$(grep -rahiE 'spill|used [0-9]+ registers' "$DUMP" "$OUT/sass_run.log" 2>/dev/null \
  | sort -u | head -n 6 | tr '\n' ';')
note "SASS lines with QGMMA: $QGMMA (HGMMA: $HGMMA); disassembler: ${TOOL:-none found}"
note "PTX wgmma: ${PTX_WGMMA:-none found}"
note "ptxas: ${SPILLS:-no report found}"
(cd "$OUT" && tar czf mosaic_dump.tgz mosaic_dump && rm -rf mosaic_dump)

# 3. GEMM benchmark ----------------------------------------------------------------------
note "== 3. benchmarks/fp8_matmul.py --sweep"
(cd benchmarks && timeout 300 "$PY" fp8_matmul.py --sweep "${BENCH_ARGS[@]}") 2>&1 \
  | tee "$OUT/bench.txt" | grep -vE '^(WARNING|I[0-9]{4})'
grep -E '^(shape|case|bf16|fp8_|kernel)' "$OUT/bench.txt" >>"$SUMMARY"

# 4. Model step --------------------------------------------------------------------------
note "== 4. benchmarks/model_step.py (bf16, fp8_block, fp8_block_pallas)"
(cd benchmarks && timeout 120 "$PY" model_step.py --recipes bf16 fp8_block fp8_block_pallas \
  --lp-vocab 4096 --lp-seq 256 "${MODEL_ARGS[@]}") 2>&1 | tee "$OUT/model_step.txt" | tail -n 12
grep -E '^(forward|recipe|bf16|fp8_)' "$OUT/model_step.txt" >>"$SUMMARY"

echo
echo "======== summary ($SUMMARY) ========"
cat "$SUMMARY"
