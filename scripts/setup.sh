#!/usr/bin/env bash
# Installs what weft's build, tests and demo need, on a Debian/Ubuntu machine, from nothing but
# a bare root and a Rust toolchain. The list below is the one home of that knowledge: the README
# shows it, and `scripts/ci.sh` proves it on a freshly bootstrapped Debian root at every CI run.
#
# Idempotent: it asks dpkg which packages are missing (a command being on PATH is not enough:
# protoc without libprotobuf-dev's well-known .proto files cannot build etcd-client), installs
# those in one apt-get call, then checks every command and file the project uses. Needs root
# (or passwordless sudo) only when something is missing; no TTY needed.
#
# On a machine without apt-get it installs nothing: it checks the same commands and files and
# names each one that is missing (see the README for the equivalents on other systems).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

# package              what weft uses it for
packages=(
    gcc                 # C compiler and linker: rustc links with cc; ring builds C
    g++                 # libFuzzer (C++), which cargo fuzz builds for scripts/fuzz.sh
    libc6-dev           # C headers and crt files for that link
    pkg-config          # build scripts that look for system libraries
    ca-certificates     # cargo fetching crates over TLS
    protobuf-compiler   # protoc, for etcd-client's generated gRPC code
    libprotobuf-dev     # google/protobuf/*.proto, which etcd's .proto files import
    etcd-server         # etcd: every store and end-to-end test starts a real one
    etcd-client         # etcdctl: tests and the demo inspect and change the store
    iproute2            # ip, bridge: network namespaces, veth, addresses, routes; ss
    iputils-ping        # ping across the overlay
    tcpdump             # decodes the ipip backend's packets as the kernel's IP-in-IP (integration/e2e_ipip.rs)
    iperf3              # throughput across the overlay (tests, demo, bench)
    sockperf            # request/response round trips across the overlay (bench)
    openssl             # test CA and certificates for etcd over TLS
    procps              # sysctl (forwarding in namespace hosts), pgrep, ps
    util-linux          # unshare, setpriv (the non-root test), mount namespaces, prlimit, nsenter
    mount               # mount, for the non-root test's private /dev/net/tun
    python3             # bench.sh's result tables; the CNI delegate config (scripts/lib/cni.sh)
    containernetworking-plugins  # CNI bridge + host-local: pods in the demo, tests, chaos soak
    iptables            # the bridge plugin's ipMasq rules (inside namespace hosts)
    nftables            # nft: the masquerade tests read weft's tables (integration/e2e_masq.rs)
    dpkg-dev            # dpkg-shlibdeps: the .deb's Depends (scripts/package.sh)
    binutils            # strip: the packaged binary (scripts/package.sh)
    podman              # the container test runs the OCI image (integration/e2e_container.rs)
    runc                # podman's runtime there: crun fails on hybrid cgroup hosts
    systemd             # systemd-analyze verify: the packaged unit (integration/e2e_container.rs)
    curl                # requests to the test kube-apiserver (integration/support/kube.rs)
    golang-go           # Debian's Go: builds the test kube-apiserver (scripts/kube-apiserver.sh build)
    kubernetes-client   # kubectl: the manifest's server-side dry run (integration/kube_manifest.rs)
    libcap2-bin         # setcap: the image's binary carries its capabilities (scripts/package.sh)
    wireguard-tools     # wg: the wireguard-go reference peer is set up from the leases (integration/e2e_wireguard.rs)
    wireguard-go        # Debian's user-space WireGuard: the reference peer, and bench.sh's wireguard-go row
)

# A package another one may stand in for: kubernetes-client is not installed where a kubectl of
# another package already owns /usr/bin/kubectl (both ship that path; dpkg would refuse).
optional_if_command=(
    kubernetes-client=kubectl
)

# command or file      must exist after install
checks=(
    cc c++ protoc /usr/include/google/protobuf/descriptor.proto etcd etcdctl ip bridge ss ping iperf3
    tcpdump openssl sysctl unshare setpriv prlimit mount python3 /usr/lib/cni/bridge /usr/lib/cni/host-local
    iptables nft sockperf dpkg-deb dpkg-shlibdeps strip podman runc systemd-analyze curl go kubectl setcap
    dpkg-source flock base64 wg wireguard-go
)

missing_checks() {
    local c
    for c in "${checks[@]}"; do
        case "$c" in
            /*) [ -e "$c" ] || echo "$c" ;;
            *) command -v "$c" >/dev/null 2>&1 || echo "$c" ;;
        esac
    done
}

if command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    # One dpkg-query for all of them; a package dpkg has never heard of prints nothing, so
    # compare the names that came back installed against the list.
    installed=$({ dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${packages[@]}" 2>/dev/null || true; } |
        awk '$2 == "installed" { print $1 }')
    need=()
    for p in "${packages[@]}"; do
        grep -qx "$p" <<<"$installed" && continue
        for o in "${optional_if_command[@]}"; do
            [ "${o%%=*}" = "$p" ] && command -v "${o#*=}" >/dev/null 2>&1 && continue 2
        done
        need+=("$p")
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "setup: installing ${need[*]}"
        sudo=()
        if [ "$(id -u)" -ne 0 ]; then
            command -v sudo >/dev/null 2>&1 || {
                echo "setup: need root (or sudo) to install: ${need[*]}" >&2
                exit 1
            }
            sudo=(sudo -n)
        fi
        "${sudo[@]}" apt-get update -q
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends "${need[@]}"
    fi
else
    echo "setup: no apt-get/dpkg here; checking for what the Debian packages would provide" >&2
fi

gone=$(missing_checks)
if [ -n "$gone" ]; then
    echo "setup: still missing after setup:" $gone >&2
    echo "setup: see the README's 'What setup installs' for the packages that provide them" >&2
    exit 1
fi
echo "setup: ok (${#packages[@]} packages; $(etcd --version 2>/dev/null | head -1))"

if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: cargo not found; install a Rust toolchain (https://rustup.rs), then re-run" >&2
    exit 1
fi
echo "setup: $(cargo --version)"
