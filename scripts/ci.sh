#!/usr/bin/env bash
# weft's CI: runs the README's test command (scripts/test.sh) inside a freshly bootstrapped
# Debian root, never on the machine as it is, so that a package only this machine happens to
# have cannot hide a missing install step.
#
#   scripts/ci.sh [COMMAND]      (as root; COMMAND defaults to scripts/test.sh)
#
# What it does:
# 1. Makes a minimal Debian bookworm root with mmdebstrap (Essential packages, apt and
#    ca-certificates: less than a new machine has, so scripts/setup.sh must install the rest)
#    and caches it as a tarball under $WEFT_CI_CACHE (default /var/tmp/weft-ci). The tarball is
#    remade when older than $WEFT_CI_ROOT_MAX_AGE_DAYS (default 7). If no root can be made and
#    none is cached, CI fails and says why: there is no fallback to the host.
# 2. Unpacks it afresh for every run, in a private mount and PID namespace: every mount, process
#    and network namespace the run makes dies with it, and nothing leaks into the host.
# 3. Bind-mounts what is shared between runs: the Rust toolchain (~/.rustup, ~/.cargo, which also
#    caches downloaded crates), apt's downloaded .debs and package lists (so a run fetches from
#    the archive only what is new), and the test kube-apiserver's cache (/var/cache/weft-test:
#    built once, minutes). Nothing *installed* survives a run.
# 4. Copies the project's tracked and unignored files (in CI, a clean checkout of main) into the
#    root and runs COMMAND there with a scrubbed environment.
set -euo pipefail

fail() {
    echo "ci: $*" >&2
    exit 1
}

# ---- inside the private namespaces (re-executed by the outer part below) --------------------
if [ "${1:-}" = "--inside" ]; then
    root=$2 tarball=$3 top=$4 cache=$5 cmd=$6
    mount --bind "$root" "$root" # '/' of the root must be a mount point for `ip netns`
    tar -xf "$tarball" -C "$root"
    # The machine's network set-up comes along, as on any new machine of this kind: its
    # resolver, and the local CAs it trusts (a TLS-inspecting egress proxy signs with one, and
    # cargo must trust it to reach the registry).
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    if [ -n "$(ls -A /usr/local/share/ca-certificates 2>/dev/null)" ]; then
        cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
        chroot "$root" update-ca-certificates >/dev/null
    fi
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mount --make-rslave "$root/sys"
    mount --rbind /dev "$root/dev"
    mount --make-rslave "$root/dev"
    mount -t tmpfs tmpfs "$root/run"
    mkdir -p "$root/root/.cargo" "$root/root/.rustup" "$cache/debs" "$cache/lists" "$cache/weft-test" \
        "$root/var/cache/weft-test"
    mount --bind "${CARGO_HOME:-$HOME/.cargo}" "$root/root/.cargo"
    mount --bind "${RUSTUP_HOME:-$HOME/.rustup}" "$root/root/.rustup"
    mount --bind "$cache/debs" "$root/var/cache/apt/archives"
    mount --bind "$cache/lists" "$root/var/lib/apt/lists"
    # The test kube-apiserver (scripts/kube-apiserver.sh build): minutes to build, so built once.
    mount --bind "$cache/weft-test" "$root/var/cache/weft-test"
    mkdir -p "$root/build"
    git -C "$top" ls-files -z --cached --others --exclude-standard |
        tar -C "$top" --null -T - -cf - | tar -xf - -C "$root/build"
    proxy=()
    for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        [ -n "${!v:-}" ] && proxy+=("$v=${!v}")
    done
    exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb CI="${CI:-true}" LANG=C.UTF-8 "${proxy[@]}" \
        PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/bash -c "cd /build && $cmd"
fi

# ---- outside: check, make or reuse the root, run, clean up ----------------------------------
cmd=${1:-scripts/test.sh}
top=$(cd "$(dirname "$0")/.." && pwd)
cache=${WEFT_CI_CACHE:-/var/tmp/weft-ci}
suite=bookworm
mirror=${WEFT_CI_MIRROR:-http://deb.debian.org/debian}
include=ca-certificates
max_age_days=${WEFT_CI_ROOT_MAX_AGE_DAYS:-7}
# The tarball's name carries what made it, so a change here makes a new one.
key=$(printf '%s\n' "$suite" "$mirror" "$include" | sha256sum | cut -c1-12)
tarball=$cache/root-$suite-$key.tar

[ "$(id -u)" -eq 0 ] || fail "needs root (chroot, mounts, network namespaces)"
[ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ] ||
    fail "no Rust toolchain at ${CARGO_HOME:-$HOME/.cargo}/bin/cargo (rustup) to bind into the root"
[ -d "${RUSTUP_HOME:-$HOME/.rustup}/toolchains" ] || fail "no rustup toolchains at ${RUSTUP_HOME:-$HOME/.rustup}"
mkdir -p "$cache"
start=$SECONDS

make_root() {
    if ! command -v mmdebstrap >/dev/null 2>&1; then
        echo "ci: installing mmdebstrap"
        command -v apt-get >/dev/null 2>&1 || { echo "ci: no apt-get to install mmdebstrap" >&2; return 1; }
        apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends mmdebstrap >/dev/null ||
            { echo "ci: could not install mmdebstrap" >&2; return 1; }
    fi
    echo "ci: bootstrapping a fresh $suite root from $mirror (cached at $tarball)"
    rm -f "$tarball.part"
    mmdebstrap --quiet --variant=apt --include="$include" --format=tar \
        "$suite" "$tarball.part" "$mirror" && mv "$tarball.part" "$tarball"
}

if [ ! -s "$tarball" ]; then
    make_root || fail "could not make a fresh Debian root (see above); CI does not fall back to this machine"
elif [ -n "$(find "$tarball" -mtime +"$max_age_days")" ]; then
    make_root || echo "ci: WARNING: could not refresh the root; using the cached one from $(date -r "$tarball" +%F)" >&2
fi
echo "ci: root $(basename "$tarball") from $(date -r "$tarball" '+%F %T') ready after $((SECONDS - start)) s"

root=$(mktemp -d "$cache/run.XXXXXX")
cleanup() {
    # The mounts live in the run's private mount namespace and die with it. Refuse to delete
    # anything while a mount is still visible under the root: rm would follow it into the host.
    if grep -q " $root/" /proc/self/mountinfo; then
        echo "ci: WARNING: mounts left under $root; not removing it" >&2
    else
        rm -rf "$root"
    fi
}
trap cleanup EXIT
# Stopped from outside (a CI time-out, Ctrl-C): end the run's namespaces first; unshare's
# --kill-child takes every process of the run with it, and the EXIT trap removes the root.
child=
stop() {
    [ -n "$child" ] && kill -KILL "$child" 2>/dev/null && wait "$child" 2>/dev/null
    exit "$1"
}
trap 'stop 143' TERM
trap 'stop 130' INT

echo "ci: running '$cmd' in the fresh root"
run_start=$SECONDS
set +e
unshare --mount --pid --fork --kill-child --propagation private -- \
    bash "$top/scripts/ci.sh" --inside "$root" "$tarball" "$top" "$cache" "$cmd" &
child=$!
wait "$child"
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
    echo "ci: '$cmd' passed in a fresh $suite root in $((SECONDS - run_start)) s ($((SECONDS - start)) s in all)"
else
    echo "ci: '$cmd' FAILED in a fresh $suite root (exit $rc) after $((SECONDS - run_start)) s" >&2
fi
exit "$rc"
