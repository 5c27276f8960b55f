//! The route watcher against a real etcd: a delete is told apart (relinquish or revoke: the
//! route goes; expiry: it stays, stale) by one read of the subnet's history record as of the
//! delete's revision, never by a re-list of every lease (issue 8: N watchers re-listing on
//! every delete is O(N²) keys read). And [`Store::get_history`]'s contract on etcd: a read as
//! of a past revision sees that revision; a compacted one is [`StoreError::Compacted`].
//!
//! Each test starts its own etcd and works under its own prefix.

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::etcd::{EtcdServer, unique_prefix};
use tokio::sync::watch;
use weft::config::NetworkConfig;
use weft::lease::etcd::{EtcdOptions, EtcdStore};
use weft::lease::record::{HistoryState, Incarnation, LeaseAttrs, NodeId, Revision, Subnet};
use weft::lease::store::{
    CreateOutcome, HeldLease, HistoryPrune, ReleaseOutcome, Store, StoreError,
};
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
    _own: watch::Sender<Option<Subnet>>,
}

impl Watcher {
    async fn start(etcd: &EtcdServer, prefix: &str) -> Self {
        let network =
            NetworkConfig::parse(br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#)
                .expect("network config");
        let routes =
            Arc::new(Routes::new(RouteTable::build(network.network, network.subnet_len, [])));
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
    assert!(text.contains("weft_route_history_reads_total 3\n"), "{text}");
    assert!(text.contains("weft_route_watch_errors_total 0\n"), "{text}");
    assert!(text.contains("weft_routes_stale 1\n"), "{text}");
    assert_eq!(w.stats.relists.load(Ordering::Relaxed), 0);

    // A new holder of the expired subnet replaces the stale route.
    hosts.create(subnet("10.244.3.0/24"), &attrs(5), LONG_TTL).await.unwrap();
    w.expect(PROMPTLY, &[("10.244.3.0/24", 5, false), ("10.244.4.0/24", 4, false)]).await;
}

#[tokio::test]
async fn a_history_read_as_of_the_delete_sees_the_delete_until_it_is_compacted() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let a = store(&etcd, &prefix).await;
    let (s, t) = (subnet("10.244.3.0/24"), subnet("10.244.4.0/24"));
    let held = created(a.create(s, &attrs(1), LONG_TTL).await.unwrap());
    assert_eq!(a.get_history(s, Revision(held.mod_revision.0 - 1)).await.unwrap(), None);
    assert_eq!(a.release(&held, &node(1)).await.unwrap(), ReleaseOutcome::Released);
    let now = a.get_history(s, Revision(0)).await.unwrap().unwrap().unwrap();
    let released = now.mod_revision;
    assert_eq!(now.record.state, HistoryState::Relinquished);
    assert!(released > held.mod_revision);

    // The same node takes another subnet, pruning its record of `s`; another node takes `s`.
    let prune = [HistoryPrune { subnet: s, mod_revision: released }];
    created(a.create_pruning(t, &attrs(1), LONG_TTL, &prune).await.unwrap());
    assert_eq!(a.get_history(s, Revision(0)).await.unwrap(), None, "pruned");
    created(a.create(s, &attrs(2), LONG_TTL).await.unwrap());
    let later = a.get_history(s, Revision(0)).await.unwrap().unwrap().unwrap();
    assert_eq!(later.record.state, HistoryState::Held);
    // As of the release, the release is what the record says.
    let then = a.get_history(s, released).await.unwrap().unwrap().unwrap();
    assert_eq!(then, now);

    // Compacted past it: the read says so (the watcher then re-lists).
    let mut raw = etcd.client().await;
    raw.compact(later.mod_revision.0, None).await.expect("compact");
    match a.get_history(s, released).await {
        Err(StoreError::Compacted { .. }) => {}
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert_eq!(a.get_history(s, later.mod_revision).await.unwrap().unwrap().unwrap(), later);
}
