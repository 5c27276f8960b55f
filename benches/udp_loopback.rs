//! UDP over loopback, sent three ways: one `sendto` per datagram (std's socket), `sendmmsg` one
//! datagram per message, and `sendmmsg` with UDP GSO (many datagrams per message), to a
//! receiver with UDP GRO off and on. Each iteration sends 100,000 datagrams of 1,400 bytes;
//! the time reported is per datagram sent. Loopback drops what the receiver cannot keep up
//! with, so each case's share received, and its send syscalls, are printed once before it runs.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weft::dataplane::sys::udp::{LoopbackSend, loopback_run};

/// Datagrams per iteration.
const PER_ITER: usize = 100_000;
/// Bytes per datagram: a full inner packet under a 1,450-byte MTU.
const SIZE: usize = 1400;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("udp_loopback");
    group.throughput(Throughput::Elements(PER_ITER as u64));
    for (name, how, gro) in [
        ("sendto", LoopbackSend::SendTo, false),
        ("sendmmsg", LoopbackSend::Sendmmsg, false),
        ("sendmmsg_gso", LoopbackSend::SendmmsgGso, false),
        ("sendmmsg_gso_to_gro", LoopbackSend::SendmmsgGso, true),
    ] {
        let run = loopback_run(how, gro, PER_ITER, SIZE);
        eprintln!(
            "udp_loopback/{name}: {} send syscalls, {:.1} % received",
            run.send_calls,
            run.received as f64 * 100.0 / PER_ITER as f64
        );
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                (0..iters).map(|_| loopback_run(how, gro, PER_ITER, SIZE).send).sum()
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(5));
    targets = bench
}
criterion_main!(benches);
