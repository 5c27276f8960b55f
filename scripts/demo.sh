#!/usr/bin/env bash
# weft demo: from a fresh machine, build weft, start etcd, bring up three network-namespace
# hosts on a shared underlay, run weft on each, put a pod behind each host, ping and iperf3
# pod to pod across the overlay, upgrade one host's weft in place under pings, then show the
# lease control plane at work: a suspended host coming back to its own subnet, an operator's
# revoke, and a clean shutdown that relinquishes.
#
#   192.0.2.254  <p>hub  bridge br0 + etcd
#   192.0.2.1-4  <p>h1..h4  weft run (TUN weft0, VXLAN on UDP 8472)
#   10.244.X.2   <p>p1..p3  pods behind cni0 (10.244.X.1) on each host
#
# The lab is scripts/lib/netns.sh's (the end-to-end tests build theirs with it too), the pods
# scripts/lib/cni.sh's.
# Everything lives in namespaces named weftdemo<pid>*, removed on exit. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/netns.sh
. scripts/lib/cni.sh

[ "$(id -u)" -eq 0 ] || { echo "demo: run as root (it creates network namespaces)" >&2; exit 1; }
scripts/setup.sh >/dev/null
echo "== building weft (release)"
cargo build --release --quiet
WEFT="${CARGO_TARGET_DIR:-$PWD/target}/release/weft"
[[ "$WEFT" = /* ]] || WEFT="$PWD/$WEFT"

P="weftdemo$$-"
WORK=$(mktemp -d /tmp/weft-demo.XXXXXX)
ETCD=$NETNS_ETCD
PREFIX=/coreos.com/network
TTL=6s
declare -A PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill -CONT "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done
    sleep 0.5
    netns_cleanup "$P"
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n== %s\n' "$*"; }
hub() { ip netns exec "${P}hub" "$@"; }
weft_admin() { hub "$WEFT" "$@" --etcd-endpoints "$ETCD" --etcd-prefix "$PREFIX"; }

start_host() { # N [extra flags...]
    local n=$1; shift
    [ -e "/run/netns/${P}h$n" ] || netns_host_up "$P" "$n"
    mkdir -p "$WORK/h$n"
    ip netns exec "${P}h$n" "$WEFT" run --etcd-endpoints "$ETCD" --etcd-prefix "$PREFIX" \
        --state-dir "$WORK/h$n/state" --subnet-file "$WORK/h$n/subnet.env" \
        --subnet-lease-ttl "$TTL" --healthz-ip 127.0.0.1 --healthz-port 9797 "$@" \
        >>"$WORK/h$n/weft.log" 2>&1 &
    PIDS[$n]=$!
}

wait_ready() { # N
    for _ in $(seq 1 100); do
        if netns_http "${P}h$1" 9797 /readyz | grep -q "is ready"; then return 0; fi
        sleep 0.2
    done
    echo "host $1 did not become ready:"; tail -20 "$WORK/h$1/weft.log"; return 1
}

subnet_of() { grep FLANNEL_SUBNET "$WORK/h$1/subnet.env" | cut -d= -f2; }

say "underlay: hub namespace with a bridge, etcd on 192.0.2.254"
netns_hub_up "$P"
netns_hub_etcd "$P" "$WORK/etcd" >>"$WORK/etcd.log" 2>&1 &
PIDS[etcd]=$!
netns_wait_etcd "$P" || { tail -20 "$WORK/etcd.log"; exit 1; }

say "network config"
printf '{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}' >"$WORK/net.json"
weft_admin network set "$WORK/net.json"
weft_admin network get

say "three hosts start weft (lease TTL $TTL): each leases a subnet and brings up TUN weft0"
for n in 1 2 3; do start_host "$n"; done
for n in 1 2 3; do wait_ready "$n"; echo "host $n (192.0.2.$n): FLANNEL_SUBNET=$(subnet_of "$n")"; done
echo; cat "$WORK/h1/subnet.env"
weft_admin lease list

say "a pod on each host, attached by the CNI bridge and host-local plugins with the config flannel's CNI plugin builds from subnet.env"
declare -A POD=()
for n in 1 2 3; do POD[$n]=$(cni_pod_up "$P" "$n" "$WORK/h$n/subnet.env" "$WORK/h$n/cni"); echo "pod $n: ${POD[$n]}"; done
echo; echo "host 1 routes:"; ip -n "${P}h1" route show | sed 's/^/  /'
ip -n "${P}h1" -br addr show weft0 | sed 's/^/  /'
netns_http "${P}h1" 9797 /metrics | grep -E "^weft_routes " | sed 's/^/  /'

say "ping pod 1 -> pods 2 and 3 across the overlay"
for n in 2 3; do ip netns exec "${P}p1" ping -c 3 -i 0.2 -W 2 "${POD[$n]}" | tail -2 | sed 's/^/  /'; done

say "iperf3 TCP, pod 1 -> pod 2, 5 s ($(sed -n 's/^FLANNEL_MTU=//p' "$WORK/h1/subnet.env")-byte overlay MTU)"
ip netns exec "${P}p2" iperf3 -s -1 -D >/dev/null 2>&1
sleep 0.5
ip netns exec "${P}p1" iperf3 -c "${POD[2]}" -t 5 -f g | grep -E "sender|receiver" | sed 's/^/  /'
netns_http "${P}h1" 9797 /metrics | grep -E "^weft_dataplane_(tx|rx)_packets_total" | sed 's/^/  h1 /'

say "host 2's weft upgrades in place while pod 1 pings pod 2 every 5 ms: SIGHUP re-executes its binary in the same PID, a bridge process holding the TUN device, sockets and lease meanwhile"
ip netns exec "${P}p1" ping -n -i 0.005 -c 400 -W 1 "${POD[2]}" >"$WORK/upgrade-ping.txt" 2>&1 &
PING=$!
sleep 0.5
kill -HUP "${PIDS[2]}"
for _ in $(seq 1 100); do
    grep -q "handed over: the next weft" "$WORK/h2/weft.log" && break
    sleep 0.1
done
wait "$PING" || true
# The bridge and the re-executed image share the log and each take the lease over (from weft,
# then from the bridge): the re-executed image's line, after "re-executing", is the one shown.
awk '/re-executing/ { reexec = 1 }
     /upgrading in place|the bridge forwards/ { print; next }
     reexec && /holding the lease the previous/ { print; exit }' "$WORK/h2/weft.log" | sed 's/^/  h2| /'

grep -E "packets transmitted" "$WORK/upgrade-ping.txt" | sed 's/^/  pings across the upgrade: /'
echo "  host 2 is still pid ${PIDS[2]}: $(tr '\0' ' ' </proc/"${PIDS[2]}"/cmdline | cut -c1-60)..."

say "host 1 is suspended (SIGSTOP) past its TTL; its key expires"
S1=$(subnet_of 1)
kill -STOP "${PIDS[1]}"
sleep 8
weft_admin lease list
say "host 4 joins while host 1 sleeps: it prefers never-used subnets over host 1's expired one"
start_host 4
wait_ready 4
echo "host 4: FLANNEL_SUBNET=$(subnet_of 4)"
say "host 1 resumes and reclaims the same subnet"
kill -CONT "${PIDS[1]}"
wait_ready 1
grep -E "recovered|expired locally" "$WORK/h1/weft.log" | sed 's/^/  h1| /' | tail -3
echo "host 1: FLANNEL_SUBNET=$(subnet_of 1) (was $S1)"
netns_http "${P}h1" 9797 /metrics | grep -E "^weft_lease_(recoveries|losses)_total"

say "an operator revokes host 2's lease; host 2 notices and reclaims it"
S2=$(subnet_of 2)
weft_admin lease revoke "${S2%.1/24}.0/24"
sleep 1.5
grep "recovered" "$WORK/h2/weft.log" | sed 's/^/  h2| /' | tail -1

say "host 3 stops cleanly with --relinquish-on-exit semantics: restart it with the flag, then SIGTERM"
kill "${PIDS[3]}"; wait "${PIDS[3]}" 2>/dev/null || true
start_host 3 --relinquish-on-exit
wait_ready 3
kill "${PIDS[3]}"; wait "${PIDS[3]}" 2>/dev/null || true
unset 'PIDS[3]'
weft_admin lease list

say "done: leases were never shared, host 2 kept every ping through an upgrade, host 1 its subnet through a suspend, host 2 through a revoke"
