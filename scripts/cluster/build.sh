#!/usr/bin/env bash
# Build the one-node cluster's components from their Go modules into a cache keyed by version:
#   $MPSD_CLUSTER_CACHE/bin/<name>-<version>/   (default cache: /var/cache/mpsd-cluster)
# A component whose directory holds .done is not built again, so a second run builds nothing.
# Each .done holds the seconds its cold build took (docs/benchmarks.md).
# Prints "<name> <dir>" for each component.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/versions.sh"
cache=${MPSD_CLUSTER_CACHE:-/var/cache/mpsd-cluster}
command -v go >/dev/null || { echo "build.sh: go not found on PATH (Go 1.26 builds the cluster's components)" >&2; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
nice=(nice -n "${MPSD_CLUSTER_NICE:-19}")
mkdir -p "$cache/src" "$cache/bin"
# One build at a time per cache: .ci/run starts one in the background while the suite runs, and
# tests/cluster's `cluster.sh up` then waits here for it (a cold build: tens of minutes) rather than
# building the same modules beside it.
exec 9>"$cache/.build.lock"
if ! flock -n 9; then
    echo "waiting for the build already running in $cache (at most ${MPSD_CLUSTER_BUILD_WAIT:-3600} s)" >&2
    flock -w "${MPSD_CLUSTER_BUILD_WAIT:-3600}" 9 || { echo "build.sh: another build held $cache/.build.lock for ${MPSD_CLUSTER_BUILD_WAIT:-3600} s" >&2; exit 1; }
fi

# build NAME VERSION MODULE_DIR LDFLAGS PACKAGE... : go build the packages into bin/NAME-VERSION
build() {
    local name=$1 version=$2 mod=$3 ldflags=$4; shift 4
    local out=$cache/bin/$name-$version
    if [ ! -f "$out/.done" ]; then
        echo "building $name $version (once per machine; see docs/kubernetes.md)" >&2
        local start=$SECONDS
        rm -rf "$out.tmp" && mkdir -p "$out.tmp"
        (cd "$mod" && "${nice[@]}" go build -trimpath -ldflags "-s -w $ldflags" -o "$out.tmp/" "$@") \
            || { echo "build.sh: building $name $version failed (output above)" >&2; exit 1; }
        echo $((SECONDS - start)) >"$out.tmp/.done"
        rm -rf "$out" && mv "$out.tmp" "$out"
    fi
    echo "$name $out"
}

# module DIR MODULE@VERSION [REPLACE...]: a build module requiring MODULE, with replace lines
module() {
    local dir=$1 req=$2; shift 2
    [ -f "$dir/.ready" ] && return 0
    rm -rf "$dir" && mkdir -p "$dir"
    { echo "module mpsd.local/cluster/$(basename "$dir")"; echo; echo "go 1.26"
      for r in "$@"; do echo "replace $r"; done; } >"$dir/go.mod"
    (cd "$dir" && go get "$req" >/dev/null) || { echo "build.sh: cannot fetch Go module $req" >&2; exit 1; }
    touch "$dir/.ready"
}

# Kubernetes: the main module needs each staging module k8s.io/X pinned to v0.<minor>.<patch>.
k8s=$cache/src/kubernetes-$K8S_VERSION
staging=v0.${K8S_VERSION#v1.}
if [ ! -f "$k8s/.ready" ]; then
    gomod=$(cd "$cache/src" && GOFLAGS= go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    [ -n "$gomod" ] || { echo "build.sh: cannot fetch Go module k8s.io/kubernetes@$K8S_VERSION" >&2; exit 1; }
    mapfile -t reps < <(sed -n "s#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1 => \1 $staging#p" "$gomod")
    module "$k8s" "k8s.io/kubernetes@$K8S_VERSION" "${reps[@]}"
    # etcd's server in the same module: the version kubernetes itself requires
    mkdir -p "$k8s/etcd"
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' >"$k8s/etcd/main.go"
    (cd "$k8s" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null) \
        || { rm -f "$k8s/.ready"; echo "build.sh: cannot fetch Go module go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2; exit 1; }
fi
v=k8s.io/component-base/version
cv=k8s.io/client-go/pkg/version
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
kflags=""
for p in $v $cv; do
    kflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
build etcd "$ETCD_VERSION" "$k8s" "" ./etcd
build kubernetes "$K8S_VERSION" "$k8s" "$kflags" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl

ctrd=$cache/src/containerd-$CONTAINERD_VERSION
module "$ctrd" "github.com/containerd/containerd/v2@$CONTAINERD_VERSION"
build containerd "$CONTAINERD_VERSION" "$ctrd" \
    "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    -tags no_btrfs,no_devmapper,no_zfs github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/ctr github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2

# NVIDIA's runtime in CDI mode, as the node's GPU needs it (cdi-runtime/main.go), with containerd's CDI library
rt=$(sha256sum "$here/cdi-runtime/main.go" | cut -c1-12)
mkdir -p "$ctrd/nvidia-cdi-runtime" && cp "$here/cdi-runtime/main.go" "$ctrd/nvidia-cdi-runtime/main.go"
build nvidia-cdi-runtime "$rt" "$ctrd" "" ./nvidia-cdi-runtime

cni=$cache/src/cni-$CNI_VERSION
module "$cni" "github.com/containernetworking/plugins@$CNI_VERSION"
build cni "$CNI_VERSION" "$cni" "" github.com/containernetworking/plugins/plugins/main/bridge \
    github.com/containernetworking/plugins/plugins/ipam/host-local \
    github.com/containernetworking/plugins/plugins/main/loopback \
    github.com/containernetworking/plugins/plugins/meta/portmap

cri=$cache/src/cri-tools-$CRICTL_VERSION
module "$cri" "sigs.k8s.io/cri-tools@$CRICTL_VERSION"
build crictl "$CRICTL_VERSION" "$cri" "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" sigs.k8s.io/cri-tools/cmd/crictl
