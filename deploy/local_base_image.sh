#!/usr/bin/env bash
# A base image without a registry: Debian bookworm from its package mirror with debootstrap, then
# `docker import`. It has python3 + venv (the Dockerfile's BASE_IMAGE), gcc + libgomp (the native
# CPU kernels are built at first use; without a compiler the worker falls back to torch ops) and
# redis-server (the compose check's redis service runs from the same image). Needs root.
#   deploy/local_base_image.sh [IMAGE] [MIRROR]
set -euo pipefail
IMAGE=${1:-sarathi-base:bookworm}
MIRROR=${2:-http://deb.debian.org/debian}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then echo "$IMAGE exists"; exit 0; fi
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,redis-server,gcc,libc6-dev,libgomp1,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import - "$IMAGE"
echo "imported $IMAGE"
