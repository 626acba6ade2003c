#!/usr/bin/env bash
# A base image without a registry: Debian bookworm from its package mirror with debootstrap, then
# `docker import`. It has python3 + venv (the Dockerfile's BASE_IMAGE) and redis-server (the compose
# check's redis service runs from the same image), and no compiler: like the default slim base,
# the Dockerfile's build stage installs gcc from the Debian mirror and the runtime stage has none.
# Needs root.
#   deploy/local_base_image.sh [IMAGE] [MIRROR]
set -euo pipefail
IMAGE=${1:-sarathi-base:bookworm-nocc}
MIRROR=${2:-http://deb.debian.org/debian}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then echo "$IMAGE exists"; exit 0; fi
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,redis-server,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import - "$IMAGE"
echo "imported $IMAGE"
