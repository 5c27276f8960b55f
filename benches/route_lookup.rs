//! Route lookup cost: `RouteTable::lookup` for a destination inside a leased subnet, with 10,
//! 1,000 and 65,536 leases of 10.0.0.0/8 split into /24s. Destinations are pre-generated, so
//! only the lookup is measured. `route_lookup6`: `RouteTable::lookup6` with the same leases
//! dual-stack (each with a /64 of fd00::/48).
//!
//! And what a route watcher pays per publish: `RouteTable::build` of 100 and 1,000 peers (a
//! whole new table, as the watcher builds on every change it publishes), in the 1,000-host
//! benchmark's network (10.244.0.0/16 in /28s: a dense table of 4,096 slots).

use std::hint::black_box;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use ipnet::Ipv4Net;
use rand::{Rng, SeedableRng};
use weft::dataplane::wire::ethernet::MacAddr;
use weft::lease::record::Subnet;
use weft::route::{Peer, Peer6, PeerBackend, RouteTable};

/// Destinations cycled through (a power of two, so the index wraps with a mask).
const DSTS: usize = 4096;

/// The /24 with index `i` of 10.0.0.0/8.
fn subnet(i: u32) -> Subnet {
    Subnet::from_parts(Ipv4Addr::from(0x0a00_0000 | (i << 8)), 24).expect("a /24 of 10/8")
}

fn peer(i: u32) -> Peer {
    Peer {
        subnet: subnet(i),
        public_ip: Ipv4Addr::from(0xc0a8_0000 | i),
        backend: PeerBackend::Vxlan,
        vtep_mac: Some(MacAddr([0x02, 0, 0, 0, (i >> 8) as u8, i as u8])),
        vni: Some(1),
        node: None,
        stale: false,
        incarnation: None,
        ipv6: None,
    }
}

fn bench(c: &mut Criterion) {
    let network: Ipv4Net = "10.0.0.0/8".parse().expect("valid network");
    let mut group = c.benchmark_group("route_lookup");
    group.throughput(Throughput::Elements(1));
    for n in [10u32, 1_000, 65_536] {
        // Spread the leases over the network, as a real cluster's would be.
        let step = 65_536 / n;
        let leased: Vec<u32> = (0..n).map(|i| i * step).collect();
        let table = RouteTable::build(network, 24, leased.iter().map(|&i| peer(i)));
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let dsts: Vec<Ipv4Addr> = (0..DSTS)
            .map(|_| {
                let s = leased[rng.random_range(0..leased.len())];
                Ipv4Addr::from(0x0a00_0000 | (s << 8) | rng.random_range(1..255))
            })
            .collect();
        assert!(dsts.iter().all(|d| table.lookup(*d).is_some()));
        group.bench_function(format!("{n}_routes"), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & (DSTS - 1);
                black_box(table.lookup(black_box(dsts[i])))
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("route_lookup6");
    group.throughput(Throughput::Elements(1));
    let half = |i: u32| 0xfd00_0000_0000_0000_0000_0000_0000_0000u128 | (u128::from(i) << 64);
    for n in [10u32, 1_000, 65_536] {
        let step = 65_536 / n;
        let leased: Vec<u32> = (0..n).map(|i| i * step).collect();
        let peers = leased.iter().map(|&i| Peer {
            ipv6: Some(Peer6 {
                subnet: format!("{}/64", Ipv6Addr::from(half(i))).parse().expect("a /64"),
                public_ip: Ipv6Addr::from(0x2001_0db8_u128 << 96 | u128::from(i)),
                vtep_mac: MacAddr([0x02, 0, 0, 6, (i >> 8) as u8, i as u8]),
                wireguard: None,
            }),
            ..peer(i)
        });
        let table = RouteTable::build(network, 24, peers);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let dsts: Vec<Ipv6Addr> = (0..DSTS)
            .map(|_| {
                let s = leased[rng.random_range(0..leased.len())];
                Ipv6Addr::from(half(s) | u128::from(rng.random_range(1u32..u32::MAX)))
            })
            .collect();
        assert!(dsts.iter().all(|d| table.lookup6(*d).is_some()));
        group.bench_function(format!("{n}_routes"), |b| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) & (DSTS - 1);
                black_box(table.lookup6(black_box(dsts[i])))
            })
        });
    }
    group.finish();

    let network: Ipv4Net = "10.244.0.0/16".parse().expect("valid network");
    let mut group = c.benchmark_group("route_table_build");
    for n in [100u32, 1_000] {
        let peers: Vec<Peer> = (0..n)
            .map(|i| Peer {
                subnet: Subnet::from_parts(Ipv4Addr::from(0x0af4_0000 | (i << 4)), 28)
                    .expect("a /28 of 10.244/16"),
                ..peer(i)
            })
            .collect();
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("{n}_peers"), |b| {
            b.iter(|| black_box(RouteTable::build(network, 28, black_box(&peers).iter().cloned())))
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
