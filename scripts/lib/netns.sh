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

# netns_etcd NS NAME DATA_DIR CLIENT_URL PEER_URL INITIAL_CLUSTER LOG [ETCD FLAG...]
# Starts one etcd member inside namespace NS in the background ($! is its pid), listening on and
# advertising CLIENT_URL and PEER_URL, its output appended to LOG. The one spelling of etcd's
# command line for the demo, the bench and the chaos soak; the flags after LOG (cluster state
# and token, raft timing, log level) go to etcd as they are.
netns_etcd() {
    local ns=$1 name=$2 dir=$3 client=$4 peer=$5 initial=$6 log=$7
    shift 7
    ip netns exec "$ns" etcd --name "$name" --data-dir "$dir" \
        --listen-client-urls "$client" --advertise-client-urls "$client" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "$initial" "$@" >>"$log" 2>&1 &
}

# netns_http NS PORT PATH: GET from a health server inside a namespace (no curl needed).
netns_http() {
    ip netns exec "$1" bash -c "exec 3<>/dev/tcp/127.0.0.1/$2 && printf 'GET $3 HTTP/1.0\r\n\r\n' >&3 && cat <&3" 2>/dev/null |
        sed '1,/^\r$/d'
}
