//! Checked views over packet bytes, one module per protocol, in the smoltcp style.
//!
//! Everything here is pure: no I/O, no allocation, and no panics on network input. Each protocol
//! module offers a `Packet<T>` (or `Frame<T>`) view over any `T: AsRef<[u8]>` and, where the
//! header has a meaning weft acts on, a `Repr` holding that meaning.
//!
//! # The panic contract
//!
//! - [`ipv4::Packet::new_unchecked`] (and its siblings) wraps a buffer without looking at it.
//!   Accessors on such a view **may panic** if the buffer is too short.
//! - `check_len` proves that every accessor is in bounds: after it returns `Ok`, no getter,
//!   setter or payload accessor panics, whatever the bytes say, until a setter rewrites a length
//!   field (`set_header_len`, `set_total_len`, `set_payload_len`, `set_len`): that is the
//!   caller's promise about the buffer, and the view has to be checked again before it is
//!   trusted.
//! - `new_checked` is `new_unchecked` followed by `check_len`. **When parsing untrusted input
//!   (anything read from TUN or a UDP socket) use `new_checked`.** `new_unchecked` is for output
//!   buffers the caller sized itself (an emit target of at least `Repr::buffer_len()` bytes).
//! - Getters live on `T: AsRef<[u8]>`; setters and `*_mut` accessors live on
//!   `T: AsRef<[u8]> + AsMut<[u8]>`, so a view over a shared slice cannot write.
//! - `Repr::parse` validates everything the `Repr` claims and rejects what it cannot represent.
//!   `Repr::emit` writes its header into the start of a `&mut [u8]` and never panics: it checks
//!   the buffer holds the header (else [`Error::BufferTooSmall`], nothing written) and writes
//!   every header byte it owns, so a reused buffer cannot leak old bytes into a header. The
//!   payload is the caller's; `Repr::buffer_len()` is the length of header plus payload.
//!
//! Payload accessors are bounded by the length field in the header (IPv4 total length, IPv6
//! payload length, UDP length), never by the buffer length: TUN and NIC buffers may carry padding.
//!
//! Checksums are the RFC 1071 Internet checksum, in [`checksum`].

#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, Ipv6Addr};

pub mod ethernet;
pub mod icmpv4;
pub mod icmpv6;
pub mod ip;
pub mod ipip;
pub mod ipv4;
pub mod ipv6;
pub mod tcp;
pub mod udp;
pub mod virtio_net;
pub mod vxlan;

pub use vxlan::{Packet as VxlanPacket, Repr as VxlanRepr, Vni};

/// Big-endian reads and writes at a byte offset; callers have proven the bounds (`check_len`).
#[inline]
pub(crate) fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
pub(crate) fn write_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn write_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

/// Why bytes could not be viewed, parsed or emitted as a packet.
///
/// Small and `Copy` so the hot path can count drops per reason without allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Error {
    /// The buffer is shorter than the header (or than a length field says it must be).
    #[error("packet truncated")]
    Truncated,
    /// The IP version nibble is not the one the view expects.
    #[error("wrong IP version")]
    BadVersion,
    /// A header length field (IPv4 IHL, TCP data offset) is below the minimum or past the buffer.
    #[error("bad header length")]
    BadHeaderLength,
    /// The IPv4 total length is below the header length or past the buffer.
    #[error("bad total length")]
    BadTotalLength,
    /// Some other length field (IPv6 payload length, UDP length) is inconsistent.
    #[error("bad length field")]
    BadLength,
    /// Flag or reserved bits are set that the protocol (as weft speaks it) does not allow.
    #[error("bad flags")]
    BadFlags,
    /// A VXLAN network identifier does not fit in 24 bits.
    #[error("VNI out of range (must be < 2^24)")]
    BadVni,
    /// A checksum did not verify.
    #[error("bad checksum")]
    BadChecksum,
    /// Well-formed, but a feature this code does not handle (IPv4 options, fragments, ...).
    #[error("unsupported packet")]
    Unsupported,
    /// The output buffer is too small for what was to be emitted.
    #[error("output buffer too small")]
    BufferTooSmall,
    /// RFC 1122 §3.2.2 forbids an ICMP error in reply to this packet (an ICMP error, a
    /// non-initial fragment, or a source or destination that is not a single host).
    #[error("an ICMP error must not be sent for this packet")]
    IcmpSuppressed,
}

impl From<crate::vocab::VniOutOfRange> for Error {
    fn from(_: crate::vocab::VniOutOfRange) -> Self {
        Self::BadVni
    }
}

/// The RFC 1071 Internet checksum: the 16-bit ones' complement of the ones' complement sum.
///
/// The functions here return the *sum* (not yet complemented), so partial sums over a pseudo
/// header and several slices can be [`combine`](checksum::combine)d before the final `!`.
pub mod checksum {
    use super::*;

    /// Fold a 64-bit ones' complement accumulator to 16 bits (end-around carry).
    ///
    /// Valid because 2^16 ≡ 1 (mod 2^16 - 1): the high halves can be added into the low ones.
    #[inline]
    const fn fold(mut acc: u64) -> u16 {
        acc = (acc >> 32) + (acc & 0xffff_ffff);
        acc = (acc >> 32) + (acc & 0xffff_ffff);
        acc = (acc >> 16) + (acc & 0xffff);
        acc = (acc >> 16) + (acc & 0xffff);
        acc as u16
    }

    /// Add `w` to `acc` in 64-bit ones' complement arithmetic (the carry wraps around).
    #[inline]
    const fn add64(acc: u64, w: u64) -> u64 {
        let (sum, carry) = acc.overflowing_add(w);
        // Cannot overflow: after a wrap, `sum` is at most 2^64 - 2.
        sum + carry as u64
    }

    /// The ones' complement sum of `data` taken as big-endian 16-bit words (RFC 1071 §4.1), an
    /// odd last byte padded with zero. Not complemented.
    ///
    /// Sums native-endian 64-bit words with end-around carry, two independent accumulators at a
    /// time, and swaps the folded result's bytes at the end: the ones' complement sum is
    /// independent of byte order up to that final swap (RFC 1071 §2(B)). This runs over every
    /// byte a TSO split produces, so it avoids a byte swap per word.
    pub fn data(data: &[u8]) -> u16 {
        let (mut a, mut b) = (0u64, 0u64);
        let mut pairs = data.chunks_exact(16);
        for p in &mut pairs {
            let (lo, hi) = p.split_at(8);
            // chunks_exact(16) split at 8: both halves are exactly 8 bytes.
            a = add64(a, u64::from_ne_bytes(lo.try_into().unwrap_or([0; 8])));
            b = add64(b, u64::from_ne_bytes(hi.try_into().unwrap_or([0; 8])));
        }
        let rest = pairs.remainder();
        let mut tail = [0u8; 16];
        tail[..rest.len()].copy_from_slice(rest);
        a = add64(a, u64::from_ne_bytes(tail[..8].try_into().unwrap_or([0; 8])));
        b = add64(b, u64::from_ne_bytes(tail[8..].try_into().unwrap_or([0; 8])));
        let native = fold(add64(a, b));
        if cfg!(target_endian = "little") { native.swap_bytes() } else { native }
    }

    /// Combine partial ones' complement sums (from [`data`] or the pseudo-header functions).
    pub fn combine(sums: &[u16]) -> u16 {
        let mut acc: u64 = 0;
        for &s in sums {
            acc += u64::from(s);
        }
        fold(acc)
    }

    /// The sum of the IPv4 pseudo header (RFC 793 §3.1, RFC 768): source, destination, zero,
    /// protocol and the transport length.
    pub(crate) fn pseudo_header_v4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, length: u16) -> u16 {
        let s = u64::from(u32::from(src));
        let d = u64::from(u32::from(dst));
        fold(s + d + u64::from(protocol) + u64::from(length))
    }

    /// The sum of the IPv6 pseudo header (RFC 8200 §8.1): source, destination, the 32-bit
    /// upper-layer length and the next header value.
    pub fn pseudo_header_v6(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, length: u32) -> u16 {
        let s = u128::from(src);
        let d = u128::from(dst);
        let mut acc: u64 = 0;
        for v in [s >> 64, s & u128::from(u64::MAX), d >> 64, d & u128::from(u64::MAX)] {
            acc = add64(acc, v as u64);
        }
        acc = add64(acc, u64::from(length));
        acc = add64(acc, u64::from(next_header));
        fold(acc)
    }

    /// The checksum field value for `data` alone: `!data(data)`. Summing a buffer that contains
    /// a correct checksum gives `0xffff`.
    pub(crate) fn of(data: &[u8]) -> u16 {
        !self::data(data)
    }

    #[cfg(test)]
    mod tests {
        use proptest::prelude::*;

        use super::*;

        /// The textbook one-word-at-a-time sum, as the reference for the fast one.
        fn naive(data: &[u8]) -> u16 {
            let mut acc: u32 = 0;
            for w in data.chunks(2) {
                let word = if w.len() == 2 {
                    u16::from_be_bytes([w[0], w[1]])
                } else {
                    u16::from(w[0]) << 8
                };
                acc += u32::from(word);
                acc = (acc & 0xffff) + (acc >> 16);
            }
            acc as u16
        }

        #[test]
        fn rfc1071_example() {
            // RFC 1071 §3: bytes 00 01 f2 03 f4 f5 f6 f7 sum to ddf2 (carries folded in).
            assert_eq!(data(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]), 0xddf2);
        }

        #[test]
        fn ipv4_header_vector() {
            // The classic example header (Wikipedia "IPv4 header checksum"): checksum b861.
            let hdr = [
                0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
                0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
            ];
            assert_eq!(of(&hdr), 0xb861);
        }

        #[test]
        fn odd_length_and_empty() {
            assert_eq!(data(&[]), 0);
            assert_eq!(data(&[0xab]), 0xab00);
            assert_eq!(data(&[0x12, 0x34, 0x56]), 0x6834);
        }

        #[test]
        fn all_ones_does_not_overflow() {
            let buf = [0xffu8; 65536];
            assert_eq!(data(&buf), naive(&buf));
        }

        #[test]
        fn pseudo_header_v4_vector() {
            let s = pseudo_header_v4(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), 17, 8);
            // 0a00 + 0001 + 0a00 + 0002 + 0011 + 0008 = 141c
            assert_eq!(s, 0x141c);
        }

        proptest! {
            #[test]
            fn fast_sum_matches_naive(buf in proptest::collection::vec(any::<u8>(), 0..2000)) {
                prop_assert_eq!(data(&buf), naive(&buf));
            }

            #[test]
            fn sum_is_split_invariant_at_even_offsets(
                buf in proptest::collection::vec(any::<u8>(), 0..600),
                cut in 0usize..300,
            ) {
                let cut = (cut * 2).min(buf.len() & !1);
                let (a, b) = buf.split_at(cut);
                prop_assert_eq!(
                    u32::from(combine(&[data(a), data(b)])) % 0xffff,
                    u32::from(data(&buf)) % 0xffff
                );
            }

            #[test]
            fn pseudo_v6_matches_bytes(
                src in any::<u128>(), dst in any::<u128>(), nh in any::<u8>(), len in any::<u32>(),
            ) {
                let mut b = [0u8; 40];
                b[..16].copy_from_slice(&src.to_be_bytes());
                b[16..32].copy_from_slice(&dst.to_be_bytes());
                b[32..36].copy_from_slice(&len.to_be_bytes());
                b[39] = nh;
                let got = pseudo_header_v6(Ipv6Addr::from(src), Ipv6Addr::from(dst), nh, len);
                prop_assert_eq!(u32::from(got) % 0xffff, u32::from(naive(&b)) % 0xffff);
            }
        }
    }
}

/// A deterministic hash of an IP packet's flow: source and destination addresses, the protocol
/// and, for TCP and UDP packets that are not fragments, the two ports.
///
/// Used to pick the sending socket, so the outer UDP source port, of a packet (RFC 7348 §5), so one inner flow
/// stays on one outer 5-tuple (no reordering through ECMP or RSS) while different flows spread.
///
/// Accepts any bytes and never panics. IPv4 and IPv6 are recognised from the version nibble;
/// for IPv6 only the fixed header's next header is consulted (extension headers are not walked,
/// so such packets hash on addresses and next header alone). Anything else, or a packet too
/// short for its addresses, hashes to a fixed value.
pub fn flow_hash(ip_packet: &[u8]) -> u32 {
    const TCP: u8 = ip::proto::TCP;
    const UDP: u8 = ip::proto::UDP;
    let b = ip_packet;
    let mut h = FlowHasher::new();
    match ip::version(b) {
        Some(4) if b.len() >= ipv4::HEADER_LEN => {
            let proto = b[9];
            h.word(u32::from_be_bytes([b[12], b[13], b[14], b[15]]));
            h.word(u32::from_be_bytes([b[16], b[17], b[18], b[19]]));
            h.word(u32::from(proto));
            let ihl = usize::from(b[0] & 0x0f) * 4;
            // Any fragment (MF set or offset nonzero) hashes without ports: later fragments
            // carry none, and all fragments of one datagram should take the same outer port.
            let fragment = u16::from_be_bytes([b[6], b[7]]) & 0x3fff != 0;
            if (proto == TCP || proto == UDP)
                && !fragment
                && ihl >= ipv4::HEADER_LEN
                && let Some(p) = b.get(ihl..ihl + 4)
            {
                h.word(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
            }
        }
        Some(6) if b.len() >= ipv6::HEADER_LEN => {
            let nh = b[6];
            for w in b[8..40].chunks_exact(4) {
                h.word(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
            }
            h.word(u32::from(nh));
            if (nh == TCP || nh == UDP)
                && let Some(p) = b.get(40..44)
            {
                h.word(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
            }
        }
        _ => {}
    }
    h.finish()
}

/// A small word-at-a-time hash (murmur3's mixing steps): fast, fixed seed, deterministic across
/// runs and hosts, and not meant to resist an adversary (it only spreads flows over ports).
struct FlowHasher(u32);

impl FlowHasher {
    fn new() -> Self {
        Self(0x9e37_79b9)
    }

    fn word(&mut self, w: u32) {
        let k = w.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
        self.0 = (self.0 ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64);
    }

    fn finish(self) -> u32 {
        let mut h = self.0;
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// An IPv4 TCP SYN 10.244.1.2:40000 -> 10.244.2.3:80 (header only, ports in place).
    fn tcp_v4(src_port: u16, frag: u16) -> Vec<u8> {
        let mut p = vec![
            0x45, 0x00, 0x00, 0x28, 0x00, 0x00, 0x40, 0x00, 0x40, 0x06, 0x00, 0x00, 10, 244, 1, 2,
            10, 244, 2, 3,
        ];
        p[6..8].copy_from_slice(&frag.to_be_bytes());
        p.extend_from_slice(&src_port.to_be_bytes());
        p.extend_from_slice(&80u16.to_be_bytes());
        p.extend_from_slice(&[0; 16]);
        p
    }

    #[test]
    fn flow_hash_same_flow_same_hash() {
        assert_eq!(flow_hash(&tcp_v4(40000, 0x4000)), flow_hash(&tcp_v4(40000, 0x4000)));
        // The payload and the IP ID do not belong to the flow.
        let mut a = tcp_v4(40000, 0);
        a[4] = 0x12;
        a.extend_from_slice(b"payload");
        assert_eq!(flow_hash(&a), flow_hash(&tcp_v4(40000, 0)));
    }

    #[test]
    fn flow_hash_ports_matter_except_in_fragments() {
        assert_ne!(flow_hash(&tcp_v4(40000, 0)), flow_hash(&tcp_v4(40001, 0)));
        // A non-initial fragment carries no ports: bytes there are payload and must be ignored.
        assert_eq!(flow_hash(&tcp_v4(40000, 0x0010)), flow_hash(&tcp_v4(40001, 0x0010)));
        // The first fragment hashes like the others of its datagram.
        assert_eq!(flow_hash(&tcp_v4(40000, 0x2000)), flow_hash(&tcp_v4(40001, 0x0010)));
    }

    #[test]
    fn flow_hash_v6_uses_ports() {
        let mut p = vec![0x60, 0, 0, 0, 0, 8, ip::proto::UDP, 64];
        p.extend_from_slice(&[0xfd; 32]);
        p.extend_from_slice(&[0x12, 0x34, 0x00, 0x35, 0, 8, 0, 0]);
        let h = flow_hash(&p);
        p[41] = 0x35;
        assert_ne!(h, flow_hash(&p));
        assert_eq!(flow_hash(&p), flow_hash(&p.clone()));
    }

    #[test]
    fn flow_hash_short_or_foreign_input_is_fixed() {
        assert_eq!(flow_hash(&[]), flow_hash(&[0x45]));
        assert_eq!(flow_hash(&[0x00; 64]), flow_hash(&[]));
    }

    proptest! {
        #[test]
        fn flow_hash_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..128)) {
            let h = flow_hash(&buf);
            prop_assert_eq!(h, flow_hash(&buf));
        }

        #[test]
        fn flow_hash_v4_like_never_panics(
            ihl in 0u8..16, rest in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let mut buf = vec![0x40 | ihl];
            buf.extend(rest);
            let _ = flow_hash(&buf);
        }
    }
}
