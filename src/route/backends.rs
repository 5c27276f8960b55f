//! Peers of another backend: which peers this host cannot reach because their lease announces
//! another backend than the one it runs, and telling about them.
//!
//! Contract:
//! - [`reaches`] is the rule: a host reaches a peer only when both run the same backend (vxlan,
//!   udp, host-gw, ipip; a lease without `BackendType` is udp's). A VXLAN frame is not
//!   decapsulated by a udp peer, a host-gw peer has no tunnel at all, and so on. The data
//!   plane drops a packet to such a peer (`weft_dataplane_drops_total{reason=
//!   "backend_mismatch"}`) and host-gw routes none to it.
//! - [`unreachable_peers`] (pure): the routed peers [`reaches`] refuses, stale ones included
//!   (they are still routed). An alloc host forwards nothing, so it has none.
//! - [`Told`] (pure): what was said, so that each such peer gets one WARN when it appears
//!   (naming its subnet, `PublicIP`, its backend and this host's) and one INFO when it goes
//!   (its lease gone, or announcing this host's backend now).
//! - [`BackendMismatches`]: the gauge `weft_route_backend_mismatched_peers`, and a note for
//!   `/readyz`'s 200 body naming the peers ([`readiness_note`]). Such a peer does not make
//!   this host unready: every host would turn unready for one host restarted on another
//!   backend, and readiness is about what this host can forward (it reaches every peer of its
//!   own backend).
//! - [`watch`]: the driver, run by the daemon while a data plane forwards: it looks again at
//!   every table the route watcher publishes.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch as tokio_watch;
use tracing::{info, warn};

use super::{Peer, PeerBackend, Routes};
use crate::config::BackendKind;
use crate::metrics;
use crate::vocab::Subnet;

/// The most peers [`readiness_note`] names; the rest are counted.
pub(crate) const NAMED_IN_NOTE: usize = 5;

/// Whether a host running `local` reaches a peer whose lease announces `peer` (see the module
/// docs).
pub fn reaches(local: BackendKind, peer: PeerBackend) -> bool {
    matches!(
        (local, peer),
        (BackendKind::Vxlan, PeerBackend::Vxlan)
            | (BackendKind::Udp, PeerBackend::Udp)
            | (BackendKind::HostGw, PeerBackend::HostGw)
            | (BackendKind::Ipip, PeerBackend::Ipip)
            | (BackendKind::Wireguard, PeerBackend::Wireguard { .. })
    )
}

/// A routed peer this host cannot reach: its lease announces another backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unreachable {
    /// The peer's subnet (its lease).
    pub subnet: Subnet,
    /// Its `PublicIP`.
    pub public_ip: Ipv4Addr,
    /// The backend its lease announces.
    pub backend: PeerBackend,
}

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {} ({})", self.subnet, self.public_ip, self.backend)
    }
}

/// The peers among `peers` that a host running `local` cannot reach, in subnet order.
pub fn unreachable_peers(peers: &[Peer], local: BackendKind) -> BTreeSet<Unreachable> {
    if local == BackendKind::Alloc {
        return BTreeSet::new();
    }
    peers
        .iter()
        .filter(|p| !reaches(local, p.backend))
        .map(|p| Unreachable { subnet: p.subnet, public_ip: p.public_ip, backend: p.backend })
        .collect()
}

/// What changed since the last look: the peers to warn about and those to say are gone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Newly unreachable (or unreachable at a new address or with a new backend).
    pub appeared: Vec<Unreachable>,
    /// No longer unreachable as told: the lease is gone, or changed.
    pub gone: Vec<Unreachable>,
}

/// The unreachable peers told about so far.
#[derive(Clone, Debug, Default)]
pub struct Told {
    peers: BTreeSet<Unreachable>,
}

impl Told {
    /// Takes the peers unreachable now; returns what to tell.
    pub fn update(&mut self, now: BTreeSet<Unreachable>) -> Changes {
        let changes = Changes {
            appeared: now.difference(&self.peers).copied().collect(),
            gone: self.peers.difference(&now).copied().collect(),
        };
        self.peers = now;
        changes
    }

    /// The peers unreachable now, in subnet order.
    pub fn peers(&self) -> impl Iterator<Item = &Unreachable> {
        self.peers.iter()
    }
}

/// The note `/readyz` carries while some peers are unreachable (`None`: there are none): how
/// many, this host's backend and the first [`NAMED_IN_NOTE`] of them.
pub fn readiness_note(local: BackendKind, peers: &[Unreachable]) -> Option<String> {
    if peers.is_empty() {
        return None;
    }
    let named: Vec<String> = peers.iter().take(NAMED_IN_NOTE).map(ToString::to_string).collect();
    let more = peers.len().saturating_sub(NAMED_IN_NOTE);
    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
    Some(format!(
        "{} unreachable: {} of another backend than this host's {local}: {}{more}",
        peers.len(),
        if peers.len() == 1 { "a peer" } else { "peers" },
        named.join(", "),
    ))
}

/// The unreachable peers now, for `/metrics` and `/readyz`.
#[derive(Debug)]
pub struct BackendMismatches {
    local: BackendKind,
    peers: Mutex<Vec<Unreachable>>,
    count: AtomicU64,
}

impl BackendMismatches {
    /// None yet, on a host running `local`.
    pub fn new(local: BackendKind) -> Self {
        Self { local, peers: Mutex::default(), count: AtomicU64::new(0) }
    }

    fn set(&self, told: &Told) {
        let peers: Vec<Unreachable> = told.peers().copied().collect();
        self.count.store(peers.len() as u64, Ordering::Relaxed);
        *self.peers.lock().unwrap_or_else(PoisonError::into_inner) = peers;
    }

    /// The note for `/readyz`'s 200 body, if any peer is unreachable.
    pub fn note(&self) -> Option<String> {
        readiness_note(self.local, &self.peers.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Collector for BackendMismatches {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::gauge(
            &mut e,
            "weft_route_backend_mismatched_peers",
            "Routed peers this host cannot reach: their lease announces another backend.",
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// Says what `changes` holds: a WARN per peer that appeared, an INFO per peer gone.
fn tell(local: BackendKind, changes: &Changes) {
    for p in &changes.gone {
        info!(
            subnet = %p.subnet,
            public_ip = %p.public_ip,
            peer_backend = %p.backend,
            "the peer holding {} at {} is no longer one of another backend: its lease is gone \
             or has changed",
            p.subnet,
            p.public_ip
        );
    }
    for p in &changes.appeared {
        warn!(
            subnet = %p.subnet,
            public_ip = %p.public_ip,
            peer_backend = %p.backend,
            backend = %local,
            "cannot reach the peer holding {} at {}: its lease says backend {}, this host runs \
             {local}; hosts on different backends cannot reach each other (the network config \
             changed? restart every host on one backend: docs/troubleshooting.md)",
            p.subnet,
            p.public_ip,
            p.backend
        );
    }
}

/// Follows the tables `routes` publishes until `shutdown`, telling about the peers a host
/// running `local` cannot reach and keeping `status` up to date.
pub async fn watch(
    routes: Arc<Routes>,
    local: BackendKind,
    status: Arc<BackendMismatches>,
    mut shutdown: tokio_watch::Receiver<bool>,
) {
    let mut generation = routes.subscribe();
    let mut told = Told::default();
    loop {
        generation.borrow_and_update();
        let now = unreachable_peers(routes.load().peers(), local);
        let changes = told.update(now);
        tell(local, &changes);
        status.set(&told);
        tokio::select! {
            r = generation.changed() => if r.is_err() { return },
            r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(subnet: &str, host: u8, backend: PeerBackend) -> Peer {
        Peer {
            subnet: subnet.parse().unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, host),
            backend,
            vtep_mac: None,
            vni: None,
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        }
    }

    fn unreachable(subnet: &str, host: u8, backend: PeerBackend) -> Unreachable {
        Unreachable {
            subnet: subnet.parse().unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, host),
            backend,
        }
    }

    /// Each backend reaches its own kind of peer only; an alloc host has no data plane, so
    /// nothing is unreachable to it.
    #[test]
    fn a_host_reaches_only_peers_of_its_own_backend() {
        use BackendKind as B;
        use PeerBackend as P;
        let all = [P::Vxlan, P::Udp, P::HostGw, P::Ipip, P::Other];
        for (local, own) in
            [(B::Vxlan, P::Vxlan), (B::Udp, P::Udp), (B::HostGw, P::HostGw), (B::Ipip, P::Ipip)]
        {
            for peer in all {
                assert_eq!(reaches(local, peer), peer == own, "{local} -> {peer}");
            }
        }
        let peers: Vec<Peer> =
            all.iter().enumerate().map(|(i, b)| peer(&format!("10.244.{i}.0/24"), 1, *b)).collect();
        assert!(unreachable_peers(&peers, B::Alloc).is_empty());
        let got = unreachable_peers(&peers, B::Vxlan);
        let want: BTreeSet<Unreachable> = [
            unreachable("10.244.1.0/24", 1, P::Udp),
            unreachable("10.244.2.0/24", 1, P::HostGw),
            unreachable("10.244.3.0/24", 1, P::Ipip),
            unreachable("10.244.4.0/24", 1, P::Other),
        ]
        .into();
        assert_eq!(got, want);
    }

    /// A peer is told about once when it appears, once when it goes; a new address or
    /// backend is a new peer to tell about.
    #[test]
    fn each_peer_is_told_once_when_it_appears_and_once_when_it_goes() {
        let b = unreachable("10.244.2.0/24", 2, PeerBackend::HostGw);
        let c = unreachable("10.244.3.0/24", 3, PeerBackend::Udp);
        let mut told = Told::default();
        assert_eq!(told.update(BTreeSet::new()), Changes::default());
        assert_eq!(told.update([b].into()), Changes { appeared: vec![b], gone: vec![] });
        assert_eq!(told.update([b].into()), Changes::default());
        assert_eq!(told.update([b, c].into()), Changes { appeared: vec![c], gone: vec![] });
        let moved = Unreachable { public_ip: Ipv4Addr::new(192, 0, 2, 9), ..b };
        assert_eq!(
            told.update([moved, c].into()),
            Changes { appeared: vec![moved], gone: vec![b] }
        );
        assert_eq!(told.update([c].into()), Changes { appeared: vec![], gone: vec![moved] });
        assert_eq!(told.update(BTreeSet::new()), Changes { appeared: vec![], gone: vec![c] });
    }

    /// The note names the peers, their backend and this host's, up to a few, and counts the
    /// rest; none without an unreachable peer.
    #[test]
    fn the_readiness_note_names_the_first_peers_and_counts_the_rest() {
        assert_eq!(readiness_note(BackendKind::Vxlan, &[]), None);
        let one = [unreachable("10.244.2.0/24", 2, PeerBackend::HostGw)];
        assert_eq!(
            readiness_note(BackendKind::Vxlan, &one).unwrap(),
            "1 unreachable: a peer of another backend than this host's vxlan: 10.244.2.0/24 at \
             192.0.2.2 (host-gw)"
        );
        let many: Vec<Unreachable> = (1..=7)
            .map(|i| unreachable(&format!("10.244.{i}.0/24"), i, PeerBackend::Udp))
            .collect();
        let note = readiness_note(BackendKind::HostGw, &many).unwrap();
        assert!(note.starts_with("7 unreachable: peers of another backend than this host's host-gw: 10.244.1.0/24 at 192.0.2.1 (udp), "), "{note}");
        assert!(note.ends_with("10.244.5.0/24 at 192.0.2.5 (udp) and 2 more"), "{note}");
    }
}
