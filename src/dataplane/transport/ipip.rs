//! ipip (flannel's ipip backend): the outer IPv4 header goes in front of the packet, in the
//! headroom, with a zero source address that the raw socket's kernel fills in from the socket's
//! binding; a received datagram is the whole outer packet as the raw socket delivers it, from a
//! known peer's `PublicIP`, its ECN decapsulated as RFC 6040 says. Pure, as the rest of
//! [`super`].

use std::net::{Ipv4Addr, SocketAddr};

use super::{DropReason, Forwarder, Rx, TxRoute};
use crate::dataplane::wire::{self, ipip, ipv4};
use crate::route::RouteTable;

/// Writes the outer IPv4 header for `route` into the first [`ipip::OVERHEAD`] bytes of
/// `datagram`, in front of the packet that follows them (whose TTL, DF and ECN it reads).
pub(super) fn emit(route: &TxRoute, datagram: &mut [u8]) {
    if let (Some((head, packet)), SocketAddr::V4(to)) =
        (datagram.split_at_mut_checked(ipip::OVERHEAD), route.to)
    {
        // The packet was validated by `route`; the source is the socket's to fill.
        let _ = ipip::emit_outer(head, packet, Ipv4Addr::UNSPECIFIED, *to.ip());
    }
}

impl Forwarder {
    /// [`Self::decap`] for ipip: `datagram` is the whole outer IPv4 packet (a raw socket of
    /// protocol 4 delivers it so), from a known peer's `PublicIP`.
    pub(super) fn decap_ipip(&self, routes: &RouteTable, datagram: &mut [u8]) -> Rx {
        let Ok(outer) = ipip::parse_outer(datagram) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        let Some(inner) = datagram.get_mut(outer.inner.clone()) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        let ip = match ipv4::Packet::new_checked(&*inner) {
            Ok(ip) => ip,
            Err(wire::Error::BadVersion) => return Rx::Drop(DropReason::RxNotIpv4),
            Err(_) => return Rx::Drop(DropReason::RxMalformed),
        };
        let (src, dst, tos, total) = (ip.src_addr(), ip.dst_addr(), ip.dscp_ecn(), ip.total_len());
        match routes.lookup(src) {
            Some(peer) if peer.public_ip == outer.src => {}
            _ if routes.is_known_peer(outer.src) => return Rx::Drop(DropReason::RxSpoofedSource),
            _ => return Rx::Drop(DropReason::RxUnknownSender),
        }
        if !self.own.contains(dst) {
            return Rx::Drop(DropReason::RxNotForUs);
        }
        match ipip::ecn_decapsulate(outer.tos, tos) {
            ipip::EcnDecap::Keep => {}
            // The inner packet was checked above: marking it cannot fail.
            ipip::EcnDecap::MarkCe => drop(ipip::mark_ce(inner)),
            ipip::EcnDecap::Drop => return Rx::Drop(DropReason::RxEcnNotEct),
        }
        let start = outer.inner.start;
        // No checksum covers the inner packet on the way (the outer header's covers only
        // itself): its own checksums are the kernel's to verify.
        Rx::Deliver { range: start..start + usize::from(total), checksums_trusted: false }
    }
}
