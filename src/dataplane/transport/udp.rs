//! udp (flannel's udp backend): the bare IP packet is the datagram (no header of its own, no
//! headroom); a received packet's TTL is decremented, as flannel's udp proxy does on each hop.
//! Pure, as the rest of [`super`].

use super::DropReason;
use crate::dataplane::wire::ipv4;

/// One hop for a received packet: flannel's udp proxy decrements the TTL on each hop; so do
/// we, against loops. A packet whose TTL would reach 0 is dropped.
pub(super) fn hop(ip: &mut ipv4::Packet<&mut [u8]>) -> Result<(), DropReason> {
    if ip.hop_limit() <= 1 {
        return Err(DropReason::RxTtlExpired);
    }
    ip.decrement_ttl_incremental();
    Ok(())
}
