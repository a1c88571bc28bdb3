"""A small, exact renderer for the subset of Kustomize that deploy/ uses.

The manifests are meant for `kubectl apply -k`, and tests compare this renderer with
`kubectl kustomize` wherever kubectl is installed. Where it is not (a bare CI machine), the
tests still render every kustomization through this module. It supports only what deploy/
uses and rejects anything else by name, so a new feature in a kustomization fails loudly
here instead of being silently ignored:

- ``resources``: YAML files (one or more documents) and directories holding a kustomization;
- ``components``: directories whose kustomization is ``kind: Component``;
- ``namespace``: set on every namespaced object of this kustomization;
- ``configMapGenerator``: ``files`` entries, ``behavior`` create|replace, and only with
  ``options.disableNameSuffixHash: true`` (name hashing is not implemented) and ``options.labels``;
- ``patches``: a ``path`` to an RFC 6902 JSON patch (ops add, replace, remove, test) with a
  ``target`` selecting by group/version/kind/name.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "RuntimeClass",
                  "PriorityClass", "CustomResourceDefinition", "StorageClass", "DeviceClass",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "namespace",
                      "configMapGenerator", "patches"}


class KustomizeError(Exception):
    """A kustomization uses something this renderer does not support, or is malformed."""


def render(directory: str | os.PathLike[str]) -> list[Obj]:
    """Objects `kubectl kustomize DIRECTORY` prints (order aside)."""
    return _build(Path(directory).resolve(), component=False)


def key(obj: Obj) -> tuple[str, str, str]:
    meta = obj.get("metadata", {})
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def _kustomization(directory: Path) -> Obj:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text())
            unknown = set(data) - KUSTOMIZATION_KEYS
            if unknown:
                raise KustomizeError(f"{path}: unsupported keys {sorted(unknown)}")
            return data
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _build(directory: Path, *, component: bool) -> list[Obj]:
    data = _kustomization(directory)
    expected = "Component" if component else "Kustomization"
    if data.get("kind", "Kustomization") != expected:
        raise KustomizeError(f"{directory}: kind {data.get('kind')!r}, expected {expected}")
    objects: list[Obj] = []
    for entry in data.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(_build(path, component=False))
        elif path.is_file():
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
        else:
            raise KustomizeError(f"{directory}: resource {entry!r} does not exist")
    for gen in data.get("configMapGenerator", []):
        _generate_config_map(directory, gen, objects)
    for patch in data.get("patches", []):
        _apply_patch(directory, patch, objects)
    for entry in data.get("components", []):
        for obj in _build((directory / entry).resolve(), component=True):
            objects.append(obj)
    namespace = data.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    _check_unique(directory, objects)
    return objects


def _generate_config_map(directory: Path, gen: Obj, objects: list[Obj]) -> None:
    unknown = set(gen) - {"name", "namespace", "files", "behavior", "options"}
    if unknown:
        raise KustomizeError(f"{directory}: configMapGenerator {gen.get('name')}: unsupported {sorted(unknown)}")
    options = dict(gen.get("options") or {})
    labels = options.pop("labels", None)
    if options != {"disableNameSuffixHash": True}:
        raise KustomizeError(f"{directory}: configMapGenerator {gen['name']}: only "
                             "options.disableNameSuffixHash: true (and options.labels) is supported")
    data = {}
    for entry in gen.get("files", []):
        name, _, source = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[name] = (directory / source).read_text()
    meta = {"name": gen["name"]}
    if gen.get("namespace"):
        meta["namespace"] = gen["namespace"]
    if labels:
        meta["labels"] = {str(k): str(v) for k, v in labels.items()}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}
    behavior = gen.get("behavior", "create")
    if behavior == "create":
        objects.append(cm)
        return
    if behavior != "replace":
        raise KustomizeError(f"{directory}: configMapGenerator behavior {behavior!r} is not supported")
    for i, obj in enumerate(objects):
        meta_i = obj.get("metadata", {})
        if obj["kind"] == "ConfigMap" and meta_i["name"] == gen["name"] and \
                meta_i.get("namespace", "") == meta.get("namespace", ""):
            merged = copy.deepcopy(obj)
            merged["data"] = data
            objects[i] = merged
            return
    raise KustomizeError(f"{directory}: configMapGenerator {gen['name']}: nothing to replace")


def _matches(obj: Obj, target: Obj) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    checks = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    unknown = set(target) - set(checks)
    if unknown:
        raise KustomizeError(f"patch target: unsupported selectors {sorted(unknown)}")
    return all(checks[k] == v for k, v in target.items())


def _apply_patch(directory: Path, patch: Obj, objects: list[Obj]) -> None:
    if set(patch) != {"path", "target"}:
        raise KustomizeError(f"{directory}: only patches with path + target are supported: {patch}")
    ops = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise KustomizeError(f"{directory}/{patch['path']}: only JSON 6902 patches are supported")
    hits = [i for i, obj in enumerate(objects) if _matches(obj, patch["target"])]
    if not hits:
        raise KustomizeError(f"{directory}: patch {patch['path']} matches no object")
    for i in hits:
        objects[i] = json_patch(objects[i], ops)


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 add/replace/remove/test on a copy of ``doc``."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if kind not in ("add", "replace", "remove", "test"):
            raise KustomizeError(f"JSON patch op {kind!r} is not supported")
        if kind == "test":
            found = node[int(last)] if isinstance(node, list) else node.get(last)
            if found != op["value"]:
                raise KustomizeError(f"JSON patch test {op['path']}: {found!r} is not {op['value']!r}")
            continue
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            else:
                del node[index]
        else:
            if kind != "add" and last not in node:
                raise KustomizeError(f"JSON patch {kind} {op['path']}: no such member")
            if kind == "remove":
                del node[last]
            else:
                node[last] = copy.deepcopy(op["value"])
    return doc


def _check_unique(directory: Path, objects: list[Obj]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        k = key(obj)
        if k in seen:
            raise KustomizeError(f"{directory}: duplicate object {k}")
        seen.add(k)
