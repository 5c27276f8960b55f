//! The `virtio_net_hdr` a TUN device opened with `IFF_VNET_HDR` prepends to every packet: how a
//! large segment is to be split (GSO) and which checksum is still to be finished.
//!
//! Layout from `include/uapi/linux/virtio_net.h` (the 10-byte legacy header; the 12-byte form
//! with `num_buffers` is not used by TUN unless `TUNSETVNETHDRSZ` asks for it). Multi-byte fields
//! are little-endian: TUN uses the host's virtio byte order, which is little-endian on every
//! architecture weft targets (and `TUNSETVNETLE` can force it elsewhere).

use super::Error;

/// The length of the header.
pub const LEN: usize = 10;

/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: the L4 checksum is partial; finish it over
/// `csum_start..` and store it at `csum_start + csum_offset`.
pub const F_NEEDS_CSUM: u8 = 1;

/// `VIRTIO_NET_HDR_GSO_NONE`: a single packet.
pub const GSO_NONE: u8 = 0;
/// `VIRTIO_NET_HDR_GSO_TCPV4`: IPv4 TCP segmentation (TSO).
pub const GSO_TCPV4: u8 = 1;
/// `VIRTIO_NET_HDR_GSO_UDP`: IP fragmentation offload of UDP (UFO, deprecated).
pub const GSO_UDP: u8 = 3;
/// `VIRTIO_NET_HDR_GSO_TCPV6`: IPv6 TCP segmentation.
pub const GSO_TCPV6: u8 = 4;
/// `VIRTIO_NET_HDR_GSO_UDP_L4`: UDP segmentation (USO, Linux 6.2+ on TUN).
pub const GSO_UDP_L4: u8 = 5;
/// `VIRTIO_NET_HDR_GSO_ECN`: ORed into the GSO type when the TCP segments carry CWR.
pub const GSO_ECN: u8 = 0x80;

/// Byte offsets of the header fields.
mod field {
    use std::ops::Range;

    pub(super) const FLAGS: usize = 0;
    pub(super) const GSO_TYPE: usize = 1;
    pub(super) const HDR_LEN: Range<usize> = 2..4;
    pub(super) const GSO_SIZE: Range<usize> = 4..6;
    pub(super) const CSUM_START: Range<usize> = 6..8;
    pub(super) const CSUM_OFFSET: Range<usize> = 8..10;
}

/// A decoded `virtio_net_hdr`. Values are taken as they come: whether they make sense for the
/// packet behind them (the GSO split) is checked where they are used; note that `hdr_len` is
/// not to be trusted (it can cover a whole forwarded packet), so recompute it there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Header {
    /// [`F_NEEDS_CSUM`] and/or [`F_DATA_VALID`].
    pub flags: u8,
    /// One of the `GSO_*` types, possibly ORed with [`GSO_ECN`].
    pub gso_type: u8,
    /// The length of the headers to copy in front of each segment (a hint).
    pub hdr_len: u16,
    /// The payload bytes per segment.
    pub gso_size: u16,
    /// Where the checksummed region starts (the L4 header), when [`F_NEEDS_CSUM`].
    pub csum_start: u16,
    /// Where in that region the checksum field is (16 for TCP, 6 for UDP).
    pub csum_offset: u16,
}

impl Header {
    /// The header of a plain packet: no GSO, checksum complete.
    pub const NONE: Self = Self {
        flags: 0,
        gso_type: GSO_NONE,
        hdr_len: 0,
        gso_size: 0,
        csum_start: 0,
        csum_offset: 0,
    };

    /// Decode the first 10 bytes of `buf`.
    ///
    /// # Errors
    /// [`Error::Truncated`] if `buf` is shorter than [`LEN`].
    pub fn parse(buf: &[u8]) -> Result<Self, Error> {
        let Some(b) = buf.get(..LEN) else {
            return Err(Error::Truncated);
        };
        let le16 = |r: std::ops::Range<usize>| u16::from_le_bytes([b[r.start], b[r.start + 1]]);
        Ok(Self {
            flags: b[field::FLAGS],
            gso_type: b[field::GSO_TYPE],
            hdr_len: le16(field::HDR_LEN),
            gso_size: le16(field::GSO_SIZE),
            csum_start: le16(field::CSUM_START),
            csum_offset: le16(field::CSUM_OFFSET),
        })
    }

    /// Encode into the first 10 bytes of `buf`, writing every byte. Returns [`LEN`].
    ///
    /// # Errors
    /// [`Error::BufferTooSmall`] if `buf` is shorter than [`LEN`] (nothing is written).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        let Some(b) = buf.get_mut(..LEN) else {
            return Err(Error::BufferTooSmall);
        };
        b[field::FLAGS] = self.flags;
        b[field::GSO_TYPE] = self.gso_type;
        b[field::HDR_LEN].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[field::GSO_SIZE].copy_from_slice(&self.gso_size.to_le_bytes());
        b[field::CSUM_START].copy_from_slice(&self.csum_start.to_le_bytes());
        b[field::CSUM_OFFSET].copy_from_slice(&self.csum_offset.to_le_bytes());
        Ok(LEN)
    }

    /// The GSO type without the [`GSO_ECN`] bit.
    pub const fn gso_kind(&self) -> u8 {
        self.gso_type & !GSO_ECN
    }

    /// Whether the checksum still has to be finished ([`F_NEEDS_CSUM`]).
    pub const fn needs_csum(&self) -> bool {
        self.flags & F_NEEDS_CSUM != 0
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// What TUN hands over for an IPv4 TSO burst: NEEDS_CSUM, TCPV4, hdr_len 52 (20 IP + 32 TCP
    /// with timestamps), gso_size 1448, csum_start 20, csum_offset 16.
    const TSO: [u8; 10] = [0x01, 0x01, 0x34, 0x00, 0xa8, 0x05, 0x14, 0x00, 0x10, 0x00];

    #[test]
    fn test_parse() {
        let h = Header::parse(&TSO).unwrap();
        assert_eq!(
            h,
            Header {
                flags: F_NEEDS_CSUM,
                gso_type: GSO_TCPV4,
                hdr_len: 52,
                gso_size: 1448,
                csum_start: 20,
                csum_offset: 16,
            }
        );
        assert!(h.needs_csum());
        assert_eq!(Header { gso_type: GSO_TCPV6 | GSO_ECN, ..h }.gso_kind(), GSO_TCPV6);
        assert_eq!(Header::parse(&TSO[..9]), Err(Error::Truncated));
    }

    #[test]
    fn test_emit() {
        let h = Header::parse(&TSO).unwrap();
        let mut buf = [0xa5u8; 12];
        assert_eq!(h.emit(&mut buf), Ok(LEN));
        assert_eq!(buf[..10], TSO);
        assert_eq!(buf[10..], [0xa5, 0xa5]);
        assert_eq!(Header::NONE.emit(&mut buf), Ok(LEN));
        assert_eq!(buf[..10], [0; 10]);
        assert_eq!(h.emit(&mut buf[..9]), Err(Error::BufferTooSmall));
    }

    proptest! {
        #[test]
        fn round_trip(b in any::<[u8; 10]>()) {
            let h = Header::parse(&b).unwrap();
            let mut out = [0xa5u8; 10];
            prop_assert_eq!(h.emit(&mut out), Ok(LEN));
            prop_assert_eq!(out, b);
            prop_assert_eq!(Header::parse(&out), Ok(h));
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(buf in proptest::collection::vec(any::<u8>(), 0..20)) {
            let _ = Header::parse(&buf);
        }
    }
}
