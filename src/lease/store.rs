//! The store: what the control plane needs from etcd, as a trait with two implementations —
//! [`crate::lease::etcd::EtcdStore`] (etcd v3) and `crate::lease::memory::MemoryStore`
//! (simulation and unit tests).
//!
//! # Layout
//! flannel's, with weft's history and presence keys beside it: see [`super::keys`], which
//! builds and parses every key.
//! - `<prefix>/subnets/<a.b.c.d>-<len>`: one lease per subnet, attached to a store lease
//!   whose TTL is the subnet lease TTL.
//! - `<prefix>/weft/history/<a.b.c.d>-<len>`: weft's allocation history
//!   ([`HistoryRecord`](super::record::HistoryRecord)),
//!   written in the same transaction as every create, renew and release, so its mod revision
//!   is the cluster-time of the subnet's last write by its holder.
//! - `<prefix>/weft/departures/<a.b.c.d>-<len>`: a departure marker, put in the transaction of
//!   every release and revoke, so that route watchers tell a clean leave from an expiry from the
//!   watch alone (see [`super::keys`], "The route watchers' range").
//! - `<prefix>/weft/nodes/<node-id>`: presence of a running process of that node
//!   ([`PresenceRecord`]), attached to a short store lease the process keeps alive. It tells a
//!   restart (the previous process is gone) from a clone (it is alive).
//!
//! # Contract
//! Every write is a transaction with a compare: there is no blind put of a subnet key anywhere.
//! - [`Store::create`] succeeds only if the key is absent (`Version == 0`).
//! - [`Store::renew`] and [`Store::release`] succeed only while the key's mod revision is the
//!   one the caller holds, so a node can never write to a key another node wrote since.
//! - Values that do not parse are never an error of the whole call: listings skip them and
//!   report them in [`Listing::skipped`]; watches deliver [`WatchEvent::Bad`], and a delete of a
//!   key under `subnets/` whose name does not parse as [`WatchEvent::DeleteUnparsed`].
//! - The network config is raw bytes to the store ([`Store::config`], [`Store::watch_config`]):
//!   parsing it, and saying what an invalid one means, is the reader's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use serde::{Deserialize, Serialize};

pub use super::keys::BadEntry;
pub use super::record::PresenceEntry;
use super::record::{
    HistoryEntry, Incarnation, Ipv6Subnet, LeaseAttrs, LeaseName, NodeId, Revision, StoreLeaseId,
    StoredLease, Subnet, ValueError,
};

/// A boxed error from a client library, kept as the source of a [`StoreError`].
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a store call failed. Every variant is about reaching or talking to the store; a compare
/// that fails is not an error but an outcome ([`CreateOutcome`], [`RenewOutcome`]). The boxed
/// causes are in the message and not also given as `source`, so an error chain says each once.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer in time. Transient: retry.
    #[error("store unavailable: {0}")]
    Unavailable(BoxError),
    /// The call took longer than its deadline. Transient: retry. The outcome is unknown.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// A watch asked for history the store has compacted away: re-list, then watch again.
    #[error("revision {requested:?} is compacted (oldest kept {compact_revision:?})")]
    Compacted {
        /// The revision the watch asked for.
        requested: Revision,
        /// The store's compaction horizon.
        compact_revision: Revision,
    },
    /// A watch asked to start at a revision the store has not reached, although the store
    /// had reached it before: its revisions went backwards (etcd restored from a snapshot
    /// without `--bump-revision`). Re-list, forgetting every revision seen, then watch again.
    #[error(
        "the store's revision went back to {current:?} (a watch asked for {requested:?}): restored from a snapshot?"
    )]
    Rewound {
        /// The revision the watch asked for.
        requested: Revision,
        /// The store's current revision.
        current: Revision,
    },
    /// The store refused the credentials. Not transient.
    #[error("store refused the credentials: {0}")]
    Auth(BoxError),
    /// The client could not be set up (bad endpoint, unreadable TLS file). Not transient.
    #[error("store client set-up failed: {0}")]
    Setup(BoxError),
    /// The store answered with something the protocol does not allow. Not transient.
    #[error("store protocol error: {0}")]
    Protocol(BoxError),
}

impl StoreError {
    /// Whether retrying the same call later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::Timeout(_) | Self::Compacted { .. } | Self::Rewound { .. }
        )
    }
}

/// Every subnet lease and history record, read at one revision.
#[derive(Clone, Debug, Default)]
pub struct Listing {
    /// The revision the listing was read at; watch from `revision + 1`.
    pub revision: Revision,
    /// Live subnet keys, in key order.
    pub leases: Vec<StoredLease>,
    /// History records, in key order.
    pub history: Vec<HistoryEntry>,
    /// Keys that did not parse (skipped; the caller counts them).
    pub skipped: Vec<BadEntry>,
    /// Presence keys, in key order: the running weft processes. Only a listing to choose a
    /// subnet from reads them ([`Store::list_with_presence`]); [`LeaseFeed::list`] leaves this
    /// empty.
    pub presence: Vec<PresenceEntry>,
}

/// A history record to delete with a create, if it is still at `mod_revision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryPrune {
    /// The subnet the record is about.
    pub subnet: Subnet,
    /// The record's mod revision when it was listed.
    pub mod_revision: Revision,
}

/// The lease a process holds: what renew and release compare on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldLease {
    /// The subnet.
    pub subnet: Subnet,
    /// The IPv6 half of the key, on a dual-stack lease: part of the key's exact name.
    pub ipv6: Option<Ipv6Subnet>,
    /// The key's mod revision after our last write.
    pub mod_revision: Revision,
    /// The store lease our last write attached the key to.
    pub lease_id: StoreLeaseId,
}

impl HeldLease {
    /// The key's full name: both halves.
    pub fn name(&self) -> LeaseName {
        LeaseName { subnet: self.subnet, ipv6: self.ipv6 }
    }
}

/// The outcome of a create-if-absent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreateOutcome {
    /// The key was absent and is now ours.
    Created(HeldLease),
    /// The key exists; here is what it holds now (`None` if its value does not parse).
    Exists(Option<StoredLease>),
}

/// The outcome of a renew (or an adopt, which is a renew of a key found by listing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The key still carried the expected mod revision and is now rewritten.
    Renewed(HeldLease),
    /// The key changed since: here is what it holds now (`None` = absent; a key whose value
    /// does not parse is reported as [`RenewOutcome::Unreadable`]).
    Changed(Option<StoredLease>),
    /// The key changed and its value does not parse: it is not ours.
    Unreadable,
}

/// The outcome of a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The key was ours and is deleted; history says relinquished.
    Released,
    /// The key was no longer ours (or gone); nothing was written.
    NotOurs,
}

/// The value of a presence key (`<prefix>/weft/nodes/<node-id>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PresenceRecord {
    /// The running process.
    pub incarnation: Incarnation,
    /// Its public IP.
    pub public_ip: Ipv4Addr,
    /// Its public IPv6 address, on a network that carries IPv6 (absent from the records of
    /// older wefts, and of nodes without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ipv6: Option<Ipv6Addr>,
}

impl PresenceRecord {
    /// The process's address for people to read: `public_ip`, or on an IPv6-only network
    /// (`0.0.0.0`) `public_ipv6` ([`super::record::shown_addr`]).
    pub fn public_addr(&self) -> IpAddr {
        super::record::shown_addr(self.public_ip, self.public_ipv6)
    }

    /// Parses a presence key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ValueError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The JSON written to the store.
    pub fn to_json(&self) -> Vec<u8> {
        // Plain fields: serializing cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The outcome of claiming presence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PresenceOutcome {
    /// The presence key was absent (or ours) and now carries our record on this store lease.
    Claimed(StoreLeaseId),
    /// Another process of the same node holds it (alive, or dead and not yet expired).
    HeldBy {
        /// Its record.
        record: PresenceRecord,
        /// The key's mod revision: it moves while that process lives (see
        /// [`Store::keep_presence`]'s `beat`).
        mod_revision: Revision,
    },
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A subnet key was created or rewritten.
    Put(StoredLease),
    /// A subnet key was deleted (expiry, release or revoke).
    Delete {
        /// The subnet.
        subnet: Subnet,
        /// The revision of the delete.
        revision: Revision,
    },
    /// A subnet key was written with something that does not parse (its name or its value).
    /// Skip and count it.
    Bad(BadEntry),
    /// A key under `<prefix>/subnets/` whose name does not parse (so no [`WatchEvent::Delete`]
    /// can name it) was deleted: whatever was said about it (ignored, warned about) is
    /// forgotten. Not a bad entry: nothing unreadable is left.
    DeleteUnparsed {
        /// The full key.
        key: String,
        /// The revision of the delete.
        revision: Revision,
    },
    /// A departure marker (`<prefix>/weft/departures/<subnet>`) was written: a release or an
    /// operator's revoke, in the transaction (so at the revision) of the subnet key's
    /// [`WatchEvent::Delete`], which comes in the same batch.
    Departed(HistoryEntry),
}

/// A batch of watch events, all at or below `revision`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchBatch {
    /// The store revision the batch brings the watcher up to; resume from `revision + 1`.
    pub revision: Revision,
    /// The events, in revision order.
    pub events: Vec<WatchEvent>,
}

/// A watch: batches until the store fails. [`StoreError::Compacted`] means "re-list".
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchBatch, StoreError>> + Send>>;

/// A watch of the network config ([`Store::watch_config`]): the raw value (`None`: the key is
/// absent), first as it was when the watch started, then after each write of it; one error
/// ends it (watch again, which reads the value afresh).
pub type ConfigWatchStream =
    Pin<Box<dyn Stream<Item = Result<Option<Vec<u8>>, StoreError>> + Send>>;

/// Every subnet lease, listed and watched: what the route watcher reads. A [`Store`] is one;
/// so is the Kubernetes subnet manager's view of the Nodes ([`super::kube`]).
#[async_trait::async_trait]
pub trait LeaseFeed: Send + Sync {
    /// All subnet leases and history at one revision.
    async fn list(&self) -> Result<Listing, StoreError>;

    /// Watches subnet keys and departure markers from `from` (inclusive; `0` or less means
    /// "from the next revision", as in etcd). `only` narrows it to one lease's exact key (and
    /// no markers).
    async fn watch(
        &self,
        from: Revision,
        only: Option<LeaseName>,
    ) -> Result<WatchStream, StoreError>;
}

/// What the control plane needs from the store. See the module docs for the contract.
#[async_trait::async_trait]
pub trait Store: LeaseFeed {
    /// [`LeaseFeed::list`] with the presence keys too ([`Listing::presence`]), all at one
    /// revision: what the keeper chooses a subnet from, so that nodes joining at once can tell
    /// who else is joining (`policy::choose`).
    async fn list_with_presence(&self) -> Result<Listing, StoreError>;

    /// The raw network config (`<prefix>/config`), if set.
    async fn config(&self) -> Result<Option<Vec<u8>>, StoreError>;

    /// Writes the network config. The caller validates it first.
    async fn set_config(&self, value: &[u8]) -> Result<(), StoreError>;

    /// Watches the network config: its value now, then its value after every put or delete
    /// of the key (a put of an unchanged value included: telling what changed is the reader's;
    /// writes the store reports together may come as one item, the latest value). Nothing
    /// written between the first read and the watch is missed: the watch starts at the read's
    /// revision.
    async fn watch_config(&self) -> Result<ConfigWatchStream, StoreError>;

    /// The subnet's key, in either form (`X` or `X&…`). `Ok(None)` if absent; `Ok(Some(Err(..)))`
    /// if its value does not parse.
    async fn get(
        &self,
        subnet: Subnet,
    ) -> Result<Option<Result<StoredLease, BadEntry>>, StoreError>;

    /// Creates the subnet's key (IPv4-only) if absent, attached to a new store lease of `ttl`,
    /// records `Held` in history and deletes the subnet's departure marker, in one transaction.
    async fn create(
        &self,
        subnet: Subnet,
        attrs: &LeaseAttrs,
        ttl: Duration,
    ) -> Result<CreateOutcome, StoreError> {
        self.create_pruning(LeaseName::single(subnet), attrs, ttl, &[]).await
    }

    /// [`Store::create`] of the key `name` (both halves), which succeeds only if no key names
    /// its IPv4 subnet, in either form (`X` or `X&…`): two keys for one subnet would be two
    /// holders. The history record carries the IPv6 half. In the same transaction, if it
    /// creates, it deletes the history
    /// records in `prune` whose mod revision is still the one given (each under its own
    /// compare, so a record rewritten since — another node took that subnet — is left alone),
    /// each with its subnet's departure marker.
    /// The keeper passes this node's own records of other subnets, which the new lease
    /// supersedes ([`super::policy::superseded_history`]): that bounds the history to about one
    /// record per node.
    async fn create_pruning(
        &self,
        name: LeaseName,
        attrs: &LeaseAttrs,
        ttl: Duration,
        prune: &[HistoryPrune],
    ) -> Result<CreateOutcome, StoreError>;

    /// Rewrites the key with `attrs` on a new store lease of `ttl` only if it exists and its mod
    /// revision is still `held.mod_revision` (never 0: that would match an absent key); records `Held` in history; revokes `held.lease_id` after.
    async fn renew(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
        ttl: Duration,
    ) -> Result<RenewOutcome, StoreError>;

    /// Renews without rewriting the key: keeps `held.lease_id` alive (to its full TTL), then,
    /// only if the key's mod revision is still `held.mod_revision`, rewrites its history record
    /// (`Held`, from `attrs`) so that the record's revision says when the holder was last seen.
    /// `Renewed(held)` (unchanged) if both held; otherwise what the key holds now, as
    /// [`Store::renew`] reports it. A store lease that is gone is never `Renewed`: its key went
    /// with it. Route watchers see no event: only the history key is written.
    async fn refresh(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
    ) -> Result<RenewOutcome, StoreError>;

    /// Deletes the key only if its mod revision is still `held.mod_revision`, and records
    /// `Relinquished` in history and in the subnet's departure marker, in one transaction.
    async fn release(&self, held: &HeldLease, node: &NodeId) -> Result<ReleaseOutcome, StoreError>;

    /// Operator action: deletes a subnet's key (either form) whoever holds it. `Ok(false)` if it was absent.
    /// A weft lease (one that names its node) gets `Revoked` in history and in its departure
    /// marker, in the same transaction; a flannel lease gets neither, and its peers keep its
    /// route (stale), as for an expiry.
    async fn revoke(&self, subnet: Subnet) -> Result<bool, StoreError>;

    /// Claims `<prefix>/weft/nodes/<node>` on a new store lease of `ttl`: succeeds if the key is
    /// absent or already carries `record.incarnation`.
    async fn claim_presence(
        &self,
        node: &NodeId,
        record: &PresenceRecord,
        ttl: Duration,
    ) -> Result<PresenceOutcome, StoreError>;

    /// Keeps a presence lease alive. `Ok(false)` if it has expired (claim again). With `beat`,
    /// first rewrites `<prefix>/weft/nodes/<node>` (same value, same lease) if it is still on
    /// `lease`, so that its mod revision moves: the proof of life that a process waiting on
    /// the key looks for, which a dead process's key never gives however long etcd keeps it
    /// (its minimum TTL, leader changes). `Ok(false)` too if the key is no longer on `lease`.
    async fn keep_presence(
        &self,
        node: &NodeId,
        lease: StoreLeaseId,
        beat: bool,
    ) -> Result<bool, StoreError>;

    /// Deletes our presence (clean shutdown), so a restart need not wait for it to expire.
    async fn drop_presence(&self, node: &NodeId, lease: StoreLeaseId) -> Result<(), StoreError>;

    /// This host's address changed: connections from the old one are dead though nothing
    /// says so yet (no RST comes for an address that is gone), so the next call should open
    /// new ones rather than wait for keep-alives to notice. A store without connections
    /// ignores it.
    fn reconnect(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Presence records name the process by its IPv6 address on an IPv6-only network, and
    /// records without `public_ipv6` (older wefts) still read; none is written when absent.
    #[test]
    fn presence_records_carry_the_ipv6_address_where_there_is_one() {
        let old = br#"{"incarnation":"inc-00000001","public_ip":"192.0.2.1"}"#;
        let old = PresenceRecord::from_json(old).unwrap();
        assert_eq!((old.public_ipv6, old.public_addr()), (None, IpAddr::from([192, 0, 2, 1])));
        assert_eq!(old.to_json(), br#"{"incarnation":"inc-00000001","public_ip":"192.0.2.1"}"#);
        let v6: Ipv6Addr = "2001:db8::1".parse().unwrap();
        let only = PresenceRecord {
            public_ip: Ipv4Addr::UNSPECIFIED,
            public_ipv6: Some(v6),
            ..old.clone()
        };
        assert_eq!(only.public_addr(), IpAddr::V6(v6));
        assert_eq!(PresenceRecord::from_json(&only.to_json()).unwrap(), only);
        // Dual stack: the IPv4 address is the one shown.
        let dual = PresenceRecord { public_ipv6: Some(v6), ..old };
        assert_eq!(dual.public_addr(), IpAddr::from([192, 0, 2, 1]));
    }
}
