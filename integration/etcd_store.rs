//! `EtcdStore` against a real etcd: the store contract (compare-and-swap on every subnet write,
//! one-revision listings, watches, presence) and the failure kinds a driver relies on
//! (unreachable, stopped, compacted, refused credentials).
//!
//! Each test starts its own etcd (tests run in parallel; a server starts in well under a second)
//! and works under its own prefix.

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use futures::StreamExt;
use support::etcd::{EtcdCluster, EtcdServer, TlsFiles, closed_port, unique_prefix};
use weft::lease::etcd::{EtcdOptions, EtcdStore};
use weft::lease::memory::{MemoryStore, drain_ready};
use weft::lease::record::{
    HistoryState, Incarnation, Ipv6Subnet, LeaseAttrs, LeaseName, NodeId, Revision, StoreLeaseId,
    StoredLease, Subnet,
};
use weft::lease::store::{
    BadEntry, CreateOutcome, LeaseFeed, Listing, PresenceOutcome, PresenceRecord, ReleaseOutcome,
    RenewOutcome, Store, StoreError, WatchEvent, WatchStream,
};
use weft::time::ManualClock;

const CALL_TIMEOUT: Duration = Duration::from_secs(2);
const LONG_TTL: Duration = Duration::from_secs(60);
/// etcd's smallest lease TTL with default raft timing (1.5 election timeouts, rounded up).
const SHORT_TTL: Duration = Duration::from_secs(2);

fn options(endpoints: Vec<String>, prefix: &str) -> EtcdOptions {
    EtcdOptions {
        endpoints,
        prefix: prefix.to_owned(),
        call_timeout: CALL_TIMEOUT,
        ..EtcdOptions::default()
    }
}

async fn store(etcd: &EtcdServer, prefix: &str) -> EtcdStore {
    EtcdStore::connect(options(vec![etcd.endpoint()], prefix))
        .await
        .expect("connect to the test etcd")
}

fn subnet(text: &str) -> Subnet {
    text.parse().expect("test subnet")
}

fn node(name: &str) -> NodeId {
    NodeId::parse(name).expect("test node id")
}

fn attrs(node_name: &str, incarnation: &str, ip: [u8; 4]) -> LeaseAttrs {
    LeaseAttrs {
        public_ip: Ipv4Addr::from(ip),
        public_ipv6: None,
        backend_type: Some("vxlan".to_owned()),
        backend_data: Some(serde_json::json!({"VNI": 1, "VtepMAC": "02:00:00:00:00:01"})),
        backend_v6_data: None,
        node_id: Some(node(node_name)),
        incarnation: Some(Incarnation::parse(incarnation).expect("test incarnation")),
    }
}

fn created(outcome: CreateOutcome) -> weft::lease::store::HeldLease {
    match outcome {
        CreateOutcome::Created(held) => held,
        other => panic!("expected Created, got {other:?}"),
    }
}

/// Collects watch events until `done` says so, or panics at the deadline.
async fn watch_until(
    watch: &mut WatchStream,
    deadline: Duration,
    mut done: impl FnMut(&WatchEvent) -> bool,
) -> Vec<WatchEvent> {
    let mut seen = Vec::new();
    let result = tokio::time::timeout(deadline, async {
        while let Some(batch) = watch.next().await {
            let batch = batch.expect("watch batch");
            for event in batch.events {
                let stop = done(&event);
                seen.push(event);
                if stop {
                    return;
                }
            }
        }
        panic!("watch ended early");
    })
    .await;
    assert!(result.is_ok(), "watch deadline passed; saw {seen:?}");
    seen
}

#[tokio::test]
async fn create_race_between_two_clients_has_exactly_one_winner() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let (a, b) = (store(&etcd, &prefix).await, store(&etcd, &prefix).await);
    let (attrs_a, attrs_b) = (
        attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]),
        attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 2]),
    );
    // Several rounds: a single round could be decided by who got scheduled first.
    for i in 0..10 {
        let s = subnet(&format!("10.244.{i}.0/24"));
        let (ra, rb) =
            tokio::join!(a.create(s, &attrs_a, LONG_TTL), b.create(s, &attrs_b, LONG_TTL));
        let (ra, rb) = (ra.expect("create a"), rb.expect("create b"));
        let (winner_attrs, held, loser) = match (ra, rb) {
            (CreateOutcome::Created(held), loser) => (&attrs_a, held, loser),
            (loser, CreateOutcome::Created(held)) => (&attrs_b, held, loser),
            (x, y) => panic!("round {i}: nobody won: {x:?} / {y:?}"),
        };
        match loser {
            CreateOutcome::Exists(Some(current)) => {
                assert_eq!(&current.attrs, winner_attrs, "round {i}");
                assert_eq!(current.mod_revision, held.mod_revision);
                assert_eq!(current.lease_id, held.lease_id);
            }
            other => panic!("round {i}: two winners or unreadable: {other:?}"),
        }
        let stored = a.get(s).await.expect("get").expect("present").expect("parses");
        assert_eq!(&stored.attrs, winner_attrs);
    }
}

/// flannel's dual-stack nodes write `X&Y` where an IPv4-only node writes `X`: either way, one
/// subnet has one key. Races between the two forms have one winner too; renew, release and
/// revoke write the exact key, and history keeps the IPv6 half.
#[tokio::test]
async fn a_subnet_has_one_key_whichever_form_each_create_writes() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let (a, b) = (store(&etcd, &prefix).await, store(&etcd, &prefix).await);
    let (attrs_a, attrs_b) = (
        attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]),
        attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 2]),
    );
    let half = |i: u32| -> Ipv6Subnet { format!("fd00:0:0:{i:x}::/64").parse().expect("half") };
    for i in 1..=6u32 {
        let s = subnet(&format!("10.244.{i}.0/24"));
        let (dual, other_dual) = (
            LeaseName { subnet: s, ipv6: Some(half(i)) },
            LeaseName { subnet: s, ipv6: Some(half(100 + i)) },
        );
        // Rounds alternate: dual against IPv4-only, dual against another dual pairing.
        let rival = if i % 2 == 1 { LeaseName::single(s) } else { other_dual };
        let (ra, rb) = tokio::join!(
            a.create_pruning(dual, &attrs_a, LONG_TTL, &[]),
            b.create_pruning(rival, &attrs_b, LONG_TTL, &[])
        );
        let (ra, rb) = (ra.expect("create a"), rb.expect("create b"));
        let (winner, held, loser) = match (ra, rb) {
            (CreateOutcome::Created(held), loser) => (dual, held, loser),
            (loser, CreateOutcome::Created(held)) => (rival, held, loser),
            (x, y) => panic!("round {i}: nobody won: {x:?} / {y:?}"),
        };
        assert_eq!(held.name(), winner, "round {i}");
        match loser {
            CreateOutcome::Exists(Some(current)) => assert_eq!(current.name(), winner, "round {i}"),
            other => panic!("round {i}: two winners or unreadable: {other:?}"),
        }
        let keys: Vec<String> = a
            .list()
            .await
            .expect("list")
            .leases
            .iter()
            .filter(|l| l.subnet == s)
            .map(|l| l.name().key_name())
            .collect();
        assert_eq!(keys, [winner.key_name()], "round {i}: one key per subnet");
        // get finds the key by its IPv4 subnet, in whichever form it is.
        let got = b.get(s).await.expect("get").expect("present").expect("parses");
        assert_eq!(got.name(), winner);
    }

    // Renew, refresh and release write the exact dual-stack key; history keeps the half.
    let s = subnet("10.244.20.0/24");
    let dual = LeaseName { subnet: s, ipv6: Some(half(0x20)) };
    let held = created(a.create_pruning(dual, &attrs_a, LONG_TTL, &[]).await.expect("create"));
    let history_half = |listing: &Listing| {
        listing.history.iter().find(|h| h.subnet == s).map(|h| (h.record.state, h.record.ipv6))
    };
    let RenewOutcome::Renewed(held) = a.renew(&held, &attrs_a, LONG_TTL).await.expect("renew")
    else {
        panic!("renew of the dual-stack key failed")
    };
    assert_eq!(held.name(), dual);
    let RenewOutcome::Renewed(held) = a.refresh(&held, &attrs_a).await.expect("refresh") else {
        panic!("refresh of the dual-stack key failed")
    };
    let listing = a.list().await.expect("list");
    assert_eq!(history_half(&listing), Some((HistoryState::Held, Some(half(0x20)))));
    assert_eq!(
        a.release(&held, &node("node-aaaa")).await.expect("release"),
        ReleaseOutcome::Released
    );
    let listing = a.list().await.expect("list");
    assert!(listing.leases.iter().all(|l| l.subnet != s), "released key still there");
    assert_eq!(history_half(&listing), Some((HistoryState::Relinquished, Some(half(0x20)))));

    // An operator's revoke names the IPv4 subnet and deletes the dual-stack key.
    created(b.create_pruning(dual, &attrs_b, LONG_TTL, &[]).await.expect("create again"));
    assert!(a.revoke(s).await.expect("revoke"));
    let listing = a.list().await.expect("list");
    assert!(listing.leases.iter().all(|l| l.subnet != s), "revoked key still there");
    assert_eq!(history_half(&listing), Some((HistoryState::Revoked, Some(half(0x20)))));
    assert!(!a.revoke(s).await.expect("revoke again"));
}

#[tokio::test]
async fn renew_with_a_stale_revision_reports_the_change_and_writes_nothing() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.3.0/24");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let first = created(store.create(s, &mine, LONG_TTL).await.expect("create"));

    let second = match store.renew(&first, &mine, LONG_TTL).await.expect("renew") {
        RenewOutcome::Renewed(held) => held,
        other => panic!("expected Renewed, got {other:?}"),
    };
    assert!(second.mod_revision > first.mod_revision);
    assert_ne!(second.lease_id, first.lease_id);

    // Renewing from the stale handle must fail its compare and leave the key alone.
    let other = attrs("node-aaaa", "inc-bbbb", [192, 0, 2, 9]);
    match store.renew(&first, &other, LONG_TTL).await.expect("stale renew") {
        RenewOutcome::Changed(Some(current)) => {
            assert_eq!(current.mod_revision, second.mod_revision);
            assert_eq!(current.attrs, mine);
        }
        other => panic!("expected Changed(Some), got {other:?}"),
    }
    let now = store.get(s).await.expect("get").expect("present").expect("parses");
    assert_eq!(now.mod_revision, second.mod_revision, "the stale renew wrote");
    assert_eq!(now.lease_id, second.lease_id);
    assert_eq!(now.attrs, mine);

    // A renew of a deleted key reports it absent.
    assert!(store.revoke(s).await.expect("revoke"));
    assert!(!store.revoke(s).await.expect("revoke again"));
    assert_eq!(
        store.renew(&second, &mine, LONG_TTL).await.expect("renew gone"),
        RenewOutcome::Changed(None)
    );
    assert!(store.get(s).await.expect("get").is_none(), "renew recreated the key");
}

#[tokio::test]
async fn renew_moves_the_key_to_a_new_lease_and_the_old_ttl_passing_keeps_it() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.4.0/24");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let first = created(store.create(s, &mine, SHORT_TTL).await.expect("create"));
    let second = match store.renew(&first, &mine, LONG_TTL).await.expect("renew") {
        RenewOutcome::Renewed(held) => held,
        other => panic!("expected Renewed, got {other:?}"),
    };
    // Well past the first lease's TTL (and etcd's 500 ms expiry sweep).
    tokio::time::sleep(SHORT_TTL + Duration::from_millis(1500)).await;
    let now = store.get(s).await.expect("get").expect("still present").expect("parses");
    assert_eq!(now.lease_id, second.lease_id);
    assert_eq!(now.mod_revision, second.mod_revision);

    // The old lease was revoked, not left to expire.
    let mut raw = etcd.client().await;
    let ttl = raw.lease_time_to_live(first.lease_id.0, None).await.expect("ttl");
    assert_eq!(ttl.ttl(), -1, "old lease still exists");
}

#[tokio::test]
async fn refresh_keeps_the_key_alive_without_rewriting_it_and_moves_its_history_record() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.5.0/24");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let held = created(store.create(s, &mine, SHORT_TTL).await.expect("create"));
    let record_at = |l: &weft::lease::store::Listing| {
        l.history.iter().find(|h| h.subnet == s).expect("a history record").mod_revision
    };
    let first_record = record_at(&store.list().await.expect("list"));
    let watch = store
        .watch(Revision(held.mod_revision.0 + 1), Some(LeaseName::single(s)))
        .await
        .expect("watch");

    // Refresh every half TTL for three TTLs: the key outlives its TTL, never rewritten.
    for _ in 0..6 {
        tokio::time::sleep(SHORT_TTL / 2).await;
        let r = store.refresh(&held, &mine).await.expect("refresh");
        assert_eq!(r, RenewOutcome::Renewed(held));
    }
    let now = store.get(s).await.expect("get").expect("still present").expect("parses");
    assert_eq!((now.mod_revision, now.lease_id), (held.mod_revision, held.lease_id));
    assert!(record_at(&store.list().await.expect("list")) > first_record);
    // The key's watch saw nothing: no route watcher anywhere wakes for a renewal.
    let (items, _) = drain_now(watch).await;
    assert!(items.is_empty(), "a refresh wrote the key: {items:?}");

    // Left alone, it expires; a refresh then reports it gone and writes nothing.
    tokio::time::sleep(SHORT_TTL + Duration::from_millis(1500)).await;
    assert_eq!(store.refresh(&held, &mine).await.expect("refresh"), RenewOutcome::Changed(None));
    assert!(store.get(s).await.expect("get").is_none(), "refresh recreated the key");

    // A key someone else wrote since is reported, never kept alive for us.
    let theirs = attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 2]);
    let other = created(store.create(s, &theirs, LONG_TTL).await.expect("create"));
    match store.refresh(&held, &mine).await.expect("refresh") {
        RenewOutcome::Changed(Some(current)) => {
            assert_eq!(current.attrs, theirs);
            assert_eq!(current.mod_revision, other.mod_revision);
        }
        r => panic!("expected Changed(Some), got {r:?}"),
    }
}

/// What a watch has delivered within 300 ms.
async fn drain_now(
    mut w: weft::lease::store::WatchStream,
) -> (Vec<weft::lease::store::WatchBatch>, bool) {
    let mut items = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_millis(300), w.next()).await {
            Ok(Some(Ok(b))) => items.push(b),
            Ok(Some(Err(_)) | None) => return (items, true),
            Err(_) => return (items, false),
        }
    }
}

#[tokio::test]
async fn expiry_deletes_the_key_and_a_watch_sees_the_delete() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.5.0/24");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let held = created(store.create(s, &mine, SHORT_TTL).await.expect("create"));
    let mut own = store
        .watch(Revision(held.mod_revision.0), Some(LeaseName::single(s)))
        .await
        .expect("watch own key");
    let started = Instant::now();
    let events =
        watch_until(&mut own, Duration::from_secs(8), |e| matches!(e, WatchEvent::Delete { .. }))
            .await;
    // The watch starts at the create itself: it sees the put, then the expiry.
    assert!(matches!(&events[0], WatchEvent::Put(l) if l.attrs == mine), "{events:?}");
    match events.last() {
        Some(WatchEvent::Delete { subnet, revision }) => {
            assert_eq!(*subnet, s);
            assert!(*revision > held.mod_revision);
        }
        other => panic!("expected Delete, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_secs(1), "deleted before its TTL");
    assert!(store.get(s).await.expect("get").is_none());

    // History still says Held, at the revision of our last write: "expired after that".
    let listing = store.list().await.expect("list");
    assert!(listing.leases.is_empty());
    assert_eq!(listing.history.len(), 1);
    let h = &listing.history[0];
    assert_eq!((h.subnet, h.record.state), (s, HistoryState::Held));
    assert_eq!(h.mod_revision, held.mod_revision);
}

#[tokio::test]
async fn release_deletes_at_once_and_records_relinquished() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.6.0/24");
    let me = node("node-aaaa");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 7]);
    let held = created(store.create(s, &mine, LONG_TTL).await.expect("create"));

    assert_eq!(store.release(&held, &me).await.expect("release"), ReleaseOutcome::Released);
    assert!(store.get(s).await.expect("get").is_none(), "key outlived release");
    let listing = store.list().await.expect("list");
    let h = listing.history.iter().find(|h| h.subnet == s).expect("history");
    assert_eq!(h.record.state, HistoryState::Relinquished);
    assert_eq!(h.record.node, me);
    assert_eq!(h.record.public_ip, Ipv4Addr::new(192, 0, 2, 7));
    assert!(h.mod_revision > held.mod_revision);
    // The lease went with it.
    let mut raw = etcd.client().await;
    let ttl = raw.lease_time_to_live(held.lease_id.0, None).await.expect("ttl");
    assert_eq!(ttl.ttl(), -1);

    // Releasing again, or releasing a key someone rewrote, writes nothing.
    assert_eq!(store.release(&held, &me).await.expect("again"), ReleaseOutcome::NotOurs);
    let theirs = attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 8]);
    created(store.create(s, &theirs, LONG_TTL).await.expect("create b"));
    assert_eq!(store.release(&held, &me).await.expect("stale"), ReleaseOutcome::NotOurs);
    let now = store.get(s).await.expect("get").expect("present").expect("parses");
    assert_eq!(now.attrs, theirs);
}

#[tokio::test]
async fn revoke_deletes_whoever_holds_it_and_records_revoked() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.9.0/24");
    let held = created(
        store.create(s, &attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 9]), LONG_TTL).await.unwrap(),
    );
    assert!(store.revoke(s).await.expect("revoke"));
    assert!(store.get(s).await.expect("get").is_none());
    let listing = store.list().await.expect("list");
    let h = listing.history.iter().find(|h| h.subnet == s).expect("history");
    assert_eq!(h.record.state, HistoryState::Revoked);
    assert_eq!(h.record.node, node("node-aaaa"));
    assert!(h.mod_revision > held.mod_revision);
    assert!(!store.revoke(s).await.expect("revoke again"), "nothing left to revoke");
}

#[tokio::test]
async fn list_reads_one_revision_and_skips_garbage() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let store = store(&etcd, &prefix).await;
    let good = [subnet("10.244.1.0/24"), subnet("10.244.2.0/24")];
    for (i, s) in good.iter().enumerate() {
        let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1 + i as u8]);
        created(store.create(*s, &a, LONG_TTL).await.expect("create"));
    }
    // What other tools, hands or bugs may leave behind.
    let valid = br#"{"PublicIP":"192.0.2.50","PublicIPv6":null}"#.to_vec();
    let garbage: [(String, Vec<u8>); 4] = [
        (format!("{prefix}/subnets/10.244.9.0-24"), b"not json".to_vec()),
        (format!("{prefix}/subnets/10.244.1.7-24"), valid.clone()),
        (format!("{prefix}/subnets/bogus"), valid.clone()),
        (format!("{prefix}/weft/history/10.244.9.0-24"), b"{}".to_vec()),
    ];
    let mut raw = etcd.client().await;
    let mut last_revision = 0;
    for (key, value) in &garbage {
        let resp = raw.put(key.as_str(), value.clone(), None).await.expect("put garbage");
        last_revision = resp.header().expect("header").revision();
    }
    // A sibling that flannel's prefix listing would catch, but weft's must not.
    raw.put(format!("{prefix}/subnetsX/10.244.8.0-24"), valid.clone(), None)
        .await
        .expect("put sibling");
    // A flannel-written lease (no weft identity) is a lease like any other.
    let flannel_key = format!("{prefix}/subnets/10.244.7.0-24");
    let resp = raw.put(flannel_key.as_str(), valid, None).await.expect("put flannel lease");
    last_revision = last_revision.max(resp.header().expect("header").revision());

    let listing = store.list().await.expect("list");
    // Nothing was written after the last put: the listing is at exactly that revision.
    assert_eq!(listing.revision, Revision(last_revision));
    let subnets: Vec<Subnet> = listing.leases.iter().map(|l| l.subnet).collect();
    assert_eq!(subnets, vec![good[0], good[1], subnet("10.244.7.0/24")]);
    assert!(listing.leases[2].attrs.node_id.is_none());
    assert_eq!(listing.leases[2].lease_id, StoreLeaseId(0), "a reservation has no lease");
    assert_eq!(listing.history.len(), 2);
    let mut skipped: Vec<&str> = listing.skipped.iter().map(|b| b.key.as_str()).collect();
    skipped.sort_unstable();
    let mut expected: Vec<&str> = garbage.iter().map(|(k, _)| k.as_str()).collect();
    expected.sort_unstable();
    assert_eq!(skipped, expected);
    for bad in &listing.skipped {
        assert!(!bad.problem.is_empty());
    }

    // A single get reports the unreadable value as such.
    match store.get(subnet("10.244.9.0/24")).await.expect("get garbage") {
        Some(Err(bad)) => assert!(bad.problem.contains("value"), "{bad:?}"),
        other => panic!("expected an unreadable entry, got {other:?}"),
    }

    // The listing is one snapshot: every entry is at or below its revision, and a watch from
    // revision + 1 sees exactly what came after.
    for l in &listing.leases {
        assert!(l.mod_revision <= listing.revision);
    }
    let mut watch = store.watch(Revision(listing.revision.0 + 1), None).await.expect("watch");
    let late = subnet("10.244.3.0/24");
    let a = attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 3]);
    created(store.create(late, &a, LONG_TTL).await.expect("create late"));
    raw.put(format!("{prefix}/subnets/10.244.4.0-24"), b"junk".to_vec(), None)
        .await
        .expect("put junk");
    let events =
        watch_until(&mut watch, Duration::from_secs(5), |e| matches!(e, WatchEvent::Bad(_))).await;
    assert!(
        matches!(&events[..], [WatchEvent::Put(l), WatchEvent::Bad(b)]
        if l.subnet == late && b.key.ends_with("10.244.4.0-24")),
        "{events:?}"
    );
}

/// The keeper's listing: the same leases and history as `list`, and the presence keys with the
/// revision each was created at (a beat rewrites a key but keeps it), read in the history's
/// range at the same revision. Departure markers and other keys between are not presence.
#[tokio::test]
async fn list_with_presence_adds_the_presence_keys_in_the_order_they_came() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let store = store(&etcd, &prefix).await;
    let presence = |inc: &str| PresenceRecord {
        incarnation: Incarnation::parse(inc).expect("inc"),
        public_ip: Ipv4Addr::new(192, 0, 2, 1),
        public_ipv6: None,
    };
    let claim = |n: &'static str, inc: &'static str| {
        let store = store.clone();
        async move {
            match store.claim_presence(&node(n), &presence(inc), LONG_TTL).await.expect("claim") {
                PresenceOutcome::Claimed(lease) => lease,
                other => panic!("{other:?}"),
            }
        }
    };
    let b = claim("node-bbbb", "inc-bbbb").await;
    let held = created(
        store
            .create(
                subnet("10.244.1.0/24"),
                &attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 2]),
                LONG_TTL,
            )
            .await
            .expect("create"),
    );
    claim("node-aaaa", "inc-aaaa").await;
    let gone = created(
        store
            .create(
                subnet("10.244.2.0/24"),
                &attrs("node-cccc", "inc-cccc", [192, 0, 2, 3]),
                LONG_TTL,
            )
            .await
            .expect("create"),
    );
    // A departure marker, and keys of no one's between history and presence.
    assert_eq!(
        store.release(&gone, &node("node-cccc")).await.expect("release"),
        ReleaseOutcome::Released
    );
    let mut raw = etcd.client().await;
    for key in ["weft/m", "weft/nodes-x", "weft/nodes/NOT-AN-ID", "weft/nodes0"] {
        raw.put(format!("{prefix}/{key}"), b"{}".to_vec(), None).await.expect("put");
    }
    // b beats: its key is rewritten, its create revision stays.
    assert!(store.keep_presence(&node("node-bbbb"), b, true).await.expect("beat"));

    let plain = store.list().await.expect("list");
    let listing = store.list_with_presence().await.expect("list with presence");
    assert!(plain.presence.is_empty());
    assert_eq!(listing.revision, plain.revision);
    assert_eq!(listing.leases, plain.leases);
    assert_eq!(listing.history, plain.history);
    assert_eq!(listing.skipped, plain.skipped);
    assert_eq!(listing.leases.len(), 1);
    assert_eq!(listing.leases[0].mod_revision, held.mod_revision);
    let nodes: Vec<&str> = listing.presence.iter().map(|p| p.node.as_str()).collect();
    assert_eq!(nodes, ["node-aaaa", "node-bbbb"], "in key order");
    let (a_rev, b_rev) = (listing.presence[0].create_revision, listing.presence[1].create_revision);
    assert!(b_rev < held.mod_revision && held.mod_revision < a_rev, "{b_rev:?} {a_rev:?}");
    let b_key = raw.get(format!("{prefix}/weft/nodes/node-bbbb"), None).await.expect("get");
    let kv = &b_key.kvs()[0];
    assert_eq!(Revision(kv.create_revision()), b_rev);
    assert!(kv.mod_revision() > kv.create_revision(), "the beat rewrote it");
}

#[tokio::test]
async fn a_watch_from_a_compacted_revision_reports_compacted() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let first =
        created(store.create(subnet("10.244.1.0/24"), &mine, LONG_TTL).await.expect("create"));
    let mut latest = first;
    for _ in 0..3 {
        latest = match store.renew(&latest, &mine, LONG_TTL).await.expect("renew") {
            RenewOutcome::Renewed(held) => held,
            other => panic!("{other:?}"),
        };
    }
    let mut raw = etcd.client().await;
    raw.compact(latest.mod_revision.0, None).await.expect("compact");

    let mut watch = store.watch(first.mod_revision, None).await.expect("watch");
    let item =
        tokio::time::timeout(Duration::from_secs(5), watch.next()).await.expect("watch answered");
    match item {
        Some(Err(StoreError::Compacted { requested, compact_revision })) => {
            assert_eq!(requested, first.mod_revision);
            assert_eq!(compact_revision, latest.mod_revision);
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(watch.next().await.is_none(), "the watch goes on after Compacted");

    // From the compaction point on, history is there.
    let mut watch = store.watch(latest.mod_revision, None).await.expect("watch");
    let events = watch_until(&mut watch, Duration::from_secs(5), |_| true).await;
    assert!(matches!(&events[0], WatchEvent::Put(l) if l.mod_revision == latest.mod_revision));
}

/// How many `LeaseKeepAlive` streams etcd has seen opened, from its own `/metrics`.
fn keep_alive_streams_opened(etcd: &EtcdServer) -> u64 {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], etcd.client_port()));
    let (status, body) = support::weft::http_get(addr, "/metrics");
    assert_eq!(status, 200, "etcd's /metrics: {body}");
    body.lines()
        .find(|l| {
            l.starts_with("grpc_server_started_total{")
                && l.contains("grpc_method=\"LeaseKeepAlive\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test]
async fn keep_alives_reuse_one_open_stream_and_a_broken_one_is_replaced_within_the_call() {
    let mut etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let store = store(&etcd, &prefix).await;
    let me = node("node-kept");
    let record = PresenceRecord {
        incarnation: Incarnation::parse("inc-kept").expect("inc"),
        public_ip: Ipv4Addr::new(192, 0, 2, 1),
        public_ipv6: None,
    };
    let PresenceOutcome::Claimed(lease) =
        store.claim_presence(&me, &record, LONG_TTL).await.expect("claim")
    else {
        panic!("claim refused");
    };
    let before = keep_alive_streams_opened(&etcd);
    for _ in 0..10 {
        assert!(store.keep_presence(&me, lease, false).await.expect("keep"));
    }
    // One stream for ten keep-alives; before, etcd-client opened one per keep-alive.
    assert_eq!(keep_alive_streams_opened(&etcd) - before, 1, "streams opened for 10 keep-alives");

    // The member restarts (leases survive it): the kept stream is broken, and the next
    // keep-alive opens a new one instead of failing or calling the lease gone.
    etcd.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.keep_presence(&me, lease, false).await {
            Ok(true) => break,
            Ok(false) => panic!("a live lease reported gone after a restart"),
            // The client's connection itself is re-made first.
            Err(e) => assert!(Instant::now() < deadline, "no keep-alive after the restart: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store.keep_presence(&me, lease, false).await.expect("keep on the new stream"));

    // A revoked lease is reported gone on the kept stream.
    etcd.client().await.lease_revoke(lease.0).await.expect("revoke");
    assert!(!store.keep_presence(&me, lease, false).await.expect("keep revoked"));
}

#[tokio::test]
async fn presence_is_claimed_held_expired_and_dropped() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let store = store(&etcd, &prefix).await;
    let me = node("node-aaaa");
    let first = PresenceRecord {
        incarnation: Incarnation::parse("inc-first").expect("inc"),
        public_ip: Ipv4Addr::new(192, 0, 2, 1),
        public_ipv6: None,
    };
    let second = PresenceRecord {
        incarnation: Incarnation::parse("inc-second").expect("inc"),
        public_ip: Ipv4Addr::new(192, 0, 2, 1),
        public_ipv6: None,
    };

    let PresenceOutcome::Claimed(lease1) =
        store.claim_presence(&me, &first, SHORT_TTL).await.expect("claim")
    else {
        panic!("first claim refused");
    };
    // A second process of the same node finds the first alive.
    let held_by = |o: PresenceOutcome| match o {
        PresenceOutcome::HeldBy { record, mod_revision } => (record, mod_revision),
        other => panic!("expected HeldBy, got {other:?}"),
    };
    let (record, _) =
        held_by(store.claim_presence(&me, &second, SHORT_TTL).await.expect("claim 2"));
    assert_eq!(record, first);
    // The first process claiming again (a retry) moves to a new lease, revoking the old one.
    let PresenceOutcome::Claimed(lease2) =
        store.claim_presence(&me, &first, SHORT_TTL).await.expect("reclaim")
    else {
        panic!("our own claim refused");
    };
    assert_ne!(lease1, lease2);
    assert!(!store.keep_presence(&me, lease1, false).await.expect("keep old"));
    assert!(!store.keep_presence(&me, lease1, true).await.expect("beat on the old lease"));
    // A keep-alive leaves the key as it is; a beat moves its mod revision, value and lease kept.
    let (_, before) = held_by(store.claim_presence(&me, &second, SHORT_TTL).await.expect("claim"));
    assert!(store.keep_presence(&me, lease2, false).await.expect("keep new"));
    let (_, kept) = held_by(store.claim_presence(&me, &second, SHORT_TTL).await.expect("claim"));
    assert_eq!(kept, before);
    assert!(store.keep_presence(&me, lease2, true).await.expect("beat"));
    let (record, beat) =
        held_by(store.claim_presence(&me, &second, SHORT_TTL).await.expect("claim"));
    assert_eq!(record, first);
    assert!(beat > before, "{beat:?} after {before:?}");
    assert!(store.keep_presence(&me, lease2, false).await.expect("still on its lease"));

    // Without keep-alives it expires, and the second process gets in.
    tokio::time::sleep(SHORT_TTL + Duration::from_millis(1500)).await;
    assert!(!store.keep_presence(&me, lease2, false).await.expect("keep expired"));
    let PresenceOutcome::Claimed(lease3) =
        store.claim_presence(&me, &second, LONG_TTL).await.expect("claim after expiry")
    else {
        panic!("claim after expiry refused");
    };

    // Dropping with someone else's lease deletes nothing; with ours, it frees the key at once.
    store.drop_presence(&me, lease2).await.expect("drop stale");
    let (record, _) = held_by(store.claim_presence(&me, &first, LONG_TTL).await.expect("claim"));
    assert_eq!(record, second);
    store.drop_presence(&me, lease3).await.expect("drop");
    assert!(matches!(
        store.claim_presence(&me, &first, LONG_TTL).await.expect("claim after drop"),
        PresenceOutcome::Claimed(_)
    ));

    // An unreadable presence value names no process: it is replaced.
    let other = node("node-bbbb");
    let mut raw = etcd.client().await;
    raw.put(format!("{prefix}/weft/nodes/node-bbbb"), b"??".to_vec(), None)
        .await
        .expect("put garbage");
    assert!(matches!(
        store.claim_presence(&other, &first, LONG_TTL).await.expect("claim over garbage"),
        PresenceOutcome::Claimed(_)
    ));
    let resp = raw
        .get(format!("{prefix}/weft/nodes/"), Some(GetOptions::new().with_prefix()))
        .await
        .expect("get nodes");
    assert_eq!(resp.kvs().len(), 2);
}

#[tokio::test]
async fn an_unreachable_endpoint_fails_calls_quickly() {
    let port = closed_port();
    let started = Instant::now();
    let store = EtcdStore::connect(options(vec![format!("http://127.0.0.1:{port}")], "/x"))
        .await
        .expect("connect is lazy");
    let s = subnet("10.244.1.0/24");
    let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    for result in [
        store.list().await.map(|_| ()),
        store.create(s, &a, LONG_TTL).await.map(|_| ()),
        store.watch(Revision(1), None).await.map(|_| ()),
    ] {
        match result {
            Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) => {}
            other => panic!("expected Unavailable or Timeout, got {:?}", other.err()),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "three calls took {:?}",
        started.elapsed()
    );
    let one = Instant::now();
    assert!(store.list().await.is_err());
    assert!(one.elapsed() < Duration::from_secs(5), "one call took {:?}", one.elapsed());
}

#[tokio::test]
async fn a_stopped_etcd_times_calls_out_and_they_recover_after() {
    let etcd = EtcdServer::start();
    let store = store(&etcd, &unique_prefix()).await;
    let s = subnet("10.244.1.0/24");
    let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let held = created(store.create(s, &a, LONG_TTL).await.expect("create"));
    let mut watch = store.watch(Revision(held.mod_revision.0 + 1), None).await.expect("watch");

    etcd.pause();
    let started = Instant::now();
    let result = store.renew(&held, &a, LONG_TTL).await;
    let elapsed = started.elapsed();
    etcd.resume();
    assert!(matches!(result, Err(StoreError::Timeout(_))), "got {result:?}");
    assert!(elapsed < CALL_TIMEOUT + Duration::from_secs(2), "took {elapsed:?}");

    // The same client works again once etcd does; the watch kept its place.
    let renewed = match store.renew(&held, &a, LONG_TTL).await.expect("renew after") {
        RenewOutcome::Renewed(h) => h,
        other => panic!("{other:?}"),
    };
    let events = watch_until(&mut watch, Duration::from_secs(5), |_| true).await;
    assert!(matches!(&events[0], WatchEvent::Put(l) if l.mod_revision == renewed.mod_revision));
}

#[tokio::test]
async fn password_auth_is_used_and_refusals_are_auth_errors() {
    let etcd = EtcdServer::start();
    let mut raw = etcd.client().await;
    raw.user_add("root", "rootpw", None).await.expect("add root");
    raw.user_grant_role("root", "root").await.expect("grant root");
    raw.auth_enable().await.expect("enable auth");
    let prefix = unique_prefix();

    let with = EtcdStore::connect(EtcdOptions {
        username: Some("root".into()),
        password: Some("rootpw".into()),
        ..options(vec![etcd.endpoint()], &prefix)
    })
    .await
    .expect("connect with credentials");
    with.set_config(br#"{"Network":"10.244.0.0/16"}"#).await.expect("write");
    assert!(with.config().await.expect("read").is_some());
    let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    created(with.create(subnet("10.244.1.0/24"), &a, LONG_TTL).await.expect("create"));
    assert_eq!(with.list().await.expect("list").leases.len(), 1);

    let without = store(&etcd, &prefix).await;
    let result = without.list().await;
    assert!(matches!(result, Err(StoreError::Auth(_))), "got {result:?}");
    assert!(!result.unwrap_err().is_transient());

    let wrong = EtcdStore::connect(EtcdOptions {
        username: Some("root".into()),
        password: Some("nope".into()),
        ..options(vec![etcd.endpoint()], &prefix)
    })
    .await;
    assert!(matches!(wrong, Err(StoreError::Auth(_))), "got {:?}", wrong.err());
}

#[tokio::test]
async fn credentials_for_an_etcd_without_auth_are_not_an_error() {
    // flannel (the Go client) accepts this; a fleet moving to auth passes credentials first.
    let etcd = EtcdServer::start();
    let store = EtcdStore::connect(EtcdOptions {
        username: Some("root".into()),
        password: Some("rootpw".into()),
        ..options(vec![etcd.endpoint()], &unique_prefix())
    })
    .await
    .expect("connect");
    assert!(store.list().await.expect("list").leases.is_empty());
}

#[tokio::test]
async fn unreadable_tls_files_are_setup_errors_naming_the_path() {
    let missing = std::path::PathBuf::from("/nonexistent/weft-test/ca.pem");
    let result = EtcdStore::connect(EtcdOptions {
        ca_file: Some(missing.clone()),
        ..options(vec!["https://127.0.0.1:1".to_owned()], "/x")
    })
    .await;
    match result {
        Err(StoreError::Setup(e)) => {
            assert!(e.to_string().contains("/nonexistent/weft-test/ca.pem"))
        }
        other => panic!("expected Setup, got {:?}", other.err()),
    }
    let result = EtcdStore::connect(EtcdOptions {
        cert_file: Some(missing),
        ..options(vec!["https://127.0.0.1:1".to_owned()], "/x")
    })
    .await;
    assert!(matches!(result, Err(StoreError::Setup(_))));
}

#[tokio::test]
async fn tls_with_a_client_certificate_works_and_a_wrong_ca_or_no_cert_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let files = TlsFiles::generate(dir.path());
    let etcd = EtcdServer::start_tls(&files);
    assert!(etcd.endpoint().starts_with("https://"));
    let prefix = unique_prefix();
    let tls = |ca: &std::path::Path, client_cert: bool| EtcdOptions {
        ca_file: Some(ca.to_owned()),
        cert_file: client_cert.then(|| files.client_cert.clone()),
        key_file: client_cert.then(|| files.client_key.clone()),
        ..options(vec![etcd.endpoint()], &prefix)
    };

    let store = EtcdStore::connect(tls(&files.ca, true)).await.expect("connect");
    let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    created(store.create(subnet("10.244.1.0/24"), &a, LONG_TTL).await.expect("create"));
    assert_eq!(store.list().await.expect("list").leases.len(), 1);

    // The server demands a client certificate; a server signed by another CA is not trusted.
    // Both fail the handshake, which the client sees as an unreachable store.
    for (what, opts) in
        [("no client cert", tls(&files.ca, false)), ("wrong CA", tls(&files.other_ca, true))]
    {
        let store = EtcdStore::connect(opts).await.expect("connect is lazy");
        let result = store.list().await;
        assert!(
            matches!(result, Err(StoreError::Unavailable(_) | StoreError::Timeout(_))),
            "{what}: got {result:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_survives_losing_its_leader() {
    let mut cluster = EtcdCluster::start();
    let store =
        EtcdStore::connect(options(cluster.endpoints(), &unique_prefix())).await.expect("connect");
    let s = subnet("10.244.1.0/24");
    let a = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let held = created(store.create(s, &a, LONG_TTL).await.expect("create"));

    let leader = cluster.leader_index().await.expect("a leader");
    cluster.kill_member(leader);
    // Calls routed to the dead member fail (transiently) until the balancer and the election
    // settle; a driver retries just like this.
    let deadline = Instant::now() + Duration::from_secs(15);
    let renewed = loop {
        match store.renew(&held, &a, LONG_TTL).await {
            Ok(RenewOutcome::Renewed(h)) => break h,
            Ok(other) => panic!("renew lost the key: {other:?}"),
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                assert!(Instant::now() < deadline, "no progress after leader loss: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let new_leader = cluster.leader_index().await.expect("a new leader");
    assert_ne!(new_leader, leader);

    cluster.restart_member(leader);
    // The client may still route a call to the member that is coming back: retry briefly.
    let deadline = Instant::now() + Duration::from_secs(10);
    let now = loop {
        match store.get(s).await {
            Ok(found) => break found.expect("present").expect("parses"),
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("get after the member restart: {e}"),
        }
    };
    assert_eq!(now.mod_revision, renewed.mod_revision);
}

#[tokio::test]
async fn a_create_prunes_the_history_it_supersedes_unless_rewritten_since() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let store = store(&etcd, &prefix).await;
    let me = node("node-aaaa");
    let mine = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]);
    let (s1, s2, s3) = (subnet("10.244.1.0/24"), subnet("10.244.2.0/24"), subnet("10.244.3.0/24"));
    // This node held s1, then s2 (both relinquished); another node has taken s2 since.
    let h1 = created(store.create(s1, &mine, LONG_TTL).await.expect("create s1"));
    assert_eq!(store.release(&h1, &me).await.expect("release"), ReleaseOutcome::Released);
    let h2 = created(store.create(s2, &mine, LONG_TTL).await.expect("create s2"));
    assert_eq!(store.release(&h2, &me).await.expect("release"), ReleaseOutcome::Released);
    let listed = store.list().await.expect("list");
    let old_s2 = listed.history.iter().find(|h| h.subnet == s2).expect("s2 history").mod_revision;
    created(
        store
            .create(s2, &attrs("node-bbbb", "inc-bbbb", [192, 0, 2, 2]), LONG_TTL)
            .await
            .expect("b"),
    );

    let listing = store.list().await.expect("list");
    let prune = weft::lease::policy::superseded_history(&listing, &me, s3);
    assert_eq!(prune.iter().map(|p| p.subnet).collect::<Vec<_>>(), [s1], "s2 is b's now");
    // A prune listed before b rewrote s2's record must not delete b's record.
    let stale = weft::lease::store::HistoryPrune { subnet: s2, mod_revision: old_s2 };
    let all: Vec<_> = prune.into_iter().chain([stale]).collect();
    created(
        store
            .create_pruning(LeaseName::single(s3), &mine, LONG_TTL, &all)
            .await
            .expect("create s3"),
    );

    let history = store.list().await.expect("list").history;
    let kept: Vec<(Subnet, String)> =
        history.iter().map(|h| (h.subnet, h.record.node.to_string())).collect();
    assert_eq!(kept, [(s2, "node-bbbb".to_owned()), (s3, "node-aaaa".to_owned())]);
}

/// The same keys in real etcd and in the simulation's memory store read back the same: the
/// same leases, the same skipped keys with the same problems, the same watch events. Both read
/// keys with one `KeyLayout`, so the simulation cannot drift from production (before, each
/// store had its own parser, with its own words for the same garbage).
#[tokio::test]
async fn the_memory_store_reads_every_key_as_etcd_does() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let real = store(&etcd, &prefix).await;
    let sim = MemoryStore::new(Arc::new(ManualClock::new()), &prefix);
    let sim_client = sim.client("test");
    let mut real_watch = real.watch(Revision(0), None).await.expect("watch etcd");
    let mut sim_watch = sim_client.watch(Revision(0), None).await.expect("watch memory");

    let valid = br#"{"PublicIP":"192.0.2.50","PublicIPv6":null}"#.to_vec();
    let weft = attrs("node-aaaa", "inc-aaaa", [192, 0, 2, 1]).to_json();
    let held = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1"}"#.to_vec();
    let left = br#"{"state":"relinquished","node":"node-aaaa","public_ip":"192.0.2.1"}"#.to_vec();
    let keys: Vec<(String, Vec<u8>)> = vec![
        (format!("{prefix}/subnets/10.244.1.0-24"), weft),
        (format!("{prefix}/subnets/10.244.7.0-24"), valid.clone()),
        (format!("{prefix}/subnets/10.244.2.0-24&fd00:0:0:2::-64"), valid.clone()),
        (format!("{prefix}/subnets/0.0.0.0-0&fd00:0:0:3::-64"), valid.clone()),
        (format!("{prefix}/subnets/10.244.9.0-24"), b"not json".to_vec()),
        (format!("{prefix}/subnets/10.244.1.7-24"), valid.clone()),
        (format!("{prefix}/subnets/bogus"), valid.clone()),
        (format!("{prefix}/subnets/10.244.4.0-024"), valid.clone()),
        (format!("{prefix}/subnets/a/10.244.5.0-24"), valid.clone()),
        (format!("{prefix}/weft/history/10.244.1.0-24"), held),
        (format!("{prefix}/weft/history/10.244.9.0-24"), b"{}".to_vec()),
        (format!("{prefix}/weft/history/nope"), b"[]".to_vec()),
        (format!("{prefix}/subnetsX/10.244.8.0-24"), valid),
        (format!("{prefix}/weft/a"), b"inside the watched range".to_vec()),
        (format!("{prefix}/weft/departures/10.244.9.0-24"), left),
        (format!("{prefix}/weft/departures/nope"), b"[]".to_vec()),
    ];
    let mut raw = etcd.client().await;
    for (key, value) in &keys {
        raw.put(key.as_str(), value.clone(), None).await.expect("put");
        sim.put_raw(key, value, None);
    }
    let deleted = [format!("{prefix}/subnets/bogus"), format!("{prefix}/subnets/10.244.7.0-24")];
    for key in &deleted {
        raw.delete(key.as_str(), None).await.expect("delete");
        assert!(sim.delete_raw(key));
    }

    // Listings: revisions differ between the stores, nothing else may.
    let view = |l: Listing| {
        let leases: Vec<_> =
            l.leases.into_iter().map(|l| (l.subnet, l.attrs, l.lease_id)).collect();
        let history: Vec<_> = l.history.into_iter().map(|h| (h.subnet, h.record)).collect();
        let mut skipped: Vec<_> = l.skipped.into_iter().map(|b| (b.key, b.problem)).collect();
        skipped.sort();
        (leases, history, skipped)
    };
    let (real_list, sim_list) = (real.list().await.expect("list etcd"), sim_client.list().await);
    let real_list = view(real_list);
    assert_eq!(real_list, view(sim_list.expect("list memory")));
    // flannel's IPv6-only key is a lease (of an IPv6-only network) in both stores.
    assert_eq!(real_list.0.len(), 3, "{:?}", real_list.0);
    assert!(real_list.0.iter().any(|(s, _, _)| s.v6().is_some()), "{:?}", real_list.0);
    assert_eq!(real_list.2.len(), 6, "{:?}", real_list.2);

    // Single reads.
    for s in ["10.244.1.0/24", "10.244.9.0/24", "10.244.3.0/24"] {
        let lease = |g: Option<Result<StoredLease, BadEntry>>| {
            g.map(|g| g.map(|l| (l.subnet, l.attrs, l.lease_id)).map_err(|b| (b.key, b.problem)))
        };
        let real_get = lease(real.get(subnet(s)).await.expect("get etcd"));
        assert_eq!(real_get, lease(sim_client.get(subnet(s)).await.expect("get memory")), "{s}");
    }

    // Watch events: every put and delete under subnets/, in order, told the same way.
    let event = |e: WatchEvent| match e {
        WatchEvent::Put(l) => format!("put {} {:?}", l.subnet, l.attrs),
        WatchEvent::Delete { subnet, .. } => format!("delete {subnet}"),
        WatchEvent::Bad(b) => format!("bad {} {}", b.key, b.problem),
        WatchEvent::DeleteUnparsed { key, .. } => format!("delete unparsed {key}"),
        WatchEvent::Departed(h) => format!("departed {} {:?}", h.subnet, h.record),
    };
    // Every subnet key's write and delete, and the one departure marker that parses; not the
    // garbage marker, nor the history, nor other keys inside the watched range.
    let writes = keys.iter().filter(|(k, _)| k.starts_with(&format!("{prefix}/subnets/"))).count()
        + deleted.len()
        + 1;
    let mut count = 0;
    let real_events: Vec<String> = watch_until(&mut real_watch, Duration::from_secs(10), |_| {
        count += 1;
        count == writes
    })
    .await
    .into_iter()
    .map(event)
    .collect();
    let (batches, _) = drain_ready(&mut sim_watch);
    let sim_events: Vec<String> = batches
        .into_iter()
        .flat_map(|b| b.expect("memory watch batch").events)
        .map(event)
        .collect();
    assert_eq!(real_events, sim_events);
}

/// The next item of a config watch, within 5 s.
async fn next(
    w: &mut weft::lease::store::ConfigWatchStream,
) -> Result<Option<Vec<u8>>, StoreError> {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("a value in time")
        .expect("the watch goes on")
}

/// The config watch on etcd: the value when it starts, then the value after each put (an
/// unchanged one too) and `None` after a delete; subnet keys are not the config. A stopped
/// etcd ends it with a transient error.
#[tokio::test]
async fn the_config_watch_gives_the_value_then_each_write() {
    let mut etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let s = store(&etcd, &prefix).await;
    let mut w = s.watch_config().await.expect("watch");
    assert_eq!(next(&mut w).await.expect("absent"), None);
    s.set_config(b"one").await.expect("write");
    assert_eq!(next(&mut w).await.expect("put"), Some(b"one".to_vec()));
    s.set_config(b"one").await.expect("write");
    assert_eq!(next(&mut w).await.expect("same put"), Some(b"one".to_vec()));
    created(
        s.create(
            subnet("10.244.1.0/24"),
            &attrs("node-aaaa", "inc-00000001", [192, 0, 2, 1]),
            LONG_TTL,
        )
        .await
        .expect("create"),
    );
    let mut client = etcd.client().await;
    client.delete(format!("{prefix}/config"), None).await.expect("delete");
    assert_eq!(next(&mut w).await.expect("delete"), None, "the lease was not the config");
    // A new watch starts from the value now.
    let mut again = s.watch_config().await.expect("watch");
    assert_eq!(next(&mut again).await.expect("absent"), None);
    etcd.kill();
    let err = next(&mut w).await.expect_err("etcd gone");
    assert!(err.is_transient(), "{err}");
}
