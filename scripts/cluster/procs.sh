# Processes of the one-node cluster (sourced by scripts/cluster.sh): started in their own session
# with their PID and executable recorded in $dir/pids, stopped by that PID only (and only while it
# still runs that executable), and everything they mounted unmounted.

# start_proc NAME COMMAND ARG...: run in the background, log to $dir/logs/NAME.log
start_proc() {
    local name=$1 exe; shift
    exe=$(command -v "$1") || die "$1 not found"
    shift
    setsid "$exe" "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
    echo "$! $exe" >"$dir/pids/$name"
}

# alive NAME: the recorded process still runs its recorded executable
alive() {
    local f=$dir/pids/$1 pid exe
    [ -f "$f" ] || return 1
    read -r pid exe <"$f"
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$exe" ]
}

running_procs() {
    local up=()
    for p in "${PROCS[@]}"; do alive "$p" && up+=("$p"); done
    [ ${#up[@]} -gt 0 ] && echo "${up[*]}"
}

# wait_for WHAT SECONDS COMMAND...: poll until COMMAND succeeds; one line if a process died or time ran out
wait_for() {
    local what=$1 limit=$2; shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        for p in "${PROCS[@]}"; do
            if [ -f "$dir/pids/$p" ] && ! alive "$p"; then
                die "$p exited while waiting for $what: $(grep -v '^\s*$' "$dir/logs/$p.log" | tail -n 1 | cut -c1-300) (log: $dir/logs/$p.log)"
            fi
        done
        [ $SECONDS -lt $end ] || die "$what not ready after ${limit}s (logs in $dir/logs)"
        sleep 0.5
    done
}

ports_free() {
    local busy
    for port in "$@"; do
        busy=$(ss -Hltn "sport = :$port" 2>/dev/null | head -n 1)
        [ -z "$busy" ] || die "port $port is in use (the cluster needs 2379 2380 6443 10248-10259): $busy"
    done
}

http_ok() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1"; }

start_control_plane() {
    local pki=$dir/pki
    start_proc etcd etcd --name node --data-dir "$dir/etcd" --log-level warn --unsafe-no-fsync \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster node=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381
    wait_for etcd 60 http_ok http://127.0.0.1:2381/health
    start_proc kube-apiserver kube-apiserver --advertise-address "$NODE_IP" --bind-address "$NODE_IP" \
        --secure-port 6443 --etcd-servers http://127.0.0.1:2379 --service-cluster-ip-range "$SERVICE_CIDR" \
        --client-ca-file "$pki/ca.crt" --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
        --kubelet-client-certificate "$pki/apiserver-kubelet.crt" --kubelet-client-key "$pki/apiserver-kubelet.key" \
        --kubelet-certificate-authority "$pki/ca.crt" --kubelet-preferred-address-types InternalIP \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --allow-privileged \
        --feature-gates "$GATES" --profiling=false
    wait_for kube-apiserver 120 kubectl --kubeconfig "$dir/admin.kubeconfig" get --raw /readyz
    start_proc kube-controller-manager kube-controller-manager --kubeconfig "$dir/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$dir/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$dir/controller-manager.kubeconfig" --bind-address 127.0.0.1 \
        --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
        --use-service-account-credentials --leader-elect=false --feature-gates "$GATES" \
        --service-cluster-ip-range "$SERVICE_CIDR" --profiling=false
    start_proc kube-scheduler kube-scheduler --kubeconfig "$dir/scheduler.kubeconfig" \
        --authentication-kubeconfig "$dir/scheduler.kubeconfig" --authorization-kubeconfig "$dir/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --leader-elect=false --feature-gates "$GATES" --profiling=false
}

# stop NAME: TERM, then KILL after 20 s; only the recorded PID, only while it runs its executable
stop() {
    alive "$1" || { rm -f "$dir/pids/$1"; return 0; }
    local pid
    read -r pid _ <"$dir/pids/$1"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do alive "$1" || break; sleep 0.5; done
    alive "$1" && kill -KILL "$pid" 2>/dev/null
    for _ in $(seq 1 20); do alive "$1" || break; sleep 0.5; done
    rm -f "$dir/pids/$1"
}

# Mount points under PREFIX..., deepest first (mountinfo's field 5, octal escapes decoded).
mounts_under() {
    python3 - "$@" <<'PY'
import sys
prefixes = [p.rstrip("/") + "/" for p in sys.argv[1:]]
points = set()
with open("/proc/self/mountinfo") as f:
    for line in f:
        point = line.split()[4].encode().decode("unicode_escape")
        if any((point + "/").startswith(p) for p in prefixes):
            points.add(point)
for point in sorted(points, key=lambda p: (-p.count("/"), p)):
    print(point)
PY
}

# The kubelet's own iptables chains (kube-proxy --cleanup leaves them): KUBE-FIREWALL and
# KUBE-KUBELET-CANARY, and the jumps to KUBE-FIREWALL.
kubelet_chains_cleanup() {
    local ipt table chain
    for ipt in iptables ip6tables; do
        command -v "$ipt" >/dev/null || continue
        for hook in INPUT OUTPUT; do
            while "$ipt" -D "$hook" -j KUBE-FIREWALL 2>/dev/null; do :; done
        done
        for table in filter nat mangle; do
            for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY; do
                "$ipt" -t "$table" -F "$chain" 2>/dev/null && "$ipt" -t "$table" -X "$chain" 2>/dev/null || true
            done
        done
    done
}

down() {
    [ "$(id -u)" = 0 ] || die "must run as root"
    [ -d "$dir" ] || { say "nothing to do: no $dir"; return 0; }
    local crictl=""
    [ -f "$dir/components" ] && crictl=$(awk '$1 == "crictl" {print $2 "/crictl"}' "$dir/components")
    stop kube-proxy
    stop kubelet
    # every pod sandbox (containers, CNI, mounts) while containerd still runs
    if alive containerd && [ -x "$crictl" ]; then
        timeout 120 "$crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" rmp --all --force >/dev/null 2>&1 || true
    fi
    stop containerd
    # shims left behind (a pod crictl could not remove): ours by executable path
    local shim
    shim=$(awk '$1 == "containerd" {print $2 "/containerd-shim-runc-v2"}' "$dir/components" 2>/dev/null || true)
    if [ -n "$shim" ]; then
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/exe" 2>/dev/null)" = "$shim" ] && kill -KILL "${p#/proc/}" 2>/dev/null || true
        done
    fi
    stop kube-scheduler; stop kube-controller-manager; stop kube-apiserver; stop etcd
    local kp
    kp=$(awk '$1 == "kubernetes" {print $2 "/kube-proxy"}' "$dir/components" 2>/dev/null || true)
    [ -x "$kp" ] && "$kp" --cleanup >/dev/null 2>&1 || true
    kubelet_chains_cleanup
    local points=("$dir")
    [ -f "$dir/made-kubelet-dir" ] && points+=(/var/lib/kubelet)
    points+=(/var/lib/mpsd)
    while read -r m; do
        [ -n "$m" ] && { umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "cannot unmount $m"; }
    done < <(mounts_under "${points[@]}")
    [ -f "$dir/made-bridge" ] && ip link del "$BRIDGE" 2>/dev/null
    [ -f "$dir/made-cdi-spec" ] && rm -f "$NVIDIA_CDI_SPEC"
    if [ -f "$dir/made-dev-nodes" ]; then # the fake GPU's nodes: only character devices 1:3 up made
        while read -r node; do
            [ "$(stat -c '%F %t:%T' "$node" 2>/dev/null)" = "character special file 1:3" ] && rm -f "$node"
        done <"$dir/made-dev-nodes"
    fi
    rm -f /var/run/cdi/mpsd.io-* # mpsd's claim specs, if its pods could not remove them
    for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/k8s.io; do
        [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    [ -f "$dir/made-kubelet-dir" ] && rm -rf /var/lib/kubelet
    if [ -f "$dir/made-host-paths" ]; then
        while read -r p; do
            case $p in /var/lib/mpsd|/var/lib/mpsd/*|/run/mpsd-pipe|/var/log/nvidia-mps|/var/lib/cni) rm -rf "$p" ;; esac
        done <"$dir/made-host-paths"
    fi
    [ -f "$dir/ip_forward" ] && cat "$dir/ip_forward" >/proc/sys/net/ipv4/ip_forward
    rm -rf "$dir"
    say "down"
}
