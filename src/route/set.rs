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
//! - A stale route is trusted for a bounded time: [`RouteSet::drop_stale`] drops it when the
//!   watcher says its trust ran out (its key gone that long, confirmed by a listing).
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
//!   [`RouteSet::ignored`] holds what the store holds now: a delete forgets the key it names
//!   ([`WatchEvent::DeleteUnparsed`] for a name that does not parse; a
//!   [`WatchEvent::Delete`], which names a subnet only, every ignored key of that subnet, in
//!   either form), so a key put again after its delete is reported again, and the set never
//!   grows with keys that are gone. A key whose name parses is listed by the name weft and
//!   flannel write (RFC 5952 text for the IPv6 half), however it was spelt.
//!   flannel's IPv6-only leases (`0.0.0.0-0&<v6>`) are leases, not garbage: they are neither
//!   routed (no IPv4 subnet) nor reported.
//! - **One IPv6 half, one route.** etcd's create compares the IPv4 subnet only, so two live
//!   keys can name one IPv6 half (a flannel node drawing a half a weft node holds, or an
//!   operator's hand). The half is routed to the key created first (the lowest
//!   [`StoredLease::create_revision`], ties to the lower IPv4 subnet); every other live key
//!   naming it is routed over IPv4 only and listed in [`RouteSet::half_conflicts`]. The choice
//!   depends on the store alone, so every node makes the same one; it is re-made whenever a key
//!   naming the half comes, changes or goes, so a conflict clears when a key goes. A stale
//!   route's half gives way to any live key naming it (as its IPv4 route gives way to a new
//!   holder of its subnet). The own lease takes part (it is a key of the store like any other):
//!   [`RouteSet::own_half_conflict`] says when it shares its half.
//! - Revisions: a listing at revision `r` makes the watch resume from `r + 1`, a batch at
//!   revision `b` from `b + 1` ([`RouteSet::resume_revision`]). Events a listing already covers
//!   (at or below its revision) are ignored, so a re-list may run while the old watch goes on.
//!
//! [`PeerError`]: super::table::PeerError

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::table::{Peer, Peer6, RouteTable};
use crate::lease::keys;
use crate::lease::record::{HistoryState, Ipv6Subnet, LeaseName, Revision, StoredLease, Subnet};
use crate::lease::store::{BadEntry, Listing, WatchBatch, WatchEvent};

/// The latest known route of one subnet and the key revision it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    peer: Peer,
    /// The mod revision of the key write this route came from.
    mod_revision: Revision,
    /// The key's create revision: who came first, for a contested IPv6 half.
    create_revision: Revision,
    /// The IPv6 half the key names, whether or not it can be carried ([`Peer::ipv6`] holds it
    /// when it can): a key claims its half either way, as its pods are addressed from it.
    half: Option<Ipv6Subnet>,
}

impl Entry {
    fn of(lease: &StoredLease, peer: Peer) -> Self {
        Self {
            peer,
            mod_revision: lease.mod_revision,
            create_revision: lease.create_revision,
            half: lease.ipv6,
        }
    }
}

/// A live lease's claim on the IPv6 half its key names. The derived order is the rule for a
/// contested half: the first claim keeps it. The create revision comes first because it is
/// the store's own record of which key was there first, the same on every node, and no
/// renewal moves it (a mod revision would: a flannel node rewrites its key on every renewal,
/// so the half would change hands each time). One transaction may create two keys at one
/// revision; the lower IPv4 subnet (the key names' order, as `RouteTable` orders routes)
/// settles that.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claim {
    create_revision: Revision,
    subnet: Subnet,
}

/// Where a live lease's [`Claim`] is filed: its half and its create revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Filed {
    half: Ipv6Subnet,
    create_revision: Revision,
}

/// This host's own lease shares its IPv6 half with another live key
/// ([`RouteSet::own_half_conflict`]): pods on both hosts may be given the same IPv6 addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnHalfConflict {
    /// The own lease's key.
    pub own: LeaseName,
    /// The half's holder, the key created first (the own key, or another).
    pub holder: LeaseName,
    /// Every live key naming the half, the holder first; the others are routed over IPv4 only.
    pub keys: Vec<LeaseName>,
}

/// The latest known route per subnet, built from listings and watch events. See the module
/// docs for the rules.
#[derive(Clone, Debug)]
pub struct RouteSet {
    network: IpNet,
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
    /// The live (not stale) leases naming each IPv6 half, first claim first: the first is the
    /// half's holder. Rebuilt by every listing, kept up by watch events.
    claims: BTreeMap<Ipv6Subnet, BTreeSet<Claim>>,
    /// The claim of each live lease that names a half, by its subnet (to find and drop it when
    /// the lease changes or goes).
    filed: BTreeMap<Subnet, Filed>,
    /// Live leases whose half another key holds (by key, why): routed over IPv4 only. Kept in
    /// step with `claims`.
    half_conflicts: BTreeMap<String, String>,
}

impl RouteSet {
    /// An empty set for `network` whose leases are normally `/subnet_len`: the IPv4 network, or
    /// on an IPv6-only network the IPv6 one ([`crate::config::NetworkConfig::leased_network`]).
    pub fn new(network: IpNet, subnet_len: u8) -> Self {
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
            claims: BTreeMap::new(),
            filed: BTreeMap::new(),
            half_conflicts: BTreeMap::new(),
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
                    next.insert(lease.subnet, Entry::of(lease, peer));
                }
                Err(Skip::Foreign(why)) => self.ignore(name_key(lease), why),
                Err(Skip::Unroutable(why)) => {
                    self.ignore(name_key(lease), why);
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
        let mut changed = self.visible_differs(&next);
        self.entries = next;
        changed |= self.refile_all_claims();
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
            // Renewals leave every claim as it is; a claim that changes re-decides its half,
            // which may move the half's route (at worst, for the own key, a table published
            // unchanged).
            if let Some(subnet) = event_subnet(event) {
                changed |= self.refile_claim(subnet);
            }
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
                        self.ignored.remove(&name_key(lease));
                        self.note_half(lease);
                        let old = self.entries.insert(lease.subnet, Entry::of(lease, peer));
                        self.is_visible(lease.subnet)
                            && old.map(|e| e.peer).as_ref() != self.peer(lease.subnet)
                    }
                    Err(Skip::Foreign(why)) => {
                        self.ipv4_only.remove(&lease_key(lease.subnet));
                        self.ignore(name_key(lease), why);
                        false
                    }
                    Err(Skip::Unroutable(why)) => {
                        self.ipv4_only.remove(&lease_key(lease.subnet));
                        self.ignore(name_key(lease), why);
                        self.mark_stale(lease.subnet)
                    }
                }
            }
            WatchEvent::Delete { subnet, revision } => {
                // Like a bad entry's put, whether or not a listing covers it: replayed in
                // order, the batch's last event of each key leaves what the store holds.
                self.forget_ignored(*subnet);
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
            WatchEvent::DeleteUnparsed { key, .. } => {
                if let Some(name) = keys::subnet_key_name(key) {
                    self.ignored.remove(&keys::relative_subnet_key(name));
                }
                false
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

    /// Files `subnet`'s claim on its IPv6 half afresh after its entry may have changed (a live
    /// lease claims the half its key names; a stale or absent one claims none), re-deciding
    /// the halves it left and joined. Whether its claim changed. O(log n) plus the claims on
    /// those two halves.
    fn refile_claim(&mut self, subnet: Subnet) -> bool {
        let now = self.entries.get(&subnet).and_then(filed_of);
        let before = self.filed.get(&subnet).copied();
        if now == before {
            return false;
        }
        if let Some(old) = before {
            self.filed.remove(&subnet);
            if let Some(claims) = self.claims.get_mut(&old.half) {
                claims.remove(&Claim { create_revision: old.create_revision, subnet });
                if claims.is_empty() {
                    self.claims.remove(&old.half);
                }
            }
            self.half_conflicts.remove(&half_key(subnet, old.half));
            self.decide(old.half);
        }
        if let Some(new) = now {
            self.filed.insert(subnet, new);
            let claim = Claim { create_revision: new.create_revision, subnet };
            self.claims.entry(new.half).or_default().insert(claim);
            self.decide(new.half);
        }
        true
    }

    /// Files every live entry's claim afresh (after a listing): O(n log n). Whether any claim
    /// changed.
    fn refile_all_claims(&mut self) -> bool {
        let before = std::mem::take(&mut self.claims);
        self.filed.clear();
        self.half_conflicts.clear();
        for (subnet, entry) in &self.entries {
            if let Some(filed) = filed_of(entry) {
                self.filed.insert(*subnet, filed);
                let claim = Claim { create_revision: filed.create_revision, subnet: *subnet };
                self.claims.entry(filed.half).or_default().insert(claim);
            }
        }
        let contested: Vec<Ipv6Subnet> =
            self.claims.iter().filter(|(_, c)| c.len() > 1).map(|(half, _)| *half).collect();
        for half in contested {
            self.decide(half);
        }
        before != self.claims
    }

    /// Lists every claimant of `half` but the first as routed over IPv4 only, and takes the
    /// first off the list.
    fn decide(&mut self, half: Ipv6Subnet) {
        let Some(claims) = self.claims.get(&half) else { return };
        let mut claims = claims.iter();
        let Some(holder) = claims.next() else { return };
        let holder_key = half_key(holder.subnet, half);
        for other in claims {
            let why = format!(
                "its IPv6 half {half} is also named by {holder_key}, created first (at revision {}), \
                 which keeps it",
                holder.create_revision.0
            );
            self.half_conflicts.insert(half_key(other.subnet, half), why);
        }
        self.half_conflicts.remove(&holder_key);
    }

    /// Whether the route of `subnet` (entry `entry`) carries its IPv6 half: the key holds the
    /// half (it names none, or is the first live key naming it), or it is a stale route whose
    /// half no live key names.
    fn holds_half(&self, subnet: Subnet, entry: &Entry) -> bool {
        let Some(half) = entry.half else { return true };
        self.claims.get(&half).and_then(BTreeSet::first).is_none_or(|first| first.subnet == subnet)
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
        let name = keys::subnet_key_name(&bad.key)?;
        // A name that parses is filed as weft writes it, where a delete of its subnet finds it.
        let key = match LeaseName::parse(name) {
            Ok(parsed) => keys::relative_subnet_key(&parsed.key_name()),
            Err(_) => keys::relative_subnet_key(name),
        };
        self.ignore(key, bad.problem.clone());
        subnet.filter(|s| s.check_lease_of(self.network, self.subnet_len).is_ok())
    }

    /// Forgets every ignored key of `subnet`, which a delete names: the key of the subnet
    /// alone, and its dual-stack forms (`<subnet>&<half>`, whose half a delete does not say).
    /// Two keys of one subnet in both forms are one subnet here, as they are for its route: a
    /// delete of either forgets both, until a listing or a write of the other names it again.
    /// O(log n) plus the keys forgotten.
    fn forget_ignored(&mut self, subnet: Subnet) {
        let alone = lease_key(subnet);
        self.ignored.remove(&alone);
        if subnet.v4().is_some() {
            // Every `<alone>&…`: from `<alone>&` up to `<alone>'`, the next character.
            let (from, to) = (format!("{alone}&"), format!("{alone}'"));
            let forms: Vec<String> =
                self.ignored.range(from..to).map(|(key, _)| key.clone()).collect();
            for key in forms {
                self.ignored.remove(&key);
            }
        }
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

    /// The live lease keys (`subnets/<v4>&<v6>`) whose IPv6 half another live key holds (the
    /// one created first), with why: routed over IPv4 only. Store-wide (the own key is listed
    /// too when it is not the holder), so every node lists the same keys. As of the last
    /// listing and the watch events since.
    pub fn half_conflicts(&self) -> &BTreeMap<String, String> {
        &self.half_conflicts
    }

    /// Whether this host's own lease's IPv6 half is named by another live key too, and by which.
    pub fn own_half_conflict(&self) -> Option<OwnHalfConflict> {
        let own = self.own?;
        let half = self.filed.get(&own)?.half;
        let claims = self.claims.get(&half).filter(|c| c.len() > 1)?;
        let keys: Vec<LeaseName> =
            claims.iter().map(|c| LeaseName { subnet: c.subnet, ipv6: Some(half) }).collect();
        let holder = *keys.first()?;
        Some(OwnHalfConflict { own: LeaseName { subnet: own, ipv6: Some(half) }, holder, keys })
    }

    /// The subnets whose routes are stale (their keys are gone or unreadable), the own one's
    /// included.
    pub fn stale_subnets(&self) -> Vec<Subnet> {
        self.entries.iter().filter(|(_, e)| e.peer.stale).map(|(s, _)| *s).collect()
    }

    /// Drops the route of `subnet` if it is stale (a live one is never dropped): its trust has
    /// run out (see [`super::watcher`], `--stale-route-ttl`). Whether the table changed.
    pub fn drop_stale(&mut self, subnet: Subnet) -> bool {
        if !self.entries.get(&subnet).is_some_and(|e| e.peer.stale) {
            return false;
        }
        self.entries.remove(&subnet);
        let visible = self.is_visible(subnet);
        self.refile_claim(subnet) | visible
    }

    /// The route the set holds for `subnet`, including the own subnet's (which
    /// [`RouteSet::table`] leaves out).
    pub fn peer(&self, subnet: Subnet) -> Option<&Peer> {
        self.entries.get(&subnet).map(|e| &e.peer)
    }

    /// The table to publish: every route but the own subnet's, each IPv6 half on the route of
    /// its holder alone.
    pub fn table(&self) -> RouteTable {
        let peers = self.entries.iter().filter(|(s, _)| self.is_visible(**s)).map(|(s, e)| {
            let mut peer = e.peer.clone();
            if !self.holds_half(*s, e) {
                peer.ipv6 = None;
            }
            peer
        });
        RouteTable::build_in(self.network, self.subnet_len, peers)
    }
}

/// The claim a route's entry files: its key's half, if the route is live.
fn filed_of(entry: &Entry) -> Option<Filed> {
    let half = entry.half.filter(|_| !entry.peer.stale)?;
    Some(Filed { half, create_revision: entry.create_revision })
}

/// The subnet whose entry an event may change.
fn event_subnet(event: &WatchEvent) -> Option<Subnet> {
    match event {
        WatchEvent::Put(lease) => Some(lease.subnet),
        WatchEvent::Delete { subnet, .. } => Some(*subnet),
        WatchEvent::Bad(bad) => bad.subnet_key().flatten(),
        WatchEvent::DeleteUnparsed { .. } | WatchEvent::Departed(_) => None,
    }
}

/// How [`RouteSet::half_conflicts`] names a dual-stack key: its exact name, both halves, as an
/// operator would delete it.
fn half_key(subnet: Subnet, half: Ipv6Subnet) -> String {
    keys::relative_subnet_key(&LeaseName { subnet, ipv6: Some(half) }.key_name())
}

/// Why a parsed lease gives no route.
enum Skip {
    /// Not a lease of this network: ignored, whatever happens to its subnet's routes.
    Foreign(String),
    /// A lease of this network whose value cannot be routed to (bad backend data): its
    /// subnet's existing route goes stale.
    Unroutable(String),
}

/// The key of `subnet` alone, as [`RouteSet::ipv4_only`] names a routed lease.
fn lease_key(subnet: Subnet) -> String {
    keys::relative_subnet_key(&subnet.key_name())
}

/// How [`RouteSet::ignored`] names the key of a parsed lease: its name, both halves.
fn name_key(lease: &StoredLease) -> String {
    keys::relative_subnet_key(&LeaseName { subnet: lease.subnet, ipv6: lease.ipv6 }.key_name())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use crate::vocab::MacAddr;

    use super::*;
    use crate::lease::record::{
        HistoryEntry, HistoryRecord, LeaseAttrs, LeaseName, NodeId, StoreLeaseId, StoredLease,
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
        Listing { revision: Revision(rev), leases, history, ..Listing::default() }
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
                "subnets/0.0.0.0-0&fd00:0:0:9::-64",
                "subnets/10.244.1.128-25",
                "subnets/10.244.2.0-24",
                "subnets/10.244.8.0-22",
                "subnets/10.244.8.7-32",
                "subnets/10.9.0.0-24",
                "subnets/bogus",
            ],
            "an IPv6-only key is ignored on an IPv4 network, like any other key of no lease"
        );
        // A watch brings another; its delete takes it off the list again.
        s.apply_batch(&put("10.244.3.0/25", 7, 11));
        assert!(s.ignored().contains_key("subnets/10.244.3.0-25"));
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);
        s.apply_batch(&delete("10.244.3.0/25", 12));
        assert!(!s.ignored().contains_key("subnets/10.244.3.0-25"));
    }

    /// The delete of a key whose name does not parse, as the store tells it.
    fn junk_gone(name: &str, rev: i64) -> WatchEvent {
        WatchEvent::DeleteUnparsed {
            key: format!("{PREFIX}/subnets/{name}"),
            revision: Revision(rev),
        }
    }

    /// 300 keys whose names are no lease, put and deleted: the ignored list follows the store
    /// to 300 and back to 0 (a delete is no bad entry), and a key put again is listed and
    /// counted again. Replayed by a watch batch that spans a listing, the events of each key
    /// leave what the store holds whichever came last.
    #[test]
    fn deleted_junk_keys_are_forgotten_and_counted_again_when_put_again() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![lease("10.244.1.0/24", 1, 5)], vec![]));
        let names: Vec<String> = (0..300).map(|i| format!("junk-{i}")).collect();
        let b = WatchBatch {
            revision: Revision(11),
            events: names.iter().map(|n| WatchEvent::Bad(bad(n))).collect(),
        };
        assert!(!s.apply_batch(&b));
        assert_eq!((s.ignored().len(), s.bad_entries()), (300, 300));
        let b = WatchBatch {
            revision: Revision(12),
            events: names.iter().map(|n| junk_gone(n, 12)).collect(),
        };
        assert!(!s.apply_batch(&b), "no route changes");
        assert_eq!((s.ignored().len(), s.bad_entries()), (0, 300));
        s.apply_batch(&WatchBatch {
            revision: Revision(13),
            events: vec![WatchEvent::Bad(bad("junk-7"))],
        });
        assert_eq!(s.ignored().keys().collect::<Vec<_>>(), ["subnets/junk-7"]);
        assert_eq!(s.bad_entries(), 301);
        assert_eq!(routes(&s), [r("10.244.1.0/24", 1, false)]);

        // A re-list at 20 while the old watch goes on: `a` was put at 15 and deleted at 16
        // (the listing lacks it), `b` deleted at 17 and put again at 18 (the listing has it).
        let mut l = listing(20, vec![lease("10.244.1.0/24", 1, 5)], vec![]);
        l.skipped = vec![bad("b")];
        s.apply_listing(&l);
        let b = WatchBatch {
            revision: Revision(21),
            events: vec![
                WatchEvent::Bad(bad("a")),
                junk_gone("a", 16),
                junk_gone("b", 17),
                WatchEvent::Bad(bad("b")),
                WatchEvent::Bad(bad("c")),
            ],
        };
        s.apply_batch(&b);
        assert_eq!(s.ignored().keys().collect::<Vec<_>>(), ["subnets/b", "subnets/c"]);
        // A delete of a key below another under subnets/ names no key of subnets/ itself.
        s.apply_batch(&WatchBatch { revision: Revision(22), events: vec![junk_gone("b/x", 22)] });
        assert_eq!(s.ignored().len(), 2);
    }

    /// A delete names a subnet only; whatever form of that subnet's key was ignored (a
    /// dual-stack name whose value is garbage, another network's dual-stack lease, an IPv6 half
    /// spelt otherwise than weft and flannel write it) is forgotten with it, so the list and its
    /// gauge hold what the store holds now.
    #[test]
    fn a_delete_forgets_the_ignored_key_of_its_subnet_whatever_the_keys_form() {
        let mut s = set();
        s.apply_listing(&listing(10, vec![], vec![]));
        let puts = |rev: i64| {
            let mut foreign = lease("10.9.0.0/24", 9, rev);
            foreign.ipv6 = Some("fd00:9::/64".parse().unwrap());
            WatchBatch {
                revision: Revision(rev),
                events: vec![
                    WatchEvent::Bad(bad("10.244.7.0-24&fd00:10:244:7::-64")),
                    WatchEvent::Put(foreign),
                    WatchEvent::Bad(bad("10.244.8.0-24&FD00:10:244:8:0:0:0:0-64")),
                ],
            }
        };
        let deletes = |rev: i64| WatchBatch {
            revision: Revision(rev),
            events: ["10.244.7.0/24", "10.9.0.0/24", "10.244.8.0/24"]
                .map(|d| WatchEvent::Delete { subnet: subnet(d), revision: Revision(rev) })
                .to_vec(),
        };
        s.apply_batch(&puts(11));
        assert_eq!(s.ignored().len(), 3, "{:?}", s.ignored());
        assert!(!s.apply_batch(&deletes(12)));
        assert!(s.ignored().is_empty(), "deleted, still ignored: {:?}", s.ignored());
        // Put again: named in the text weft and flannel write (RFC 5952), both halves.
        s.apply_batch(&puts(13));
        let ignored: Vec<&str> = s.ignored().keys().map(String::as_str).collect();
        assert_eq!(
            ignored,
            [
                "subnets/10.244.7.0-24&fd00:10:244:7::-64",
                "subnets/10.244.8.0-24&fd00:10:244:8::-64",
                "subnets/10.9.0.0-24&fd00:9::-64",
            ]
        );
        assert!(routes(&s).is_empty());
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

    /// A dual-stack lease of `host` whose IPv6 half (`half`) can be carried, its key created at
    /// `created` and last written at `rev`.
    fn claim(s: &str, host: u8, half: &str, created: i64, rev: i64) -> StoredLease {
        let v6 = format!(
            r#","PublicIPv6":"2001:db8::{host}","BackendV6Data":{{"VNI":1,"VtepMAC":"02:00:00:00:06:{host:02x}"}}"#
        );
        StoredLease {
            ipv6: Some(half.parse().unwrap()),
            create_revision: Revision(created),
            ..dual(s, host, rev, &v6)
        }
    }

    /// The host (last octet of its public IPv4 address) whose route carries `dst`.
    fn half_route(s: &RouteSet, dst: &str) -> Option<u8> {
        s.table().lookup6(dst.parse().unwrap()).map(|(p, _)| p.public_ip.octets()[3])
    }

    fn puts(rev: i64, leases: Vec<StoredLease>) -> WatchBatch {
        WatchBatch {
            revision: Revision(rev),
            events: leases.into_iter().map(WatchEvent::Put).collect(),
        }
    }

    const HALF: &str = "fd00:10:244:1::/64";
    const FIRST: &str = "subnets/10.244.2.0-24&fd00:10:244:1::-64";
    const LATER: &str = "subnets/10.244.1.0-24&fd00:10:244:1::-64";

    /// Two live keys naming one half: host 2's key was created first (revision 3), host 1's
    /// later (5) but host 1 rewrote its key last (so its mod revision is the lower one). A third
    /// key has a half of its own.
    fn contested() -> Vec<StoredLease> {
        vec![
            claim("10.244.1.0/24", 1, HALF, 5, 8),
            claim("10.244.2.0/24", 2, HALF, 3, 9),
            claim("10.244.3.0/24", 3, "fd00:10:244:3::/64", 4, 4),
        ]
    }

    #[test]
    fn two_keys_naming_one_half_route_it_to_the_first_created_and_list_the_other() {
        let mut s = set();
        s.apply_listing(&listing(10, contested(), vec![]));
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(2), "the key created first");
        let listed: Vec<(&str, &str)> =
            s.half_conflicts().iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            listed,
            [(
                LATER,
                "its IPv6 half fd00:10:244:1::/64 is also named by subnets/10.244.2.0-24&fd00:10:244:1::-64, created first (at revision 3), which keeps it"
            )]
        );
        // The other key keeps its IPv4 route; exactly one route carries the half.
        let t = s.table();
        assert_eq!(t.len(), 3);
        let carriers: Vec<u8> = t
            .peers()
            .iter()
            .filter(|p| p.ipv6.is_some_and(|v6| v6.subnet == HALF.parse().unwrap()))
            .map(|p| p.public_ip.octets()[3])
            .collect();
        assert_eq!(carriers, [2]);
        assert_eq!(
            t.lookup(Ipv4Addr::new(10, 244, 1, 9)).map(|p| p.public_ip.octets()[3]),
            Some(1)
        );
        // A key whose half is its own is never listed, and keeps its IPv6 route.
        assert_eq!(half_route(&s, "fd00:10:244:3::9"), Some(3));
        assert!(s.half_conflicts().keys().all(|k| !k.starts_with("subnets/10.244.3.0")));
        assert!(s.ipv4_only().is_empty(), "a carried half is not 'cannot be carried'");
    }

    #[test]
    fn the_half_goes_to_the_same_key_whatever_order_the_keys_come_in() {
        let orders: [[usize; 3]; 6] =
            [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        for order in orders {
            let leases: Vec<StoredLease> = order.iter().map(|i| contested()[*i].clone()).collect();
            let mut listed = set();
            listed.apply_listing(&listing(10, leases.clone(), vec![]));
            // The same keys brought by the watch, one batch each, in that order.
            let mut watched = set();
            for (rev, lease) in (10..).zip(&leases) {
                watched.apply_batch(&puts(rev, vec![lease.clone()]));
            }
            for s in [&listed, &watched] {
                assert_eq!(half_route(s, "fd00:10:244:1::9"), Some(2), "{order:?}");
                assert_eq!(s.half_conflicts().keys().collect::<Vec<_>>(), [LATER], "{order:?}");
            }
        }
        // Created in one transaction (one create revision): the lower IPv4 subnet keeps it.
        for reversed in [false, true] {
            let mut leases =
                vec![claim("10.244.7.0/24", 7, HALF, 3, 3), claim("10.244.6.0/24", 6, HALF, 3, 3)];
            if reversed {
                leases.reverse();
            }
            let mut s = set();
            s.apply_listing(&listing(10, leases, vec![]));
            assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(6));
            assert_eq!(
                s.half_conflicts().keys().collect::<Vec<_>>(),
                ["subnets/10.244.7.0-24&fd00:10:244:1::-64"]
            );
        }
    }

    #[test]
    fn a_renewal_of_the_later_key_neither_moves_the_half_nor_publishes() {
        let mut s = set();
        s.apply_listing(&listing(10, contested(), vec![]));
        // A flannel node rewrites its key on renewal: a new mod revision, the same create one.
        let renewed = claim("10.244.2.0/24", 2, HALF, 3, 11);
        assert!(!s.apply_batch(&puts(11, vec![renewed])));
        let renewed = claim("10.244.1.0/24", 1, HALF, 5, 12);
        assert!(!s.apply_batch(&puts(12, vec![renewed])));
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(2));
        assert_eq!(s.half_conflicts().keys().collect::<Vec<_>>(), [LATER]);
    }

    #[test]
    fn when_the_holder_leaves_the_other_key_gets_the_half_and_the_conflict_clears() {
        // A clean leave (the route goes) and an expiry (the route stays, stale: its half gives
        // way to the live key).
        for expiry in [false, true] {
            let mut s = set();
            s.apply_listing(&listing(10, contested(), vec![]));
            let b = if expiry {
                delete("10.244.2.0/24", 11)
            } else {
                leave("10.244.2.0/24", 11, HistoryState::Relinquished)
            };
            assert!(s.apply_batch(&b), "expiry {expiry}");
            assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(1), "expiry {expiry}");
            assert!(s.half_conflicts().is_empty(), "expiry {expiry}: {:?}", s.half_conflicts());
            if expiry {
                let stale = s.table().peers().iter().find(|p| p.stale).cloned().unwrap();
                assert_eq!((stale.public_ip.octets()[3], stale.ipv6), (2, None));
            }
            // Host 2 leases it again: a new key, created after host 1's, so host 1 keeps it.
            assert!(s.apply_batch(&puts(12, vec![claim("10.244.2.0/24", 2, HALF, 12, 12)])));
            assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(1), "expiry {expiry}");
            assert_eq!(s.half_conflicts().keys().collect::<Vec<_>>(), [FIRST], "expiry {expiry}");
        }
        // A listing without the holder clears it too.
        let mut s = set();
        s.apply_listing(&listing(10, contested(), vec![]));
        let mut rest = contested();
        rest.remove(1);
        let l = listing(20, rest, vec![history("10.244.2.0/24", HistoryState::Relinquished, 15)]);
        assert!(s.apply_listing(&l));
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(1));
        assert!(s.half_conflicts().is_empty());
    }

    #[test]
    fn a_key_moving_to_another_half_leaves_the_contest() {
        let mut s = set();
        s.apply_listing(&listing(10, contested(), vec![]));
        // An operator rewrites host 1's key with a half of its own (a new key, as the name
        // changes; the old one is deleted in the same transaction).
        let mut b = delete("10.244.1.0/24", 11);
        b.events.push(WatchEvent::Put(claim("10.244.1.0/24", 1, "fd00:10:244:9::/64", 11, 11)));
        assert!(s.apply_batch(&b));
        assert!(s.half_conflicts().is_empty());
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(2));
        assert_eq!(half_route(&s, "fd00:10:244:9::9"), Some(1));
    }

    #[test]
    fn the_own_lease_sharing_its_half_is_told_whichever_key_holds_it() {
        let mut s = set();
        s.apply_listing(&listing(10, contested(), vec![]));
        let name = |s: &str| LeaseName { subnet: subnet(s), ipv6: Some(HALF.parse().unwrap()) };
        // Our key is the later one: host 2 holds the half, we are listed.
        s.set_own(Some(subnet("10.244.1.0/24")));
        let own = s.own_half_conflict().unwrap();
        assert_eq!(own.own, name("10.244.1.0/24"));
        assert_eq!(own.holder, name("10.244.2.0/24"));
        assert_eq!(own.keys, [name("10.244.2.0/24"), name("10.244.1.0/24")]);
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), Some(2));
        // Our key holds it: the other is listed, and its route does not carry our half.
        s.set_own(Some(subnet("10.244.2.0/24")));
        assert_eq!(s.own_half_conflict().unwrap().holder, name("10.244.2.0/24"));
        assert_eq!(half_route(&s, "fd00:10:244:1::9"), None);
        assert_eq!(s.half_conflicts().keys().collect::<Vec<_>>(), [LATER]);
        // A host whose half is its own has nothing to be told.
        s.set_own(Some(subnet("10.244.3.0/24")));
        assert_eq!(s.own_half_conflict(), None);
    }
}
