#!/usr/bin/env bash
# Everything needed to pass weft's whole test suite on a fresh machine: installs what is
# missing (scripts/setup.sh), checks formatting and lints, then runs every test. The tests
# start their own services (etcd on loopback ports with temp dirs; network namespaces for the
# end-to-end tests) and clean up after themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== no merge-conflict markers left in the tree"
# One survived a merge into README.md for a whole stop (ba98343); nothing else would notice.
if grep -rnE '^(<<<<<<<|>>>>>>>) ' --include='*.md' --include='*.rs' --include='*.sh' \
    --include='*.toml' --include='*.py' --exclude-dir=target --exclude-dir=.git .; then
    echo "test.sh: merge-conflict markers above" >&2
    exit 1
fi
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
# `fault-injection` adds the test-only hooks the end-to-end tests drive
# (integration/e2e_worker.rs); release builds (scripts/demo.sh, scripts/bench.sh) never have it.
# `etcd` and `netns` turn on the suites under integration/ (real etcd; network namespaces): a
# plain `cargo test` runs only tests/, which needs no root and no etcd. `container` (which
# implies `netns`) turns on integration/e2e_container.rs: the image and the package below, run.
# `kube` turns on the suites against a real kube-apiserver (integration/kube_*.rs), built below.
FEATURES=fault-injection,etcd,netns,container,kube
cargo clippy --all-targets --features "$FEATURES" --quiet -- -D warnings
echo "== the Debian package and the OCI image (scripts/package.sh)"
# The release build it makes is the one the chaos soak below runs (cargo's no-op there).
scripts/package.sh
echo "== the test kube-apiserver (scripts/kube-apiserver.sh build: once per machine)"
# Built from Debian's kubernetes source package with Debian's Go, cached in /var/cache/weft-test;
# the first build takes minutes, every later run finds it.
scripts/kube-apiserver.sh build
echo "== cargo test"
# Benches are built by clippy above; criterion binaries take no test-runner flags.
cargo test --features "$FEATURES" --lib --bins --tests -- --test-threads 2
echo "== the default tests as an unprivileged user (uid 65534)"
# A plain `cargo test` (the library's, the binary's and tests/' tests) must pass for anyone: run
# the binaries built above as nobody, without capabilities, from the package root as cargo does.
cargo test --features "$FEATURES" --lib --bins --tests --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and "/integration/" not in m["target"]["src_path"]:
        print(m["executable"])' |
    while read -r bin; do
        setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps=-all \
            "$bin" -q --test-threads 2 </dev/null
    done
echo "== chaos soak (short): namespace hosts, a 3-member etcd, random faults, invariants"
# The long soak (minutes) is `scripts/chaos.sh`; CI runs the short one (about 90 s + a build).
scripts/chaos.sh --short
echo "== fuzzing: every cargo-fuzz target for 10 s (overflow checks on)"
# Longer runs: scripts/fuzz.sh 600 (ten minutes a target).
scripts/fuzz.sh 10
