//! What netlink reads from the kernel and writes to it, as plain data: a link as seen
//! ([`ObservedLink`]), a route of the main table as seen ([`SeenRoute`]) and a route to a peer
//! ([`PeerRoute`], of weft's [`ROUTE_PROTOCOL`]). The planners above (`tunnel::drift`,
//! `kernel_routes::route_plan`) take and give these; the driver ([`super::Netlink`]) reads and
//! writes them, and imports no planner.

#![forbid(unsafe_code)]

use std::net::Ipv4Addr;

use ipnet::{Ipv4Net, Ipv6Net};

/// The route protocol (`rtm_protocol`) of the routes weft adds to peers: `ip route show proto
/// 119` lists them. Not one the kernel or iproute2 assigns (`/etc/iproute2/rt_protos`).
pub(crate) const ROUTE_PROTOCOL: u8 = 119;

/// A kernel route to a peer: `dst via gw`, through the underlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct PeerRoute {
    /// The peer's subnet.
    pub(crate) dst: Ipv4Net,
    /// The peer's `PublicIP`.
    pub(crate) gw: Ipv4Addr,
}

impl std::fmt::Display for PeerRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} via {}", self.dst, self.gw)
    }
}

/// A unicast IPv4 route of the kernel's main table, as far as planning goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SeenRoute {
    /// Its destination.
    pub(crate) dst: Ipv4Net,
    /// Its gateway, if it has one.
    pub(crate) gw: Option<Ipv4Addr>,
    /// Its output interface, if it has one.
    pub(crate) oif: Option<u32>,
    /// Its metric (`RTA_PRIORITY`; 0 when absent).
    pub(crate) metric: u32,
    /// Whether it is of [`ROUTE_PROTOCOL`]: weft added it.
    pub(crate) ours: bool,
}

impl std::fmt::Display for SeenRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.dst)?;
        if let Some(gw) = self.gw {
            write!(f, " via {gw}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev #{oif}")?;
        }
        if self.metric != 0 {
            write!(f, " metric {}", self.metric)?;
        }
        Ok(())
    }
}

/// The link state the kernel reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedLink {
    /// `IFF_UP` is set.
    pub(crate) up: bool,
    /// The MTU.
    pub(crate) mtu: u32,
    /// The IPv4 addresses on the device, with their prefix lengths.
    pub(crate) addresses: Vec<Ipv4Net>,
    /// The destinations of the main table's routes through the device without a gateway.
    pub(crate) routes: Vec<Ipv4Net>,
    /// The IPv6 addresses on the device (read only on a dual-stack network).
    pub(crate) addresses6: Vec<Ipv6Net>,
    /// The destinations of the main table's IPv6 routes through the device without a gateway
    /// (read only on a dual-stack network).
    pub(crate) routes6: Vec<Ipv6Net>,
}
