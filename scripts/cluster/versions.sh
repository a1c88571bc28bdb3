# Pinned versions of the one-node cluster's components (scripts/cluster.sh). Each component is
# built once per machine into $MPSD_CLUSTER_CACHE/bin/<name>-<version>/, so changing a version here
# rebuilds that component only.
K8S_VERSION=v1.37.2            # k8s.io/kubernetes; its staging modules k8s.io/* are v0.${K8S_VERSION#v1.}
ETCD_VERSION=v3.7.0            # go.etcd.io/etcd/server/v3: the version k8s.io/kubernetes v1.37.2 requires
CONTAINERD_VERSION=v2.4.2      # github.com/containerd/containerd/v2
CNI_VERSION=v1.10.0            # github.com/containernetworking/plugins
CRICTL_VERSION=v1.37.0         # sigs.k8s.io/cri-tools
