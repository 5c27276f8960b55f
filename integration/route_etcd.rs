//! The route watcher against a real etcd: a delete is told apart (relinquish or revoke: the
//! route goes; expiry: it stays, stale) by the departure marker a release or revoke writes in
//! the delete's transaction, which etcd delivers in the delete's own watch response: no read
//! and no re-list per delete (with N watchers, a call per delete per watcher is O(N²)).
//!
//! Each test starts its own etcd and works under its own prefix.

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use support::etcd::{EtcdServer, unique_prefix};
use support::weft::lease_list_json;
use tokio::sync::watch;
use weft::config::NetworkConfig;
use weft::lease::etcd::{EtcdOptions, EtcdStore};
use weft::lease::record::{HistoryState, Incarnation, LeaseAttrs, NodeId, Revision, Subnet};
use weft::lease::store::{CreateOutcome, HeldLease, LeaseFeed, ReleaseOutcome, Store, WatchEvent};
use weft::route::{RouteStats, RouteTable, Routes};

const CALL_TIMEOUT: Duration = Duration::from_secs(2);
const LONG_TTL: Duration = Duration::from_secs(60);
/// etcd's smallest lease TTL with default raft timing (1.5 election timeouts, rounded up).
const SHORT_TTL: Duration = Duration::from_secs(2);
/// How soon a published table must show a change the watch delivered.
const PROMPTLY: Duration = Duration::from_secs(5);

async fn store(etcd: &EtcdServer, prefix: &str) -> EtcdStore {
    EtcdStore::connect(EtcdOptions {
        endpoints: vec![etcd.endpoint()],
        prefix: prefix.to_owned(),
        call_timeout: CALL_TIMEOUT,
        ..EtcdOptions::default()
    })
    .await
    .expect("connect to the test etcd")
}

fn subnet(text: &str) -> Subnet {
    text.parse().expect("test subnet")
}

fn node(host: u8) -> NodeId {
    NodeId::parse(&format!("node-{host:04}")).expect("test node id")
}

fn attrs(host: u8) -> LeaseAttrs {
    LeaseAttrs {
        public_ip: Ipv4Addr::new(192, 0, 2, host),
        public_ipv6: None,
        backend_type: Some("vxlan".to_owned()),
        backend_data: Some(
            serde_json::json!({"VNI": 1, "VtepMAC": format!("02:00:00:00:00:{host:02x}")}),
        ),
        backend_v6_data: None,
        node_id: Some(node(host)),
        incarnation: Some(Incarnation::parse("inc-00000001").expect("test incarnation")),
    }
}

fn created(outcome: CreateOutcome) -> HeldLease {
    match outcome {
        CreateOutcome::Created(held) => held,
        other => panic!("expected Created, got {other:?}"),
    }
}

/// A route watcher on its own etcd client, as `weft run` starts one.
struct Watcher {
    routes: Arc<Routes>,
    stats: Arc<RouteStats>,
    _shutdown: watch::Sender<bool>,
    _own: watch::Sender<Option<weft::lease::record::LeaseName>>,
}

impl Watcher {
    async fn start(etcd: &EtcdServer, prefix: &str) -> Self {
        Self::start_on(etcd, prefix, br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#)
            .await
    }

    /// A watcher of the network `config` (JSON).
    async fn start_on(etcd: &EtcdServer, prefix: &str, config: &[u8]) -> Self {
        let network = NetworkConfig::parse(config).expect("network config");
        let routes = Arc::new(Routes::new({
            let (net, len) = network.leased_network();
            RouteTable::build_in(net, len, [])
        }));
        let stats = Arc::new(RouteStats::default());
        let (own, own_rx) = watch::channel(None);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let client: Arc<dyn Store> = Arc::new(store(etcd, prefix).await);
        tokio::spawn(weft::route::watcher::run(
            client,
            routes.clone(),
            network,
            own_rx,
            stats.clone(),
            // Longer than any test here: an expired route stays, stale.
            Duration::from_secs(3600),
            shutdown_rx,
        ));
        Self { routes, stats, _shutdown: shutdown, _own: own }
    }

    /// (subnet, last octet of the public IP, stale) for every published route.
    fn routes(&self) -> Vec<(String, u8, bool)> {
        self.routes
            .load()
            .peers()
            .iter()
            .map(|p| (p.subnet.to_string(), p.public_ip.octets()[3], p.stale))
            .collect()
    }

    /// Waits until the published routes are `want`, or panics after `within`.
    async fn expect(&self, within: Duration, want: &[(&str, u8, bool)]) {
        let want: Vec<(String, u8, bool)> =
            want.iter().map(|(s, h, st)| (subnet(s).to_string(), *h, *st)).collect();
        let deadline = Instant::now() + within;
        loop {
            let now = self.routes();
            if now == want {
                return;
            }
            assert!(Instant::now() < deadline, "within {within:?}: want {want:?}, have {now:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn metrics(&self) -> String {
        weft::metrics::render_collector(self.stats.clone()).expect("metrics render")
    }
}

#[tokio::test]
async fn relinquish_and_revoke_unroute_and_an_expiry_stays_stale_without_any_relist() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let hosts = store(&etcd, &prefix).await;
    let one = created(hosts.create(subnet("10.244.1.0/24"), &attrs(1), LONG_TTL).await.unwrap());
    hosts.create(subnet("10.244.2.0/24"), &attrs(2), LONG_TTL).await.unwrap();
    hosts.create(subnet("10.244.3.0/24"), &attrs(3), SHORT_TTL).await.unwrap();
    hosts.create(subnet("10.244.4.0/24"), &attrs(4), LONG_TTL).await.unwrap();

    let w = Watcher::start(&etcd, &prefix).await;
    w.expect(
        PROMPTLY,
        &[
            ("10.244.1.0/24", 1, false),
            ("10.244.2.0/24", 2, false),
            ("10.244.3.0/24", 3, false),
            ("10.244.4.0/24", 4, false),
        ],
    )
    .await;

    // Host 1 leaves cleanly; an operator revokes host 2; host 3 stops renewing (its key
    // expires: SHORT_TTL plus etcd's expiry sweep).
    assert_eq!(hosts.release(&one, &node(1)).await.unwrap(), ReleaseOutcome::Released);
    assert!(hosts.revoke(subnet("10.244.2.0/24")).await.unwrap());
    w.expect(PROMPTLY + SHORT_TTL, &[("10.244.3.0/24", 3, true), ("10.244.4.0/24", 4, false)])
        .await;
    // Settled: the expired route is kept (stale), and nothing was re-listed to tell.
    tokio::time::sleep(Duration::from_secs(1)).await;
    w.expect(PROMPTLY, &[("10.244.3.0/24", 3, true), ("10.244.4.0/24", 4, false)]).await;
    let text = w.metrics();
    assert!(text.contains("weft_route_relists_total 0\n"), "{text}");
    assert!(text.contains("weft_route_watch_errors_total 0\n"), "{text}");
    assert!(text.contains("weft_routes_stale 1\n"), "{text}");
    assert_eq!(w.stats.relists.load(Ordering::Relaxed), 0);

    // A new holder of the expired subnet replaces the stale route.
    hosts.create(subnet("10.244.3.0/24"), &attrs(5), LONG_TTL).await.unwrap();
    w.expect(PROMPTLY, &[("10.244.3.0/24", 5, false), ("10.244.4.0/24", 4, false)]).await;
}

/// etcd's side of the departure markers: a release's delete and its marker arrive in one watch
/// response; the next create of the subnet deletes the marker; renewals (`refresh`, which
/// writes only history) and other keys inside the watched range give the watcher nothing.
#[tokio::test]
async fn a_leave_and_its_marker_arrive_in_one_watch_batch_and_renewals_wake_no_watcher() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let a = store(&etcd, &prefix).await;
    let s = subnet("10.244.3.0/24");
    let held = created(a.create(s, &attrs(1), LONG_TTL).await.unwrap());
    let mut watch = a.watch(Revision(held.mod_revision.0 + 1), None).await.expect("watch");
    // Renewals and a stranger's key inside the range: no batch for either.
    for _ in 0..3 {
        a.refresh(&held, &attrs(1)).await.expect("refresh");
    }
    let mut raw = etcd.client().await;
    let stray = raw.put(format!("{prefix}/weft/a"), "x", None).await.expect("put");
    let stray = stray.header().expect("a header").revision();
    assert_eq!(a.release(&held, &node(1)).await.unwrap(), ReleaseOutcome::Released);
    let mut next = async || {
        tokio::time::timeout(PROMPTLY, watch.next())
            .await
            .expect("a batch in time")
            .expect("the watch goes on")
            .expect("a batch")
    };
    // The stranger's key: an empty batch (progress), no event. The renewals: nothing at all.
    let progress = next().await;
    assert_eq!((progress.revision.0, progress.events.len()), (stray, 0), "{progress:?}");
    let batch = next().await;
    let [WatchEvent::Delete { subnet: deleted, revision }, WatchEvent::Departed(d)] =
        batch.events.as_slice()
    else {
        panic!("the leave's first batch: {batch:?}");
    };
    assert_eq!((*deleted, d.subnet, d.record.state), (s, s, HistoryState::Relinquished));
    assert_eq!(*revision, d.mod_revision, "one transaction");
    let marker = format!("{prefix}/weft/departures/{}", s.key_name());
    assert_eq!(raw.get(marker.as_str(), None).await.expect("get").kvs().len(), 1);
    // Taken again: the marker goes in the create's transaction.
    created(a.create(s, &attrs(2), LONG_TTL).await.unwrap());
    assert!(raw.get(marker.as_str(), None).await.expect("get").kvs().is_empty());
}

/// The dual-stack value of host `host`: its IPv6 half can be carried.
fn dual_attrs(host: u8) -> LeaseAttrs {
    LeaseAttrs {
        public_ipv6: Some(format!("2001:db8::{host}").parse().expect("test address")),
        backend_v6_data: Some(
            serde_json::json!({"VNI": 1, "VtepMAC": format!("02:00:00:00:06:{host:02x}")}),
        ),
        ..attrs(host)
    }
}

/// Two live keys naming one IPv6 half (etcd's create guards the IPv4 subnet only: here a
/// second writer puts its key by hand, as a flannel node that drew the same half would): the
/// half is routed to the key etcd created first, by etcd's own create revision, even after
/// the later key's holder last wrote before the first's did; the other key keeps its IPv4
/// route, is counted, and gets the half when the first key goes.
#[tokio::test]
async fn a_half_two_keys_name_is_routed_to_the_key_etcd_created_first() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let hosts = store(&etcd, &prefix).await;
    let half: weft::lease::record::Ipv6Subnet = "fd00:10:244:1::/64".parse().unwrap();
    let first =
        weft::lease::record::LeaseName { subnet: subnet("10.244.2.0/24"), ipv6: Some(half) };
    let later =
        weft::lease::record::LeaseName { subnet: subnet("10.244.1.0/24"), ipv6: Some(half) };
    let held = created(hosts.create_pruning(first, &dual_attrs(2), LONG_TTL, &[]).await.unwrap());
    created(hosts.create_pruning(later, &dual_attrs(1), LONG_TTL, &[]).await.unwrap());
    // The first key is rewritten last: by mod revision it is now the later one.
    let renewed = match hosts.renew(&held, &dual_attrs(2), LONG_TTL).await.unwrap() {
        weft::lease::store::RenewOutcome::Renewed(r) => r,
        other => panic!("expected Renewed, got {other:?}"),
    };
    let listing = hosts.list().await.unwrap();
    let revs: Vec<(Subnet, i64, i64)> =
        listing.leases.iter().map(|l| (l.subnet, l.create_revision.0, l.mod_revision.0)).collect();
    assert!(
        revs[0].1 > revs[1].1 && revs[0].2 < revs[1].2,
        "10.244.1.0/24 created after and written before 10.244.2.0/24: {revs:?}"
    );
    assert_eq!(revs[1].2, renewed.mod_revision.0);

    let config = br#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;
    let w = Watcher::start_on(&etcd, &prefix, config).await;
    w.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
    let carrier = |w: &Watcher| {
        w.routes.load().lookup6("fd00:10:244:1::9".parse().unwrap()).map(|(p, _)| p.public_ip)
    };
    assert_eq!(carrier(&w), Some(Ipv4Addr::new(192, 0, 2, 2)), "the key created first");
    let text = w.metrics();
    assert!(text.contains("weft_route_ipv6_half_conflicts 1\n"), "{text}");
    // `weft lease list` tells the operator the same, by the same rule.
    hosts.set_config(config).await.unwrap();
    let conflicts = || {
        let list = lease_list_json(&etcd.endpoint(), &prefix);
        let keys: Vec<String> = list["ipv6_half_conflicts"]
            .as_array()
            .expect("ipv6_half_conflicts")
            .iter()
            .map(|c| c["key"].as_str().unwrap_or_default().to_owned())
            .collect();
        keys
    };
    assert_eq!(conflicts(), ["subnets/10.244.1.0-24&fd00:10:244:1::-64"]);

    // The first key goes: the other key carries the half now, and nothing conflicts.
    assert_eq!(hosts.release(&renewed, &node(2)).await.unwrap(), ReleaseOutcome::Released);
    w.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
    let deadline = Instant::now() + PROMPTLY;
    while carrier(&w) != Some(Ipv4Addr::new(192, 0, 2, 1)) {
        assert!(Instant::now() < deadline, "the half did not move to the remaining key");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = w.metrics();
    assert!(text.contains("weft_route_ipv6_half_conflicts 0\n"), "{text}");
    assert!(conflicts().is_empty());
}

/// The value of `name` in the watcher's metrics text.
fn gauge(w: &Watcher, name: &str) -> Option<u64> {
    w.metrics().lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until the gauge `name` reads `want`, or panics after `within`.
async fn expect_gauge(w: &Watcher, name: &str, want: u64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let have = gauge(w, name);
        if have == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "within {within:?}: {name} want {want}, have {have:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Keys under `subnets/` that are no lease (300 names that do not parse, a dual-stack name
/// whose value is garbage, another network's subnet), put and then deleted (one by one, and
/// the rest by one range delete, which etcd delivers as many deletes at one revision): the
/// gauge follows the store, 302 then 0, and a key put again is counted again. Before, a
/// delete of a name that does not parse came as a "bad entry" and was ignored anew: the gauge
/// stayed at the number ever put, and the watcher's memory grew with every key.
#[tokio::test]
async fn deleted_junk_keys_are_forgotten_and_a_key_put_again_counts_again() {
    const GAUGE: &str = "weft_route_ignored_keys";
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let hosts = store(&etcd, &prefix).await;
    hosts.create(subnet("10.244.1.0/24"), &attrs(1), LONG_TTL).await.unwrap();
    let w = Watcher::start(&etcd, &prefix).await;
    w.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
    let mut raw = etcd.client().await;
    let junk = |i: u32| format!("{prefix}/subnets/junk-{i:03}");
    for i in 0..300 {
        raw.put(junk(i), "x", None).await.expect("put junk");
    }
    let garbage = format!("{prefix}/subnets/10.244.7.0-24&fd00:10:244:7::-64");
    raw.put(garbage.as_str(), "not json", None).await.expect("put garbage");
    let foreign = format!("{prefix}/subnets/10.9.0.0-24");
    raw.put(foreign.as_str(), attrs(9).to_json(), None).await.expect("put foreign");
    expect_gauge(&w, GAUGE, 302, PROMPTLY).await;

    for i in 0..100 {
        raw.delete(junk(i), None).await.expect("delete junk");
    }
    expect_gauge(&w, GAUGE, 202, PROMPTLY).await;
    let rest = etcd_client::DeleteOptions::new().with_prefix();
    let deleted = raw.delete(format!("{prefix}/subnets/junk-"), Some(rest)).await.expect("delete");
    assert_eq!(deleted.deleted(), 200);
    raw.delete(garbage.as_str(), None).await.expect("delete garbage");
    raw.delete(foreign.as_str(), None).await.expect("delete foreign");
    expect_gauge(&w, GAUGE, 0, PROMPTLY).await;

    // Put again: counted again.
    raw.put(junk(7), "x", None).await.expect("put junk again");
    expect_gauge(&w, GAUGE, 1, PROMPTLY).await;
    w.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
    // All from the watch: nothing was re-listed, no watch broke.
    assert_eq!(gauge(&w, "weft_route_relists_total"), Some(0));
    assert_eq!(gauge(&w, "weft_route_watch_errors_total"), Some(0));
}
