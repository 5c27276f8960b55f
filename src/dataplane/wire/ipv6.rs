//! IPv6 (RFC 8200): a checked view over the fixed 40-byte header, and a [`Repr`] for it.
//!
//! Extension headers are not walked: [`Packet::payload`] starts right after the fixed header,
//! whatever [`Packet::next_header`] says. See the [module contract](super) for panics.

use std::net::Ipv6Addr;

use super::{Error, read_u16, read_u32, write_u16, write_u32};

/// Byte offsets of the fixed header fields (RFC 8200 §3).
mod field {
    use std::ops::Range;

    /// Version (4 bits), traffic class (8 bits) and flow label (20 bits).
    pub(super) const VER_TC_FLOW: Range<usize> = 0..4;
    pub(super) const LENGTH: Range<usize> = 4..6;
    pub(super) const NXT_HDR: usize = 6;
    pub(super) const HOP_LIMIT: usize = 7;
    pub(super) const SRC_ADDR: Range<usize> = 8..24;
    pub(super) const DST_ADDR: Range<usize> = 24..40;
}

/// The length of the fixed header.
pub const HEADER_LEN: usize = field::DST_ADDR.end;

/// A read/write view of an IPv6 packet.
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
    /// [`Error::Truncated`] below 40 bytes, [`Error::BadVersion`] if the version is not 6,
    /// [`Error::BadLength`] if the payload length runs past the buffer. (A zero payload length
    /// with a Jumbo Payload option, RFC 2675, is taken literally: an empty payload.)
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 6 {
            return Err(Error::BadVersion);
        }
        if HEADER_LEN + usize::from(self.payload_len()) > len {
            return Err(Error::BadLength);
        }
        Ok(())
    }

    fn ver_tc_flow(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::VER_TC_FLOW.start)
    }

    /// The IP version (6 on a checked packet).
    #[inline]
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 4
    }

    /// The traffic class (DSCP and ECN).
    #[inline]
    pub fn traffic_class(&self) -> u8 {
        (self.ver_tc_flow() >> 20) as u8
    }

    /// The 20-bit flow label.
    #[inline]
    pub fn flow_label(&self) -> u32 {
        self.ver_tc_flow() & 0x000f_ffff
    }

    /// The payload length: everything after the fixed header, extension headers included.
    #[inline]
    pub fn payload_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::LENGTH.start)
    }

    /// The type of the header that follows the fixed header ([`super::ip::proto`]).
    #[inline]
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NXT_HDR]
    }

    /// The hop limit.
    #[inline]
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }

    /// The source address.
    #[inline]
    pub fn src_addr(&self) -> Ipv6Addr {
        addr(&self.buffer.as_ref()[field::SRC_ADDR])
    }

    /// The destination address.
    #[inline]
    pub fn dst_addr(&self) -> Ipv6Addr {
        addr(&self.buffer.as_ref()[field::DST_ADDR])
    }

    /// The payload, bounded by the payload length (not by the buffer).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..HEADER_LEN + usize::from(self.payload_len())]
    }

    /// The packet bytes up to the end of the payload (the buffer minus trailing padding).
    #[inline]
    pub fn packet(&self) -> &[u8] {
        &self.buffer.as_ref()[..HEADER_LEN + usize::from(self.payload_len())]
    }
}

/// An address from a 16-byte field.
fn addr(b: &[u8]) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(b);
    Ipv6Addr::from(a)
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_ver_tc_flow(&mut self, v: u32) {
        write_u32(self.buffer.as_mut(), field::VER_TC_FLOW.start, v);
    }

    /// Set the version nibble.
    #[inline]
    pub fn set_version(&mut self, version: u8) {
        let v = self.ver_tc_flow();
        self.set_ver_tc_flow((v & 0x0fff_ffff) | (u32::from(version & 0x0f) << 28));
    }

    /// Set the traffic class.
    #[inline]
    pub fn set_traffic_class(&mut self, tc: u8) {
        let v = self.ver_tc_flow();
        self.set_ver_tc_flow((v & 0xf00f_ffff) | (u32::from(tc) << 20));
    }

    /// Set the flow label (the low 20 bits of `label`).
    #[inline]
    pub fn set_flow_label(&mut self, label: u32) {
        let v = self.ver_tc_flow();
        self.set_ver_tc_flow((v & 0xfff0_0000) | (label & 0x000f_ffff));
    }

    /// Set the payload length.
    #[inline]
    pub fn set_payload_len(&mut self, len: u16) {
        write_u16(self.buffer.as_mut(), field::LENGTH.start, len);
    }

    /// Set the next header.
    #[inline]
    pub fn set_next_header(&mut self, next_header: u8) {
        self.buffer.as_mut()[field::NXT_HDR] = next_header;
    }

    /// Set the hop limit.
    #[inline]
    pub fn set_hop_limit(&mut self, hop_limit: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = hop_limit;
    }

    /// Set the source address.
    #[inline]
    pub fn set_src_addr(&mut self, addr: Ipv6Addr) {
        self.buffer.as_mut()[field::SRC_ADDR].copy_from_slice(&addr.octets());
    }

    /// Set the destination address.
    #[inline]
    pub fn set_dst_addr(&mut self, addr: Ipv6Addr) {
        self.buffer.as_mut()[field::DST_ADDR].copy_from_slice(&addr.octets());
    }

    /// The payload (bounded by the payload length), writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = HEADER_LEN + usize::from(self.payload_len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }
}

/// The meaning of an IPv6 fixed header. `emit` writes traffic class 0 and flow label 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The source address.
    pub(crate) src_addr: Ipv6Addr,
    /// The destination address.
    pub(crate) dst_addr: Ipv6Addr,
    /// The next header ([`super::ip::proto`]).
    pub(crate) next_header: u8,
    /// The payload length in bytes.
    pub(crate) payload_len: usize,
    /// The hop limit.
    pub(crate) hop_limit: u8,
}

impl Repr {
    /// Parse the fixed header of a packet.
    ///
    /// # Errors
    /// Anything [`Packet::check_len`] rejects.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, Error> {
        packet.check_len()?;
        Ok(Self {
            src_addr: packet.src_addr(),
            dst_addr: packet.dst_addr(),
            next_header: packet.next_header(),
            payload_len: usize::from(packet.payload_len()),
            hop_limit: packet.hop_limit(),
        })
    }

    /// The length of the whole packet: fixed header plus payload.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Write all 40 fixed-header bytes into the start of `buf`. Returns the header length.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] if `buf` is shorter than 40 bytes; [`Error::BadLength`] if
    /// `payload_len` does not fit in 16 bits. Nothing is written on error.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let Ok(payload_len) = u16::try_from(self.payload_len) else {
            return Err(Error::BadLength);
        };
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(Error::BufferTooSmall);
        };
        let mut packet = Packet::new_unchecked(hdr);
        packet.set_ver_tc_flow(6 << 28);
        packet.set_payload_len(payload_len);
        packet.set_next_header(self.next_header);
        packet.set_hop_limit(self.hop_limit);
        packet.set_src_addr(self.src_addr);
        packet.set_dst_addr(self.dst_addr);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::dataplane::wire::ip::proto;

    /// A UDP datagram fd00::1:53000 -> fd00::2:53, TC 0xb8 (EF), flow label 0x12345, hop limit
    /// 64, payload "hi" (UDP checksum not meaningful here).
    const PACKET: [u8; 50] = [
        0x6b, 0x81, 0x23, 0x45, 0x00, 0x0a, 0x11, 0x40, // ver/tc/flow, len 10, UDP, hop 64
        0xfd, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, // src fd00::1
        0xfd, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, // dst fd00::2
        0xcf, 0x08, 0x00, 0x35, 0x00, 0x0a, 0x00, 0x00, 0x68, 0x69, // UDP
    ];

    fn src() -> Ipv6Addr {
        "fd00::1".parse().unwrap()
    }

    fn dst() -> Ipv6Addr {
        "fd00::2".parse().unwrap()
    }

    #[test]
    fn test_deconstruct() {
        let p = Packet::new_checked(&PACKET[..]).unwrap();
        assert_eq!(p.version(), 6);
        assert_eq!(p.traffic_class(), 0xb8);
        assert_eq!(p.flow_label(), 0x12345);
        assert_eq!(p.payload_len(), 10);
        assert_eq!(p.next_header(), proto::UDP);
        assert_eq!(p.hop_limit(), 64);
        assert_eq!(p.src_addr(), src());
        assert_eq!(p.dst_addr(), dst());
        assert_eq!(p.payload(), &PACKET[40..]);
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 50];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_version(6);
        p.set_traffic_class(0xb8);
        p.set_flow_label(0x12345);
        p.set_payload_len(10);
        p.set_next_header(proto::UDP);
        p.set_hop_limit(64);
        p.set_src_addr(src());
        p.set_dst_addr(dst());
        p.payload_mut().copy_from_slice(&PACKET[40..]);
        assert_eq!(buf, PACKET);
    }

    #[test]
    fn test_emit() {
        let repr = Repr::parse(&Packet::new_checked(&PACKET[..]).unwrap()).unwrap();
        let mut buf = [0xa5u8; 50];
        assert_eq!(repr.emit(&mut buf), Ok(40));
        assert_eq!(buf[..4], [0x60, 0, 0, 0]);
        assert_eq!(buf[4..40], PACKET[4..40]);
        assert!(buf[40..].iter().all(|&b| b == 0xa5));
        assert_eq!(repr.emit(&mut buf[..39]), Err(Error::BufferTooSmall));
    }

    #[test]
    fn check_len_rejections() {
        assert_eq!(Packet::new_checked(&PACKET[..39]).unwrap_err(), Error::Truncated);
        assert_eq!(Packet::new_checked(&PACKET[..49]).unwrap_err(), Error::BadLength);
        let mut b = PACKET;
        b[0] = 0x4b;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadVersion);
        let mut padded = PACKET.to_vec();
        padded.push(0);
        assert_eq!(Packet::new_checked(&padded[..]).unwrap().payload(), &PACKET[40..]);
    }

    fn arb_repr() -> impl Strategy<Value = Repr> {
        (any::<u128>(), any::<u128>(), any::<u8>(), 0..=usize::from(u16::MAX), any::<u8>())
            .prop_map(|(s, d, next_header, payload_len, hop_limit)| Repr {
                src_addr: s.into(),
                dst_addr: d.into(),
                next_header,
                payload_len,
                hop_limit,
            })
    }

    proptest! {
        #[test]
        fn repr_round_trip(repr in arb_repr()) {
            let mut buf = vec![0xa5u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            prop_assert_eq!(Repr::parse(&Packet::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(
            first in any::<u8>(), buf in proptest::collection::vec(any::<u8>(), 0..100),
        ) {
            let mut buf = buf;
            if let Some(b) = buf.first_mut() {
                // Half the time, a plausible version nibble so the length checks get exercised.
                *b = if first & 1 == 0 { 0x60 | (*b & 0x0f) } else { *b };
            }
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), p.packet(), p.traffic_class(), p.flow_label());
                let _ = Repr::parse(&p);
            }
        }
    }
}
