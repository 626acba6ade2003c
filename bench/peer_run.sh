#!/usr/bin/env bash
# One timed hold of the llama-server peer comparison: start a server, wait until it answers,
# load it with `sarathi bench --url` at fixed QPS points, stop it. Run under the exclusive lock:
#   flock -x /tmp/sarathi-cpu.lock bench/peer_run.sh sarathi  OUT QPS_LIST [TOKEN_BUDGET]
#   flock -x /tmp/sarathi-cpu.lock bench/peer_run.sh llama    OUT QPS_LIST
# Workload (both servers): the shipped ShareGPT-4 length trace x0.125, Poisson, seed 0,
# $DURATION s of arrivals + $DRAIN s drain per QPS point. The server log goes to OUT.server.log.
set -euo pipefail
KIND="$1"; OUT="$2"; QPS="$3"; TAU="${4:-bench/results/paper/plan_strict.json}"
DURATION="${DURATION:-60}"; DRAIN="${DRAIN:-30}"
PY="${PY:-/work/main/.venv/bin/python}"
GGUF="$("$PY" -c 'from shared.model_source import default_gguf_path; print(default_gguf_path())')"
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
if [[ "$KIND" == llama ]]; then
  BIN="$(bench/build_llama_server.sh)"   # cached: prints the path, builds only if missing
  SERVER=("$BIN" -m "$GGUF" -np 16 -c 65536 -t 2 --host 127.0.0.1 --port "$PORT")
else
  SERVER=("$PY" -m sarathi.cli serve --model "$GGUF" --threads 2 --token-budget "$TAU" --host 127.0.0.1 --port "$PORT")
fi
echo "server: ${SERVER[*]}" | tee "$OUT.server_cmd.txt"
"${SERVER[@]}" > "$OUT.server.log" 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null; wait $SPID 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  curl -fs "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 $SPID 2>/dev/null || { echo "server exited; see $OUT.server.log" >&2; exit 1; }
  sleep 0.5
done
curl -fs "http://127.0.0.1:$PORT/v1/models" >/dev/null || { echo "server not ready in 120 s" >&2; exit 1; }
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)" | tee -a "$OUT.server_cmd.txt"
"$PY" -m sarathi.cli bench --url "http://127.0.0.1:$PORT" --vocab-size 49152 --length-scale 0.125 \
  --duration "$DURATION" --drain "$DRAIN" --qps "$QPS" --seed 0 --tbt-slo 2.064 --no-progress --out "$OUT"
