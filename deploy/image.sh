#!/usr/bin/env bash
# Build the sevendb node image with no registry: a Debian base made by debootstrap
# (kept as a local image named by a hash of its recipe, so it is built once), a
# wheelhouse of sevendb[server] made on this machine, and deploy/Dockerfile.
#
#   deploy/image.sh [TAG]              # default sevendb:latest; prints the image id
#
# Needs a running Docker daemon, and debootstrap (as root) when the base is missing.
#   SEVENDB_BASE=IMAGE           use this base instead (python3, python3-venv, useradd)
#   SEVENDB_DEBIAN_MIRROR=URL    debootstrap's mirror (default: debootstrap's own)
#   PYTHON=python3.11            the Python that makes the wheelhouse (default: ./.venv's);
#                                its minor version must be the base's
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-sevendb:latest}"
docker="${DOCKER:-docker}"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
suite=bookworm
include=python3,python3-venv
scratch="$(mktemp -d /var/tmp/sevendb-image.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

# The base: a minimal Debian with Python, imported as an image (no registry needed).
make_base() {
    local rootfs="$scratch/rootfs"
    echo "building the base image $1: debootstrap $suite (a minute or two)" >&2
    debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" \
        ${SEVENDB_DEBIAN_MIRROR:+"$SEVENDB_DEBIAN_MIRROR"} >"$scratch/debootstrap.log" 2>&1 \
        || { tail -20 "$scratch/debootstrap.log" >&2; return 1; }
    rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
    tar -C "$rootfs" -c . | "$docker" import - "$1" >/dev/null
    rm -rf "$rootfs"
}

base="${SEVENDB_BASE:-}"
if [ -z "$base" ]; then
    recipe="$(declare -f make_base; echo "$suite $include")"
    base="sevendb-base:$suite-$(printf '%s' "$recipe" | sha256sum | cut -c1-12)"
    if ! "$docker" image inspect "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null \
            || { echo "no base image $base and no debootstrap to make it (deploy/system-deps.sh)" >&2; exit 1; }
        make_base "$base"
    fi
fi

want="$("$docker" run --rm --network none --entrypoint python3 "$base" \
    -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$want" != "$have" ]; then
    echo "the base $base has Python $want but $py is $have: wheels would not install;" \
        "set PYTHON to a Python $want" >&2
    exit 1
fi

wheels="$scratch/wheels"
# A fixed timestamp makes the sevendb wheel byte-identical for identical sources,
# so an unchanged tree reuses Docker's cached layers.
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-315532800}" PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$py" -m pip wheel --quiet --wheel-dir "$wheels" '.[server]' 2> >(grep -v '^WARNING: Location' >&2)
# The classic builder: Debian's Docker has no buildx, and it needs none here.
DOCKER_BUILDKIT=0 "$docker" build --quiet --network none --file deploy/Dockerfile \
    --build-arg BASE="$base" --tag "$tag" "$wheels" 2>"$scratch/build.log" \
    || { cat "$scratch/build.log" >&2; exit 1; }
