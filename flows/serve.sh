#!/usr/bin/env bash
# `make serve`: serve the scheduled deployments. Without PREFECT_API_URL, first start a local
# Prefect server on PREFECT_PORT (SQLite under $PREFECT_HOME, bound to 127.0.0.1); stopping this
# script (Ctrl-C, or SIGTERM to make) stops the server and the serving process together.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_EXTRA_LOGGERS=batchlab

if [ -n "${PREFECT_API_URL:-}" ]; then
  exec "$BIN/python" flows/serve.py
fi

port=${PREFECT_PORT:-4200}
home=${PREFECT_HOME:-.prefect}
mkdir -p "$home"
# before the server starts: its UI asks the API at PREFECT_UI_API_URL, which defaults to
# PREFECT_API_URL and else to port 4200 whatever --port says (every page then stays empty)
export PREFECT_API_URL="http://127.0.0.1:$port/api"
export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-$PREFECT_API_URL}"
pids=()
stop() {  # the serving process first: it pauses the schedules through the server on its way out
  trap - EXIT INT TERM
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    { kill "${pids[i]}" && wait "${pids[i]}"; } 2>/dev/null || true
  done
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# in a session of its own, so that Ctrl-C (SIGINT to the terminal's whole process group) leaves
# it up until the serving process has paused the schedules; stop() ends it after that
"$BIN/python" -c 'import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])' \
  "$BIN/prefect" server start --host 127.0.0.1 --port "$port" >"$home/server.log" 2>&1 &
pids+=($!)
until "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
  "$PREFECT_API_URL/health" 2>/dev/null; do
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$home/server.log"; exit 1; }
  sleep 1
done
echo "Prefect server: http://127.0.0.1:$port (log: $home/server.log)"
# in the background, so that a signal reaches the trap at once (bash runs traps between commands)
"$BIN/python" flows/serve.py &
pids+=($!)
wait "${pids[1]}"
