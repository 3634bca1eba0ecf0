#!/usr/bin/env bash
# One inference node under Slurm (run by thinkfleet.sbatch, directly or one srun task per node): start this
# node's SGLang server, wait for /health_generate, then run the worker against it under a per-node identity.
#
# Signals: SIGTERM (Slurm's --signal=B:TERM warning forwarded by the sbatch script, a preemption, a scancel)
# drains the worker first — it stops consuming, lets requests finish for THINKFLEET_SHUTDOWN_GRACE_S, commits
# and hands the rest back to the queue — and only then stops the server, so requests finishing during the
# drain still have one. A server that dies drains the worker the same way and the node exits non-zero.
set -uo pipefail

THINKFLEET_HOME="${THINKFLEET_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}}"
# shellcheck source=node.env
source "${THINKFLEET_SLURM_ENV:-$THINKFLEET_HOME/deploy/slurm/node.env}"
py="$THINKFLEET_VENV/bin/python"

log() { echo "[thinkfleet-node $(date -u +%H:%M:%S)] $*" >&2; }

# The worker's identity: Slurm's node name and job id (ARRAYJOB_INDEX for an array element), as squeue shows
# them, so `producer status` lists workers an operator can find with squeue and scancel. A requeued element
# keeps its job id and so its name: its restart takes its own dead heartbeat over.
node="${SLURMD_NODENAME:-$(hostname -s)}"
if [ -n "${SLURM_ARRAY_JOB_ID:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
  job_ref="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
else
  job_ref="${SLURM_JOB_ID:-local}"
fi
export THINKFLEET_WORKER_NAME="${THINKFLEET_WORKER_NAME:-$node-$job_ref}"

if [ "$SGLANG_PORT" = auto ]; then
  SGLANG_PORT="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
export THINKFLEET_SGLANG_URL="http://127.0.0.1:$SGLANG_PORT"

start_server() {
  # shellcheck disable=SC2086  # the flag strings are word-split on purpose, as docker compose splits them
  case "$SGLANG_RUNTIME" in
    venv)
      exec "$SGLANG_VENV/bin/python" -m sglang.launch_server $SGLANG_ARGS $SGLANG_EXTRA_ARGS \
        --host 127.0.0.1 --port "$SGLANG_PORT" ;;
    apptainer)
      exec apptainer exec --nv --bind "$MODEL_PATH:$MODEL_PATH:ro" "$SGLANG_SIF" \
        python3 -m sglang.launch_server $SGLANG_ARGS $SGLANG_EXTRA_ARGS --host 127.0.0.1 --port "$SGLANG_PORT" ;;
    enroot)
      exec enroot start --mount "$MODEL_PATH:$MODEL_PATH" "$SGLANG_ENROOT_NAME" \
        python3 -m sglang.launch_server $SGLANG_ARGS $SGLANG_EXTRA_ARGS --host 127.0.0.1 --port "$SGLANG_PORT" ;;
    sim)
      exec "$THINKFLEET_VENV/bin/sglang-sim" --port "$SGLANG_PORT" $SIM_ARGS ;;
    *)
      log "SGLANG_RUNTIME=$SGLANG_RUNTIME: expected venv, apptainer, enroot or sim"; exit 78 ;;
  esac
}

server=""
worker=""
stopping=""
stop() {  # SIGTERM/SIGINT: drain the worker (if it runs yet), then the server
  stopping=1
  log "signal: draining worker $THINKFLEET_WORKER_NAME"
  if [ -n "$worker" ]; then kill -TERM "$worker" 2>/dev/null; elif [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null; fi
}
trap stop TERM INT

log "node $node job $job_ref: starting SGLang ($SGLANG_RUNTIME) on $THINKFLEET_SGLANG_URL"
start_server &
server=$!

# /health_generate runs a real one-token generation: the worker starts only once the model answers.
deadline=$((SECONDS + ${SGLANG_START_TIMEOUT_S%.*}))
until "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=90)' \
    "$THINKFLEET_SGLANG_URL/health_generate" 2>/dev/null; do
  if [ -n "$stopping" ] || ! kill -0 "$server" 2>/dev/null; then
    wait "$server"; rc=$?
    log "SGLang ended before it was healthy (rc $rc)"; exit $(( stopping ? 0 : (rc ? rc : 1) ))
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    log "SGLang not healthy after ${SGLANG_START_TIMEOUT_S}s: stopping it"
    kill -TERM "$server"; wait "$server"; exit 1
  fi
  sleep 2
done
log "SGLang healthy; worker $THINKFLEET_WORKER_NAME starting"

"$THINKFLEET_VENV/bin/worker" --loglevel "${THINKFLEET_LOG_LEVEL:-INFO}" &
worker=$!

# Until one of the two ends (a trapped signal interrupts wait; stop() has TERMed the worker by then). Bash
# keeps no status of a child once waited for, so each wait's status is kept here.
worker_rc=""
while kill -0 "$worker" 2>/dev/null && kill -0 "$server" 2>/dev/null; do
  ended=""
  wait -n -p ended "$worker" "$server"; rc=$?
  if [ "${ended:-}" = "$worker" ]; then worker_rc=$rc; fi  # -p leaves it unset when a signal interrupts
done
if [ -z "$worker_rc" ] && kill -0 "$worker" 2>/dev/null && [ -z "$stopping" ]; then
  log "SGLang exited: draining the worker"
  kill -TERM "$worker" 2>/dev/null
fi
while [ -z "$worker_rc" ]; do
  wait "$worker"; rc=$?
  kill -0 "$worker" 2>/dev/null || worker_rc=$rc
done
log "worker exited (rc $worker_rc); stopping SGLang"
kill -TERM "$server" 2>/dev/null
while kill -0 "$server" 2>/dev/null; do wait "$server"; done
if [ -n "$stopping" ]; then exit 0; fi
exit $(( worker_rc ? worker_rc : 1 ))  # an end nobody asked for: non-zero, so Slurm reports it
