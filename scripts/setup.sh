#!/usr/bin/env bash
# Installs what weft's build and tests need on a Debian/Ubuntu machine: etcd and etcdctl (the
# store tests start real etcd), iperf3 (end-to-end throughput), protoc (etcd-client's build)
# and ip (network namespaces). Idempotent: installs only what is missing, and runs apt-get
# update at most once. Needs root for the installs; no TTY needed.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

updated=0
apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: apt-get not found; install these packages by hand: $*" >&2
        exit 1
    fi
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=(sudo -n)
        else
            echo "setup: need root (or sudo) to install: $*" >&2
            exit 1
        fi
    fi
    if [ "$updated" -eq 0 ]; then
        "${sudo[@]}" apt-get update -q
        updated=1
    fi
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "$@"
}

# command  package
tools=(
    "etcd etcd-server"
    "etcdctl etcd-client"
    "iperf3 iperf3"
    "protoc protobuf-compiler"
    "ip iproute2"
    "openssl openssl"
    "ping iputils-ping"
)

for entry in "${tools[@]}"; do
    read -r cmd pkg <<<"$entry"
    if ! command -v "$cmd" >/dev/null 2>&1; then
        echo "setup: $cmd missing; installing $pkg"
        apt_install "$pkg"
    fi
    if ! path=$(command -v "$cmd"); then
        echo "setup: $cmd still missing after installing $pkg" >&2
        exit 1
    fi
    echo "ok: $cmd ($path)"
done

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install a Rust toolchain (https://rustup.rs), then re-run" >&2
    exit 1
fi
echo "ok: cargo ($(command -v cargo), $(cargo --version))"
