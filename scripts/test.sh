#!/usr/bin/env bash
# The project's test command (README.md): installs what the tests need, then runs them.
# Works on a bare machine as root; a fresh virtual environment in .venv keeps the system clean.
set -euo pipefail
cd "$(dirname "$0")/.."
# tool -> Debian package: the C toolchain, dpkg-deb for the real MPS binary, what the
# full-disk tests mount (a tmpfs, ext4 on a loop device) and unshare with, the real
# containers of tests/container.py (podman, runc, a static busybox for the image),
# Prometheus (promtool for the alerting rules' tests, the server for the live dashboard test),
# openssl for the stand-in API server's TLS certificate (tests/dra), cppcheck, the static
# analyser the C code must pass (tests/core/test_static_analysis.py), and valgrind, whose callgrind
# counts the shim's instructions (benchmarks/shim_instructions.py, tests/shim/test_instructions.py).
export PATH="$PATH:/usr/sbin:/sbin"
need=()
for pair in cc:gcc make:make valgrind:valgrind dpkg-deb:dpkg mount:mount mkfs.ext4:e2fsprogs unshare:util-linux \
        podman:podman runc:runc promtool:prometheus prometheus:prometheus openssl:openssl cppcheck:cppcheck; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
done
# The real one-node cluster's tier (tests/cluster, on with MPSD_CLUSTER=1 as in .ci/run):
# scripts/cluster.sh's bridge, iptables rules and mpsd's image (mmdebstrap, a static pause binary).
if [ "${MPSD_CLUSTER:-}" = 1 ]; then
    for pair in iptables:iptables ip:iproute2 mmdebstrap:mmdebstrap findmnt:util-linux; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
    done
    [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
    command -v go >/dev/null 2>&1 || { echo "test.sh: MPSD_CLUSTER=1 needs Go (1.26) on PATH to build the cluster's components" >&2; exit 1; }
fi
for pkg in busybox-static debian-archive-keyring; do  # the keys: each Debian suite tests/mpsbin.py fetches
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing system packages: ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
exec .venv/bin/python -m pytest "$@"
