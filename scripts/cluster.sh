#!/usr/bin/env bash
# A real one-node Kubernetes cluster on this machine, with mpsd installed by its Helm chart.
#
#   scripts/cluster.sh up [--mode dra|device-plugin]   start it (builds the components once)
#   scripts/cluster.sh down                            stop it and remove what up made
#   scripts/cluster.sh install [--mode dra|device-plugin]  (re)install the chart in that mode
#   scripts/cluster.sh status                          which of its processes run
#   scripts/cluster.sh restart kubelet|containerd      stop one (TERM, by PID) and start it again
#
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl from
# the k8s.io/kubernetes Go module, etcd, containerd 2 with CDI, the CNI plugins and crictl, all
# built by scripts/cluster/build.sh into $MPSD_CLUSTER_CACHE (default /var/cache/mpsd-cluster) once
# per version. The cluster lives in $MPSD_CLUSTER_DIR (default /var/lib/mpsd-cluster), except what
# the chart and a real node share by path: the kubelet's /var/lib/kubelet, mpsd's host paths and
# the fake GPU's CDI spec /var/run/cdi/nvidia.yaml. Its GPU is the fake one of scripts/demo.sh.
# Network: the bridge mpsd-br0 (10.244.0.1, the node's address); etcd, the controllers and
# health ports on 127.0.0.1. Needs root, cgroups, runc, iptables, openssl, mmdebstrap, go.
# `up` prints `export KUBECONFIG=...` and `export CONTAINERD_ADDRESS=...`; docs/kubernetes.md.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
here=$REPO/scripts/cluster
dir=${MPSD_CLUSTER_DIR:-/var/lib/mpsd-cluster}
cache=${MPSD_CLUSTER_CACHE:-/var/cache/mpsd-cluster}
export MPSD_CLUSTER_CACHE=$cache PATH="$PATH:/usr/sbin:/sbin"
NODE_NAME=mpsd-node NODE_IP=10.244.0.1 POD_CIDR=10.244.0.0/24 BRIDGE=mpsd-br0
SERVICE_CIDR=10.96.0.0/24 SERVICE_IP=10.96.0.1
GPU_UUID=GPU-face0000-0000-0000-0000-000000000000
NVIDIA_CDI_SPEC=/var/run/cdi/nvidia.yaml
CONTAINERD_SOCK=$dir/containerd/containerd.sock
PAUSE_TAG=3.10.2 PAUSE_IMAGE=localhost/pause:3.10.2
# mpsd's DRA face: consumable capacity (beta in 1.36, on), device health in pod status (beta in
# 1.36, on), device taints (GA in 1.37). Named so that a version where they are off still has them.
GATES=DRAConsumableCapacity=true,ResourceHealthStatus=true
KUBELET_GATES="DRAConsumableCapacity: true, ResourceHealthStatus: true"
PROCS=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy)
say() { echo "cluster.sh: $*" >&2; }
die() { say "$*"; exit 1; }
. "$here/pki.sh"
. "$here/node.sh"
. "$here/procs.sh"

usage="usage: scripts/cluster.sh up [--mode dra|device-plugin] | install [--mode dra|device-plugin] | down | status | restart kubelet|containerd"
cmd=${1:-}; shift || true
mode=dra
which=""
while [ $# -gt 0 ]; do
    case $1 in
        kubelet|containerd) [ "$cmd" = restart ] && [ -z "$which" ] || die "unknown argument '$1'; $usage"; which=$1; shift ;;
        --mode) mode=${2:-}; shift 2 || true ;;
        --mode=*) mode=${1#--mode=}; shift ;;
        *) die "unknown argument '$1'; $usage" ;;
    esac
done
case $mode in dra|device-plugin) ;; *) die "--mode '$mode': expected dra or device-plugin" ;; esac

# One line naming what this machine lacks, or nothing.
check_environment() {
    [ "$(id -u)" = 0 ] || die "must run as root (it starts a kubelet and containerd); run it with sudo"
    for ctrl in cpu cpuacct cpuset memory pids; do
        [ -d "/sys/fs/cgroup/$ctrl" ] || grep -qw "$ctrl" /sys/fs/cgroup/cgroup.controllers 2>/dev/null \
            || die "no $ctrl cgroup controller mounted under /sys/fs/cgroup (the kubelet needs cpu, cpuacct, cpuset, memory, pids)"
    done
    grep -qw overlay /proc/filesystems || die "no overlay file system in this kernel (modprobe overlay): containerd's snapshotter needs it"
    if [ ! -d /proc/sys/net/bridge ]; then
        ip link add mpsd-probe0 type bridge 2>/dev/null || die "cannot create a bridge interface (modprobe bridge): the CNI network needs one"
        ip link del mpsd-probe0
    fi
    for tool in runc:runc iptables:iptables openssl:openssl ip:iproute2 mmdebstrap:mmdebstrap gcc:gcc \
            make:make go:golang python3:python3; do
        command -v "${tool%%:*}" >/dev/null || die "${tool%%:*} not found (Debian package ${tool##*:})"
    done
    [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || die "no static C library for the pause image (apt-get install libc6-dev)"
}

components() {
    "$here/build.sh" >"$dir/components" || die "building the components failed (see above)"
    while read -r name path; do
        case $name in
            kubernetes) K8S_BIN=$path ;; etcd) ETCD_BIN=$path ;; containerd) CTRD_BIN=$path ;;
            cni) CNI_BIN=$path ;; crictl) CRICTL_BIN=$path ;; nvidia-cdi-runtime) CDI_RUNTIME=$path/nvidia-cdi-runtime ;;
        esac
    done <"$dir/components"
    export PATH="$K8S_BIN:$CTRD_BIN:$CRICTL_BIN:$ETCD_BIN:$PATH"
}

# The pause image: Kubernetes' own pause.c (from the module), static, as an OCI archive.
pause_image() {
    local p=$cache/bin/pause-$PAUSE_TAG
    if [ ! -f "$p/pause.oci.tar" ]; then
        local src
        src=$(cd "$cache/src/kubernetes-$K8S_VERSION" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
        rm -rf "$p.tmp" && mkdir -p "$p.tmp/root"
        gcc -Os -static -Wall -DVERSION="v$PAUSE_TAG" -o "$p.tmp/root/pause" "$src"
        strip "$p.tmp/root/pause"
        SOURCE_DATE_EPOCH=0 python3 "$here/oci.py" layer "$p.tmp/root" "$p.tmp/layer.tar"
        SOURCE_DATE_EPOCH=0 python3 "$here/oci.py" "$p.tmp/pause.oci.tar" --name "$PAUSE_IMAGE" \
            --layer "$p.tmp/layer.tar" --entrypoint /pause >/dev/null
        rm -rf "$p" && mv "$p.tmp" "$p"
    fi
    ctr --address "$CONTAINERD_SOCK" -n k8s.io images import "$p/pause.oci.tar" >/dev/null 2>&1 \
        || die "ctr images import $p/pause.oci.tar failed"
}

make_network() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || { ip link add "$BRIDGE" type bridge && touch "$dir/made-bridge"; }
    ip addr show dev "$BRIDGE" | grep -q " $NODE_IP/" || ip addr add "$NODE_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

# shared_mount PATH: PATH on a shared mount, as Bidirectional mount propagation needs (the chart's
# tmpfs init containers mount into stateDir); systemd makes / shared, a bare host leaves it private:
# then PATH is bound onto itself and that mount made shared (down unmounts it).
shared_mount() {
    mkdir -p "$1"
    local opts
    opts=$(findmnt -n -o PROPAGATION --target "$1")
    case $opts in shared*) return 0 ;; esac
    mount --bind "$1" "$1" && mount --make-shared "$1" || die "cannot make $1 a shared mount (Bidirectional propagation needs one)"
}

# ds_ready NAME: the DaemonSet has pods, all updated and ready (rollout status refuses OnDelete)
ds_ready() {
    local s
    s=$(kubectl_ -n mpsd-system get ds "$1" -o jsonpath='{.status.desiredNumberScheduled} {.status.updatedNumberScheduled} {.status.numberReady}')
    read -r want updated ready <<<"$s"
    [ "${want:-0}" -gt 0 ] && [ "$updated" = "$want" ] && [ "$ready" = "$want" ]
}

kubectl_() { kubectl --kubeconfig "$dir/admin.kubeconfig" "$@"; }

helm_() { KUBECONFIG=$dir/admin.kubeconfig "$(cd "$REPO" && python3 -m tests.kubetools "$cache/kubetools")/helm" "$@"; }

# install: the chart in $mode, replacing an install in the other mode (helm uninstall --wait first)
install() {
    [ -f "$dir/env" ] && [ -n "$(running_procs)" ] || die "the cluster is not up: scripts/cluster.sh up first"
    components
    local current
    current=$(helm_ get values mpsd -n mpsd-system -a -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("mode",""))' 2>/dev/null || true)
    if [ -n "$current" ] && [ "$current" != "$( [ "$mode" = dra ] && echo dra || echo devicePlugin)" ]; then
        # another mode is another holder (ipcMode, tmpfs): uninstalled as docs/operations.md says,
        # the kept holder deleted on purpose (no tenant runs here between the tiers' modules)
        helm_ uninstall mpsd -n mpsd-system --wait --timeout 5m >"$dir/logs/helm-uninstall.log" 2>&1 \
            || die "helm uninstall failed: $(tail -n 1 "$dir/logs/helm-uninstall.log")"
        kubectl_ -n mpsd-system delete daemonset/mpsd-holder \
            serviceaccount/mpsd-holder --ignore-not-found --wait --timeout 5m >>"$dir/logs/helm-uninstall.log" 2>&1 \
            || die "deleting the kept holder failed: $(tail -n 1 "$dir/logs/helm-uninstall.log")"
    fi
    "$REPO/scripts/image.sh" --load containerd --containerd-address "$CONTAINERD_SOCK" >"$dir/logs/image.log" 2>&1 \
        || die "scripts/image.sh failed: $(tail -n 1 "$dir/logs/image.log") (log: $dir/logs/image.log)"
    install_mpsd
    cat "$dir/env"
}

install_mpsd() {
    local args=(upgrade --install mpsd "$REPO/deploy/helm/mpsd" --namespace mpsd-system --create-namespace
        --set image.repository=localhost/mpsd --set image.pullPolicy=Never --wait --timeout 5m)
    if [ "$mode" = dra ]; then
        args+=(-f "$REPO/deploy/helm/mpsd/ci/dra-values.yaml")
    else
        args+=(--set mode=devicePlugin)
    fi
    helm_ "${args[@]}" >"$dir/logs/helm-install.log" 2>&1 \
        || die "helm install failed: $(tail -n 1 "$dir/logs/helm-install.log") (log: $dir/logs/helm-install.log)"
    # helm's --wait can return before the DaemonSets' pods exist (seen with helm v4.3.1): wait for them
    local ds
    for ds in mpsd mpsd-holder; do
        wait_for "mpsd-system/$ds ready" 300 ds_ready "$ds"
    done
    if [ "$mode" = dra ]; then
        wait_for "mpsd's ResourceSlice" 120 sh -c "kubectl --kubeconfig '$dir/admin.kubeconfig' get resourceslices -o name | grep -q ."
    else
        wait_for "mpsd.io/gpu on the node" 120 sh -c \
            "kubectl --kubeconfig '$dir/admin.kubeconfig' get node $NODE_NAME -o jsonpath='{.status.allocatable.mpsd\\.io/gpu}' | grep -q '[1-9]'"
    fi
}

up() {
    check_environment
    running_procs && die "already up ($(running_procs)); scripts/cluster.sh down first"
    mkdir -p "$dir/logs" "$dir/pids" && chmod 700 "$dir"
    [ -e "$NVIDIA_CDI_SPEC" ] && ! [ -f "$dir/made-cdi-spec" ] \
        && die "$NVIDIA_CDI_SPEC exists and is not this cluster's: a real NVIDIA CDI spec? (the fake GPU would replace it)"
    [ -f "$dir/ip_forward" ] || cat /proc/sys/net/ipv4/ip_forward >"$dir/ip_forward" # the bridge plugin turns it on
    for p in /var/lib/mpsd /var/lib/mpsd/regions /var/lib/mpsd/shm /var/lib/mpsd/lib /run/mpsd-pipe /var/log/nvidia-mps /var/lib/cni; do # the chart's host paths, the CNI cache
        [ -e "$p" ] || echo "$p" >>"$dir/made-host-paths"
    done
    shared_mount /var/lib/mpsd
    if [ ! -d /var/lib/kubelet ]; then mkdir -p /var/lib/kubelet && touch "$dir/made-kubelet-dir"; fi
    [ -f "$dir/made-kubelet-dir" ] || die "/var/lib/kubelet exists and is not this cluster's: is another kubelet on this machine?"
    ports_free 2379 2380 6443 10250 10248 10257 10259 10249 10256
    local start=$SECONDS
    components
    K8S_VERSION=$(basename "$K8S_BIN"); K8S_VERSION=${K8S_VERSION#kubernetes-}
    make_pki
    make_network
    write_fake_gpu && touch "$dir/made-cdi-spec"
    write_cni_config; write_containerd_config; write_kubelet_config; write_kube_proxy_config
    start_containerd
    pause_image
    "$REPO/scripts/image.sh" --load containerd --containerd-address "$CONTAINERD_SOCK" >"$dir/logs/image.log" 2>&1 \
        || die "scripts/image.sh failed: $(tail -n 1 "$dir/logs/image.log") (log: $dir/logs/image.log)"
    start_control_plane
    start_kubelet
    start_proc kube-proxy kube-proxy --config "$dir/kube-proxy.yaml"
    wait_for "node $NODE_NAME Ready" 180 sh -c \
        "kubectl --kubeconfig '$dir/admin.kubeconfig' get node $NODE_NAME -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -q True"
    kubectl_ label node "$NODE_NAME" --overwrite nvidia.com/gpu.present=true mpsd.io/enabled=true >/dev/null
    install_mpsd
    say "up in $((SECONDS - start))s (mode $mode; logs in $dir/logs)"
    printf 'export KUBECONFIG=%s\nexport CONTAINERD_ADDRESS=%s\n' "$dir/admin.kubeconfig" "$CONTAINERD_SOCK" | tee "$dir/env"
}

start_containerd() {
    start_proc containerd containerd --config "$dir/containerd/config.toml"
    wait_for containerd 60 ctr --address "$CONTAINERD_SOCK" version
}

start_kubelet() {
    start_proc kubelet kubelet --config "$dir/kubelet/config.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
        --hostname-override "$NODE_NAME" --node-ip "$NODE_IP"
}

# restart kubelet|containerd: what an operator's `systemctl restart` does; pods keep running
restart() {
    [ -n "$which" ] || die "$usage"
    alive "$which" || die "$which is not running: scripts/cluster.sh up first"
    components
    stop "$which"
    "start_$which"
    [ "$which" = kubelet ] && wait_for "kubelet healthz" 120 http_ok http://127.0.0.1:10248/healthz
    say "$which restarted (PID $(cut -d' ' -f1 "$dir/pids/$which"))"
}

case $cmd in
    up) up ;;
    restart) restart ;;
    install) install ;;
    down) down ;;
    status) running_procs || echo "down" ;;
    *) die "$usage" ;;
esac
