//! Per-packet VXLAN forwarding cost through the pure pipeline: `Forwarder::encap` (route
//! lookup, flow hash, VXLAN and inner Ethernet headers into the headroom) and
//! `Forwarder::decap` (VXLAN/Ethernet checks, inner IPv4 parse, sender and destination
//! validation), for 64-byte and 1400-byte inner packets, against a 1,000-lease table.

use std::hint::black_box;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ipnet::Ipv4Net;
use weft::config::BackendKind;
use weft::dataplane::transport::{Forwarder, HEADROOM, OwnSubnet, Rx, Tx};
use weft::dataplane::wire::ethernet::MacAddr;
use weft::dataplane::wire::{Vni, ipv4};
use weft::lease::record::Subnet;
use weft::route::{Peer, PeerBackend, RouteTable};
use weft::time::Instant;

fn subnet(i: u32) -> Subnet {
    Subnet::from_parts(Ipv4Addr::from(0x0a00_0000 | (i << 8)), 24).expect("a /24 of 10/8")
}

fn mac(i: u32) -> MacAddr {
    MacAddr([0x02, 0, 0, 0, (i >> 8) as u8, i as u8])
}

fn public_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0xc0a8_0000 | i)
}

fn forwarder(i: u32) -> Forwarder {
    let own = Arc::new(OwnSubnet::default());
    own.set(Some(subnet(i)));
    Forwarder {
        backend: BackendKind::Vxlan,
        vni: Vni::new(1).expect("VNI 1"),
        port: 8472,
        our_mac: mac(i),
        own,
        icmp_source: std::net::Ipv4Addr::new(10, 0, 0, 0),
        icmp_limit: Arc::default(),
        malformed: Arc::default(),
        wireguard: None,
        ipv6: Default::default(),
    }
}

/// An IPv4/UDP packet of `len` bytes from 10.0.0.2 to 10.0.5.3, at `buf[HEADROOM..]`.
fn packet_buf(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; HEADROOM + len];
    let p = &mut buf[HEADROOM..];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[6] = 0x40;
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&[10, 0, 0, 2]);
    p[16..20].copy_from_slice(&[10, 0, 5, 3]);
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&5201u16.to_be_bytes());
    p[24..26].copy_from_slice(&((len - 20) as u16).to_be_bytes());
    ipv4::Packet::new_unchecked(&mut p[..]).fill_checksum();
    buf
}

fn bench(c: &mut Criterion) {
    let network: Ipv4Net = "10.0.0.0/8".parse().expect("valid network");
    // Leases 0..1000 (so 10.0.0.0/24 sends, 10.0.5.0/24 receives).
    let peers = (0..1000).map(|i| Peer {
        subnet: subnet(i),
        public_ip: public_ip(i),
        backend: PeerBackend::Vxlan,
        vtep_mac: Some(mac(i)),
        vni: Some(1),
        node: None,
        stale: false,
        incarnation: None,
        ipv6: None,
    });
    let routes = RouteTable::build(network, 24, peers);
    let (tx, rx) = (forwarder(0), forwarder(5));
    let from = SocketAddrV4::new(public_ip(0), 8472).into();
    let mut reply = vec![0u8; 1500];

    let mut group = c.benchmark_group("encap_decap");
    for len in [64usize, 1400] {
        group.throughput(Throughput::Bytes(len as u64));
        let mut buf = packet_buf(len);
        let Tx::Send { range, .. } = tx.encap(&routes, &mut buf, len, &mut reply, Instant::ZERO)
        else {
            panic!("the bench packet must be sendable");
        };
        // The datagram as the receiver's socket hands it over.
        let mut datagram = buf[range].to_vec();
        let dlen = datagram.len();
        assert_eq!(
            rx.decap(&routes, from, &mut datagram, dlen),
            Rx::Deliver { range: HEADROOM..dlen, checksums_trusted: false }
        );

        // encap only rewrites the headroom, so the same buffer serves every iteration.
        group.bench_function(format!("encap_{len}B"), |b| {
            b.iter(|| {
                black_box(tx.encap(&routes, black_box(&mut buf), len, &mut reply, Instant::ZERO))
            })
        });
        // decap of a VXLAN datagram reads only (no TTL change on vxlan).
        group.bench_function(format!("decap_{len}B"), |b| {
            b.iter(|| black_box(rx.decap(&routes, from, black_box(&mut datagram), dlen)))
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
