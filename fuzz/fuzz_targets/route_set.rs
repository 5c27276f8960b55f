//! The watch → route path: RouteSet::apply_listing / apply_batch / set_own with arbitrary
//! listings and events (puts of arbitrary lease JSON, deletes, unparsable keys), then table()
//! and lookups. Invariants: the own subnet is never published; every lookup is the longest
//! prefix over the table's peers (checked against a naive scan); resume revisions never go
//! back; a delete or unreadable key keeps the route (stale), unless the same batch holds a
//! departure marker (relinquish or revoke) of that subnet at the delete's own revision.
//! Leases name IPv6 halves from a pool of eight, so several keys often name one: no two
//! published routes carry one half, a key listed in `half_conflicts` carries none, and which
//! key carries a half does not depend on the order of a listing.
//! Half the inputs run on an IPv6-only network (`fd00:10:244::/56` in /64s), whose leases are
//! those halves themselves (`0.0.0.0-0&<half>`): every route is then an IPv6 subnet carried as
//! its own half, and no IPv4 address is ever routed.
#![no_main]

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use arbitrary::{Arbitrary, Unstructured};
use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use weft::lease::record::{
    HistoryEntry, HistoryRecord, HistoryState, Ipv6Subnet, LeaseAttrs, NodeId, Revision,
    StoreLeaseId, StoredLease, Subnet,
};
use weft::lease::store::{BadEntry, Listing, WatchBatch, WatchEvent};
use weft::route::RouteSet;
use weft_fuzz::{ArbNetwork, naive_lookup};

#[derive(Arbitrary, Debug)]
struct ArbLease {
    index: u32,
    len: Option<u8>,
    rev: u8,
    /// How many revisions before `rev` the key was created.
    age: u8,
    /// The IPv6 half the key names: `fd00:10:244:<n % 8>::/64`.
    half: Option<u8>,
    value: Value,
}

#[derive(Arbitrary, Debug)]
enum Value {
    /// A flannel-shaped value.
    Shaped { public: u8, vxlan: Option<Option<[u8; 6]>>, vni: Option<u32>, v6: bool },
    /// Arbitrary JSON text (only leases that parse become events).
    Json(String),
}

#[derive(Arbitrary, Debug)]
enum Event {
    Put(ArbLease),
    Delete {
        index: u32,
        len: Option<u8>,
        rev: u8,
    },
    Bad {
        name: String,
        under_subnets: bool,
    },
    /// The delete of a key whose name does not parse.
    DeleteUnparsed {
        name: String,
        rev: u8,
    },
    Departed {
        index: u32,
        len: Option<u8>,
        state: u8,
        rev: u8,
    },
}

#[derive(Arbitrary, Debug)]
enum Op {
    Listing {
        rev: u8,
        leases: Vec<ArbLease>,
        history: Vec<(u32, u8, u8)>,
        bad: Vec<String>,
    },
    Batch {
        rev: u8,
        events: Vec<Event>,
    },
    SetOwn(Option<u32>),
    /// A stale route's trust ran out (the watcher's `--stale-route-ttl`).
    DropStale(u32),
}

#[derive(Arbitrary, Debug)]
struct Input {
    network: ArbNetwork,
    /// An IPv6-only network instead of `network`.
    ipv6_only: bool,
    ops: Vec<Op>,
    probes: Vec<u32>,
}

/// The network under test: `net`, or an IPv6-only one.
struct Net {
    net: ArbNetwork,
    ipv6_only: bool,
}

/// `fd00:10:244:<n % 8>::/64`: the pool of halves (and, IPv6-only, of subnets).
fn half(n: u8) -> Ipv6Subnet {
    let addr = std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, u16::from(n % 8), 0, 0, 0, 0);
    Ipv6Subnet::new(ipnet::Ipv6Net::new(addr, 64).unwrap()).unwrap()
}

impl Net {
    /// What the route set is built for.
    fn leased(&self) -> (IpNet, u8) {
        if self.ipv6_only {
            ("fd00:10:244::/56".parse().unwrap(), 64)
        } else {
            (self.net.net().into(), self.net.subnet_len())
        }
    }

    /// The `i`th subnet: a pool half on an IPv6-only network, else `len` long in `net`.
    fn subnet(&self, i: u32, len: Option<u8>) -> Subnet {
        if self.ipv6_only {
            Subnet::from(half(i as u8))
        } else {
            self.net.subnet(i, len.map_or(self.net.subnet_len(), |x| x % 33))
        }
    }
}

fn lease(net: &Net, l: &ArbLease) -> Option<StoredLease> {
    let attrs = match &l.value {
        Value::Shaped { public, vxlan, vni, v6 } => {
            let mut json = if net.ipv6_only {
                r#"{"PublicIP":"0.0.0.0""#.to_owned()
            } else {
                format!(r#"{{"PublicIP":"192.0.2.{public}""#)
            };
            if *v6 {
                json.push_str(&format!(
                    r#","PublicIPv6":"2001:db8::{public:x}","BackendV6Data":{{"VNI":1,"VtepMAC":"02:00:00:00:06:{public:02x}"}}"#
                ));
            }
            if let Some(mac) = vxlan {
                json.push_str(r#","BackendType":"vxlan","BackendData":{"#);
                if let Some(m) = mac {
                    json.push_str(&format!(
                        r#""VtepMAC":"{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}""#,
                        m[0], m[1], m[2], m[3], m[4], m[5]
                    ));
                    if let Some(v) = vni {
                        json.push_str(&format!(r#","VNI":{v}"#));
                    }
                }
                json.push('}');
            }
            json.push('}');
            LeaseAttrs::from_json(json.as_bytes()).ok()?
        }
        Value::Json(s) => LeaseAttrs::from_json(s.as_bytes()).ok()?,
    };
    // IPv6-only: a key naming a half is that half's lease; one naming none is an IPv4 key,
    // foreign to the network.
    let subnet = match (net.ipv6_only, l.half) {
        (true, Some(n)) => Subnet::from(half(n)),
        (true, None) => net.net.subnet(l.index, net.net.subnet_len()),
        (false, _) => net.subnet(l.index, l.len),
    };
    Some(StoredLease {
        subnet,
        ipv6: l.half.map(half),
        attrs,
        create_revision: Revision(i64::from(l.rev) - i64::from(l.age)),
        mod_revision: Revision(i64::from(l.rev)),
        lease_id: StoreLeaseId(0),
    })
}

fn check(set: &RouteSet, probes: &[u32], net: &Net) {
    let (leased, len) = net.leased();
    let table = set.table();
    let peers = table.peers();
    if let Some(own) = set.own() {
        assert!(peers.iter().all(|p| p.subnet != own), "own subnet published");
    }
    assert!(peers.windows(2).all(|w| w[0].subnet < w[1].subnet), "peers not sorted and unique");
    for p in peers {
        assert!(p.subnet.check_lease_of(leased, len).is_ok(), "foreign route");
        match p.subnet.v6() {
            Some(v6) => {
                assert!(net.ipv6_only, "an IPv6 route on an IPv4 network");
                assert_eq!(p.ipv6.map(|h| h.subnet), Some(v6), "not carried as its own half");
                assert!(!table.is_known_peer(p.public_ip), "{} accepted", p.public_ip);
                let found = table.lookup6(v6.first_host()).map(|(q, _)| q);
                assert_eq!(found, Some(p), "a peer's own IPv6 address");
            }
            None => {
                assert!(table.is_known_peer(p.public_ip));
                let own = p.subnet.v4().expect("IPv4 or IPv6").network();
                assert_eq!(table.lookup(own), Some(p), "a peer's own address");
            }
        }
    }
    // One half, one live route (stale routes alone on a half are left to the table, which
    // gives it to the lower subnet); a key listed as conflicting carries none.
    let mut carried = BTreeSet::new();
    for p in peers {
        if let Some(v6) = &p.ipv6 {
            assert!(p.stale || carried.insert(v6.subnet), "{} carried by two routes", v6.subnet);
            let key = match p.subnet.v4() {
                Some(v4) => format!("subnets/{}-{}&", v4.network(), v4.prefix_len()),
                None => format!("subnets/{}", p.subnet.key_name()),
            };
            assert!(
                set.half_conflicts().keys().all(|k| !k.starts_with(&key)),
                "{key} is listed as conflicting and carries its half"
            );
        }
    }
    let base = u32::from(net.net.net().network());
    for &x in probes.iter().take(32) {
        for d in [Ipv4Addr::from(x), Ipv4Addr::from(base.wrapping_add(x % 65536))] {
            assert_eq!(table.lookup(d), naive_lookup(peers, d), "lookup of {d}");
            assert!(!net.ipv6_only || table.lookup(d).is_none(), "{d} routed on IPv6-only");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let net = Net { net: input.network, ipv6_only: input.ipv6_only };
    let (leased, len) = net.leased();
    let mut set = RouteSet::new(leased, len);
    let node = NodeId::parse("node-0001").unwrap();
    for op in input.ops.iter().take(16) {
        let resume = set.resume_revision();
        match op {
            Op::Listing { rev, leases, history, bad } => {
                let listing = Listing {
                    revision: Revision(i64::from(*rev)),
                    leases: leases.iter().take(32).filter_map(|l| lease(&net, l)).collect(),
                    history: history
                        .iter()
                        .take(32)
                        .map(|&(i, state, rev)| HistoryEntry {
                            subnet: net.subnet(i, None),
                            record: HistoryRecord {
                                state: [
                                    HistoryState::Held,
                                    HistoryState::Relinquished,
                                    HistoryState::Revoked,
                                ][usize::from(state % 3)],
                                node: node.clone(),
                                public_ip: Ipv4Addr::new(192, 0, 2, 1),
                                ipv6: None,
                            },
                            mod_revision: Revision(i64::from(rev)),
                        })
                        .collect(),
                    skipped: bad
                        .iter()
                        .take(8)
                        .map(|n| BadEntry {
                            key: format!("/coreos.com/network/subnets/{n}"),
                            problem: "x".into(),
                        })
                        .collect(),
                    presence: Vec::new(),
                };
                set.apply_listing(&listing);
                assert!(!set.needs_relist());
                // The same listing in the other order gives the halves to the same routes (when
                // each subnet is listed once: else the order picks which of its leases counts).
                let subnets: BTreeSet<_> = listing.leases.iter().map(|l| l.subnet).collect();
                if subnets.len() == listing.leases.len() {
                    let mut reversed = RouteSet::new(leased, len);
                    reversed.set_own(set.own());
                    let mut other = listing.clone();
                    other.leases.reverse();
                    reversed.apply_listing(&other);
                    let halves = |s: &RouteSet| -> Vec<_> {
                        s.table()
                            .peers()
                            .iter()
                            .map(|p| (p.subnet, p.ipv6.map(|v| v.subnet)))
                            .collect()
                    };
                    if set.table().peers().iter().all(|p| !p.stale) {
                        assert_eq!(halves(&set), halves(&reversed), "order changed the halves");
                    }
                }
                // Every lease of the listing that parses is routed (not stale), unless own.
                for l in &listing.leases {
                    if let Some(p) = set.peer(l.subnet)
                        && l.subnet.check_lease_of(leased, len).is_ok()
                        && weft::route::Peer::from_lease(l).is_ok()
                    {
                        let last = listing.leases.iter().rev().find(|x| x.subnet == l.subnet);
                        if last == Some(l) {
                            assert!(!p.stale, "listed lease stale");
                        }
                    }
                }
            }
            Op::Batch { rev, events } => {
                let events: Vec<WatchEvent> = events
                    .iter()
                    .take(32)
                    .filter_map(|e| match e {
                        Event::Put(l) => lease(&net, l).map(WatchEvent::Put),
                        Event::Delete { index, len, rev } => Some(WatchEvent::Delete {
                            subnet: net.subnet(*index, *len),
                            revision: Revision(i64::from(*rev)),
                        }),
                        Event::Bad { name, under_subnets } => Some(WatchEvent::Bad(BadEntry {
                            key: if *under_subnets {
                                format!("/coreos.com/network/subnets/{name}")
                            } else {
                                name.clone()
                            },
                            problem: "bad".into(),
                        })),
                        Event::DeleteUnparsed { name, rev } => Some(WatchEvent::DeleteUnparsed {
                            key: format!("/coreos.com/network/subnets/{name}"),
                            revision: Revision(i64::from(*rev)),
                        }),
                        Event::Departed { index, len, state, rev } => {
                            Some(WatchEvent::Departed(HistoryEntry {
                                subnet: net.subnet(*index, *len),
                                record: HistoryRecord {
                                    state: [
                                        HistoryState::Held,
                                        HistoryState::Relinquished,
                                        HistoryState::Revoked,
                                    ][usize::from(state % 3)],
                                    node: node.clone(),
                                    public_ip: Ipv4Addr::new(192, 0, 2, 1),
                                    ipv6: None,
                                },
                                mod_revision: Revision(i64::from(*rev)),
                            }))
                        }
                    })
                    .collect();
                // A route may go only by a delete with its clean-leave marker in this batch.
                let left = |s: weft::lease::record::Subnet| {
                    events.iter().any(|d| {
                        matches!(d, WatchEvent::Departed(h) if h.subnet == s
                            && h.record.state != HistoryState::Held
                            && events.iter().any(|e| matches!(e,
                                WatchEvent::Delete { subnet, revision }
                                    if *subnet == s && *revision == h.mod_revision)))
                    })
                };
                let before: Vec<_> = set.table().peers().iter().map(|p| p.subnet).collect();
                let batch =
                    WatchBatch { revision: Revision(i64::from(*rev)), events: events.clone() };
                set.apply_batch(&batch);
                let after = set.table();
                for s in before {
                    assert!(
                        after.peers().iter().any(|p| p.subnet == s)
                            || set.own() == Some(s)
                            || left(s),
                        "{s} lost by a batch"
                    );
                }
            }
            Op::SetOwn(i) => {
                set.set_own(i.map(|i| net.subnet(i, None)));
            }
            Op::DropStale(i) => {
                // Only a stale route goes; every live one stays.
                let s = net.subnet(*i, None);
                let live: Vec<_> =
                    set.table().peers().iter().filter(|p| !p.stale).map(|p| p.subnet).collect();
                let was_stale = set.peer(s).is_some_and(|p| p.stale);
                set.drop_stale(s);
                assert!(!was_stale || set.peer(s).is_none(), "{s} stale and not dropped");
                for l in live {
                    assert!(set.table().peers().iter().any(|p| p.subnet == l), "{l} live, dropped");
                }
            }
        }
        assert!(set.resume_revision() >= resume, "resume revision went back");
        let _ = (set.bad_entries(), set.ignored().len());
        check(&set, &input.probes, &net);
    }
});
