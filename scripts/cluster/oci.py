"""Write an OCI image archive (the layout of the OCI image spec, as one tar) from layer tars.

    python3 oci.py layer DIR OUT.tar        (a layer of the tree under DIR)
    python3 oci.py OUT.tar --name localhost/mpsd:0.1.0 --layer base.tar --layer app.tar \
        --entrypoint mpsd --cmd run --cmd --config --cmd /etc/mpsd/config.yaml --label k=v

Reproducible: the same layers and arguments give the same bytes (gzip and tar headers carry
SOURCE_DATE_EPOCH, default 0, and no host name, user or order of the file system). The archive
names the image twice in index.json: org.opencontainers.image.ref.name (podman load) and
io.containerd.image.name (ctr images import).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import time

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def gzipped(data: bytes, mtime: int) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=mtime, compresslevel=6, filename="") as gz:
        gz.write(data)
    return out.getvalue()


def descriptor(media: str, data: bytes, **extra: object) -> dict:
    return {"mediaType": media, "digest": digest(data), "size": len(data), **extra}


def image_config(diff_ids: list[str], entrypoint: list[str], cmd: list[str], labels: dict[str, str],
                 created: str) -> dict:
    return {
        "created": created, "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": [PATH], "Labels": labels,
                   "ExposedPorts": {"9400/tcp": {}}, "User": "0"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": created, "created_by": "scripts/image.sh"} for _ in diff_ids],
    }


def blobs(layers: list[bytes], name: str, entrypoint: list[str], cmd: list[str],
          labels: dict[str, str], epoch: int) -> tuple[dict[str, bytes], bytes]:
    """The archive's blobs by digest and its index.json."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    out: dict[str, bytes] = {}
    layer_descs = []
    for raw in layers:
        gz = gzipped(raw, epoch)
        out[digest(gz)] = gz
        layer_descs.append(descriptor(LAYER, gz))
    config = json.dumps(image_config([digest(raw) for raw in layers], entrypoint, cmd, labels, created),
                        sort_keys=True, separators=(",", ":")).encode()
    out[digest(config)] = config
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": descriptor(CONFIG, config),
                           "layers": layer_descs}, sort_keys=True, separators=(",", ":")).encode()
    out[digest(manifest)] = manifest
    annotations = {"org.opencontainers.image.ref.name": name, "io.containerd.image.name": name}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [descriptor(MANIFEST, manifest, annotations=annotations)]}
    return out, json.dumps(index, sort_keys=True, separators=(",", ":")).encode()


def write_archive(path: str, blob_map: dict[str, bytes], index: bytes, epoch: int) -> None:
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
    for d, data in blob_map.items():
        files["blobs/sha256/" + d.split(":", 1)[1]] = data
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, epoch
            tar.addfile(info, io.BytesIO(files[name]))
    os.replace(tmp, path)


def write_layer(root: str, out: str, epoch: int) -> None:
    """A layer tar of the tree under root: sorted, owner root, times epoch, modes kept."""
    def entries(top: str):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                yield os.path.join(dirpath, name)
    with tarfile.open(out + ".tmp", "w", format=tarfile.PAX_FORMAT) as tar:
        for path in entries(root):
            info = tar.gettarinfo(path, os.path.relpath(path, root))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = epoch
            info.pax_headers = {}
            if info.isfile():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    os.replace(out + ".tmp", out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["layer"]:
        if len(argv) != 3:
            print("usage: oci.py layer DIR OUT.tar", file=sys.stderr)
            return 2
        write_layer(argv[1], argv[2], int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
        return 0
    p = argparse.ArgumentParser(prog="oci.py", description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--name", required=True)
    p.add_argument("--layer", action="append", required=True)
    p.add_argument("--entrypoint", action="append", default=[])
    p.add_argument("--cmd", action="append", default=[])
    p.add_argument("--label", action="append", default=[])
    a = p.parse_args(argv)
    labels = {}
    for item in a.label:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    layers = []
    for path in a.layer:
        with open(path, "rb") as f:
            layers.append(f.read())
    blob_map, index = blobs(layers, a.name, a.entrypoint, a.cmd, labels, epoch)
    write_archive(a.out, blob_map, index, epoch)
    print(json.loads(index)["manifests"][0]["digest"])  # the manifest's digest: the image's ID
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
