#!/usr/bin/env bash
# Builds weft's two artifacts from the tree, reaching nothing but the crate registry (for the
# release build), into $CARGO_TARGET_DIR/package/ (target/package/ by default):
#
#   weft_<version>_<arch>.deb   /usr/bin/weft; weft.service; man pages and bash, zsh and fish
#                               completions made from the command line (`weft package-files`);
#                               /etc/default/weft (every `weft run` flag's WEFT_* variable);
#                               Depends from dpkg-shlibdeps
#   weft-<version>.oci.tar      an OCI image archive (`podman load -i …`): the stripped binary
#                               and the libraries it links, nothing else (no base image, no
#                               shell); ENTRYPOINT ["/usr/bin/weft"], CMD ["run"]
#
# Both are made with Debian's own tools and coreutils: dpkg-deb and dpkg-shlibdeps for the
# package; tar, gzip and sha256sum for the OCI layout, written as the image-spec lays it out.
# Nothing is pulled and no container runtime is needed to build. The output is reproducible:
# every timestamp is SOURCE_DATE_EPOCH (default: the last commit's time, else 0), so a second
# run over the same build gives the same bytes. Quick and idempotent: it reuses the release
# build (cargo's no-op when scripts/chaos.sh or demo.sh built it) and remakes only the files.
#
#   scripts/package.sh          (no root needed)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for c in dpkg-deb dpkg-shlibdeps strip ldd gzip tar sha256sum setcap; do
    command -v "$c" >/dev/null 2>&1 || need+=("$c")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "package: missing ${need[*]} (Debian: dpkg-dev binutils libc-bin; or run scripts/setup.sh)" >&2
    exit 1
fi

echo "== building weft (release)"
cargo build --release --quiet
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
[[ "$TARGET" = /* ]] || TARGET="$PWD/$TARGET"
OUT="$TARGET/package"
BIN="$TARGET/release/weft"
VERSION=$("$BIN" --version | awk '{print $2}')
ARCH=$(dpkg --print-architecture)
case "$ARCH" in
    amd64 | arm64 | ppc64el | s390x | riscv64) OCI_ARCH=${ARCH/ppc64el/ppc64le} ;;
    armhf) OCI_ARCH=arm ;;
    i386) OCI_ARCH=386 ;;
    *) OCI_ARCH=$ARCH ;;
esac
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

WORK="$OUT/work"
rm -rf "$WORK"
mkdir -p "$WORK"
# Every file and directory below gets the same mode rules and timestamp whatever the umask.
umask 022
strip --strip-unneeded -o "$WORK/weft" "$BIN"
"$WORK/weft" package-files "$WORK/files"

# Sets every timestamp under $1 to SOURCE_DATE_EPOCH.
settime() { find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +; }

# ---- the Debian package -----------------------------------------------------------------------
ROOT="$WORK/deb"
install -D -m 0755 "$WORK/weft" "$ROOT/usr/bin/weft"
install -D -m 0644 packaging/weft.service "$ROOT/lib/systemd/system/weft.service"
# 0600: it may hold WEFT_ETCD_PASSWORD.
install -D -m 0600 "$WORK/files/default/weft" "$ROOT/etc/default/weft"
install -d "$ROOT/usr/share/man/man1"
for page in "$WORK"/files/man/*.1; do
    gzip -9n <"$page" >"$ROOT/usr/share/man/man1/$(basename "$page").gz"
done
install -D -m 0644 "$WORK/files/completions/weft.bash" "$ROOT/usr/share/bash-completion/completions/weft"
install -D -m 0644 "$WORK/files/completions/_weft" "$ROOT/usr/share/zsh/vendor-completions/_weft"
install -D -m 0644 "$WORK/files/completions/weft.fish" "$ROOT/usr/share/fish/vendor_completions.d/weft.fish"
install -d "$ROOT/usr/share/doc/weft"
install -D -m 0644 packaging/weft-ipip.conf "$ROOT/usr/share/doc/weft/examples/ipip.conf"
cat >"$ROOT/usr/share/doc/weft/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: weft

Files: *
Copyright: the weft developers
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF

# Depends: what dpkg-shlibdeps derives from the libraries the binary links and the symbol
# versions it uses (it wants a debian/control to read; a minimal one in a directory of its own).
SHLIBS="$WORK/shlibdeps"
mkdir -p "$SHLIBS/debian"
printf 'Source: weft\n\nPackage: weft\nArchitecture: any\n' >"$SHLIBS/debian/control"
DEPENDS=$(cd "$SHLIBS" && dpkg-shlibdeps -O -e"$ROOT/usr/bin/weft" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$DEPENDS" ] || { echo "package: dpkg-shlibdeps found no dependencies for weft" >&2; exit 1; }

mkdir -p "$ROOT/DEBIAN"
cat >"$ROOT/DEBIAN/control" <<EOF
Package: weft
Version: $VERSION
Architecture: $ARCH
Maintainer: weft developers <weft@localhost>
Installed-Size: $(du -sk --apparent-size "$ROOT" | cut -f1)
Depends: $DEPENDS
Section: net
Priority: optional
Description: flannel-compatible overlay network daemon with a user-space data plane
 weft leases each host a subnet of a cluster network from etcd, in flannel's store layout
 and with flannel's subnet.env, and forwards the overlay's traffic through a TUN device as
 VXLAN or flannel's udp format. It needs only CAP_NET_ADMIN, not root.
 .
 The weft.service unit is installed but neither enabled nor started: set the etcd endpoints
 in /etc/default/weft, then run: systemctl enable --now weft
EOF
echo /etc/default/weft >"$ROOT/DEBIAN/conffiles"
cat >"$ROOT/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
EOF
# An upgrade of a running weft is an in-place upgrade (SIGHUP, through the unit's
# ExecReload=): the new binary takes the TUN device, sockets and lease over without a loss.
cat >"$ROOT/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
    if [ "$1" = configure ] && [ -n "$2" ] && systemctl -q is-active weft.service; then
        systemctl reload weft.service || true
    fi
fi
EOF
chmod 0755 "$ROOT/DEBIAN/postinst" "$ROOT/DEBIAN/postrm"
(cd "$ROOT" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z |
    xargs -0 md5sum >DEBIAN/md5sums)
settime "$ROOT"
DEB="$OUT/weft_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$ROOT" "$DEB.part" >/dev/null
mv "$DEB.part" "$DEB"

# ---- the OCI image ----------------------------------------------------------------------------
ROOTFS="$WORK/rootfs"
install -D -m 0755 "$WORK/weft" "$ROOTFS/usr/bin/weft"
# Permitted, not effective: a non-root container (a Kubernetes DaemonSet's: no ambient
# capabilities) gets NET_ADMIN and NET_RAW at exec where the runtime's bounding set has them,
# and weft raises them itself (crate::capabilities); where the bounding set lacks them, exec
# still works (`podman run weft --version`), as it would not with the effective bit.
setcap cap_net_admin,cap_net_raw+p "$ROOTFS/usr/bin/weft"
# The libraries at the paths the loader looks them up by (ldd's), as regular files.
ldd "$WORK/weft" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' |
    while read -r lib; do
        install -D -m 0755 "$(readlink -f "$lib")" "$ROOTFS$lib"
    done
install -d -m 0755 "$ROOTFS/etc" "$ROOTFS/run/flannel" "$ROOTFS/var/lib/weft"
install -d -m 1777 "$ROOTFS/tmp"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$ROOTFS/etc/group"
settime "$ROOTFS"
OCI="$WORK/oci"
mkdir -p "$OCI/blobs/sha256"
LAYER="$WORK/layer.tar"
tar --sort=name --owner=0 --group=0 --numeric-owner --format=posix \
    --xattrs --xattrs-include=security.capability \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$ROOTFS" -cf "$LAYER" etc lib lib64 run tmp usr var
DIFF_ID=$(sha256sum "$LAYER" | cut -d' ' -f1)
gzip -9n <"$LAYER" >"$WORK/layer.tar.gz"

# Moves $1 into blobs/ under its digest; prints "<digest> <size>".
blob() {
    local digest size
    digest=$(sha256sum "$1" | cut -d' ' -f1)
    size=$(stat -c %s "$1")
    mv "$1" "$OCI/blobs/sha256/$digest"
    echo "$digest $size"
}
read -r LAYER_DIGEST LAYER_SIZE < <(blob "$WORK/layer.tar.gz")
printf '%s' "{\"created\":\"$CREATED\",\"architecture\":\"$OCI_ARCH\",\"os\":\"linux\",\
\"config\":{\"Entrypoint\":[\"/usr/bin/weft\"],\"Cmd\":[\"run\"],\
\"Labels\":{\"org.opencontainers.image.title\":\"weft\",\"org.opencontainers.image.version\":\"$VERSION\"}},\
\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$DIFF_ID\"]},\
\"history\":[{\"created\":\"$CREATED\",\"created_by\":\"scripts/package.sh\"}]}" >"$WORK/config.json"
read -r CONFIG_DIGEST CONFIG_SIZE < <(blob "$WORK/config.json")
printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$CONFIG_DIGEST\",\"size\":$CONFIG_SIZE},\
\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:$LAYER_DIGEST\",\"size\":$LAYER_SIZE}]}" >"$WORK/manifest.json"
read -r MANIFEST_DIGEST MANIFEST_SIZE < <(blob "$WORK/manifest.json")
printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\
\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:$MANIFEST_DIGEST\",\"size\":$MANIFEST_SIZE,\
\"annotations\":{\"org.opencontainers.image.ref.name\":\"localhost/weft:$VERSION\"}}]}" >"$OCI/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$OCI/oci-layout"
settime "$OCI"
IMAGE="$OUT/weft-$VERSION.oci.tar"
tar --sort=name --owner=0 --group=0 --numeric-owner -C "$OCI" -cf "$IMAGE.part" oci-layout index.json blobs
mv "$IMAGE.part" "$IMAGE"

size() { du -h --apparent-size "$1" | cut -f1; }
echo "package: $DEB ($(size "$DEB"); Depends: $DEPENDS)"
echo "package: $IMAGE ($(size "$IMAGE"); image localhost/weft:$VERSION, $(size "$LAYER") unpacked)"
