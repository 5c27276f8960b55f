//! Counting packets from two forwarding threads at once: every thread adding to one shared
//! `PacketCounters` block against each adding to its own `CachePadded` block
//! (`Counters::thread`, as the workers do). One count is what `account_sent` does per
//! sendmmsg: a relaxed `fetch_add` to `tx_packets` and one to `tx_bytes`. The time reported is
//! per count per thread; one thread alone is the floor.
//!
//! The workers count once per batch, not per packet, so this bounds from above what false
//! sharing of these counters costs the data plane.

use std::hint::black_box;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weft::dataplane::worker::counters::{Counters, PacketCounters};

/// `n` counts of a sent datagram into `c`.
fn count(c: &PacketCounters, n: u64) {
    for _ in 0..n {
        let c = black_box(c);
        c.tx_packets.fetch_add(1, Ordering::Relaxed);
        c.tx_bytes.fetch_add(1448, Ordering::Relaxed);
    }
}

/// The time for every block of `blocks` to take `n` counts, each from a thread of its own.
fn counted_by_threads(blocks: &[&PacketCounters], n: u64) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for block in blocks {
            s.spawn(move || count(block, n));
        }
    });
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("counters");
    group.throughput(Throughput::Elements(1));
    group.bench_function("one_thread", |b| {
        let counters = Counters::default();
        let q0 = counters.thread("weft-q0");
        b.iter_custom(|n| counted_by_threads(&[&q0], n));
    });
    group.bench_function("two_threads_one_shared_block", |b| {
        let shared = PacketCounters::default();
        b.iter_custom(|n| counted_by_threads(&[&shared, &shared], n));
    });
    group.bench_function("two_threads_own_padded_blocks", |b| {
        let counters = Counters::default();
        let (q0, q1) = (counters.thread("weft-q0"), counters.thread("weft-q1"));
        b.iter_custom(|n| counted_by_threads(&[&q0, &q1], n));
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
