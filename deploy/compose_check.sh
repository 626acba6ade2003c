#!/usr/bin/env bash
# Brings up docker-compose.yml for real on a machine without a container registry, runs the
# `openai` client against it (deploy/compose_smoke.py), and tears it down. Needs root (dockerd,
# debootstrap) and Docker Compose (v2 `docker compose`, or Debian's `docker-compose` 1.29).
#   deploy/compose_check.sh [OUT_JSON]     (default bench/results/deploy/compose_check.json)
# Steps: a local Debian base image (deploy/local_base_image.sh, skipped when it exists), wheels
# from this host's pip configuration (deploy/wheelhouse.sh, skipped when present), the project
# image built from them with nothing fetched, then the stack with Redis from that image
# (docker-compose.local.yml). A failed step leaves the services' logs in the output's folder.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/deploy/compose_check.json}
BASE=${BASE_IMAGE:-sarathi-base:bookworm}
PY=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}
PROJECT=sarathi-check
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
FILES=(-f docker-compose.yml -f docker-compose.local.yml)
mkdir -p "$(dirname "$OUT")"
t0=$(date +%s)

deploy/local_base_image.sh "$BASE"
ls deploy/wheelhouse/*.whl >/dev/null 2>&1 || PYTHON="$PY" deploy/wheelhouse.sh "$BASE"
tb=$(date +%s)
docker build -q --build-arg BASE_IMAGE="$BASE" -t sarathi-serve:latest . >/dev/null
build_s=$(( $(date +%s) - tb ))

down() { "${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
trap down EXIT
down
"${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" up -d --no-build
if ! smoke=$("$PY" deploy/compose_smoke.py --wait 600); then
    "${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" logs --no-color > "${OUT%.json}.logs.txt" 2>&1 || true
    echo "compose check FAILED; logs in ${OUT%.json}.logs.txt" >&2
    exit 1
fi
services=$("${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" ps --services | sort | tr '\n' ' ')
"$PY" - "$OUT" "$smoke" "$build_s" "$(( $(date +%s) - t0 ))" "$services" "${COMPOSE[*]}" <<'PY'
import datetime, json, platform, subprocess, sys
out, smoke, build_s, total_s, services, compose = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
res = {"command": "deploy/compose_check.sh " + out, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "machine": f"{cpu}, {platform.platform()}",
       "docker": subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True).stdout.strip(),
       "compose": compose, "services": services.split(), "image_build_s": int(build_s), "total_s": int(total_s),
       "smoke": json.loads(smoke)}
open(out, "w").write(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PY
