# Configuration files of the one-node cluster's node (sourced by scripts/cluster.sh): containerd
# with CDI and runc (through nvidia-cdi-runtime), the CNI network, the kubelet, kube-proxy, and
# the fake GPU: what NVIDIA's toolkit would leave on a GPU node, with tests/fakes' libraries.

# Without CAP_SYS_RESOURCE (a sandboxed machine, as the project's are) no process may lower its
# oom_score_adj, and runc fails every pod sandbox (containerd asks -998): containerd is then told to
# keep every score at or above its own (restrict_oom_score_adj, as kind does in a container).
no_sys_resource() {
    local eff
    eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
    (( (16#$eff >> 24 & 1) == 0 ))
}

write_containerd_config() {
    local c=$dir/containerd restrict=false
    no_sys_resource && restrict=true
    mkdir -p "$c/root" "$c/state"
    cat >"$c/config.toml" <<EOF_
version = 3
root = "$c/root"
state = "$c/state"

[grpc]
  address = "$CONTAINERD_SOCK"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"

[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  restrict_oom_score_adj = $restrict
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$CDI_RUNTIME"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$dir/cni/net.d"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF_
}

write_cni_config() {
    mkdir -p "$dir/cni/net.d" "$dir/cni/ipam"
    cat >"$dir/cni/net.d/10-mpsd.conflist" <<EOF_
{
  "cniVersion": "1.0.0",
  "name": "mpsd-cluster",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam",
              "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF_
}

# The kubelet: cgroupfs driver, and failCgroupV1 false because this kernel mounts cgroup v1 (the
# kubelet refuses v1 by default since 1.35). x509 and webhook authentication, webhook
# authorization: the API server reaches it with its kubelet client certificate.
write_kubelet_config() {
    mkdir -p "$dir/kubelet"
    cat >"$dir/kubelet/config.yaml" <<EOF_
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
address: $NODE_IP
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $dir/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $dir/pki/kubelet-serving.crt
tlsPrivateKeyFile: $dir/pki/kubelet-serving.key
clusterDomain: cluster.local
failSwapOn: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
featureGates: {$KUBELET_GATES}
EOF_
}

write_kube_proxy_config() {
    cat >"$dir/kube-proxy.yaml" <<EOF_
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_CIDR
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0, min: 0}
EOF_
}

# The fake GPU: tests/fakes' libcuda.so.1 and libnvidia-ml.so.1 (one simulated 16 GiB GPU), the
# real nvidia-cuda-mps-control and -server from Debian's package (tests/mpsbin.py), and a CDI
# spec of kind nvidia.com/gpu naming the GPU by index, UUID and "all", as `nvidia-ctk cdi
# generate` names them, that mounts them where the toolkit puts the driver's files.
write_fake_gpu() {
    local g=$dir/gpu
    mkdir -p "$g/lib"
    make -s -C "$REPO/tests/fakes" OUT_DIR="$g/lib" all >/dev/null
    local control
    control=$(cd "$REPO" && python3 -m tests.mpsbin 2>/dev/null | tail -n 1 | awk -F'\t' '{print $NF}')
    [ -x "$control" ] || { echo "cluster.sh: cannot fetch nvidia-cuda-mps-control (python3 -m tests.mpsbin)" >&2; return 1; }
    local server=${control%/bin/nvidia-cuda-mps-control}/sbin/nvidia-cuda-mps-server # the package's layout
    [ -x "$server" ] || { echo "cluster.sh: no nvidia-cuda-mps-server at $server" >&2; return 1; }
    mkdir -p "$g/bin"
    cp "$control" "$server" "$g/bin/"
    # The driver's device nodes, on the host as on a GPU node (mpsd's claim specs name them by
    # their host path), here with /dev/null's numbers; down removes those up made.
    for node in nvidia0 nvidiactl nvidia-uvm; do
        if [ ! -e "/dev/$node" ]; then
            mknod -m 666 "/dev/$node" c 1 3 && echo "/dev/$node" >>"$dir/made-dev-nodes"
        elif ! grep -qx "/dev/$node" "$dir/made-dev-nodes" 2>/dev/null; then
            echo "cluster.sh: /dev/$node exists: an NVIDIA driver is here, and the fake GPU would hide it" >&2
            return 1
        fi
    done
    printf 'gpu 0 %s %d 0 9 0 0 Simulated GPU\n' "$GPU_UUID" $((16 << 30)) >"$g/nvml.conf"
    local lib=/usr/lib/x86_64-linux-gnu
    mkdir -p /var/run/cdi
    cat >"$NVIDIA_CDI_SPEC" <<EOF_
cdiVersion: 0.6.0
kind: nvidia.com/gpu
devices:
  - name: "0"
    containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}
  - name: $GPU_UUID
    containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}
  - name: all
    containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}
containerEdits:
  deviceNodes:
    - {path: /dev/nvidiactl}
    - {path: /dev/nvidia-uvm}
  env:
    - FAKE_NVML_CONFIG=/etc/fake-gpu/nvml.conf
    - FAKE_CUDA_DEVICES=16G
  mounts:
    - {hostPath: $g/lib/libcuda.so.1, containerPath: $lib/libcuda.so.1, options: [ro, nosuid, nodev, bind]}
    - {hostPath: $g/lib/libnvidia-ml.so.1, containerPath: $lib/libnvidia-ml.so.1, options: [ro, nosuid, nodev, bind]}
    - {hostPath: $g/bin/nvidia-cuda-mps-control, containerPath: /usr/bin/nvidia-cuda-mps-control, options: [ro, nosuid, nodev, bind]}
    - {hostPath: $g/bin/nvidia-cuda-mps-server, containerPath: /usr/bin/nvidia-cuda-mps-server, options: [ro, nosuid, nodev, bind]}
    - {hostPath: $g/nvml.conf, containerPath: /etc/fake-gpu/nvml.conf, options: [ro, nosuid, nodev, bind]}
EOF_
}
