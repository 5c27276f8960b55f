//! IP in IP (RFC 2003): an IPv4 packet behind an outer IPv4 header of protocol 4, as flannel's
//! ipip backend sends it through its kernel `flannel.ipip` device (Linux's `ipip` module).
//!
//! # The outer header flannel's device writes
//! flannel creates `flannel.ipip` over netlink with `local` set to its interface's address and
//! every other tunnel parameter at Go's zero value: `ttl 0` (inherit), `tos 0`, `pmtudisc 0`
//! (`nopmtudisc`). Linux's `ip_tunnel_xmit` then builds each outer header as [`emit_outer`]
//! does:
//! - **TTL**: the inner packet's (`ttl 0` means inherit);
//! - **DF**: the inner packet's DF bit (without `pmtudisc` the device adds none of its own);
//! - **TOS**: DSCP 0 (`tos 0`), ECN from the inner packet as `INET_ECN_encapsulate` copies it:
//!   ECT(0) and ECT(1) as they are, CE as ECT(0) (RFC 6040's normal mode);
//! - **identification**: left 0 here; the raw socket's kernel fills a zero ID in
//!   (`raw_send_hdrinc`, `ip_select_ident`), as the tunnel's own transmit does.
//!
//! # Receiving
//! [`parse_outer`] takes a datagram as a raw IPv4 socket of protocol 4 delivers it: the outer
//! header first, after the kernel verified its checksum and reassembled fragments. It checks
//! what weft relies on itself (version, lengths, protocol 4, no fragment, the checksum) and
//! returns where the inner packet lies. [`ecn_decapsulate`] applies RFC 6040 as the kernel's
//! `ip_tunnel_rcv` does: an outer CE marks an ECN-capable inner packet CE, and is a drop for an
//! inner packet that is not ECN-capable.
//!
//! Pure: no I/O, no allocation, no panic on any input (see the [module contract](super)).

use std::net::Ipv4Addr;
use std::ops::Range;

use super::{Error, ipv4};

/// The IP protocol number of IP in IP (IANA: "IPv4 encapsulation").
pub const PROTOCOL: u8 = 4;

/// The bytes IP in IP adds in front of each packet: the outer IPv4 header, without options.
pub const OVERHEAD: usize = ipv4::HEADER_LEN;

/// The ECN field's mask in the TOS byte (RFC 3168).
const ECN_MASK: u8 = 0b11;
/// ECN: not ECN-capable transport.
const ECN_NOT_ECT: u8 = 0b00;
/// ECN: ECT(0).
const ECN_ECT0: u8 = 0b10;
/// ECN: congestion experienced.
const ECN_CE: u8 = 0b11;

/// The outer TOS byte for an inner packet whose TOS byte is `inner_tos`: DSCP 0, the inner ECN
/// copied, CE sent as ECT(0) (Linux's `INET_ECN_encapsulate` over a `tos 0` device).
pub fn outer_tos(inner_tos: u8) -> u8 {
    match inner_tos & ECN_MASK {
        ECN_CE => ECN_ECT0,
        ecn => ecn,
    }
}

/// Writes the outer header for the IPv4 packet `inner` (from `src` to `dst`) into
/// `head[..OVERHEAD]`, as flannel's kernel device writes it (see the module docs), checksum
/// included.
///
/// # Errors
/// [`Error::BufferTooSmall`] when `head` is shorter than [`OVERHEAD`]; [`Error::Truncated`],
/// [`Error::BadVersion`], [`Error::BadHeaderLength`] or [`Error::BadTotalLength`] when `inner`
/// is no valid IPv4 packet; [`Error::BadLength`] when the outer total length would pass
/// 65535. Nothing is written on an error.
pub fn emit_outer(
    head: &mut [u8],
    inner: &[u8],
    src: Ipv4Addr,
    dst: Ipv4Addr,
) -> Result<(), Error> {
    if head.len() < OVERHEAD {
        return Err(Error::BufferTooSmall);
    }
    let ip = ipv4::Packet::new_checked(inner)?;
    let total =
        u16::try_from(OVERHEAD + usize::from(ip.total_len())).map_err(|_| Error::BadLength)?;
    let mut outer = ipv4::Packet::new_unchecked(&mut head[..OVERHEAD]);
    outer.set_version(4);
    outer.set_header_len(ipv4::HEADER_LEN as u8);
    outer.set_dscp_ecn(outer_tos(ip.dscp_ecn()));
    outer.set_total_len(total);
    outer.set_ident(0);
    outer.clear_flags();
    outer.set_dont_frag(ip.dont_frag());
    outer.set_ttl(ip.ttl());
    outer.set_protocol(PROTOCOL);
    outer.set_src_addr(src);
    outer.set_dst_addr(dst);
    outer.fill_checksum();
    Ok(())
}

/// A received IP-in-IP datagram's outer header, as [`parse_outer`] read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outer {
    /// The outer source: the sending peer's `PublicIP`.
    pub src: Ipv4Addr,
    /// The outer destination.
    pub dst: Ipv4Addr,
    /// The outer TOS byte (its ECN bits matter, [`ecn_decapsulate`]).
    pub tos: u8,
    /// Where the inner packet lies in the datagram: after the outer header (and its options),
    /// up to the outer total length.
    pub inner: Range<usize>,
}

/// Reads the outer header of `datagram`, a whole IPv4 packet as a raw socket of protocol 4
/// delivers it.
///
/// # Errors
/// [`Error::Truncated`], [`Error::BadVersion`], [`Error::BadHeaderLength`] or
/// [`Error::BadTotalLength`] for no valid IPv4 header; [`Error::Unsupported`] for a protocol
/// other than 4 or a fragment (the kernel reassembles before a raw socket sees one);
/// [`Error::BadChecksum`].
pub fn parse_outer(datagram: &[u8]) -> Result<Outer, Error> {
    let ip = ipv4::Packet::new_checked(datagram)?;
    if ip.protocol() != PROTOCOL || ip.is_fragment() {
        return Err(Error::Unsupported);
    }
    if !ip.verify_checksum() {
        return Err(Error::BadChecksum);
    }
    Ok(Outer {
        src: ip.src_addr(),
        dst: ip.dst_addr(),
        tos: ip.dscp_ecn(),
        inner: usize::from(ip.header_len())..usize::from(ip.total_len()),
    })
}

/// What RFC 6040 makes of the inner packet, from the outer and inner ECN fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EcnDecap {
    /// Deliver the inner packet as it is.
    Keep,
    /// Mark the inner packet CE ([`mark_ce`]), then deliver it: the path said congestion.
    MarkCe,
    /// Drop it: congestion experienced on the path of a packet whose transport cannot be told.
    Drop,
}

/// RFC 6040 §4.2 as Linux's `INET_ECN_decapsulate` applies it: outer CE over a not-ECT inner
/// packet is a drop; outer CE over an ECT inner packet marks it CE; anything else keeps it.
pub fn ecn_decapsulate(outer_tos: u8, inner_tos: u8) -> EcnDecap {
    match (outer_tos & ECN_MASK, inner_tos & ECN_MASK) {
        (ECN_CE, ECN_NOT_ECT) => EcnDecap::Drop,
        (ECN_CE, ECN_CE) => EcnDecap::Keep,
        (ECN_CE, _) => EcnDecap::MarkCe,
        _ => EcnDecap::Keep,
    }
}

/// Sets the IPv4 packet `inner`'s ECN field to CE and its header checksum to match.
///
/// # Errors
/// The [`ipv4::Packet::new_checked`] errors, with nothing written.
pub fn mark_ce(inner: &mut [u8]) -> Result<(), Error> {
    let mut ip = ipv4::Packet::new_checked(inner)?;
    let tos = ip.dscp_ecn();
    ip.set_dscp_ecn(tos | ECN_CE);
    ip.fill_checksum();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
    const DST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);

    /// A 28-byte IPv4/UDP packet 10.244.1.2 -> 10.244.2.3 with `ttl`, `tos` and DF as given.
    fn inner(ttl: u8, tos: u8, df: bool) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        {
            let mut ip = ipv4::Packet::new_unchecked(&mut p[..]);
            ip.set_version(4);
            ip.set_header_len(20);
            ip.set_dscp_ecn(tos);
            ip.set_total_len(28);
            ip.set_ident(0x1234);
            ip.clear_flags();
            ip.set_dont_frag(df);
            ip.set_ttl(ttl);
            ip.set_protocol(17);
            ip.set_src_addr(Ipv4Addr::new(10, 244, 1, 2));
            ip.set_dst_addr(Ipv4Addr::new(10, 244, 2, 3));
            ip.fill_checksum();
        }
        p
    }

    fn encap(packet: &[u8]) -> Vec<u8> {
        let mut d = vec![0xee; OVERHEAD + packet.len()];
        d[OVERHEAD..].copy_from_slice(packet);
        let (head, rest) = d.split_at_mut(OVERHEAD);
        emit_outer(head, rest, SRC, DST).unwrap();
        d
    }

    #[test]
    fn the_outer_header_is_the_kernel_devices() {
        let p = inner(63, 0b1011_1001, true);
        let d = encap(&p);
        // Byte for byte: 45, TOS = inner ECN (ECT(1)) and DSCP 0, length 48, ID 0, DF, TTL
        // inherited, protocol 4, then the checksum and the addresses.
        assert_eq!(&d[..10], &[0x45, 0x01, 0, 48, 0, 0, 0x40, 0, 63, 4]);
        assert_eq!(&d[12..20], &[192, 0, 2, 1, 192, 0, 2, 2]);
        assert!(ipv4::Packet::new_checked(&d[..]).unwrap().verify_checksum());
        assert_eq!(&d[OVERHEAD..], &p[..], "the inner packet is untouched");
        // No DF inside, none outside (flannel's device runs without pmtudisc).
        let d = encap(&inner(1, 0, false));
        assert_eq!((d[6], d[8]), (0, 1));
    }

    #[test]
    fn ecn_is_copied_out_and_ce_goes_as_ect0() {
        for (inner_ecn, outer_ecn) in [(0b00, 0b00), (0b01, 0b01), (0b10, 0b10), (0b11, 0b10)] {
            assert_eq!(outer_tos(0b1010_1000 | inner_ecn), outer_ecn, "inner {inner_ecn:02b}");
        }
    }

    #[test]
    fn emit_refuses_what_it_cannot_describe() {
        let p = inner(64, 0, true);
        assert_eq!(emit_outer(&mut [0; 19], &p, SRC, DST), Err(Error::BufferTooSmall));
        assert_eq!(emit_outer(&mut [0; 20], &p[..27], SRC, DST), Err(Error::BadTotalLength));
        assert_eq!(emit_outer(&mut [0; 20], &[0x60; 40], SRC, DST), Err(Error::BadVersion));
        let mut big = vec![0u8; 65535];
        big[..20].copy_from_slice(&p[..20]);
        big[2..4].copy_from_slice(&65535u16.to_be_bytes());
        let mut head = [7u8; 20];
        assert_eq!(emit_outer(&mut head, &big, SRC, DST), Err(Error::BadLength));
        assert_eq!(head, [7u8; 20], "nothing written");
    }

    #[test]
    fn parse_reads_back_what_emit_wrote() {
        let p = inner(64, 0b10, true);
        let mut d = encap(&p);
        d.extend_from_slice(&[0xaa; 6]); // link padding past the total length
        let o = parse_outer(&d).unwrap();
        assert_eq!((o.src, o.dst, o.tos), (SRC, DST, 0b10));
        assert_eq!(&d[o.inner.clone()], &p[..]);
    }

    #[test]
    fn parse_skips_outer_options() {
        let p = inner(64, 0, false);
        let mut d = vec![0u8; 24 + p.len()];
        d[24..].copy_from_slice(&p);
        {
            let mut ip = ipv4::Packet::new_unchecked(&mut d[..]);
            ip.set_version(4);
            ip.set_header_len(24);
            ip.set_total_len((24 + p.len()) as u16);
            ip.set_ttl(9);
            ip.set_protocol(PROTOCOL);
            ip.set_src_addr(SRC);
            ip.set_dst_addr(DST);
        }
        d[20] = 1; // NOP options
        d[21] = 1;
        d[22] = 1;
        d[23] = 0;
        ipv4::Packet::new_unchecked(&mut d[..]).fill_checksum();
        assert_eq!(parse_outer(&d).unwrap().inner, 24..24 + p.len());
    }

    #[test]
    fn parse_refuses_what_is_not_ip_in_ip() {
        let good = encap(&inner(64, 0, true));
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut d = good.clone();
            f(&mut d);
            parse_outer(&d)
        };
        let fix = |d: &mut Vec<u8>| ipv4::Packet::new_unchecked(&mut d[..]).fill_checksum();
        assert_eq!(parse_outer(&[]), Err(Error::Truncated));
        assert_eq!(parse_outer(&good[..19]), Err(Error::Truncated));
        assert_eq!(parse_outer(&good[..40]), Err(Error::BadTotalLength));
        assert_eq!(with(&|d| d[0] = 0x65), Err(Error::BadVersion));
        assert_eq!(with(&|d| d[0] = 0x44), Err(Error::BadHeaderLength));
        assert_eq!(
            with(&|d| {
                d[9] = 17;
                fix(d)
            }),
            Err(Error::Unsupported)
        );
        assert_eq!(
            with(&|d| {
                d[6] = 0x20;
                fix(d)
            }),
            Err(Error::Unsupported),
            "MF"
        );
        assert_eq!(
            with(&|d| {
                d[7] = 1;
                fix(d)
            }),
            Err(Error::Unsupported),
            "offset"
        );
        assert_eq!(with(&|d| d[8] ^= 1), Err(Error::BadChecksum));
    }

    #[test]
    fn ecn_decapsulation_follows_rfc_6040() {
        use EcnDecap::{Drop, Keep, MarkCe};
        // Rows: outer not-ECT, ECT(1), ECT(0), CE; columns: inner the same four.
        let want = [
            [Keep, Keep, Keep, Keep],
            [Keep, Keep, Keep, Keep],
            [Keep, Keep, Keep, Keep],
            [Drop, MarkCe, MarkCe, Keep],
        ];
        for (outer, row) in want.iter().enumerate() {
            for (inner, want) in row.iter().enumerate() {
                assert_eq!(
                    ecn_decapsulate(0xfc | outer as u8, inner as u8),
                    *want,
                    "{outer} {inner}"
                );
            }
        }
        let mut p = inner(64, 0b1000_0010, true);
        mark_ce(&mut p).unwrap();
        let ip = ipv4::Packet::new_checked(&p[..]).unwrap();
        assert_eq!(ip.dscp_ecn(), 0b1000_0011);
        assert!(ip.verify_checksum());
        assert_eq!(mark_ce(&mut [0u8; 3]), Err(Error::Truncated));
    }
}
