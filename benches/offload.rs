//! Offload cost: TSO split of a 64 KiB TCPv4 super-packet (MSS 1398) into segments behind
//! VXLAN headroom, and GRO coalescing of those segments back into one super-packet: by copying
//! into the first segment's buffer, and in place (what the RX path does).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weft::dataplane::offload::{GroConfig, GroTable, PacketRef, VIRTIO_HEADROOM, split};
use weft::dataplane::transport::HEADROOM;
use weft::dataplane::wire::{tcp, virtio_net};

const MSS: usize = 1398;
/// The largest IPv4 packet: what TSO hands over at most.
const SUPER_LEN: usize = 65_535;
const HDRS: usize = 20 + 20;

/// A TCPv4 super-packet of `SUPER_LEN` bytes and its TSO header, as TUN gives them.
fn super_packet() -> (virtio_net::Header, Vec<u8>) {
    let mut p: Vec<u8> = (0..SUPER_LEN).map(|i| (i * 7) as u8).collect();
    p[..HDRS].fill(0);
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(SUPER_LEN as u16).to_be_bytes());
    p[4..6].copy_from_slice(&1234u16.to_be_bytes());
    p[6] = 0x40;
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&[10, 244, 1, 2]);
    p[16..20].copy_from_slice(&[10, 244, 2, 3]);
    let mut t = tcp::Packet::new_unchecked(&mut p[20..]);
    t.set_src_port(40000);
    t.set_dst_port(5201);
    t.set_seq_number(1);
    t.set_ack_number(1);
    t.set_header_len(20);
    t.set_flags(tcp::ACK | tcp::PSH);
    t.set_window_len(502);
    let hdr = virtio_net::Header {
        flags: virtio_net::F_NEEDS_CSUM,
        gso_type: virtio_net::GSO_TCPV4,
        hdr_len: HDRS as u16,
        gso_size: MSS as u16,
        csum_start: 20,
        csum_offset: 16,
    };
    (hdr, p)
}

fn bench(c: &mut Criterion) {
    let (hdr, packet) = super_packet();
    let payload = (SUPER_LEN - HDRS) as u64;
    let mut out = vec![0u8; 50 * (HEADROOM + HDRS + MSS)];
    let segs = split(&hdr, &packet, &mut out, HEADROOM).expect("splits");
    let n = segs.count();
    let segments: Vec<Vec<u8>> = (0..n).map(|i| out[segs.packet(i)].to_vec()).collect();

    let mut group = c.benchmark_group("offload");
    group.throughput(Throughput::Bytes(payload));
    group.bench_function(format!("tso_split_64KiB_{n}_segs"), |b| {
        b.iter(|| black_box(split(&hdr, black_box(&packet), &mut out, HEADROOM)))
    });

    // Every buffer could hold a whole super-packet, as a receive ring's would.
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; VIRTIO_HEADROOM + SUPER_LEN]; n];
    let mut lens = vec![0usize; n];
    let mut table = GroTable::new(GroConfig::default(), n);
    let refill = |bufs: &mut [Vec<u8>], lens: &mut [usize]| {
        for ((b, l), s) in bufs.iter_mut().zip(lens.iter_mut()).zip(&segments) {
            b[VIRTIO_HEADROOM..][..s.len()].copy_from_slice(s);
            *l = s.len();
        }
    };
    refill(&mut bufs, &mut lens);
    assert_eq!(table.coalesce(&mut bufs, &mut lens), [0], "one super-packet comes back");
    assert_eq!(lens[0], VIRTIO_HEADROOM + SUPER_LEN);
    group.bench_function(format!("gro_coalesce_{n}_segs"), |b| {
        // Coalescing rewrites the batch, so restore it before each timed run (untimed).
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                refill(&mut bufs, &mut lens);
                let start = Instant::now();
                black_box(table.coalesce(&mut bufs, &mut lens));
                total += start.elapsed();
            }
            total
        })
    });

    // In place, as the RX path does it: the segments back to back in one receive buffer
    // (VXLAN headroom between them, as UDP GRO leaves the datagrams), nothing copied.
    let mut ring = vec![0u8; n * (HEADROOM + HDRS + MSS)];
    let mut refs = Vec::with_capacity(n);
    let mut at = 0;
    for s in &segments {
        at += HEADROOM;
        ring[at..at + s.len()].copy_from_slice(s);
        refs.push(PacketRef::new(0, at, s.len()));
        at += s.len();
    }
    let pristine = ring.clone();
    let mut bufs = [ring];
    // The same segments from a weft peer: the outer UDP checksum, verified by the kernel,
    // covered every one, so none is verified again.
    let trusted: Vec<PacketRef> =
        refs.iter().map(|r| PacketRef { checksums_trusted: true, ..*r }).collect();
    for (name, refs) in
        [("gro_coalesce_in_place", &refs), ("gro_coalesce_in_place_trusted", &trusted)]
    {
        bufs[0][..HEADROOM + HDRS].copy_from_slice(&pristine[..HEADROOM + HDRS]);
        assert_eq!(table.coalesce_refs(&mut bufs, refs).len(), 1, "one super-packet comes back");
        group.bench_function(format!("{name}_{n}_segs"), |b| {
            // Coalescing fixes up the head's headers, so restore them before each run (untimed).
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    bufs[0][..HEADROOM + HDRS].copy_from_slice(&pristine[..HEADROOM + HDRS]);
                    let start = Instant::now();
                    black_box(table.coalesce_refs(&mut bufs, refs));
                    total += start.elapsed();
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
