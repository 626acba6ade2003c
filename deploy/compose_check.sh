#!/usr/bin/env bash
# Brings up two stacks for real on a machine without a container registry, one after the other:
# docker-compose.yml (colocated) and the prefill/decode one (+ docker-compose.disagg.yml); runs
# the `openai` client against each (deploy/compose_smoke.py), and tears it down. Needs root (dockerd,
# debootstrap) and Docker Compose (v2 `docker compose`, or Debian's `docker-compose` 1.29).
#   deploy/compose_check.sh [OUT_JSON]     (default bench/results/deploy/compose_check.json)
# Steps: a local Debian base image (deploy/local_base_image.sh, skipped when it exists), wheels
# from this host's pip configuration (deploy/wheelhouse.sh, skipped when present), the project
# image built from them with nothing fetched, then the stack with Redis from that image
# (docker-compose.local.yml). A failed step leaves the services' logs in the output's folder.
# Secrets on, as in production: a fresh API key and Redis password, and the internal links' CURVE
# keys (`sarathi keys`, when the image has the command), in a private temporary directory that is
# removed at the end; the smoke checks that a request without the key is refused and that Redis
# refuses a client without the password.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/deploy/compose_check.json}
BASE=${BASE_IMAGE:-sarathi-base:bookworm-nocc}
PY=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}
PROJECT=sarathi-check
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
FILES=(-f docker-compose.yml -f docker-compose.local.yml)
mkdir -p "$(dirname "$OUT")"
t0=$(date +%s)

deploy/local_base_image.sh "$BASE"
ls deploy/wheelhouse/*.whl >/dev/null 2>&1 || PYTHON="$PY" deploy/wheelhouse.sh "$BASE"
tb=$(date +%s)
IMAGE=sarathi-serve:0.1.0   # the tag the compose files pin
docker build -q --build-arg BASE_IMAGE="$BASE" -t "$IMAGE" . >/dev/null
build_s=$(( $(date +%s) - tb ))
image_mb=$(( $(docker image inspect "$IMAGE" --format '{{.Size}}') / 1048576 ))

# secrets: readable by the image's user (uid 10001) only, in a directory only we can enter
SARATHI_SECRETS_DIR=$(mktemp -d)
export SARATHI_SECRETS_DIR
cleanup_secrets() { rm -rf "$SARATHI_SECRETS_DIR"; }
trap cleanup_secrets EXIT
openssl rand -hex 32 > "$SARATHI_SECRETS_DIR/redis_password"
SARATHI_API_KEY=$(openssl rand -hex 24)
export SARATHI_API_KEY
mkdir -p "$SARATHI_SECRETS_DIR/link-keys"
chown -R 10001:10001 "$SARATHI_SECRETS_DIR/link-keys"
if docker run --rm --entrypoint sarathi "$IMAGE" keys --help >/dev/null 2>&1; then
    docker run --rm -v "$SARATHI_SECRETS_DIR/link-keys:/keys" --entrypoint sarathi "$IMAGE" keys /keys >/dev/null
    LINK_KEYS=on
else
    LINK_KEYS=off   # an image without `sarathi keys`: the links run on the project network only
fi
chown 10001:10001 "$SARATHI_SECRETS_DIR/redis_password"
chmod 0400 "$SARATHI_SECRETS_DIR/redis_password"

# one stack after the other: colocated (docker-compose.yml) and prefill/decode disaggregated
# (+ docker-compose.disagg.yml), each brought up, smoke-tested with the openai client, torn down
STACKS=(colocated disagg)
declare -A EXTRA=([colocated]="" [disagg]="-f docker-compose.disagg.yml")
# the P/D stack runs with every prompt disaggregated, so that the smoke's short prompts move KV
declare -A ENVS=([colocated]="" [disagg]="SARATHI_DISAGGREGATION=all")
declare -A SMOKE=([colocated]="" [disagg]="--expect-handoffs")
RESULTS=()
for stack in "${STACKS[@]}"; do
    # shellcheck disable=SC2206
    files=("${FILES[@]}" ${EXTRA[$stack]})
    down() { "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
    trap 'down; cleanup_secrets' EXIT
    down
    ts=$(date +%s)
    env ${ENVS[$stack]} "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" up -d --no-build
    # shellcheck disable=SC2086
    if ! smoke=$("$PY" deploy/compose_smoke.py --wait 600 ${SMOKE[$stack]}); then
        "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" logs --no-color > "${OUT%.json}.$stack.logs.txt" 2>&1 || true
        echo "compose check FAILED ($stack); logs in ${OUT%.json}.$stack.logs.txt" >&2
        exit 1
    fi
    # the workers run the native kernels built into the image (no compiler in it), not the torch path
    backend=$("${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" logs --no-color 2>&1 | grep -o "device cpu: .*" | sort -u)
    if ! grep -q "attention native.*kernels: prebuilt" <<<"$backend"; then
        echo "compose check FAILED ($stack): the workers do not run the prebuilt native kernels: $backend" >&2
        exit 1
    fi
    # Redis without the password: refused
    noauth=$("${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" exec -T redis redis-cli ping 2>&1 || true)
    case "$noauth" in
        *NOAUTH*) ;;
        *) echo "compose check FAILED ($stack): Redis answered without the password: $noauth" >&2; exit 1 ;;
    esac
    smoke=$("$PY" -c 'import json, sys; d = json.loads(sys.argv[1]); d["redis_without_password"] = "NOAUTH"; d["link_keys"] = sys.argv[2]; print(json.dumps(d))' "$smoke" "$LINK_KEYS")
    services=$("${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" ps --services | sort | tr '\n' ' ')
    RESULTS+=("$stack" "${files[*]}" "$services" "$(( $(date +%s) - ts ))" "$smoke" "$backend")
    down
    trap cleanup_secrets EXIT
done
"$PY" - "$OUT" "$build_s" "$image_mb" "$(( $(date +%s) - t0 ))" "${COMPOSE[*]}" "${RESULTS[@]}" <<'PY'
import datetime, json, platform, subprocess, sys
out, build_s, image_mb, total_s, compose, *rest = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
stacks = {}
for i in range(0, len(rest), 6):
    name, files, services, seconds, smoke, backend = rest[i:i + 6]
    stacks[name] = {"files": files.split(), "services": services.split(), "up_and_smoke_s": int(seconds),
                    "smoke": json.loads(smoke), "worker_backends": sorted(set(backend.splitlines()))}
res = {"command": "deploy/compose_check.sh " + out, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "machine": f"{cpu}, {platform.platform()}",
       "docker": subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True).stdout.strip(),
       "compose": compose, "image_build_s": int(build_s), "image_mb": int(image_mb), "total_s": int(total_s), "stacks": stacks}
open(out, "w").write(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PY
