//! ICMPv6 error messages (RFC 4443) that weft writes back into TUN when it cannot forward an
//! IPv6 packet: Destination Unreachable for a destination in no lease (the IPv6 twin of
//! [`super::icmpv4::emit_dest_unreachable`]), and Packet Too Big for path MTU discovery
//! through the overlay.
//!
//! The rules for *when not* to send one are RFC 4443 §2.4 (e); [`emit_dest_unreachable`]
//! enforces them rather than trusting callers to. It never answers what it cannot classify: an
//! upper-layer header hidden behind an extension header it does not walk, or behind a
//! non-initial fragment, gets no reply, as an ICMPv6 error might otherwise answer an error.

#![forbid(unsafe_code)]

use std::net::Ipv6Addr;

use super::{Error, checksum, ipv6, write_u16, write_u32};

/// Byte offsets of the fields of an ICMPv6 error message header.
mod field {
    use std::ops::Range;

    pub(super) const TYPE: usize = 0;
    pub(super) const CODE: usize = 1;
    pub(super) const CHECKSUM: Range<usize> = 2..4;
    /// Unused, or the MTU of a Packet Too Big.
    pub(super) const REST: Range<usize> = 4..8;
}

/// The length of an ICMPv6 error header, before the quoted packet.
pub const HEADER_LEN: usize = field::REST.end;

/// The IPv6 minimum MTU (RFC 8200 §5): an error message is never longer, so it quotes as much
/// of the invoking packet as fits in it (RFC 4443 §2.4 (c)).
pub const MIN_MTU: usize = 1280;

/// The longest quote: what fits in [`MIN_MTU`] after the IPv6 and ICMPv6 headers.
pub const MAX_QUOTE_LEN: usize = MIN_MTU - ipv6::HEADER_LEN - HEADER_LEN;

/// The hop limit of the errors weft originates (Linux's default `hop_limit`).
pub(crate) const HOP_LIMIT: u8 = 64;

/// The IPv6 next-header value of ICMPv6 (RFC 4443).
pub const NEXT_HEADER: u8 = 58;

/// The type of a Destination Unreachable message.
pub const TYPE_DEST_UNREACHABLE: u8 = 1;

/// The type of a Packet Too Big message.
pub const TYPE_PACKET_TOO_BIG: u8 = 2;

/// Destination Unreachable codes (RFC 4443 §3.1).
pub mod code {
    /// No route to destination: a destination in no lease (the IPv4 "net unreachable").
    pub const NO_ROUTE: u8 = 0;
}

/// IPv6 extension headers walked to find the upper-layer protocol (RFC 8200 §4).
mod ext {
    pub(super) const HOP_BY_HOP: u8 = 0;
    pub(super) const ROUTING: u8 = 43;
    pub(super) const FRAGMENT: u8 = 44;
    pub(super) const AUTH: u8 = 51;
    pub(super) const DEST_OPTS: u8 = 60;
}

/// At most this many extension headers are walked; a longer chain gets no reply.
const MAX_EXTENSION_HEADERS: usize = 8;

/// The upper-layer protocol of a packet and the offset of its header in the packet, walking the
/// extension headers; `None` if it cannot be told: a chain that is truncated, too long, or
/// passes a non-initial fragment (whose upper-layer header is in another packet).
fn upper_layer(packet: &[u8]) -> Option<(u8, usize)> {
    let mut next = *packet.get(6)?;
    let mut at = ipv6::HEADER_LEN;
    for _ in 0..MAX_EXTENSION_HEADERS {
        let len = match next {
            ext::HOP_BY_HOP | ext::ROUTING | ext::DEST_OPTS => {
                (usize::from(*packet.get(at + 1)?) + 1) * 8
            }
            ext::AUTH => (usize::from(*packet.get(at + 1)?) + 2) * 4,
            ext::FRAGMENT => {
                let offset = u16::from_be_bytes([*packet.get(at + 2)?, *packet.get(at + 3)?]);
                if offset >> 3 != 0 {
                    return None;
                }
                8
            }
            upper => return Some((upper, at)),
        };
        next = *packet.get(at)?;
        at = at.checked_add(len)?;
        if at > packet.len() {
            return None;
        }
    }
    None
}

/// Whether an address can be the source of a packet that deserves an ICMPv6 error: it must
/// identify a single node (RFC 4443 §2.4 (e.6)), so not unspecified, loopback or multicast.
fn is_single_node(addr: Ipv6Addr) -> bool {
    !(addr.is_unspecified() || addr.is_loopback() || addr.is_multicast())
}

/// Build a complete IPv6 packet carrying an ICMPv6 Destination Unreachable with `code` (see
/// [`code`]) in reply to `original`, into the start of `out`. Returns the bytes written.
///
/// The packet goes from `our_addr` to the original's source with hop limit [`HOP_LIMIT`]; it
/// quotes as much of the original as fits in [`MIN_MTU`], and its checksum covers the IPv6
/// pseudo header.
///
/// # Errors
/// Nothing is written on error.
/// - Whatever [`ipv6::Packet::new_checked`] rejects in `original`.
/// - [`Error::IcmpSuppressed`] when RFC 4443 §2.4 (e) forbids an error reply: `original` is an
///   ICMPv6 error (or its upper layer cannot be told), or it was sent to a multicast address,
///   or from an address that is not a single node.
/// - [`Error::BufferTooSmall`] if `out` is shorter than the reply.
pub fn emit_dest_unreachable(
    original: &[u8],
    code: u8,
    our_addr: Ipv6Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    emit_error(original, TYPE_DEST_UNREACHABLE, code, 0, our_addr, out)
}

/// Build a Packet Too Big carrying `mtu` (RFC 4443 §3.2, RFC 8201), for path MTU discovery
/// through the overlay. Same rules and result as [`emit_dest_unreachable`].
///
/// # Errors
/// As [`emit_dest_unreachable`].
pub fn emit_packet_too_big(
    original: &[u8],
    mtu: u32,
    our_addr: Ipv6Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    emit_error(original, TYPE_PACKET_TOO_BIG, 0, mtu, our_addr, out)
}

fn emit_error(
    original: &[u8],
    icmp_type: u8,
    icmp_code: u8,
    rest: u32,
    our_addr: Ipv6Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    let orig = ipv6::Packet::new_checked(original)?;
    let packet = orig.packet();
    match upper_layer(packet) {
        // An informational message (type 128 and up) may be answered; an error never is.
        Some((NEXT_HEADER, at)) => match packet.get(at) {
            Some(&t) if t >= 128 => {}
            _ => return Err(Error::IcmpSuppressed),
        },
        Some(_) => {}
        None => return Err(Error::IcmpSuppressed),
    }
    if !is_single_node(orig.src_addr()) || orig.dst_addr().is_multicast() {
        return Err(Error::IcmpSuppressed);
    }

    let quote = &packet[..packet.len().min(MAX_QUOTE_LEN)];
    let icmp_len = HEADER_LEN + quote.len();
    let ip_repr = ipv6::Repr {
        src_addr: our_addr,
        dst_addr: orig.src_addr(),
        next_header: NEXT_HEADER,
        payload_len: icmp_len,
        hop_limit: HOP_LIMIT,
    };
    let Some(out) = out.get_mut(..ip_repr.buffer_len()) else {
        return Err(Error::BufferTooSmall);
    };
    let (ip_hdr, icmp) = out.split_at_mut(ipv6::HEADER_LEN);
    ip_repr.emit(ip_hdr)?;

    icmp[field::TYPE] = icmp_type;
    icmp[field::CODE] = icmp_code;
    write_u16(icmp, field::CHECKSUM.start, 0);
    write_u32(icmp, field::REST.start, rest);
    icmp[HEADER_LEN..].copy_from_slice(quote);
    // At most MIN_MTU bytes: the length fits in 32 bits.
    let pseudo =
        checksum::pseudo_header_v6(our_addr, orig.src_addr(), NEXT_HEADER, icmp_len as u32);
    let sum = !checksum::combine(&[pseudo, checksum::data(icmp)]);
    write_u16(icmp, field::CHECKSUM.start, sum);
    Ok(ip_repr.buffer_len())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const POD: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
    const FAR: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 9, 0, 0, 0, 3);
    const US: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0);

    /// An IPv6 packet from `src` to `dst`: `next` then `payload`.
    fn packet(src: Ipv6Addr, dst: Ipv6Addr, next: u8, payload: &[u8]) -> Vec<u8> {
        let repr = ipv6::Repr {
            src_addr: src,
            dst_addr: dst,
            next_header: next,
            payload_len: payload.len(),
            hop_limit: 64,
        };
        let mut p = vec![0; repr.buffer_len()];
        repr.emit(&mut p).unwrap();
        p[ipv6::HEADER_LEN..].copy_from_slice(payload);
        p
    }

    /// An echo request (type 128) with 8 bytes of data.
    fn echo(src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
        packet(src, dst, NEXT_HEADER, &[128, 0, 0x12, 0x34, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8])
    }

    /// Whether an ICMPv6 message's checksum is right for its IPv6 header.
    fn checksum_ok(reply: &[u8]) -> bool {
        let ip = ipv6::Packet::new_checked(reply).unwrap();
        let icmp = ip.payload();
        let pseudo = checksum::pseudo_header_v6(
            ip.src_addr(),
            ip.dst_addr(),
            NEXT_HEADER,
            icmp.len() as u32,
        );
        checksum::combine(&[pseudo, checksum::data(icmp)]) == 0xffff
    }

    #[test]
    fn an_echo_request_to_nowhere_is_answered_no_route_quoting_it_whole() {
        let original = echo(POD, FAR);
        let mut out = [0xa5u8; 200];
        let n = emit_dest_unreachable(&original, code::NO_ROUTE, US, &mut out).unwrap();
        assert_eq!(n, 40 + 8 + original.len());
        assert!(out[n..].iter().all(|&b| b == 0xa5));
        let ip = ipv6::Packet::new_checked(&out[..n]).unwrap();
        assert_eq!((ip.src_addr(), ip.dst_addr()), (US, POD));
        assert_eq!((ip.next_header(), ip.hop_limit()), (58, 64));
        assert_eq!(&ip.payload()[..2], &[1, 0]);
        assert_eq!(&ip.payload()[4..8], &[0, 0, 0, 0]);
        assert_eq!(&ip.payload()[8..], &original[..]);
        assert!(checksum_ok(&out[..n]));
        // A TCP segment is answered too; a Packet Too Big carries the MTU.
        let tcp = packet(POD, FAR, 6, &[0u8; 20]);
        let n = emit_packet_too_big(&tcp, 1400, US, &mut out).unwrap();
        assert_eq!(&out[40..48], &[2, 0, out[42], out[43], 0, 0, 0x05, 0x78]);
        assert!(checksum_ok(&out[..n]));
    }

    #[test]
    fn the_quote_stops_at_the_minimum_mtu() {
        let big = packet(POD, FAR, 17, &[7u8; 3000]);
        let mut out = [0u8; 2000];
        let n = emit_dest_unreachable(&big, code::NO_ROUTE, US, &mut out).unwrap();
        assert_eq!(n, MIN_MTU);
        assert_eq!(&out[48..n], &big[..MAX_QUOTE_LEN]);
        assert!(checksum_ok(&out[..n]));
        assert_eq!(
            emit_dest_unreachable(&big, code::NO_ROUTE, US, &mut out[..MIN_MTU - 1]),
            Err(Error::BufferTooSmall)
        );
    }

    #[test]
    fn errors_multicast_and_unclassifiable_packets_are_never_answered() {
        let mut out = [0u8; 200];
        let mut suppressed = |p: &[u8]| {
            emit_dest_unreachable(p, code::NO_ROUTE, US, &mut out) == Err(Error::IcmpSuppressed)
        };
        // An ICMPv6 error (a Destination Unreachable), and an ICMPv6 message too short to tell.
        assert!(suppressed(&packet(POD, FAR, NEXT_HEADER, &[1, 0, 0, 0, 0, 0, 0, 0])));
        assert!(suppressed(&packet(POD, FAR, NEXT_HEADER, &[])));
        // To a multicast group; from the unspecified address, loopback or a multicast group.
        assert!(suppressed(&echo(POD, "ff02::1".parse().unwrap())));
        assert!(suppressed(&echo(Ipv6Addr::UNSPECIFIED, FAR)));
        assert!(suppressed(&echo(Ipv6Addr::LOCALHOST, FAR)));
        assert!(suppressed(&echo("ff02::2".parse().unwrap(), FAR)));
        // An error behind a hop-by-hop header is still an error; an echo behind one is not.
        let hbh = |inner: &[u8]| {
            let mut payload = vec![NEXT_HEADER, 0, 1, 4, 0, 0, 0, 0];
            payload.extend_from_slice(inner);
            packet(POD, FAR, 0, &payload)
        };
        assert!(suppressed(&hbh(&[1, 0, 0, 0, 0, 0, 0, 0])));
        assert!(!suppressed(&hbh(&[128, 0, 0, 0, 0, 0, 0, 0])));
        // A first fragment is walked past; a later fragment hides its upper layer.
        let frag = |offset: u16, inner: &[u8]| {
            let o = (offset << 3).to_be_bytes();
            let mut payload = vec![NEXT_HEADER, 0, o[0], o[1] | 1, 0, 0, 0, 9];
            payload.extend_from_slice(inner);
            packet(POD, FAR, 44, &payload)
        };
        assert!(!suppressed(&frag(0, &[128, 0, 0, 0])));
        assert!(suppressed(&frag(0, &[1, 0, 0, 0])));
        assert!(suppressed(&frag(1, &[128, 0, 0, 0])));
        // A truncated or endless extension chain.
        assert!(suppressed(&packet(POD, FAR, 60, &[6, 4, 0, 0])));
        assert!(suppressed(&packet(POD, FAR, 60, &[60, 0, 0, 0, 0, 0, 0, 0].repeat(9))));
        // Not IPv6 at all.
        assert_eq!(
            emit_dest_unreachable(&[0x45, 0, 0, 20], code::NO_ROUTE, US, &mut [0u8; 200]),
            Err(Error::Truncated)
        );
    }

    proptest! {
        #[test]
        fn never_panics_and_every_reply_is_well_formed(
            bytes in proptest::collection::vec(any::<u8>(), 0..1600),
            out_len in 0usize..1400,
        ) {
            let mut out = vec![0u8; out_len];
            if let Ok(n) = emit_dest_unreachable(&bytes, code::NO_ROUTE, US, &mut out) {
                prop_assert!((48..=MIN_MTU).contains(&n));
                prop_assert!(checksum_ok(&out[..n]));
            }
        }
    }
}
