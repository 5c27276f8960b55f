//! The store in memory: a model of etcd v3 that implements [`Store`], for the lease simulation
//! and unit tests.
//!
//! One [`MemoryStore`] is one etcd cluster (a "world"); each simulated process talks to it
//! through its own [`MemoryClient`], so faults can be aimed at one client. Time comes from the
//! [`Clock`] given at construction (a [`crate::time::ManualClock`] in tests), never from the
//! real clock, and nothing is random: the same calls at the same clock readings give the same
//! revisions, lease IDs, events and write log.
//!
//! # What it models (etcd semantics)
//! - A keyspace with `create_revision`, `mod_revision`, `version` and an attached lease per key,
//!   and a global revision that starts at 1 and grows by one per transaction that changes
//!   something; all writes of one transaction share its revision. A transaction whose compare
//!   fails, or that deletes only absent keys, writes nothing and keeps the revision.
//! - Store leases with a TTL, granted with sequential IDs from 1. A put detaches the key from
//!   its previous lease; revoking a lease deletes only the keys still attached to it.
//! - Expiry: every call (and [`MemoryStore::tick`]) first revokes the leases whose deadline is
//!   at or before `now`, in lease ID order. Like etcd, one expired lease is one transaction that
//!   deletes its keys (in key order); every lease weft makes carries a single key, so each
//!   expired key gets its own revision.
//! - Watches on the route watchers' range (subnet keys and departure markers; see
//!   [`super::keys`]) or on one subnet key: a bounded event log plus a compaction horizon. A watch
//!   from below the horizon yields [`StoreError::Compacted`] and ends; otherwise it replays the
//!   log from `from`, then delivers live events, one [`WatchBatch`] per transaction. A `from` of
//!   zero or below means "from the next revision", as in etcd.
//! - Watches of the network config: its value at once, then its value after each transaction
//!   that writes it.
//! - Faults: a client partitioned from the store ([`MemoryStore::partition`]), a whole-store
//!   outage ([`MemoryStore::set_down`]), and a lost reply ([`MemoryStore::fail_next_after_commit`]):
//!   the write is applied, the caller sees [`StoreError::Timeout`].
//!
//! # What it does not model
//! - Several members, leader changes, request latency: every call is atomic and instant.
//! - etcd's lease TTL rounding and minimum TTL, and lease keep-alive streams: a keep-alive is
//!   one call that restarts the TTL.
//! - Slow watchers: live watch streams are unbounded and never fall behind, so only a watch that
//!   starts below the horizon is told it is compacted. Progress notifications are not sent.
//! - Reads at past revisions.
//! - Auth, TLS, request size limits.
//!
//! # Contract
//! The [`Store`] methods follow the trait's documentation operation by operation; the
//! inspection and fault helpers on [`MemoryStore`] are for tests and the simulation. Nothing
//! here panics on input: garbage values are reported as the trait says (skipped, `Bad`,
//! `Unreadable`), never unwrapped.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::channel::mpsc;
use futures::{FutureExt, StreamExt};

use super::keys::{KeyLayout, KeyRevisions};
use super::record::{
    HistoryEntry, HistoryRecord, HistoryState, LeaseAttrs, LeaseName, NodeId, Revision,
    StoreLeaseId, StoredLease, Subnet,
};
use super::store::{
    BadEntry, ConfigWatchStream, CreateOutcome, HeldLease, HistoryPrune, LeaseFeed, Listing,
    PresenceOutcome, PresenceRecord, ReleaseOutcome, RenewOutcome, Store, StoreError, WatchBatch,
    WatchEvent, WatchStream,
};
use crate::time::{Clock, Instant};

/// The deadline a simulated lost reply reports in [`StoreError::Timeout`].
pub(crate) const SIMULATED_DEADLINE: Duration = Duration::from_secs(5);

/// The [`WriteRecord::client`] of deletes done by lease expiry (no client asked for them).
pub const EXPIRY_CLIENT: &str = "<expiry>";

/// The [`WriteRecord::client`] of writes done with [`MemoryStore::put_raw`] and
/// [`MemoryStore::delete_raw`].
pub const RAW_CLIENT: &str = "<raw>";

/// How many subnet-key events the watch log keeps by default before it compacts itself.
const DEFAULT_EVENT_LOG_CAPACITY: usize = 10_000;

/// The source of [`StoreError::Unavailable`] for a partitioned client.
#[derive(Debug, thiserror::Error)]
#[error("partitioned from the store (simulated)")]
struct Partitioned;

/// The source of [`StoreError::Unavailable`] while the whole store is down.
#[derive(Debug, thiserror::Error)]
#[error("the store is down (simulated)")]
struct Down;

/// What kind of operation wrote a subnet key (see [`WriteRecord`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriteKind {
    /// [`Store::create`].
    Create,
    /// [`Store::renew`] (and revoking the lease a renew replaced).
    Renew,
    /// [`Store::release`] (and revoking the released lease).
    Release,
    /// [`Store::revoke`].
    Revoke,
    /// [`MemoryStore::put_raw`] or [`MemoryStore::delete_raw`].
    Raw,
    /// Lease expiry (client [`EXPIRY_CLIENT`]).
    Expire,
}

/// One write to a subnet key, for invariant checks ("no node ever writes to a key carrying
/// another node's identity").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteRecord {
    /// The client that wrote ([`MemoryStore::client`] name), [`EXPIRY_CLIENT`] or
    /// [`RAW_CLIENT`].
    pub client: String,
    /// The full key.
    pub key: String,
    /// The revision of the write.
    pub revision: Revision,
    /// The operation.
    pub kind: WriteKind,
    /// The node ID in the value that was overwritten or deleted (`None`: the key was absent,
    /// or its value carried no node ID or did not parse).
    pub previous_node: Option<NodeId>,
    /// The node ID in the value written (`None` for deletes and values without one).
    pub(crate) new_node: Option<NodeId>,
}

/// One key of the keyspace, with etcd's per-key metadata.
#[derive(Clone, Debug)]
struct KeyValue {
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    version: i64,
    lease: i64,
}

/// A granted store lease.
#[derive(Debug)]
struct LeaseState {
    ttl: Duration,
    expires_at: Instant,
    keys: BTreeSet<String>,
}

/// One subnet-key event in the watch log.
#[derive(Debug)]
struct LoggedEvent {
    revision: i64,
    key: String,
    event: WatchEvent,
}

/// A live watch.
struct Watcher {
    client: String,
    /// The first revision it wants.
    from: i64,
    /// The one key it wants, if narrowed.
    only: Option<String>,
    tx: mpsc::UnboundedSender<Result<WatchBatch, StoreError>>,
}

/// Where a config watch's values go.
type ConfigSender = mpsc::UnboundedSender<Result<Option<Vec<u8>>, StoreError>>;

impl Watcher {
    fn wants(&self, key: &str) -> bool {
        self.only.as_deref().is_none_or(|only| only == key)
    }
}

/// One operation of a transaction's success branch.
enum Op {
    Put { key: String, value: Vec<u8>, lease: i64 },
    Delete { key: String },
}

/// The whole simulated cluster.
struct World {
    clock: Arc<dyn Clock>,
    keys: KeyLayout,
    kv: BTreeMap<String, KeyValue>,
    /// The current revision: that of the last transaction that changed something.
    revision: i64,
    leases: BTreeMap<i64, LeaseState>,
    next_lease: i64,
    /// Subnet-key events with revision >= `compacted`, in revision order.
    events: VecDeque<LoggedEvent>,
    event_capacity: usize,
    /// The compaction horizon: the oldest revision a watch may start from.
    compacted: i64,
    watchers: Vec<Watcher>,
    /// Watches of the network config: the client and its stream.
    config_watchers: Vec<(String, ConfigSender)>,
    partitioned: BTreeSet<String>,
    down: bool,
    /// Clients whose next committed write loses its reply.
    lose_reply: BTreeSet<String>,
    writes: Vec<WriteRecord>,
}

impl World {
    /// Revokes every lease due at `now`, lease ID order.
    fn expire(&mut self) {
        let now = self.clock.now();
        let due: Vec<i64> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.expires_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.revoke_lease(id, EXPIRY_CLIENT, WriteKind::Expire);
        }
    }

    /// Fails the call if `client` cannot reach the store.
    fn check_reachable(&self, client: &str) -> Result<(), StoreError> {
        if self.down {
            return Err(StoreError::Unavailable(Box::new(Down)));
        }
        if self.partitioned.contains(client) {
            return Err(StoreError::Unavailable(Box::new(Partitioned)));
        }
        Ok(())
    }

    fn grant(&mut self, ttl: Duration) -> i64 {
        let id = self.next_lease;
        self.next_lease += 1;
        let expires_at = self.clock.now() + ttl;
        self.leases.insert(id, LeaseState { ttl, expires_at, keys: BTreeSet::new() });
        id
    }

    /// Revokes a lease: one transaction deleting the keys still attached to it. Unknown IDs
    /// (already expired or revoked, or `0`) are ignored.
    fn revoke_lease(&mut self, id: i64, client: &str, kind: WriteKind) {
        if let Some(lease) = self.leases.remove(&id) {
            let ops = lease.keys.into_iter().map(|key| Op::Delete { key }).collect();
            self.commit(client, kind, ops);
        }
    }

    /// Applies a transaction's writes: one new revision if anything changes. Records subnet-key
    /// writes in the write log and the watch log, and delivers them to watchers.
    fn commit(&mut self, client: &str, kind: WriteKind, ops: Vec<Op>) -> Option<Revision> {
        let changes = ops.iter().any(|op| match op {
            Op::Put { .. } => true,
            Op::Delete { key } => self.kv.contains_key(key),
        });
        if !changes {
            return None;
        }
        self.revision += 1;
        let rev = self.revision;
        let config = self.keys.config();
        let config_written = ops.iter().any(|op| match op {
            Op::Put { key, .. } => *key == config,
            Op::Delete { key } => *key == config && self.kv.contains_key(key),
        });
        let mut batch: Vec<(String, WatchEvent)> = Vec::new();
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    let old = self.kv.remove(&key);
                    if let Some(old) = &old {
                        self.detach(&key, old.lease);
                    }
                    if let Some(state) = self.leases.get_mut(&lease) {
                        state.keys.insert(key.clone());
                    }
                    let (create_revision, version) =
                        old.as_ref().map_or((rev, 1), |kv| (kv.create_revision, kv.version + 1));
                    if self.keys.is_subnet_key(&key) {
                        self.writes.push(WriteRecord {
                            client: client.to_owned(),
                            key: key.clone(),
                            revision: Revision(rev),
                            kind,
                            previous_node: old.as_ref().and_then(|kv| node_of(&kv.value)),
                            new_node: node_of(&value),
                        });
                        let revisions = KeyRevisions {
                            create_revision: Revision(create_revision),
                            mod_revision: Revision(rev),
                        };
                        let parsed =
                            self.keys.parse_lease(&key, &value, revisions, StoreLeaseId(lease));
                        let event = match parsed {
                            Ok(stored) => WatchEvent::Put(stored),
                            Err(bad) => WatchEvent::Bad(bad),
                        };
                        batch.push((key.clone(), event));
                    } else if let Some(Ok(departed)) =
                        self.keys.parse_departure(&key, &value, Revision(rev))
                    {
                        // A departure marker: route watchers see it beside the delete.
                        batch.push((key.clone(), WatchEvent::Departed(departed)));
                    }
                    let kv = KeyValue { value, create_revision, mod_revision: rev, version, lease };
                    self.kv.insert(key, kv);
                }
                Op::Delete { key } => {
                    let Some(old) = self.kv.remove(&key) else {
                        continue;
                    };
                    self.detach(&key, old.lease);
                    if self.keys.is_subnet_key(&key) {
                        self.writes.push(WriteRecord {
                            client: client.to_owned(),
                            key: key.clone(),
                            revision: Revision(rev),
                            kind,
                            previous_node: node_of(&old.value),
                            new_node: None,
                        });
                        let event = match self.keys.parse_deleted(&key) {
                            Ok(subnet) => WatchEvent::Delete { subnet, revision: Revision(rev) },
                            Err(_) => WatchEvent::DeleteUnparsed {
                                key: key.clone(),
                                revision: Revision(rev),
                            },
                        };
                        batch.push((key, event));
                    }
                }
            }
        }
        if !batch.is_empty() {
            self.publish(rev, batch);
        }
        if config_written {
            let now = self.kv.get(&self.keys.config()).map(|kv| kv.value.clone());
            self.config_watchers.retain(|(_, tx)| tx.unbounded_send(Ok(now.clone())).is_ok());
        }
        Some(Revision(rev))
    }

    /// Applies a client's transaction; if the client's next reply is to be lost, the write
    /// stays applied and the call reports a timeout (so no follow-up work runs either).
    fn client_commit(
        &mut self,
        client: &str,
        kind: WriteKind,
        ops: Vec<Op>,
    ) -> Result<Option<Revision>, StoreError> {
        let rev = self.commit(client, kind, ops);
        if rev.is_some() && self.lose_reply.remove(client) {
            return Err(StoreError::Timeout(SIMULATED_DEADLINE));
        }
        Ok(rev)
    }

    fn detach(&mut self, key: &str, lease: i64) {
        if let Some(state) = self.leases.get_mut(&lease) {
            state.keys.remove(key);
        }
    }

    /// Logs one transaction's subnet-key events and delivers them to the watchers that want
    /// them, dropping watchers whose stream is gone.
    fn publish(&mut self, rev: i64, batch: Vec<(String, WatchEvent)>) {
        self.watchers.retain(|w| {
            if rev < w.from {
                return !w.tx.is_closed();
            }
            let events: Vec<WatchEvent> =
                batch.iter().filter(|(key, _)| w.wants(key)).map(|(_, e)| e.clone()).collect();
            if events.is_empty() {
                return !w.tx.is_closed();
            }
            w.tx.unbounded_send(Ok(WatchBatch { revision: Revision(rev), events })).is_ok()
        });
        for (key, event) in batch {
            self.events.push_back(LoggedEvent { revision: rev, key, event });
        }
        self.trim_events();
    }

    /// Keeps the watch log within its capacity, dropping whole revisions from the front and
    /// moving the compaction horizon past them.
    fn trim_events(&mut self) {
        while self.events.len() > self.event_capacity {
            let Some(oldest) = self.events.front().map(|e| e.revision) else {
                break;
            };
            while self.events.front().is_some_and(|e| e.revision == oldest) {
                self.events.pop_front();
            }
            self.compacted = self.compacted.max(oldest + 1);
        }
    }

    fn compact(&mut self, revision: i64) {
        self.compacted = self.compacted.max(revision.min(self.revision));
        while self.events.front().is_some_and(|e| e.revision < self.compacted) {
            self.events.pop_front();
        }
    }

    /// Ends the watch streams of the clients `cut` selects, with an `Unavailable` error.
    fn cut_watchers(&mut self, cut: impl Fn(&str) -> bool, why: fn() -> StoreError) {
        self.watchers.retain(|w| {
            if cut(&w.client) {
                // The receiver may be gone already; the watcher is dropped either way.
                let _ = w.tx.unbounded_send(Err(why()));
                false
            } else {
                true
            }
        });
        self.config_watchers.retain(|(client, tx)| {
            if cut(client) {
                let _ = tx.unbounded_send(Err(why()));
                false
            } else {
                true
            }
        });
    }

    /// The exact key of a lease, as stored, parsed.
    fn stored(&self, name: LeaseName) -> Option<Result<StoredLease, BadEntry>> {
        let key = self.keys.lease(name);
        let kv = self.kv.get(&key)?;
        Some(self.parse_lease(&key, kv))
    }

    /// `subnet`'s key in whichever form it exists (`X` or `X&…`), as etcd's store finds it.
    fn key_of(&self, subnet: Subnet) -> Option<String> {
        let (start, end) = self.keys.keys_of_range(subnet);
        self.kv.range(start..end).map(|(k, _)| k).find(|k| self.keys.is_key_of(k, subnet)).cloned()
    }

    /// `subnet`'s key in either form, parsed.
    fn stored_any(&self, subnet: Subnet) -> Option<Result<StoredLease, BadEntry>> {
        let key = self.key_of(subnet)?;
        let kv = self.kv.get(&key)?;
        Some(self.parse_lease(&key, kv))
    }

    fn parse_lease(&self, key: &str, kv: &KeyValue) -> Result<StoredLease, BadEntry> {
        let revisions = KeyRevisions {
            create_revision: Revision(kv.create_revision),
            mod_revision: Revision(kv.mod_revision),
        };
        self.keys.parse_lease(key, &kv.value, revisions, StoreLeaseId(kv.lease))
    }

    fn parse_history(&self, key: &str, kv: &KeyValue) -> Result<HistoryEntry, BadEntry> {
        self.keys.parse_history(key, &kv.value, Revision(kv.mod_revision))
    }

    /// Every key under `dir`, in key order.
    fn under<'a>(&'a self, dir: &'a str) -> impl Iterator<Item = (&'a str, &'a KeyValue)> {
        self.kv
            .range::<str, _>((Bound::Included(dir), Bound::Unbounded))
            .take_while(move |(key, _)| key.starts_with(dir))
            .map(|(key, kv)| (key.as_str(), kv))
    }

    fn list(&self) -> Listing {
        let mut listing = Listing { revision: Revision(self.revision), ..Listing::default() };
        for (key, kv) in self.under(self.keys.subnets_dir()) {
            match self.parse_lease(key, kv) {
                Ok(stored) => listing.leases.push(stored),
                Err(bad) => listing.skipped.push(bad),
            }
        }
        for (key, kv) in self.under(self.keys.history_dir()) {
            match self.parse_history(key, kv) {
                Ok(entry) => listing.history.push(entry),
                Err(bad) => listing.skipped.push(bad),
            }
        }
        listing
    }

    /// [`World::list`] and the presence keys.
    fn list_with_presence(&self) -> Listing {
        let mut listing = self.list();
        for (key, kv) in self.under(&self.keys.nodes_dir()) {
            if let Some(p) = self.keys.parse_presence(key, Revision(kv.create_revision)) {
                listing.presence.push(p);
            }
        }
        listing
    }
}

/// The node ID in a subnet key's value, if it parses and has one.
fn node_of(value: &[u8]) -> Option<NodeId> {
    LeaseAttrs::from_json(value).ok().and_then(|attrs| attrs.node_id)
}

fn unavailable_partitioned() -> StoreError {
    StoreError::Unavailable(Box::new(Partitioned))
}

fn unavailable_down() -> StoreError {
    StoreError::Unavailable(Box::new(Down))
}

/// An in-memory etcd: one shared world. Clones share it (cheap: one `Arc`).
///
/// Hand each simulated process its own [`MemoryClient`] ([`MemoryStore::client`]); use the
/// store itself to inject faults, move expiry along ([`MemoryStore::tick`]) and inspect state.
#[derive(Clone)]
pub struct MemoryStore {
    world: Arc<Mutex<World>>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.world();
        f.debug_struct("MemoryStore")
            .field("prefix", &w.keys.prefix())
            .field("revision", &w.revision)
            .field("keys", &w.kv.len())
            .field("leases", &w.leases.len())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store at revision 1 whose keys live under `prefix` (e.g.
    /// `/coreos.com/network`; a trailing `/` is ignored), with TTLs measured on `clock`.
    pub fn new(clock: Arc<dyn Clock>, prefix: &str) -> Self {
        let world = World {
            clock,
            keys: KeyLayout::new(prefix),
            kv: BTreeMap::new(),
            revision: 1,
            leases: BTreeMap::new(),
            next_lease: 1,
            events: VecDeque::new(),
            event_capacity: DEFAULT_EVENT_LOG_CAPACITY,
            compacted: 0,
            watchers: Vec::new(),
            config_watchers: Vec::new(),
            partitioned: BTreeSet::new(),
            down: false,
            lose_reply: BTreeSet::new(),
            writes: Vec::new(),
        };
        Self { world: Arc::new(Mutex::new(world)) }
    }

    /// A handle for one simulated process; faults aimed at `name` hit every handle of that
    /// name.
    pub fn client(&self, name: &str) -> MemoryClient {
        MemoryClient { store: self.clone(), name: name.into() }
    }

    /// Locks the world (a panic elsewhere cannot leave it half-written: every mutation
    /// completes under one lock, so a poisoned lock is still consistent) and runs expiry.
    fn world(&self) -> MutexGuard<'_, World> {
        let mut w = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        w.expire();
        w
    }

    /// Runs expiry now: revokes every store lease whose TTL has run out on the clock. Call it
    /// after moving the clock so that watchers see the deletes.
    pub fn tick(&self) {
        drop(self.world());
    }

    /// Cuts `client` off the store (`true`) or heals it (`false`). While cut off, every call of
    /// that client fails with [`StoreError::Unavailable`]; cutting ends its watch streams with
    /// that error.
    pub fn partition(&self, client: &str, partitioned: bool) {
        let mut w = self.world();
        if partitioned {
            w.partitioned.insert(client.to_owned());
            w.cut_watchers(|c| c == client, unavailable_partitioned);
        } else {
            w.partitioned.remove(client);
        }
    }

    /// Takes the whole store down (`true`) or brings it back (`false`). While down, every call
    /// of every client fails with [`StoreError::Unavailable`]; going down ends all watch
    /// streams with that error. Store leases keep running on the clock meanwhile.
    pub fn set_down(&self, down: bool) {
        let mut w = self.world();
        w.down = down;
        if down {
            w.cut_watchers(|_| true, unavailable_down);
        }
    }

    /// Loses the reply of `client`'s next call that commits a write (one that changes the
    /// keyspace; a failed compare does not count): the write is applied, the call returns
    /// [`StoreError::Timeout`], and any follow-up of the call (revoking a replaced lease) does
    /// not happen.
    pub fn fail_next_after_commit(&self, client: &str) {
        self.world().lose_reply.insert(client.to_owned());
    }

    /// Compacts the watch history: watches from below `revision` (clamped to the current
    /// revision) now fail with [`StoreError::Compacted`]. Never moves the horizon back.
    pub fn compact(&self, revision: Revision) {
        self.world().compact(revision.0);
    }

    /// Sets how many subnet-key events the watch log keeps (at least 1); beyond it the oldest
    /// revisions are compacted away.
    #[cfg(test)]
    pub(crate) fn set_event_log_capacity(&self, capacity: usize) {
        let mut w = self.world();
        w.event_capacity = capacity.max(1);
        w.trim_events();
    }

    /// Writes `key` directly (no compare), attached to a new store lease of `ttl`, or to none
    /// (a reservation) if `ttl` is `None`. For tests that inject garbage, flannel-written
    /// leases or reservations. Returns the revision of the write.
    pub fn put_raw(&self, key: &str, value: &[u8], ttl: Option<Duration>) -> Revision {
        let mut w = self.world();
        let lease = ttl.map_or(0, |ttl| w.grant(ttl));
        let op = Op::Put { key: key.to_owned(), value: value.to_vec(), lease };
        // A put always changes the keyspace, so it always has a revision.
        w.commit(RAW_CLIENT, WriteKind::Raw, vec![op]).unwrap_or(Revision(w.revision))
    }

    /// Deletes `key` directly. `false` if it was absent.
    pub fn delete_raw(&self, key: &str) -> bool {
        let mut w = self.world();
        w.commit(RAW_CLIENT, WriteKind::Raw, vec![Op::Delete { key: key.to_owned() }]).is_some()
    }

    /// The current revision (that of the last write).
    pub fn revision(&self) -> Revision {
        Revision(self.world().revision)
    }

    /// The current compaction horizon: the oldest revision a watch may start from.
    #[cfg(test)]
    pub(crate) fn compact_revision(&self) -> Revision {
        Revision(self.world().compacted)
    }

    /// A key's value and mod revision, if present.
    pub fn raw(&self, key: &str) -> Option<(Vec<u8>, Revision)> {
        let w = self.world();
        w.kv.get(key).map(|kv| (kv.value.clone(), Revision(kv.mod_revision)))
    }

    /// The store lease a key is attached to (`StoreLeaseId(0)`: none), if the key is present.
    pub fn lease_of(&self, key: &str) -> Option<StoreLeaseId> {
        self.world().kv.get(key).map(|kv| StoreLeaseId(kv.lease))
    }

    /// Live store leases and when each expires, by lease ID.
    pub fn live_leases(&self) -> Vec<(StoreLeaseId, Instant)> {
        let w = self.world();
        w.leases.iter().map(|(id, lease)| (StoreLeaseId(*id), lease.expires_at)).collect()
    }

    /// Every subnet key whose name and value parse, in key order.
    pub fn subnet_keys(&self) -> Vec<StoredLease> {
        self.world().list().leases
    }

    /// Every history record that parses, in key order.
    pub fn history(&self) -> Vec<HistoryEntry> {
        self.world().list().history
    }

    /// Every write to a subnet key so far, in revision order (writes of one transaction in
    /// the order they were applied).
    pub fn write_log(&self) -> Vec<WriteRecord> {
        self.world().writes.clone()
    }

    /// The write log from entry `from` on (empty if `from` is past its end), for checking
    /// invariants incrementally without copying the whole log each step.
    pub fn write_log_since(&self, from: usize) -> Vec<WriteRecord> {
        self.world().writes.get(from..).map(<[WriteRecord]>::to_vec).unwrap_or_default()
    }
}

/// Everything `stream` has ready now, without waiting: the items in order, and whether the
/// stream has ended. For a simulation that steps synchronously instead of awaiting: every write
/// delivers its events before the call that made it returns, so after a step this sees them all.
pub fn drain_ready(stream: &mut WatchStream) -> (Vec<Result<WatchBatch, StoreError>>, bool) {
    let mut items = Vec::new();
    loop {
        match stream.next().now_or_never() {
            None => return (items, false),
            Some(None) => return (items, true),
            Some(Some(item)) => items.push(item),
        }
    }
}

/// One simulated process's handle on a [`MemoryStore`]: implements [`Store`].
#[derive(Clone)]
pub struct MemoryClient {
    store: MemoryStore,
    name: Arc<str>,
}

impl fmt::Debug for MemoryClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryClient").field("name", &self.name).finish_non_exhaustive()
    }
}

impl MemoryClient {
    /// Runs one call: expiry, then the reachability check, then `f`, all under one lock.
    fn call<T>(
        &self,
        f: impl FnOnce(&mut World, &str) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut w = self.store.world();
        w.check_reachable(&self.name)?;
        f(&mut w, &self.name)
    }
}

#[async_trait::async_trait]
impl Store for MemoryClient {
    async fn list_with_presence(&self) -> Result<Listing, StoreError> {
        self.call(|w, _| Ok(w.list_with_presence()))
    }

    async fn config(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.call(|w, _| Ok(w.kv.get(&w.keys.config()).map(|kv| kv.value.clone())))
    }

    async fn set_config(&self, value: &[u8]) -> Result<(), StoreError> {
        self.call(|w, client| {
            let op = Op::Put { key: w.keys.config(), value: value.to_vec(), lease: 0 };
            // Not a subnet key: the kind goes nowhere.
            w.client_commit(client, WriteKind::Raw, vec![op])?;
            Ok(())
        })
    }

    async fn watch_config(&self) -> Result<ConfigWatchStream, StoreError> {
        self.call(|w, client| {
            let (tx, rx) = mpsc::unbounded();
            let now = w.kv.get(&w.keys.config()).map(|kv| kv.value.clone());
            // `rx` is alive: the send cannot fail.
            let _ = tx.unbounded_send(Ok(now));
            w.config_watchers.push((client.to_owned(), tx));
            Ok(Box::pin(rx) as ConfigWatchStream)
        })
    }

    async fn get(
        &self,
        subnet: Subnet,
    ) -> Result<Option<Result<StoredLease, BadEntry>>, StoreError> {
        self.call(|w, _| Ok(w.stored_any(subnet)))
    }

    async fn create_pruning(
        &self,
        name: LeaseName,
        attrs: &LeaseAttrs,
        ttl: Duration,
        prune: &[HistoryPrune],
    ) -> Result<CreateOutcome, StoreError> {
        let subnet = name.subnet;
        self.call(|w, client| {
            // Neither form of the subnet's key may exist, as in etcd's compares.
            if let Some(existing) = w.stored_any(subnet) {
                return Ok(CreateOutcome::Exists(existing.ok()));
            }
            let (dual_start, dual_end) = w.keys.dual_stack_range(subnet);
            if w.kv.range(dual_start..dual_end).next().is_some() {
                return Ok(CreateOutcome::Exists(None));
            }
            // As etcd's nested compares: only records still at the listed revision go.
            let prunes: Vec<Op> = prune
                .iter()
                .filter(|p| p.subnet != subnet)
                .filter(|p| {
                    let key = w.keys.history(p.subnet);
                    w.kv.get(&key).is_some_and(|kv| kv.mod_revision == p.mod_revision.0)
                })
                .flat_map(|p| {
                    [
                        Op::Delete { key: w.keys.history(p.subnet) },
                        Op::Delete { key: w.keys.departure(p.subnet) },
                    ]
                })
                .collect();
            let lease = w.grant(ttl);
            let mut ops = vec![Op::Put { key: w.keys.lease(name), value: attrs.to_json(), lease }];
            if let Some(record) = HistoryRecord::held(attrs, name.ipv6) {
                ops.push(Op::Put {
                    key: w.keys.history(subnet),
                    value: record.to_json(),
                    lease: 0,
                });
            }
            // An earlier holder's departure marker goes with the create.
            ops.push(Op::Delete { key: w.keys.departure(subnet) });
            ops.extend(prunes);
            let rev = w.client_commit(client, WriteKind::Create, ops)?;
            // A put always changes the keyspace, so `rev` is always `Some`.
            let mod_revision = rev.unwrap_or(Revision(w.revision));
            Ok(CreateOutcome::Created(HeldLease {
                subnet,
                ipv6: name.ipv6,
                mod_revision,
                lease_id: StoreLeaseId(lease),
            }))
        })
    }

    async fn renew(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
        ttl: Duration,
    ) -> Result<RenewOutcome, StoreError> {
        self.call(|w, client| {
            let subnet = held.subnet;
            let key = w.keys.lease(held.name());
            let new_lease = w.grant(ttl);
            // etcd compares an absent key's mod revision as 0.
            let current = w.kv.get(&key).map_or(0, |kv| kv.mod_revision);
            if current != held.mod_revision.0 {
                w.revoke_lease(new_lease, client, WriteKind::Renew);
                return Ok(match w.stored(held.name()) {
                    None => RenewOutcome::Changed(None),
                    Some(Ok(stored)) => RenewOutcome::Changed(Some(stored)),
                    Some(Err(_)) => RenewOutcome::Unreadable,
                });
            }
            let mut ops = vec![Op::Put { key, value: attrs.to_json(), lease: new_lease }];
            if let Some(record) = HistoryRecord::held(attrs, held.ipv6) {
                ops.push(Op::Put {
                    key: w.keys.history(subnet),
                    value: record.to_json(),
                    lease: 0,
                });
            }
            let rev = w.client_commit(client, WriteKind::Renew, ops)?;
            // The key is on the new lease now, so revoking the old one deletes nothing of it.
            w.revoke_lease(held.lease_id.0, client, WriteKind::Renew);
            // A put always changes the keyspace, so `rev` is always `Some`.
            let mod_revision = rev.unwrap_or(Revision(w.revision));
            Ok(RenewOutcome::Renewed(HeldLease {
                subnet,
                ipv6: held.ipv6,
                mod_revision,
                lease_id: StoreLeaseId(new_lease),
            }))
        })
    }

    async fn refresh(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
    ) -> Result<RenewOutcome, StoreError> {
        self.call(|w, client| {
            let subnet = held.subnet;
            let now = w.clock.now();
            let alive = match w.leases.get_mut(&held.lease_id.0) {
                Some(state) => {
                    state.expires_at = now + state.ttl;
                    true
                }
                None => false,
            };
            let key = w.keys.lease(held.name());
            let ours = w.kv.get(&key).is_some_and(|kv| {
                kv.mod_revision == held.mod_revision.0 && kv.lease == held.lease_id.0
            });
            if !ours {
                return Ok(match w.stored(held.name()) {
                    None => RenewOutcome::Changed(None),
                    Some(Ok(stored)) => RenewOutcome::Changed(Some(stored)),
                    Some(Err(_)) => RenewOutcome::Unreadable,
                });
            }
            if !alive {
                // Cannot happen here (an expired lease's keys are deleted with it), as in etcd.
                return Err(StoreError::Protocol(
                    format!(
                        "store lease {} of {key} is gone but the key is still on it",
                        held.lease_id.0
                    )
                    .into(),
                ));
            }
            if let Some(record) = HistoryRecord::held(attrs, held.ipv6) {
                let op = Op::Put { key: w.keys.history(subnet), value: record.to_json(), lease: 0 };
                // A history key is not a subnet key: the kind goes nowhere.
                w.client_commit(client, WriteKind::Raw, vec![op])?;
            }
            Ok(RenewOutcome::Renewed(*held))
        })
    }

    async fn release(&self, held: &HeldLease, node: &NodeId) -> Result<ReleaseOutcome, StoreError> {
        self.call(|w, client| {
            let key = w.keys.lease(held.name());
            let ours = w.kv.get(&key).filter(|kv| kv.mod_revision == held.mod_revision.0);
            let Some(kv) = ours else {
                // Whoever wrote the key since attached it to their own lease: revoking ours
                // deletes nothing of theirs.
                w.revoke_lease(held.lease_id.0, client, WriteKind::Release);
                return Ok(ReleaseOutcome::NotOurs);
            };
            let public_ip = LeaseAttrs::from_json(&kv.value).ok().map(|attrs| attrs.public_ip);
            let mut ops = vec![Op::Delete { key }];
            if let Some(public_ip) = public_ip {
                let record = HistoryRecord {
                    state: HistoryState::Relinquished,
                    node: node.clone(),
                    public_ip,
                    ipv6: held.ipv6,
                };
                ops.push(Op::Put {
                    key: w.keys.history(held.subnet),
                    value: record.to_json(),
                    lease: 0,
                });
                ops.push(Op::Put {
                    key: w.keys.departure(held.subnet),
                    value: record.to_json(),
                    lease: 0,
                });
            }
            w.client_commit(client, WriteKind::Release, ops)?;
            w.revoke_lease(held.lease_id.0, client, WriteKind::Release);
            Ok(ReleaseOutcome::Released)
        })
    }

    async fn revoke(&self, subnet: Subnet) -> Result<bool, StoreError> {
        self.call(|w, client| {
            let Some(key) = w.key_of(subnet) else {
                return Ok(false);
            };
            let ipv6 = w.keys.parse_deleted_name(&key).ok().and_then(|n| n.ipv6);
            // Name the holder in history when the value says who it is (a weft lease).
            let holder = w.kv.get(&key).and_then(|kv| LeaseAttrs::from_json(&kv.value).ok());
            let mut ops = vec![Op::Delete { key }];
            if let Some(attrs) = holder
                && let Some(node) = attrs.node_id.clone()
            {
                let record = HistoryRecord {
                    state: HistoryState::Revoked,
                    node,
                    public_ip: attrs.public_ip,
                    ipv6,
                };
                ops.push(Op::Put {
                    key: w.keys.history(subnet),
                    value: record.to_json(),
                    lease: 0,
                });
                ops.push(Op::Put {
                    key: w.keys.departure(subnet),
                    value: record.to_json(),
                    lease: 0,
                });
            }
            Ok(w.client_commit(client, WriteKind::Revoke, ops)?.is_some())
        })
    }

    async fn claim_presence(
        &self,
        node: &NodeId,
        record: &PresenceRecord,
        ttl: Duration,
    ) -> Result<PresenceOutcome, StoreError> {
        self.call(|w, client| {
            let key = w.keys.node(node);
            let replaced = match w.kv.get(&key) {
                None => None,
                Some(kv) => match PresenceRecord::from_json(&kv.value) {
                    Ok(other) if other.incarnation != record.incarnation => {
                        return Ok(PresenceOutcome::HeldBy {
                            record: other,
                            mod_revision: Revision(kv.mod_revision),
                        });
                    }
                    // Ours from an earlier claim; or garbage, which names no live process.
                    _ => Some(kv.lease),
                },
            };
            let lease = w.grant(ttl);
            let value = record.to_json();
            // Not a subnet key: the kind goes nowhere.
            w.client_commit(client, WriteKind::Raw, vec![Op::Put { key, value, lease }])?;
            if let Some(previous) = replaced {
                w.revoke_lease(previous, client, WriteKind::Raw);
            }
            Ok(PresenceOutcome::Claimed(StoreLeaseId(lease)))
        })
    }

    async fn keep_presence(
        &self,
        node: &NodeId,
        lease: StoreLeaseId,
        beat: bool,
    ) -> Result<bool, StoreError> {
        self.call(|w, client| {
            if beat {
                let key = w.keys.node(node);
                let Some(kv) = w.kv.get(&key).filter(|kv| kv.lease == lease.0) else {
                    return Ok(false);
                };
                let value = kv.value.clone();
                // Not a subnet key: the kind goes nowhere.
                w.client_commit(
                    client,
                    WriteKind::Raw,
                    vec![Op::Put { key, value, lease: lease.0 }],
                )?;
            }
            let now = w.clock.now();
            Ok(match w.leases.get_mut(&lease.0) {
                Some(state) => {
                    state.expires_at = now + state.ttl;
                    true
                }
                None => false,
            })
        })
    }

    async fn drop_presence(&self, node: &NodeId, lease: StoreLeaseId) -> Result<(), StoreError> {
        self.call(|w, client| {
            let key = w.keys.node(node);
            if w.kv.get(&key).is_some_and(|kv| kv.lease == lease.0) {
                // Not a subnet key: the kind goes nowhere.
                w.client_commit(client, WriteKind::Raw, vec![Op::Delete { key }])?;
            }
            w.revoke_lease(lease.0, client, WriteKind::Raw);
            Ok(())
        })
    }
}

#[async_trait::async_trait]
impl LeaseFeed for MemoryClient {
    async fn list(&self) -> Result<Listing, StoreError> {
        self.call(|w, _| Ok(w.list()))
    }

    async fn watch(
        &self,
        from: Revision,
        only: Option<LeaseName>,
    ) -> Result<WatchStream, StoreError> {
        self.call(|w, client| {
            let (tx, rx) = mpsc::unbounded();
            let start = if from.0 <= 0 { w.revision + 1 } else { from.0 };
            if start < w.compacted {
                let compacted = StoreError::Compacted {
                    requested: from,
                    compact_revision: Revision(w.compacted),
                };
                // `rx` is alive: the send cannot fail. Dropping `tx` ends the stream after it.
                let _ = tx.unbounded_send(Err(compacted));
                return Ok(Box::pin(rx) as WatchStream);
            }
            let only = only.map(|name| w.keys.lease(name));
            let watcher = Watcher { client: client.to_owned(), from: start, only, tx };
            let mut replay: Option<WatchBatch> = None;
            for logged in w.events.iter().filter(|e| e.revision >= start && watcher.wants(&e.key)) {
                let revision = Revision(logged.revision);
                match &mut replay {
                    Some(batch) if batch.revision == revision => {
                        batch.events.push(logged.event.clone())
                    }
                    _ => {
                        if let Some(batch) = replay.take() {
                            let _ = watcher.tx.unbounded_send(Ok(batch));
                        }
                        replay = Some(WatchBatch { revision, events: vec![logged.event.clone()] });
                    }
                }
            }
            if let Some(batch) = replay {
                let _ = watcher.tx.unbounded_send(Ok(batch));
            }
            w.watchers.push(watcher);
            Ok(Box::pin(rx) as WatchStream)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use futures::executor::block_on;

    use super::*;
    use crate::lease::record::Incarnation;
    use crate::time::ManualClock;

    const PREFIX: &str = "/coreos.com/network";
    const TTL: Duration = Duration::from_secs(4);

    fn setup() -> (ManualClock, MemoryStore) {
        let clock = ManualClock::new();
        let store = MemoryStore::new(Arc::new(clock.clone()), PREFIX);
        (clock, store)
    }

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn node(s: &str) -> NodeId {
        NodeId::parse(s).unwrap()
    }

    fn attrs(node_id: &str, ip: u8) -> LeaseAttrs {
        LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 0, 2, ip),
            public_ipv6: None,
            backend_type: Some("vxlan".into()),
            backend_data: None,
            backend_v6_data: None,
            node_id: Some(node(node_id)),
            incarnation: Some(Incarnation::parse("inc-00000001").unwrap()),
        }
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn key(s: &str) -> String {
        format!("{PREFIX}/subnets/{}", subnet(s).key_name())
    }

    fn created(outcome: CreateOutcome) -> HeldLease {
        match outcome {
            CreateOutcome::Created(held) => held,
            other => panic!("expected Created, got {other:?}"),
        }
    }

    fn batches(stream: &mut WatchStream) -> Vec<WatchBatch> {
        let (items, ended) = drain_ready(stream);
        assert!(!ended, "watch ended");
        items.into_iter().map(|item| item.unwrap()).collect()
    }

    #[test]
    fn create_when_absent_then_second_create_sees_first_holder() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        assert_eq!(held.mod_revision, Revision(2));
        assert_eq!(store.revision(), Revision(2), "key and history share one revision");
        match block_on(b.create(s, &attrs("node-bbbb", 2), TTL)).unwrap() {
            CreateOutcome::Exists(Some(existing)) => {
                assert_eq!(existing.attrs, attrs("node-aaaa", 1));
                assert_eq!(existing.mod_revision, held.mod_revision);
                assert_eq!(existing.lease_id, held.lease_id);
            }
            other => panic!("expected Exists, got {other:?}"),
        }
        assert_eq!(store.revision(), Revision(2), "a failed create writes nothing");
        let log = store.write_log();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].client, "a");
        assert_eq!(log[0].kind, WriteKind::Create);
        assert_eq!(log[0].previous_node, None);
        assert_eq!(log[0].new_node, Some(node("node-aaaa")));
        assert_eq!(store.write_log_since(0), log);
        assert!(store.write_log_since(1).is_empty());
        assert!(store.write_log_since(7).is_empty());
        let listing = block_on(a.list()).unwrap();
        assert_eq!(listing.history.len(), 1);
        assert_eq!(listing.history[0].record.state, HistoryState::Held);
        assert_eq!(listing.history[0].mod_revision, Revision(2));
    }

    #[test]
    fn create_without_node_id_writes_no_history() {
        let (_, store) = setup();
        let a = store.client("a");
        let flannelish = LeaseAttrs { node_id: None, incarnation: None, ..attrs("node-aaaa", 1) };
        created(block_on(a.create(subnet("10.244.3.0/24"), &flannelish, TTL)).unwrap());
        let listing = block_on(a.list()).unwrap();
        assert_eq!(listing.leases.len(), 1);
        assert!(listing.history.is_empty());
    }

    #[test]
    fn a_keys_create_revision_survives_its_rewrites_in_listings_and_watches() {
        let (_, store) = setup();
        let a = store.client("a");
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        let mut watch = block_on(a.watch(Revision(held.mod_revision.0 + 1), None)).unwrap();
        let renewed = match block_on(a.renew(&held, &attrs("node-aaaa", 7), TTL)).unwrap() {
            RenewOutcome::Renewed(renewed) => renewed,
            other => panic!("expected Renewed, got {other:?}"),
        };
        assert!(renewed.mod_revision > held.mod_revision);
        let listing = block_on(a.list()).unwrap();
        let listed = &listing.leases[0];
        assert_eq!(
            (listed.create_revision, listed.mod_revision),
            (held.mod_revision, renewed.mod_revision)
        );
        let put = batches(&mut watch).into_iter().flat_map(|b| b.events).find_map(|e| match e {
            WatchEvent::Put(l) => Some(l),
            _ => None,
        });
        let put = put.expect("the renewal's put");
        assert_eq!(
            (put.create_revision, put.mod_revision),
            (held.mod_revision, renewed.mod_revision)
        );
    }

    #[test]
    fn renew_with_stale_revision_fails_and_writes_nothing() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        let renewed = match block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap() {
            RenewOutcome::Renewed(renewed) => renewed,
            other => panic!("expected Renewed, got {other:?}"),
        };
        let before = (store.revision(), store.write_log(), store.live_leases());
        // `held` is stale now: its mod revision was superseded by the renew.
        match block_on(b.renew(&held, &attrs("node-bbbb", 2), TTL)).unwrap() {
            RenewOutcome::Changed(Some(current)) => {
                assert_eq!(current.attrs, attrs("node-aaaa", 1));
                assert_eq!(current.mod_revision, renewed.mod_revision);
            }
            other => panic!("expected Changed, got {other:?}"),
        }
        assert_eq!((store.revision(), store.write_log(), store.live_leases()), before);
        // Absent key: Changed(None). Garbage: Unreadable.
        let gone = subnet("10.244.9.0/24");
        let phantom = HeldLease {
            subnet: gone,
            ipv6: None,
            mod_revision: Revision(2),
            lease_id: StoreLeaseId(1),
        };
        assert_eq!(
            block_on(b.renew(&phantom, &attrs("node-bbbb", 2), TTL)).unwrap(),
            RenewOutcome::Changed(None)
        );
        store.put_raw(&key("10.244.9.0/24"), b"garbage", None);
        assert_eq!(
            block_on(b.renew(&phantom, &attrs("node-bbbb", 2), TTL)).unwrap(),
            RenewOutcome::Unreadable
        );
    }

    #[test]
    fn renew_keeps_key_alive_past_old_ttl_and_old_lease_revoke_keeps_it() {
        let (clock, store) = setup();
        let a = store.client("a");
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        clock.advance(secs(3));
        let renewed = match block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap() {
            RenewOutcome::Renewed(renewed) => renewed,
            other => panic!("expected Renewed, got {other:?}"),
        };
        assert_ne!(renewed.lease_id, held.lease_id);
        assert!(renewed.mod_revision > held.mod_revision);
        // The old lease was revoked, yet the key lives: it is on the new lease.
        let leases: Vec<StoreLeaseId> = store.live_leases().into_iter().map(|(id, _)| id).collect();
        assert_eq!(leases, vec![renewed.lease_id]);
        assert_eq!(store.lease_of(&key("10.244.3.0/24")), Some(renewed.lease_id));
        clock.advance(secs(3)); // 6s: past the old lease's TTL.
        let current = block_on(a.get(s)).unwrap().unwrap().unwrap();
        assert_eq!(current.mod_revision, renewed.mod_revision);
        clock.advance(secs(1)); // 7s: the new lease (granted at 3s) is due.
        assert_eq!(block_on(a.get(s)).unwrap(), None);
        // Revoking the old lease deleted nothing: the only delete is the expiry.
        let log = store.write_log();
        assert_eq!(
            log.iter().map(|w| w.kind).collect::<Vec<_>>(),
            vec![WriteKind::Create, WriteKind::Renew, WriteKind::Expire]
        );
        assert_eq!(log[1].previous_node, Some(node("node-aaaa")));
    }

    #[test]
    fn expiry_after_ttl_deletes_key_and_watcher_sees_delete() {
        let (clock, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        let mut watch = block_on(b.watch(Revision(held.mod_revision.0 + 1), None)).unwrap();
        assert!(batches(&mut watch).is_empty());
        clock.advance(TTL - Duration::from_millis(1));
        store.tick();
        assert!(batches(&mut watch).is_empty());
        assert!(store.raw(&key("10.244.3.0/24")).is_some());
        clock.advance(Duration::from_millis(1));
        store.tick();
        let got = batches(&mut watch);
        let rev = Revision(held.mod_revision.0 + 1);
        assert_eq!(
            got,
            vec![WatchBatch {
                revision: rev,
                events: vec![WatchEvent::Delete { subnet: s, revision: rev }]
            }]
        );
        assert_eq!(store.raw(&key("10.244.3.0/24")), None);
        assert!(store.live_leases().is_empty());
        let last = store.write_log().pop().unwrap();
        assert_eq!(last.client, EXPIRY_CLIENT);
        assert_eq!(last.kind, WriteKind::Expire);
        assert_eq!(last.previous_node, Some(node("node-aaaa")));
        // History survives expiry: it says Held, and the key is gone.
        let listing = block_on(b.list()).unwrap();
        assert!(listing.leases.is_empty());
        assert_eq!(listing.history[0].record.state, HistoryState::Held);
    }

    #[test]
    fn expiry_order_is_by_lease_id() {
        let (clock, store) = setup();
        let a = store.client("a");
        let (s1, s2) = (subnet("10.244.2.0/24"), subnet("10.244.1.0/24"));
        created(block_on(a.create(s1, &attrs("node-aaaa", 1), TTL)).unwrap());
        created(block_on(a.create(s2, &attrs("node-aaaa", 1), TTL)).unwrap());
        let mut watch = block_on(a.watch(Revision(0), None)).unwrap();
        clock.advance(TTL);
        store.tick();
        let got = batches(&mut watch);
        assert_eq!(got.len(), 2, "one revision per expired lease");
        assert_eq!(
            got[0].events,
            vec![WatchEvent::Delete { subnet: s1, revision: got[0].revision }]
        );
        assert_eq!(
            got[1].events,
            vec![WatchEvent::Delete { subnet: s2, revision: got[1].revision }]
        );
        assert!(got[0].revision < got[1].revision);
    }

    #[test]
    fn history_revisions_order_writes() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let (s1, s2) = (subnet("10.244.1.0/24"), subnet("10.244.2.0/24"));
        let h1 = created(block_on(a.create(s1, &attrs("node-aaaa", 1), TTL)).unwrap());
        created(block_on(b.create(s2, &attrs("node-bbbb", 2), TTL)).unwrap());
        let history = |store: &MemoryStore| {
            let listing = block_on(store.client("x").list()).unwrap();
            let rev = |s| listing.history.iter().find(|h| h.subnet == s).unwrap().mod_revision;
            (rev(s1), rev(s2))
        };
        let (r1, r2) = history(&store);
        assert!(r1 < r2);
        block_on(a.renew(&h1, &attrs("node-aaaa", 1), TTL)).unwrap();
        let (r1, r2) = history(&store);
        assert!(r1 > r2);
        assert_eq!(r1, store.revision());
    }

    #[test]
    fn release_deletes_key_and_marks_relinquished() {
        let (_, store) = setup();
        let a = store.client("a");
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 7), TTL)).unwrap());
        let mut watch = block_on(a.watch(Revision(0), Some(LeaseName::single(s)))).unwrap();
        assert_eq!(
            block_on(a.release(&held, &node("node-aaaa"))).unwrap(),
            ReleaseOutcome::Released
        );
        let listing = block_on(a.list()).unwrap();
        assert!(listing.leases.is_empty());
        let h = &listing.history[0];
        assert_eq!(h.record.state, HistoryState::Relinquished);
        assert_eq!(h.record.node, node("node-aaaa"));
        assert_eq!(h.record.public_ip, Ipv4Addr::new(192, 0, 2, 7));
        assert_eq!(h.mod_revision, store.revision());
        assert!(store.live_leases().is_empty(), "the released lease is revoked");
        let got = batches(&mut watch);
        assert_eq!(got[0].events, vec![WatchEvent::Delete { subnet: s, revision: h.mod_revision }]);
        // Twice: not ours any more, and nothing is written.
        let rev = store.revision();
        assert_eq!(
            block_on(a.release(&held, &node("node-aaaa"))).unwrap(),
            ReleaseOutcome::NotOurs
        );
        assert_eq!(store.revision(), rev);
        assert_eq!(store.write_log().last().unwrap().kind, WriteKind::Release);
    }

    /// As etcd's store (integration/etcd_store.rs): one key per subnet whichever form a create
    /// writes, and the dual-stack key is the one renewed, released and revoked.
    #[test]
    fn both_key_forms_of_one_subnet_exclude_each_other() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let half: crate::lease::record::Ipv6Subnet = "fd00:0:0:3::/64".parse().unwrap();
        let dual = LeaseName { subnet: s, ipv6: Some(half) };
        let held =
            created(block_on(a.create_pruning(dual, &attrs("node-aaaa", 1), TTL, &[])).unwrap());
        assert_eq!(held.name(), dual);
        match block_on(b.create(s, &attrs("node-bbbb", 2), TTL)).unwrap() {
            CreateOutcome::Exists(Some(now)) => assert_eq!(now.name(), dual),
            other => panic!("an IPv4-only key beside the dual-stack one: {other:?}"),
        }
        assert_eq!(block_on(b.get(s)).unwrap().unwrap().unwrap().name(), dual);
        let held = match block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap() {
            RenewOutcome::Renewed(h) => h,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            block_on(a.release(&held, &node("node-aaaa"))).unwrap(),
            ReleaseOutcome::Released
        );
        assert!(store.subnet_keys().is_empty());
        let record = &store.history()[0].record;
        assert_eq!((record.state, record.ipv6), (HistoryState::Relinquished, Some(half)));
        // The other way round: the IPv4-only key holds the subnet against a dual-stack create.
        created(block_on(b.create(s, &attrs("node-bbbb", 2), TTL)).unwrap());
        assert!(matches!(
            block_on(a.create_pruning(dual, &attrs("node-aaaa", 1), TTL, &[])).unwrap(),
            CreateOutcome::Exists(Some(now)) if now.ipv6.is_none()
        ));
        assert!(block_on(a.revoke(s)).unwrap());
        created(block_on(a.create_pruning(dual, &attrs("node-aaaa", 1), TTL, &[])).unwrap());
        assert!(block_on(b.revoke(s)).unwrap());
        assert!(store.subnet_keys().is_empty(), "the dual-stack key is revoked by its subnet");
        let record = &store.history()[0].record;
        assert_eq!((record.state, record.ipv6), (HistoryState::Revoked, Some(half)));
    }

    #[test]
    fn a_release_or_revoke_writes_a_departure_marker_that_the_next_create_or_prune_deletes() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let (s, t) = (subnet("10.244.3.0/24"), subnet("10.244.4.0/24"));
        let marker = |sn: Subnet| format!("{PREFIX}/weft/departures/{}", sn.key_name());
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 7), TTL)).unwrap());
        let mut watch = block_on(b.watch(Revision(held.mod_revision.0 + 1), None)).unwrap();
        block_on(a.release(&held, &node("node-aaaa"))).unwrap();
        let released = store.revision();
        // The delete and the marker: one transaction, one batch, one revision.
        let got = batches(&mut watch);
        assert_eq!(got.len(), 1, "{got:?}");
        let [WatchEvent::Delete { subnet: deleted, revision }, WatchEvent::Departed(d)] =
            got[0].events.as_slice()
        else {
            panic!("{got:?}");
        };
        assert_eq!((*deleted, *revision), (s, released));
        assert_eq!(
            (d.subnet, d.mod_revision, d.record.state),
            (s, released, HistoryState::Relinquished)
        );
        assert!(store.raw(&marker(s)).is_some());
        // A one-key watch sees no markers.
        let mut own = block_on(a.watch(Revision(0), Some(LeaseName::single(s)))).unwrap();
        // The same node takes another subnet, pruning its record of `s`: the marker goes too.
        let prune: Vec<HistoryPrune> = block_on(a.list())
            .unwrap()
            .history
            .iter()
            .map(|h| HistoryPrune { subnet: h.subnet, mod_revision: h.mod_revision })
            .collect();
        let on_t = created(
            block_on(a.create_pruning(LeaseName::single(t), &attrs("node-aaaa", 7), TTL, &prune))
                .unwrap(),
        );
        assert_eq!(store.raw(&marker(s)), None, "pruned with its history");
        // An operator revokes `t`: a marker again; then node b creates `t`, which deletes it.
        assert!(block_on(b.revoke(t)).unwrap());
        let revoked = store.raw(&marker(t)).expect("marker of a revoke").0;
        let d = KeyLayout::new(PREFIX).parse_departure(&marker(t), &revoked, Revision(0));
        assert_eq!(d.unwrap().unwrap().record.state, HistoryState::Revoked);
        assert!(on_t.mod_revision < store.revision());
        created(block_on(b.create(t, &attrs("node-bbbb", 8), TTL)).unwrap());
        assert_eq!(store.raw(&marker(t)), None, "an earlier holder's news");
        assert!(batches(&mut own).is_empty());
        // A flannel lease (no node ID) revoked: no history, no marker; peers keep it stale.
        let mut flannel = attrs("node-cccc", 9);
        flannel.node_id = None;
        let u = subnet("10.244.5.0/24");
        store.put_raw(&key("10.244.5.0/24"), &flannel.to_json(), None);
        assert!(block_on(b.revoke(u)).unwrap());
        assert_eq!(store.raw(&marker(u)), None);
    }

    #[test]
    fn release_of_a_key_rewritten_since_is_not_ours() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        block_on(b.revoke(s)).unwrap();
        let theirs = created(block_on(b.create(s, &attrs("node-bbbb", 2), TTL)).unwrap());
        assert_eq!(
            block_on(a.release(&held, &node("node-aaaa"))).unwrap(),
            ReleaseOutcome::NotOurs
        );
        let current = block_on(a.get(s)).unwrap().unwrap().unwrap();
        assert_eq!(current.mod_revision, theirs.mod_revision);
        assert_eq!(current.attrs, attrs("node-bbbb", 2));
    }

    #[test]
    fn revoke_deletes_whoever_holds_it() {
        let (_, store) = setup();
        let (a, op) = (store.client("a"), store.client("operator"));
        let s = subnet("10.244.3.0/24");
        created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        assert!(block_on(op.revoke(s)).unwrap());
        assert!(!block_on(op.revoke(s)).unwrap());
        let last = store.write_log().pop().unwrap();
        assert_eq!((last.client.as_str(), last.kind), ("operator", WriteKind::Revoke));
        assert_eq!(last.previous_node, Some(node("node-aaaa")));
        // History records the revoke (peers unroute it), naming the holder.
        let h = block_on(op.list()).unwrap().history.into_iter().find(|h| h.subnet == s).unwrap();
        assert_eq!(h.record.state, HistoryState::Revoked);
        assert_eq!(h.record.node, node("node-aaaa"));
    }

    #[test]
    fn partition_fails_calls_and_ends_watches_until_healed() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        let mut watch = block_on(a.watch(Revision(0), None)).unwrap();
        store.partition("a", true);
        let (items, ended) = drain_ready(&mut watch);
        assert!(ended);
        assert!(matches!(items.as_slice(), [Err(StoreError::Unavailable(_))]));
        let err = block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap_err();
        assert!(matches!(err, StoreError::Unavailable(_)) && err.is_transient());
        assert!(err.to_string().contains("partitioned"));
        assert!(block_on(a.list()).is_err());
        assert!(block_on(a.watch(Revision(0), None)).is_err());
        // Others are unaffected.
        created(block_on(b.create(s, &attrs("node-bbbb", 2), TTL)).unwrap());
        store.partition("a", false);
        assert_eq!(block_on(a.list()).unwrap().leases.len(), 1);
        // The whole store down: everyone fails, watches end.
        let mut watch = block_on(b.watch(Revision(0), None)).unwrap();
        store.set_down(true);
        assert!(block_on(b.list()).is_err());
        assert!(block_on(a.config()).is_err());
        assert!(drain_ready(&mut watch).1);
        store.set_down(false);
        assert!(block_on(b.list()).is_ok());
    }

    #[test]
    fn leases_expire_during_an_outage() {
        let (clock, store) = setup();
        let a = store.client("a");
        let s = subnet("10.244.3.0/24");
        let held = created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
        store.partition("a", true);
        clock.advance(TTL + secs(1));
        assert!(block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).is_err());
        store.partition("a", false);
        assert_eq!(
            block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap(),
            RenewOutcome::Changed(None)
        );
        created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap());
    }

    #[test]
    fn compaction_fails_old_watch_while_fresh_list_and_watch_work() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s1 = subnet("10.244.1.0/24");
        let first = created(block_on(a.create(s1, &attrs("node-aaaa", 1), TTL)).unwrap());
        block_on(a.renew(&first, &attrs("node-aaaa", 1), TTL)).unwrap();
        // Before compaction, a watch from the first write replays both.
        let mut old = block_on(b.watch(first.mod_revision, None)).unwrap();
        assert_eq!(batches(&mut old).len(), 2);
        store.compact(store.revision());
        let mut stale = block_on(b.watch(first.mod_revision, None)).unwrap();
        let (items, ended) = drain_ready(&mut stale);
        assert!(ended);
        match items.as_slice() {
            [Err(StoreError::Compacted { requested, compact_revision })] => {
                assert_eq!(*requested, first.mod_revision);
                assert_eq!(*compact_revision, store.revision());
            }
            other => panic!("expected Compacted, got {other:?}"),
        }
        // The live watch from before is not affected by compaction.
        let listing = block_on(b.list()).unwrap();
        let mut fresh = block_on(b.watch(Revision(listing.revision.0 + 1), None)).unwrap();
        assert!(batches(&mut fresh).is_empty());
        let s2 = subnet("10.244.2.0/24");
        created(block_on(a.create(s2, &attrs("node-aaaa", 1), TTL)).unwrap());
        assert_eq!(batches(&mut fresh).len(), 1);
        assert_eq!(batches(&mut old).len(), 1);
        // The horizon never moves back, and is clamped to the current revision.
        store.compact(Revision(1));
        store.compact(Revision(1_000));
        assert_eq!(store.compact_revision(), store.revision());
    }

    #[test]
    fn bounded_event_log_compacts_itself() {
        let (_, store) = setup();
        let a = store.client("a");
        store.set_event_log_capacity(2);
        let mut revs = Vec::new();
        for i in 1..=4u8 {
            let s = Subnet::from_parts(Ipv4Addr::new(10, 244, i, 0), 24).unwrap();
            revs.push(
                created(block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap()).mod_revision,
            );
        }
        assert_eq!(store.compact_revision(), revs[2]);
        let (items, _) = drain_ready(&mut block_on(a.watch(revs[1], None)).unwrap());
        assert!(matches!(items.as_slice(), [Err(StoreError::Compacted { .. })]));
        assert_eq!(batches(&mut block_on(a.watch(revs[2], None)).unwrap()).len(), 2);
    }

    #[test]
    fn watch_only_filters_one_key_and_future_from_waits() {
        let (_, store) = setup();
        let a = store.client("a");
        let (s1, s2) = (subnet("10.244.1.0/24"), subnet("10.244.2.0/24"));
        let mut only = block_on(a.watch(Revision(0), Some(LeaseName::single(s2)))).unwrap();
        let mut future = block_on(a.watch(Revision(store.revision().0 + 2), None)).unwrap();
        created(block_on(a.create(s1, &attrs("node-aaaa", 1), TTL)).unwrap());
        let h2 = created(block_on(a.create(s2, &attrs("node-aaaa", 1), TTL)).unwrap());
        let got = batches(&mut only);
        assert_eq!(got.len(), 1);
        match &got[0].events[..] {
            [WatchEvent::Put(stored)] => {
                assert_eq!(stored.subnet, s2);
                assert_eq!(stored.mod_revision, h2.mod_revision);
                assert_eq!(stored.lease_id, h2.lease_id);
            }
            other => panic!("expected one Put, got {other:?}"),
        }
        let got = batches(&mut future);
        assert_eq!(got.iter().map(|b| b.revision).collect::<Vec<_>>(), vec![h2.mod_revision]);
        // History and presence writes are not subnet keys: no events.
        let rec = PresenceRecord {
            incarnation: Incarnation::parse("inc-00000001").unwrap(),
            public_ip: Ipv4Addr::LOCALHOST,
            public_ipv6: None,
        };
        block_on(a.claim_presence(&node("node-aaaa"), &rec, TTL)).unwrap();
        assert!(batches(&mut future).is_empty());
    }

    #[test]
    fn dropped_watch_streams_are_forgotten() {
        let (_, store) = setup();
        let a = store.client("a");
        drop(block_on(a.watch(Revision(0), None)).unwrap());
        created(block_on(a.create(subnet("10.244.1.0/24"), &attrs("node-aaaa", 1), TTL)).unwrap());
        assert!(store.world().watchers.is_empty());
    }

    #[test]
    fn presence_claim_hold_keep_expire_and_drop() {
        let (clock, store) = setup();
        let (first, clone) = (store.client("first"), store.client("clone"));
        let n = node("node-aaaa");
        let mine = PresenceRecord {
            incarnation: Incarnation::parse("inc-00000001").unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, 1),
            public_ipv6: None,
        };
        let theirs = PresenceRecord {
            incarnation: Incarnation::parse("inc-00000002").unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, 2),
            public_ipv6: None,
        };
        let ttl = secs(2);
        let PresenceOutcome::Claimed(lease) =
            block_on(first.claim_presence(&n, &mine, ttl)).unwrap()
        else {
            panic!("expected Claimed");
        };
        let held_by = |o: PresenceOutcome| match o {
            PresenceOutcome::HeldBy { record, mod_revision } => (record, mod_revision),
            other => panic!("expected HeldBy, got {other:?}"),
        };
        let (record, _) = held_by(block_on(clone.claim_presence(&n, &theirs, ttl)).unwrap());
        assert_eq!(record, mine);
        // Claiming again with our own incarnation moves it to a new lease; the old one goes.
        let PresenceOutcome::Claimed(again) =
            block_on(first.claim_presence(&n, &mine, ttl)).unwrap()
        else {
            panic!("expected Claimed");
        };
        assert_ne!(again, lease);
        assert!(!block_on(first.keep_presence(&n, lease, false)).unwrap());
        assert!(!block_on(first.keep_presence(&n, lease, true)).unwrap(), "not on that lease");
        // Kept alive past its TTL; a keep-alive alone leaves the key as it is, a beat moves it.
        let (_, before) = held_by(block_on(clone.claim_presence(&n, &theirs, ttl)).unwrap());
        clock.advance(secs(1));
        assert!(block_on(first.keep_presence(&n, again, false)).unwrap());
        let (_, kept) = held_by(block_on(clone.claim_presence(&n, &theirs, ttl)).unwrap());
        assert_eq!(kept, before);
        clock.advance(secs(1));
        assert!(block_on(first.keep_presence(&n, again, true)).unwrap());
        clock.advance(secs(1));
        let (record, beat) = held_by(block_on(clone.claim_presence(&n, &theirs, ttl)).unwrap());
        assert_eq!(record, mine, "a beat keeps the value");
        assert!(beat > before, "a beat moves the mod revision");
        // Not kept: expires, and the clone may claim.
        clock.advance(secs(2));
        assert!(!block_on(first.keep_presence(&n, again, false)).unwrap());
        let PresenceOutcome::Claimed(clone_lease) =
            block_on(clone.claim_presence(&n, &theirs, ttl)).unwrap()
        else {
            panic!("expected Claimed");
        };
        // Dropping with a lease that is not the key's deletes nothing.
        block_on(first.drop_presence(&n, again)).unwrap();
        assert!(store.raw(&format!("{PREFIX}/weft/nodes/node-aaaa")).is_some());
        block_on(clone.drop_presence(&n, clone_lease)).unwrap();
        assert!(store.raw(&format!("{PREFIX}/weft/nodes/node-aaaa")).is_none());
        assert!(store.live_leases().is_empty());
        assert!(matches!(
            block_on(first.claim_presence(&n, &mine, ttl)).unwrap(),
            PresenceOutcome::Claimed(_)
        ));
    }

    #[test]
    fn fail_next_after_commit_applies_the_write_but_times_out() {
        let (_, store) = setup();
        let (a, b) = (store.client("a"), store.client("b"));
        let s = subnet("10.244.3.0/24");
        store.fail_next_after_commit("a");
        // A compare that fails is no write: the fault waits.
        store.put_raw(&key("10.244.9.0/24"), &attrs("node-bbbb", 2).to_json(), Some(TTL));
        let Ok(CreateOutcome::Exists(_)) =
            block_on(a.create(subnet("10.244.9.0/24"), &attrs("node-aaaa", 1), TTL))
        else {
            panic!("expected Exists");
        };
        let err = block_on(a.create(s, &attrs("node-aaaa", 1), TTL)).unwrap_err();
        assert!(matches!(err, StoreError::Timeout(_)));
        let stored = block_on(b.get(s)).unwrap().unwrap().unwrap();
        assert_eq!(stored.attrs, attrs("node-aaaa", 1));
        assert_eq!(store.write_log().last().unwrap().client, "a");
        // Only once: adopting the key works, and a lost renew reply leaves the old lease.
        let held = HeldLease {
            subnet: s,
            ipv6: None,
            mod_revision: stored.mod_revision,
            lease_id: stored.lease_id,
        };
        store.fail_next_after_commit("a");
        let err = block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap_err();
        assert!(matches!(err, StoreError::Timeout(_)));
        let now = block_on(b.get(s)).unwrap().unwrap().unwrap();
        assert!(now.mod_revision > stored.mod_revision);
        assert!(store.live_leases().iter().any(|(id, _)| *id == stored.lease_id));
        let held = HeldLease {
            subnet: s,
            ipv6: None,
            mod_revision: now.mod_revision,
            lease_id: now.lease_id,
        };
        assert!(matches!(
            block_on(a.renew(&held, &attrs("node-aaaa", 1), TTL)).unwrap(),
            RenewOutcome::Renewed(_)
        ));
    }

    #[test]
    fn garbage_is_skipped_in_list_and_bad_in_watch() {
        let (_, store) = setup();
        let a = store.client("a");
        let mut watch = block_on(a.watch(Revision(0), None)).unwrap();
        store.put_raw(&key("10.244.1.0/24"), b"{not json", None);
        store.put_raw(&format!("{PREFIX}/subnets/not-a-subnet"), b"{}", None);
        store.put_raw(&format!("{PREFIX}/weft/history/10.244.1.0-24"), b"[]", None);
        // flannel's prefix without the slash is not ours to list.
        store.put_raw(&format!("{PREFIX}/subnetsextra"), b"x", None);
        let flannel = br#"{"PublicIP":"192.0.2.9","PublicIPv6":null,"BackendType":"vxlan"}"#;
        store.put_raw(&key("10.244.2.0/24"), flannel, None);
        let listing = block_on(a.list()).unwrap();
        assert_eq!(listing.revision, store.revision());
        assert_eq!(listing.leases.len(), 1);
        assert_eq!(listing.leases[0].lease_id, StoreLeaseId(0), "a reservation");
        assert!(listing.leases[0].attrs.node_id.is_none());
        assert!(listing.history.is_empty());
        let keys: Vec<&str> = listing.skipped.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(
            keys,
            vec![
                key("10.244.1.0/24").as_str(),
                &format!("{PREFIX}/subnets/not-a-subnet"),
                &format!("{PREFIX}/weft/history/10.244.1.0-24"),
            ]
        );
        assert!(listing.skipped[0].problem.contains("not valid JSON"), "{:?}", listing.skipped[0]);
        assert!(listing.skipped[1].problem.starts_with("bad key: "), "{:?}", listing.skipped[1]);
        match block_on(a.get(subnet("10.244.1.0/24"))).unwrap() {
            Some(Err(bad)) => assert_eq!(bad.key, key("10.244.1.0/24")),
            other => panic!("expected a bad entry, got {other:?}"),
        }
        assert_eq!(store.subnet_keys().len(), 1);
        let events: Vec<WatchEvent> =
            batches(&mut watch).into_iter().flat_map(|b| b.events).collect();
        assert_eq!(events.len(), 3);
        assert!(matches!(&events[0], WatchEvent::Bad(bad) if bad.key == key("10.244.1.0/24")));
        assert!(matches!(&events[1], WatchEvent::Bad(_)));
        assert!(
            matches!(&events[2], WatchEvent::Put(stored) if stored.attrs.public_ip == Ipv4Addr::new(192, 0, 2, 9))
        );
        // Garbage is overwritten neither by create nor by a stale renew.
        assert_eq!(
            block_on(a.create(subnet("10.244.1.0/24"), &attrs("node-aaaa", 1), TTL)).unwrap(),
            CreateOutcome::Exists(None)
        );
        assert!(store.delete_raw(&format!("{PREFIX}/subnets/not-a-subnet")));
        assert!(!store.delete_raw(&format!("{PREFIX}/subnets/not-a-subnet")));
        let events: Vec<WatchEvent> =
            batches(&mut watch).into_iter().flat_map(|b| b.events).collect();
        // Told as etcd's watch tells it: a delete, by its key, so that watchers forget it.
        assert!(matches!(&events[..], [WatchEvent::DeleteUnparsed { key, .. }]
            if *key == format!("{PREFIX}/subnets/not-a-subnet")));
    }

    #[test]
    fn raw_ttl_puts_expire_and_reservations_do_not() {
        let (clock, store) = setup();
        let flannel = br#"{"PublicIP":"192.0.2.9","PublicIPv6":null}"#;
        store.put_raw(&key("10.244.1.0/24"), flannel, Some(TTL));
        store.put_raw(&key("10.244.2.0/24"), flannel, None);
        clock.advance(TTL * 10);
        let left: Vec<Subnet> = store.subnet_keys().iter().map(|l| l.subnet).collect();
        assert_eq!(left, vec![subnet("10.244.2.0/24")]);
    }

    /// A config watch gives the value at once, then the value after each write of the key (an
    /// unchanged put too, a delete as `None`), and nothing for other keys; a partition ends it.
    #[test]
    fn config_watch_gives_the_value_then_each_write() {
        let (_, store) = setup();
        let a = store.client("a");
        block_on(a.set_config(b"one")).unwrap();
        let mut w = block_on(a.watch_config()).unwrap();
        let mut next = || w.next().now_or_never().flatten().map(|r| r.unwrap());
        assert_eq!(next(), Some(Some(b"one".to_vec())));
        assert_eq!(next(), None, "nothing written yet");
        block_on(a.set_config(b"two")).unwrap();
        block_on(a.set_config(b"two")).unwrap();
        created(block_on(a.create(subnet("10.244.1.0/24"), &attrs("node-aaaa", 1), TTL)).unwrap());
        assert_eq!(next(), Some(Some(b"two".to_vec())));
        assert_eq!(next(), Some(Some(b"two".to_vec())));
        assert_eq!(next(), None, "a lease is not the config");
        store.world().commit(
            "a",
            WriteKind::Raw,
            vec![Op::Delete { key: format!("{PREFIX}/config") }],
        );
        assert_eq!(next(), Some(None));
        let mut gone = block_on(store.client("b").watch_config()).unwrap();
        assert!(matches!(gone.next().now_or_never(), Some(Some(Ok(None)))), "absent at first");
        store.partition("b", true);
        assert!(matches!(gone.next().now_or_never(), Some(Some(Err(StoreError::Unavailable(_))))));
        assert!(matches!(gone.next().now_or_never(), Some(None)));
    }

    #[test]
    fn config_round_trips() {
        let (_, store) = setup();
        let a = store.client("a");
        assert_eq!(block_on(a.config()).unwrap(), None);
        block_on(a.set_config(br#"{"Network":"10.244.0.0/16"}"#)).unwrap();
        assert_eq!(
            block_on(a.config()).unwrap().as_deref(),
            Some(&br#"{"Network":"10.244.0.0/16"}"#[..])
        );
        assert!(store.raw(&format!("{PREFIX}/config")).is_some());
        assert!(store.write_log().is_empty(), "config is not a subnet key");
    }

    #[test]
    fn same_schedule_gives_same_world() {
        let run = || {
            let (clock, store) = setup();
            let (a, b) = (store.client("a"), store.client("b"));
            for i in 0..20u8 {
                let s = Subnet::from_parts(Ipv4Addr::new(10, 244, i % 5, 0), 24).unwrap();
                let _ = block_on(a.create(s, &attrs("node-aaaa", 1), TTL));
                let _ = block_on(b.create(s, &attrs("node-bbbb", 2), TTL + secs(1)));
                clock.advance(secs(1));
            }
            clock.advance(TTL * 2);
            store.tick();
            (store.write_log(), store.revision(), store.live_leases())
        };
        assert_eq!(run(), run());
    }
}
