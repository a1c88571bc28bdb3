#!/usr/bin/env bash
# The project's test command (README.md): installs what the tests need, then runs them.
# Works on a bare machine as root; a fresh virtual environment in .venv keeps the system clean.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for tool in cc make dpkg-deb apt-get; do command -v "$tool" >/dev/null 2>&1 || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
    echo "installing system packages for: ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc make dpkg >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
exec .venv/bin/python -m pytest "$@"
