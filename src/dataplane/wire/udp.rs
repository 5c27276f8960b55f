//! UDP (RFC 768): a checked view, checksums over the IPv4 and IPv6 pseudo headers, and a
//! [`Repr`] for the outer header of a VXLAN or udp-backend packet.
//!
//! See the [module contract](super) for panics.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::{Error, checksum, ip, read_u16, write_u16};

/// Byte offsets of the header fields.
mod field {
    use std::ops::Range;

    pub(super) const SRC_PORT: Range<usize> = 0..2;
    pub(super) const DST_PORT: Range<usize> = 2..4;
    pub(super) const LENGTH: Range<usize> = 4..6;
    pub(super) const CHECKSUM: Range<usize> = 6..8;
}

/// The length of the UDP header.
pub const HEADER_LEN: usize = field::CHECKSUM.end;

/// The offset of the checksum field in the header (a virtio `csum_offset`).
pub(crate) const CHECKSUM_OFFSET: usize = field::CHECKSUM.start;

/// A read/write view of a UDP datagram.
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
    /// [`Error::Truncated`] below 8 bytes; [`Error::BadLength`] if the length field is below 8
    /// or runs past the buffer.
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let field_len = usize::from(self.len());
        if field_len < HEADER_LEN || field_len > len {
            return Err(Error::BadLength);
        }
        Ok(())
    }

    /// The source port.
    #[inline]
    pub fn src_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::SRC_PORT.start)
    }

    /// The destination port.
    #[inline]
    pub fn dst_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::DST_PORT.start)
    }

    /// The length field: header plus payload.
    #[inline]
    pub fn len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::LENGTH.start)
    }

    /// Whether the payload is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) == HEADER_LEN
    }

    /// The checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM.start)
    }

    /// The payload, bounded by the length field (not by the buffer).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.len())]
    }

    /// The datagram bytes, header included, up to the length field.
    #[inline]
    pub fn datagram(&self) -> &[u8] {
        &self.buffer.as_ref()[..usize::from(self.len())]
    }

    /// Whether the checksum is correct over the IPv4 pseudo header.
    ///
    /// RFC 768: "An all zero transmitted checksum value means that the transmitter generated no
    /// checksum", so zero verifies. (VXLAN senders do this, RFC 7348 §5.)
    pub fn verify_checksum_v4(&self, src: Ipv4Addr, dst: Ipv4Addr) -> bool {
        if self.checksum() == 0 {
            return true;
        }
        let ph = checksum::pseudo_header_v4(src, dst, ip::proto::UDP, self.len());
        checksum::combine(&[ph, checksum::data(self.datagram())]) == 0xffff
    }

    /// Whether the checksum is correct over the IPv6 pseudo header.
    ///
    /// Over IPv6 the checksum is mandatory (RFC 8200 §8.1): zero never verifies. (RFC 6935's
    /// zero-checksum tunnel exception is not taken.)
    pub fn verify_checksum_v6(&self, src: Ipv6Addr, dst: Ipv6Addr) -> bool {
        if self.checksum() == 0 {
            return false;
        }
        let ph = checksum::pseudo_header_v6(src, dst, ip::proto::UDP, u32::from(self.len()));
        checksum::combine(&[ph, checksum::data(self.datagram())]) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Set the source port.
    #[inline]
    pub fn set_src_port(&mut self, port: u16) {
        write_u16(self.buffer.as_mut(), field::SRC_PORT.start, port);
    }

    /// Set the destination port.
    #[inline]
    pub fn set_dst_port(&mut self, port: u16) {
        write_u16(self.buffer.as_mut(), field::DST_PORT.start, port);
    }

    /// Set the length field.
    #[inline]
    pub(crate) fn set_len(&mut self, len: u16) {
        write_u16(self.buffer.as_mut(), field::LENGTH.start, len);
    }

    /// Set the checksum field.
    #[inline]
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM.start, value);
    }

    /// Compute and store the checksum over the IPv4 pseudo header, header and payload.
    ///
    /// A computed zero is sent as `0xffff` (RFC 768), since zero means "no checksum".
    pub fn fill_checksum_v4(&mut self, src: Ipv4Addr, dst: Ipv4Addr) {
        self.set_checksum(0);
        let ph = checksum::pseudo_header_v4(src, dst, ip::proto::UDP, self.len());
        let sum = !checksum::combine(&[ph, checksum::data(self.datagram())]);
        self.set_checksum(if sum == 0 { 0xffff } else { sum });
    }

    /// Compute and store the checksum over the IPv6 pseudo header, header and payload (a
    /// computed zero is sent as `0xffff`).
    pub fn fill_checksum_v6(&mut self, src: Ipv6Addr, dst: Ipv6Addr) {
        self.set_checksum(0);
        let ph = checksum::pseudo_header_v6(src, dst, ip::proto::UDP, u32::from(self.len()));
        let sum = !checksum::combine(&[ph, checksum::data(self.datagram())]);
        self.set_checksum(if sum == 0 { 0xffff } else { sum });
    }

    /// The payload (bounded by the length field), writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = usize::from(self.len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }
}

/// The meaning of a UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The source port.
    pub(crate) src_port: u16,
    /// The destination port.
    pub(crate) dst_port: u16,
    /// The payload length in bytes (length field − 8).
    pub payload_len: usize,
}

impl Repr {
    /// Parse a header. The checksum is not looked at: it needs the IP addresses, so callers
    /// verify it with [`Packet::verify_checksum_v4`] where they care.
    ///
    /// # Errors
    /// Anything [`Packet::check_len`] rejects.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, Error> {
        packet.check_len()?;
        Ok(Self {
            src_port: packet.src_port(),
            dst_port: packet.dst_port(),
            payload_len: packet.payload().len(),
        })
    }

    /// The length of the whole datagram.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }

    /// Write the 8 header bytes into the start of `buf`, with checksum zero: RFC 7348 §5 says
    /// a VXLAN outer UDP checksum over IPv4 "SHOULD be transmitted as zero". Call
    /// [`Packet::fill_checksum_v4`] afterwards to send one anyway. Returns the header length.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] below 8 bytes, [`Error::BadLength`] if the datagram length does
    /// not fit in 16 bits. Nothing is written on error.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let Ok(len) = u16::try_from(HEADER_LEN + self.payload_len) else {
            return Err(Error::BadLength);
        };
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(Error::BufferTooSmall);
        };
        let mut packet = Packet::new_unchecked(hdr);
        packet.set_src_port(self.src_port);
        packet.set_dst_port(self.dst_port);
        packet.set_len(len);
        packet.set_checksum(0);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A DNS-ish datagram 10.244.1.2:53000 -> 10.244.2.3:53, payload "hello".
    const DATAGRAM: [u8; 13] =
        [0xcf, 0x08, 0x00, 0x35, 0x00, 0x0d, 0xd3, 0xd7, 0x68, 0x65, 0x6c, 0x6c, 0x6f];
    const SRC: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
    const DST: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 3);

    #[test]
    fn test_deconstruct() {
        let p = Packet::new_checked(&DATAGRAM[..]).unwrap();
        assert_eq!(p.src_port(), 53000);
        assert_eq!(p.dst_port(), 53);
        assert_eq!(p.len(), 13);
        assert_eq!(p.checksum(), 0xd3d7);
        assert_eq!(p.payload(), b"hello");
        assert!(p.verify_checksum_v4(SRC, DST));
        assert!(!p.verify_checksum_v4(DST, Ipv4Addr::new(10, 244, 2, 4)));
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 13];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_src_port(53000);
        p.set_dst_port(53);
        p.set_len(13);
        p.payload_mut().copy_from_slice(b"hello");
        p.fill_checksum_v4(SRC, DST);
        assert_eq!(buf, DATAGRAM);
    }

    #[test]
    fn test_emit() {
        let repr = Repr::parse(&Packet::new_checked(&DATAGRAM[..]).unwrap()).unwrap();
        assert_eq!(repr, Repr { src_port: 53000, dst_port: 53, payload_len: 5 });
        let mut buf = [0xa5u8; 13];
        assert_eq!(repr.emit(&mut buf), Ok(8));
        assert_eq!(buf[..8], [0xcf, 0x08, 0x00, 0x35, 0x00, 0x0d, 0x00, 0x00]);
        assert_eq!(buf[8..], [0xa5; 5]);
        let huge = Repr { payload_len: 65528, ..repr };
        assert_eq!(huge.emit(&mut buf), Err(Error::BadLength));
    }

    #[test]
    fn zero_checksum_means_none_on_v4_only() {
        let mut b = DATAGRAM;
        b[6..8].copy_from_slice(&[0, 0]);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert!(p.verify_checksum_v4(SRC, DST));
        assert!(!p.verify_checksum_v6(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST));
    }

    #[test]
    fn v6_checksum_round_trip() {
        let (s, d) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        let mut b = DATAGRAM;
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        p.fill_checksum_v6(s, d);
        assert!(p.verify_checksum_v6(s, d));
        assert!(!p.verify_checksum_v6(s, "fd00::3".parse().unwrap()));
    }

    #[test]
    fn check_len_rejections() {
        assert_eq!(Packet::new_checked(&DATAGRAM[..7]).unwrap_err(), Error::Truncated);
        assert_eq!(Packet::new_checked(&DATAGRAM[..12]).unwrap_err(), Error::BadLength);
        let mut b = DATAGRAM;
        b[4..6].copy_from_slice(&7u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadLength);
    }

    proptest! {
        #[test]
        fn repr_round_trip(src_port in any::<u16>(), dst_port in any::<u16>(), n in 0usize..200) {
            let repr = Repr { src_port, dst_port, payload_len: n };
            let mut buf = vec![0xa5u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            prop_assert_eq!(Repr::parse(&Packet::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn filled_checksum_verifies(
            payload in proptest::collection::vec(any::<u8>(), 0..100),
            s in any::<u32>(), d in any::<u32>(),
        ) {
            let mut buf = vec![0u8; HEADER_LEN + payload.len()];
            Repr { src_port: 1, dst_port: 2, payload_len: payload.len() }.emit(&mut buf).unwrap();
            let mut p = Packet::new_checked(&mut buf[..]).unwrap();
            p.payload_mut().copy_from_slice(&payload);
            p.fill_checksum_v4(s.into(), d.into());
            prop_assert_ne!(p.checksum(), 0);
            prop_assert!(p.verify_checksum_v4(s.into(), d.into()));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), Repr::parse(&p));
                let _ = p.verify_checksum_v4(Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST);
                let _ = p.verify_checksum_v6(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST);
            }
        }
    }
}
