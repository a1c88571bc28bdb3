"""Latency of the DRA plugin's NodePrepareResources and NodeUnprepareResources, called through
gRPC (dra v1) on a unix socket as the kubelet calls them.

    .venv/bin/python benchmarks/dra_prepare.py [--calls 300] [--claims 1,16]

For each claim count: ``--calls`` rounds of one NodePrepareResources naming that many new
claims (each gets a region directory, a CDI spec written atomically and two journal lines
fdatasync'd before the answer), then one NodeUnprepareResources of the same claims (spec,
directory and one journal line each). The API server is not measured: claims come from a dict
(the stand-in for mpsd/dra/kubeapi.py answers at once). Claims are capacity-mode, 4Gi of an
80 GiB GPU; NVIDIA CDI specs are looked up on every answer as mpsd run does (there are none).
Prints p50, p99, mean and max per call in milliseconds. Everything lives in a
temporary directory under $TMPDIR (the syncs go to that file system).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.allocate_latency import summary  # noqa: E402
from mpsd.dra import dra_v1_pb2, dra_v1_pb2_grpc  # noqa: E402
from mpsd.dra.cdi import CdiDir  # noqa: E402
from mpsd.dra.kubeletplugin import DraPlugin  # noqa: E402
from mpsd.dra.prepared import PreparedClaim, Preparer  # noqa: E402
from mpsd.inventory.nvml import Gpu  # noqa: E402

try:  # NVIDIA's CDI specs looked up on every answer, as mpsd run does (none here); absent before it existed
    from mpsd.dra.nvidiacdi import NvidiaSpecs  # noqa: E402
except ImportError:
    NvidiaSpecs = None
from mpsd.alloc.container import HostPaths  # noqa: E402
from mpsd.alloc.state import StateStore  # noqa: E402

NODE = "bench-node"
GIB = 1 << 30


def claim(uid: str) -> dict:
    return {
        "metadata": {"namespace": "bench", "name": uid, "uid": uid},
        "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.mpsd.io", "pool": NODE, "device": "gpu-0",
                                     "consumedCapacity": {"memory": "4Gi", "compute": "5"}}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
        }},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--claims", default="1,16", help="claims per call, comma-separated")
    parser.add_argument("--instance", default="", help="an instance name (POD_UID): calls serialized across instances")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    root = tempfile.mkdtemp(prefix="drab")
    try:
        paths = HostPaths(pipe_dir=f"{root}/pipe", region_dir=f"{root}/regions", shim_host_dir=f"{root}/lib")
        claims: dict[tuple[str, str], dict] = {}
        preparer = Preparer(
            driver="gpu.mpsd.io", node=NODE, pool=NODE,
            gpus=[Gpu(0, "GPU-00000000-0000-0000-0000-000000000000", "bench", 80 * GIB, 0, (9, 0), False)],
            slices_per_gpu=10, paths=paths, cdi_dir=CdiDir(f"{root}/cdi"),
            store=StateStore(f"{root}/state/dra-state.json", record=PreparedClaim),
            get_claim=lambda ns, name: claims[(ns, name)], dev_dir=f"{root}/dev",
            **({"nvidia": NvidiaSpecs([f"{root}/etc-cdi", f"{root}/cdi"])} if NvidiaSpecs else {}),
        )
        plugin = DraPlugin(preparer, plugins_dir=f"{root}/plugins", registry_dir=f"{root}/registry",
                           **({"instance": args.instance} if args.instance else {}))
        plugin.start()
        channel = grpc.insecure_channel("unix://" + plugin.socket_path, options=[("grpc.enable_http_proxy", 0)])
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        serial = 0
        for per_call in (int(n) for n in args.claims.split(",")):
            prepare_ns, unprepare_ns = [], []
            for _ in range(args.calls):
                refs = []
                for _ in range(per_call):
                    serial += 1
                    uid = f"uid-{serial}"
                    claims[("bench", uid)] = claim(uid)
                    refs.append(dra_v1_pb2.Claim(namespace="bench", name=uid, uid=uid))
                t0 = time.perf_counter_ns()
                reply = stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=refs), timeout=30)
                prepare_ns.append(time.perf_counter_ns() - t0)
                errors = [c.error for c in reply.claims.values() if c.error]
                assert not errors and len(reply.claims) == per_call, errors[:1]
                t0 = time.perf_counter_ns()
                reply = stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=refs), timeout=30)
                unprepare_ns.append(time.perf_counter_ns() - t0)
                assert not any(c.error for c in reply.claims.values())
            print(summary(f"prepare  x{per_call}", prepare_ns))
            print(summary(f"unprep   x{per_call}", unprepare_ns))
        channel.close()
        plugin.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
