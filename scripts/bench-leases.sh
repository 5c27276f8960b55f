#!/usr/bin/env bash
# "1,000 hosts on one etcd cluster" (issue 8 §3): a benchmark, not a test; not part of CI.
#
# Builds benches/leases.rs in release and runs N hosts (default 1000) of weft's own lease driver,
# keeper, etcd client and route watcher (no TUN devices) in WORKERS worker processes (default 10)
# against a fresh 3-member etcd on loopback (raft 100/1000 ms), through four phases: join (all at
# once), renew (2 TTLs), suspend (SIGSTOP one worker past the TTL, SIGCONT), churn (SIGTERM one
# worker, whose hosts relinquish, while a new worker joins). Prints each phase's figures (among
# them the store calls: the lease drivers' listings and creates, the route watchers' listings
# and re-lists) and a SUMMARY line. Needs etcd (scripts/setup.sh) and /dev/shm.
#
# Before the join, on the same fresh etcd, it measures etcd's own floor for the join's work: N
# plain etcd clients in as many worker processes, each creating one subnet key (a store lease
# and a create-if-absent, no race, no listing) at once while N plain watchers watch the subnets
# prefix, until every watcher has every key. The line
#   RATIO N=<n>: weft <a> s, etcd floor <b> s, ratio <a/b>
# compares the two: <a> from the start of the join until every host holds a distinct lease and
# every live watcher routes every lease. Measured side by side in one run, it tolerates load.
#
# POLICY=flannel runs flanneld's lease logic (as tests/sim/mod.rs models it) in every host
# instead of weft's driver and keeper, for a side-by-side row: same etcd, same clients, same
# route watchers (weft's), same phases; only the lease policy differs.
#
# Usage: scripts/bench-leases.sh [N]      env: WORKERS=10 TTL=10 (seconds), POLICY=weft|flannel,
#                                              WEFT_BENCH_KEEP=1 keeps the worker logs
#
# etcd's data dirs go to tmpfs (/dev/shm) unless ETCD_TMPDIR says otherwise: on this 2-core VM's
# shared virtual disk a WAL fsync took 53 ms on average and 1,000 joining hosts never settled
# (0 held after 60 s, leader changes); with tmpfs the figures are etcd's and weft's CPU, not the
# disk's. Real members want an SSD (etcd's guidance: WAL fsync p99 < 10 ms).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
WORKERS=${WORKERS:-10}
TTL=${TTL:-10}
POLICY=${POLICY:-weft}
export TMPDIR=${ETCD_TMPDIR:-/dev/shm}
# The bench opens about 3 connections per host per process (one per etcd member).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cargo bench --bench leases --no-run
exec cargo bench --bench leases -- --hosts "$N" --workers "$WORKERS" --ttl "$TTL" --policy "$POLICY"
