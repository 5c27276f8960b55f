//! vxlan (flannel's vxlan backend): a VXLAN header and an inner Ethernet header in front of
//! each packet, from our VTEP MAC to the peer's; on receive, the VXLAN header's flags and VNI
//! and the inner Ethernet destination (our VTEP MAC) are checked, over either underlay family
//! (IPv6 inner packets travel over the IPv6 underlay only). Pure, as the rest of [`super`].

use std::net::Ipv6Addr;

use super::{DropReason, Forwarder, HEADROOM, Rx, TxRoute};
use crate::config::BackendKind;
use crate::dataplane::sys::udp::gso_tail;
use crate::dataplane::wire::{ethernet, ipv6, vxlan};
use crate::route::RouteTable;

impl Forwarder {
    /// Writes the VXLAN and inner Ethernet headers for `route` into the first [`HEADROOM`]
    /// bytes of `datagram` (nothing when the route has no peer MAC: the udp backend's).
    pub(super) fn emit_vxlan(&self, route: &TxRoute, datagram: &mut [u8]) {
        let head = datagram;
        let (Some(peer_mac), Some((vx, eth))) =
            (route.peer_mac, head.split_at_mut_checked(vxlan::HEADER_LEN))
        else {
            return;
        };
        // Both emits write into room of at least their header length: they cannot fail, and
        // the VNI was validated when the forwarder was built.
        let _ = vxlan::Repr { vni: self.vni }.emit(vx);
        let _ = ethernet::Repr {
            src_addr: self.our_mac,
            dst_addr: peer_mac,
            ethertype: route.ethertype,
        }
        .emit(eth);
    }

    /// The VXLAN checks of every received datagram, whichever family it came over: a VXLAN
    /// header with the I bit alone and our VNI, then an inner Ethernet header to our VTEP MAC.
    /// Returns the inner EtherType, for the caller to check against the family.
    pub(super) fn vxlan_ethertype(
        &self,
        datagram: &[u8],
    ) -> Result<ethernet::EtherType, DropReason> {
        let vx = vxlan::Packet::new_checked(datagram).map_err(|_| DropReason::RxMalformed)?;
        let repr = vxlan::Repr::parse(&vx).map_err(|_| DropReason::RxBadFlags)?;
        if repr.vni != self.vni {
            return Err(DropReason::RxWrongVni);
        }
        let eth = ethernet::Frame::new_checked(&datagram[vxlan::HEADER_LEN..])
            .map_err(|_| DropReason::RxMalformed)?;
        if eth.dst_addr() != self.our_mac {
            return Err(DropReason::RxNotOurMac);
        }
        Ok(eth.ethertype())
    }

    /// [`Self::decap`] of a datagram from an IPv6 sender: VXLAN carrying IPv6, from a peer's
    /// `PublicIPv6`, with an inner source in that peer's IPv6 half.
    pub(super) fn decap6(
        &self,
        routes: &RouteTable,
        from: Ipv6Addr,
        buf: &mut [u8],
        len: usize,
    ) -> Rx {
        let Some(datagram) = buf.get_mut(..len) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        if gso_tail::is_pad(datagram) {
            return Rx::Drop(DropReason::RxGsoPad);
        }
        if self.backend != BackendKind::Vxlan || !self.ipv6.own.is_set() {
            // No IPv6 peer is expected: nothing here sends to one.
            return Rx::Drop(DropReason::RxUnknownSender);
        }
        match self.vxlan_ethertype(datagram) {
            Ok(ethernet::EtherType::IPV6) => {}
            Ok(_) => return Rx::Drop(DropReason::RxNotIpv6),
            Err(reason) => return Rx::Drop(reason),
        }
        let Ok(ip) = ipv6::Packet::new_checked(&datagram[HEADROOM..]) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        let checksums_trusted = match routes.lookup6(ip.src_addr()) {
            Some((peer, half)) if half.public_ip == from => peer.node.is_some(),
            _ if routes.is_known_peer6(from) => return Rx::Drop(DropReason::RxSpoofedSource),
            _ => return Rx::Drop(DropReason::RxUnknownSender),
        };
        if !self.ipv6.own.contains(ip.dst_addr()) {
            return Rx::Drop(DropReason::RxNotForUs);
        }
        // Only the IP packet's own length is delivered, never trailing bytes.
        let total = ipv6::HEADER_LEN + usize::from(ip.payload_len());
        Rx::Deliver { range: HEADROOM..HEADROOM + total, checksums_trusted }
    }
}
