# shellcheck shell=bash
# etcd's command line: the one spelling of it for the demo, the bench, the chaos soak and the
# Rust harness (integration/support/etcd.rs starts every test's etcd through etcd_member, and
# restores snapshots through etcd_restore). Source it.
#
# Every member: listening on and advertising its client and peer URLs, a member of a new cluster
# (token ETCD_TOKEN), logging JSON (zap) to stderr at level error. A caller's flags come after
# these and win where they name the same flag (etcd takes a repeated flag's last value): the
# chaos soak's rejoining member says --initial-cluster-state existing, and its raft timing.

ETCD_BIN=${ETCD_BIN:-etcd}
ETCD_TOKEN=${ETCD_TOKEN:-weft-lab}

# etcd_member_args NAME DATA_DIR CLIENT_URL PEER_URL INITIAL_CLUSTER [ETCD FLAG...]: sets the
# array ETCD_ARGS to that member's command line (without the binary).
etcd_member_args() {
    local name=$1 dir=$2 client=$3 peer=$4 initial=$5
    shift 5
    ETCD_ARGS=(--name "$name" --data-dir "$dir"
        --listen-client-urls "$client" --advertise-client-urls "$client"
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer"
        --initial-cluster "$initial" --initial-cluster-state new
        --initial-cluster-token "$ETCD_TOKEN"
        --logger zap --log-outputs stderr --log-level error "$@")
}

# etcd_member NAME DATA_DIR CLIENT_URL PEER_URL INITIAL_CLUSTER [ETCD FLAG...]: execs that member
# (the shell becomes etcd: run it in the background, `etcd_member ... 2>>LOG &`, and $! is
# etcd's pid).
etcd_member() {
    etcd_member_args "$@"
    exec "$ETCD_BIN" "${ETCD_ARGS[@]}"
}

# etcd_restore SNAPSHOT DATA_DIR NAME PEER_URL INITIAL_CLUSTER: restores SNAPSHOT into the fresh
# DATA_DIR for member NAME of a cluster started by etcd_member (its token), as an operator
# restoring a backup does.
etcd_restore() {
    ETCDCTL_API=3 etcdctl snapshot restore "$1" --data-dir "$2" --name "$3" \
        --initial-advertise-peer-urls "$4" --initial-cluster "$5" \
        --initial-cluster-token "$ETCD_TOKEN"
}
