//! The lease → route state machine: listings and watch batches in, [`RouteTable`]s out. Pure:
//! no store, no clock, no I/O; [`super::watcher`] drives it.
//!
//! # Rules (docs/lease-rules.md, "Loss and reclaim")
//! - The route for this host's own subnet ([`RouteSet::set_own`]) is never published; it is
//!   remembered, so that it appears as soon as the subnet is no longer ours.
//! - A **Put** adds or replaces the subnet's route: a new holder replaces the old one.
//! - A **Delete** with a **departure marker** of the same subnet at the same revision in the
//!   same batch ([`WatchEvent::Departed`], saying `Relinquished` or `Revoked`) is a clean
//!   leave: a release and a revoke write the marker in the delete's transaction, and etcd never
//!   splits a revision over two batches. The route is dropped.
//! - Any other **Delete** (an expiry; a flannel peer's leave, which writes no marker) keeps the
//!   route but marks it [`Peer::stale`]: the host is most likely partitioned, not gone. A stale
//!   route is still used for forwarding. A marker alone (its delete was covered by a listing or
//!   is older than the route) changes nothing.
//! - A **listing** is authoritative: keys present become routes (not stale). A key absent from
//!   it whose history says `Relinquished` after the last write we saw (a clean leave) loses its
//!   route; any other absent key keeps its route as stale — the host is most likely
//!   partitioned, not gone — until that subnet is leased to someone else.
//! - Only a lease of this network becomes a route: a key inside the network of exactly its
//!   `SubnetLen` ([`Subnet::check_lease_of`]). Any other key under `subnets/` (`0.0.0.0-0`, a
//!   `/32`, a `/25` inside a lease, another network's subnet) is ignored, so it can neither
//!   steal traffic nor widen what a sender may claim as an inner source.
//! - Entries that do not parse, foreign keys, and leases that cannot be routed to
//!   ([`PeerError`]) are skipped, counted ([`RouteSet::bad_entries`]) and kept by key in
//!   [`RouteSet::ignored`] (for a warning and a gauge); an existing route for a subnet whose
//!   key turned unreadable is kept and marked stale (we cannot tell who holds it now).
//!   flannel's IPv6-only leases (`0.0.0.0-0&<v6>`) are leases, not garbage: they are neither
//!   routed (no IPv4 subnet) nor reported.
//! - Revisions: a listing at revision `r` makes the watch resume from `r + 1`, a batch at
//!   revision `b` from `b + 1` ([`RouteSet::resume_revision`]). Events a listing already covers
//!   (at or below its revision) are ignored, so a re-list may run while the old watch goes on.
//!
//! [`PeerError`]: super::table::PeerError

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

use ipnet::Ipv4Net;

use super::table::{Peer, Peer6, RouteTable};
use crate::lease::keys;
use crate::lease::record::{HistoryState, Revision, StoredLease, Subnet};
use crate::lease::store::{BadEntry, Listing, WatchBatch, WatchEvent};

/// The latest known route of one subnet and the key revision it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    peer: Peer,
    /// The mod revision of the key write this route came from.
    mod_revision: Revision,
}

/// The latest known route per subnet, built from listings and watch events. See the module
/// docs for the rules.
#[derive(Clone, Debug)]
pub struct RouteSet {
    network: Ipv4Net,
    subnet_len: u8,
    own: Option<Subnet>,
    entries: BTreeMap<Subnet, Entry>,
    /// The revision of the last listing applied (`None`: none yet).
    listed_at: Option<Revision>,
    resume: Revision,
    needs_relist: bool,
    bad_entries: u64,
    /// Keys under `subnets/` that are skipped, by key, with why: rebuilt by every listing,
    /// added to by watch events (and removed by a delete of a key that parses).
    ignored: BTreeMap<String, String>,
    /// Routed leases whose IPv6 half cannot be carried (why, by key): they are routed over
    /// IPv4 only. Rebuilt by every listing, kept up by watch events.
    ipv4_only: BTreeMap<String, String>,
}

impl RouteSet {
    /// An empty set for `network` whose leases are normally `/subnet_len`.
    pub fn new(network: Ipv4Net, subnet_len: u8) -> Self {
        Self {
            network,
            subnet_len,
            own: None,
            entries: BTreeMap::new(),
            listed_at: None,
            resume: Revision(0),
            needs_relist: false,
            bad_entries: 0,
            ignored: BTreeMap::new(),
            ipv4_only: BTreeMap::new(),
        }
    }

    /// Sets this host's own subnet, whose route is never published. When the own subnet moves
    /// away from a subnet whose route is stale, that route is dropped: it was this host's own
    /// leftover, never a peer's. Returns whether the table changed.
    pub fn set_own(&mut self, own: Option<Subnet>) -> bool {
        if own == self.own {
            return false;
        }
        let mut changed = false;
        if let Some(old) = self.own {
            if self.entries.get(&old).is_some_and(|e| e.peer.stale) {
                self.entries.remove(&old);
            } else {
                changed |= self.entries.contains_key(&old);
            }
        }
        if let Some(new) = own {
            changed |= self.entries.contains_key(&new);
        }
        self.own = own;
        changed
    }

    /// This host's own subnet, as last set.
    pub fn own(&self) -> Option<Subnet> {
        self.own
    }

    /// Replaces the set with what `listing` says, keeping the stale routes the rules keep.
    /// Clears [`RouteSet::needs_relist`]. Returns whether the table changed.
    pub fn apply_listing(&mut self, listing: &Listing) -> bool {
        let mut next: BTreeMap<Subnet, Entry> = BTreeMap::new();
        let mut unreadable: BTreeSet<Subnet> = BTreeSet::new();
        self.ignored.clear();
        self.ipv4_only.clear();
        for lease in &listing.leases {
            match self.route_of(lease) {
                Ok(peer) => {
                    self.note_half(lease);
                    next.insert(lease.subnet, Entry { peer, mod_revision: lease.mod_revision });
                }
                Err(Skip::Foreign(why)) => self.ignore(lease_key(lease.subnet), why),
                Err(Skip::Unroutable(why)) => {
                    self.ignore(lease_key(lease.subnet), why);
                    unreadable.insert(lease.subnet);
                }
            }
        }
        for bad in &listing.skipped {
            if let Some(subnet) = self.ignore_bad(bad) {
                unreadable.insert(subnet);
            }
        }
        let relinquished: BTreeMap<Subnet, Revision> = listing
            .history
            .iter()
            .filter(|h| {
                matches!(h.record.state, HistoryState::Relinquished | HistoryState::Revoked)
            })
            .map(|h| (h.subnet, h.mod_revision))
            .collect();
        for (subnet, old) in &self.entries {
            if next.contains_key(subnet) {
                continue;
            }
            // A release (or an operator's revoke) deletes the key and writes the history in one
            // transaction, after the holder's last write: an older record is about an earlier
            // holder. An expiry writes nothing, so an expired peer's route stays (stale).
            let left_cleanly = !unreadable.contains(subnet)
                && relinquished.get(subnet).is_some_and(|rev| *rev > old.mod_revision);
            if !left_cleanly {
                let mut kept = old.clone();
                kept.peer.stale = true;
                next.insert(*subnet, kept);
            }
        }
        let changed = self.visible_differs(&next);
        self.entries = next;
        self.listed_at = Some(listing.revision);
        self.resume = self.resume.max(Revision(listing.revision.0.saturating_add(1)));
        self.needs_relist = false;
        changed
    }

    /// Applies one watch batch. Returns whether the table changed.
    pub fn apply_batch(&mut self, batch: &WatchBatch) -> bool {
        if batch.revision < self.resume {
            // Already covered by a listing or an earlier batch.
            return false;
        }
        // The clean leaves of this batch: each delete they name (same subnet, same revision)
        // drops its route instead of marking it stale.
        let departed: BTreeSet<(Subnet, Revision)> = batch
            .events
            .iter()
            .filter_map(|e| match e {
                WatchEvent::Departed(h)
                    if matches!(
                        h.record.state,
                        HistoryState::Relinquished | HistoryState::Revoked
                    ) =>
                {
                    Some((h.subnet, h.mod_revision))
                }
                _ => None,
            })
            .collect();
        let mut changed = false;
        for event in &batch.events {
            changed |= self.apply_event(event, &departed);
        }
        self.resume = Revision(batch.revision.0.saturating_add(1));
        changed
    }

    fn covered(&self, revision: Revision) -> bool {
        self.listed_at.is_some_and(|at| revision <= at)
    }

    fn apply_event(&mut self, event: &WatchEvent, departed: &BTreeSet<(Subnet, Revision)>) -> bool {
        match event {
            WatchEvent::Put(lease) => {
                if self.covered(lease.mod_revision)
                    || self
                        .entries
                        .get(&lease.subnet)
                        .is_some_and(|e| e.mod_revision > lease.mod_revision)
                {
                    return false;
                }
                match self.route_of(lease) {
                    Ok(peer) => {
                        self.ignored.remove(&lease_key(lease.subnet));
                        self.note_half(lease);
                        let entry = Entry { peer, mod_revision: lease.mod_revision };
                        let old = self.entries.insert(lease.subnet, entry);
                        self.is_visible(lease.subnet)
                            && old.map(|e| e.peer).as_ref() != self.peer(lease.subnet)
                    }
                    Err(Skip::Foreign(why)) => {
                        self.ipv4_only.remove(&lease_key(lease.subnet));
                        self.ignore(lease_key(lease.subnet), why);
                        false
                    }
                    Err(Skip::Unroutable(why)) => {
                        self.ipv4_only.remove(&lease_key(lease.subnet));
                        self.ignore(lease_key(lease.subnet), why);
                        self.mark_stale(lease.subnet)
                    }
                }
            }
            WatchEvent::Delete { subnet, revision } => {
                self.ignored.remove(&lease_key(*subnet));
                self.ipv4_only.remove(&lease_key(*subnet));
                if self.covered(*revision)
                    || self.entries.get(subnet).is_none_or(|e| e.mod_revision >= *revision)
                {
                    return false;
                }
                if departed.contains(&(*subnet, *revision)) {
                    self.entries.remove(subnet);
                    return self.is_visible(*subnet);
                }
                // An expiry, or a leave that wrote no marker: keep forwarding, stale.
                self.mark_stale(*subnet)
            }
            WatchEvent::Bad(bad) => {
                let Some(subnet) = self.ignore_bad(bad) else { return false };
                // The key was written again (with garbage): the subnet is occupied, by whom we
                // cannot tell, so its route stays, stale.
                self.mark_stale(subnet)
            }
            // Read with the delete it names (see `apply_batch`).
            WatchEvent::Departed(_) => false,
        }
    }

    /// The route a lease gives, or why it gives none.
    fn route_of(&self, lease: &StoredLease) -> Result<Peer, Skip> {
        lease
            .subnet
            .check_lease_of(self.network, self.subnet_len)
            .map_err(|e| Skip::Foreign(e.to_string()))?;
        Peer::from_lease(lease).map_err(|e| Skip::Unroutable(format!("cannot route to it: {e}")))
    }

    /// Records whether a routed lease's IPv6 half can be carried ([`Peer6::from_lease`]).
    fn note_half(&mut self, lease: &StoredLease) {
        let key = lease_key(lease.subnet);
        match (lease.ipv6, Peer6::from_lease(lease)) {
            (Some(half), Err(e)) => {
                self.ipv4_only.insert(key, format!("its IPv6 half {half} cannot be routed: {e}"));
            }
            _ => {
                self.ipv4_only.remove(&key);
            }
        }
    }

    fn ignore(&mut self, key: String, why: String) {
        self.bad_entries += 1;
        self.ignored.insert(key, why);
    }

    /// Records a skipped subnet key (history keys are not routes and are left to the lease
    /// driver); returns its subnet if its name parses to a lease of this network, whose route
    /// an unreadable value makes stale.
    fn ignore_bad(&mut self, bad: &BadEntry) -> Option<Subnet> {
        let subnet = bad.subnet_key()?;
        if bad.is_ipv6_only_lease() {
            return None;
        }
        let name = bad.key.rsplit('/').next().unwrap_or(&bad.key);
        self.ignore(keys::relative_subnet_key(name), bad.problem.clone());
        subnet.filter(|s| s.check_lease_of(self.network, self.subnet_len).is_ok())
    }

    /// Marks a subnet's route stale; whether the table changed.
    fn mark_stale(&mut self, subnet: Subnet) -> bool {
        let visible = self.is_visible(subnet);
        match self.entries.get_mut(&subnet) {
            Some(e) if !e.peer.stale => {
                e.peer.stale = true;
                visible
            }
            _ => false,
        }
    }

    fn is_visible(&self, subnet: Subnet) -> bool {
        self.own != Some(subnet)
    }

    /// Whether the published part of `next` differs from the current one.
    fn visible_differs(&self, next: &BTreeMap<Subnet, Entry>) -> bool {
        fn visible(
            m: &BTreeMap<Subnet, Entry>,
            own: Option<Subnet>,
        ) -> impl Iterator<Item = &Peer> {
            m.iter().filter(move |(s, _)| Some(**s) != own).map(|(_, e)| &e.peer)
        }
        !visible(&self.entries, self.own).eq(visible(next, self.own))
    }

    /// Forgets every revision seen, for a store whose revisions went backwards (restored from
    /// a snapshot): the next listing sets where the watch resumes, and its keys replace the
    /// routes (those it lacks are kept stale, as for any listing).
    pub(crate) fn forget_revisions(&mut self) {
        // Revisions of the old timeline would make every new event look older than the route.
        for e in self.entries.values_mut() {
            e.mod_revision = Revision(0);
        }
        self.listed_at = None;
        self.resume = Revision(0);
        self.needs_relist = true;
    }

    /// Whether only a listing can bring the set up to date (the store went back in time);
    /// cleared by [`RouteSet::apply_listing`].
    pub fn needs_relist(&self) -> bool {
        self.needs_relist
    }

    /// The revision to (re)start the watch from: the last listing's or batch's revision + 1
    /// (`0`, "from now", before any).
    pub fn resume_revision(&self) -> Revision {
        self.resume
    }

    /// Entries skipped so far because they did not parse or could not be routed to (each time
    /// one is seen: a re-list counts a lingering one again).
    pub fn bad_entries(&self) -> u64 {
        self.bad_entries
    }

    /// Keys under `subnets/` currently skipped (`subnets/<name>` → why), as of the last listing
    /// and the watch events since.
    pub fn ignored(&self) -> &BTreeMap<String, String> {
        &self.ignored
    }

    /// The routed leases whose IPv6 half cannot be carried, by key, with why (on a dual-stack
    /// vxlan network, for a warning and a gauge: a peer reached over IPv4 only).
    pub fn ipv4_only(&self) -> &BTreeMap<String, String> {
        &self.ipv4_only
    }

    /// The route the set holds for `subnet`, including the own subnet's (which
    /// [`RouteSet::table`] leaves out).
    pub fn peer(&self, subnet: Subnet) -> Option<&Peer> {
        self.entries.get(&subnet).map(|e| &e.peer)
    }

    /// The table to publish: every route but the own subnet's.
    pub fn table(&self) -> RouteTable {
        let peers =
            self.entries.iter().filter(|(s, _)| self.is_visible(**s)).map(|(_, e)| e.peer.clone());
        RouteTable::build(self.network, self.subnet_len, peers)
    }
}

/// Why a parsed lease gives no route.
enum Skip {
    /// Not a lease of this network: ignored, whatever happens to its subnet's routes.
    Foreign(String),
    /// A lease of this network whose value cannot be routed to (bad backend data): its
    /// subnet's existing route goes stale.
    Unroutable(String),
}

/// How [`RouteSet::ignored`] names the key of a parsed lease.
fn lease_key(subnet: Subnet) -> String {
    keys::relative_subnet_key(&subnet.key_name())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use crate::dataplane::wire::ethernet::MacAddr;

    use super::*;
    use crate::lease::record::{
        HistoryEntry, HistoryRecord, LeaseAttrs, NodeId, StoreLeaseId, StoredLease,
    };
    use crate::lease::store::BadEntry;

    const PREFIX: &str = "/coreos.com/network";

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn set() -> RouteSet {
        RouteSet::new("10.244.0.0/16".parse().unwrap(), 24)
    }

    fn lease(s: &str, host: u8, rev: i64) -> StoredLease {
        let json = format!(
            r#"{{"PublicIP":"192.0.2.{host}","BackendType":"vxlan","BackendData":{{"VNI":1,"VtepMAC":"02:00:00:00:00:{host:02x}"}}}}"#
        );
        StoredLease {
            subnet: subnet(s),
            ipv6: None,
            attrs: LeaseAttrs::from_json(json.as_bytes()).unwrap(),
            create_revision: Revision(rev),
            mod_revision: Revision(rev),
            lease_id: StoreLeaseId(rev),
        }
    }

    fn put(s: &str, host: u8, rev: i64) -> WatchBatch {
        WatchBatch { revision: Revision(rev), events: vec![WatchEvent::Put(lease(s, host, rev))] }
    }

    fn delete(s: &str, rev: i64) -> WatchBatch {
        WatchBatch {
            revision: Revision(rev),
            events: vec![WatchEvent::Delete { subnet: subnet(s), revision: Revision(rev) }],
        }
    }

    fn history(s: &str, state: HistoryState, rev: i64) -> HistoryEntry {
        HistoryEntry {
            subnet: subnet(s),
            record: HistoryRecord {
                state,
                node: NodeId::parse("node-aaaa").unwrap(),
                public_ip: Ipv4Addr::new(192, 0, 2, 1),
                ipv6: None,
            },
            mod_revision: Revision(rev),
        }
    }

    fn listing(rev: i64, leases: Vec<StoredLease>, history: Vec<HistoryEntry>) -> Listing {
        Listing { revision: Revision(rev), leases, history, skipped: vec![] }
    }

    fn bad(name: &str) -> BadEntry {
        BadEntry { key: format!("{PREFIX}/subnets/{name}"), problem: "garbage".into() }
    }

    /// (subnet, last octet of the public IP, stale) for every published route.
    fn routes(set: &RouteSet) -> Vec<(String, u8, bool)> {
        set.table()
            .peers()
            .iter()
            .map(|p| (p.subnet.to_string(), p.public_ip.octets()[3], p.stale))
            .collect()
    }

    fn r(s: &str, host: u8, stale: bool) -> (String, u8, bool) {
        (s.to_string(), host, stale)
    }

    #[test]
    fn put_adds_a_route_and_advances_the_revision() {
        let mut s = set();
        assert!(!s.apply_listing(&listing(10, vec![], vec![])));
        assert_eq!(s.resume_revision(), Revision(11));
        assert!(s.apply_batch(&put("10.244.1.0/24", 1, 11)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);
        assert_eq!(s.resume_revision(), Revision(12));
        let p = s.table().lookup(Ipv4Addr::new(10, 244, 1, 9)).cloned().unwrap();
        assert_eq!(p.vtep_mac, Some(MacAddr([2, 0, 0, 0, 0, 1])));
    }

    #[test]
    fn put_by_a_new_holder_replaces_the_route() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        assert!(s.apply_batch(&put("10.244.1.0/24", 2, 11)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false)]);
    }

    #[test]
    fn renewal_with_the_same_value_changes_nothing() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        assert!(!s.apply_batch(&put("10.244.1.0/24", 1, 11)));
        assert_eq!(s.resume_revision(), Revision(12));
    }

    /// The delete and the departure marker a release (or revoke) writes in one transaction.
    fn leave(s: &str, rev: i64, state: HistoryState) -> WatchBatch {
        WatchBatch {
            revision: Revision(rev),
            events: vec![
                WatchEvent::Delete { subnet: subnet(s), revision: Revision(rev) },
                WatchEvent::Departed(history(s, state, rev)),
            ],
        }
    }

    #[test]
    fn a_delete_without_a_departure_keeps_the_route_stale_and_asks_for_nothing() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        assert!(s.apply_batch(&delete("10.244.1.0/24", 11)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
        assert!(!s.needs_relist(), "an expiry is no reason to list everything");
        assert_eq!(s.table().stale_count(), 1);
        // The stale route still forwards.
        assert!(s.table().lookup(Ipv4Addr::new(10, 244, 1, 1)).is_some());
        // A delete of an unknown subnet is no news.
        assert!(!s.apply_batch(&delete("10.244.9.0/24", 12)));
        // Until another host leases it.
        assert!(s.apply_batch(&put("10.244.1.0/24", 2, 13)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false)]);
    }

    #[test]
    fn a_delete_with_its_departure_marker_drops_the_route_in_either_order() {
        for state in [HistoryState::Relinquished, HistoryState::Revoked] {
            for reversed in [false, true] {
                let mut s = set();
                s.apply_listing(&listing(
                    10,
                    vec![lease("10.244.1.0/24", 1, 5), lease("10.244.2.0/24", 2, 6)],
                    vec![],
                ));
                let mut b = leave("10.244.1.0/24", 11, state);
                if reversed {
                    b.events.reverse();
                }
                assert!(s.apply_batch(&b), "{state:?}");
                assert_eq!(routes(&s), [r("10.244.2.0/24", 2, false)], "{state:?} {reversed}");
                assert!(!s.needs_relist());
            }
        }
    }

    #[test]
    fn a_marker_that_is_not_the_deletes_own_keeps_the_route_stale() {
        let other_revision = WatchBatch {
            revision: Revision(11),
            events: vec![
                WatchEvent::Delete { subnet: subnet("10.244.1.0/24"), revision: Revision(11) },
                WatchEvent::Departed(history("10.244.1.0/24", HistoryState::Relinquished, 3)),
            ],
        };
        let other_subnet = WatchBatch {
            revision: Revision(11),
            events: vec![
                WatchEvent::Delete { subnet: subnet("10.244.1.0/24"), revision: Revision(11) },
                WatchEvent::Departed(history("10.244.3.0/24", HistoryState::Relinquished, 11)),
            ],
        };
        let held = leave("10.244.1.0/24", 11, HistoryState::Held);
        for b in [other_revision, other_subnet, held] {
            let mut s = set();
            s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
            s.apply_batch(&b);
            assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)], "{b:?}");
        }
        // A marker in a later batch than its delete is not the delete's: etcd never splits
        // a revision, so this is another transaction's (or garbage).
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let late = WatchBatch {
            revision: Revision(12),
            events: vec![WatchEvent::Departed(history(
                "10.244.1.0/24",
                HistoryState::Relinquished,
                11,
            ))],
        };
        assert!(!s.apply_batch(&late));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
    }

    #[test]
    fn a_leave_of_an_older_write_than_the_route_changes_nothing() {
        let mut s = set();
        // Host 2 took the subnet at 12; a replayed leave of host 1 at 11 is old news.
        s.apply_listing(&listing(12, vec![lease("10.244.1.0/24", 2, 12)], vec![]));
        assert!(!s.apply_batch(&leave("10.244.1.0/24", 11, HistoryState::Relinquished)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false)]);
        // Left and retaken in one batch: the new holder's put wins.
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        let mut b = leave("10.244.1.0/24", 11, HistoryState::Relinquished);
        b.events.push(WatchEvent::Put(lease("10.244.1.0/24", 2, 12)));
        b.revision = Revision(12);
        assert!(s.apply_batch(&b));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false)]);
    }

    #[test]
    fn garbage_written_after_the_delete_keeps_the_route_stale() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let b = WatchBatch {
            revision: Revision(12),
            events: vec![WatchEvent::Bad(bad("10.244.1.0-24"))],
        };
        s.apply_batch(&b);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
    }

    #[test]
    fn a_wave_of_leaves_and_expiries_is_told_apart_without_a_listing() {
        let leases = (1..=40).map(|i| lease(&format!("10.244.{i}.0/24"), i, 5)).collect();
        let mut s = set();
        s.apply_listing(&listing(10, leases, vec![]));
        // 30 leave (every other one cleanly), all in one batch of many revisions.
        let mut wave = WatchBatch { revision: Revision(40), events: Vec::new() };
        for i in 1..=30u8 {
            let b = if i % 2 == 0 {
                leave(&format!("10.244.{i}.0/24"), 10 + i64::from(i), HistoryState::Relinquished)
            } else {
                delete(&format!("10.244.{i}.0/24"), 10 + i64::from(i))
            };
            wave.events.extend(b.events);
        }
        assert!(s.apply_batch(&wave));
        assert!(!s.needs_relist());
        let t = routes(&s);
        assert_eq!(t.len(), 25, "15 left cleanly, 15 expired (stale), 10 untouched");
        assert_eq!(t.iter().filter(|(_, _, stale)| *stale).count(), 15);
        for (subnet, host, stale) in &t {
            assert!(*host % 2 == 1 || *host > 30, "{subnet} left cleanly: no route");
            assert_eq!(*stale, *host <= 30, "{subnet}");
        }
    }

    #[test]
    fn listing_drops_a_relinquished_route() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let l = listing(11, vec![], vec![history("10.244.1.0/24", HistoryState::Relinquished, 11)]);
        assert!(s.apply_listing(&l));
        assert!(routes(&s).is_empty());
        assert!(!s.needs_relist());
        assert_eq!(s.resume_revision(), Revision(12));
    }

    #[test]
    fn listing_drops_a_revoked_route() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let l = listing(11, vec![], vec![history("10.244.1.0/24", HistoryState::Revoked, 11)]);
        assert!(s.apply_listing(&l));
        assert!(routes(&s).is_empty());
    }

    #[test]
    fn listing_keeps_an_expired_route_stale_until_someone_else_leases_it() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let l = listing(11, vec![], vec![history("10.244.1.0/24", HistoryState::Held, 5)]);
        assert!(!s.apply_listing(&l));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
        // Later listings keep it too.
        assert!(!s.apply_listing(&listing(20, vec![], vec![])));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
        // Until another host leases it.
        assert!(s.apply_batch(&put("10.244.1.0/24", 2, 21)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false)]);
    }

    #[test]
    fn an_old_relinquish_does_not_drop_a_later_holder() {
        // Relinquished at 3 by someone; leased at 5 by host 1 (a flannel node, which writes no
        // history); host 1's key then expires: the route stays.
        let mut s = set();
        let l = listing(
            10,
            vec![lease("10.244.1.0/24", 1, 5)],
            vec![history("10.244.1.0/24", HistoryState::Relinquished, 3)],
        );
        s.apply_listing(&l);
        s.apply_batch(&delete("10.244.1.0/24", 11));
        let l = listing(11, vec![], vec![history("10.244.1.0/24", HistoryState::Relinquished, 3)]);
        s.apply_listing(&l);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
    }

    #[test]
    fn listing_replaces_everything_else() {
        let mut s = set();
        s.apply_listing(&listing(
            10,
            vec![lease("10.244.1.0/24", 1, 5), lease("10.244.2.0/24", 2, 6)],
            vec![],
        ));
        let l = listing(
            30,
            vec![lease("10.244.2.0/24", 7, 25), lease("10.244.3.0/24", 3, 26)],
            vec![history("10.244.1.0/24", HistoryState::Relinquished, 20)],
        );
        assert!(s.apply_listing(&l));
        assert_eq!(routes(&s), [r("10.244.2.0/24", 7, false), r("10.244.3.0/24", 3, false)]);
        assert_eq!(s.resume_revision(), Revision(31));
    }

    #[test]
    fn listing_after_compaction_catches_up_on_missed_events() {
        // The watch fell behind the compaction horizon: puts, a new holder, a relinquish and an
        // expiry were missed. One listing brings the set to the truth.
        let mut s = set();
        s.apply_listing(&listing(
            10,
            vec![
                lease("10.244.1.0/24", 1, 5),
                lease("10.244.2.0/24", 2, 6),
                lease("10.244.3.0/24", 3, 7),
            ],
            vec![],
        ));
        s.apply_batch(&put("10.244.4.0/24", 4, 11));
        let l = listing(
            500,
            vec![
                lease("10.244.2.0/24", 9, 400),
                lease("10.244.4.0/24", 4, 11),
                lease("10.244.5.0/24", 5, 450),
            ],
            vec![
                history("10.244.1.0/24", HistoryState::Relinquished, 300),
                history("10.244.3.0/24", HistoryState::Held, 7),
            ],
        );
        assert!(s.apply_listing(&l));
        assert_eq!(
            routes(&s),
            [
                r("10.244.2.0/24", 9, false),
                r("10.244.3.0/24", 3, true),
                r("10.244.4.0/24", 4, false),
                r("10.244.5.0/24", 5, false),
            ]
        );
        assert_eq!(s.resume_revision(), Revision(501));
    }

    #[test]
    fn own_subnet_is_excluded_and_comes_back_when_it_is_not_ours() {
        let mut s = set();
        s.apply_listing(&listing(
            10,
            vec![lease("10.244.1.0/24", 1, 5), lease("10.244.2.0/24", 2, 6)],
            vec![],
        ));
        assert!(s.set_own(Some(subnet("10.244.1.0/24"))));
        assert_eq!(routes(&s), [r("10.244.2.0/24", 2, false)]);
        assert!(!s.set_own(Some(subnet("10.244.1.0/24"))));
        // Our own key's renewals and deletes are not news, and need no relist.
        assert!(!s.apply_batch(&put("10.244.1.0/24", 1, 11)));
        assert!(!s.apply_batch(&delete("10.244.1.0/24", 12)));
        assert!(!s.needs_relist());
        // Our subnet is taken by host 3 and we move to .5: host 3's route appears.
        assert!(!s.apply_batch(&put("10.244.1.0/24", 3, 13)));
        assert!(s.set_own(Some(subnet("10.244.5.0/24"))));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 3, false), r("10.244.2.0/24", 2, false)]);
        assert_eq!(s.own(), Some(subnet("10.244.5.0/24")));
    }

    #[test]
    fn own_stale_leftover_is_dropped_when_own_moves() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.set_own(Some(subnet("10.244.1.0/24")));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        assert!(!s.set_own(Some(subnet("10.244.5.0/24"))));
        assert!(routes(&s).is_empty());
        assert!(s.peer(subnet("10.244.1.0/24")).is_none());
    }

    #[test]
    fn bad_entries_are_skipped_and_counted() {
        let mut s = set();
        let mut unroutable = lease("10.244.3.0/24", 3, 7);
        unroutable.attrs.backend_data = None;
        let mut l = listing(10, vec![lease("10.244.1.0/24", 1, 5), unroutable], vec![]);
        l.skipped = vec![
            bad("10.244.2.0-24"),
            bad("not-a-subnet"),
            // History garbage is not a route and not counted here.
            BadEntry { key: format!("{PREFIX}/weft/history/10.244.2.0-24"), problem: "x".into() },
        ];
        s.apply_listing(&l);
        assert_eq!(s.bad_entries(), 3);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);
        // Garbage written over a live route: counted, the route kept but stale.
        let b = WatchBatch {
            revision: Revision(11),
            events: vec![WatchEvent::Bad(bad("10.244.1.0-24"))],
        };
        assert!(s.apply_batch(&b));
        assert_eq!(s.bad_entries(), 4);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
        // An unroutable put: counted and skipped.
        let mut p = lease("10.244.6.0/24", 6, 12);
        p.attrs.public_ip = Ipv4Addr::UNSPECIFIED;
        let b = WatchBatch { revision: Revision(12), events: vec![WatchEvent::Put(p)] };
        assert!(!s.apply_batch(&b));
        assert_eq!(s.bad_entries(), 5);
        assert_eq!(routes(&s).len(), 1);
        // A listing where that garbage is still present keeps the stale route.
        let mut l =
            listing(20, vec![], vec![history("10.244.1.0/24", HistoryState::Relinquished, 15)]);
        l.skipped = vec![bad("10.244.1.0-24")];
        s.apply_listing(&l);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, true)]);
    }

    #[test]
    fn events_covered_by_a_listing_are_ignored() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        s.apply_batch(&delete("10.244.1.0/24", 11));
        // A re-list at 13 while the old watch goes on: it still delivers 12 and 13, then 14.
        s.apply_listing(&listing(
            13,
            vec![lease("10.244.1.0/24", 2, 12), lease("10.244.2.0/24", 3, 13)],
            vec![],
        ));
        assert!(!s.apply_batch(&put("10.244.1.0/24", 2, 12)));
        assert!(!s.apply_batch(&delete("10.244.2.0/24", 13)));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 2, false), r("10.244.2.0/24", 3, false)]);
        // A batch spanning the listing revision: only the newer events count.
        let b = WatchBatch {
            revision: Revision(14),
            events: vec![
                WatchEvent::Delete { subnet: subnet("10.244.2.0/24"), revision: Revision(13) },
                WatchEvent::Put(lease("10.244.4.0/24", 4, 14)),
            ],
        };
        assert!(s.apply_batch(&b));
        assert_eq!(
            routes(&s),
            [
                r("10.244.1.0/24", 2, false),
                r("10.244.2.0/24", 3, false),
                r("10.244.4.0/24", 4, false)
            ]
        );
        assert_eq!(s.resume_revision(), Revision(15));
    }

    #[test]
    fn after_the_store_went_back_in_time_new_events_count_again() {
        let mut s = set();
        s.apply_listing(&listing(500, vec![lease("10.244.1.0/24", 1, 400)], vec![]));
        assert_eq!(s.resume_revision(), Revision(501));
        // Restored from a snapshot at revision 100: host 2 takes .2 at 101, .1 moves at 102.
        s.forget_revisions();
        assert!(s.needs_relist());
        s.apply_listing(&listing(100, vec![lease("10.244.1.0/24", 1, 90)], vec![]));
        assert_eq!(s.resume_revision(), Revision(101), "the watch resumes in the new timeline");
        s.apply_batch(&put("10.244.2.0/24", 2, 101));
        s.apply_batch(&put("10.244.1.0/24", 3, 102));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 3, false), r("10.244.2.0/24", 2, false)]);
    }

    #[test]
    fn keys_that_are_not_leases_of_the_network_are_ignored_and_never_routed() {
        // A stray /0 would otherwise route the whole network (and every inner source a sender
        // claims) to one peer; a /25 inside a peer's /24 would steal part of its traffic.
        let mut s = set();
        let mut l = listing(
            10,
            vec![
                lease("10.244.1.0/24", 1, 3),
                lease("0.0.0.0/0", 2, 4),
                lease("10.244.1.128/25", 3, 5),
                lease("10.244.8.7/32", 4, 6),
                lease("10.244.8.0/22", 5, 7),
                lease("10.9.0.0/24", 6, 8),
            ],
            vec![],
        );
        l.skipped = vec![bad("bogus"), bad("0.0.0.0-0&fd00:0:0:9::-64"), bad("10.244.2.0-24")];
        s.apply_listing(&l);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);
        let t = s.table();
        assert_eq!(
            t.lookup(Ipv4Addr::new(10, 244, 1, 200)).map(|p| p.public_ip.octets()[3]),
            Some(1)
        );
        for outside in
            [Ipv4Addr::new(10, 244, 8, 7), Ipv4Addr::new(10, 9, 0, 1), Ipv4Addr::new(8, 8, 8, 8)]
        {
            assert!(t.lookup(outside).is_none(), "{outside}");
        }
        let ignored: Vec<&str> = s.ignored().keys().map(String::as_str).collect();
        assert_eq!(
            ignored,
            [
                "subnets/0.0.0.0-0",
                "subnets/10.244.1.128-25",
                "subnets/10.244.2.0-24",
                "subnets/10.244.8.0-22",
                "subnets/10.244.8.7-32",
                "subnets/10.9.0.0-24",
                "subnets/bogus",
            ],
            "an IPv6-only lease is a lease, not garbage"
        );
        // A watch brings another; its delete takes it off the list again.
        s.apply_batch(&put("10.244.3.0/25", 7, 11));
        assert!(s.ignored().contains_key("subnets/10.244.3.0-25"));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);
        s.apply_batch(&delete("10.244.3.0/25", 12));
        assert!(!s.ignored().contains_key("subnets/10.244.3.0-25"));
    }

    /// A dual-stack lease (`host`'s half `fd00:10:244:<host>::/64`) with `v6_json` added to
    /// its vxlan value.
    fn dual(s: &str, host: u8, rev: i64, v6_json: &str) -> StoredLease {
        let json = format!(
            r#"{{"PublicIP":"192.0.2.{host}","BackendType":"vxlan","BackendData":{{"VNI":1,"VtepMAC":"02:00:00:00:00:{host:02x}"}}{v6_json}}}"#
        );
        StoredLease {
            ipv6: Some(format!("fd00:10:244:{host}::/64").parse().unwrap()),
            attrs: LeaseAttrs::from_json(json.as_bytes()).unwrap(),
            ..lease(s, host, rev)
        }
    }

    #[test]
    fn peers_whose_ipv6_half_cannot_be_carried_are_routed_over_ipv4_and_listed() {
        let carried = r#","PublicIPv6":"2001:db8::1","BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:00:01"}"#;
        let mut s = set();
        s.apply_listing(&listing(
            10,
            vec![
                dual("10.244.1.0/24", 1, 3, carried),
                // flannel's udp-style value: no PublicIPv6.
                dual("10.244.2.0/24", 2, 4, r#","PublicIPv6":null"#),
                // IPv4-only lease: nothing to say.
                lease("10.244.3.0/24", 3, 5),
            ],
            vec![],
        ));
        assert_eq!(
            routes(&s),
            [
                r("10.244.1.0/24", 1, false),
                r("10.244.2.0/24", 2, false),
                r("10.244.3.0/24", 3, false)
            ]
        );
        let listed: Vec<(&str, &str)> =
            s.ipv4_only().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            listed,
            [(
                "subnets/10.244.2.0-24",
                "its IPv6 half fd00:10:244:2::/64 cannot be routed: PublicIPv6 is not a unicast address"
            )]
        );
        let t = s.table();
        assert!(t.lookup6("fd00:10:244:1::9".parse().unwrap()).is_some());
        assert!(t.lookup6("fd00:10:244:2::9".parse().unwrap()).is_none());
        // The peer fixes its value: off the list; it breaks it again: back; it leaves: off.
        let put_dual = |v6: &str, rev| WatchBatch {
            revision: Revision(rev),
            events: vec![WatchEvent::Put(dual("10.244.2.0/24", 2, rev, v6))],
        };
        let fixed = r#","PublicIPv6":"2001:db8::2","BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:00:02"}"#;
        s.apply_batch(&put_dual(fixed, 11));
        assert!(s.ipv4_only().is_empty(), "{:?}", s.ipv4_only());
        s.apply_batch(&put_dual(r#","PublicIPv6":"2001:db8::2""#, 12));
        assert!(s.ipv4_only()["subnets/10.244.2.0-24"].contains("BackendV6Data"));
        s.apply_batch(&delete("10.244.2.0/24", 13));
        assert!(s.ipv4_only().is_empty());
        // A listing starts the list afresh.
        s.apply_batch(&put_dual(r#","PublicIPv6":null"#, 14));
        s.apply_listing(&listing(20, vec![dual("10.244.1.0/24", 1, 3, carried)], vec![]));
        assert!(s.ipv4_only().is_empty());
    }
}
