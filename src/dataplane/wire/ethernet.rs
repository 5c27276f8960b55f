//! Ethernet II frames (IEEE 802.3 with an EtherType), as carried inside VXLAN: flannel's inner
//! frame is untagged Ethernet II from one VTEP MAC to another.
//!
//! See the [module contract](super) for panics.

pub use crate::vocab::MacAddr;

use super::{Error, read_u16, write_u16};

/// Byte offsets of the header fields.
mod field {
    use std::ops::Range;

    pub(super) const DST: Range<usize> = 0..6;
    pub(super) const SRC: Range<usize> = 6..12;
    pub(super) const ETHERTYPE: Range<usize> = 12..14;
}

/// The length of an untagged Ethernet II header.
pub const HEADER_LEN: usize = field::ETHERTYPE.end;

/// An EtherType (IEEE 802 numbers registry).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EtherType(pub u16);

impl EtherType {
    /// IPv4 (RFC 894).
    pub const IPV4: Self = Self(0x0800);
    /// IPv6 (RFC 2464).
    pub const IPV6: Self = Self(0x86dd);
}

/// A read/write view of an Ethernet II frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wrap a buffer without checking it. Accessors may panic unless [`Self::check_len`] passed.
    pub(crate) const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wrap a buffer and [`check_len`](Self::check_len) it: the constructor for untrusted input.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let frame = Self::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Prove every accessor in bounds.
    ///
    /// # Errors
    /// [`Error::Truncated`] if shorter than the 14-byte header.
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        if self.buffer.as_ref().len() < HEADER_LEN { Err(Error::Truncated) } else { Ok(()) }
    }

    /// The destination address.
    #[inline]
    pub fn dst_addr(&self) -> MacAddr {
        mac(&self.buffer.as_ref()[field::DST])
    }

    /// The source address.
    #[inline]
    pub fn src_addr(&self) -> MacAddr {
        mac(&self.buffer.as_ref()[field::SRC])
    }

    /// The EtherType.
    #[inline]
    pub fn ethertype(&self) -> EtherType {
        EtherType(read_u16(self.buffer.as_ref(), field::ETHERTYPE.start))
    }

    /// Everything after the header (Ethernet has no length field; padding is the payload's).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

fn mac(b: &[u8]) -> MacAddr {
    let mut a = [0u8; 6];
    a.copy_from_slice(b);
    MacAddr(a)
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// Set the destination address.
    #[inline]
    pub fn set_dst_addr(&mut self, addr: MacAddr) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&addr.0);
    }

    /// Set the source address.
    #[inline]
    pub fn set_src_addr(&mut self, addr: MacAddr) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&addr.0);
    }

    /// Set the EtherType.
    #[inline]
    pub fn set_ethertype(&mut self, ethertype: EtherType) {
        write_u16(self.buffer.as_mut(), field::ETHERTYPE.start, ethertype.0);
    }

    /// The payload, writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[HEADER_LEN..]
    }
}

/// The meaning of an Ethernet II header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The source address.
    pub src_addr: MacAddr,
    /// The destination address.
    pub dst_addr: MacAddr,
    /// The EtherType.
    pub ethertype: EtherType,
}

impl Repr {
    /// Parse a frame's header.
    ///
    /// # Errors
    /// [`Error::Truncated`] if shorter than the header.
    pub fn parse<T: AsRef<[u8]>>(frame: &Frame<T>) -> Result<Self, Error> {
        frame.check_len()?;
        Ok(Self {
            src_addr: frame.src_addr(),
            dst_addr: frame.dst_addr(),
            ethertype: frame.ethertype(),
        })
    }

    /// The header length `emit` writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the 14 header bytes into the start of `buf`. Returns the header length.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] if `buf` is shorter than 14 bytes (nothing is written).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(Error::BufferTooSmall);
        };
        let mut frame = Frame::new_unchecked(hdr);
        frame.set_dst_addr(self.dst_addr);
        frame.set_src_addr(self.src_addr);
        frame.set_ethertype(self.ethertype);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parse_mac_accepts_go_forms_only() {
        let m = Some(MacAddr([0x00, 0x00, 0x5e, 0x00, 0x53, 0x01]));
        assert_eq!(MacAddr::parse("00:00:5e:00:53:01"), m);
        assert_eq!(MacAddr::parse("00-00-5E-00-53-01"), m);
        assert_eq!(MacAddr::parse("0000.5e00.5301"), m);
        for bad in [
            "",
            "00:00:5e:00:53",
            "00:00:5e:00:53:01:02",
            "00:00-5e:00:53:01",
            "00:00:5e:00:53:0g",
            "+0:00:5e:00:53:01",
            "0000.5e00.530",
            "0000:5e00.5301",
            "00:00:5e:00:53:1 ",
            "02:00:5e:10:00:00:00:01", // EUI-64: Go takes it, a VTEP MAC is never one
        ] {
            assert_eq!(MacAddr::parse(bad), None, "{bad:?}");
        }
    }

    const FRAME: [u8; 18] = [
        0x0a, 0x58, 0x0a, 0xf4, 0x02, 0x00, // dst: remote flannel.1 VtepMAC
        0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x00, // src: our flannel.1 MAC
        0x08, 0x00, // IPv4
        0x45, 0x00, 0x00, 0x14, // (start of the IP packet)
    ];
    const DST: MacAddr = MacAddr([0x0a, 0x58, 0x0a, 0xf4, 0x02, 0x00]);
    const SRC: MacAddr = MacAddr([0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x00]);

    #[test]
    fn test_deconstruct() {
        let f = Frame::new_checked(&FRAME[..]).unwrap();
        assert_eq!(f.dst_addr(), DST);
        assert_eq!(f.src_addr(), SRC);
        assert_eq!(f.ethertype(), EtherType::IPV4);
        assert_eq!(f.payload(), &FRAME[14..]);
        assert_eq!(DST.to_string(), "0a:58:0a:f4:02:00");
        assert!(!DST.is_multicast() && MacAddr::BROADCAST.is_multicast());
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 18];
        let mut f = Frame::new_unchecked(&mut buf[..]);
        f.set_dst_addr(DST);
        f.set_src_addr(SRC);
        f.set_ethertype(EtherType::IPV4);
        f.payload_mut().copy_from_slice(&FRAME[14..]);
        assert_eq!(buf, FRAME);
    }

    #[test]
    fn test_emit() {
        let repr = Repr { src_addr: SRC, dst_addr: DST, ethertype: EtherType::IPV4 };
        let mut buf = [0xa5u8; 18];
        assert_eq!(repr.emit(&mut buf), Ok(14));
        assert_eq!(buf[..14], FRAME[..14]);
        assert_eq!(buf[14..], [0xa5; 4]);
        assert_eq!(repr.emit(&mut buf[..13]), Err(Error::BufferTooSmall));
        assert_eq!(Frame::new_checked(&FRAME[..13]).unwrap_err(), Error::Truncated);
    }

    proptest! {
        #[test]
        fn repr_round_trip(s in any::<[u8; 6]>(), d in any::<[u8; 6]>(), t in any::<u16>()) {
            let repr = Repr { src_addr: MacAddr(s), dst_addr: MacAddr(d), ethertype: EtherType(t) };
            let mut buf = [0xa5u8; HEADER_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            prop_assert_eq!(Repr::parse(&Frame::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(f) = Frame::new_checked(&buf[..]) {
                let _ = (f.payload(), Repr::parse(&f));
            }
        }
    }
}
