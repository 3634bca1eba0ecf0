#!/usr/bin/env bash
# Take docs/flower.png: Flower's tasks page while a small job runs.
#
# Starts, on free loopback ports in a temporary directory, everything a head node and one inference node
# run — redis-server, the SGLang simulator, a worker and Flower with basic auth, with the same flags as
# deploy/head/docker-compose.yml — then submits a small two-dataset job with the test tokenizer, waits
# until Flower lists both running and finished tasks, holds that moment (the simulator stalls: the requests
# at it stay there) and screenshots /tasks with headless Chromium. Everything it started is stopped on exit.
#
# What the page shows (workers/events.py): a task is STARTED from the moment its request goes to the SGLang
# server until its outcome; RECEIVED while it waits for a request slot; its RUNTIME is the generation's wall
# time, from that request going out to its row stored. tests/test_flower.py checks the same on every CI run.
#
# Needs: the project venv (.venv), redis-server and chromium (apt-get install -y redis-server chromium).
# Usage: bash scripts/flower_screenshot.sh [OUT.png]     (default docs/flower.png)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$(realpath -m "${1:-docs/flower.png}")
VENV=$ROOT/.venv/bin
for tool in redis-server chromium; do
  command -v "$tool" >/dev/null || { echo "$tool is missing: apt-get install -y ${tool/redis-server/redis-server}" >&2; exit 1; }
done

WORK=$(mktemp -d -t thinkfleet-flower-XXXXXX)
PIDS=()
cleanup() {
  # Stop only what this script started, newest first (the worker before the server it talks to).
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { "$VENV/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() {  # wait_port PORT WHAT
  for _ in $(seq 300); do
    if "$VENV/python" -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$2 did not listen on port $1; logs in $WORK" >&2; exit 1
}

REDIS_PORT=$(free_port); SIM_PORT=$(free_port); FLOWER_PORT=$(free_port); METRICS_PORT=$(free_port)
AUTH=operator:flower-demo

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$WORK" --save "" \
  --appendonly yes --appendfsync everysec --maxmemory-policy noeviction --logfile "$WORK/redis.log" &
PIDS+=($!)
wait_port "$REDIS_PORT" redis-server

# A slow clock (5 simulated seconds per wall second at 40 tok/s per request) keeps requests running
# for a few seconds each, so the page shows tasks in flight next to finished ones.
"$VENV/sglang-sim" --port "$SIM_PORT" --time-scale 5 --model-path moonshotai/Kimi-K2.5 >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_port "$SIM_PORT" sglang-sim

export THINKFLEET_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
export THINKFLEET_SGLANG_URL=http://127.0.0.1:$SIM_PORT
export THINKFLEET_OUTPUT_URI=$WORK/output
export THINKFLEET_METRICS_PORT=$METRICS_PORT
export THINKFLEET_MAX_INFLIGHT=12

(cd "$WORK" && exec "$VENV/worker" --name gpu-node-01 --loglevel INFO >"$WORK/worker.log" 2>&1) &
PIDS+=($!)
wait_port "$METRICS_PORT" worker

# The head node's Flower command (deploy/head/docker-compose.yml), on loopback and a scratch state file.
(cd "$WORK" && FLOWER_BASIC_AUTH=$AUTH exec "$VENV/celery" -A workers.app flower \
  --port="$FLOWER_PORT" --address=127.0.0.1 --persistent=True --db="$WORK/flower.db" \
  --state_save_interval=60000 --max_tasks=250000 --purge_offline_workers=86400 \
  --tasks_columns=name,uuid,state,args,received,runtime,worker >"$WORK/flower.log" 2>&1) &
PIDS+=($!)
wait_port "$FLOWER_PORT" flower

# A small job: two datasets of plain prompts, rendered with the Kimi-shaped test tokenizer.
"$VENV/python" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
from testing.tokenizer import build_test_tokenizer
work = Path(sys.argv[1])
build_test_tokenizer(work / "tokenizer")
for name, count, template in (
    ("math", 30, "Question {i}: a train travels {i} km at 60 km/h. How long does it take? Think step by step."),
    ("code", 60, "Review function number {i} and explain how to make it faster."),
):
    with open(work / f"{name}.jsonl", "w") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"{i:04d}", "prompt": template.format(i=i)}) + "\n")
EOF
"$VENV/producer" submit "$WORK/math.jsonl" "$WORK/code.jsonl" --job k25-demo \
  --tokenizer "$WORK/tokenizer" --max-new-tokens 2048 >"$WORK/submit.log" 2>&1

# Until Flower shows finished tasks and running ones of the second dataset, so the page has both
# states and both datasets (its API answers with the same auth).
"$VENV/python" - "$FLOWER_PORT" "$AUTH" <<'EOF'
import base64, json, sys, time, urllib.request
port, auth = sys.argv[1], sys.argv[2]
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/api/tasks?limit=1000",
    headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()},
)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    tasks = json.load(urllib.request.urlopen(request, timeout=5)).values()
    running_code = [t for t in tasks if t["state"] == "STARTED" and "'code'" in (t["args"] or "")]
    if len(running_code) >= 3 and sum(t["state"] == "SUCCESS" for t in tasks) >= 10:
        sys.exit(0)
    time.sleep(0.5)
sys.exit("Flower did not show running and finished tasks of both datasets within 120 s")
EOF

# Hold the moment: the simulator answers nothing for a while (its generations freeze, the worker keeps
# waiting for them), so the picture shows the tasks above, not whatever is left once Chromium has started.
# Once Flower's view stops moving (the events already sent have arrived), the page is taken.
"$VENV/python" - "$SIM_PORT" "$FLOWER_PORT" "$AUTH" <<'EOF'
import base64, json, sys, time, urllib.request
sim_port, port, auth = sys.argv[1:4]
stall = urllib.request.Request(f"http://127.0.0.1:{sim_port}/control/stall", data=b'{"seconds": 120}',
                               headers={"Content-Type": "application/json"}, method="POST")
urllib.request.urlopen(stall, timeout=5).read()
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/api/tasks?limit=1000",
    headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()},
)
seen, deadline = None, time.monotonic() + 60
while time.monotonic() < deadline:
    states = {uuid: t["state"] for uuid, t in json.load(urllib.request.urlopen(request, timeout=5)).items()}
    if states == seen:
        sys.exit(0)
    seen = states
    time.sleep(1.5)
sys.exit("Flower's view kept moving while the simulator stalled")
EOF

mkdir -p "$(dirname "$OUT")"
# --virtual-time-budget lets the page's table request finish before the picture is taken.
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --user-data-dir="$WORK/chromium" --hide-scrollbars \
  --window-size=1400,900 --virtual-time-budget=5000 --screenshot="$OUT" \
  "http://$AUTH@127.0.0.1:$FLOWER_PORT/tasks" >"$WORK/chromium.log" 2>&1
echo "wrote $OUT"
