#!/usr/bin/env bash
# weft throughput benchmark: the same two namespace hosts, the same run, five data paths.
#
#   <p>h1 eth0 192.0.2.1 ==== veth (MTU 1500) ==== eth0 192.0.2.2 <p>h2
#        etcd on 192.0.2.1:2379 (for weft)
#
#   raw        iperf3 straight over the underlay veth
#   kernel     Linux VXLAN set up as flannel's vxlan backend does (flannel.1, nolearning,
#              permanent neigh + fdb entries, route via the peer's .0 onlink)
#   weft-vxlan weft run, vxlan backend, all batching and offloads on
#   weft-udp   weft run, flannel's udp backend
#   weft-base  weft run, vxlan, one worker, no TUN offload, no UDP GSO/GRO, no batching:
#              the flannel-udp-like baseline (one packet per syscall)
#
# For each: TCP 1 stream, TCP 4 streams, UDP 1400 B and 64 B packet rates (iperf3 -u -b 0), the
# TCP 1-stream retransmits (a healthy path shows none: they betray drops or reordering), and the
# latency figures below; each figure is the median of RUNS runs. Overlay traffic goes host to
# host between the overlay addresses (10.244.1.0 -> 10.244.2.0), so every path carries the same
# hops. Prints a throughput table and a latency table, each figure with its ratio to kernel VXLAN,
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
#   BENCH_PATHS="weft-vxlan"  only some paths (default: all five)
#   WEFT_BIN=/path/to/weft    bench that binary (e.g. another commit's build) instead of building
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/netns.sh

RUNS=${RUNS:-3}
DURATION=${DURATION:-5}
IDLE_PINGS=${IDLE_PINGS:-100}
if [ "${1:-}" = "--quick" ]; then RUNS=1; DURATION=2; IDLE_PINGS=40; fi
SOCKPERF_MSG=${SOCKPERF_MSG:-64}
SOCKPERF_LOW_MPS=${SOCKPERF_LOW_MPS:-100}
SOCKPERF_UDP_PORT=11111
SOCKPERF_TCP_PORT=11112
OUT=${BENCH_JSON:-bench-results.json}
PATHS=${BENCH_PATHS:-"raw kernel weft-vxlan weft-udp weft-base"}

[ "$(id -u)" -eq 0 ] || { echo "bench: run as root (it creates network namespaces)" >&2; exit 1; }
scripts/setup.sh >/dev/null
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
    netns_cleanup "$P"
    rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$H1"; ip netns add "$H2"
for h in "$H1" "$H2"; do ip -n "$h" link set lo up; done
ip -n "$H1" link add eth0 mtu 1500 type veth peer name eth0 mtu 1500 netns "$H2"
ip -n "$H1" addr add 192.0.2.1/24 dev eth0; ip -n "$H1" link set eth0 up
ip -n "$H2" addr add 192.0.2.2/24 dev eth0; ip -n "$H2" link set eth0 up

ip netns exec "$H1" etcd --name bench --data-dir "$WORK/etcd" \
    --listen-client-urls http://192.0.2.1:2379 --advertise-client-urls http://192.0.2.1:2379 \
    --listen-peer-urls http://127.0.0.1:23801 --initial-advertise-peer-urls http://127.0.0.1:23801 \
    --initial-cluster bench=http://127.0.0.1:23801 --log-level error >"$WORK/etcd.log" 2>&1 &
disown
for _ in $(seq 1 50); do
    ip netns exec "$H2" bash -c "exec 3<>/dev/tcp/192.0.2.1/2379" 2>/dev/null && break
    sleep 0.2
done
admin() { ip netns exec "$H2" "$WEFT" "$@" --etcd-endpoints http://192.0.2.1:2379; }

busy_jiffies() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }

# measure NAME DST: runs every figure against DST (an address in h2), appends JSON lines.
# sockperf_pp NAME RUN PROTO(udp|tcp) RATE(low|max) DST: one sockperf ping-pong client run from
# h1 to h2's server; appends the p50 and p99 round-trip times (--full-rtt: RTT, not RTT/2).
sockperf_pp() {
    local name=$1 run=$2 proto=$3 rate=$4 dst=$5 args=() mps
    if [ "$proto" = tcp ]; then args=(--tcp -p "$SOCKPERF_TCP_PORT"); else args=(-p "$SOCKPERF_UDP_PORT"); fi
    if [ "$rate" = low ]; then mps=$SOCKPERF_LOW_MPS; else mps=max; fi
    ip netns exec "$H1" sockperf ping-pong -i "$dst" "${args[@]}" -m "$SOCKPERF_MSG" --mps "$mps" \
        -t "$DURATION" --full-rtt 2>&1 | tee "$WORK/sockperf-$proto-$rate.log" |
        awk -v n="$name" -v r="$run" -v m="sp_${proto}_${rate}" '
            /percentile 50\.000 =/ { p50 = $NF }
            /percentile 99\.000 =/ { p99 = $NF }
            END {
                if (p50 != "") printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"%s_p50_us\",\"value\":%f}\n", n, r, m, p50
                if (p99 != "") printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"%s_p99_us\",\"value\":%f}\n", n, r, m, p99
            }' >>"$WORK/raw.jsonl" || true
}

measure() {
    local name=$1 dst=$2 r proto rate
    ip netns exec "$H2" iperf3 -s -D --pidfile "$WORK/iperf.pid" >/dev/null 2>&1
    ip netns exec "$H2" sockperf server -i "$dst" -p "$SOCKPERF_UDP_PORT" >"$WORK/sockperf-udp-server.log" 2>&1 &
    echo $! >"$WORK/sockperf-udp.pid"
    ip netns exec "$H2" sockperf server --tcp -i "$dst" -p "$SOCKPERF_TCP_PORT" >"$WORK/sockperf-tcp-server.log" 2>&1 &
    echo $! >"$WORK/sockperf-tcp.pid"
    sleep 0.3
    for r in $(seq 1 "$RUNS"); do
        local j0 j1 json
        j0=$(busy_jiffies)
        ip netns exec "$H1" iperf3 -c "$dst" -t "$DURATION" -J >"$WORK/tcp1.json" 2>/dev/null || true
        j1=$(busy_jiffies)
        python3 - "$name" "$r" "$j0" "$j1" "$(getconf CLK_TCK)" "$WORK/tcp1.json" >>"$WORK/raw.jsonl" <<'PY' || true
import json, sys
name, run, j0, j1, tck = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
try:
    d = json.load(open(sys.argv[6]))
    bps = d["end"]["sum_received"]["bits_per_second"]
    nbytes = d["end"]["sum_received"]["bytes"]
    cpu = (j1 - j0) / tck
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_gbps", "value": bps / 1e9}))
    print(json.dumps({"path": name, "run": run, "metric": "cpu_s_per_gb", "value": cpu / (nbytes / 1e9)}))
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_retr", "value": d["end"]["sum_sent"].get("retransmits", 0)}))
except Exception as e:
    print(json.dumps({"path": name, "run": run, "metric": "tcp1_gbps", "value": None, "error": str(e)}))
PY
        json=$(ip netns exec "$H1" iperf3 -c "$dst" -t "$DURATION" -P 4 -J 2>/dev/null || true)
        python3 -c '
import json, sys
d = json.load(sys.stdin)
print(json.dumps({"path": sys.argv[1], "run": int(sys.argv[2]), "metric": "tcp4_gbps", "value": d["end"]["sum_received"]["bits_per_second"] / 1e9}))
' "$name" "$r" <<<"$json" >>"$WORK/raw.jsonl" 2>/dev/null || true
        for size in 1400 64; do
            json=$(ip netns exec "$H1" iperf3 -c "$dst" -u -b 0 -l "$size" -t "$DURATION" -J 2>/dev/null || true)
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
        ip netns exec "$H1" ping -q -c 200 -i 0.005 -W 1 "$dst" 2>/dev/null |
            awk -F'[/ ]' -v n="$name" -v r="$r" '/^rtt/ {printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"ping_us\",\"value\":%f}\n", n, r, $8*1000}' \
            >>"$WORK/raw.jsonl" || true
        # idle ping: a packet every 50 ms, after a second of quiet: average and minimum RTT.
        sleep 1
        local woke=$(( $(wakeups 1) + $(wakeups 2) ))
        ip netns exec "$H1" ping -q -c "$IDLE_PINGS" -i 0.05 -W 1 "$dst" 2>/dev/null |
            awk -F'[/ ]' -v n="$name" -v r="$r" '/^rtt/ {
                printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"idle_ping_avg_us\",\"value\":%f}\n", n, r, $8*1000
                printf "{\"path\":\"%s\",\"run\":%d,\"metric\":\"idle_ping_min_us\",\"value\":%f}\n", n, r, $7*1000 }' \
            >>"$WORK/raw.jsonl" || true
        # weft's forwarding threads' wake-ups per idle round trip, both hosts together (issue 12:
        # where a round trip's time goes). Three is the least: the request wakes h1's thread
        # and h2's, and the reply h1's again (h2's reply is generated inside its TUN write and
        # read by the same thread without sleeping).
        if [[ $name == weft-* ]]; then
            woke=$(( $(wakeups 1) + $(wakeups 2) - woke ))
            printf '{"path":"%s","run":%d,"metric":"idle_wakeups_per_ping","value":%s}\n' "$name" "$r" \
                "$(python3 -c "print($woke / $IDLE_PINGS)")" >>"$WORK/raw.jsonl"
        fi
        # request/response: sockperf ping-pong, UDP and TCP, at a low rate and back to back.
        for proto in udp tcp; do
            for rate in low max; do sockperf_pp "$name" "$r" "$proto" "$rate" "$dst"; done
        done
    done
    stop_servers
    sleep 0.3
}

flannel_vxlan_up() { # NS LOCAL_IP N: a flannel.1 device as flannel's vxlan backend creates it
    local ns=$1 local_ip=$2 n=$3
    ip -n "$ns" link add flannel.1 type vxlan id 1 local "$local_ip" dev eth0 dstport 8472 nolearning
    ip -n "$ns" link set flannel.1 mtu 1450 up
    ip -n "$ns" addr add "10.244.$n.0/32" dev flannel.1
}
flannel_vxlan_peer() { # NS PEER_NS PEER_IP PN
    local mac
    mac=$(ip -n "$2" -br link show flannel.1 | awk '{print $3}')
    ip -n "$1" neigh replace "10.244.$4.0" lladdr "$mac" dev flannel.1 nud permanent
    bridge -n "$1" fdb append "$mac" dev flannel.1 dst "$3" self permanent
    ip -n "$1" route replace "10.244.$4.0/24" via "10.244.$4.0" dev flannel.1 onlink
}

wakeups() { # N: weft_dataplane_wakeups_total on host N (0 if weft does not answer)
    { netns_http "${P}h$1" 9797 /metrics || true; } |
        awk '/^weft_dataplane_wakeups_total / { v = $2 } END { print v + 0 }'
}

weft_up() { # BACKEND FLAGS...
    local backend=$1; shift
    printf '{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.2.0","Backend":{"Type":"%s"}}' "$backend" >"$WORK/net.json"
    admin network set "$WORK/net.json" >/dev/null 2>&1
    local n
    for n in 1 2; do
        rm -rf "$WORK/w$n"; mkdir -p "$WORK/w$n"
        ip netns exec "${P}h$n" "$WEFT" run --etcd-endpoints http://192.0.2.1:2379 \
            --state-dir "$WORK/w$n/state" --subnet-file "$WORK/w$n/subnet.env" \
            --iface eth0 --relinquish-on-exit --healthz-ip 127.0.0.1 --healthz-port 9797 "$@" \
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
weft_down() {
    local n
    for n in 1 2; do kill "$(cat "$WORK/w$n/pid")" 2>/dev/null || true; done
    for n in 1 2; do while kill -0 "$(cat "$WORK/w$n/pid")" 2>/dev/null; do sleep 0.1; done; done
}
weft_dst() { sed -n 's/^FLANNEL_SUBNET=\(.*\)\.1\/.*/\1.0/p' "$WORK/w2/subnet.env"; }

for path in $PATHS; do
    echo "== $path" >&2
    case $path in
        raw) measure raw 192.0.2.2 ;;
        kernel)
            flannel_vxlan_up "$H1" 192.0.2.1 1; flannel_vxlan_up "$H2" 192.0.2.2 2
            flannel_vxlan_peer "$H1" "$H2" 192.0.2.2 2; flannel_vxlan_peer "$H2" "$H1" 192.0.2.1 1
            measure kernel 10.244.2.0
            ip -n "$H1" link del flannel.1; ip -n "$H2" link del flannel.1 ;;
        weft-vxlan) weft_up vxlan; measure weft-vxlan "$(weft_dst)"; weft_down ;;
        weft-udp) weft_up udp; measure weft-udp "$(weft_dst)"; weft_down ;;
        weft-base)
            weft_up vxlan --workers 1 --no-tun-offload --no-udp-gso --no-udp-gro --no-batching
            measure weft-base "$(weft_dst)"; weft_down ;;
    esac
done

python3 - "$WORK/raw.jsonl" "$OUT" "$RUNS" "$DURATION" "$IDLE_PINGS" "$SOCKPERF_MSG" "$SOCKPERF_LOW_MPS" <<'PY'
import json, statistics, sys, platform
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs, duration, idle_pings, sp_msg, sp_low = (int(a) for a in sys.argv[3:8])
throughput = ["tcp1_gbps", "tcp4_gbps", "udp1400_kpps", "udp64_kpps", "cpu_s_per_gb", "tcp1_retr"]
sockperf = [f"sp_{proto}_{rate}_{q}_us" for proto in ("udp", "tcp") for rate in ("low", "max") for q in ("p50", "p99")]
latency = ["ping_us", "idle_ping_avg_us", "idle_ping_min_us", "idle_wakeups_per_ping"] + sockperf
metrics = throughput + latency
paths = []
for r in rows:
    if r["path"] not in paths:
        paths.append(r["path"])
med = {}
for p in paths:
    for m in metrics:
        vals = [r["value"] for r in rows if r["path"] == p and r["metric"] == m and r.get("value") is not None]
        med[(p, m)] = statistics.median(vals) if vals else None
def fmt(v, m):
    if v is None: return "-"
    if m == "idle_wakeups_per_ping": return f"{v:.1f}"
    return f"{v:.2f}" if m in ("tcp1_gbps", "tcp4_gbps", "cpu_s_per_gb") else f"{v:.0f}"
def cell(p, m):
    """The median, and its ratio to kernel VXLAN's (not for CPU s/GB and retransmits)."""
    v, k = med[(p, m)], med.get(("kernel", m))
    c = fmt(v, m)
    if v is not None and k and p != "kernel" and m not in ("cpu_s_per_gb", "tcp1_retr"):
        c += f" ({v / k:.2f}x)"
    return c
def table(hdr, cols):
    print("| " + " | ".join(hdr) + " |")
    print("|" + "|".join("---" for _ in hdr) + "|")
    for p in paths:
        print("| " + " | ".join([p] + [" / ".join(cell(p, m) for m in c) for c in cols]) + " |")
    print()
table(["path", "TCP 1 (Gb/s)", "TCP 4 (Gb/s)", "UDP 1400 (kpps)", "UDP 64 (kpps)", "CPU s/GB", "TCP 1 retr"],
      [[m] for m in throughput])
low = f"{sp_low}/s"
table(["path", "ping 5 ms avg", "idle ping avg", "idle ping min", "wake-ups / idle ping",
       f"UDP {low} p50 / p99", "UDP max p50 / p99", f"TCP {low} p50 / p99", "TCP max p50 / p99"],
      [["ping_us"], ["idle_ping_avg_us"], ["idle_ping_min_us"], ["idle_wakeups_per_ping"]] +
      [[f"sp_{proto}_{rate}_p50_us", f"sp_{proto}_{rate}_p99_us"] for proto in ("udp", "tcp") for rate in ("low", "max")])
print(f"latency: round-trip times in microseconds. ping 5 ms: ping -i 0.005 (200 pings); idle ping: ping -i 0.05 "
      f"({idle_pings} pings); UDP/TCP: sockperf ping-pong --full-rtt, {sp_msg} B messages, --mps {sp_low} and --mps max")
print("ratios in brackets are to kernel VXLAN; medians of", runs, "runs of", duration, "s")
out = {"runs": runs, "duration_s": duration, "kernel": platform.release(),
       "latency": {"unit": "microseconds, full round trip", "idle_pings": idle_pings, "idle_ping_interval_s": 0.05,
                   "sockperf_msg_bytes": sp_msg, "sockperf_low_mps": sp_low,
                   "sockperf": "ping-pong --full-rtt: RTT percentiles, not sockperf's default one-way RTT/2"},
       "results": {p: {m: med[(p, m)] for m in metrics} for p in paths}, "samples": rows}
json.dump(out, open(sys.argv[2], "w"), indent=2)
print("JSON:", sys.argv[2])
PY
