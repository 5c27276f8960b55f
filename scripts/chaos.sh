#!/usr/bin/env bash
# weft chaos soak: real weft processes, a real 3-member etcd cluster, faults at random.
#
#   <p>hub        bridge br0 192.0.2.254: the underlay
#   <p>e1..e3     etcd members 192.0.2.201-203 (heartbeat 50 ms, election 500 ms)
#   (the lab is scripts/lib/netns.sh's, the end-to-end tests' too: the etcd members are nodes
#   on its underlay)
#   <p>h1..hN     weft run (lease TTL $CHAOS_TTL s, all three etcd endpoints), 192.0.2.1..N
#   <p>p1..pN     a pod behind cni0 on each host; every pod pings every other (ping -i 0.2)
#
# Then, until CHAOS_DURATION seconds have passed, one fault at a time, each followed by a
# settle pause (one TTL) and the invariant check (scripts/chaos_check.py). The faults come in
# rounds, each round a seeded shuffle of every kind, so a short run still sees each once:
#
#   stop         SIGSTOP a weft for TTL+1..2*TTL s (its key expires), then SIGCONT
#   partition    cut a host from etcd for 2..3 TTLs, then heal: blackhole /32 routes to the
#                three etcd addresses in the host namespace and one to the host in each etcd
#                namespace (only etcd traffic; the overlay's UDP between hosts is untouched)
#   leader-kill  kill -9 the etcd leader (from `etcdctl endpoint status`), restart it 1-3 s later
#   member-wipe  kill a member, `member remove`, wipe its data dir, `member add`, start it with
#                --initial-cluster-state existing
#   storm        kill -9 a weft and restart it, 3-5 times, 1-2.5 s apart
#   compact      etcdctl compact <current revision> --physical
#   (snapshot restore of the whole cluster is not done: see the README)
#
# Invariants (exit 1 if any is broken): no two ready hosts claim one subnet (subnet.env or
# weft0's address), no ready host claims a subnet etcd gives to another node, no two live
# leases share an IPv4 subnet or an IPv6 half (the leases as `weft lease list --json` reads
# them, dual-stack keys included; `chaos_check.py --self-test` holds that check); no write
# changed a key's WeftNodeID without the key being deleted first (etcd watch with --prev-kv,
# and create revisions between checks); no host unready longer than the
# fault's duration plus two TTLs; and no fault loses more than CHAOS_MAX_LOSS % (default 5) of
# the pings it should not touch (a reply after more than 1 s counts as lost): for stop and
# storm every pair not involving the faulted host, for every other fault (etcd's faults,
# compaction, a partition from etcd) every pair.
#
# Usage: scripts/chaos.sh [--short]
#   CHAOS_SEED (random, printed)  CHAOS_DURATION (300 s; --short: 75 s)  CHAOS_HOSTS (4)
#   CHAOS_TTL (4 s)  CHAOS_MAX_LOSS (5)  CHAOS_KEEP=1 keeps the work dir with every log.
# Needs root. Everything lives in namespaces named weftchaos<pid>-*, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/netns.sh
. scripts/lib/cni.sh

SHORT=0
case "${1:-}" in
    --short) SHORT=1 ;;
    "") ;;
    *) echo "usage: $0 [--short]" >&2; exit 2 ;;
esac
CHAOS_SEED=${CHAOS_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}
if [ "$SHORT" = 1 ]; then CHAOS_DURATION=${CHAOS_DURATION:-75}; else CHAOS_DURATION=${CHAOS_DURATION:-300}; fi
HOSTS=${CHAOS_HOSTS:-4}
TTL=${CHAOS_TTL:-4}
MAX_LOSS=${CHAOS_MAX_LOSS:-5}
SETTLE=$TTL

[ "$(id -u)" -eq 0 ] || { echo "chaos: run as root (it creates network namespaces)" >&2; exit 1; }
scripts/setup.sh >/dev/null
python3 scripts/chaos_check.py --self-test >/dev/null || { python3 scripts/chaos_check.py --self-test >&2; exit 1; }
echo "== building weft (release)"
cargo build --release --quiet
WEFT="${CARGO_TARGET_DIR:-$PWD/target}/release/weft"
[[ "$WEFT" = /* ]] || WEFT="$PWD/$WEFT"

P="weftchaos$$-"
WORK=$(mktemp -d /tmp/weft-chaos.XXXXXX)
mkdir -p "$WORK/ping" "$WORK/ready" "$WORK/etcd"
PREFIX=/coreos.com/network
KEYS="$PREFIX/subnets/"
EIP=(x "$(netns_ip 201)" "$(netns_ip 202)" "$(netns_ip 203)") # nodes e1..e3 of the lab
EPS="http://${EIP[1]}:2379,http://${EIP[2]}:2379,http://${EIP[3]}:2379"
INITIAL="e1=http://${EIP[1]}:2380,e2=http://${EIP[2]}:2380,e3=http://${EIP[3]}:2380"
declare -A WPID=() EPID=() POD=()

cleanup() {
    local rc=$?
    set +e
    disown -a # no "Killed" notices for the helpers netns_cleanup kills
    for pid in "${WPID[@]}"; do kill -CONT "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
    sleep 0.3
    netns_cleanup "$P"
    if [ "${CHAOS_KEEP:-0}" = 1 ]; then echo "chaos: logs kept in $WORK"; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '== %s\n' "$*"; }
now() { echo "$EPOCHREALTIME"; }
hub() { ip netns exec "${P}hub" "$@"; }
ectl() { hub etcdctl --endpoints "$EPS" --dial-timeout 2s --command-timeout 5s "$@"; }
ectl_at() { local ep=$1; shift; hub etcdctl --endpoints "$ep" --dial-timeout 2s --command-timeout 5s "$@"; }
check() { python3 scripts/chaos_check.py check --work "$WORK" --netns-prefix "$P" --hosts "$HOSTS" \
    --endpoints "$EPS" --prefix "$KEYS" --etcd-prefix "$PREFIX" --weft "$WEFT" --label "$1"; }

# Seeded choices: only ever called in the main shell, so $RANDOM's sequence is the seed's.
RANDOM=$CHAOS_SEED
rnd() { R=$((RANDOM % $1)); } # R = 0..N-1

# --- etcd: three members, each in its own namespace on the underlay ---------------------------
etcd_ns_up() { # I
    netns_node_up "$P" "e$1" "$((200 + $1))"
}
etcd_start() { # I new|existing
    netns_etcd "${P}e$1" "e$1" "$WORK/etcd/e$1" "http://${EIP[$1]}:2379" "http://${EIP[$1]}:2380" \
        "$INITIAL" --initial-cluster-state "$2" --initial-cluster-token "$P" \
        --heartbeat-interval 50 --election-timeout 500 --log-level warn >>"$WORK/etcd/e$1.log" 2>&1 &
    EPID[$1]=$!
}
etcd_kill() { # I
    kill -9 "${EPID[$1]}" 2>/dev/null || true
    wait "${EPID[$1]}" 2>/dev/null || true
}
etcd_healthy() { # wait until all three answer; 0 if they do within 20 s
    for _ in $(seq 1 100); do
        [ "$(ectl endpoint health 2>&1 | grep -c 'is healthy')" = 3 ] && return 0
        sleep 0.2
    done
    return 1
}
etcd_leader() { # prints the index of the leader (1..3), or nothing
    ectl endpoint status -w json 2>/dev/null | python3 -c '
import json, sys
for s in json.load(sys.stdin):
    if s["Status"]["leader"] == s["Status"]["header"]["member_id"]:
        print(int(s["Endpoint"].split(":")[1].split(".")[-1]) - 200)' || true
}

# --- weft hosts -------------------------------------------------------------------------------
start_weft() { # N
    local n=$1
    ip netns exec "${P}h$n" "$WEFT" run --etcd-endpoints "$EPS" --etcd-prefix "$PREFIX" \
        --state-dir "$WORK/h$n/state" --subnet-file "$WORK/h$n/subnet.env" \
        --subnet-lease-ttl "${TTL}s" --healthz-ip 127.0.0.1 --healthz-port 9797 --workers 1 \
        >>"$WORK/h$n/weft.log" 2>&1 &
    WPID[$n]=$!
}
kill_weft() { # N
    kill -9 "${WPID[$1]}" 2>/dev/null || true
    wait "${WPID[$1]}" 2>/dev/null || true
}
# Runs inside a host namespace: one line "<epoch> 1|0" per /readyz probe, every 0.5 s.
poll_ready() {
    while :; do
        local t=$EPOCHREALTIME r
        r=$(timeout 1 bash -c 'exec 3<>/dev/tcp/127.0.0.1/9797 && printf "GET /readyz HTTP/1.0\r\n\r\n" >&3 && cat <&3' 2>/dev/null) || true
        if [[ $r == *"is ready"* ]]; then echo "$t 1"; else echo "$t 0"; fi
        sleep 0.5
    done
}
wait_ready() { # N
    for _ in $(seq 1 150); do
        netns_http "${P}h$1" 9797 /readyz | grep -q "is ready" && return 0
        sleep 0.2
    done
    echo "chaos: host $1 did not become ready:" >&2; tail -20 "$WORK/h$1/weft.log" >&2; return 1
}

# --- faults: each sets T0 (start), T1 (healed), WHAT, HOST (a weft host or empty), ERR ---------
fault_stop() {
    rnd "$HOSTS"; HOST=$((R + 1)); rnd "$TTL"; local d=$((TTL + 1 + R))
    WHAT="h$HOST SIGSTOP ${d}s"; T0=$(now)
    kill -STOP "${WPID[$HOST]}"; sleep "$d"; kill -CONT "${WPID[$HOST]}"
    T1=$(now)
}
partition_routes() { # add|del N
    local i
    for i in 1 2 3; do
        ip -n "${P}h$2" route "$1" blackhole "${EIP[$i]}/32"
        ip -n "${P}e$i" route "$1" blackhole "192.0.2.$2/32"
    done
}
fault_partition() {
    rnd "$HOSTS"; HOST=$((R + 1)); rnd "$((TTL + 1))"; local d=$((2 * TTL + R))
    WHAT="h$HOST cut from etcd ${d}s"; T0=$(now)
    partition_routes add "$HOST"; sleep "$d"; partition_routes del "$HOST"
    T1=$(now)
}
fault_leader_kill() {
    local l; l=$(etcd_leader); HOST=
    [ -n "$l" ] || { ERR="no leader found"; T0=$(now); T1=$T0; WHAT="-"; return; }
    rnd 3; local d=$((1 + R))
    WHAT="e$l (leader) down ${d}s"; T0=$(now)
    etcd_kill "$l"; sleep "$d"; etcd_start "$l" new
    etcd_healthy || ERR="etcd not healthy after restarting e$l"
    T1=$(now)
}
fault_member_wipe() {
    rnd 3; local i=$((R + 1)) id others="" j; HOST=
    for j in 1 2 3; do [ "$j" = "$i" ] || others="${others:+$others,}http://${EIP[$j]}:2379"; done
    WHAT="e$i wiped, rejoined"; T0=$(now)
    etcd_kill "$i"
    id=$(ectl_at "$others" member list -w json | python3 -c '
import json, sys
for m in json.load(sys.stdin)["members"]:
    if m.get("name") == sys.argv[1] or "'"${EIP[$i]}"':2380" in " ".join(m.get("peerURLs", [])):
        print("%x" % m["ID"])' "e$i")
    for _ in $(seq 1 20); do ectl_at "$others" member remove "$id" >>"$WORK/etcd/admin.log" 2>&1 && break; sleep 0.5; done
    rm -rf "$WORK/etcd/e$i"
    for _ in $(seq 1 20); do
        ectl_at "$others" member add "e$i" --peer-urls "http://${EIP[$i]}:2380" >>"$WORK/etcd/admin.log" 2>&1 && break
        sleep 0.5
    done
    etcd_start "$i" existing
    etcd_healthy || ERR="etcd not healthy after e$i rejoined"
    T1=$(now)
}
fault_storm() {
    rnd "$HOSTS"; HOST=$((R + 1)); rnd 3; local k=$((3 + R)) j
    WHAT="h$HOST kill -9 x$k"; T0=$(now)
    for j in $(seq 1 "$k"); do
        kill_weft "$HOST"; start_weft "$HOST"
        rnd 4; sleep "$((R / 2 + 1)).$((R % 2 * 5))" # 1, 1.5, 2 or 2.5 s
    done
    T1=$(now)
}
fault_compact() {
    local rev; HOST=
    rev=$(ectl endpoint status -w json 2>/dev/null | python3 -c 'import json,sys; print(max(s["Status"]["header"]["revision"] for s in json.load(sys.stdin)))' || true)
    WHAT="at rev ${rev:-?}"; T0=$(now)
    [ -n "$rev" ] && ectl compact "$rev" --physical >>"$WORK/etcd/admin.log" 2>&1 || ERR="compact $rev failed"
    T1=$(now)
}

record() { # FAULT
    python3 -c 'import json,sys; a=sys.argv; print(json.dumps({"fault":a[1],"what":a[2],"host":int(a[3]) if a[3] else None,"t0":float(a[4]),"t1":float(a[5]),"t2":float(a[6]),**({"error":a[7]} if a[7] else {})}))' \
        "$1" "$WHAT" "$HOST" "$T0" "$T1" "$T2" "$ERR" >>"$WORK/faults.jsonl"
}

# --- setup ------------------------------------------------------------------------------------
say "chaos: seed $CHAOS_SEED, ${CHAOS_DURATION}s of faults, $HOSTS hosts, lease TTL ${TTL}s (CHAOS_SEED=$CHAOS_SEED to replay the schedule)"
START=$SECONDS
netns_hub_up "$P"
for i in 1 2 3; do etcd_ns_up "$i"; done
for i in 1 2 3; do etcd_start "$i" new; done
etcd_healthy || { echo "chaos: etcd cluster did not come up" >&2; tail -5 "$WORK"/etcd/*.log >&2; exit 1; }
ip netns exec "${P}hub" python3 scripts/chaos_check.py watch --work "$WORK" --hub "${P}hub" \
    --endpoints "$EPS" --prefix "$KEYS" >>"$WORK/watch.err" 2>&1 &
printf '{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}' >"$WORK/net.json"
hub "$WEFT" network set "$WORK/net.json" --etcd-endpoints "$EPS" --etcd-prefix "$PREFIX" >/dev/null
for n in $(seq 1 "$HOSTS"); do netns_host_up "$P" "$n"; mkdir -p "$WORK/h$n"; start_weft "$n"; done
for n in $(seq 1 "$HOSTS"); do wait_ready "$n"; done
for n in $(seq 1 "$HOSTS"); do
    POD[$n]=$(cni_pod_up "$P" "$n" "$WORK/h$n/subnet.env" "$WORK/h$n/cni")
    ip netns exec "${P}h$n" bash -c "$(declare -f poll_ready); poll_ready" >"$WORK/ready/h$n.log" 2>&1 &
done
for a in $(seq 1 "$HOSTS"); do
    for b in $(seq 1 "$HOSTS"); do
        [ "$a" = "$b" ] && continue
        ip netns exec "${P}p$a" ping -n -D -O -i 0.2 -W 1 "${POD[$b]}" >"$WORK/ping/$a-$b.log" 2>&1 &
    done
done
say "etcd e1-e3 at ${EIP[*]:1}; pods: $(for n in $(seq 1 "$HOSTS"); do printf 'p%s=%s ' "$n" "${POD[$n]}"; done)"

# A quiet window first: the baseline every fault is compared with.
WHAT="no fault"; HOST=; ERR=; T0=$(now); sleep 3; T1=$(now)
check "#0"; T2=$(now); record baseline

# --- the faults -------------------------------------------------------------------------------
KINDS=(stop partition leader-kill member-wipe storm compact)
QUEUE=()
i=0
END=$((SECONDS + CHAOS_DURATION))
while [ "$SECONDS" -lt "$END" ]; do
    if [ ${#QUEUE[@]} = 0 ]; then
        QUEUE=("${KINDS[@]}")
        for ((j = ${#QUEUE[@]} - 1; j > 0; j--)); do # Fisher-Yates, seeded
            rnd $((j + 1)); tmp=${QUEUE[j]}; QUEUE[j]=${QUEUE[R]}; QUEUE[R]=$tmp
        done
    fi
    kind=${QUEUE[0]}; QUEUE=("${QUEUE[@]:1}")
    i=$((i + 1)); ERR=; HOST=
    "fault_${kind//-/_}"
    printf '%3d %-12s %s (+%ss)\n' "$i" "$kind" "$WHAT" "$((SECONDS - START))"
    sleep "$SETTLE"
    check "#$i"; T2=$(now); record "$kind"
done

say "report (seed $CHAOS_SEED, $((SECONDS - START))s in all)"
rc=0
python3 scripts/chaos_check.py report --work "$WORK" --hosts "$HOSTS" --ttl "$TTL" --max-loss "$MAX_LOSS" \
    | tee "$WORK/report.txt" || rc=$?
if [ "$rc" != 0 ]; then
    for n in $(seq 1 "$HOSTS"); do
        echo "--- h$n weft.log (WARN/ERROR, last 15)"; grep -E "WARN|ERROR" "$WORK/h$n/weft.log" | tail -15 || true
    done
    # Again at the end, where a CI log's tail shows it: the faults and what broke.
    echo "--- the report again"; cat "$WORK/report.txt"
fi
say "seed $CHAOS_SEED: $([ "$rc" = 0 ] && echo "all invariants held" || echo "INVARIANTS BROKEN (rc $rc)")"
exit "$rc"
