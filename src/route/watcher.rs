//! The route watcher: lists and watches every subnet lease in the store, feeds a
//! [`RouteSet`] and publishes its tables into [`Routes`]. The only route code that does I/O.
//!
//! # Contract
//! - Start: list at a revision, publish, then watch from the next revision (flannel's
//!   `WatchLeases`; docs/store-layout.md, "Watching").
//! - Every batch that changes the routes publishes a new table at once; renewals, which rewrite
//!   a lease with the same value, publish nothing. Batches that are already waiting behind it
//!   (at most [`BATCHES_AT_ONCE`]) are applied with it and published with it.
//! - A delete costs no call: the watch covers the departure markers a release or revoke writes
//!   with its delete ([`KeyLayout::route_watch_range`](crate::lease::keys::KeyLayout::route_watch_range)),
//!   so the batch that brings the delete says whether it was a clean leave (the route goes) or
//!   an expiry (the route stays, stale). Before the markers, every delete cost every watcher
//!   one read of the subnet's history: with 1,000 hosts, a wave of 100 leaves was 100,000
//!   reads, and took half a minute to propagate.
//! - A re-list runs after [`StoreError::Compacted`] and after the store went back in time, at
//!   most once per [`RELIST_DEBOUNCE`]; the watch then restarts from the listing.
//! - Any other failure (list, watch set-up, a watch that errors or ends) re-lists and re-watches
//!   with backoff from [`BACKOFF_MIN`] doubling to [`BACKOFF_MAX`], each wait jittered ±50 %. Meanwhile the last
//!   published routes stay in place: nothing here ever clears them because the store is
//!   unreachable.
//! - Own-subnet changes (from the lease driver) re-publish without the own subnet at once, also
//!   while the store is unreachable.
//! - Stops when `shutdown` turns `true` or its sender is dropped.
//! - Two live keys naming one IPv6 half ([`RouteSet::half_conflicts`]): on a network that
//!   carries IPv6, one WARN per key routed over IPv4 only for it, when it appears, and the
//!   gauge `weft_route_ipv6_half_conflicts`. When this host's own key is one of them, one ERROR
//!   per other key, naming both and what to do, on any dual-stack network: pods on both hosts
//!   may be given the same IPv6 addresses.
//!
//! [`RouteStats`] counts what happened; it is the route watcher's metrics collector (add it
//! with [`crate::health::Health::add_collector`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::Routes;
use super::set::{OwnHalfConflict, RouteSet};
use crate::config::NetworkConfig;
use crate::lease::keys;
use crate::lease::record::{LeaseName, Subnet};
use crate::lease::store::{LeaseFeed, StoreError, WatchStream};
use crate::metrics;

/// The least time between two re-lists asked for by compaction or a rewound store.
pub(crate) const RELIST_DEBOUNCE: Duration = Duration::from_millis(200);

/// The most watch batches applied together (the one that woke the watcher and those already
/// waiting behind it) before the table is published: a wave of changes makes one table, and
/// shutdown is never kept waiting long.
pub(crate) const BATCHES_AT_ONCE: usize = 64;

/// The most keys newly ignored that one look at the set warns about by name; the rest are
/// counted in one more WARN. A listing of 100,000 junk keys makes 21 lines, not 100,000.
pub(crate) const IGNORED_NAMED_AT_ONCE: usize = 20;

/// The first retry delay after a store failure.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(100);

/// The longest retry delay after repeated store failures.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What the route watcher has done, for `/metrics`.
#[derive(Debug, Default)]
pub struct RouteStats {
    /// Tables published.
    pub updates: AtomicU64,
    /// Lease entries skipped because they did not parse or could not be routed to.
    pub(crate) bad_entries: AtomicU64,
    /// Listings after the first (for compaction, a rewound store or failures).
    pub relists: AtomicU64,
    /// Failed list or watch calls and watches that broke.
    pub watch_errors: AtomicU64,
    /// Routes in the published table (gauge).
    pub(crate) routes: AtomicU64,
    /// Stale routes in the published table (gauge).
    pub(crate) stale_routes: AtomicU64,
    /// Keys under `subnets/` currently ignored: not a lease of this network, or unreadable
    /// (gauge).
    pub(crate) ignored_keys: AtomicU64,
    /// On a dual-stack vxlan network, peers routed over IPv4 only because their lease's IPv6
    /// half cannot be carried (gauge).
    pub(crate) ipv4_only_peers: AtomicU64,
    /// On a dual-stack vxlan network, live keys routed over IPv4 only because another key,
    /// created first, names the same IPv6 half (gauge).
    pub(crate) ipv6_half_conflicts: AtomicU64,
    /// Stale routes dropped because their trust ran out (`--stale-route-ttl`).
    pub(crate) stale_dropped: AtomicU64,
}

impl Collector for RouteStats {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let gauges: [(&str, &str, &AtomicU64); 5] = [
            ("weft_routes", "Routes to peers in the published table.", &self.routes),
            (
                "weft_routes_stale",
                "Published routes whose lease expired (peer presumed partitioned).",
                &self.stale_routes,
            ),
            (
                "weft_route_ignored_keys",
                "Keys under subnets/ ignored: not a lease of this network, or unreadable.",
                &self.ignored_keys,
            ),
            (
                "weft_route_ipv4_only_peers",
                "Peers on a dual-stack vxlan network routed over IPv4 only: their lease's IPv6 \
                 half cannot be carried.",
                &self.ipv4_only_peers,
            ),
            (
                "weft_route_ipv6_half_conflicts",
                "Keys on a dual-stack vxlan network routed over IPv4 only: another key, created \
                 first, names the same IPv6 half.",
                &self.ipv6_half_conflicts,
            ),
        ];
        for (name, help, v) in gauges {
            metrics::gauge(&mut e, name, help, load(v))?;
        }
        let counters: [(&str, &str, &AtomicU64); 5] = [
            ("weft_route_updates_total", "Route tables published.", &self.updates),
            (
                "weft_route_bad_entries_total",
                "Lease entries skipped because they did not parse or could not be routed to.",
                &self.bad_entries,
            ),
            (
                "weft_route_relists_total",
                "Re-lists of all leases (after compaction, a rewound store or store failures).",
                &self.relists,
            ),
            (
                "weft_route_watch_errors_total",
                "Failed lease list or watch calls.",
                &self.watch_errors,
            ),
            (
                "weft_routes_stale_dropped_total",
                "Stale routes dropped: their key gone longer than --stale-route-ttl, confirmed by \
                 a listing.",
                &self.stale_dropped,
            ),
        ];
        for (name, help, v) in counters {
            metrics::counter(&mut e, name, help, load(v))?;
        }
        Ok(())
    }
}

/// Publishes the set's table and updates the gauges.
fn publish(routes: &Routes, set: &RouteSet, stats: &RouteStats) {
    let table = set.table();
    stats.routes.store(table.len() as u64, Ordering::Relaxed);
    stats.stale_routes.store(table.stale_count() as u64, Ordering::Relaxed);
    stats.updates.fetch_add(1, Ordering::Relaxed);
    debug!(routes = table.len(), stale = table.stale_count(), "publishing routes");
    routes.store(table);
}

/// What the watcher has warned about, so that each key is warned about once while it lasts.
#[derive(Debug, Default)]
struct Warned {
    /// Keys ignored.
    ignored: BTreeSet<String>,
    /// Peers routed over IPv4 only.
    ipv4_only: BTreeSet<String>,
    /// Keys routed over IPv4 only because another key holds their IPv6 half.
    half_conflicts: BTreeSet<String>,
    /// The other keys told about, in ERRORs, as naming the own lease's IPv6 half.
    own_half: Option<OwnHalfTold>,
}

/// The keys the watcher has told about as sharing the own lease's IPv6 half.
#[derive(Debug)]
struct OwnHalfTold {
    /// The own lease's key: a new one starts afresh.
    own: LeaseName,
    /// The other keys naming its half.
    others: BTreeSet<LeaseName>,
}

/// Updates the half-conflict gauge and warns once about each key newly routed over IPv4 only
/// because another key holds its IPv6 half (on a network that carries IPv6: elsewhere no half
/// is routed, so none is contested), and tells at ERROR, once per other key, when the own
/// lease's half is named by another key (any dual-stack network: the pods' addresses clash
/// whatever carries them). The own key is left to the ERROR, not warned about too.
fn note_half_conflicts(
    set: &RouteSet,
    stats: &RouteStats,
    warned: &mut Warned,
    carries_ipv6: bool,
) {
    let own = set.own_half_conflict();
    if carries_ipv6 {
        let conflicts = set.half_conflicts();
        stats.ipv6_half_conflicts.store(conflicts.len() as u64, Ordering::Relaxed);
        warned.half_conflicts.retain(|k| conflicts.contains_key(k));
        let own_key = own.as_ref().map(|c| key_of(c.own));
        for (key, why) in conflicts {
            if warned.half_conflicts.insert(key.clone()) && own_key.as_ref() != Some(key) {
                warn!(%key, reason = %why, "a peer is reached over IPv4 only: another key holds its lease's IPv6 half");
            }
        }
    }
    let Some(conflict) = own else {
        warned.own_half = None;
        return;
    };
    let told = match &mut warned.own_half {
        Some(told) if told.own == conflict.own => told,
        slot => slot.insert(OwnHalfTold { own: conflict.own, others: BTreeSet::new() }),
    };
    told.others.retain(|k| conflict.keys.contains(k));
    for other in conflict.keys.iter().filter(|k| **k != conflict.own) {
        if told.others.insert(*other) {
            tell_own_half_conflict(&conflict, *other);
        }
    }
}

/// The ERROR for the own lease's IPv6 half named by `other` too.
fn tell_own_half_conflict(conflict: &OwnHalfConflict, other: LeaseName) {
    // `keys` is in claim order, the holder first: the later of the two is the one further on.
    let position = |name: LeaseName| conflict.keys.iter().position(|k| *k == name);
    let later = if position(other) > position(conflict.own) { other } else { conflict.own };
    error!(
        own = %key_of(conflict.own),
        other = %key_of(other),
        holder = %key_of(conflict.holder),
        later = %key_of(later),
        "this node's lease names the same IPv6 half as another key: pods on both hosts may be \
         given the same IPv6 addresses. Delete the later key (`weft lease revoke <its IPv4 \
         subnet>`) and, if its node does not lease afresh by itself, restart that node"
    );
}

/// How the watcher's logs name a lease key: `subnets/<name>`, both halves.
fn key_of(name: LeaseName) -> String {
    keys::relative_subnet_key(&name.key_name())
}

/// Counts what the set skipped since the last call, and warns once about each key it newly
/// ignores (a key that comes back after being deleted is warned about again), by name up to
/// [`IGNORED_NAMED_AT_ONCE`] at a time and the rest by number. On a network
/// that carries IPv6 (`carries_ipv6`: dual stack on vxlan) the same for each peer whose IPv6
/// half cannot be carried: it is reached over IPv4 only. On the udp backend no peer's half is
/// carried, as flannel's; that is said once at start, not per peer.
fn note_skipped(
    set: &RouteSet,
    stats: &RouteStats,
    bad_seen: &mut u64,
    warned: &mut Warned,
    carries_ipv6: bool,
) {
    note_half_conflicts(set, stats, warned, carries_ipv6);
    if carries_ipv6 {
        let ipv4_only = set.ipv4_only();
        stats.ipv4_only_peers.store(ipv4_only.len() as u64, Ordering::Relaxed);
        warned.ipv4_only.retain(|k| ipv4_only.contains_key(k));
        for (key, why) in ipv4_only {
            if warned.ipv4_only.insert(key.clone()) {
                warn!(%key, reason = %why, "a peer is reached over IPv4 only: its lease's IPv6 half cannot be carried");
            }
        }
    }
    let warned = &mut warned.ignored;
    let new_bad = set.bad_entries();
    stats.bad_entries.fetch_add(new_bad - *bad_seen, Ordering::Relaxed);
    *bad_seen = new_bad;
    let ignored = set.ignored();
    stats.ignored_keys.store(ignored.len() as u64, Ordering::Relaxed);
    // What the set forgot (deleted keys) is forgotten here too: a key put again is warned
    // about again, and this memory is never larger than the set's.
    warned.retain(|k| ignored.contains_key(k));
    let (mut named, mut unnamed) = (0usize, 0usize);
    for (key, why) in ignored {
        if warned.insert(key.clone()) {
            if named < IGNORED_NAMED_AT_ONCE {
                named += 1;
                warn!(%key, reason = %why, "ignoring a key under the subnets prefix: not a usable lease of this network");
            } else {
                unnamed += 1;
            }
        }
    }
    if unnamed > 0 {
        warn!(
            more = unnamed,
            "ignoring {unnamed} more keys under the subnets prefix, not named here (`weft lease \
             list` names them all)"
        );
    }
}

/// The next item of the watch, or never if there is none (for `select!`).
async fn next_batch(
    stream: &mut Option<WatchStream>,
) -> Option<Result<crate::lease::store::WatchBatch, StoreError>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// Notes when each route turned stale (now, for one not seen stale before) and forgets the
/// routes that are no longer stale (their key is back, or the route is gone).
fn track_stale(set: &RouteSet, since: &mut BTreeMap<Subnet, Instant>, now: Instant) {
    let own = set.own();
    let stale: Vec<Subnet> = set.stale_subnets().into_iter().filter(|s| Some(*s) != own).collect();
    since.retain(|s, _| stale.contains(s));
    for s in stale {
        since.entry(s).or_insert(now);
    }
}

/// When the first stale route's trust runs out.
fn stale_due(since: &BTreeMap<Subnet, Instant>, ttl: Duration) -> Option<Instant> {
    since.values().min().map(|t| *t + ttl)
}

/// After a listing at `listed` (the store answers, and every key absent from it is gone):
/// drops each stale route stale for `ttl` or longer. Whether the table changed.
fn drop_untrusted(
    set: &mut RouteSet,
    since: &mut BTreeMap<Subnet, Instant>,
    ttl: Duration,
    listed: Instant,
    stats: &RouteStats,
) -> bool {
    let due: Vec<(Subnet, Instant)> = since
        .iter()
        .filter(|(_, t)| listed.saturating_duration_since(**t) >= ttl)
        .map(|(s, t)| (*s, *t))
        .collect();
    let mut changed = false;
    for (subnet, t) in due {
        since.remove(&subnet);
        let Some(peer) = set.peer(subnet).filter(|p| p.stale).map(|p| p.public_ip) else {
            continue;
        };
        changed |= set.drop_stale(subnet);
        stats.stale_dropped.fetch_add(1, Ordering::Relaxed);
        warn!(
            %subnet,
            %peer,
            gone_for = ?listed.saturating_duration_since(t),
            "dropped the stale route: its key has been gone longer than --stale-route-ttl while \
             the store answers, so its address is no longer trusted as that peer"
        );
    }
    changed
}

/// `delay` spread over half to one and a half of itself: a thousand watchers that failed
/// together (an overloaded or restarted etcd) must not come back together.
fn jittered(delay: Duration) -> Duration {
    delay.mul_f64(rand::random_range(0.5..JITTER_MAX))
}

/// The most [`jittered`] stretches a wait by.
const JITTER_MAX: f64 = 1.5;

/// The longest wait before a retry: [`BACKOFF_MAX`] jittered up.
#[cfg(test)]
fn longest_retry_wait() -> Duration {
    BACKOFF_MAX.mul_f64(JITTER_MAX)
}

/// Runs the route watcher until `shutdown`. See the module docs for the contract.
pub async fn run(
    store: Arc<dyn LeaseFeed>,
    routes: Arc<Routes>,
    network: NetworkConfig,
    mut own: watch::Receiver<Option<LeaseName>>,
    stats: Arc<RouteStats>,
    stale_ttl: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut set = {
        let (net, len) = network.leased_network();
        RouteSet::new(net, len)
    };
    set.set_own(own.borrow_and_update().map(|l| l.subnet));
    let mut own_open = true;
    let mut stream: Option<WatchStream> = None;
    let mut listed_once = false;
    let mut last_list: Option<Instant> = None;
    let mut list_at: Option<Instant> = Some(Instant::now());
    let mut backoff = BACKOFF_MIN;
    let mut bad_seen = 0u64;
    let mut warned = Warned::default();
    let carries_ipv6 = network.ipv6.is_some() && network.backend.kind.carries_ipv6();
    // When each stale route was first seen stale (its key gone, as the store said).
    let mut stale_since: BTreeMap<Subnet, Instant> = BTreeMap::new();

    let debounced = |last_list: Option<Instant>| {
        let now = Instant::now();
        last_list.map_or(now, |t| (t + RELIST_DEBOUNCE).max(now))
    };

    loop {
        if *shutdown.borrow() {
            return;
        }
        // A stale route whose trust runs out is confirmed gone by a listing, which also shows
        // that the store answers; only then is it dropped.
        if list_at.is_none()
            && stale_due(&stale_since, stale_ttl).is_some_and(|t| t <= Instant::now())
        {
            list_at = Some(Instant::now());
        }
        if list_at.is_some_and(|t| t <= Instant::now()) {
            list_at = None;
            last_list = Some(Instant::now());
            match store.list().await {
                Ok(listing) => {
                    if listed_once {
                        stats.relists.fetch_add(1, Ordering::Relaxed);
                    }
                    let mut changed = set.apply_listing(&listing);
                    let listed = Instant::now();
                    track_stale(&set, &mut stale_since, listed);
                    changed |=
                        drop_untrusted(&mut set, &mut stale_since, stale_ttl, listed, &stats);
                    if changed || !listed_once {
                        publish(&routes, &set, &stats);
                    }
                    listed_once = true;
                    debug!(
                        revision = listing.revision.0,
                        leases = listing.leases.len(),
                        "listed leases"
                    );
                }
                Err(e) => {
                    stats.watch_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(error = %e, retry_in = ?backoff, "listing leases failed; keeping the last routes");
                    list_at = Some(Instant::now() + jittered(backoff));
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
            note_skipped(&set, &stats, &mut bad_seen, &mut warned, carries_ipv6);
            if list_at.is_none() && stream.is_none() {
                match store.watch(set.resume_revision(), None).await {
                    Ok(s) => {
                        stream = Some(s);
                        if backoff > BACKOFF_MIN {
                            info!("lease watch restored");
                        }
                        backoff = BACKOFF_MIN;
                    }
                    Err(StoreError::Compacted { .. }) => list_at = Some(debounced(last_list)),
                    Err(e) => {
                        stats.watch_errors.fetch_add(1, Ordering::Relaxed);
                        warn!(error = %e, retry_in = ?backoff, "watching leases failed; keeping the last routes");
                        list_at = Some(Instant::now() + jittered(backoff));
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
        }

        // A listing already due also confirms the stale routes: wait for it alone.
        let wake = list_at.or_else(|| stale_due(&stale_since, stale_ttl));
        let mut watched = None;
        tokio::select! {
            biased;
            r = shutdown.changed() => {
                if r.is_err() {
                    return;
                }
            }
            r = own.changed(), if own_open => match r {
                Ok(()) => {
                    let subnet = own.borrow_and_update().map(|l| l.subnet);
                    if set.set_own(subnet) {
                        publish(&routes, &set, &stats);
                    }
                    // A new own subnet may be one whose half another key names.
                    note_half_conflicts(&set, &stats, &mut warned, carries_ipv6);
                }
                // The lease driver is gone: keep the last own subnet.
                Err(_) => own_open = false,
            },
            item = next_batch(&mut stream) => watched = Some(item),
            _ = sleep_until(wake), if wake.is_some() => {}
        }
        let Some(mut item) = watched else { continue };

        // This batch and those already waiting behind it, then one table for them all.
        let mut applied = 0;
        let mut changed = false;
        let ended = loop {
            match item {
                Some(Ok(batch)) => {
                    crate::panics::injected_task_fault("route-watcher");
                    changed |= set.apply_batch(&batch);
                    applied += 1;
                    if applied == BATCHES_AT_ONCE {
                        break None;
                    }
                    match stream.as_mut().and_then(|s| s.next().now_or_never()) {
                        Some(next) => item = next,
                        None => break None,
                    }
                }
                other => break Some(other),
            }
        };
        if applied > 0 {
            track_stale(&set, &mut stale_since, Instant::now());
            if changed {
                publish(&routes, &set, &stats);
            }
            note_skipped(&set, &stats, &mut bad_seen, &mut warned, carries_ipv6);
            if set.needs_relist() && list_at.is_none() {
                list_at = Some(debounced(last_list));
            }
        }
        // What ended the run of batches, if it was not "nothing more yet".
        match ended {
            None | Some(Some(Ok(_))) => {}
            Some(Some(Err(StoreError::Compacted { .. }))) => {
                info!("lease watch is behind the compaction horizon; re-listing");
                stream = None;
                list_at = Some(debounced(last_list));
            }
            Some(Some(Err(e @ StoreError::Rewound { .. }))) => {
                warn!(error = %e, "the store went back in time; forgetting its revisions and re-listing");
                set.forget_revisions();
                stream = None;
                list_at = Some(debounced(last_list));
            }
            Some(Some(Err(e))) => {
                stats.watch_errors.fetch_add(1, Ordering::Relaxed);
                warn!(error = %e, retry_in = ?backoff, "lease watch failed; keeping the last routes");
                stream = None;
                list_at = Some(Instant::now() + jittered(backoff));
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
            Some(None) => {
                stats.watch_errors.fetch_add(1, Ordering::Relaxed);
                warn!(retry_in = ?backoff, "lease watch ended; keeping the last routes");
                stream = None;
                list_at = Some(Instant::now() + jittered(backoff));
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::Mutex;

    use tokio::task::JoinHandle;

    use super::*;
    use crate::lease::memory::{MemoryClient, MemoryStore};
    use crate::lease::record::Subnet;
    use crate::lease::record::{Incarnation, LeaseAttrs, LeaseName, NodeId, Revision, StoredLease};
    use crate::lease::store::{
        BadEntry, CreateOutcome, HeldLease, Listing, PresenceOutcome, PresenceRecord,
        ReleaseOutcome, RenewOutcome, Store, WatchBatch, WatchEvent,
    };
    use crate::route::RouteTable;
    use crate::time::ManualClock;
    use crate::vocab::MacAddr;

    const PREFIX: &str = "/coreos.com/network";
    const TTL: Duration = Duration::from_secs(10);
    /// How soon the data plane must see a change.
    const PROMPTLY: Duration = Duration::from_secs(1);
    /// `--stale-route-ttl` in these tests: longer than any test idles with a stale route but
    /// the one about it.
    const STALE_TTL: Duration = Duration::from_secs(120);

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn key(s: &str) -> String {
        format!("{PREFIX}/subnets/{}", subnet(s).key_name())
    }

    fn node(host: u8) -> NodeId {
        NodeId::parse(&format!("node-{host:04}")).unwrap()
    }

    fn attrs(host: u8) -> LeaseAttrs {
        LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 0, 2, host),
            public_ipv6: None,
            backend_type: Some("vxlan".into()),
            backend_data: Some(
                serde_json::json!({"VNI": 1, "VtepMAC": format!("02:00:00:00:00:{host:02x}")}),
            ),
            backend_v6_data: None,
            node_id: Some(node(host)),
            incarnation: Some(Incarnation::parse("inc-00000001").unwrap()),
        }
    }

    /// `host`'s dual-stack lease value: IPv6 carried (`PublicIPv6`, `BackendV6Data`).
    fn attrs6(host: u8) -> LeaseAttrs {
        LeaseAttrs {
            public_ipv6: Some(format!("2001:db8::{host}").parse().unwrap()),
            backend_v6_data: Some(
                serde_json::json!({"VNI": 1, "VtepMAC": format!("02:00:00:00:06:{host:02x}")}),
            ),
            ..attrs(host)
        }
    }

    const HALF: &str = "fd00:10:244:1::/64";

    /// The full key of `s`'s lease naming [`HALF`].
    fn half_key(s: &str) -> String {
        format!("{PREFIX}/{}", key_of(half_name(s)))
    }

    fn half_name(s: &str) -> LeaseName {
        LeaseName { subnet: subnet(s), ipv6: Some(HALF.parse().unwrap()) }
    }

    /// `host`'s lease of `s` naming [`HALF`], created at `created`.
    fn half_lease(s: &str, host: u8, created: i64) -> StoredLease {
        StoredLease {
            subnet: subnet(s),
            ipv6: Some(HALF.parse().unwrap()),
            attrs: attrs6(host),
            create_revision: Revision(created),
            mod_revision: Revision(created),
            lease_id: crate::lease::record::StoreLeaseId(created),
        }
    }

    /// What is logged while `f` runs.
    /// Log output kept in memory.
    #[derive(Clone, Default)]
    struct LogBuf(Arc<Mutex<Vec<u8>>>);

    impl LogBuf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    impl std::io::Write for LogBuf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(f: impl FnOnce()) -> String {
        let buf = LogBuf::default();
        let writer = buf.clone();
        let subscriber =
            tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        tracing::subscriber::with_default(subscriber, f);
        buf.text()
    }

    struct Harness {
        clock: ManualClock,
        store: MemoryStore,
        routes: Arc<Routes>,
        stats: Arc<RouteStats>,
        own: watch::Sender<Option<LeaseName>>,
        shutdown: watch::Sender<bool>,
        task: JoinHandle<()>,
    }

    impl Harness {
        fn start() -> Self {
            let clock = ManualClock::new();
            let store = MemoryStore::new(Arc::new(clock.clone()), PREFIX);
            let client: Arc<dyn Store> = Arc::new(store.client("routes"));
            Self::start_with(clock, store, client)
        }

        fn start_with(clock: ManualClock, store: MemoryStore, client: Arc<dyn Store>) -> Self {
            let network =
                NetworkConfig::parse(br#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#)
                    .unwrap();
            Self::start_on(clock, store, client, network)
        }

        /// On a dual-stack vxlan network (`fd00:10:244::/48`, `/64` halves).
        fn start_dual() -> Self {
            let clock = ManualClock::new();
            let store = MemoryStore::new(Arc::new(clock.clone()), PREFIX);
            let client: Arc<dyn Store> = Arc::new(store.client("routes"));
            let network = NetworkConfig::parse(
                br#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/48","Backend":{"Type":"vxlan"}}"#,
            )
            .unwrap();
            Self::start_on(clock, store, client, network)
        }

        fn start_on(
            clock: ManualClock,
            store: MemoryStore,
            client: Arc<dyn Store>,
            network: NetworkConfig,
        ) -> Self {
            let routes = Arc::new(Routes::new({
                let (net, len) = network.leased_network();
                RouteTable::build_in(net, len, [])
            }));
            let stats = Arc::new(RouteStats::default());
            let (own, own_rx) = watch::channel(None);
            let (shutdown, shutdown_rx) = watch::channel(false);
            let task = tokio::spawn(run(
                client,
                routes.clone(),
                network,
                own_rx,
                stats.clone(),
                STALE_TTL,
                shutdown_rx,
            ));
            Self { clock, store, routes, stats, own, shutdown, task }
        }

        /// A host's client creating its lease.
        async fn join(&self, host: u8, s: &str) -> (MemoryClient, HeldLease) {
            let client = self.store.client(&format!("host-{host}"));
            match client.create(subnet(s), &attrs(host), TTL).await.unwrap() {
                CreateOutcome::Created(held) => (client, held),
                other => panic!("create {s}: {other:?}"),
            }
        }

        /// Waits (in virtual time) until the published routes are `want`: (subnet, last
        /// octet of the public IP, stale).
        async fn expect(&self, within: Duration, want: &[(&str, u8, bool)]) {
            let deadline = Instant::now() + within;
            loop {
                let now = table_routes(&self.routes.load());
                let wanted: Vec<(String, u8, bool)> =
                    want.iter().map(|(s, h, st)| (subnet(s).to_string(), *h, *st)).collect();
                if now == wanted {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "within {within:?}: want {wanted:?}, have {now:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }

        /// Lets the watcher run for `d` of virtual time.
        async fn idle(&self, d: Duration) {
            tokio::time::sleep(d).await;
        }

        fn expire_all(&self) {
            self.clock.advance(TTL + Duration::from_secs(1));
            self.store.tick();
        }

        async fn stop(self) {
            self.shutdown.send_replace(true);
            tokio::time::timeout(Duration::from_secs(1), self.task)
                .await
                .expect("watcher stops on shutdown")
                .unwrap();
        }
    }

    fn table_routes(t: &RouteTable) -> Vec<(String, u8, bool)> {
        t.peers().iter().map(|p| (p.subnet.to_string(), p.public_ip.octets()[3], p.stale)).collect()
    }

    fn stat(v: &AtomicU64) -> u64 {
        v.load(Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn existing_and_new_leases_appear_promptly() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        let t = h.routes.load();
        let p = t.lookup(Ipv4Addr::new(10, 244, 2, 7)).unwrap();
        assert_eq!(p.vtep_mac, Some(MacAddr([2, 0, 0, 0, 0, 2])));
        assert!(t.is_known_peer(Ipv4Addr::new(192, 0, 2, 1)));
        assert_eq!(stat(&h.stats.routes), 2);
        assert!(stat(&h.stats.updates) >= 2);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_publish_nothing() {
        let h = Harness::start();
        let (client, held) = h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.idle(Duration::from_secs(1)).await;
        let updates = stat(&h.stats.updates);
        let mut held = held;
        for _ in 0..5 {
            match client.renew(&held, &attrs(1), TTL).await.unwrap() {
                RenewOutcome::Renewed(next) => held = next,
                other => panic!("renew: {other:?}"),
            }
            h.idle(Duration::from_millis(300)).await;
        }
        assert_eq!(stat(&h.stats.updates), updates);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn relinquished_lease_is_removed() {
        let h = Harness::start();
        let (client, held) = h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        assert_eq!(client.release(&held, &node(1)).await.unwrap(), ReleaseOutcome::Released);
        // The departure marker in the delete's batch told it: no read, no re-list.
        h.expect(PROMPTLY, &[("10.244.2.0/24", 2, false)]).await;
        assert_eq!(stat(&h.stats.relists), 0);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_revoked_lease_is_removed_from_the_watch_alone() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        let operator = h.store.client("operator");
        assert!(operator.revoke(subnet("10.244.2.0/24")).await.unwrap());
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        assert_eq!(stat(&h.stats.relists), 0);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_wave_of_leaves_is_published_once() {
        let h = Harness::start();
        let mut held = Vec::new();
        for host in 1..=4 {
            held.push(h.join(host, &format!("10.244.{host}.0/24")).await);
        }
        h.expect(
            PROMPTLY,
            &[
                ("10.244.1.0/24", 1, false),
                ("10.244.2.0/24", 2, false),
                ("10.244.3.0/24", 3, false),
                ("10.244.4.0/24", 4, false),
            ],
        )
        .await;
        h.idle(Duration::from_secs(1)).await;
        let updates = stat(&h.stats.updates);
        // Three hosts leave at once (the memory store delivers each release's batch before
        // the call returns, so all three wait for the watcher together).
        for (host, (client, lease)) in held.iter().enumerate().take(3) {
            let released = client.release(lease, &node(host as u8 + 1)).await.unwrap();
            assert_eq!(released, ReleaseOutcome::Released);
        }
        h.expect(PROMPTLY, &[("10.244.4.0/24", 4, false)]).await;
        assert_eq!(stat(&h.stats.updates), updates + 1, "one table for the three deletes");
        assert_eq!(stat(&h.stats.relists), 0);
        h.stop().await;
    }

    /// A stale route is trusted for `--stale-route-ttl` from when its key went, and then only
    /// until a listing shows the store answering and the key still gone: during an outage it
    /// stays however long that lasts; once the store answers, it is dropped (its address is no
    /// longer accepted as that peer); the peer coming back is routed again.
    #[tokio::test(start_paused = true)]
    async fn a_stale_route_is_dropped_once_its_trust_runs_out_and_a_listing_confirms_the_key_gone()
    {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.expire_all();
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true)]).await;
        h.idle(STALE_TTL - Duration::from_secs(10)).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true)]).await;
        // The store stops answering before the trust runs out: nothing is dropped while it is
        // down, however long.
        h.store.set_down(true);
        h.idle(STALE_TTL).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true)]).await;
        assert_eq!(stat(&h.stats.stale_dropped), 0);
        h.store.set_down(false);
        h.expect(longest_retry_wait() + PROMPTLY, &[]).await;
        assert_eq!(stat(&h.stats.stale_dropped), 1);
        assert_eq!(stat(&h.stats.stale_routes), 0);
        assert!(h.routes.load().lookup(Ipv4Addr::new(10, 244, 1, 1)).is_none());
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.stop().await;
    }

    /// With the store answering, the drop comes at the stale TTL, one listing, no sooner.
    #[tokio::test(start_paused = true)]
    async fn with_the_store_answering_a_stale_route_goes_at_its_ttl_after_one_listing() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        h.expire_all();
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true), ("10.244.2.0/24", 2, false)]).await;
        h.idle(STALE_TTL - Duration::from_secs(2)).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true), ("10.244.2.0/24", 2, false)]).await;
        assert_eq!(stat(&h.stats.relists), 0);
        h.expect(Duration::from_secs(3), &[("10.244.2.0/24", 2, false)]).await;
        assert_eq!(stat(&h.stats.relists), 1, "one listing confirmed it");
        assert_eq!(stat(&h.stats.stale_dropped), 1);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn expired_lease_stays_stale_until_a_new_holder_replaces_it() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.expire_all();
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true)]).await;
        // No departure marker came with the delete: expired, not relinquished, for good.
        h.idle(Duration::from_secs(2)).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, true)]).await;
        assert_eq!(stat(&h.stats.stale_routes), 1);
        assert_eq!(stat(&h.stats.relists), 0);
        // Still forwarded to.
        assert!(h.routes.load().lookup(Ipv4Addr::new(10, 244, 1, 1)).is_some());
        h.join(3, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 3, false)]).await;
        assert_eq!(stat(&h.stats.stale_routes), 0);
        h.stop().await;
    }

    /// The route metrics byte for byte as weft's hand-written renderer wrote them before
    /// prometheus-client (`tests/golden/metrics_routes.prom` is its output for these values;
    /// `weft_route_ipv4_only_peers` and `weft_route_ipv6_half_conflicts` came after, in the
    /// same form).
    #[test]
    fn route_metrics_render_exactly_as_before() {
        let stats = Arc::new(RouteStats::default());
        let all = [
            &stats.routes,
            &stats.stale_routes,
            &stats.ignored_keys,
            &stats.updates,
            &stats.bad_entries,
            &stats.relists,
            &stats.watch_errors,
            &stats.ipv4_only_peers,
            &stats.ipv6_half_conflicts,
            &stats.stale_dropped,
        ];
        for (v, n) in all.into_iter().zip(1..) {
            v.store(n, Ordering::Relaxed);
        }
        assert_eq!(
            metrics::render_collector(stats).unwrap(),
            include_str!("../../tests/golden/metrics_routes.prom")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_key_naming_a_held_ipv6_half_is_routed_over_ipv4_only_until_one_goes() {
        let h = Harness::start_dual();
        // Host 2's key first, then host 1's (a flannel node drawing the same random half).
        h.store.put_raw(&half_key("10.244.2.0/24"), &attrs6(2).to_json(), Some(TTL));
        h.store.put_raw(&half_key("10.244.1.0/24"), &attrs6(1).to_json(), Some(TTL));
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        let half_route = |h: &Harness| {
            let t = h.routes.load();
            t.lookup6("fd00:10:244:1::9".parse().unwrap()).map(|(p, _)| p.public_ip.octets()[3])
        };
        assert_eq!(half_route(&h), Some(2), "the key created first");
        assert_eq!(stat(&h.stats.ipv6_half_conflicts), 1);
        assert_eq!(stat(&h.stats.ipv4_only_peers), 0);
        let text = metrics::render_collector(h.stats.clone()).unwrap();
        assert!(text.contains("\nweft_route_ipv6_half_conflicts 1\n"), "{text}");
        // Host 2's key expires (deleted without a departure marker): its stale route gives
        // the half up to the live key, and the conflict is over.
        assert!(h.store.delete_raw(&half_key("10.244.2.0/24")));
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, true)]).await;
        assert_eq!(half_route(&h), Some(1));
        assert_eq!(stat(&h.stats.ipv6_half_conflicts), 0);
        h.stop().await;
    }

    #[test]
    fn half_conflicts_are_warned_once_and_the_own_share_is_an_error_once() {
        let mut set = RouteSet::new("10.244.0.0/16".parse().unwrap(), 24);
        let leases = vec![half_lease("10.244.2.0/24", 2, 3), half_lease("10.244.1.0/24", 1, 5)];
        set.apply_listing(&Listing { revision: Revision(10), leases, ..Listing::default() });
        set.set_own(Some(subnet("10.244.1.0/24")));
        let stats = RouteStats::default();
        let mut warned = Warned::default();
        let note = |set: &RouteSet, warned: &mut Warned| {
            logged(|| note_half_conflicts(set, &stats, warned, true))
        };
        // Our key is the later one: an ERROR naming both and what to do; no WARN about our key.
        let first = note(&set, &mut warned);
        assert_eq!(first.matches("ERROR").count(), 1, "{first}");
        assert_eq!(first.matches("WARN").count(), 0, "{first}");
        for part in [
            "own=subnets/10.244.1.0-24&fd00:10:244:1::-64",
            "other=subnets/10.244.2.0-24&fd00:10:244:1::-64",
            "later=subnets/10.244.1.0-24&fd00:10:244:1::-64",
            "weft lease revoke",
        ] {
            assert!(first.contains(part), "{part}: {first}");
        }
        assert_eq!(stat(&stats.ipv6_half_conflicts), 1);
        assert_eq!(note(&set, &mut warned), "", "told once");
        // A third key on the half: a WARN for it, and an ERROR for it (it is later than ours).
        let third = WatchEvent::Put(half_lease("10.244.3.0/24", 3, 11));
        set.apply_batch(&WatchBatch { revision: Revision(11), events: vec![third] });
        let second = note(&set, &mut warned);
        assert_eq!(second.matches("WARN").count(), 1, "{second}");
        assert!(second.contains("key=subnets/10.244.3.0-24&fd00:10:244:1::-64"), "{second}");
        assert_eq!(second.matches("ERROR").count(), 1, "{second}");
        assert!(second.contains("later=subnets/10.244.3.0-24&fd00:10:244:1::-64"), "{second}");
        assert_eq!(stat(&stats.ipv6_half_conflicts), 2);
        assert_eq!(note(&set, &mut warned), "", "told once");
        // The third key goes and comes back: told again.
        let gone = WatchEvent::Delete { subnet: subnet("10.244.3.0/24"), revision: Revision(12) };
        set.apply_batch(&WatchBatch { revision: Revision(12), events: vec![gone] });
        assert_eq!(note(&set, &mut warned), "");
        assert_eq!(stat(&stats.ipv6_half_conflicts), 1);
        let back = WatchEvent::Put(half_lease("10.244.3.0/24", 3, 13));
        set.apply_batch(&WatchBatch { revision: Revision(13), events: vec![back] });
        let again = note(&set, &mut warned);
        assert_eq!((again.matches("WARN").count(), again.matches("ERROR").count()), (1, 1));
        // Our half is ours alone again once the others are gone: nothing to tell, gauge 0.
        let events = ["10.244.2.0/24", "10.244.3.0/24"]
            .map(|s| WatchEvent::Delete { subnet: subnet(s), revision: Revision(14) })
            .to_vec();
        set.apply_batch(&WatchBatch { revision: Revision(14), events });
        assert_eq!(note(&set, &mut warned), "");
        assert_eq!(stat(&stats.ipv6_half_conflicts), 0);
        assert!(warned.own_half.is_none() && warned.half_conflicts.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn garbage_entries_are_counted_and_skipped() {
        let h = Harness::start();
        h.store.put_raw(&key("10.244.8.0/24"), b"not json", None);
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        assert_eq!(stat(&h.stats.bad_entries), 1);
        h.store.put_raw(
            &key("10.244.9.0/24"),
            br#"{"PublicIP":"192.0.2.9","BackendType":"vxlan","BackendData":{"VtepMAC":"nope"}}"#,
            None,
        );
        h.store.put_raw(&format!("{PREFIX}/subnets/garbage"), br#"{"PublicIP":"192.0.2.9"}"#, None);
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        assert_eq!(stat(&h.stats.bad_entries), 3);
        let text = metrics::render_collector(h.stats.clone()).unwrap();
        assert!(text.contains("weft_route_bad_entries_total 3\n"), "{text}");
        assert!(text.contains("# TYPE weft_routes gauge\nweft_routes 2\n"), "{text}");
        for name in [
            "weft_routes_stale 0",
            "weft_route_updates_total",
            "weft_route_relists_total",
            "weft_route_watch_errors_total 0",
        ] {
            assert!(text.contains(name), "{name}: {text}");
        }
        h.stop().await;
    }

    /// A listing of many ignored keys (a hostile writer's, say) names 20 of them and counts
    /// the rest in one more line, rather than a line each; the gauge counts them all.
    #[test]
    fn many_keys_ignored_at_once_are_named_twenty_at_a_time_and_counted() {
        let mut set = RouteSet::new("10.244.0.0/16".parse().unwrap(), 24);
        let mut listing = Listing { revision: Revision(10), ..Listing::default() };
        listing.skipped = (0..1000)
            .map(|i| BadEntry { key: format!("{PREFIX}/subnets/junk-{i}"), problem: "x".into() })
            .collect();
        set.apply_listing(&listing);
        let stats = RouteStats::default();
        let (mut bad_seen, mut warned) = (0, Warned::default());
        let text = logged(|| note_skipped(&set, &stats, &mut bad_seen, &mut warned, false));
        assert_eq!(warns(&text), IGNORED_NAMED_AT_ONCE + 1, "{text}");
        assert!(text.contains("ignoring 980 more keys"), "{text}");
        assert_eq!(stat(&stats.ignored_keys), 1000);
        assert_eq!(warned.ignored.len(), 1000, "all told: named or counted");
        let again = logged(|| note_skipped(&set, &stats, &mut bad_seen, &mut warned, false));
        assert_eq!(again, "", "told once");
    }

    /// Lines of `text` at WARN.
    fn warns(text: &str) -> usize {
        text.lines().filter(|l| l.contains(" WARN ")).count()
    }

    /// Keys whose names are no lease put under `subnets/`, then deleted: the gauge follows the
    /// store down to 0 and the watcher forgets them (its memory of what it warned about too),
    /// so one put again is counted and warned about again. Nothing is re-listed to get there.
    #[tokio::test(start_paused = true)]
    async fn deleted_junk_keys_are_forgotten_and_warned_about_again_when_put_again() {
        let buf = LogBuf::default();
        let writer = buf.clone();
        let subscriber =
            tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        let _log = tracing::subscriber::set_default(subscriber);
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        let junk = |i: u32| format!("{PREFIX}/subnets/junk-{i}");
        for i in 0..300 {
            h.store.put_raw(&junk(i), b"x", None);
        }
        let gauge = async |want: u64| {
            let deadline = Instant::now() + PROMPTLY;
            while stat(&h.stats.ignored_keys) != want {
                assert!(
                    Instant::now() < deadline,
                    "ignored keys: want {want}, have {}",
                    stat(&h.stats.ignored_keys)
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        gauge(300).await;
        // Named one by one as the watch brings them, at most 20 at once and a count of the rest.
        let first = warns(&buf.text());
        assert!((21..=300).contains(&first), "{first} WARNs for 300 keys");
        for i in 0..300 {
            assert!(h.store.delete_raw(&junk(i)));
        }
        gauge(0).await;
        h.idle(Duration::from_secs(1)).await;
        assert_eq!(stat(&h.stats.ignored_keys), 0);
        assert_eq!(stat(&h.stats.bad_entries), 300, "a delete is no bad entry");
        assert_eq!(warns(&buf.text()), first, "a delete is not warned about");
        h.store.put_raw(&junk(7), b"x", None);
        gauge(1).await;
        let text = buf.text();
        assert_eq!(warns(&text), first + 1, "put again: warned about again");
        assert!(text.lines().last().is_some_and(|l| l.contains("junk-7")), "{text}");
        assert_eq!(stat(&h.stats.relists), 0);
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn store_outage_keeps_the_routes() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        h.store.set_down(true);
        h.idle(Duration::from_secs(30)).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        let errors = stat(&h.stats.watch_errors);
        // Backoff: 100 ms doubling to 5 s is about a dozen tries in 30 s, not hundreds.
        assert!((5..=20).contains(&errors), "{errors} errors");
        h.store.set_down(false);
        h.join(3, "10.244.3.0/24").await;
        h.expect(
            longest_retry_wait() + PROMPTLY,
            &[
                ("10.244.1.0/24", 1, false),
                ("10.244.2.0/24", 2, false),
                ("10.244.3.0/24", 3, false),
            ],
        )
        .await;
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn partition_of_the_watcher_alone_keeps_the_routes_and_catches_up() {
        let h = Harness::start();
        let (client, held) = h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        h.store.partition("routes", true);
        client.release(&held, &node(1)).await.unwrap();
        h.join(4, "10.244.4.0/24").await;
        h.idle(Duration::from_secs(10)).await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        h.store.partition("routes", false);
        h.expect(
            longest_retry_wait() + PROMPTLY,
            &[("10.244.2.0/24", 2, false), ("10.244.4.0/24", 4, false)],
        )
        .await;
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn own_subnet_is_excluded_and_included_again_when_own_changes() {
        let h = Harness::start();
        h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        h.own.send_replace(Some(LeaseName::single(subnet("10.244.1.0/24"))));
        h.expect(PROMPTLY, &[("10.244.2.0/24", 2, false)]).await;
        h.own.send_replace(Some(LeaseName::single(subnet("10.244.2.0/24"))));
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.own.send_replace(None);
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false), ("10.244.2.0/24", 2, false)]).await;
        // Also during an outage.
        h.store.set_down(true);
        h.own.send_replace(Some(LeaseName::single(subnet("10.244.2.0/24"))));
        h.expect(PROMPTLY, &[("10.244.1.0/24", 1, false)]).await;
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn own_subnet_set_before_start_is_never_published() {
        let h = Harness::start();
        h.own.send_replace(Some(LeaseName::single(subnet("10.244.1.0/24"))));
        h.join(1, "10.244.1.0/24").await;
        h.join(2, "10.244.2.0/24").await;
        h.expect(PROMPTLY, &[("10.244.2.0/24", 2, false)]).await;
        h.stop().await;
    }

    /// A store whose first `watch` comes after the world moved on and was compacted: the race
    /// between a listing and the watch that follows it.
    struct RacingStore {
        inner: MemoryClient,
        before_watch: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }

    #[async_trait::async_trait]
    impl Store for RacingStore {
        async fn list_with_presence(&self) -> Result<Listing, StoreError> {
            self.inner.list_with_presence().await
        }
        async fn config(&self) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.config().await
        }
        async fn set_config(&self, value: &[u8]) -> Result<(), StoreError> {
            self.inner.set_config(value).await
        }
        async fn watch_config(&self) -> Result<crate::lease::store::ConfigWatchStream, StoreError> {
            self.inner.watch_config().await
        }
        async fn get(
            &self,
            subnet: Subnet,
        ) -> Result<Option<Result<StoredLease, BadEntry>>, StoreError> {
            self.inner.get(subnet).await
        }
        async fn create_pruning(
            &self,
            name: LeaseName,
            attrs: &LeaseAttrs,
            ttl: Duration,
            prune: &[crate::lease::store::HistoryPrune],
        ) -> Result<CreateOutcome, StoreError> {
            self.inner.create_pruning(name, attrs, ttl, prune).await
        }
        async fn renew(
            &self,
            held: &HeldLease,
            attrs: &LeaseAttrs,
            ttl: Duration,
        ) -> Result<RenewOutcome, StoreError> {
            self.inner.renew(held, attrs, ttl).await
        }
        async fn refresh(
            &self,
            held: &HeldLease,
            attrs: &LeaseAttrs,
        ) -> Result<RenewOutcome, StoreError> {
            self.inner.refresh(held, attrs).await
        }
        async fn release(
            &self,
            held: &HeldLease,
            node: &NodeId,
        ) -> Result<ReleaseOutcome, StoreError> {
            self.inner.release(held, node).await
        }
        async fn revoke(&self, subnet: Subnet) -> Result<bool, StoreError> {
            self.inner.revoke(subnet).await
        }
        async fn claim_presence(
            &self,
            node: &NodeId,
            record: &PresenceRecord,
            ttl: Duration,
        ) -> Result<PresenceOutcome, StoreError> {
            self.inner.claim_presence(node, record, ttl).await
        }
        async fn keep_presence(
            &self,
            node: &NodeId,
            lease: crate::lease::record::StoreLeaseId,
            beat: bool,
        ) -> Result<bool, StoreError> {
            self.inner.keep_presence(node, lease, beat).await
        }
        async fn drop_presence(
            &self,
            node: &NodeId,
            lease: crate::lease::record::StoreLeaseId,
        ) -> Result<(), StoreError> {
            self.inner.drop_presence(node, lease).await
        }
    }

    #[async_trait::async_trait]
    impl LeaseFeed for RacingStore {
        async fn list(&self) -> Result<Listing, StoreError> {
            self.inner.list().await
        }

        async fn watch(
            &self,
            from: Revision,
            only: Option<LeaseName>,
        ) -> Result<WatchStream, StoreError> {
            let hook = self.before_watch.lock().unwrap().take();
            if let Some(hook) = hook {
                hook();
            }
            self.inner.watch(from, only).await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn compaction_triggers_a_relist_and_nothing_is_lost() {
        let clock = ManualClock::new();
        let store = MemoryStore::new(Arc::new(clock.clone()), PREFIX);
        let one = attrs(1).to_json();
        store.put_raw(&key("10.244.1.0/24"), &one, Some(TTL));
        store.put_raw(&key("10.244.2.0/24"), &attrs(2).to_json(), Some(TTL));
        let world = store.clone();
        let racing = RacingStore {
            inner: store.client("routes"),
            before_watch: Mutex::new(Some(Box::new(move || {
                // Between the listing and the watch: a new host, a departure, then compaction.
                world.put_raw(&key("10.244.3.0/24"), &attrs(3).to_json(), Some(TTL));
                world.delete_raw(&key("10.244.2.0/24"));
                world.put_raw(&key("10.244.1.0/24"), &attrs(5).to_json(), Some(TTL));
                world.compact(world.revision());
            }))),
        };
        let h = Harness::start_with(clock, store, Arc::new(racing));
        h.expect(
            PROMPTLY,
            &[("10.244.1.0/24", 5, false), ("10.244.2.0/24", 2, true), ("10.244.3.0/24", 3, false)],
        )
        .await;
        assert_eq!(stat(&h.stats.relists), 1);
        assert_eq!(stat(&h.stats.watch_errors), 0);
        // The watch runs again after the re-list.
        h.join(4, "10.244.4.0/24").await;
        h.expect(
            PROMPTLY,
            &[
                ("10.244.1.0/24", 5, false),
                ("10.244.2.0/24", 2, true),
                ("10.244.3.0/24", 3, false),
                ("10.244.4.0/24", 4, false),
            ],
        )
        .await;
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_wave_of_relinquishes_is_told_from_the_watch_alone() {
        let h = Harness::start();
        let mut joined = Vec::new();
        for host in 1..=50u8 {
            let s = format!("10.244.{host}.0/24");
            let (client, held) = h.join(host, &s).await;
            joined.push((host, s, client, held));
        }
        let all: Vec<(&str, u8, bool)> =
            joined.iter().map(|(n, s, _, _)| (s.as_str(), *n, false)).collect();
        h.expect(PROMPTLY, &all).await;
        // A rack of 20 leaves at once.
        for (n, _, client, held) in &joined[..20] {
            client.release(held, &node(*n)).await.unwrap();
        }
        let rest: Vec<(&str, u8, bool)> =
            joined[20..].iter().map(|(n, s, _, _)| (s.as_str(), *n, false)).collect();
        h.expect(PROMPTLY, &rest).await;
        assert_eq!(stat(&h.stats.relists), 0);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_wave_of_expiries_keeps_every_route_stale_without_a_call() {
        let h = Harness::start();
        let mut want = Vec::new();
        for host in 1..=20 {
            let s = format!("10.244.{host}.0/24");
            h.join(host, &s).await;
            want.push((s, host));
        }
        let fresh: Vec<(&str, u8, bool)> =
            want.iter().map(|(s, n)| (s.as_str(), *n, false)).collect();
        h.expect(PROMPTLY, &fresh).await;
        // etcd was unreachable longer than the TTL, say: every lease expires at once.
        h.expire_all();
        let stale: Vec<(&str, u8, bool)> =
            want.iter().map(|(s, n)| (s.as_str(), *n, true)).collect();
        h.expect(PROMPTLY, &stale).await;
        h.idle(Duration::from_secs(1)).await;
        h.expect(PROMPTLY, &stale).await;
        assert_eq!(stat(&h.stats.relists), 0);
        h.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_stops_the_watcher_even_while_the_store_is_down() {
        let h = Harness::start();
        h.store.set_down(true);
        h.idle(Duration::from_secs(3)).await;
        h.stop().await;
    }
}
