#!/usr/bin/env bash
# A real kube-apiserver for weft's Kubernetes tests (scripts/lib/kube-apiserver.sh has the
# recipe; the Rust harness, integration/support/kube.rs, starts its own control planes with it).
#
#   scripts/kube-apiserver.sh build      builds kube-apiserver v1.20.2 from Debian's source
#                                        package, once per machine (cached at
#                                        /var/cache/weft-test/; needs root to write there, and
#                                        scripts/setup.sh's golang-go and dpkg-dev)
#   scripts/kube-apiserver.sh path       prints the cached binary's path
#   scripts/kube-apiserver.sh run [-- COMMAND...]
#                                        a throw-away control plane on 127.0.0.1 (free ports):
#                                        without COMMAND, prints the admin kubeconfig's path and
#                                        waits until interrupted; with COMMAND, runs it with
#                                        KUBECONFIG (admin), WEFT_KUBE_USER_KUBECONFIG (user
#                                        weft-test, no rights) and WEFT_KUBE_URL exported, then
#                                        stops everything and exits with COMMAND's status.
#
# Environment: KUBE_APISERVER_BIN (the binary; default the cached one), KEEP=1 keeps the run's
# dir (its logs, and its secrets: mode 0600 in a 0700 dir).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/kube-apiserver.sh
. scripts/lib/kube-apiserver.sh

free_port() { # a loopback port nothing listens on (bound by python, then closed)
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

case "${1:-}" in
    build)
        kube_apiserver_build
        "$KUBE_APISERVER_BIN" --version
        ;;
    path)
        echo "$KUBE_APISERVER_BIN"
        ;;
    run)
        shift
        [ "${1:-}" = -- ] && shift
        kube_apiserver_build
        KUBE_APISERVER_PORT=$(free_port)
        KUBE_ETCD_PORT=$(free_port)
        KUBE_ETCD_PEER_PORT=$(free_port)
        export KUBE_APISERVER_PORT KUBE_ETCD_PORT KUBE_ETCD_PEER_PORT
        dir=$(mktemp -d /tmp/weft-kube.XXXXXX)
        pids=()
        cleanup() {
            trap - EXIT INT TERM
            local p
            for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
            for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
            if [ "${KEEP:-0}" = 1 ]; then echo "kube-apiserver: kept $dir" >&2; else rm -rf "$dir"; fi
        }
        trap cleanup EXIT
        trap 'exit 143' TERM
        trap 'exit 130' INT
        kube_control_plane_files "$dir/secrets"
        (kube_etcd "$dir") >"$dir/etcd.log" 2>&1 &
        pids+=($!)
        (kube_apiserver "$dir/secrets" 127.0.0.1) >"$dir/apiserver.log" 2>&1 &
        pids+=($!)
        if ! kube_wait_ready "$dir/secrets" 127.0.0.1; then
            tail -n 20 "$dir/etcd.log" "$dir/apiserver.log" >&2
            exit 1
        fi
        kube_kubeconfig "$dir/secrets" 127.0.0.1 admin "$dir/secrets/admin.token" "$dir/admin.kubeconfig"
        kube_kubeconfig "$dir/secrets" 127.0.0.1 weft-test "$dir/secrets/user.token" "$dir/user.kubeconfig"
        export KUBECONFIG=$dir/admin.kubeconfig WEFT_KUBE_USER_KUBECONFIG=$dir/user.kubeconfig
        export WEFT_KUBE_URL=https://127.0.0.1:$KUBE_APISERVER_PORT
        # kubectl's discovery cache goes with the run (kubectl >= 1.26 reads it; older ones
        # take --cache-dir).
        export KUBECACHEDIR=$dir/cache
        echo "kube-apiserver: ready at $WEFT_KUBE_URL (logs in $dir)" >&2
        if [ $# -gt 0 ]; then
            set +e
            "$@"
            rc=$?
            set -e
            exit $rc
        fi
        echo "$KUBECONFIG"
        wait "${pids[@]}"
        ;;
    *)
        echo "usage: scripts/kube-apiserver.sh build | path | run [-- COMMAND...]" >&2
        exit 2
        ;;
esac
