# shellcheck shell=bash
# The lab: network-namespace hosts on one underlay, with etcd on it. The one definition of that
# topology for the demo, the bench, the chaos soak and the end-to-end tests (the Rust harness,
# integration/support/netns.rs, builds its lab with these functions). Source it.
#
#   <p>hub   bridge br0, 192.0.2.254/24 and 2001:db8::fe/64, MAC 02:00:c0:00:02:fe: the shared
#            underlay; the lab's etcd (netns_hub_etcd) listens on 192.0.2.254:2379
#   <p>hN    a host (netns_host_up): eth0 = 192.0.2.N/24 and 2001:db8::N/64 (N in hex, the last
#            16-bit group: host 10 is 2001:db8::a) on the hub's bridge, default routes via
#            192.0.2.254 and 2001:db8::fe
#   <p>NAME  any other node on the underlay (netns_node_up), addressed the same way: the chaos
#            soak's etcd members are e1..e3 at 192.0.2.201-203
#
# IPv6 addresses are added nodad: usable at once (nothing else on the bridge claims them).
# Everything is created inside namespaces these functions make (veth pairs are created from
# inside the hub with the peer moved straight into its namespace, so no link ever appears in
# the root namespace), named with a caller-chosen prefix unique to the run, and removed by
# netns_cleanup (or the Rust lab's Drop). The root namespace's links, routes and addresses are
# never touched. Call them with errexit on (`set -e`; the scripts and the Rust harness do):
# they stop at the first command that fails.

# shellcheck source=scripts/lib/etcd.sh
. "$(dirname "${BASH_SOURCE[0]}")/etcd.sh"

# The hub's addresses, and the lab's etcd client URL.
NETNS_HUB_IP=192.0.2.254
NETNS_HUB_IP6=2001:db8::fe
NETNS_ETCD="http://$NETNS_HUB_IP:2379"
# A fixed MAC: a bridge without one takes its lowest port's MAC and changes it when a port with
# a lower one joins, and hosts that had already resolved 192.0.2.254 then send to the old
# address, and nothing answers until their neighbour entry expires (15-45 s): a host whose weft
# started while the next host was being wired could not reach etcd (seen in CI).
NETNS_HUB_MAC=02:00:c0:00:02:fe

netns_ip() { echo "192.0.2.$1"; }             # N: node N's IPv4 underlay address
netns_ip6() { printf '2001:db8::%x\n' "$1"; } # N: node N's IPv6 underlay address

# netns_new NS: the namespace, unless it exists (the Rust lab makes its namespaces first, to
# own their cleanup). Its loopback is brought up by the caller's batch below.
netns_new() {
    [ -e "/run/netns/$1" ] || ip netns add "$1"
}

# Each namespace's links, addresses and routes go in as one `ip -batch` (which stops at the
# first command that fails, and fails): one process per namespace, not one per command.
netns_hub_up() { # PREFIX
    local hub="${1}hub"
    netns_new "$hub"
    ip -n "$hub" -batch - <<EOF
link set lo up
link add br0 address $NETNS_HUB_MAC type bridge
addr add $NETNS_HUB_IP/24 dev br0
addr add $NETNS_HUB_IP6/64 dev br0 nodad
link set br0 up
EOF
}

netns_node_up() { # PREFIX NAME N: namespace <PREFIX>NAME, node N on the hub's bridge
    local hub="${1}hub" ns="${1}$2" veth=$2 ip4 ip6
    ip4=$(netns_ip "$3")
    ip6=$(netns_ip6 "$3")
    netns_new "$ns"
    ip -n "$hub" -batch - <<EOF
link add $veth type veth peer name eth0 netns $ns
link set $veth master br0 up
EOF
    ip -n "$ns" -batch - <<EOF
link set lo up
addr add $ip4/24 dev eth0
addr add $ip6/64 dev eth0 nodad
link set eth0 up
route add default via $NETNS_HUB_IP
route add default via $NETNS_HUB_IP6
EOF
}

netns_host_up() { # PREFIX N: host <PREFIX>hN
    netns_node_up "$1" "h$2" "$2"
}

netns_cleanup() { # PREFIX
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${1}" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}

# netns_etcd NS NAME DATA_DIR CLIENT_URL PEER_URL INITIAL_CLUSTER [ETCD FLAG...]: execs etcd
# member NAME (etcd_member, scripts/lib/etcd.sh) inside namespace NS. Run it in the background
# with its output redirected: `netns_etcd ... >>LOG 2>&1 &`; $! is etcd's pid.
netns_etcd() {
    local ns=$1
    shift
    etcd_member_args "$@"
    exec ip netns exec "$ns" "$ETCD_BIN" "${ETCD_ARGS[@]}"
}

# netns_hub_etcd PREFIX DATA_DIR [ETCD FLAG...]: execs the lab's etcd, one member in the hub,
# clients at $NETNS_ETCD (peers on the hub's own loopback). As netns_etcd: in the background.
netns_hub_etcd() {
    local p=$1 dir=$2 peer=http://127.0.0.1:2380
    shift 2
    netns_etcd "${p}hub" lab "$dir" "$NETNS_ETCD" "$peer" "lab=$peer" "$@"
}

# netns_wait_etcd PREFIX: waits (up to 20 s) until the lab's etcd reports healthy.
netns_wait_etcd() {
    for _ in $(seq 100); do
        netns_http_at "${1}hub" "$NETNS_HUB_IP" 2379 /health | grep -q '"health":"true"' && return 0
        sleep 0.2
    done
    echo "etcd in ${1}hub did not become healthy in 20 s" >&2
    return 1
}

# netns_http_at NS ADDR PORT PATH: GET from a server inside a namespace (no curl needed); the
# body. netns_http NS PORT PATH: the same from 127.0.0.1 (a weft's health server).
netns_http_at() {
    ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3 && printf 'GET $4 HTTP/1.0\r\n\r\n' >&3 && cat <&3" 2>/dev/null |
        sed '1,/^\r$/d'
}
netns_http() {
    netns_http_at "$1" 127.0.0.1 "$2" "$3"
}

# netns_readdress NS DEV OLD NEW [GW]: moves DEV from the address OLD to NEW (both with their
# prefix length) and puts the default route back via GW (the hub by default): removing the
# address took it. The old address goes first: deleting a primary address deletes the
# secondaries of its subnet with it.
netns_readdress() {
    ip -n "$1" -batch - <<EOF2
addr del $3 dev $2
addr add $4 dev $2
EOF2
    ip -n "$1" route replace default via "${5:-$NETNS_HUB_IP}"
}
