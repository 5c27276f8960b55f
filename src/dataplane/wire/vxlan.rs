//! VXLAN (RFC 7348 §5): the 8-byte header between the outer UDP header and the inner Ethernet
//! frame.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |R|R|R|R|I|R|R|R|            Reserved                           |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                VXLAN Network Identifier (VNI) |   Reserved    |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! # Strictness on receive
//!
//! RFC 7348 says reserved bits "MUST be set to zero on transmission and ignored on receipt".
//! The Linux kernel, the VXLAN peer flannel uses, deliberately diverges: `vxlan_rcv` drops a
//! packet with any flag or reserved bit set that an enabled extension (GBP, GPE, RCO) did not
//! consume ("more robust and provides a little more security in adding extensions"). flannel does
//! not enable GBP by default, so [`Repr::parse`] does what the kernel does without extensions:
//! it rejects a clear I flag **and** any other nonzero bit outside the VNI, with
//! [`Error::BadFlags`]. A weft peer and a kernel peer therefore accept exactly the same packets.
//!
//! Whether the VNI is one this host serves is the caller's check (compare [`Repr::vni`]).
//! See the [module contract](super) for panics.

pub use crate::vocab::Vni;

use super::{Error, read_u32, write_u32};

/// Byte offsets of the header fields.
mod field {
    use std::ops::Range;

    pub(super) const FLAGS: usize = 0;
    pub(super) const RESERVED1: Range<usize> = 1..4;
    pub(super) const VNI: Range<usize> = 4..7;
    pub(super) const RESERVED2: usize = 7;
}

/// The length of the VXLAN header.
pub const HEADER_LEN: usize = field::RESERVED2 + 1;

/// The I flag: "the VNI is valid" (RFC 7348 §5); the only flag flannel's kernel peer sends.
pub(crate) const FLAG_I: u8 = 0x08;

/// A read/write view of a VXLAN packet (header plus inner frame).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a buffer without checking it. Accessors may panic unless [`Self::check_len`] passed.
    pub(crate) const fn new_unchecked(buffer: T) -> Self {
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
    /// [`Error::Truncated`] if shorter than the 8-byte header.
    pub(crate) fn check_len(&self) -> Result<(), Error> {
        if self.buffer.as_ref().len() < HEADER_LEN { Err(Error::Truncated) } else { Ok(()) }
    }

    /// The flags byte.
    #[inline]
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// The 24 reserved bits after the flags.
    #[inline]
    pub fn reserved1(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::FLAGS) & 0x00ff_ffff
    }

    /// The VNI field (24 bits), whatever the I flag says.
    #[inline]
    pub fn vni(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::VNI.start) >> 8
    }

    /// The reserved byte after the VNI.
    #[inline]
    pub fn reserved2(&self) -> u8 {
        self.buffer.as_ref()[field::RESERVED2]
    }

    /// The inner Ethernet frame.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Set the flags byte.
    #[inline]
    pub fn set_flags(&mut self, flags: u8) {
        self.buffer.as_mut()[field::FLAGS] = flags;
    }

    /// Set the 24 reserved bits after the flags (the low 24 bits of `value`).
    #[inline]
    pub fn set_reserved1(&mut self, value: u32) {
        let b = value.to_be_bytes();
        self.buffer.as_mut()[field::RESERVED1].copy_from_slice(&b[1..]);
    }

    /// Set the VNI, keeping the reserved byte after it.
    #[inline]
    pub fn set_vni(&mut self, vni: Vni) {
        let low = u32::from(self.reserved2());
        write_u32(self.buffer.as_mut(), field::VNI.start, (vni.get() << 8) | low);
    }

    /// Set the reserved byte after the VNI.
    #[inline]
    pub fn set_reserved2(&mut self, value: u8) {
        self.buffer.as_mut()[field::RESERVED2] = value;
    }

    /// The inner Ethernet frame, writable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[HEADER_LEN..]
    }
}

/// The meaning of a VXLAN header: just the VNI (everything else is fixed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// The VXLAN Network Identifier (flannel's `VNI`, default 1).
    pub vni: Vni,
}

impl Repr {
    /// Parse a header, as strictly as the Linux kernel (see the [module docs](self)).
    ///
    /// # Errors
    /// [`Error::Truncated`] below 8 bytes; [`Error::BadFlags`] if the I flag is clear or any
    /// bit outside the VNI other than I is set.
    pub fn parse<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Self, Error> {
        packet.check_len()?;
        if packet.flags() != FLAG_I || packet.reserved1() != 0 || packet.reserved2() != 0 {
            return Err(Error::BadFlags);
        }
        // The field is 24 bits wide, so this cannot fail.
        let vni = Vni::new(packet.vni())?;
        Ok(Self { vni })
    }

    /// The header length `emit` writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write all 8 header bytes (flags = I, reserved = 0) into the start of `buf`. Returns the
    /// header length.
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] if `buf` is shorter than 8 bytes (nothing is written).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(Error::BufferTooSmall);
        };
        write_u32(hdr, 0, u32::from(FLAG_I) << 24);
        write_u32(hdr, 4, self.vni.get() << 8);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::dataplane::wire::ethernet::{self, EtherType, MacAddr};

    /// The UDP payload of a packet the Linux kernel sends for flannel (VNI 1, "flags [I] (0x08)
    /// ... instance 1" in tcpdump): VXLAN header, then the inner Ethernet frame between the two
    /// flannel.1 MACs carrying the start of an IPv4 packet.
    const PACKET: [u8; 26] = [
        0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, // VXLAN: I flag, VNI 1
        0x0a, 0x58, 0x0a, 0xf4, 0x02, 0x00, 0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x00, 0x08,
        0x00, // Eth
        0x45, 0x00, 0x00, 0x54, // IPv4 ...
    ];

    fn vni(n: u32) -> Vni {
        Vni::new(n).unwrap()
    }

    #[test]
    fn test_deconstruct() {
        let p = Packet::new_checked(&PACKET[..]).unwrap();
        assert_eq!(p.flags(), FLAG_I);
        assert_eq!(p.reserved1(), 0);
        assert_eq!(p.vni(), 1);
        assert_eq!(p.reserved2(), 0);
        let inner = ethernet::Frame::new_checked(p.payload()).unwrap();
        assert_eq!(inner.ethertype(), EtherType::IPV4);
        assert_eq!(inner.src_addr(), MacAddr([0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x00]));
        assert_eq!(Repr::parse(&p), Ok(Repr { vni: vni(1) }));
    }

    #[test]
    fn test_construct() {
        let mut buf = [0xa5u8; 26];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_flags(FLAG_I);
        p.set_reserved1(0);
        p.set_reserved2(0);
        p.set_vni(vni(1));
        p.payload_mut().copy_from_slice(&PACKET[8..]);
        assert_eq!(buf, PACKET);
    }

    #[test]
    fn test_emit_writes_every_header_byte() {
        let mut buf = [0xa5u8; 10];
        assert_eq!(Repr { vni: vni(0x123456) }.emit(&mut buf), Ok(8));
        assert_eq!(buf, [0x08, 0, 0, 0, 0x12, 0x34, 0x56, 0, 0xa5, 0xa5]);
        assert_eq!(Repr { vni: vni(1) }.emit(&mut buf[..7]), Err(Error::BufferTooSmall));
    }

    #[test]
    fn parse_is_as_strict_as_the_kernel() {
        let parse = |b: &[u8]| Repr::parse(&Packet::new_checked(b)?);
        let mut b = PACKET;
        b[0] = 0x00; // I clear
        assert_eq!(parse(&b), Err(Error::BadFlags));
        b[0] = 0x88; // GBP's G bit, not enabled
        assert_eq!(parse(&b), Err(Error::BadFlags));
        b[0] = 0x0c; // GPE's P bit
        assert_eq!(parse(&b), Err(Error::BadFlags));
        b[0] = 0x08;
        b[2] = 0x01; // reserved
        assert_eq!(parse(&b), Err(Error::BadFlags));
        b[2] = 0x00;
        b[7] = 0x01; // reserved after the VNI
        assert_eq!(parse(&b), Err(Error::BadFlags));
        assert_eq!(parse(&PACKET[..7]), Err(Error::Truncated));
    }

    #[test]
    fn vni_range() {
        assert_eq!(Vni::new(Vni::MAX).map(Vni::get), Ok(0xff_ffff));
        assert_eq!(Vni::new(1 << 24), Err(crate::vocab::VniOutOfRange));
        assert_eq!(Vni::try_from(7).unwrap().to_string(), "7");
    }

    proptest! {
        #[test]
        fn repr_round_trip(n in 0..=Vni::MAX) {
            let repr = Repr { vni: vni(n) };
            let mut buf = [0xa5u8; HEADER_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            prop_assert_eq!(Repr::parse(&Packet::new_checked(&buf[..]).unwrap()), Ok(repr));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..20)) {
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                let _ = (p.payload(), p.vni(), Repr::parse(&p));
            }
        }
    }
}
