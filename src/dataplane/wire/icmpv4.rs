//! ICMPv4 error messages (RFC 792) that weft writes back into TUN when it cannot forward a
//! packet, as flannel's udp backend does for a destination with no route.
//!
//! The rules for *when not* to send one come from RFC 1122 §3.2.2 (and RFC 1812 §4.3.2.7 for
//! routers); [`emit_dest_unreachable`] enforces them rather than trusting callers to. flannel's
//! udp backend is stricter still (it never answers any ICMP packet); weft answers ICMP queries
//! such as echo requests, which RFC 1122 permits, so `ping` through a missing route reports
//! "Destination Net Unreachable" instead of timing out.

use std::net::Ipv4Addr;

use super::{Error, checksum, ip, ipv4, write_u16, write_u32};

/// Byte offsets of the fields of an ICMP error message header.
mod field {
    use std::ops::Range;

    pub(super) const TYPE: usize = 0;
    pub(super) const CODE: usize = 1;
    pub(super) const CHECKSUM: Range<usize> = 2..4;
    /// Unused, or the next-hop MTU in its low 16 bits (RFC 1191).
    pub(super) const REST: Range<usize> = 4..8;
}

/// The length of an ICMP error header, before the quoted datagram.
pub const HEADER_LEN: usize = field::REST.end;

/// How many payload bytes of the original datagram an error quotes (RFC 792: "the first 64 bits
/// of the original datagram's data").
pub const QUOTED_PAYLOAD_LEN: usize = 8;

/// The TTL of the ICMP errors weft originates (Linux's default `ip_default_ttl`).
pub(crate) const TTL: u8 = 64;

/// The type of a Destination Unreachable message.
pub const TYPE_DEST_UNREACHABLE: u8 = 3;

/// Destination Unreachable codes (RFC 792, RFC 1122 §3.2.2.1, RFC 1812 §5.2.7.1).
pub mod code {
    /// Network unreachable: no route to the destination's subnet (flannel uses this).
    pub const NET_UNREACHABLE: u8 = 0;
    /// Fragmentation needed and DF set; the message carries the next-hop MTU (RFC 1191).
    pub(crate) const FRAG_NEEDED: u8 = 4;
}

/// Whether an ICMP message type is a query (informational) rather than an error: echo reply
/// and request, router advertisement and solicitation, timestamp, information and address
/// mask request and reply. Unknown types count as errors, as in Linux's `icmp_send`, so weft
/// never answers something it cannot classify.
const fn is_icmp_query(icmp_type: u8) -> bool {
    matches!(icmp_type, 0 | 8 | 9 | 10 | 13..=18)
}

/// Whether an address can be the source of a packet that deserves an ICMP error: it must
/// "define a single host" (RFC 1122 §3.2.2), so not zero, loopback, broadcast, multicast or
/// class E.
fn is_single_host(addr: Ipv4Addr) -> bool {
    !(addr.is_unspecified()
        || addr.is_loopback()
        || addr.is_broadcast()
        || addr.is_multicast()
        || addr.octets()[0] >= 240)
}

/// Build a complete IPv4 packet carrying an ICMP Destination Unreachable with `code` (see
/// [`code`]) in reply to `original`, into the start of `out`. Returns the bytes written.
///
/// The packet goes from `our_addr` to the original's source with TTL [`TTL`]; the ICMP message
/// quotes the original's IP header and the first 8 bytes of its payload (less if the payload is
/// shorter), and both checksums are filled.
///
/// # Errors
/// Nothing is written on error.
/// - Whatever [`ipv4::Packet::check_len`] rejects in `original`.
/// - [`Error::IcmpSuppressed`] when RFC 1122 §3.2.2 forbids an error reply: `original` is an ICMP
///   error (or an ICMP message too short to tell), a non-initial fragment, sent from an address
///   that is not a single host, or sent to a multicast or limited broadcast address.
/// - [`Error::BufferTooSmall`] if `out` is shorter than 20 + 8 + the quote.
pub fn emit_dest_unreachable(
    original: &[u8],
    code: u8,
    our_addr: Ipv4Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    emit_error(original, TYPE_DEST_UNREACHABLE, code, 0, our_addr, out)
}

/// Build a "fragmentation needed and DF set" Destination Unreachable carrying `next_hop_mtu`
/// (RFC 1191 §4), for path MTU discovery through the overlay. Same rules and result as
/// [`emit_dest_unreachable`].
///
/// # Errors
/// As [`emit_dest_unreachable`].
pub fn emit_frag_needed(
    original: &[u8],
    next_hop_mtu: u16,
    our_addr: Ipv4Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    let rest = u32::from(next_hop_mtu);
    emit_error(original, TYPE_DEST_UNREACHABLE, code::FRAG_NEEDED, rest, our_addr, out)
}

fn emit_error(
    original: &[u8],
    icmp_type: u8,
    icmp_code: u8,
    rest: u32,
    our_addr: Ipv4Addr,
    out: &mut [u8],
) -> Result<usize, Error> {
    let orig = ipv4::Packet::new_checked(original)?;
    if orig.frag_offset() != 0 {
        return Err(Error::IcmpSuppressed);
    }
    if orig.protocol() == ip::proto::ICMP {
        match orig.payload().first() {
            Some(&t) if is_icmp_query(t) => {}
            _ => return Err(Error::IcmpSuppressed),
        }
    }
    let dst = orig.dst_addr();
    if !is_single_host(orig.src_addr()) || dst.is_multicast() || dst.is_broadcast() {
        return Err(Error::IcmpSuppressed);
    }

    let header_len = usize::from(orig.header_len());
    let quote_len = (header_len + QUOTED_PAYLOAD_LEN).min(usize::from(orig.total_len()));
    let icmp_len = HEADER_LEN + quote_len;
    let ip_repr = ipv4::Repr {
        src_addr: our_addr,
        dst_addr: orig.src_addr(),
        protocol: ip::proto::ICMP,
        payload_len: icmp_len,
        ttl: TTL,
    };
    let Some(out) = out.get_mut(..ip_repr.buffer_len()) else {
        return Err(Error::BufferTooSmall);
    };
    let (ip_hdr, icmp) = out.split_at_mut(ipv4::HEADER_LEN);
    ip_repr.emit(ip_hdr)?;

    icmp[field::TYPE] = icmp_type;
    icmp[field::CODE] = icmp_code;
    write_u16(icmp, field::CHECKSUM.start, 0);
    write_u32(icmp, field::REST.start, rest);
    icmp[HEADER_LEN..].copy_from_slice(&original[..quote_len]);
    let sum = checksum::of(icmp);
    write_u16(icmp, field::CHECKSUM.start, sum);
    Ok(ip_repr.buffer_len())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `ping -s 8 10.244.2.3` from 10.244.1.2 (see `ipv4::tests`).
    const ECHO: [u8; 36] = [
        0x45, 0x00, 0x00, 0x24, 0x12, 0x34, 0x40, 0x00, 0x40, 0x01, 0x0f, 0xb9, 0x0a, 0xf4, 0x01,
        0x02, 0x0a, 0xf4, 0x02, 0x03, 0x08, 0x00, 0x66, 0x68, 0x00, 0x01, 0x00, 0x01, 0x61, 0x62,
        0x63, 0x64, 0x65, 0x66, 0x67, 0x68,
    ];
    const US: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 0);

    fn refill(b: &mut [u8]) {
        ipv4::Packet::new_unchecked(b).fill_checksum();
    }

    #[test]
    fn unreachable_for_echo_request() {
        let mut out = [0xa5u8; 100];
        let n = emit_dest_unreachable(&ECHO, code::NET_UNREACHABLE, US, &mut out).unwrap();
        assert_eq!(n, 20 + 8 + 28);
        assert!(out[n..].iter().all(|&b| b == 0xa5));

        let ip = ipv4::Packet::new_checked(&out[..n]).unwrap();
        assert!(ip.verify_checksum());
        assert_eq!(ip.src_addr(), US);
        assert_eq!(ip.dst_addr(), Ipv4Addr::new(10, 244, 1, 2));
        assert_eq!((ip.ttl(), ip.protocol(), usize::from(ip.total_len())), (64, 1, n));

        let icmp = ip.payload();
        assert_eq!(&icmp[..2], &[3, 0]);
        assert_eq!(checksum::data(icmp), 0xffff);
        assert_eq!(&icmp[4..8], &[0, 0, 0, 0]);
        assert_eq!(&icmp[8..], &ECHO[..28]);

        #[rustfmt::skip]
        let expected: [u8; 56] = [
            0x45, 0x00, 0x00, 0x38, 0x00, 0x00, 0x00, 0x00, 0x40, 0x01,
            ip.checksum().to_be_bytes()[0], ip.checksum().to_be_bytes()[1],
            0x0a, 0xf4, 0x01, 0x00, 0x0a, 0xf4, 0x01, 0x02,
            0x03, 0x00, icmp[2], icmp[3], 0x00, 0x00, 0x00, 0x00,
            0x45, 0x00, 0x00, 0x24, 0x12, 0x34, 0x40, 0x00, 0x40, 0x01, 0x0f, 0xb9, 0x0a, 0xf4,
            0x01, 0x02, 0x0a, 0xf4, 0x02, 0x03, 0x08, 0x00, 0x66, 0x68, 0x00, 0x01, 0x00, 0x01,
        ];
        assert_eq!(out[..n], expected);
    }

    #[test]
    fn frag_needed_carries_mtu() {
        let mut out = [0u8; 100];
        let n = emit_frag_needed(&ECHO, 1450, US, &mut out).unwrap();
        let icmp = &out[20..n];
        assert_eq!(&icmp[..2], &[3, 4]);
        assert_eq!(&icmp[4..8], &[0, 0, 0x05, 0xaa]);
        assert_eq!(checksum::data(icmp), 0xffff);
    }

    #[test]
    fn quote_is_bounded_by_total_length() {
        // Total length 24: a 20-byte header and only 4 payload bytes to quote, whatever the
        // buffer holds after them.
        let mut p = ECHO;
        p[2..4].copy_from_slice(&24u16.to_be_bytes());
        p[9] = ip::proto::UDP;
        refill(&mut p);
        let mut out = [0u8; 100];
        let n = emit_dest_unreachable(&p, 0, US, &mut out).unwrap();
        assert_eq!(n, 20 + 8 + 24);
        assert_eq!(&out[28..n], &p[..24]);
    }

    #[test]
    fn never_for_icmp_errors() {
        for t in [3u8, 4, 5, 11, 12, 42] {
            let mut p = ECHO;
            p[20] = t;
            let mut out = [0xa5u8; 100];
            assert_eq!(emit_dest_unreachable(&p, 0, US, &mut out), Err(Error::IcmpSuppressed));
            assert!(out.iter().all(|&b| b == 0xa5));
        }
        // An ICMP packet with no room for a type cannot be classified: no reply.
        let mut p = ECHO;
        p[2..4].copy_from_slice(&20u16.to_be_bytes());
        refill(&mut p);
        assert_eq!(emit_dest_unreachable(&p, 0, US, &mut [0; 100]), Err(Error::IcmpSuppressed));
    }

    #[test]
    fn never_for_non_initial_fragments() {
        let mut p = ECHO;
        p[6..8].copy_from_slice(&0x0001u16.to_be_bytes()); // offset 8 bytes
        refill(&mut p);
        assert_eq!(emit_dest_unreachable(&p, 0, US, &mut [0; 100]), Err(Error::IcmpSuppressed));
        // The first fragment (MF set, offset 0) does get one.
        p[6..8].copy_from_slice(&0x2000u16.to_be_bytes());
        refill(&mut p);
        assert!(emit_dest_unreachable(&p, 0, US, &mut [0; 100]).is_ok());
    }

    #[test]
    fn never_for_non_unicast_endpoints() {
        for (at, addr) in [
            (12, [0, 0, 0, 0]),
            (12, [127, 0, 0, 1]),
            (12, [255, 255, 255, 255]),
            (12, [224, 0, 0, 1]),
            (12, [240, 0, 0, 1]),
            (16, [224, 0, 0, 251]),
            (16, [255, 255, 255, 255]),
        ] {
            let mut p = ECHO;
            p[at..at + 4].copy_from_slice(&addr);
            refill(&mut p);
            assert_eq!(
                emit_dest_unreachable(&p, 0, US, &mut [0; 100]),
                Err(Error::IcmpSuppressed),
                "{addr:?} at {at}"
            );
        }
    }

    #[test]
    fn invalid_original_or_small_output() {
        assert_eq!(emit_dest_unreachable(&ECHO[..19], 0, US, &mut [0; 100]), Err(Error::Truncated));
        let mut out = [0xa5u8; 55];
        assert_eq!(emit_dest_unreachable(&ECHO, 0, US, &mut out), Err(Error::BufferTooSmall));
        assert!(out.iter().all(|&b| b == 0xa5));
    }

    proptest! {
        #[test]
        fn never_panics_and_replies_are_valid(
            buf in proptest::collection::vec(any::<u8>(), 0..120), out_len in 0usize..120,
        ) {
            let mut out = vec![0u8; out_len];
            if let Ok(n) = emit_dest_unreachable(&buf, 1, US, &mut out) {
                let ip = ipv4::Packet::new_checked(&out[..n]).unwrap();
                prop_assert!(ip.verify_checksum());
                prop_assert_eq!(checksum::data(ip.payload()), 0xffff);
            }
        }

        #[test]
        fn never_panics_on_v4_shaped_input(
            ihl in 5u8..16, proto in prop::sample::select(vec![1u8, 6, 17]),
            rest in proptest::collection::vec(any::<u8>(), 20..100),
        ) {
            let mut buf = rest;
            buf[0] = 0x40 | ihl;
            let len = buf.len() as u16;
            buf[2..4].copy_from_slice(&len.to_be_bytes());
            buf[9] = proto;
            let mut out = [0u8; 128];
            if let Ok(n) = emit_dest_unreachable(&buf, 0, US, &mut out) {
                let quote = usize::from(ihl) * 4 + 8;
                prop_assert_eq!(n, 28 + quote.min(buf.len()));
            }
        }
    }
}
