# shellcheck shell=bash
# Network-namespace test hosts for weft's demo, end-to-end tests and benchmarks. Source it.
#
#   <p>hub  : a bridge br0 (192.0.2.254/24): the shared underlay; etcd listens here
#   <p>hN   : a host; eth0 = 192.0.2.N/24 on the hub's bridge, default route via .254
#
# Everything is created inside namespaces this script makes (veth pairs are created from
# inside the hub, so no link ever appears in the root namespace), named with a caller-chosen
# prefix, and removed by netns_cleanup. The root namespace's links, routes and addresses are
# never touched.

# shellcheck source=scripts/lib/etcd.sh
. "$(dirname "${BASH_SOURCE[0]}")/etcd.sh"

# The hub's address, and the lab's etcd client URL.
NETNS_HUB_IP=192.0.2.254
NETNS_ETCD="http://$NETNS_HUB_IP:2379"

netns_hub_up() { # PREFIX
    local hub="${1}hub"
    ip netns add "$hub"
    ip -n "$hub" link set lo up
    # A fixed MAC: a bridge without one takes its lowest port's MAC and changes it when a
    # port with a lower one joins, and hosts that resolved 192.0.2.254 before then lose it
    # until their neighbour entry expires (integration/support/netns.rs, HUB_MAC).
    ip -n "$hub" link add br0 address 02:00:c0:00:02:fe type bridge
    ip -n "$hub" addr add 192.0.2.254/24 dev br0
    ip -n "$hub" link set br0 up
}

netns_host_up() { # PREFIX N [MTU]
    local hub="${1}hub" host="${1}h${2}" mtu="${3:-1500}"
    ip netns add "$host"
    ip -n "$host" link set lo up
    ip -n "$hub" link add "h${2}" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$host"
    ip -n "$hub" link set "h${2}" master br0 up
    ip -n "$host" addr add "192.0.2.${2}/24" dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$host" route add default via 192.0.2.254
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
