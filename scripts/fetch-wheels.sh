#!/usr/bin/env bash
# Download, on a machine WITH network, the wheels that scripts/gpu-check.sh installs on a GPU
# machine WITHOUT network: into .whl/ (ignored by git; carry it with the working tree).
#
#   scripts/fetch-wheels.sh [--python-version 3.12] [--dest DIR] [PACKAGE ...]
#
# Default packages: cffi (the lent GPU image lacks it; it brings pycparser), grpcio and protobuf
# (the image's grpcio 1.84.0 is older than mpsd's generated gRPC code needs: mpsd/grpcdeps.py).
# Name more to add them (e.g. `cffi pytest-timeout`): gpu-check installs from .whl/ whatever the
# machine is missing among mpsd's and the tests' requirements. Binary wheels only, for CPython of
# the given version on manylinux x86-64; their dependencies come too. The folder is emptied first,
# so it holds one version of each package (two versions of one stop pip's offline install).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12
dest=.whl
usage="usage: scripts/fetch-wheels.sh [--python-version X.Y] [--dest DIR] [PACKAGE ...]"
pkgs=()
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) pyver=${2:?--python-version needs X.Y}; shift 2 ;;
        --dest) dest=${2:?--dest needs a directory}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        -*) echo "fetch-wheels: unknown option '$1'; $usage" >&2; exit 2 ;;
        *) pkgs+=("$1"); shift ;;
    esac
done
if ! [[ $pyver =~ ^3\.[0-9]+$ ]]; then
    echo "fetch-wheels: --python-version '$pyver' is not X.Y (e.g. 3.12)" >&2
    exit 2
fi
[ ${#pkgs[@]} -gt 0 ] || pkgs=(cffi 'grpcio>=1.85.1' 'protobuf>=7.35.1')
python=$(command -v python3 || command -v python)
mkdir -p "$dest"
rm -f "$dest"/*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$dest" "${pkgs[@]}"
echo "fetch-wheels: in $dest for CPython $pyver x86-64 ($(du -sh "$dest" | cut -f1)):"
ls -1 "$dest"
