#!/usr/bin/env bash
# Build (or reuse) the isolated venv holding verl 0.9.1 from PyPI: the reference that
# tests/losses/test_rollout_correction_verl.py compares the rollout correction against
# (tests/reference/verl_ref.py imports verl.trainer.ppo.rollout_corr_helper from it).
# Usage: scripts/setup_verl_env.sh [VENV_DIR]   (default: $JFP8RL_VERL_VENV or ~/.cache/jfp8rl/verl-venv)
# Prints the venv folder on its last line.
#
# verl's full requirement list (ray[default], wandb, datasets, peft, ...) is far heavier than
# importing the helper needs, so verl goes in with --no-deps and next to it exactly the
# packages its import chain (verl/__init__, verl.protocol, verl.utils.torch_functional, verl's
# config dataclasses) imports, pinned inside verl 0.9.1's own version ranges (packaging<26 for
# tensordict 0.10's pyvers). Its own venv rather than the vLLM venv: verl 0.9.1 wants
# transformers<5.11, older than the one vLLM's venv holds, and sharing would tie one
# reference's pins to the other's.
set -euo pipefail
VENV="${1:-${JFP8RL_VERL_VENV:-$HOME/.cache/jfp8rl/verl-venv}}"
PY="${PYTHON:-python3.11}"  # torch 2.13's CPU wheel is for 3.11, as in the vLLM venv
PINS=(
  "torch==2.13.0" "numpy==2.4.6" "packaging==25.0" "ray==2.60.0" "tensordict==0.10.0"
  "omegaconf==2.4.0" "transformers==5.10.4" "codetiming==1.4.0" "orjson==3.13.0"
)
VERL="verl==0.9.1"
RECIPE="$VERL --no-deps; ${PINS[*]}"
# A venv whose recorded recipe is this one was built and probed by this script: reused without
# importing verl again (about 9 s of ray / transformers import).
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/jfp8rl-recipe" 2>/dev/null)" = "$RECIPE" ]; then
  echo "$VENV"
  exit 0
fi
echo "[setup_verl_env] creating $VENV ($RECIPE; a minute or two the first time)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "${PINS[@]}"
"$VENV/bin/pip" install -q --no-deps "$VERL"
"$VENV/bin/python" -c 'import importlib.metadata as m, verl.trainer.ppo.rollout_corr_helper, verl.utils.torch_functional; assert m.version("verl") == "0.9.1"'
printf '%s' "$RECIPE" > "$VENV/jfp8rl-recipe"
echo "$VENV"
