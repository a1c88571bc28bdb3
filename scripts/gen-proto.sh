#!/usr/bin/env bash
# Regenerates the committed Python gRPC modules of mpsd/plugin and mpsd/dra from their .proto files.
# Needs grpcio-tools (pip install -e '.[test]'). Run from anywhere: scripts/gen-proto.sh
# The protos are compiled with the repository root as include path, so the generated
# modules import each other as mpsd.plugin.*_pb2 and register unique file names
# ("mpsd/plugin/api.proto", "mpsd/dra/dra_v1.proto") in protobuf's descriptor pool.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
PROTOS=(mpsd/plugin/api.proto mpsd/plugin/podresources.proto
        mpsd/dra/dra_v1.proto mpsd/dra/dra_v1beta1.proto mpsd/dra/pluginregistration.proto
        mpsd/dra/dra_health_v1.proto mpsd/dra/dra_health_v1alpha1.proto)
for proto in "${PROTOS[@]}"; do
    "$python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
done
echo "generated: $(ls mpsd/plugin/*_pb2*.py* mpsd/dra/*_pb2*.py* | tr '\n' ' ')"
