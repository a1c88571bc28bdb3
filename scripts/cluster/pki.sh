# Certificates and kubeconfigs of the one-node cluster (sourced by scripts/cluster.sh).
# One CA; EC P-256 keys; every client identity is what the API server's Node and RBAC
# authorizers expect of that component. Made once per cluster directory.

# sign NAME CN ORG [SAN]: NAME.key and NAME.crt in $pki signed by the CA
sign() {
    local name=$1 cn=$2 org=$3 san=${4:-}
    local ext="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth,serverAuth"
    [ -n "$san" ] && ext+=$'\n'"subjectAltName=$san"
    openssl ecparam -name prime256v1 -genkey -noout -out "$pki/$name.key" 2>/dev/null
    openssl req -new -key "$pki/$name.key" -subj "/CN=$cn${org:+/O=$org}" -out "$pki/$name.csr" 2>/dev/null
    openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 3650 -extfile <(echo "$ext") -out "$pki/$name.crt" 2>/dev/null
    rm -f "$pki/$name.csr"
}

# kubeconfig NAME CERT: $dir/NAME.kubeconfig, the client certificate CERT against the API server
kubeconfig() {
    cat >"$dir/$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: mpsd
  cluster:
    certificate-authority: $pki/ca.crt
    server: https://$NODE_IP:6443
users:
- name: $1
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: mpsd
  context: {cluster: mpsd, user: $1}
current-context: mpsd
KC
}

make_pki() {
    pki=$dir/pki
    [ -f "$pki/.done" ] && return 0
    rm -rf "$pki" && mkdir -p "$pki" && chmod 700 "$pki"
    openssl ecparam -name prime256v1 -genkey -noout -out "$pki/ca.key" 2>/dev/null
    openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=mpsd-cluster-ca" -days 3650 -out "$pki/ca.crt" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    sign apiserver kube-apiserver "" "IP:$NODE_IP,IP:127.0.0.1,IP:$SERVICE_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
    sign apiserver-kubelet kube-apiserver-kubelet-client system:masters
    sign admin kubernetes-admin system:masters
    sign controller-manager system:kube-controller-manager ""
    sign scheduler system:kube-scheduler ""
    sign kube-proxy system:kube-proxy ""
    sign kubelet "system:node:$NODE_NAME" system:nodes
    sign kubelet-serving "$NODE_NAME" "" "IP:$NODE_IP,DNS:$NODE_NAME"
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
    for who in admin:admin controller-manager:controller-manager scheduler:scheduler \
            kube-proxy:kube-proxy kubelet:kubelet; do
        kubeconfig "${who%%:*}" "${who##*:}"
    done
    touch "$pki/.done"
}
