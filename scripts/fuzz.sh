#!/usr/bin/env bash
# Runs every coverage-guided fuzz target in fuzz/ for SECONDS each (default 20), one after the
# other, built once with optimizations plus debug assertions and overflow checks. Fails if any
# target crashes (a panic, a failed invariant, an overflow, a leak, a timeout or running out of
# memory); the input that did it is left in fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS]          every target
#   FUZZ_TARGETS="wire_ipv4 pipeline" scripts/fuzz.sh 60
#
# Needs the nightly toolchain (rustup's `nightly`, for libFuzzer's instrumentation) and
# cargo-fuzz, which is installed from crates.io if missing. Seeds are read from
# fuzz/seeds/<target>/ (committed); what the fuzzer learns grows in fuzz/corpus/<target>/
# (ignored by git), so later runs start from there.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-20}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -lt 1 ]; then
    echo "usage: $0 [SECONDS]  (a positive whole number of seconds per target)" >&2
    exit 2
fi

if ! command -v rustup >/dev/null || ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "error: fuzzing needs the nightly Rust toolchain (libFuzzer instrumentation uses" >&2
    echo "       -Z flags); install it with: rustup toolchain install nightly" >&2
    exit 1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz from crates.io"
    cargo install --locked cargo-fuzz
fi

# Safe Rust only on the fuzzed paths: AddressSanitizer would halve the speed for nothing, so
# no sanitizer; -O with -a (debug assertions and overflow checks) keeps arithmetic checked.
flags=(-O --debug-assertions --sanitizer none)
cd fuzz
targets="${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}"
echo "== building the fuzz targets"
cargo +nightly fuzz build "${flags[@]}"

failed=()
for t in $targets; do
    echo "== fuzzing $t for ${seconds}s"
    mkdir -p "corpus/$t" "seeds/$t"
    # One job, one worker (this runs beside other work); rss_limit bounds memory per input.
    if ! cargo +nightly fuzz run "${flags[@]}" "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        2>"corpus/$t.log"; then
        tail -n 40 "corpus/$t.log" >&2
        failed+=("$t")
    else
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)|^Done' "corpus/$t.log" || true
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]} (crash inputs in fuzz/artifacts/; logs in fuzz/corpus/<target>.log)" >&2
    exit 1
fi
echo "== every target ran ${seconds}s without a crash"
