#!/usr/bin/env bash
# Launch a multi-process jfp8rl run: one trainer process per host, vLLM servers beside
# (docs/cluster.md explains the layout, the flags and the filesystem the export must be on).
#
#   scripts/launch_cluster.sh [options] -- --config C [section.key=value ...]
#
# Where the trainer processes run (one of):
#   --local N              N processes on this host, coordinator 127.0.0.1:PORT (tests; a
#                          single big box). Set XLA_FLAGS / CUDA_VISIBLE_DEVICES yourself.
#   --hosts h0,h1,...      one process per host over ssh; process 0 on h0 (the coordinator
#                          binds h0:PORT; every host must reach it)
#   --slurm                `srun --ntasks-per-node=1` inside an allocation: JAX reads SLURM's
#                          environment itself, so the trainer gets no distributed flags
# vLLM servers beside the trainer (optional; --hosts or --slurm):
#   --vllm h:p,h:p,...     start `vllm serve` on each host:port (ssh), wait for /health, and
#                          point the trainer at them (rollout.backend=http, rollout.url(s))
#   --vllm-model DIR       the HF folder the servers start from (the run's base policy)
#   --vllm-args "..."      extra `vllm serve` arguments, e.g. "--tensor-parallel-size 8"
#   --vllm-fp8-block B     serve block-FP8 linear layers (B x B weight blocks), the layout of
#                          rollout.export_format: fp8 pushes (B = 128, the export's): adds
#                          --quantization fp8 --load-format dummy --hf-overrides
#                          '{"quantization_config": {..., "weight_block_size": [B, B]}}'
#                          (rollout_bridge/vllm_layout.py; the first push brings the weights)
#   --export-root DIR      where the trainer writes weight pushes (rollout.export_root): a
#                          filesystem every server can read; /dev/shm only on a shared host
#   --api-key-file FILE    a file holding the servers' API key, at the same path on every host
#                          (mode 600): the servers read it into VLLM_API_KEY and load
#                          rollout_bridge.vllm_auth.RequireApiKey (the key on every route but
#                          /health), the trainer into JFP8RL_ROLLOUT_API_KEY; the key is on no
#                          command line
# Common:
#   --port P               coordinator port (default 6379; 0 = a free port, --local only)
#   --repo DIR             the checkout on every host (default: this one)
#   --python PY            the trainer's python on every host (default: REPO/.venv/bin/python)
#   --vllm-bin PATH        vllm executable on the server hosts (default: vllm)
#   --log-dir DIR          --local: process i logs to DIR/proc-i.log (default: this terminal)
#   --dry-run              print the commands, run nothing
#
# --local waits for all processes; when one fails the others are stopped and its exit code is
# returned (0 = all done). Servers started with --vllm are left running (stop them with the
# printed kill commands).
set -euo pipefail

usage() { sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="" LOCAL=0 HOSTS="" SLURM=0 PORT=6379 DRY=0 LOG_DIR=""
VLLM="" VLLM_MODEL="" VLLM_ARGS="" VLLM_BIN="vllm" EXPORT_ROOT="" KEY_FILE="" FP8_BLOCK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --local) LOCAL="$2"; shift 2 ;;
    --hosts) HOSTS="$2"; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    --port) PORT="$2"; shift 2 ;;
    --repo) REPO="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --vllm) VLLM="$2"; shift 2 ;;
    --vllm-model) VLLM_MODEL="$2"; shift 2 ;;
    --vllm-args) VLLM_ARGS="$2"; shift 2 ;;
    --vllm-bin) VLLM_BIN="$2"; shift 2 ;;
    --vllm-fp8-block) FP8_BLOCK="$2"; shift 2 ;;
    --export-root) EXPORT_ROOT="$2"; shift 2 ;;
    --api-key-file) KEY_FILE="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "launch_cluster.sh: unknown option $1 (trainer arguments go after --)" >&2; usage ;;
  esac
done
TRAIN_ARGS=("$@")
if [[ -z "$PYTHON" ]]; then
  PYTHON="$REPO/.venv/bin/python"; [[ -x "$PYTHON" ]] || PYTHON=python3
fi
modes=$(( (LOCAL > 0) + (${#HOSTS} > 0) + SLURM ))
if [[ $modes -ne 1 ]]; then
  echo "launch_cluster.sh: give exactly one of --local N, --hosts h0,h1,..., --slurm" >&2; exit 2
fi
if [[ ${#TRAIN_ARGS[@]} -eq 0 ]]; then
  echo "launch_cluster.sh: no trainer arguments; add: -- --config configs/<run>.yaml" >&2; exit 2
fi
if [[ -n "$VLLM" && ( $LOCAL -gt 0 || -z "$VLLM_MODEL" ) ]]; then
  echo "launch_cluster.sh: --vllm needs --hosts or --slurm, and --vllm-model DIR" >&2; exit 2
fi

q() { local out; out=$(printf '%q ' "$@"); printf '%s' "${out% }"; }  # shell-quoted words
# Block-FP8 layers for `fp8` pushes: vLLM's FP8 checkpoint config over the BF16 checkpoint,
# placeholder weights until the first push (rollout_bridge/vllm_layout.py `serve_flags`).
FP8_ARGS=""
if [[ -n "$FP8_BLOCK" ]]; then
  if [[ ! "$FP8_BLOCK" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch_cluster.sh: --vllm-fp8-block $FP8_BLOCK: give the export's FP8 block size (128)" >&2
    exit 2
  fi
  qc="{\"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": \"dynamic\", \"weight_block_size\": [$FP8_BLOCK, $FP8_BLOCK]}}"
  FP8_ARGS=" --quantization fp8 --load-format dummy --hf-overrides $(q "$qc")"
fi
# The key is read from the file where each command runs, never put on a command line.
SERVER_KEY="" TRAINER_KEY="" MIDDLEWARE=""
if [[ -n "$KEY_FILE" ]]; then
  SERVER_KEY="VLLM_API_KEY=\$(cat $(q "$KEY_FILE")) "
  TRAINER_KEY="JFP8RL_ROLLOUT_API_KEY=\$(cat $(q "$KEY_FILE")) "
  MIDDLEWARE=" --middleware rollout_bridge.vllm_auth.RequireApiKey"
  if [[ $DRY -eq 0 && ( $LOCAL -gt 0 || $SLURM -eq 1 ) ]]; then
    JFP8RL_ROLLOUT_API_KEY="$(cat "$KEY_FILE")"; export JFP8RL_ROLLOUT_API_KEY
  fi
fi
run() { if [[ $DRY -eq 1 ]]; then echo "$*"; else bash -c "$*"; fi; }
# `ssh HOST CMD`: run it, or print it (single-quoted for reading and pasting).
remote() {
  if [[ $DRY -eq 1 ]]; then
    if [[ "$2" != *"'"* ]]; then echo "ssh -o BatchMode=yes $1 '$2'"; else echo "ssh -o BatchMode=yes $1 $(q "$2")"; fi
  else
    ssh -o BatchMode=yes "$1" "$2"
  fi
}

# --- vLLM servers ------------------------------------------------------------------------
if [[ -n "$VLLM" ]]; then
  IFS=, read -r -a SERVERS <<< "$VLLM"
  urls=()
  for hp in "${SERVERS[@]}"; do
    host="${hp%:*}" port="${hp##*:}"
    transfer='{"backend": "jfp8rl_shm"}'
    serve="cd $(q "$REPO") && ${SERVER_KEY}VLLM_SERVER_DEV_MODE=1 nohup $(q "$VLLM_BIN") serve \
$(q "$VLLM_MODEL") --host 0.0.0.0 --port $port --logprobs-mode processed_logprobs \
--weight-transfer-config $(q "$transfer")$MIDDLEWARE$FP8_ARGS $VLLM_ARGS > vllm-$port.log 2>&1 & echo \$!"
    remote "$host" "$serve"
    [[ $DRY -eq 1 ]] || echo "  (stop it: ssh $host kill <pid printed above>)"
    urls+=("\"http://$hp\"")
  done
  for hp in "${SERVERS[@]}"; do
    run "for i in \$(seq 600); do curl -sf http://$hp/health >/dev/null && exit 0; sleep 1; done; \
echo 'vLLM at $hp not healthy after 600 s (see vllm-${hp##*:}.log on ${hp%:*})' >&2; exit 1"
  done
  if [[ ${#urls[@]} -eq 1 ]]; then
    TRAIN_ARGS+=("rollout.backend=http" "rollout.url=${urls[0]//\"/}")
  else
    TRAIN_ARGS+=("rollout.backend=http" "rollout.urls=[$(IFS=,; echo "${urls[*]}")]")
  fi
fi
[[ -n "$EXPORT_ROOT" ]] && TRAIN_ARGS+=("rollout.export_root=$EXPORT_ROOT")

TRAIN=("$PYTHON" -m jfp8rl.train "${TRAIN_ARGS[@]}")

# --- SLURM: JAX finds coordinator, count and rank in SLURM's environment ------------------
if [[ $SLURM -eq 1 ]]; then
  run "cd $(q "$REPO") && srun --ntasks-per-node=1 --kill-on-bad-exit=1 $(q "${TRAIN[@]}")"
  exit $?
fi

# --- one process per host over ssh ------------------------------------------------------
if [[ -n "$HOSTS" ]]; then
  IFS=, read -r -a HS <<< "$HOSTS"
  n=${#HS[@]} pids=()
  for i in "${!HS[@]}"; do
    cmd="cd $(q "$REPO") && ${TRAINER_KEY}PYTHONPATH=$(q "$REPO") exec $(q "${TRAIN[@]}") \
--coordinator ${HS[0]}:$PORT --num-processes $n --process-id $i"
    if [[ $DRY -eq 1 ]]; then remote "${HS[$i]}" "$cmd"; continue; fi
    remote "${HS[$i]}" "$cmd" & pids+=($!)
  done
  [[ $DRY -eq 1 ]] && exit 0
  rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
fi

# --- N processes on this host -----------------------------------------------------------
if [[ "$PORT" == 0 ]]; then
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
pids=()
# SIGTERM first; a JAX process stuck in a collective ignores it (jax's preemption service
# catches SIGTERM), so whatever is still alive after a grace period gets SIGKILL.
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && return 0
    sleep 1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap 'cleanup; exit 130' INT TERM
for ((i = 0; i < LOCAL; i++)); do
  args=("${TRAIN[@]}" --coordinator "127.0.0.1:$PORT" --num-processes "$LOCAL" --process-id "$i")
  if [[ $DRY -eq 1 ]]; then echo "cd $(q "$REPO") && PYTHONPATH=$(q "$REPO") $(q "${args[@]}")"; continue; fi
  if [[ -n "$LOG_DIR" ]]; then
    mkdir -p "$LOG_DIR"
    (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "${args[@]}") > "$LOG_DIR/proc-$i.log" 2>&1 &
  else
    (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "${args[@]}") &
  fi
  pids+=($!)
done
[[ $DRY -eq 1 ]] && exit 0
# The first process to fail stops the others (they would wait for it in a collective).
rc=0 running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  done_pid=""
  set +e; wait -n -p done_pid "${running[@]}"; code=$?; set -e
  [[ -n "$done_pid" ]] || { cleanup; exit "${code:-1}"; }  # wait itself was interrupted
  rest=(); for p in "${running[@]}"; do [[ $p == "$done_pid" ]] || rest+=("$p"); done
  running=("${rest[@]}")
  if [[ $code -ne 0 && $rc -eq 0 ]]; then
    rc=$code
    echo "launch_cluster.sh: a trainer process (pid $done_pid) exited with $code; stopping the others" >&2
    cleanup
  fi
done
exit $rc
