# shellcheck shell=bash
# A kernel flannel node on the lab's underlay (scripts/lib/netns.sh): a host whose VXLAN
# devices, neighbours, FDB entries and routes are set up exactly as flannel's vxlan backend sets
# them up (flannel-io/flannel, pkg/backend/vxlan: vxlan.go RegisterNetwork, device.go,
# vxlan_network.go handleSubnetEvents); host-gw's routes; ipip's device and routes. The one home of that recipe: the bench's kernel rows and
# the Rust harness's kernel flannel peer (integration/support/kernel_flannel.rs) both use it.
# Source it; call it with errexit on, as netns.sh's functions.
#
# Per address family, one device ("half"): flannel.1 for IPv4, flannel-v6.1 for IPv6, each VNI
# 1, UDP port 8472, nolearning, over the host's underlay address of that family on eth0.

# shellcheck source=scripts/lib/netns.sh
. "$(dirname "${BASH_SOURCE[0]}")/netns.sh"

FLANNEL_VNI=1
FLANNEL_PORT=8472

flannel_dev() { # SUBNET: the device of SUBNET's family
    if [[ $1 == *:* ]]; then echo flannel-v6.1; else echo flannel.1; fi
}

# flannel_vtep_up NS N SUBNET: in host namespace NS (the lab's node N), the VTEP of the half
# holding SUBNET (10.244.1.0/24, or fd00:10:244:1::/64), as newVXLANDevice makes it and
# Configure/ConfigureIPv6 address it: IPv4, flannel.1 over 192.0.2.N with MTU 1450 (the
# underlay's 1500 less VXLAN's 50) and <base>/32; IPv6, flannel-v6.1 over 2001:db8::N with no
# router advertisements, the kernel's default MTU (eth0's less 70) and <base>/128 (nodad).
# Prints the device's MAC (its lease's VtepMAC).
flannel_vtep_up() {
    local ns=$1 n=$2 subnet=$3 dev base=${3%/*}
    dev=$(flannel_dev "$subnet")
    if [ "$dev" = flannel.1 ]; then
        ip -n "$ns" -batch - <<EOF
link add $dev type vxlan id $FLANNEL_VNI local $(netns_ip "$n") dev eth0 dstport $FLANNEL_PORT nolearning
link set $dev mtu 1450
addr add $base/32 dev $dev
link set $dev up
EOF
    else
        ip -n "$ns" link add "$dev" type vxlan id "$FLANNEL_VNI" local "$(netns_ip6 "$n")" dev eth0 \
            dstport "$FLANNEL_PORT" nolearning
        ip netns exec "$ns" sh -c "echo 0 >/proc/sys/net/ipv6/conf/$dev/accept_ra"
        ip -n "$ns" -batch - <<EOF
addr add $base/128 dev $dev nodad
link set $dev up
EOF
    fi
    ip -n "$ns" -br link show "$dev" | awk '{print $3}'
}

# flannel_vtep_peer NS SUBNET VTEP_MAC PUBLIC_IP: in NS, the route to another node's half, as
# handleSubnetEvents programs it on EventAdded (no DirectRouting), on SUBNET's family's device:
# a permanent neighbour <base> lladdr VTEP_MAC (AddARP / AddV6ARP), an FDB entry VTEP_MAC dst
# PUBLIC_IP (AddFDB / AddV6FDB; flannel's NeighSet replaces), and last, as flannel does, the
# route SUBNET via <base> onlink. No route for the whole network: flannel adds none.
flannel_vtep_peer() {
    local ns=$1 subnet=$2 mac=$3 public=$4 dev base=${2%/*}
    dev=$(flannel_dev "$subnet")
    ip -n "$ns" neigh replace "$base" lladdr "$mac" dev "$dev" nud permanent
    bridge -n "$ns" fdb replace "$mac" dev "$dev" dst "$public" self permanent
    ip -n "$ns" route replace "$subnet" via "$base" dev "$dev" onlink
}

# flannel_route_peer NS SUBNET PUBLIC_IP [DEV]: in NS, the route to another node's subnet as
# flannel programs it without encapsulation: host-gw (route_network.go routeAdd: SUBNET via
# PUBLIC_IP dev <external interface>, a differing route to SUBNET replaced), and vxlan's
# DirectRouting for a peer on the link (vxlan_network.go: RouteReplace of SUBNET via
# PUBLIC_IP, no device: the kernel picks it). DEV given: host-gw's; none: DirectRouting's.
flannel_route_peer() {
    local ns=$1 subnet=$2 public=$3
    ip -n "$ns" route replace "$subnet" via "$public" ${4:+dev "$4"}
}

# flannel_unroute_peer NS SUBNET: EventRemoved: the route to SUBNET goes (vxlan's DirectRouting
# removal, host-gw's RouteDel; one already gone is fine).
flannel_unroute_peer() {
    ip -n "$1" route del "$2" 2>/dev/null || true
}

# flannel_ipip_up NS N SUBNET: in host namespace NS (the lab's node N), the device of flannel's
# ipip backend (pkg/backend/ipip: ipip.go configureIPIPDevice) as flanneld makes it over
# netlink: flannel.ipip, type ipip, local 192.0.2.N and every other tunnel parameter at its Go
# zero value as vishvananda/netlink passes it (ttl 0: inherit; tos 0; pmtudisc 0: nopmtudisc),
# MTU eth0's 1500 less the outer header's 20, <base>/32, up. Needs the kernel's ipip module
# (CONFIG_NET_IPIP): without it `ip link add` fails with "Unknown device type", loudly.
flannel_ipip_up() {
    local ns=$1 n=$2 base=${3%/*}
    ip -n "$ns" -batch - <<EOF
link add flannel.ipip type ipip local $(netns_ip "$n") ttl inherit tos 0 nopmtudisc
link set flannel.ipip mtu 1480
addr add $base/32 dev flannel.ipip
link set flannel.ipip up
EOF
}

# flannel_ipip_peer NS SUBNET PUBLIC_IP [DEV]: in NS, the route to another node's subnet as
# flannel's ipip backend programs it (ipip.go GetRoute, route_network.go routeAdd): SUBNET via
# PUBLIC_IP dev flannel.ipip onlink; with DirectRouting, a peer on the link gets the external
# interface DEV instead, still onlink.
flannel_ipip_peer() {
    ip -n "$1" route replace "$2" via "$3" dev "${4:-flannel.ipip}" onlink
}

# flannel_wg_up NS N SUBNET NETWORK KEYFILE [PORT] [WG]: in host namespace NS (the lab's node N),
# the device of flannel's wireguard backend (pkg/backend/wireguard: device.go newWGDevice,
# Configure) on a host without the kernel module: user-space WireGuard (WG, default Debian's
# wireguard-go on PATH) makes the device, then, as flanneld does over wgctrl and netlink: the
# private key in KEYFILE (as flannel's /run/flannel/wgkey) and listen port PORT (51820), MTU
# eth0's 1500 less flannel's overhead 80, <base>/32, up, and the route to the whole NETWORK
# on the device (scope link). Prints the public key (the lease's BackendData.PublicKey).
# The device is flannel-wgN, not flannel's flannel-wg: a user-space WireGuard's control socket
# (/var/run/wireguard/<dev>.sock) is one per name for the whole machine, not per namespace.
flannel_wg_dev() { echo "flannel-wg$1"; } # N
flannel_wg_up() {
    local ns=$1 n=$2 base=${3%/*} network=$4 key=$5 port=${6:-51820} wg=${7:-wireguard-go} dev
    dev=$(flannel_wg_dev "$n")
    # wireguard-go daemonizes: its parent returns once the device is up. Its banner about the
    # kernel module is noise here.
    ip netns exec "$ns" "$wg" "$dev" >/dev/null
    ip netns exec "$ns" wg set "$dev" private-key "$key" listen-port "$port"
    ip -n "$ns" -batch - <<EOF
link set $dev mtu 1420
addr add $base/32 dev $dev
link set $dev up
route replace $network dev $dev scope link
EOF
    wg pubkey <"$key"
}

# flannel_wg_peer NS N KEY ENDPOINT SUBNET [PSKFILE] [KEEPALIVE]: in NS (node N), another node as
# handleSubnetEvents adds it in Separate mode (addPeer): its public KEY, ENDPOINT
# (PublicIP:Port of its lease), allowed IPs SUBNET alone (ReplaceAllowedIPs), the network's PSK
# and keepalive when set.
flannel_wg_peer() {
    local ns=$1 n=$2 key=$3 endpoint=$4 subnet=$5 psk=${6:-} keepalive=${7:-}
    ip netns exec "$ns" wg set "$(flannel_wg_dev "$n")" peer "$key" endpoint "$endpoint" \
        allowed-ips "$subnet" ${psk:+preshared-key "$psk"} ${keepalive:+persistent-keepalive "$keepalive"}
}

# flannel_wg_unpeer NS N KEY: EventRemoved: the peer goes (removePeer).
flannel_wg_unpeer() {
    ip netns exec "$1" wg set "$(flannel_wg_dev "$2")" peer "$3" remove
}

# flannel_wg_down NS N: the device goes, and its wireguard-go process with it.
flannel_wg_down() {
    ip -n "$1" link del "$(flannel_wg_dev "$2")" 2>/dev/null || true
}

# flannel_wg6_up NS N SUBNET6 NETWORK6 KEYFILE [PORT] [WG]: flannel's second device in Mode
# "separate" with IPv6 enabled (wireguard.go RegisterNetwork: flannel-wg-v6 on ListenPortV6,
# the same key file; device.go ConfigureV6): made as flannel_wg_up makes the first, listening
# on PORT (51821), with <v6 base>/128, up, and the route to the whole IPv6 NETWORK6 on it
# (scope link). Prints the public key (the lease's BackendV6Data.PublicKey: the same).
# The device is flannel-wg6-N (flannel's flannel-wg-v6, one name per machine: see above).
flannel_wg6_dev() { echo "flannel-wg6-$1"; } # N
flannel_wg6_up() {
    local ns=$1 n=$2 base=${3%/*} network=$4 key=$5 port=${6:-51821} wg=${7:-wireguard-go} dev
    dev=$(flannel_wg6_dev "$n")
    ip netns exec "$ns" "$wg" "$dev" >/dev/null
    ip netns exec "$ns" wg set "$dev" private-key "$key" listen-port "$port"
    ip -n "$ns" -batch - <<EOF
link set $dev mtu 1420
addr add $base/128 dev $dev
link set $dev up
route replace $network dev $dev scope link
EOF
    wg pubkey <"$key"
}

# flannel_wg6_peer NS N KEY ENDPOINT SUBNET6: another node's IPv6 half as handleSubnetEvents adds
# it in Separate mode: on the IPv6 device, its BackendV6Data KEY, ENDPOINT
# ([PublicIPv6]:BackendV6Data.Port), allowed IPs its IPv6 SUBNET6 alone.
flannel_wg6_peer() {
    ip netns exec "$1" wg set "$(flannel_wg6_dev "$2")" peer "$3" endpoint "$4" allowed-ips "$5"
}

# flannel_wg6_down NS N: the IPv6 device goes, and its wireguard-go process with it.
flannel_wg6_down() {
    ip -n "$1" link del "$(flannel_wg6_dev "$2")" 2>/dev/null || true
}

# flannel_forwarding NS: IPv4 forwarding on, as on every flannel node (the kernel routes pods'
# traffic between the bridge and the underlay).
flannel_forwarding() {
    ip netns exec "$1" sh -c 'echo 1 >/proc/sys/net/ipv4/ip_forward'
}

# flannel_flanneld_up BIN NS N DIR [FLANNELD FLAG...]: a real flanneld (BIN, v0.19.0 built by
# ../shared/tools/build-flanneld) in host namespace NS (the lab's node N), leasing from the lab's
# etcd under flannel's prefix, with the network config already there (its Backend.Type picks
# udp, flanneld's user-space TUN proxy, or vxlan, which programs flannel.1 itself). Its
# subnet.env, log and pid go in DIR. No iptables rules (--iptables-forward-rules=false, no
# --ip-masq): the lab's namespaces forward without them. Returns at once; flannel_flanneld_wait
# waits for the lease.
flannel_flanneld_up() {
    local bin=$1 ns=$2 n=$3 dir=$4
    shift 4
    mkdir -p "$dir"
    ip netns exec "$ns" "$bin" --etcd-endpoints "$NETNS_ETCD" --etcd-prefix /coreos.com/network \
        --iface eth0 --public-ip "$(netns_ip "$n")" --subnet-file "$dir/subnet.env" \
        --iptables-forward-rules=false "$@" >"$dir/log" 2>&1 &
    echo $! >"$dir/pid"
}

# flannel_flanneld_kube_up BIN NS N DIR KUBECONFIG NODE [FLANNELD FLAG...]: a real flanneld (as
# flannel_flanneld_up) in --kube-subnet-mgr mode, as kube-flannel's DaemonSet runs it: Node NODE
# (NODE_NAME) of the API server KUBECONFIG names (support/kube.rs's, in the lab's hub) gives its
# subnet (spec.podCIDR) and carries its lease as annotations; the network config is the file
# DIR/net-conf.json (the ConfigMap's, which the caller writes). Its subnet.env, log and pid go in
# DIR, as flannel_flanneld_up's, so flannel_flanneld_wait and flannel_flanneld_down serve it.
flannel_flanneld_kube_up() {
    local bin=$1 ns=$2 n=$3 dir=$4 kubeconfig=$5 node=$6
    shift 6
    mkdir -p "$dir"
    ip netns exec "$ns" env NODE_NAME="$node" "$bin" --kube-subnet-mgr --kubeconfig-file "$kubeconfig" \
        --net-config-path "$dir/net-conf.json" --iface eth0 --public-ip "$(netns_ip "$n")" \
        --subnet-file "$dir/subnet.env" --iptables-forward-rules=false "$@" >"$dir/log" 2>&1 &
    echo $! >"$dir/pid"
}

# flannel_flanneld_wait DIR: waits (up to 20 s) until that flanneld wrote its subnet.env.
flannel_flanneld_wait() {
    for _ in $(seq 200); do
        [ -s "$1/subnet.env" ] && return 0
        kill -0 "$(cat "$1/pid")" 2>/dev/null || break
        sleep 0.1
    done
    echo "flanneld ($1) wrote no subnet.env:" >&2
    tail -20 "$1/log" >&2
    return 1
}

# flannel_flanneld_down DIR: stops that flanneld (SIGTERM; it keeps its lease, as flanneld does)
# and waits until it has gone. What it made stays (flannel0 or flannel.1, routes): the caller's.
flannel_flanneld_down() {
    local pid
    pid=$(cat "$1/pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}
