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
#   ipam        host-local, one range per subnet present: FLANNEL_SUBNET's network, then
#               FLANNEL_IPV6_SUBNET's; one route per network present: FLANNEL_NETWORK, then
#               FLANNEL_IPV6_NETWORK (getDelegateIPAM). A dual-stack pod gets one address of
#               each family, and the bridge cni0 each subnet's first address.
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
ranges, routes = [], []
for sub in ("FLANNEL_SUBNET", "FLANNEL_IPV6_SUBNET"):
    if env.get(sub):
        ranges.append([{"subnet": str(ipaddress.ip_interface(env[sub]).network)}])
for net in ("FLANNEL_NETWORK", "FLANNEL_IPV6_NETWORK"):
    if env.get(net):
        routes.append({"dst": env[net]})
if not ranges:
    sys.exit(f"{sys.argv[1]}: neither FLANNEL_SUBNET nor FLANNEL_IPV6_SUBNET")
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
        "ranges": ranges,
        "routes": routes,
    },
}))
PY
}

# cni_pod_up PREFIX N SUBNET_ENV DATA_DIR: a pod namespace <p>pN (made if missing) attached to
# host <p>hN by the bridge plugin; prints the pod's IPv4 address, and, only when the pod has
# one (subnet.env has FLANNEL_IPV6_SUBNET), its IPv6 address on a second line: on an
# IPv4-only network `$(cni_pod_up ...)` is the IPv4 address alone, as before. On an IPv6-only
# network (subnet.env without FLANNEL_SUBNET) the first line is empty. Returns once no
# IPv6 address of the pod or of cni0 is tentative (DAD), so the pod can be reached at once.
# Fails, printing the plugin's error, if the plugin does.
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
    local ips
    ips=$(python3 -c '
import ipaddress, json, sys
addrs = [ipaddress.ip_interface(ip["address"]).ip for ip in json.load(sys.stdin)["ips"]]
v4 = [a for a in addrs if a.version == 4]
v6 = [a for a in addrs if a.version == 6]
print(v4[0] if v4 else "")
if v6:
    print(v6[0])' <<<"$result") || return 1
    if [ "$(wc -l <<<"$ips")" -gt 1 ]; then
        cni_wait_dad "$pod" "" || return 1
        cni_wait_dad "$host" cni0 || return 1
    fi
    echo "$ips"
}

# cni_wait_dad NS [DEV]: waits (up to 5 s) until no IPv6 address in namespace NS (on DEV, if
# given) is tentative; fails, listing them, if one stays tentative or DAD failed.
cni_wait_dad() {
    local ns="$1" dev=() left
    [ -n "$2" ] && dev=(dev "$2")
    for _ in $(seq 100); do
        left=$(ip -n "$ns" -6 addr show "${dev[@]}" dadfailed)
        if [ -n "$left" ]; then
            echo "IPv6 duplicate address detection failed in $ns: $left" >&2
            return 1
        fi
        left=$(ip -n "$ns" -6 addr show "${dev[@]}" tentative)
        [ -z "$left" ] && return 0
        sleep 0.05
    done
    echo "IPv6 addresses still tentative in $ns after 5 s: $left" >&2
    return 1
}
