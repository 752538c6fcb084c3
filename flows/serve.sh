#!/usr/bin/env bash
# `make serve`: serve the scheduled deployments. Without PREFECT_API_URL, first start a local
# Prefect server (SQLite under $PREFECT_HOME, bound to 127.0.0.1) and stop it on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_EXTRA_LOGGERS=batchlab

if [ -z "${PREFECT_API_URL:-}" ]; then
  port=${PREFECT_PORT:-4200}
  mkdir -p "${PREFECT_HOME:-.prefect}"
  "$BIN/prefect" server start --host 127.0.0.1 --port "$port" >"${PREFECT_HOME:-.prefect}/server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  export PREFECT_API_URL="http://127.0.0.1:$port/api"
  for _ in $(seq 120); do
    "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
      "$PREFECT_API_URL/health" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "${PREFECT_HOME:-.prefect}/server.log"; exit 1; }
    sleep 1
  done
  echo "Prefect server: http://127.0.0.1:$port (log: ${PREFECT_HOME:-.prefect}/server.log)"
fi
exec "$BIN/python" flows/serve.py
