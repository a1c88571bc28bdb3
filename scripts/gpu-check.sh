#!/usr/bin/env bash
# One command that shows on a real NVIDIA GPU what mpsd claims, and measures MPS against
# time-slicing (docs/hardware.md). Needs no network: Python packages the machine lacks come
# from wheels in .whl/ (scripts/fetch-wheels.sh, run beforehand on a machine with network).
#
#   scripts/gpu-check.sh [--out DIR] [--dry-run] [--python PY] [--venv DIR] [--wheels DIR]
#                        [--control-binary PATH]
#
# Steps: a virtual environment that reuses the machine's packages (PyTorch, JAX, CuPy, ...),
# the missing ones from .whl/, mpsd installed from this tree (libmpsshim.so built with make);
# what the machine has (GPU, driver, CUDA, PyTorch, MPS binaries and whether they match the
# driver); tests/gpu with pytest (JUnit report); the shim's overhead against the real driver;
# the inference benchmark. Results (results.json, summary.md, pytest-gpu.xml, PNG plots) go to
# --out, default $OUT if set, else results/gpu-<UTC time>. Without a GPU it says so in one line
# and runs the CPU dry-run against the fake driver of tests/fakes. It never changes the card's
# settings, and quits every MPS daemon it started on the way out (trap).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
given="$*"

out=${OUT:-}
dry=auto
python=${GPU_CHECK_PYTHON:-python3}
venv=${GPU_CHECK_VENV:-$repo/.gpu-venv}
control=""
wheels=$repo/.whl
usage="usage: scripts/gpu-check.sh [--out DIR] [--dry-run] [--python PY] [--venv DIR] [--wheels DIR] [--control-binary PATH]"
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --dry-run) dry=yes; shift ;;
        --python) python=${2:?--python needs an interpreter}; shift 2 ;;
        --venv) venv=${2:?--venv needs a directory}; shift 2 ;;
        --wheels) wheels=$(cd "${2:?--wheels needs a directory}" && pwd); shift 2 ;;
        --control-binary) control=${2:?--control-binary needs a path}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "gpu-check: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
[ -n "$out" ] || out="results/gpu-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
out=$(cd "$out" && pwd)

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$dry" = auto ]; then
    if [ "$gpus" -gt 0 ]; then dry=no; else dry=yes; fi
fi
if [ "$gpus" -eq 0 ]; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L lists none): CPU dry-run against the fake driver of tests/fakes"
elif [ "$dry" = yes ]; then
    echo "gpu-check: $gpus GPU(s) here, but --dry-run: CPU dry-run against the fake driver of tests/fakes"
fi
if [ -z "$control" ]; then
    control=$(command -v nvidia-cuda-mps-control || true)
    cached=$repo/.cache/mps/root/usr/bin/nvidia-cuda-mps-control
    if [ -z "$control" ] && [ "$dry" = yes ] && [ -x "$cached" ]; then control=$cached; fi
fi

if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    if command -v gcc >/dev/null 2>&1; then export CC=gcc; else
        echo "gpu-check: no C compiler (cc or gcc) on PATH: libmpsshim.so cannot be built" >&2; exit 1
    fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
chmod 711 "$work"
cleanup() {
    if [ -x "$venv/bin/python" ] && [ -n "$control" ]; then
        "$venv/bin/python" benchmarks/gpu_check.py cleanup "$work" "$control" || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- install: a venv that sees the machine's packages, the missing ones from .whl/, mpsd itself
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages --without-pip "$venv"
fi
# pip, setuptools and the rest come from the interpreter it was made from. A venv made from a
# venv (the lent machine's python3 is one) reaches only the base interpreter
# through --system-site-packages: point it at the parent's site-packages as well.
parent_sites=$("$python" -c 'import site, sys; print("\n".join(site.getsitepackages()))')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$parent_sites" > "$venv_site/gpu-check-parent.pth"
vpy=$venv/bin/python

missing=$("$vpy" - <<'PY'
import importlib.util
need = {"cffi": "cffi", "yaml": "pyyaml", "psutil": "psutil", "prometheus_client": "prometheus-client",
        "grpc": "grpcio", "google.protobuf": "protobuf", "pynvml": "nvidia-ml-py", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "numpy": "numpy", "setuptools": "setuptools"}
def have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except ImportError:
        return False
wanted = [dist for mod, dist in need.items() if not have(mod)]
# Present but too old counts as missing: the lent machine's image had grpcio 1.84.0, below what
# mpsd's generated gRPC code needs (mpsd/grpcdeps.py), and `mpsd status` died of it.
from mpsd import grpcdeps
for dist, minimum in (("grpcio", grpcdeps.GRPCIO_MIN), ("protobuf", grpcdeps.PROTOBUF_MIN)):
    if any(problem.startswith(dist + " ") for problem in grpcdeps.missing()):
        wanted = [w for w in wanted if w != dist] + [f"{dist}>={minimum}"]
print(" ".join(wanted))
PY
)
install_note="all Python packages were already there"
if [ -n "$missing" ]; then
    if compgen -G "$wheels/*.whl" >/dev/null; then
        echo "gpu-check: installing from $wheels: $missing"
        # one package at a time: a wheel that is not there must not keep the others out
        done_list="" failed_list=""
        for req in $missing; do
            if "$vpy" -m pip install -q --no-index --find-links "$wheels" "$req"; then
                done_list+=" $req"
            else
                failed_list+=" $req"
            fi
        done
        install_note="installed from $wheels:${done_list:- nothing}"
        [ -z "$failed_list" ] || install_note+="; pip could not install from $wheels:$failed_list"
    else
        install_note="missing, and no wheels in $wheels (run scripts/fetch-wheels.sh where there is network): $missing"
    fi
    echo "gpu-check: $install_note"
fi
make -s -C csrc OUT="$repo/shim/libmpsshim.so" lib
project_note="pip install -e . (no deps, no build isolation)"
if ! "$vpy" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$work/pip-project.log" 2>&1; then
    project_note="pip install -e . failed ($(tail -n 1 "$work/pip-project.log")); using PYTHONPATH=$repo"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu-check: $project_note"
fi
"$vpy" - "$work/install.json" "$venv" "$install_note" "$project_note" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
path, venv, packages, project, seconds = sys.argv[1:]
json.dump({"venv": venv, "packages": packages, "project": project, "seconds": int(seconds)}, open(path, "w"))
PY
echo "gpu-check: installed in $(( $(date +%s) - start ))s into $venv"

args=(--out "$out" --work "$work" --command "scripts/gpu-check.sh${given:+ $given}")
[ "$dry" = yes ] && args+=(--dry-run)
[ -n "$control" ] && args+=(--control-binary "$control")
"$vpy" benchmarks/gpu_check.py "${args[@]}"
