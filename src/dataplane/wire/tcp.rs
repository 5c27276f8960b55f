//! TCP (RFC 9293 §3.1): a minimal checked view of the header, enough for segmentation and
//! coalescing offloads and their tests (ports, sequence numbers, flags, checksums).
//!
//! See the [module contract](super) for panics.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::{Error, checksum, ip, read_u16, read_u32, write_u16, write_u32};

/// Byte offsets of the header fields.
mod field {
    use std::ops::Range;

    pub(super) const SRC_PORT: Range<usize> = 0..2;
    pub(super) const DST_PORT: Range<usize> = 2..4;
    pub(super) const SEQ_NUM: Range<usize> = 4..8;
    pub(super) const ACK_NUM: Range<usize> = 8..12;
    /// Data offset (4 bits), reserved (4 bits).
    pub(super) const DATA_OFF: usize = 12;
    pub(super) const FLAGS: usize = 13;
    pub(super) const WIN_SIZE: Range<usize> = 14..16;
    pub(super) const CHECKSUM: Range<usize> = 16..18;
    pub(super) const URGENT: Range<usize> = 18..20;
}

/// The length of a header without options.
pub const HEADER_LEN: usize = field::URGENT.end;

/// The offset of the checksum field in the header (a virtio `csum_offset`).
pub(crate) const CHECKSUM_OFFSET: usize = field::CHECKSUM.start;

/// FIN: no more data from the sender.
pub(crate) const FIN: u8 = 0x01;
/// SYN: synchronize sequence numbers.
#[cfg(test)]
pub(crate) const SYN: u8 = 0x02;
/// RST: reset the connection.
#[cfg(test)]
pub(crate) const RST: u8 = 0x04;
/// PSH: push function.
pub const PSH: u8 = 0x08;
/// ACK: the acknowledgment field is significant.
pub const ACK: u8 = 0x10;
/// URG: the urgent pointer is significant.
#[cfg(test)]
pub(crate) const URG: u8 = 0x20;
/// ECE: ECN-Echo (RFC 3168).
#[cfg(test)]
pub(crate) const ECE: u8 = 0x40;
/// CWR: congestion window reduced (RFC 3168).
pub(crate) const CWR: u8 = 0x80;

/// A read/write view of a TCP segment.
///
/// TCP has no length field: the segment is the whole buffer, so callers slice it to the IP
/// payload first ([`super::ipv4::Packet::payload`]).
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
    /// [`Error::Truncated`] below 20 bytes; [`Error::BadHeaderLength`] if the data offset is
    /// below 5 words or the header runs past the buffer.
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        let len = self.buffer.as_ref().len();
        if len < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let header_len = usize::from(self.header_len());
        if header_len < HEADER_LEN || header_len > len {
            return Err(Error::BadHeaderLength);
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

    /// The sequence number.
    #[inline]
    pub fn seq_number(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::SEQ_NUM.start)
    }

    /// The acknowledgment number.
    #[inline]
    pub fn ack_number(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::ACK_NUM.start)
    }

    /// The header length in bytes (data offset × 4), options included.
    #[inline]
    pub fn header_len(&self) -> u8 {
        (self.buffer.as_ref()[field::DATA_OFF] >> 4) * 4
    }

    /// The flags byte (see [`FIN`] .. [`CWR`]).
    #[inline]
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// The receive window.
    #[inline]
    pub fn window_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::WIN_SIZE.start)
    }

    /// The checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM.start)
    }

    /// The urgent pointer.
    #[inline]
    pub fn urgent_at(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::URGENT.start)
    }

    /// The options bytes.
    #[inline]
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.header_len())]
    }

    /// The payload: everything after the header.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[usize::from(self.header_len())..]
    }

    fn sum_v4(&self, src: Ipv4Addr, dst: Ipv4Addr) -> Option<u16> {
        let data = self.buffer.as_ref();
        // A segment longer than 64 KiB cannot be described by the pseudo header.
        let len = u16::try_from(data.len()).ok()?;
        let ph = checksum::pseudo_header_v4(src, dst, ip::proto::TCP, len);
        Some(checksum::combine(&[ph, checksum::data(data)]))
    }

    fn sum_v6(&self, src: Ipv6Addr, dst: Ipv6Addr) -> Option<u16> {
        let data = self.buffer.as_ref();
        let len = u32::try_from(data.len()).ok()?;
        let ph = checksum::pseudo_header_v6(src, dst, ip::proto::TCP, len);
        Some(checksum::combine(&[ph, checksum::data(data)]))
    }

    /// Whether the checksum over the IPv4 pseudo header and the whole buffer is correct.
    pub fn verify_checksum_v4(&self, src: Ipv4Addr, dst: Ipv4Addr) -> bool {
        self.sum_v4(src, dst) == Some(0xffff)
    }

    /// Whether the checksum over the IPv6 pseudo header and the whole buffer is correct.
    pub fn verify_checksum_v6(&self, src: Ipv6Addr, dst: Ipv6Addr) -> bool {
        self.sum_v6(src, dst) == Some(0xffff)
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

    /// Set the sequence number.
    #[inline]
    pub fn set_seq_number(&mut self, seq: u32) {
        write_u32(self.buffer.as_mut(), field::SEQ_NUM.start, seq);
    }

    /// Set the acknowledgment number.
    #[inline]
    pub fn set_ack_number(&mut self, ack: u32) {
        write_u32(self.buffer.as_mut(), field::ACK_NUM.start, ack);
    }

    /// Set the header length in bytes (rounded down to a multiple of 4); clears the reserved
    /// bits sharing its byte.
    #[inline]
    pub fn set_header_len(&mut self, len: u8) {
        self.buffer.as_mut()[field::DATA_OFF] = ((len / 4) & 0x0f) << 4;
    }

    /// Set the flags byte.
    #[inline]
    pub fn set_flags(&mut self, flags: u8) {
        self.buffer.as_mut()[field::FLAGS] = flags;
    }

    /// Set the receive window.
    #[inline]
    pub fn set_window_len(&mut self, window: u16) {
        write_u16(self.buffer.as_mut(), field::WIN_SIZE.start, window);
    }

    /// Set the checksum field.
    #[inline]
    pub(crate) fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM.start, value);
    }

    /// Set the urgent pointer.
    #[inline]
    pub fn set_urgent_at(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::URGENT.start, value);
    }

    /// Compute and store the checksum over the IPv4 pseudo header and the whole buffer.
    ///
    /// # Errors
    /// [`Error::BadLength`] if the buffer is longer than 65535 bytes (the pseudo header's length
    /// is 16 bits); the checksum is then left zero.
    pub fn fill_checksum_v4(&mut self, src: Ipv4Addr, dst: Ipv4Addr) -> Result<(), Error> {
        self.set_checksum(0);
        let sum = self.sum_v4(src, dst).ok_or(Error::BadLength)?;
        self.set_checksum(!sum);
        Ok(())
    }

    /// Compute and store the checksum over the IPv6 pseudo header and the whole buffer.
    ///
    /// # Errors
    /// [`Error::BadLength`] if the buffer is longer than `u32::MAX` bytes.
    pub fn fill_checksum_v6(&mut self, src: Ipv6Addr, dst: Ipv6Addr) -> Result<(), Error> {
        self.set_checksum(0);
        let sum = self.sum_v6(src, dst).ok_or(Error::BadLength)?;
        self.set_checksum(!sum);
        Ok(())
    }

    /// The options bytes, writable.
    #[inline]
    pub fn options_mut(&mut self) -> &mut [u8] {
        let end = usize::from(self.header_len());
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }

    /// The payload, writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = usize::from(self.header_len());
        &mut self.buffer.as_mut()[start..]
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The TCP part of a SYN 10.244.1.2:40000 -> 10.244.2.3:80, seq 0x01020304, window 64240,
    /// MSS 1460.
    const SYN_V4: [u8; 24] = [
        0x9c, 0x40, 0x00, 0x50, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x00, 0x60, 0x02, 0xfa,
        0xf0, 0xe3, 0xb2, 0x00, 0x00, 0x02, 0x04, 0x05, 0xb4,
    ];
    /// The same SYN between fd00::1 and fd00::2 with MSS 1440.
    const SYN_V6: [u8; 24] = [
        0x9c, 0x40, 0x00, 0x50, 0x01, 0x02, 0x03, 0x04, 0x00, 0x00, 0x00, 0x00, 0x60, 0x02, 0xfa,
        0xf0, 0x02, 0xaf, 0x00, 0x00, 0x02, 0x04, 0x05, 0xa0,
    ];
    const SRC: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
    const DST: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 3);

    fn v6() -> (Ipv6Addr, Ipv6Addr) {
        ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap())
    }

    #[test]
    fn test_deconstruct() {
        let p = Packet::new_checked(&SYN_V4[..]).unwrap();
        assert_eq!(p.src_port(), 40000);
        assert_eq!(p.dst_port(), 80);
        assert_eq!(p.seq_number(), 0x0102_0304);
        assert_eq!(p.ack_number(), 0);
        assert_eq!(p.header_len(), 24);
        assert_eq!(p.flags(), SYN);
        assert_eq!(p.window_len(), 64240);
        assert_eq!(p.checksum(), 0xe3b2);
        assert_eq!(p.urgent_at(), 0);
        assert_eq!(p.options(), &[0x02, 0x04, 0x05, 0xb4]);
        assert!(p.payload().is_empty());
        assert!(p.verify_checksum_v4(SRC, DST));
        // The pseudo header is part of the sum: another address pair does not verify.
        assert!(!p.verify_checksum_v4(SRC, Ipv4Addr::new(10, 244, 2, 4)));
        let (s, d) = v6();
        assert!(Packet::new_checked(&SYN_V6[..]).unwrap().verify_checksum_v6(s, d));
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 24];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_src_port(40000);
        p.set_dst_port(80);
        p.set_seq_number(0x0102_0304);
        p.set_ack_number(0);
        p.set_header_len(24);
        p.set_flags(SYN);
        p.set_window_len(64240);
        p.set_urgent_at(0);
        p.options_mut().copy_from_slice(&[0x02, 0x04, 0x05, 0xb4]);
        p.fill_checksum_v4(SRC, DST).unwrap();
        assert_eq!(buf, SYN_V4);

        let (s, d) = v6();
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.options_mut()[3] = 0xa0;
        p.fill_checksum_v6(s, d).unwrap();
        assert_eq!(buf, SYN_V6);
    }

    #[test]
    fn check_len_rejections() {
        assert_eq!(Packet::new_checked(&SYN_V4[..19]).unwrap_err(), Error::Truncated);
        assert_eq!(Packet::new_checked(&SYN_V4[..23]).unwrap_err(), Error::BadHeaderLength);
        let mut b = SYN_V4;
        b[12] = 0x40;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::BadHeaderLength);
    }

    #[test]
    fn flag_consts_are_distinct_bits() {
        let all = [FIN, SYN, RST, PSH, ACK, URG, ECE, CWR];
        assert_eq!(all.iter().fold(0u8, |a, f| a | f), 0xff);
        assert!(all.iter().all(|f| f.count_ones() == 1));
    }

    proptest! {
        #[test]
        fn filled_checksum_verifies(
            payload in proptest::collection::vec(any::<u8>(), 0..100),
            s in any::<u32>(), d in any::<u32>(), s6 in any::<u128>(), d6 in any::<u128>(),
        ) {
            let mut buf = SYN_V4.to_vec();
            buf.extend(payload);
            let mut p = Packet::new_checked(&mut buf[..]).unwrap();
            p.fill_checksum_v4(s.into(), d.into()).unwrap();
            prop_assert!(p.verify_checksum_v4(s.into(), d.into()));
            p.fill_checksum_v6(s6.into(), d6.into()).unwrap();
            prop_assert!(p.verify_checksum_v6(s6.into(), d6.into()));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.options(), p.payload(), p.flags());
                let _ = p.verify_checksum_v4(Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST);
                let mut copy = buf.clone();
                let mut p = Packet::new_unchecked(&mut copy[..]);
                let _ = (p.options_mut().len(), p.payload_mut().len());
            }
        }
    }
}
