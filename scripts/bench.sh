#!/usr/bin/env bash
# weft throughput benchmark: the same two namespace hosts, the same run, fourteen data paths
# by default (twelve over IPv4, two over IPv6; two more with FLANNELD).
#
#   <p>h1 eth0 192.0.2.1, 2001:db8::1 ==== <p>hub br0 ==== eth0 192.0.2.2, 2001:db8::2 <p>h2
#        veths of MTU 1500; etcd (for weft) in the hub on 192.0.2.254:2379
#
# The lab is scripts/lib/netns.sh's, the same as the end-to-end tests' and the demo's; the
# kernel rows' devices are set up by scripts/lib/flannel.sh, the tests' kernel flannel peer.
#
#   raw        iperf3 straight over the underlay veth
#   kernel     Linux VXLAN set up as flannel's vxlan backend does (flannel.1, nolearning,
#              permanent neigh + fdb entries, route via the peer's .0 onlink)
#   weft-vxlan weft run, vxlan backend, all batching and offloads on
#   weft-vxlan-tailpad  weft-vxlan with the equal-tail workaround weft uses on kernels 7.0 to
#              7.1.4 (no GSO message ends on a full segment: an 18-byte pad, or datagrams
#              alone), forced by the hidden --gso-never-equal-tail: what the workaround costs
#   weft-vxlan-nogso  weft-vxlan with --udp-gso off: what turning GSO off instead would cost
#   weft-udp   weft run, flannel's udp backend
#   weft-ipip  weft run, flannel's ipip backend: IP-in-IP (protocol 4) on raw IP sockets, no
#              UDP GSO/GRO (raw IP has neither), TUN offloads on; the kernel ipip row beside it
#              would need the kernel's ipip module (CONFIG_NET_IPIP), which this test machine
#              lacks, so there is none: compare with weft-udp (the same one-packet-per-message
#              path over UDP) and kernel
#   kernel-hostgw  flannel's host-gw as its backend programs it: a route 10.244.N.0/24 via the
#              peer's eth0 address on each host (flannel_route_peer), the destination on h2's lo
#   weft-hostgw weft run, host-gw backend: the same routes, put by weft; traffic to h2's
#              subnet's .0 (on h2's lo): the kernel forwards, weft only programs the routes
#   weft-wireguard  weft run, flannel's wireguard backend: its TUN (MTU the underlay's less 80)
#              and WireGuard on UDP 51820, the key made in the state dir
#   wireguard-go  the incumbent user-space WireGuard: h1 and h2 as flannel wireguard nodes
#              without the kernel module (flannel_wg_up/_peer: wireguard-go and `wg set`, MTU
#              1420, keys from `wg genkey`), traffic 10.244.1.0 -> 10.244.2.0 through them
#   weft-base  weft run, vxlan, one worker, no TUN offload, no UDP GSO/GRO, no batching:
#              the flannel-udp-like baseline (one packet per syscall)
#   kernel6    Linux VXLAN over the IPv6 underlay set up as flannel's dual-stack vxlan backend
#              does (flannel-v6.1 over 2001:db8::N, nolearning, <v6 base>/128, permanent neigh +
#              fdb entries, route via the peer's v6 base onlink; MTU the kernel's 1430), traffic
#              between the hosts' overlay IPv6 addresses (fd00:10:244:1:: -> fd00:10:244:2::)
#   flanneld-udp  flanneld v0.19.0 itself (FLANNELD=<path>), udp backend: its user-space proxy,
#              one thread poll()ing flannel0 (a TUN device) and a UDP socket on port 8285,
#              one packet per call: the incumbent user-space data plane
#   flanneld-vxlan flanneld v0.19.0 (FLANNELD), vxlan backend: the kernel path as flanneld
#              itself programs it (flannel.1, neighbours, FDB entries, routes)
#   weft-vxlan6 weft run on the dual-stack vxlan network (EnableIPv6, fd00:10:244::/56), all
#              batching and offloads on as for weft-vxlan; IPv6 in VXLAN over the IPv6 underlay
#              (PublicIPv6 2001:db8::N from --iface), traffic between the hosts' weft0 IPv6
#              addresses (<v6 subnet base>, from subnet.env's FLANNEL_IPV6_SUBNET; route MTU 1430)
#
# The IPv6 rows (kernel6, weft-vxlan6) get their own tables, and their ratios are to kernel6
# (kernel VXLAN over IPv6), not to the IPv4 kernel row. iperf3 and ping run with -6 for them.
# sockperf over IPv6: only if this machine's sockperf takes an IPv6 address (checked at start;
# sockperf 3.7, the version this was written with, refuses one: "Invalid address"); if not,
# the IPv6 rows' sockperf cells read "n/a" (null in the JSON).
#
# For each: TCP 1 stream, TCP 4 streams, UDP 1400 B and 64 B packet rates (iperf3 -u -b 0), the
# TCP 1-stream retransmits (a healthy path shows none: they betray drops or reordering) and the
# segments the receiver queued out of order (TcpExt TCPOFOQueue in h2: reordering, even with
# nothing lost), both from the worst of the runs, and the latency figures below; every other
# figure is the median of RUNS runs. Overlay traffic goes host to
# host between the overlay addresses (10.244.1.0 -> 10.244.2.0; fd00:10:244:1:: -> :2:: over
# IPv6), so every path carries the same hops. Prints a throughput table and a latency table per
# family, each figure with its ratio to kernel VXLAN of the same family (kernel, or kernel6),
# and CPU seconds per GB forwarded (whole-machine busy time from /proc/stat during the TCP
# 1-stream runs), and writes it all as JSON to bench-results.json (or $BENCH_JSON).
#
# Latency, all round-trip times in microseconds (issue 12):
#   ping 5 ms   `ping -i 0.005`, 200 pings: the average RTT with a packet every 5 ms, so the
#               path's threads have little time to fall asleep (metric ping_us; the older figure)
#   idle ping   `ping -i 0.05`, IDLE_PINGS pings (100), one second after the bulk runs: the
#               average and minimum RTT with 50 ms of silence between packets, so every hop
#               has gone to sleep (idle_ping_avg_us, idle_ping_min_us); for weft, also its
#               forwarding threads' wake-ups per round trip, both hosts together, from
#               weft_dataplane_wakeups_total (idle_wakeups_per_ping; 3 is the least)
#   sockperf    `sockperf ping-pong` from h1 to a `sockperf server` on h2's overlay address,
#               UDP and TCP, SOCKPERF_MSG-byte (64) messages, one in flight, at a low rate
#               (--mps SOCKPERF_LOW_MPS, 100/s) and back to back (--mps max); p50 and p99.
#               Run with --full-rtt, so these are full round trips like ping's, not sockperf's
#               default one-way "latency" (which is RTT/2). Beware: sockperf paces a low rate by
#               busy-waiting between messages, so its client keeps one vCPU busy: "low rate",
#               not "idle machine"; the idle ping is the idle figure. (sp_{udp,tcp}_{low,max}_{p50,p99}_us)
#
# Usage: scripts/bench.sh [--quick]      RUNS=3 DURATION=5 IDLE_PINGS=100 by default;
#                                        --quick: RUNS=1 DURATION=2 IDLE_PINGS=40
#   (DURATION is also each sockperf run's length, warm-up included)
#   BENCH_PATHS="weft-vxlan"  only some paths (default: all fourteen: raw kernel weft-vxlan
#                             weft-vxlan-tailpad weft-vxlan-nogso weft-udp weft-ipip
#                             weft-wireguard wireguard-go weft-base kernel-hostgw weft-hostgw
#                             kernel6 weft-vxlan6)
#   BENCH_MODE=two-machines   model two machines on this one: h1's processes (daemons, iperf3,
#                             ping, sockperf; every thread, found with `ip netns pids`) pinned to
#                             CPU 0 and h2's to CPU 1 with taskset, and each host's eth0 steering
#                             its receive processing (RPS) to its own CPU, so a thread that spins
#                             or polls takes its own host's CPU, never its peer's. The default,
#                             BENCH_MODE=shared, leaves the scheduler free: both hosts share both
#                             cores (needs 2 CPUs or more)
#   WEFT_FLAGS="--spin 50us"  more flags for every weft row (split on spaces)
#   WEFT_BIN=/path/to/weft    bench that binary (e.g. another commit's build) instead of building
#   BENCH_LOGS=DIR            keep each weft run's log there as <path>-h<N>.log (the WORK dir,
#                             where weft logs, is removed on exit)
#   TRACE_IDLE=DIR            for each user-space row, one more idle ping traced with bpftrace
#                             and cut into its steps (scripts/lib/idle_trace.py) into DIR
#   FLANNELD=/path/flanneld   flanneld v0.19.0 (../shared/tools/build-flanneld): adds the rows
#                             flanneld-udp and flanneld-vxlan to the default paths (they may be
#                             named in BENCH_PATHS only with it)
#   WIREGUARD_GO=/path        the wireguard-go the wireguard-go row runs (default: wireguard-go
#                             on PATH, Debian's 0.0.20220316); ../shared/tools/build-wireguard-go
#                             builds the 2023 one with UDP GSO/GRO and TUN offloads
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/netns.sh
. scripts/lib/flannel.sh

RUNS=${RUNS:-3}
DURATION=${DURATION:-5}
IDLE_PINGS=${IDLE_PINGS:-100}
if [ "${1:-}" = "--quick" ]; then RUNS=1; DURATION=2; IDLE_PINGS=40; fi
SOCKPERF_MSG=${SOCKPERF_MSG:-64}
SOCKPERF_LOW_MPS=${SOCKPERF_LOW_MPS:-100}
SOCKPERF_UDP_PORT=11111
SOCKPERF_TCP_PORT=11112
OUT=${BENCH_JSON:-bench-results.json}
BENCH_MODE=${BENCH_MODE:-shared}
case $BENCH_MODE in
    shared) ;;
    two-machines)
        [ "$(nproc)" -ge 2 ] || { echo "bench: BENCH_MODE=two-machines needs 2 CPUs, this machine has $(nproc)" >&2; exit 1; } ;;
    *) echo "bench: BENCH_MODE is shared or two-machines, not $BENCH_MODE" >&2; exit 1 ;;
esac
PATHS=${BENCH_PATHS:-"raw kernel weft-vxlan weft-vxlan-tailpad weft-vxlan-nogso weft-udp weft-ipip weft-wireguard wireguard-go weft-base kernel-hostgw weft-hostgw kernel6 weft-vxlan6${FLANNELD:+ flanneld-udp flanneld-vxlan}"}
if [ -n "${FLANNELD:-}" ]; then
    FLANNELD=$(realpath "$FLANNELD")
    [ -x "$FLANNELD" ] || { echo "bench: FLANNELD=$FLANNELD is not an executable" >&2; exit 1; }
fi
for path in $PATHS; do
    case $path in
        raw | kernel | weft-vxlan | weft-vxlan-tailpad | weft-vxlan-nogso | weft-udp | weft-ipip | weft-wireguard | wireguard-go | weft-base | kernel-hostgw | weft-hostgw | kernel6 | weft-vxlan6) ;;
        flanneld-udp | flanneld-vxlan)
            [ -n "${FLANNELD:-}" ] || { echo "bench: path $path needs FLANNELD=<flanneld v0.19.0 binary>" >&2; exit 1; } ;;
        *) echo "bench: unknown path $path in BENCH_PATHS (see the header of $0)" >&2; exit 1 ;;
    esac
done

[ "$(id -u)" -eq 0 ] || { echo "bench: run as root (it creates network namespaces)" >&2; exit 1; }
scripts/setup.sh >/dev/null
# The wireguard-go row's binary, by absolute path (it runs inside the namespaces), and its
# version for the JSON: which wireguard-go was measured (Debian's, or the 2023 offload build).
WIREGUARD_GO_VERSION=""
if [[ " $PATHS " == *" wireguard-go "* ]]; then
    wg_go=$(command -v "${WIREGUARD_GO:-wireguard-go}" || true)
    [ -n "$wg_go" ] && [ -x "$wg_go" ] ||
        { echo "bench: path wireguard-go needs wireguard-go on PATH or WIREGUARD_GO=<path>: ${WIREGUARD_GO:-wireguard-go} is not an executable" >&2; exit 1; }
    WIREGUARD_GO=$(realpath "$wg_go")
    WIREGUARD_GO_VERSION=$("$WIREGUARD_GO" --version | head -1)
    echo "bench: wireguard-go row: $WIREGUARD_GO ($WIREGUARD_GO_VERSION)" >&2
fi
if [ -n "${WEFT_BIN:-}" ]; then
    WEFT=$(realpath "$WEFT_BIN")
else
    cargo build --release --quiet
    WEFT="${CARGO_TARGET_DIR:-$PWD/target}/release/weft"
fi

P="weftb$$-"
WORK=$(mktemp -d /tmp/weft-bench.XXXXXX)
H1="${P}h1"; H2="${P}h2"
# The servers each measure() starts in h2 (iperf3, sockperf UDP and TCP), by pid file: measure
# stops them itself; this is for an exit part-way (error, ^C). netns_cleanup then kills whatever
# else still runs in the namespaces (etcd, weft) and deletes them.
SERVER_PIDFILES="iperf.pid sockperf-udp.pid sockperf-tcp.pid"
stop_servers() {
    local f
    for f in $SERVER_PIDFILES; do
        if [ -f "$WORK/$f" ]; then
            kill "$(cat "$WORK/$f")" 2>/dev/null || true
            rm -f "$WORK/$f"
        fi
    done
}
cleanup() {
    stop_servers
    # Before the namespaces go: their wireguard-go exits with its device (and removes its
    # control socket, which lives outside the namespace, in /var/run/wireguard).
    if [ -n "${WGGO_UP:-}" ]; then wggo_down; fi
    netns_cleanup "$P"
    rm -rf "$WORK"
}
trap cleanup EXIT

# The IPv6 underlay is there for kernel6 and weft-vxlan6; weft ignores it on an IPv4-only network.
netns_hub_up "$P"
netns_host_up "$P" 1
netns_host_up "$P" 2
netns_hub_etcd "$P" "$WORK/etcd" >>"$WORK/etcd.log" 2>&1 &
disown
netns_wait_etcd "$P" || { tail -20 "$WORK/etcd.log" >&2; exit 1; }

# BENCH_MODE=two-machines: host N's CPU is N-1. Its eth0 steers received packets (RPS) to that
# CPU (`ip netns exec` mounts the namespace's own sysfs), so the receive softirq of a datagram
# runs on the receiving host's CPU, as on another machine; pin_hosts pins every thread of each
# host's processes, and in_h1 starts h1's traffic tools on CPU 0.
host_cpu() { echo $(($1 - 1)); }
if [ "$BENCH_MODE" = two-machines ]; then
    for n in 1 2; do
        ip netns exec "${P}h$n" sh -c "printf '%x' $((1 << $(host_cpu "$n"))) >/sys/class/net/eth0/queues/rx-0/rps_cpus"
    done
fi
pin_hosts() {
    [ "$BENCH_MODE" = two-machines ] || return 0
    local n pid
    for n in 1 2; do
        for pid in $(ip netns pids "${P}h$n"); do
            taskset -a -p -c "$(host_cpu "$n")" "$pid" >/dev/null 2>&1 || true
        done
    done
}
in_h1() {
    if [ "$BENCH_MODE" = two-machines ]; then
        taskset -c "$(host_cpu 1)" ip netns exec "$H1" "$@"
    else
        ip netns exec "$H1" "$@"
    fi
}
admin() { ip netns exec "${P}hub" "$WEFT" "$@" --etcd-endpoints "$NETNS_ETCD"; }

# Does this sockperf take an IPv6 address? (3.7 does not: "-i ::1" gives "Invalid address".)
# A server on h1's ::1 for a moment: one that refuses the address exits at once saying so.
if ip netns exec "$H1" timeout 1 sockperf server -i ::1 -p "$SOCKPERF_UDP_PORT" 2>&1 |
    grep -q "Invalid address"; then
    SOCKPERF_V6=0
else
    SOCKPERF_V6=1
fi

busy_jiffies() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
# Segments h2's TCP queued out of order so far (TcpExt TCPOFOQueue): a path that reorders
# shows them even when nothing is lost (docs/dataplane.md, "Flow order").
ofo_count() {
    ip netns exec "$H2" awk '/^TcpExt:/ { if (!c) { for (i = 2; i <= NF; i++) if ($i == "TCPOFOQueue") c = i }
        else print $c }' /proc/net/netstat
}

# measure NAME DST: runs every figure against DST (an address in h2), appends JSON lines.
# sockperf_pp NAME RUN PROTO(udp|tcp) RATE(low|max) DST: one sockperf ping-pong client run from
# h1 to h2's server; appends the p50 and p99 round-trip times (--full-rtt: RTT, not RTT/2).
sockperf_pp() {
    local name=$1 run=$2 proto=$3 rate=$4 dst=$5 args=() mps
    if [ "$proto" = tcp ]; then args=(--tcp -p "$SOCKPERF_TCP_PORT"); else args=(-p "$SOCKPERF_UDP_PORT"); fi
    if [ "$rate" = low ]; then mps=$SOCKPERF_LOW_MPS; else mps=max; fi
    in_h1 sockperf ping-pong -i "$dst" "${args[@]}" -m "$SOCKPERF_MSG" --mps "$mps" \
        -t "$DURATION" --full-rtt 2>&1 | tee "$WORK/sockperf-$proto-$rate.log" |
        awk -v n="$name" -v r="$run" -v m="sp_${proto}_${rate}" '
            /percentile 50\.000 =/ { p50 = $NF }
            /percentile 99\.000 =/ { p99 = $NF }
            END {
                if (p50 != "") printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"%s_p50_us\",\"value\":%f}\n", n, r, m, p50
                if (p99 != "") printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"%s_p99_us\",\"value\":%f}\n", n, r, m, p99
            }' >>"$WORK/raw.jsonl" || true
}

# measure NAME DST: DST an IPv6 address (it has a ':') runs iperf3 and ping with -6, and sockperf
# only if SOCKPERF_V6.
measure() {
    local name=$1 dst=$2 r proto rate fam=-4 sp=1
    if [[ $dst == *:* ]]; then fam=-6; sp=$SOCKPERF_V6; fi
    ip netns exec "$H2" iperf3 -s -D --pidfile "$WORK/iperf.pid" >/dev/null 2>&1
    if [ "$sp" = 1 ]; then
        ip netns exec "$H2" sockperf server -i "$dst" -p "$SOCKPERF_UDP_PORT" >"$WORK/sockperf-udp-server.log" 2>&1 &
        echo $! >"$WORK/sockperf-udp.pid"
        ip netns exec "$H2" sockperf server --tcp -i "$dst" -p "$SOCKPERF_TCP_PORT" >"$WORK/sockperf-tcp-server.log" 2>&1 &
        echo $! >"$WORK/sockperf-tcp.pid"
    fi
    sleep 0.3
    # The daemons and servers of this path are up: on their hosts' CPUs (two-machines mode).
    pin_hosts
    for r in $(seq 1 "$RUNS"); do
        local j0 j1 json ofo0 ofo1
        ofo0=$(ofo_count)
        j0=$(busy_jiffies)
        in_h1 iperf3 "$fam" -c "$dst" -t "$DURATION" -J >"$WORK/tcp1.json" 2>/dev/null || true
        j1=$(busy_jiffies)
        ofo1=$(ofo_count)
        python3 - "$name" "$r" "$j0" "$j1" "$(getconf CLK_TCK)" "$WORK/tcp1.json" "$dst" "$((ofo1 - ofo0))" >>"$WORK/raw.jsonl" <<'PY' || true
import ipaddress, json, sys
name, run, j0, j1, tck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
print(json.dumps({"path": name, "run": run, "metric": "tcp1_ofo", "value": int(sys.argv[8])}))
try:
    d = json.load(open(sys.argv[6]))
    bps = d["end"]["sum_received"]["bits_per_second"]
    nbytes = d["end"]["sum_received"]["bytes"]
    cpu = (j1 - j0) / tck
    # Where iperf3 says it connected: the path's own addresses (an IPv6 path really ran over IPv6).
    conn = (d["start"].get("connected") or [{}])[0]
    local, remote = conn.get("local_host"), conn.get("remote_host")
    if remote is None or ipaddress.ip_address(remote) != ipaddress.ip_address(sys.argv[7]):
        print(f"bench: {name}: iperf3 connected to {remote}, not {sys.argv[7]}", file=sys.stderr)
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_gbps", "value": bps / 1e9,
                      "local": local, "remote": remote}))
    print(json.dumps({"path": name, "run": run, "metric": "cpu_s_per_gb", "value": cpu / (nbytes / 1e9)}))
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_retr", "value": d["end"]["sum_sent"].get("retransmits", 0)}))
except Exception as e:
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_gbps", "value": None, "error": str(e)}))
PY
        json=$(in_h1 iperf3 "$fam" -c "$dst" -t "$DURATION" -P 4 -J 2>/dev/null || true)
        python3 -c '
import json, sys
d = json.load(sys.stdin)
print(json.dumps({"path": sys.argv[1], "run": int(sys.argv[2]), "metric": "tcp4_gbps", "value": d["end"]["sum_received"]["bits_per_second"] / 1e9}))
' "$name" "$r" <<<"$json" >>"$WORK/raw.jsonl" 2>/dev/null || true
        for size in 1400 64; do
            json=$(in_h1 iperf3 "$fam" -c "$dst" -u -b 0 -l "$size" -t "$DURATION" -J 2>/dev/null || true)
            python3 -c '
import json, sys
d = json.load(sys.stdin)
s = d["end"]["sum"]
secs = s["seconds"] or 1
rx = s["packets"] - s["lost_packets"]
print(json.dumps({"path": sys.argv[1], "run": int(sys.argv[2]), "metric": "udp" + sys.argv[3] + "_kpps", "value": rx / secs / 1e3}))
' "$name" "$r" "$size" <<<"$json" >>"$WORK/raw.jsonl" 2>/dev/null || true
        done
        # ping 5 ms: a packet every 5 ms (the older figure, ping_us): average RTT.
        in_h1 ping "$fam" -q -c 200 -i 0.005 -W 1 "$dst" 2>/dev/null |
            awk -F'[/ ]' -v n="$name" -v r="$r" '/^rtt/ {printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"ping_us\",\"value\":%f}\n", n, r, $8*1000}' \
            >>"$WORK/raw.jsonl" || true
        # idle ping: a packet every 50 ms, after a second of quiet: average and minimum RTT.
        sleep 1
        local woke=$(( $(wakeups 1) + $(wakeups 2) )) oncpu=$(( $(fwd_cpu_ns 1) + $(fwd_cpu_ns 2) ))
        in_h1 ping "$fam" -q -c "$IDLE_PINGS" -i 0.05 -W 1 "$dst" 2>/dev/null |
            awk -F'[/ ]' -v n="$name" -v r="$r" '/^rtt/ {
                printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"idle_ping_avg_us\",\"value\":%f}\n", n, r, $8*1000
                printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"idle_ping_min_us\",\"value\":%f}\n", n, r, $7*1000 }' \
            >>"$WORK/raw.jsonl" || true
        if [ -n "${TRACE_IDLE:-}" ] && [ "$r" = 1 ] && [[ $name == weft-* || $name == flanneld-udp ]]; then
            trace_idle "$name" "$dst"
        fi
        # weft's forwarding threads' wake-ups per idle round trip, both hosts together (issue 12:
        # where a round trip's time goes). Three is the least: the request wakes h1's thread
        # and h2's, and the reply h1's again (h2's reply is generated inside its TUN write and
        # read by the same thread without sleeping).
        if [[ $name == weft-* || $name == flanneld-udp ]]; then
            woke=$(( $(wakeups 1) + $(wakeups 2) - woke ))
            oncpu=$(( $(fwd_cpu_ns 1) + $(fwd_cpu_ns 2) - oncpu ))
            printf '{"path":"%s","run":%d,"metric":"idle_wakeups_per_ping","value":%s}\n' "$name" "$r" \
                "$(python3 -c "print($woke / $IDLE_PINGS)")" >>"$WORK/raw.jsonl"
            printf '{"path":"%s","run":%d,"metric":"idle_fwd_cpu_us_per_ping","value":%s}\n' "$name" "$r" \
                "$(python3 -c "print($oncpu / 1000 / $IDLE_PINGS)")" >>"$WORK/raw.jsonl"
        fi
        # request/response: sockperf ping-pong, UDP and TCP, at a low rate and back to back.
        if [ "$sp" = 1 ]; then
            for proto in udp tcp; do
                for rate in low max; do sockperf_pp "$name" "$r" "$proto" "$rate" "$dst"; done
            done
        fi
    done
    stop_servers
    sleep 0.3
}

# trace_idle NAME DST: TRACE_IDLE=DIR: another IDLE_PINGS idle pings, traced (bpftrace,
# scripts/lib/idle_trace.bt) into DIR/NAME.trace, the threads named in DIR/NAME.tids, cut into
# the round trip's steps by scripts/lib/idle_trace.py (DIR/NAME.steps, and .json). Not part of
# the figures: the tracing itself slows every step it sees.
trace_idle() {
    local name=$1 dst=$2 dir=$TRACE_IDLE n pid t bt
    mkdir -p "$dir"
    : >"$dir/$name.tids"
    for n in 1 2; do
        for t in $(fwd_tasks "$n"); do echo "${t##*/} h$n" >>"$dir/$name.tids"; done
    done
    bpftrace scripts/lib/idle_trace.bt >"$dir/$name.trace" 2>"$dir/$name.bpftrace.log" &
    bt=$!
    sleep 3 # bpftrace attaches
    ip netns exec "$H1" ping -q -c "$IDLE_PINGS" -i 0.05 -W 1 "$dst" >/dev/null 2>&1 &
    pid=$!
    echo "$pid ping" >>"$dir/$name.tids"
    wait "$pid" || true
    kill -INT "$bt"; wait "$bt" || true
    python3 scripts/lib/idle_trace.py "$dir/$name.trace" "$dir/$name.tids" --json "$dir/$name.json" \
        >"$dir/$name.steps" 2>&1 || true
    echo "== $name: idle round trip, step by step (TRACE_IDLE)" >&2
    cat "$dir/$name.steps" >&2
}

kernel_up() { # SUBNET1 SUBNET2: h1 and h2 as kernel flannel nodes holding SUBNET1 and SUBNET2
    # (one family: the VTEPs run over the underlay of that family), each routing to the other
    local mac1 mac2 at=netns_ip
    [[ $1 == *:* ]] && at=netns_ip6
    mac1=$(flannel_vtep_up "$H1" 1 "$1")
    mac2=$(flannel_vtep_up "$H2" 2 "$2")
    flannel_vtep_peer "$H1" "$2" "$mac2" "$($at 2)"
    flannel_vtep_peer "$H2" "$1" "$mac1" "$($at 1)"
}

# wggo_up: h1 and h2 as flannel wireguard nodes on user-space WireGuard ($WIREGUARD_GO), as
# kernel_up's: flannel-wg1 on h1 with 10.244.1.0/32, flannel-wg2 on h2 with 10.244.2.0/32 (MTU
# 1420, the route to 10.244.0.0/16 on the device, port 51820), keys from `wg genkey` 0600 in
# WORK, each the other's peer at its eth0 address as flanneld adds it from the lease; then a
# route both ways (a first ping, which also makes the handshake, answered within 30 s). What
# the setup prints on stderr (wireguard-go's banner about the kernel module; `wg` and `ip`
# errors) goes to WORK/wggo.log, shown if no ping comes back.
wggo_up() {
    local n pub1 pub2 log=$WORK/wggo.log
    for n in 1 2; do (umask 077 && wg genkey >"$WORK/wg$n.key"); done
    WGGO_UP=1
    pub1=$(flannel_wg_up "$H1" 1 10.244.1.0/24 10.244.0.0/16 "$WORK/wg1.key" 51820 "$WIREGUARD_GO" 2>>"$log")
    pub2=$(flannel_wg_up "$H2" 2 10.244.2.0/24 10.244.0.0/16 "$WORK/wg2.key" 51820 "$WIREGUARD_GO" 2>>"$log")
    flannel_wg_peer "$H1" 1 "$pub2" "$(netns_ip 2):51820" 10.244.2.0/24 2>>"$log"
    flannel_wg_peer "$H2" 2 "$pub1" "$(netns_ip 1):51820" 10.244.1.0/24 2>>"$log"
    for _ in $(seq 20); do
        ip netns exec "$H1" ping -q -c 1 -W 1 10.244.2.0 >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "wireguard-go: no route from h1 to h2 in 30 s" >&2
    tail -20 "$log" >&2
    ip netns exec "$H1" wg show >&2 || true
    return 1
}
# wggo_pids N: the wireguard-go processes in host N's namespace (it daemonizes: no $! to keep).
wggo_pids() {
    local pid
    for pid in $(ip netns pids "${P}h$1" 2>/dev/null || true); do
        if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$WIREGUARD_GO" ]; then echo "$pid"; fi
    done
}
# wggo_down: the devices go (flannel_wg_down), and with them their wireguard-go, waited for
# (killed after 5 s), so that the next path starts from a clean lab; the keys go too.
wggo_down() {
    local n pids
    for n in 1 2; do flannel_wg_down "${P}h$n" "$n"; done
    for n in 1 2; do
        for _ in $(seq 50); do
            [ -z "$(wggo_pids "$n")" ] && break
            sleep 0.1
        done
        pids=$(wggo_pids "$n")
        if [ -n "$pids" ]; then
            echo "bench: wireguard-go on h$n outlived its device: killed" >&2
            # shellcheck disable=SC2086 # one pid a word
            kill $pids 2>/dev/null || true
        fi
    done
    rm -f "$WORK/wg1.key" "$WORK/wg2.key"
    WGGO_UP=""
}

wakeups() { # N: weft_dataplane_wakeups_total on host N (0 if weft does not answer); with a
    # flanneld running there, its proxy thread's voluntary context switches instead (the thread
    # asleep in poll(2), syscall 7 on x86-64: each is one wake-up; Go's own threads sleep in
    # futex or epoll and are not counted)
    if [ -f "$WORK/f$1/pid" ] && kill -0 "$(cat "$WORK/f$1/pid")" 2>/dev/null; then
        local t v=0
        for t in /proc/"$(cat "$WORK/f$1/pid")"/task/*; do
            [ "$(cut -d' ' -f1 "$t/syscall" 2>/dev/null)" = 7 ] &&
                v=$((v + $(awk '/^voluntary_ctxt_switches/ { print $2 }' "$t/status")))
        done
        echo "$v"
        return
    fi
    { netns_http "${P}h$1" 9797 /metrics || true; } |
        awk '/^weft_dataplane_wakeups_total / { v = $2 } END { print v + 0 }'
}

# fwd_tasks N: the forwarding threads of the data plane on host N, as /proc/<pid>/task/<tid>
# paths: weft's weft-q*, or flanneld's proxy thread (the one asleep in poll(2)); none if neither
# runs there.
fwd_tasks() {
    local pid t
    if [ -f "$WORK/f$1/pid" ]; then pid=$(cat "$WORK/f$1/pid"); elif [ -f "$WORK/w$1/pid" ]; then pid=$(cat "$WORK/w$1/pid"); else return 0; fi
    for t in /proc/"$pid"/task/*; do
        case $(cat "$t/comm" 2>/dev/null),$(cut -d' ' -f1 "$t/syscall" 2>/dev/null) in
            weft-q*,* | flanneld,7) echo "$t" ;;
        esac
    done
}
# fwd_cpu_ns N: the CPU time (ns, /proc/.../schedstat) the forwarding threads on host N used.
fwd_cpu_ns() {
    local t v=0
    for t in $(fwd_tasks "$1"); do v=$((v + $(cut -d' ' -f1 "$t/schedstat" 2>/dev/null || echo 0))); done
    echo "$v"
}

weft_up() { # BACKEND [ipv6] FLAGS...: ipv6, the dual-stack network (fd00:10:244::/56 beside
    # 10.244.0.0/16, a /64 each: fd00:10:244:1:: or :2::)
    local backend=$1 v6=""; shift
    if [ "${1:-}" = ipv6 ]; then
        v6=',"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":64,"IPv6SubnetMin":"fd00:10:244:1::","IPv6SubnetMax":"fd00:10:244:2::"'
        shift
    fi
    printf '{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.2.0"%s,"Backend":{"Type":"%s"}}' "$v6" "$backend" >"$WORK/net.json"
    admin network set "$WORK/net.json" >/dev/null 2>&1
    local n
    for n in 1 2; do
        rm -rf "$WORK/w$n"; mkdir -p "$WORK/w$n"
        # shellcheck disable=SC2086 # WEFT_FLAGS: one flag a word
        ip netns exec "${P}h$n" "$WEFT" run --etcd-endpoints "$NETNS_ETCD" \
            --state-dir "$WORK/w$n/state" --subnet-file "$WORK/w$n/subnet.env" \
            --iface eth0 --relinquish-on-exit --healthz-ip 127.0.0.1 --healthz-port 9797 "$@" ${WEFT_FLAGS:-} \
            >"$WORK/w$n/log" 2>&1 &
        echo $! >"$WORK/w$n/pid"
    done
    for n in 1 2; do
        local ok=0
        for _ in $(seq 1 100); do
            if netns_http "${P}h$n" 9797 /readyz | grep -q "is ready"; then ok=1; break; fi
            sleep 0.1
        done
        [ "$ok" = 1 ] || { echo "weft on h$n did not become ready:" >&2; tail -20 "$WORK/w$n/log" >&2; return 1; }
    done
    sleep 1 # routes
}
weft_down() { # PATH: its name, for BENCH_LOGS
    local n
    for n in 1 2; do kill "$(cat "$WORK/w$n/pid")" 2>/dev/null || true; done
    for n in 1 2; do while kill -0 "$(cat "$WORK/w$n/pid")" 2>/dev/null; do sleep 0.1; done; done
    if [ -n "${BENCH_LOGS:-}" ]; then
        mkdir -p "$BENCH_LOGS"
        for n in 1 2; do cp "$WORK/w$n/log" "$BENCH_LOGS/$1-h$n.log"; done
    fi
}
weft_dst() { subnet_base "$WORK/w2/subnet.env"; }
subnet_base() { sed -n 's/^FLANNEL_SUBNET=\(.*\)\.1\/.*/\1.0/p' "$1"; } # SUBNET_ENV: its subnet's .0

flanneld_up() { # BACKEND (udp or vxlan): flanneld on h1 and h2 (scripts/lib/flannel.sh), and
    # a route both ways before measuring (a first ping answered within 20 s)
    printf '{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.2.0","Backend":{"Type":"%s"}}' "$1" >"$WORK/net.json"
    admin network set "$WORK/net.json" >/dev/null 2>&1
    local n
    # One after the other: two flanneld picking at once can pick the same subnet, and the one
    # that loses the race exits ("subnet already exists").
    for n in 1 2; do
        rm -rf "$WORK/f$n"
        flannel_flanneld_up "$FLANNELD" "${P}h$n" "$n" "$WORK/f$n"
        flannel_flanneld_wait "$WORK/f$n"
    done
    local dst _
    dst=$(subnet_base "$WORK/f2/subnet.env")
    for _ in $(seq 20); do
        ip netns exec "$H1" ping -q -c 1 -W 1 "$dst" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "flanneld-$1: no route from h1 to h2 in 30 s" >&2
    tail -20 "$WORK/f1/log" "$WORK/f2/log" >&2
    return 1
}
flanneld_down() { # PATH: its name, for BENCH_LOGS. flanneld keeps its lease and, for vxlan,
    # its device on exit: both go here, so that the next path starts from a clean lab.
    local n
    for n in 1 2; do flannel_flanneld_down "$WORK/f$n"; done
    if [ -n "${BENCH_LOGS:-}" ]; then
        mkdir -p "$BENCH_LOGS"
        for n in 1 2; do cp "$WORK/f$n/log" "$BENCH_LOGS/$1-h$n.log"; done
    fi
    for n in 1 2; do
        rm -f "$WORK/f$n/pid"
        ip -n "${P}h$n" link del flannel.1 2>/dev/null || true
    done
    ip netns exec "${P}hub" etcdctl --endpoints "$NETNS_ETCD" del --prefix /coreos.com/network/subnets >/dev/null
}
# h2's weft0 IPv6 address: the base of subnet.env's FLANNEL_IPV6_SUBNET (fd00:10:244:2::1/64 ->
# fd00:10:244:2::), checked against weft0's addresses.
weft_dst6() {
    local env dst
    env=$(sed -n 's/^FLANNEL_IPV6_SUBNET=//p' "$WORK/w2/subnet.env")
    [ -n "$env" ] || { echo "bench: no FLANNEL_IPV6_SUBNET in h2's subnet.env" >&2; return 1; }
    dst=$(python3 -c 'import ipaddress, sys; print(ipaddress.ip_interface(sys.argv[1]).network.network_address)' "$env")
    ip -n "$H2" -6 -br addr show dev weft0 | grep -q " $dst/128" ||
        { echo "bench: weft0 on h2 lacks $dst/128:" >&2; ip -n "$H2" -6 addr show dev weft0 >&2; return 1; }
    echo "$dst"
}

for path in $PATHS; do
    echo "== $path" >&2
    case $path in
        raw) measure raw 192.0.2.2 ;;
        kernel)
            kernel_up 10.244.1.0/24 10.244.2.0/24
            measure kernel 10.244.2.0
            ip -n "$H1" link del flannel.1; ip -n "$H2" link del flannel.1 ;;
        weft-vxlan) weft_up vxlan; measure weft-vxlan "$(weft_dst)"; weft_down weft-vxlan ;;
        weft-vxlan-tailpad)
            weft_up vxlan --gso-never-equal-tail
            measure weft-vxlan-tailpad "$(weft_dst)"; weft_down weft-vxlan-tailpad ;;
        weft-vxlan-nogso)
            weft_up vxlan --udp-gso off
            measure weft-vxlan-nogso "$(weft_dst)"; weft_down weft-vxlan-nogso ;;
        weft-udp) weft_up udp; measure weft-udp "$(weft_dst)"; weft_down weft-udp ;;
        weft-ipip) weft_up ipip; measure weft-ipip "$(weft_dst)"; weft_down weft-ipip ;;
        weft-wireguard)
            weft_up wireguard; measure weft-wireguard "$(weft_dst)"; weft_down weft-wireguard ;;
        wireguard-go) wggo_up; measure wireguard-go 10.244.2.0; wggo_down ;;
        kernel-hostgw)
            flannel_route_peer "$H1" 10.244.2.0/24 "$(netns_ip 2)" eth0
            flannel_route_peer "$H2" 10.244.1.0/24 "$(netns_ip 1)" eth0
            ip -n "$H2" addr add 10.244.2.0/32 dev lo
            measure kernel-hostgw 10.244.2.0
            ip -n "$H2" addr del 10.244.2.0/32 dev lo
            flannel_unroute_peer "$H1" 10.244.2.0/24; flannel_unroute_peer "$H2" 10.244.1.0/24 ;;
        weft-hostgw)
            weft_up host-gw
            dst=$(weft_dst)
            ip -n "$H2" addr add "$dst/32" dev lo
            measure weft-hostgw "$dst"
            ip -n "$H2" addr del "$dst/32" dev lo
            weft_down weft-hostgw
            # The routes stay when weft stops (as flannel's): remove them for the next path.
            for n in 1 2; do ip -n "${P}h$n" route flush proto 119; done ;;
        weft-base)
            weft_up vxlan --workers 1 --no-tun-offload --no-udp-gso --no-udp-gro --no-batching
            measure weft-base "$(weft_dst)"; weft_down weft-base ;;
        kernel6)
            kernel_up fd00:10:244:1::/64 fd00:10:244:2::/64
            measure kernel6 fd00:10:244:2::
            ip -n "$H1" link del flannel-v6.1; ip -n "$H2" link del flannel-v6.1 ;;
        flanneld-udp | flanneld-vxlan)
            flanneld_up "${path#flanneld-}"
            measure "$path" "$(subnet_base "$WORK/f2/subnet.env")"; flanneld_down "$path" ;;
        weft-vxlan6)
            weft_up vxlan ipv6
            dst6=$(weft_dst6)
            measure weft-vxlan6 "$dst6"; weft_down weft-vxlan6 ;;
    esac
done

BENCH_MODE=$BENCH_MODE WIREGUARD_GO_VERSION=$WIREGUARD_GO_VERSION python3 - "$WORK/raw.jsonl" "$OUT" "$RUNS" "$DURATION" "$IDLE_PINGS" "$SOCKPERF_MSG" "$SOCKPERF_LOW_MPS" "$SOCKPERF_V6" <<'PY'
import json, os, statistics, sys, platform
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs, duration, idle_pings, sp_msg, sp_low, sp_v6 = (int(a) for a in sys.argv[3:9])
IPV6_PATHS = ("kernel6", "weft-vxlan6")  # over the IPv6 underlay: ratios to kernel6
def baseline(p): return "kernel6" if p in IPV6_PATHS else "kernel"
throughput = ["tcp1_gbps", "tcp4_gbps", "udp1400_kpps", "udp64_kpps", "cpu_s_per_gb", "tcp1_retr", "tcp1_ofo"]
# Reordering comes in bursts, in some runs and not others: these show the worst run, not the median.
WORST = ("tcp1_retr", "tcp1_ofo")
sockperf = [f"sp_{proto}_{rate}_{q}_us" for proto in ("udp", "tcp") for rate in ("low", "max") for q in ("p50", "p99")]
latency = ["ping_us", "idle_ping_avg_us", "idle_ping_min_us", "idle_wakeups_per_ping", "idle_fwd_cpu_us_per_ping"] + sockperf
metrics = throughput + latency
paths = []
for r in rows:
    if r["path"] not in paths:
        paths.append(r["path"])
med = {}
for p in paths:
    for m in metrics:
        vals = [r["value"] for r in rows if r["path"] == p and r["metric"] == m and r.get("value") is not None]
        med[(p, m)] = (max(vals) if m in WORST else statistics.median(vals)) if vals else None
def fmt(v, m, p):
    if v is None:
        # sockperf that refuses IPv6 addresses: not measured, rather than failed.
        return "n/a" if p in IPV6_PATHS and m.startswith("sp_") and not sp_v6 else "-"
    if m in ("idle_wakeups_per_ping", "idle_fwd_cpu_us_per_ping"): return f"{v:.1f}"
    return f"{v:.2f}" if m in ("tcp1_gbps", "tcp4_gbps", "cpu_s_per_gb") else f"{v:.0f}"
def cell(p, m):
    """The median, and its ratio to kernel VXLAN's over the same family (kernel, or kernel6 for
    the IPv6 paths; not for CPU s/GB and retransmits)."""
    b = baseline(p)
    v, k = med[(p, m)], med.get((b, m))
    c = fmt(v, m, p)
    if v is not None and k and p != b and m not in ("cpu_s_per_gb",) + WORST:
        c += f" ({v / k:.2f}x)"
    return c
v4 = [p for p in paths if p not in IPV6_PATHS]
v6 = [p for p in paths if p in IPV6_PATHS]
sections = [(ps, title) for ps, title in (
    (v4, "IPv4 (ratios to kernel)"),
    (v6, "IPv6: over the IPv6 underlay (ratios to kernel6, kernel VXLAN over IPv6)")) if ps]
def table(ps, hdr, cols):
    print("| " + " | ".join(hdr) + " |")
    print("|" + "|".join("---" for _ in hdr) + "|")
    for p in ps:
        print("| " + " | ".join([p] + [" / ".join(cell(p, m) for m in c) for c in cols]) + " |")
    print()
for ps, title in sections:
    print(f"Throughput, {title}")
    table(ps, ["path", "TCP 1 (Gb/s)", "TCP 4 (Gb/s)", "UDP 1400 (kpps)", "UDP 64 (kpps)", "CPU s/GB", "TCP 1 retr / OFO (worst run)"],
          [[m] for m in throughput[:5]] + [list(WORST)])
low = f"{sp_low}/s"
for ps, title in sections:
    print(f"Latency, {title}")
    table(ps, ["path", "ping 5 ms avg", "idle ping avg", "idle ping min", "wake-ups / idle ping", "fwd CPU µs / idle ping",
               f"UDP {low} p50 / p99", "UDP max p50 / p99", f"TCP {low} p50 / p99", "TCP max p50 / p99"],
          [["ping_us"], ["idle_ping_avg_us"], ["idle_ping_min_us"], ["idle_wakeups_per_ping"], ["idle_fwd_cpu_us_per_ping"]] +
          [[f"sp_{proto}_{rate}_p50_us", f"sp_{proto}_{rate}_p99_us"] for proto in ("udp", "tcp") for rate in ("low", "max")])
print(f"latency: round-trip times in microseconds. ping 5 ms: ping -i 0.005 (200 pings); idle ping: ping -i 0.05 "
      f"({idle_pings} pings); UDP/TCP: sockperf ping-pong --full-rtt, {sp_msg} B messages, --mps {sp_low} and --mps max")
if v6 and not sp_v6:
    print("sockperf over IPv6: n/a (this sockperf refuses IPv6 addresses)")
print("ratios in brackets are to kernel VXLAN of the same family: IPv4 rows to kernel, IPv6 rows to kernel6; "
      "medians of", runs, "runs of", duration, "s (TCP 1 retransmits and segments the receiver queued out of "
      "order: the worst run)")
print("mode:", os.environ["BENCH_MODE"], "(two-machines: h1 on CPU 0, h2 on CPU 1, RPS to each host's CPU)"
      if os.environ["BENCH_MODE"] == "two-machines" else "(both hosts share every CPU)")
out = {"runs": runs, "duration_s": duration, "kernel": platform.release(), "mode": os.environ["BENCH_MODE"],
       "latency": {"unit": "microseconds, full round trip", "idle_pings": idle_pings, "idle_ping_interval_s": 0.05,
                   "sockperf_msg_bytes": sp_msg, "sockperf_low_mps": sp_low,
                   "sockperf": "ping-pong --full-rtt: RTT percentiles, not sockperf's default one-way RTT/2"},
       "families": {p: "ipv6" if p in IPV6_PATHS else "ipv4" for p in paths},
       "ratio_baseline": {p: baseline(p) for p in paths},
       "sockperf_ipv6": bool(sp_v6),
       "wireguard_go": os.environ.get("WIREGUARD_GO_VERSION") or None,
       "results": {p: {m: med[(p, m)] for m in metrics} for p in paths}, "samples": rows}
json.dump(out, open(sys.argv[2], "w"), indent=2)
print("JSON:", sys.argv[2])
PY
