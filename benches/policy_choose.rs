//! Subnet choice cost: `policy::choose` with 1,000, 10,000 and 50,000 live leases of
//! 10.0.0.0/8 split into /24s (65,535 leasable), each with a history record (a cluster where every
//! host has held its subnet a while). The leases are the lowest subnets, the worst case for the
//! ascending scan: it must step over every occupied subnet to reach the free ones. A joining node
//! with no previous subnet chooses, so rules 3 and 4 run.

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use rand::SeedableRng;
use rand::rngs::StdRng;
use weft::config::NetworkConfig;
use weft::lease::policy::{Choice, choose};
use weft::lease::record::{
    HistoryEntry, HistoryRecord, HistoryState, LeaseAttrs, NodeId, Revision, StoreLeaseId,
    StoredLease, Subnet,
};
use weft::lease::store::Listing;

fn listing(config: &NetworkConfig, n: usize) -> Listing {
    let mut l = Listing::default();
    for (i, subnet) in config.subnets().take(n).enumerate() {
        let node = NodeId::parse(&format!("node-{i:08}")).expect("node id");
        let public_ip = Ipv4Addr::from(0xc612_0000 | i as u32);
        l.leases.push(StoredLease {
            subnet,
            ipv6: None,
            attrs: LeaseAttrs {
                public_ip,
                public_ipv6: None,
                backend_type: Some("vxlan".into()),
                backend_data: None,
                backend_v6_data: None,
                node_id: Some(node.clone()),
                incarnation: None,
            },
            create_revision: Revision(i as i64 + 1),
            mod_revision: Revision(i as i64 + 1),
            lease_id: StoreLeaseId(i as i64 + 1),
        });
        l.history.push(HistoryEntry {
            subnet,
            record: HistoryRecord { state: HistoryState::Held, node, public_ip, ipv6: None },
            mod_revision: Revision(i as i64 + 1),
        });
    }
    l
}

fn bench(c: &mut Criterion) {
    let config =
        NetworkConfig::parse(br#"{"Network":"10.0.0.0/8","SubnetLen":24}"#).expect("valid config");
    let me = NodeId::parse("joining-node").expect("node id");
    let mut group = c.benchmark_group("policy_choose");
    for n in [1_000usize, 10_000, 50_000] {
        let l = listing(&config, n);
        let mut rng = StdRng::seed_from_u64(1);
        let first_free: Subnet = config.subnets().nth(n).expect("a free subnet");
        let d = choose(&config, &l, &me, None, &mut rng);
        assert!(
            matches!(d.choice, Choice::Create { subnet, .. } if subnet >= first_free),
            "{:?}",
            d.choice
        );
        group.bench_function(format!("{n}_leases"), |b| {
            b.iter(|| choose(&config, black_box(&l), &me, None, &mut rng))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).sample_size(20);
    targets = bench
}
criterion_main!(benches);
