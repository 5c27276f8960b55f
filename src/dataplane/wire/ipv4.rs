//! IPv4 (RFC 791): a checked view over a packet, and the [`Repr`] weft emits for outer headers
//! and ICMP replies.
//!
//! See the [module contract](super) for when accessors may panic.

use std::net::Ipv4Addr;

use super::{Error, checksum, read_u16, write_u16};

/// Byte offsets of the fixed header fields (RFC 791 §3.1).
mod field {
    use std::ops::Range;

    pub(super) const VER_IHL: usize = 0;
    pub(super) const DSCP_ECN: usize = 1;
    pub(super) const LENGTH: Range<usize> = 2..4;
    pub(super) const IDENT: Range<usize> = 4..6;
    pub(super) const FLG_OFF: Range<usize> = 6..8;
    pub(super) const TTL: usize = 8;
    pub(super) const PROTOCOL: usize = 9;
    pub(super) const CHECKSUM: Range<usize> = 10..12;
    pub(super) const SRC_ADDR: Range<usize> = 12..16;
    pub(super) const DST_ADDR: Range<usize> = 16..20;
}

/// The length of a header without options.
pub const HEADER_LEN: usize = field::DST_ADDR.end;

/// The largest payload a header without options can describe (total length is 16 bits).
pub(crate) const MAX_PAYLOAD_LEN: usize = u16::MAX as usize - HEADER_LEN;

/// The "don't fragment" bit in the flags/fragment-offset word.
const FLAG_DF: u16 = 0x4000;
/// The "more fragments" bit.
const FLAG_MF: u16 = 0x2000;
/// The reserved ("evil") bit; must be zero (RFC 791).
const FLAG_RESERVED: u16 = 0x8000;
/// The fragment offset, in units of 8 bytes.
const FRAG_OFFSET_MASK: u16 = 0x1fff;

/// A read/write view of an IPv4 packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a buffer without checking it. Accessors may panic unless [`Self::check_len`] passed.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wrap a buffer and [`check_len`](Self::check_len) it: the constructor for untrusted input.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Prove every accessor in bounds.
    ///
    /// # Errors
    /// - [`Error::Truncated`]: shorter than 20 bytes.
    /// - [`Error::BadVersion`]: the version nibble is not 4.
    /// - [`Error::BadHeaderLength`]: IHL below 5, or the header runs past the buffer.
    /// - [`Error::BadTotalLength`]: total length below the header length or past the buffer.
    ///
    /// The buffer may be longer than the total length (link padding); the excess is ignored.
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 4 {
            return Err(Error::BadVersion);
        }
        let header_len = usize::from(self.header_len());
        if header_len < HEADER_LEN || header_len > len {
            return Err(Error::BadHeaderLength);
        }
        let total_len = usize::from(self.total_len());
        if total_len < header_len || total_len > len {
            return Err(Error::BadTotalLength);
        }
        Ok(())
    }

    /// The IP version (4 on a checked packet).
    #[inline]
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// The header length in bytes (IHL × 4), options included.
    #[inline]
    pub fn header_len(&self) -> u8 {
        (self.buffer.as_ref()[field::VER_IHL] & 0x0f) * 4
    }

    /// The DSCP and ECN bits (the old type-of-service byte, RFC 2474 and RFC 3168).
    #[inline]
    pub fn dscp_ecn(&self) -> u8 {
        self.buffer.as_ref()[field::DSCP_ECN]
    }

    /// The total length of the packet, header included.
    #[inline]
    pub fn total_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::LENGTH.start)
    }

    /// The identification field.
    #[inline]
    pub fn ident(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::IDENT.start)
    }

    fn flags_offset(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::FLG_OFF.start)
    }

    /// The "don't fragment" flag.
    #[inline]
    pub fn dont_frag(&self) -> bool {
        self.flags_offset() & FLAG_DF != 0
    }

    /// The "more fragments" flag.
    #[inline]
    pub fn more_frags(&self) -> bool {
        self.flags_offset() & FLAG_MF != 0
    }

    /// The reserved flag bit (must be zero on the wire).
    #[inline]
    pub fn reserved_flag(&self) -> bool {
        self.flags_offset() & FLAG_RESERVED != 0
    }

    /// The fragment offset in bytes (the field counts 8-byte units).
    #[inline]
    pub fn frag_offset(&self) -> u16 {
        (self.flags_offset() & FRAG_OFFSET_MASK) << 3
    }

    /// Whether this is a fragment at all (more fragments, or a nonzero offset).
    #[inline]
    pub fn is_fragment(&self) -> bool {
        self.flags_offset() & (FLAG_MF | FRAG_OFFSET_MASK) != 0
    }

    /// The time to live.
    #[inline]
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }

    /// The time to live, under its IPv6 name.
    #[inline]
    pub fn hop_limit(&self) -> u8 {
        self.ttl()
    }

    /// The protocol of the payload ([`super::ip::proto`]).
    #[inline]
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }

    /// The protocol, under its IPv6 name.
    #[inline]
    pub fn next_header(&self) -> u8 {
        self.protocol()
    }

    /// The header checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM.start)
    }

    /// The source address.
    #[inline]
    pub fn src_addr(&self) -> Ipv4Addr {
        let a = &self.buffer.as_ref()[field::SRC_ADDR];
        Ipv4Addr::new(a[0], a[1], a[2], a[3])
    }

    /// The destination address.
    #[inline]
    pub fn dst_addr(&self) -> Ipv4Addr {
        let a = &self.buffer.as_ref()[field::DST_ADDR];
        Ipv4Addr::new(a[0], a[1], a[2], a[3])
    }

    /// The header bytes: fixed part and options.
    #[inline]
    pub fn header(&self) -> &[u8] {
        &self.buffer.as_ref()[..usize::from(self.header_len())]
    }

    /// The options bytes (empty for a 20-byte header).
    #[inline]
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.header_len())]
    }

    /// The payload, bounded by the total length (not by the buffer).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[usize::from(self.header_len())..usize::from(self.total_len())]
    }

    /// The packet bytes up to the total length (the buffer minus any trailing padding).
    #[inline]
    pub fn packet(&self) -> &[u8] {
        &self.buffer.as_ref()[..usize::from(self.total_len())]
    }

    /// Whether the header checksum is correct (the header sums to `0xffff`, RFC 1071).
    pub fn verify_checksum(&self) -> bool {
        checksum::data(self.header()) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Set the version nibble.
    #[inline]
    pub fn set_version(&mut self, version: u8) {
        let b = &mut self.buffer.as_mut()[field::VER_IHL];
        *b = (*b & 0x0f) | (version << 4);
    }

    /// Set the header length in bytes (rounded down to a multiple of 4).
    #[inline]
    pub fn set_header_len(&mut self, len: u8) {
        let b = &mut self.buffer.as_mut()[field::VER_IHL];
        *b = (*b & 0xf0) | ((len / 4) & 0x0f);
    }

    /// Set the DSCP and ECN byte.
    #[inline]
    pub fn set_dscp_ecn(&mut self, value: u8) {
        self.buffer.as_mut()[field::DSCP_ECN] = value;
    }

    /// Set the total length. Does not update the checksum.
    #[inline]
    pub fn set_total_len(&mut self, len: u16) {
        write_u16(self.buffer.as_mut(), field::LENGTH.start, len);
    }

    /// Set the identification field. Does not update the checksum.
    #[inline]
    pub fn set_ident(&mut self, ident: u16) {
        write_u16(self.buffer.as_mut(), field::IDENT.start, ident);
    }

    fn set_flags_offset(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::FLG_OFF.start, value);
    }

    /// Clear all three flag bits and the fragment offset.
    #[inline]
    pub fn clear_flags(&mut self) {
        self.set_flags_offset(0);
    }

    /// Set or clear "don't fragment".
    #[inline]
    pub fn set_dont_frag(&mut self, value: bool) {
        let f = self.flags_offset();
        self.set_flags_offset(if value { f | FLAG_DF } else { f & !FLAG_DF });
    }

    /// Set or clear "more fragments".
    #[inline]
    pub fn set_more_frags(&mut self, value: bool) {
        let f = self.flags_offset();
        self.set_flags_offset(if value { f | FLAG_MF } else { f & !FLAG_MF });
    }

    /// Set the fragment offset in bytes (rounded down to a multiple of 8).
    #[inline]
    pub fn set_frag_offset(&mut self, offset: u16) {
        let f = self.flags_offset();
        self.set_flags_offset((f & !FRAG_OFFSET_MASK) | (offset >> 3));
    }

    /// Set the time to live. Does not update the checksum.
    #[inline]
    pub fn set_ttl(&mut self, ttl: u8) {
        self.buffer.as_mut()[field::TTL] = ttl;
    }

    /// Set the protocol. Does not update the checksum.
    #[inline]
    pub fn set_protocol(&mut self, protocol: u8) {
        self.buffer.as_mut()[field::PROTOCOL] = protocol;
    }

    /// Set the checksum field.
    #[inline]
    pub(crate) fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM.start, value);
    }

    /// Set the source address. Does not update the checksum.
    #[inline]
    pub fn set_src_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::SRC_ADDR].copy_from_slice(&addr.octets());
    }

    /// Set the destination address. Does not update the checksum.
    #[inline]
    pub fn set_dst_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::DST_ADDR].copy_from_slice(&addr.octets());
    }

    /// Compute the header checksum over the header (options included) and store it.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let sum = checksum::of(self.header());
        self.set_checksum(sum);
    }

    /// Decrement the TTL as a forwarding hop does, patching the header checksum incrementally
    /// (RFC 1624 eqn. 3: `HC' = ~(~HC + ~m + m')`, with `m` the TTL/protocol word), so the
    /// header is not re-summed per packet.
    ///
    /// Returns the new TTL. A router must not forward a packet whose TTL is now 0 (RFC 1812
    /// §5.3.1); flannel's udp backend drops it, and so should the caller. A TTL that is already
    /// 0 is left alone (and 0 returned), checksum untouched.
    pub fn decrement_ttl_incremental(&mut self) -> u8 {
        let ttl = self.ttl();
        if ttl == 0 {
            return 0;
        }
        let old = read_u16(self.buffer.as_ref(), field::TTL);
        let new = old - 0x0100;
        let sum = u32::from(!self.checksum()) + u32::from(!old) + u32::from(new);
        let sum = (sum & 0xffff) + (sum >> 16);
        let sum = (sum & 0xffff) + (sum >> 16);
        self.set_ttl(ttl - 1);
        self.set_checksum(!(sum as u16));
        ttl - 1
    }

    /// The options bytes, writable.
    #[inline]
    pub fn options_mut(&mut self) -> &mut [u8] {
        let end = usize::from(self.header_len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }

    /// The payload (bounded by the total length), writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (start, end) = (usize::from(self.header_len()), usize::from(self.total_len()));
        &mut self.buffer.as_mut()[start..end]
    }
}

/// The meaning of an IPv4 header without options or fragmentation.
///
/// `emit` writes DSCP/ECN 0, identification 0 and no flags; callers that need other values
/// (an outer header copying the inner ECN, a unique ID) set them after emitting and refill the
/// checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The source address.
    pub src_addr: Ipv4Addr,
    /// The destination address.
    pub dst_addr: Ipv4Addr,
    /// The payload protocol ([`super::ip::proto`]).
    pub protocol: u8,
    /// The payload length in bytes (total length − 20).
    pub payload_len: usize,
    /// The time to live.
    pub ttl: u8,
}

impl Repr {
    /// Parse a packet.
    ///
    /// # Errors
    /// Anything [`Packet::check_len`] rejects; [`Error::BadChecksum`] for a wrong header
    /// checksum; [`Error::BadFlags`] for the reserved flag; [`Error::Unsupported`] for options or
    /// fragments, which this `Repr` cannot describe.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, Error> {
        packet.check_len()?;
        if !packet.verify_checksum() {
            return Err(Error::BadChecksum);
        }
        if packet.reserved_flag() {
            return Err(Error::BadFlags);
        }
        if usize::from(packet.header_len()) != HEADER_LEN || packet.is_fragment() {
            return Err(Error::Unsupported);
        }
        Ok(Self {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            protocol: packet.protocol(),
            payload_len: packet.payload().len(),
            ttl: packet.ttl(),
        })
    }

    /// The length of the whole packet: header plus payload.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Write all 20 header bytes, checksum included, into the start of `buf`; the payload is
    /// the caller's. Returns the header length.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] if `buf` is shorter than the header; [`Error::BadTotalLength`]
    /// if `payload_len` exceeds [`MAX_PAYLOAD_LEN`]. Nothing is written on error.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        if self.payload_len > MAX_PAYLOAD_LEN {
            return Err(Error::BadTotalLength);
        }
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(Error::BufferTooSmall);
        };
        let mut packet = Packet::new_unchecked(hdr);
        packet.set_version(4);
        packet.set_header_len(HEADER_LEN as u8);
        packet.set_dscp_ecn(0);
        // Fits: payload_len <= MAX_PAYLOAD_LEN was checked above.
        packet.set_total_len((HEADER_LEN + self.payload_len) as u16);
        packet.set_ident(0);
        packet.clear_flags();
        packet.set_ttl(self.ttl);
        packet.set_protocol(self.protocol);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        packet.fill_checksum();
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::dataplane::wire::ip::proto;

    /// `ping -s 8 10.244.2.3` from 10.244.1.2: ID 0x1234, DF, TTL 64, echo id 1 seq 1, "abcdefgh".
    pub(crate) const ECHO: [u8; 36] = [
        0x45, 0x00, 0x00, 0x24, 0x12, 0x34, 0x40, 0x00, 0x40, 0x01, 0x0f, 0xb9, 0x0a, 0xf4, 0x01,
        0x02, 0x0a, 0xf4, 0x02, 0x03, // IPv4 header
        0x08, 0x00, 0x66, 0x68, 0x00, 0x01, 0x00, 0x01, // ICMP echo request
        0x61, 0x62, 0x63, 0x64, 0x65, 0x66, 0x67, 0x68, // "abcdefgh"
    ];

    const SRC: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
    const DST: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 3);

    #[test]
    fn test_deconstruct() {
        let p = Packet::new_checked(&ECHO[..]).unwrap();
        assert_eq!(p.version(), 4);
        assert_eq!(p.header_len(), 20);
        assert_eq!(p.dscp_ecn(), 0);
        assert_eq!(p.total_len(), 36);
        assert_eq!(p.ident(), 0x1234);
        assert!(p.dont_frag());
        assert!(!p.more_frags());
        assert!(!p.is_fragment());
        assert_eq!(p.frag_offset(), 0);
        assert_eq!(p.ttl(), 64);
        assert_eq!(p.protocol(), proto::ICMP);
        assert_eq!(p.checksum(), 0x0fb9);
        assert_eq!(p.src_addr(), SRC);
        assert_eq!(p.dst_addr(), DST);
        assert!(p.options().is_empty());
        assert_eq!(p.payload(), &ECHO[20..]);
        assert!(p.verify_checksum());
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 36];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_version(4);
        p.set_header_len(20);
        p.set_dscp_ecn(0);
        p.set_total_len(36);
        p.set_ident(0x1234);
        p.clear_flags();
        p.set_dont_frag(true);
        p.set_ttl(64);
        p.set_protocol(proto::ICMP);
        p.set_src_addr(SRC);
        p.set_dst_addr(DST);
        p.fill_checksum();
        p.payload_mut().copy_from_slice(&ECHO[20..]);
        assert_eq!(buf, ECHO);
    }

    #[test]
    fn test_parse_and_emit() {
        let repr = Repr::parse(&Packet::new_checked(&ECHO[..]).unwrap()).unwrap();
        assert_eq!(
            repr,
            Repr { src_addr: SRC, dst_addr: DST, protocol: proto::ICMP, payload_len: 16, ttl: 64 }
        );
        let mut buf = [0xa5u8; 36];
        assert_eq!(repr.emit(&mut buf), Ok(20));
        // emit writes ID 0 and no DF, and leaves the payload alone.
        let mut expected = ECHO;
        expected[4..8].copy_from_slice(&[0, 0, 0, 0]);
        expected[10..12].copy_from_slice(&[0, 0]);
        let ck = checksum::of(&expected[..20]);
        expected[10..12].copy_from_slice(&ck.to_be_bytes());
        assert_eq!(buf[..20], expected[..20]);
        assert!(buf[20..].iter().all(|&b| b == 0xa5));
    }

    #[test]
    fn emit_rejects_small_buffer_and_huge_payload() {
        let repr = Repr { src_addr: SRC, dst_addr: DST, protocol: 17, payload_len: 10, ttl: 1 };
        let mut buf = [0xa5u8; 19];
        assert_eq!(repr.emit(&mut buf), Err(Error::BufferTooSmall));
        assert!(buf.iter().all(|&b| b == 0xa5));
        let big = Repr { payload_len: MAX_PAYLOAD_LEN + 1, ..repr };
        assert_eq!(big.emit(&mut [0; 20]), Err(Error::BadTotalLength));
    }

    #[test]
    fn check_len_rejections() {
        assert_eq!(Packet::new_checked(&ECHO[..19]).unwrap_err(), Error::Truncated);
        let mut b = ECHO;
        b[0] = 0x65;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadVersion);
        b[0] = 0x44;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadHeaderLength);
        b[0] = 0x4f; // 60-byte header in a 36-byte buffer
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadHeaderLength);
        b[0] = 0x45;
        b[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadTotalLength);
        b[2..4].copy_from_slice(&37u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadTotalLength);
    }

    #[test]
    fn payload_ignores_padding() {
        let mut b = ECHO.to_vec();
        b.extend_from_slice(&[0; 10]);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.payload(), &ECHO[20..]);
        assert_eq!(p.packet(), &ECHO[..]);
    }

    #[test]
    fn parse_rejects_what_repr_cannot_hold() {
        let mut b = ECHO;
        b[10] ^= 1;
        assert_eq!(Repr::parse(&Packet::new_checked(&b[..]).unwrap()), Err(Error::BadChecksum));
        let mut b = ECHO;
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.set_more_frags(true);
        p.fill_checksum();
        assert_eq!(Repr::parse(&p), Err(Error::Unsupported));
        p.set_more_frags(false);
        p.set_flags_offset(FLAG_RESERVED);
        p.fill_checksum();
        assert_eq!(Repr::parse(&p), Err(Error::BadFlags));
    }

    #[test]
    fn ttl_decrement_matches_kernel_result() {
        let mut b = ECHO;
        let mut p = Packet::new_unchecked(&mut b[..]);
        assert_eq!(p.decrement_ttl_incremental(), 63);
        assert!(p.verify_checksum());
        assert_eq!(p.checksum(), 0x10b9);
        p.set_ttl(0);
        let ck = p.checksum();
        assert_eq!(p.decrement_ttl_incremental(), 0);
        assert_eq!((p.ttl(), p.checksum()), (0, ck));
    }

    #[test]
    fn frag_offset_round_trip() {
        let mut b = ECHO;
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.set_frag_offset(1480);
        p.set_more_frags(true);
        assert_eq!(p.frag_offset(), 1480);
        assert!(p.dont_frag() && p.more_frags() && p.is_fragment());
    }

    fn arb_repr() -> impl Strategy<Value = Repr> {
        (any::<u32>(), any::<u32>(), any::<u8>(), 0..=MAX_PAYLOAD_LEN, any::<u8>()).prop_map(
            |(s, d, protocol, payload_len, ttl)| Repr {
                src_addr: s.into(),
                dst_addr: d.into(),
                protocol,
                payload_len,
                ttl,
            },
        )
    }

    proptest! {
        #[test]
        fn repr_round_trip(repr in arb_repr()) {
            let mut buf = vec![0xa5u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            let p = Packet::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p), Ok(repr));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..100)) {
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.options(), p.payload(), p.packet(), p.verify_checksum(), p.frag_offset());
                let _ = Repr::parse(&p);
                let mut copy = buf.clone();
                let mut p = Packet::new_unchecked(&mut copy[..]);
                let _ = p.decrement_ttl_incremental();
                p.fill_checksum();
                let _ = (p.options_mut().len(), p.payload_mut().len());
            }
        }

        #[test]
        fn v4ish_never_panics(
            ihl in 0u8..16, total in any::<u16>(),
            rest in proptest::collection::vec(any::<u8>(), 16..80),
        ) {
            let mut buf = vec![0x40 | ihl, 0];
            buf.extend_from_slice(&total.to_be_bytes());
            buf.extend(rest);
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                prop_assert!(p.payload().len() + usize::from(p.header_len()) <= buf.len());
                let _ = Repr::parse(&p);
            }
        }

        #[test]
        fn incremental_ttl_equals_full_recompute(
            ihl in 5u8..16,
            body in proptest::collection::vec(any::<u8>(), 60),
            ttl in 1u8..=255,
        ) {
            let header_len = usize::from(ihl) * 4;
            let mut buf = body;
            buf[0] = 0x40 | ihl;
            buf[2..4].copy_from_slice(&(header_len as u16).to_be_bytes());
            buf.truncate(header_len);
            let mut p = Packet::new_checked(&mut buf[..]).unwrap();
            p.set_ttl(ttl);
            p.fill_checksum();
            prop_assert_eq!(p.decrement_ttl_incremental(), ttl - 1);
            let incremental = p.checksum();
            p.fill_checksum();
            prop_assert_eq!(incremental, p.checksum());
            prop_assert!(p.verify_checksum());
        }
    }
}
