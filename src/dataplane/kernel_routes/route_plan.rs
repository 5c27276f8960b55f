//! Kernel routes to peers, for the backends that reach peers without weft's TUN device
//! (host-gw; vxlan `DirectRouting`'s peers on the underlay's link): which routes the route
//! table wants, and the changes that take the kernel's main table there. Pure: the driver
//! ([`super`]) reads the table, the underlay and the kernel's routes, asks
//! [`wanted`] and [`plan`] what to do, and applies it over netlink.
//!
//! Contract:
//! - A peer's route is `<subnet> via <PublicIP> dev <underlay>`, as flannel's host-gw
//!   (`pkg/backend/hostgw`, `route_network.go`) and vxlan's direct routing
//!   (`vxlan_network.go`) program it, in the main table, metric 0, with weft's own route
//!   protocol ([`crate::dataplane::sys::netlink::ROUTE_PROTOCOL`]): that is how weft knows its routes again after a restart or
//!   a takeover, and how it tells them from everyone else's.
//! - [`wanted`]: one route per peer of the backend's type (host-gw: leases of `BackendType
//!   "host-gw"`, the others get none, as flannel ignores them, and are told about by
//!   [`crate::route::backends`]; direct routing: vxlan leases)
//!   whose `PublicIP` lies inside one of the underlay's address prefixes (on its link). This
//!   host's own subnet is never routed. Stale peers keep their routes, as the tunnel keeps
//!   forwarding to them. A host-gw peer off the underlay's link gets no route, and is named
//!   ([`Wanted::off_link`]): the kernel would refuse the route (`ENETUNREACH`, which flannel
//!   logs); a direct-routing peer off the link simply stays on the tunnel. A lease of this
//!   host's own `PublicIP` is this host's (an old lease of its, not yet replaced by the new
//!   one: flannel reuses a lease by `PublicIP`), never a peer: it gets no route, and is named
//!   ([`Wanted::own_public_ip`]) so the driver can say so.
//! - [`plan`]: a wanted route the kernel has exactly (ours, via that gateway, through the
//!   underlay, metric 0) needs nothing; any other is [`Change::Put`] (add, or replace a route
//!   to the same destination of metric 0, which is how flannel's `routeAdd` replaces a route
//!   that differs). Routes of weft's protocol inside the Network that no peer wants are
//!   [`Change::Remove`]d, but only once the route table is trusted (`remove`): the table the
//!   daemon starts with is empty until the watcher's first listing, and removing on it would
//!   flap every route on a restart. Routes of any other protocol are never removed.
//! - Deterministic: changes come in destination order, removals first (a peer that moved to
//!   another subnet never has two routes).

#![forbid(unsafe_code)]

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::config::BackendKind;
use crate::dataplane::sys::netlink::{PeerRoute, SeenRoute};
use crate::route::{Peer, PeerBackend, backends};
use crate::vocab::Subnet;

/// Which peers get kernel routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// host-gw: every host-gw peer, each of which must be on the underlay's link.
    HostGw,
    /// Direct routing: the peers of this (tunnel) backend that are on the underlay's link.
    Direct(PeerBackend),
}

/// What the route table wants of the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Wanted {
    /// The routes, in destination order.
    pub(crate) routes: Vec<PeerRoute>,
    /// host-gw peers whose `PublicIP` is on no prefix of the underlay: no route, an error.
    pub(crate) off_link: Vec<PeerRoute>,
    /// Leases of another subnet than this host's whose `PublicIP` is this host's: never a
    /// peer, no route; their subnets.
    pub(crate) own_public_ip: Vec<Ipv4Net>,
}

/// Whether `ip` is on the link whose addresses have the prefixes `prefixes`.
pub(crate) fn on_link(ip: Ipv4Addr, prefixes: &[Ipv4Net]) -> bool {
    prefixes.iter().any(|p| p.prefix_len() < 32 && p.contains(&ip) && p.addr() != ip)
}

/// What this host is, for [`wanted`]: its subnet (once leased) and its `PublicIP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Me {
    /// This host's subnet.
    pub(crate) subnet: Option<Subnet>,
    /// This host's `PublicIP`.
    pub(crate) public_ip: Ipv4Addr,
}

/// The routes `peers` want, for `reach`, with the underlay's address prefixes `prefixes`, on
/// host `me` (see the module docs).
pub(crate) fn wanted(peers: &[Peer], me: Me, reach: Reach, prefixes: &[Ipv4Net]) -> Wanted {
    let mut out = Wanted::default();
    for peer in peers {
        let Some(dst) = peer.subnet.v4() else { continue };
        if me.subnet.and_then(Subnet::v4) == Some(dst) {
            continue;
        }
        if peer.public_ip == me.public_ip {
            out.own_public_ip.push(dst);
            continue;
        }
        let route = PeerRoute { dst, gw: peer.public_ip };
        let linked = on_link(peer.public_ip, prefixes);
        match reach {
            // Told about where every backend's are ([`crate::route::backends`]).
            Reach::HostGw if !backends::reaches(BackendKind::HostGw, peer.backend) => {}
            Reach::HostGw if !linked => out.off_link.push(route),
            Reach::Direct(kind) if peer.backend != kind || !linked => {}
            _ => out.routes.push(route),
        }
    }
    out.routes.sort_unstable();
    out.routes.dedup_by_key(|r| r.dst);
    out.off_link.sort_unstable();
    out.own_public_ip.sort_unstable();
    out
}

/// One change to the kernel's main table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Add `route` through the underlay, replacing a route to its destination of metric 0.
    Put {
        /// The route.
        route: PeerRoute,
        /// The routes to the destination that were there instead (empty: none).
        found: Vec<SeenRoute>,
    },
    /// Remove one of weft's routes that no peer wants.
    Remove(SeenRoute),
}

/// The changes that take `seen` (the main table's unicast IPv4 routes) to `wanted`, through
/// the underlay of index `underlay`, inside `network`; weft's unwanted routes are removed
/// only when `remove` (see the module docs).
pub(crate) fn plan(
    wanted: &[PeerRoute],
    seen: &[SeenRoute],
    underlay: u32,
    network: Ipv4Net,
    remove: bool,
) -> Vec<Change> {
    let mut changes = Vec::new();
    if remove {
        let mut stale: Vec<&SeenRoute> = seen
            .iter()
            .filter(|r| r.ours && network.contains(&r.dst))
            .filter(|r| {
                // A route of ours the wanted one replaces (same destination, metric 0) is not
                // removed first: the replace is atomic, a removal would leave a gap.
                !wanted
                    .iter()
                    .any(|w| w.dst == r.dst && (r.metric == 0 || is_exact(r, w, underlay)))
            })
            .collect();
        stale.sort_by_key(|r| (r.dst, r.gw, r.metric));
        changes.extend(stale.into_iter().cloned().map(Change::Remove));
    }
    for w in wanted {
        if seen.iter().any(|r| is_exact(r, w, underlay)) {
            continue;
        }
        let found: Vec<SeenRoute> = seen.iter().filter(|r| r.dst == w.dst).cloned().collect();
        changes.push(Change::Put { route: *w, found });
    }
    changes
}

/// Whether `r` is the route weft adds for `w`.
fn is_exact(r: &SeenRoute, w: &PeerRoute, underlay: u32) -> bool {
    r.ours && r.dst == w.dst && r.gw == Some(w.gw) && r.oif == Some(underlay) && r.metric == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Peer;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn peer(subnet: &str, public_ip: &str, backend: PeerBackend) -> Peer {
        Peer {
            subnet: subnet.parse().unwrap(),
            public_ip: ip(public_ip),
            backend,
            vtep_mac: None,
            vni: None,
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        }
    }

    fn route(dst: &str, gw: &str) -> PeerRoute {
        PeerRoute { dst: net(dst), gw: ip(gw) }
    }

    fn seen(dst: &str, gw: Option<&str>, oif: u32, ours: bool) -> SeenRoute {
        SeenRoute { dst: net(dst), gw: gw.map(ip), oif: Some(oif), metric: 0, ours }
    }

    const LINK: [&str; 1] = ["192.0.2.1/24"];

    fn prefixes() -> Vec<Ipv4Net> {
        LINK.iter().map(|s| net(s)).collect()
    }

    #[test]
    fn on_link_is_inside_a_prefix_of_the_underlay_and_not_its_own_address() {
        let p = prefixes();
        assert!(on_link(ip("192.0.2.2"), &p));
        assert!(on_link(ip("192.0.2.254"), &p));
        assert!(!on_link(ip("192.0.2.1"), &p), "our own address is no peer's gateway");
        assert!(!on_link(ip("198.51.100.2"), &p));
        assert!(!on_link(ip("192.0.2.2"), &[net("192.0.2.1/32")]), "a /32 has no link");
        assert!(!on_link(ip("192.0.2.2"), &[]));
    }

    /// host-gw routes every host-gw peer on the link, names those off it, ignores the other
    /// backends' peers and never routes its own subnet.
    #[test]
    fn host_gw_wants_its_peers_on_the_link_and_names_the_others() {
        let peers = [
            peer("10.244.3.0/24", "192.0.2.3", PeerBackend::HostGw),
            peer("10.244.2.0/24", "192.0.2.2", PeerBackend::HostGw),
            peer("10.244.1.0/24", "192.0.2.8", PeerBackend::HostGw),
            peer("10.244.7.0/24", "192.0.2.1", PeerBackend::HostGw),
            peer("10.244.9.0/24", "203.0.113.9", PeerBackend::HostGw),
            peer("10.244.5.0/24", "192.0.2.5", PeerBackend::Vxlan),
        ];
        // Host 1, holding 10.244.1.0/24; its old lease 10.244.7.0/24 is no peer either.
        let me = Me { subnet: Some("10.244.1.0/24".parse().unwrap()), public_ip: ip("192.0.2.1") };
        let w = wanted(&peers, me, Reach::HostGw, &prefixes());
        assert_eq!(
            w.routes,
            [route("10.244.2.0/24", "192.0.2.2"), route("10.244.3.0/24", "192.0.2.3")]
        );
        assert_eq!(w.off_link, [route("10.244.9.0/24", "203.0.113.9")]);
        assert_eq!(w.own_public_ip, [net("10.244.7.0/24")], "the old lease is named");
    }

    /// Direct routing wants the tunnel backend's peers on the link only; the rest stay on the
    /// tunnel, unnamed.
    #[test]
    fn direct_routing_wants_the_peers_on_the_link_only() {
        let peers = [
            peer("10.244.2.0/24", "192.0.2.2", PeerBackend::Vxlan),
            peer("10.244.3.0/24", "198.51.100.3", PeerBackend::Vxlan),
            peer("10.244.4.0/24", "192.0.2.4", PeerBackend::HostGw),
        ];
        let me = Me { subnet: None, public_ip: ip("192.0.2.1") };
        let w = wanted(&peers, me, Reach::Direct(PeerBackend::Vxlan), &prefixes());
        assert_eq!(w.routes, [route("10.244.2.0/24", "192.0.2.2")]);
        assert!(w.off_link.is_empty(), "{w:?}");
    }

    const UNDERLAY: u32 = 2;

    fn network() -> Ipv4Net {
        net("10.244.0.0/16")
    }

    #[test]
    fn nothing_changes_when_the_kernel_has_the_routes() {
        let want = [route("10.244.2.0/24", "192.0.2.2")];
        let have = [
            seen("10.244.2.0/24", Some("192.0.2.2"), UNDERLAY, true),
            seen("192.0.2.0/24", None, UNDERLAY, false),
            seen("10.244.0.0/16", None, 7, false),
        ];
        assert_eq!(plan(&want, &have, UNDERLAY, network(), true), []);
    }

    /// A missing route is put; one that differs (another gateway, another device, not ours) is
    /// put over it, naming what was there.
    #[test]
    fn missing_and_differing_routes_are_put() {
        let want = [
            route("10.244.2.0/24", "192.0.2.2"),
            route("10.244.3.0/24", "192.0.2.3"),
            route("10.244.4.0/24", "192.0.2.4"),
        ];
        let other_gw = seen("10.244.3.0/24", Some("192.0.2.33"), UNDERLAY, true);
        let foreign = seen("10.244.4.0/24", Some("192.0.2.4"), UNDERLAY, false);
        let have = [other_gw.clone(), foreign.clone()];
        assert_eq!(
            plan(&want, &have, UNDERLAY, network(), true),
            [
                Change::Put { route: want[0], found: vec![] },
                Change::Put { route: want[1], found: vec![other_gw] },
                Change::Put { route: want[2], found: vec![foreign] },
            ]
        );
    }

    /// weft's routes no peer wants go, once the table is trusted; nobody else's ever do.
    #[test]
    fn only_our_unwanted_routes_inside_the_network_are_removed_and_only_when_trusted() {
        let want = [route("10.244.2.0/24", "192.0.2.2")];
        let gone = seen("10.244.5.0/24", Some("192.0.2.5"), UNDERLAY, true);
        let have = [
            seen("10.244.2.0/24", Some("192.0.2.2"), UNDERLAY, true),
            gone.clone(),
            seen("10.244.6.0/24", Some("192.0.2.6"), UNDERLAY, false),
            seen("198.51.100.0/24", Some("192.0.2.9"), UNDERLAY, true),
        ];
        assert_eq!(plan(&want, &have, UNDERLAY, network(), true), [Change::Remove(gone)]);
        assert_eq!(plan(&want, &have, UNDERLAY, network(), false), []);
    }

    /// A peer that moved to another address is one replace, not a removal and an add; an old
    /// route of ours at another metric beside it goes.
    #[test]
    fn a_moved_peer_is_replaced_in_place() {
        let want = [route("10.244.2.0/24", "192.0.2.22")];
        let old = seen("10.244.2.0/24", Some("192.0.2.2"), UNDERLAY, true);
        let odd = SeenRoute { metric: 5, ..old.clone() };
        assert_eq!(
            plan(&want, std::slice::from_ref(&old), UNDERLAY, network(), true),
            [Change::Put { route: want[0], found: vec![old.clone()] }]
        );
        assert_eq!(
            plan(&want, &[old.clone(), odd.clone()], UNDERLAY, network(), true),
            [Change::Remove(odd.clone()), Change::Put { route: want[0], found: vec![old, odd] }]
        );
    }
}
