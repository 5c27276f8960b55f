# shellcheck shell=bash
# Pods attached the way a kubelet attaches them on a flannel node: by running Debian's CNI
# plugins (containernetworking-plugins: `bridge`, which calls `host-local`) with
# CNI_COMMAND=ADD and the delegate config that flannel's CNI plugin builds from subnet.env.
# The one home of that config for the demo and the end-to-end tests. Source it.
#
# flannel's plugin (flannel-io/cni-plugin, doCmdAdd) delegates to `bridge` with:
#   name        the CNI network's name (flannel's default conf calls it cbr0)
#   isGateway   true: the bridge cni0 gets the subnet's first address and is the pods' gateway
#   ipMasq      the opposite of FLANNEL_IPMASQ: when the daemon does not masquerade traffic
#               leaving the cluster, the bridge plugin does (iptables, in the host's namespace)
#   mtu         FLANNEL_MTU
#   ipam        host-local, one range: FLANNEL_SUBNET's network; one route: FLANNEL_NETWORK
# One addition of ours: host-local's dataDir, so that address allocations are kept in the
# caller's work directory, not in the machine's /var/lib/cni.

CNI_PLUGIN_DIR="${CNI_PLUGIN_DIR:-/usr/lib/cni}"

# cni_flannel_delegate SUBNET_ENV DATA_DIR: prints the delegate config.
cni_flannel_delegate() {
    python3 - "$1" "$2" <<'PY'
import ipaddress, json, sys
env = {}
for line in open(sys.argv[1]):
    key, sep, value = line.strip().partition("=")
    if sep:
        env[key] = value
subnet = ipaddress.ip_interface(env["FLANNEL_SUBNET"]).network
print(json.dumps({
    "cniVersion": "0.3.1",
    "name": "cbr0",
    "type": "bridge",
    "bridge": "cni0",
    "isGateway": True,
    "ipMasq": env.get("FLANNEL_IPMASQ", "false") != "true",
    "mtu": int(env["FLANNEL_MTU"]),
    "ipam": {
        "type": "host-local",
        "dataDir": sys.argv[2],
        "ranges": [[{"subnet": str(subnet)}]],
        "routes": [{"dst": env["FLANNEL_NETWORK"]}],
    },
}))
PY
}

# cni_pod_up PREFIX N SUBNET_ENV DATA_DIR: a pod namespace <p>pN (made if missing) attached to
# host <p>hN by the bridge plugin; prints the pod's IPv4 address. Fails, printing the plugin's
# error, if the plugin does.
cni_pod_up() {
    local host="${1}h${2}" pod="${1}p${2}" env="$3" data="$4" conf result
    [ -e "/run/netns/$pod" ] || ip netns add "$pod"
    ip -n "$pod" link set lo up
    mkdir -p "$data"
    conf=$(cni_flannel_delegate "$env" "$data") || return 1
    if ! result=$(ip netns exec "$host" env CNI_COMMAND=ADD CNI_CONTAINERID="$pod" \
        CNI_NETNS="/run/netns/$pod" CNI_IFNAME=eth0 CNI_PATH="$CNI_PLUGIN_DIR" \
        "$CNI_PLUGIN_DIR/bridge" <<<"$conf"); then
        echo "CNI bridge plugin ADD for $pod failed: $result" >&2
        echo "config: $conf" >&2
        return 1
    fi
    python3 -c 'import json, sys; print(json.load(sys.stdin)["ips"][0]["address"].split("/")[0])' <<<"$result"
}
