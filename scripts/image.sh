#!/usr/bin/env bash
# Build mpsd's container image here, from Debian's packages and this checkout, reproducibly, and
# load it into podman and/or containerd. No registry is needed; nothing is fetched at run time.
#
#   scripts/image.sh [--tag TAG] [--out FILE] [--load podman|containerd|both|none]
#                    [--containerd-address SOCKET]
#
# The image is localhost/mpsd:TAG (default TAG: the chart's appVersion), the chart's default image.
# Layers: a Debian base made by mmdebstrap (bookworm minbase + python3, cached by its package
# list), then the project's wheel (with libmpsshim.so, built by csrc/Makefile) and its dependencies'
# wheels from PyPI, installed into /usr/lib/python3/dist-packages. The OCI archive (FILE, default
# $MPSD_CLUSTER_CACHE/image/mpsd-TAG.oci.tar) is byte-for-byte the same for the same checkout,
# base and wheels (times are SOURCE_DATE_EPOCH: the commit's time). Its manifest digest is printed.
# Pushing it to a registry: docs/kubernetes.md ("Building the image").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${MPSD_CLUSTER_CACHE:-/var/cache/mpsd-cluster}/image
suite=bookworm
packages=python3,python-is-python3,ca-certificates
tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' deploy/helm/mpsd/Chart.yaml)
out="" load=podman address=${CONTAINERD_ADDRESS:-}
usage="usage: scripts/image.sh [--tag TAG] [--out FILE] [--load podman|containerd|both|none] [--containerd-address SOCKET]"
while [ $# -gt 0 ]; do
    case $1 in
        --tag) tag=${2:?--tag needs a value}; shift 2 ;;
        --out) out=${2:?--out needs a file}; shift 2 ;;
        --load) load=${2:?--load needs podman, containerd, both or none}; shift 2 ;;
        --containerd-address) address=${2:?--containerd-address needs a socket}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "image.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "image.sh: --tag '$tag' is not an image tag ([A-Za-z0-9_][A-Za-z0-9_.-]*, at most 128)" >&2; exit 2; }
case $load in podman|containerd|both|none) ;; *) echo "image.sh: --load '$load': expected podman, containerd, both or none" >&2; exit 2 ;; esac
if [ "$load" = containerd ] || [ "$load" = both ]; then
    [ -n "$address" ] || { echo "image.sh: --load $load needs --containerd-address (or CONTAINERD_ADDRESS)" >&2; exit 2; }
    command -v ctr >/dev/null || { echo "image.sh: ctr not found on PATH (scripts/cluster.sh puts containerd's there)" >&2; exit 1; }
fi
for tool in mmdebstrap:mmdebstrap gcc:gcc make:make; do
    command -v "${tool%%:*}" >/dev/null || { echo "image.sh: ${tool%%:*} not found (apt-get install ${tool##*:})" >&2; exit 1; }
done
name=localhost/mpsd:$tag
out=${out:-$cache/mpsd-$tag.oci.tar}
mkdir -p "$cache"
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
py=python3
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. The Debian base, once per package list.
base=$cache/base-$suite-$(echo "$packages" | sha256sum | cut -c1-12).tar
if [ ! -f "$base" ]; then
    echo "image.sh: making the Debian base ($suite: $packages) with mmdebstrap" >&2
    SOURCE_DATE_EPOCH=0 nice -n 19 mmdebstrap --quiet --format=tar --variant=minbase --include="$packages" \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
        "$suite" "$base.tmp" >&2
    mv "$base.tmp" "$base"
fi

# 2. The dependencies' wheels, once per requirement list (binary wheels for Debian's CPython 3.11).
reqs=$($py -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
deps=$cache/wheels-$(echo "$reqs" | sha256sum | cut -c1-12)
if [ ! -d "$deps" ]; then
    echo "image.sh: downloading the dependencies' wheels" >&2
    # shellcheck disable=SC2086 # one requirement a line
    $py -m pip download -q --dest "$deps.tmp" --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 $reqs >&2
    mv "$deps.tmp" "$deps"
fi

# 3. The project's layer: its wheel and the dependencies installed where Debian's python3 finds them.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$py -m pip wheel -q --no-deps --wheel-dir "$work/wheel" . >&2
stage=$work/layer
$py -m pip install -q --no-compile --no-index --find-links "$work/wheel" --find-links "$deps" \
    --target "$stage/usr/lib/python3/dist-packages" mpsd >&2
rm -rf "$stage/usr/lib/python3/dist-packages/bin" # console scripts with this host's interpreter
mkdir -p "$stage/usr/local/bin" "$stage/etc/mpsd"
printf '#!/usr/bin/python3\nimport sys\n\nfrom mpsd.cli import main\n\nsys.exit(main())\n' >"$stage/usr/local/bin/mpsd"
chmod 755 "$stage/usr/local/bin/mpsd"
$py scripts/cluster/oci.py layer "$stage" "$work/app.tar"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
digest=$($py scripts/cluster/oci.py "$out" --name "$name" --layer "$base" --layer "$work/app.tar" \
    --entrypoint mpsd --cmd=run --cmd=--config --cmd=/etc/mpsd/config.yaml \
    --label org.opencontainers.image.title=mpsd --label "org.opencontainers.image.version=$tag" \
    --label "org.opencontainers.image.revision=$revision" --label org.opencontainers.image.licenses=Apache-2.0)
echo "image.sh: $name $digest -> $out" >&2

# 4. Load it.
if [ "$load" = podman ] || [ "$load" = both ]; then
    podman load -q -i "$out" >&2
fi
if [ "$load" = containerd ] || [ "$load" = both ]; then
    ctr --address "$address" -n k8s.io images import "$out" >&2
fi
echo "$name"
