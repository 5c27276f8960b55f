//! Version-agnostic peeks at an IP packet, for the per-packet fast path (route lookup before any
//! full parse), and the IP protocol numbers weft uses.
//!
//! Every function takes any bytes, guards its own length and returns `None` instead of
//! panicking. They do not validate the rest of the header: use [`super::ipv4::Packet::new_checked`]
//! before trusting anything else.

use std::net::Ipv4Addr;

/// IP protocol numbers (IANA "Assigned Internet Protocol Numbers"), shared by the IPv4 protocol
/// field and the IPv6 next header field.
pub mod proto {
    /// ICMP (RFC 792).
    pub const ICMP: u8 = 1;
    /// TCP (RFC 9293).
    pub const TCP: u8 = 6;
    /// UDP (RFC 768).
    pub const UDP: u8 = 17;
}

/// The IP version nibble of the first byte, or `None` for an empty buffer.
#[inline]
pub fn version(buf: &[u8]) -> Option<u8> {
    buf.first().map(|b| b >> 4)
}

/// The IPv4 source address, if `buf` starts like an IPv4 packet (version 4, at least 20 bytes).
#[inline]
pub fn src_v4(buf: &[u8]) -> Option<Ipv4Addr> {
    addr_v4(buf, 12)
}

/// The IPv4 destination address, if `buf` starts like an IPv4 packet (version 4, at least 20
/// bytes).
#[inline]
pub fn dst_v4(buf: &[u8]) -> Option<Ipv4Addr> {
    addr_v4(buf, 16)
}

fn addr_v4(buf: &[u8], at: usize) -> Option<Ipv4Addr> {
    if buf.len() < super::ipv4::HEADER_LEN || version(buf) != Some(4) {
        return None;
    }
    let a = buf.get(at..at + 4)?;
    Some(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn peeks() {
        let p = [0x45, 0, 0, 20, 0, 0, 0, 0, 64, 1, 0, 0, 10, 244, 1, 2, 10, 244, 2, 3];
        assert_eq!(version(&p), Some(4));
        assert_eq!(src_v4(&p), Some(Ipv4Addr::new(10, 244, 1, 2)));
        assert_eq!(dst_v4(&p), Some(Ipv4Addr::new(10, 244, 2, 3)));
        assert_eq!(dst_v4(&p[..19]), None);
        assert_eq!(version(&[]), None);
        let mut v6 = p;
        v6[0] = 0x60;
        assert_eq!(dst_v4(&v6), None);
    }

    proptest! {
        #[test]
        fn peeks_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = (version(&buf), src_v4(&buf), dst_v4(&buf));
        }
    }
}
