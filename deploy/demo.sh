#!/usr/bin/env bash
# The main job: `specdec up` on the embedded default pair (all three services on
# loopback), then one real streamed Generate call. Usage: deploy/demo.sh ["prompt"]
set -euo pipefail
PORT=${SPECDEC_PORT:-50051}
PROMPT=${1:-"Write a short poem about the sea."}

LOG=${SPECDEC_LOGS:-specdec-up.log}

# The services and the launcher write to the log: this terminal shows the answer alone.
echo "demo: starting specdec up (logs in $LOG); the answer streams below" >&2
specdec up --port "$PORT" --logs "$LOG" >>"$LOG" 2>&1 &
UP=$!
trap 'kill "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true' EXIT

specdec generate --address "127.0.0.1:$PORT" --wait 600 --max-new-tokens 96 "$PROMPT"
