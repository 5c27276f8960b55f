//! Link-layer identifiers: MAC addresses and VXLAN network identifiers, as flannel writes them
//! in lease values and as they sit in frames.
//!
//! Contract: pure parsing and formatting; never panics on any input.

use std::fmt;

/// A 48-bit MAC address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// Parses a 48-bit MAC in any form Go's `net.ParseMAC` accepts for 6 bytes:
    /// `aa:bb:cc:dd:ee:ff`, `aa-bb-cc-dd-ee-ff` (one separator throughout) or `aabb.ccdd.eeff`;
    /// hex digits in either case. Go also accepts 8- and 20-byte addresses; a VTEP MAC is never
    /// one, so they are refused.
    pub fn parse(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        let mut out = [0u8; 6];
        match b.len() {
            17 => {
                let sep = b[2];
                if sep != b':' && sep != b'-' {
                    return None;
                }
                for (i, byte) in out.iter_mut().enumerate() {
                    let x = i * 3;
                    *byte = hex2(b[x], b[x + 1])?;
                    if i < 5 && b[x + 2] != sep {
                        return None;
                    }
                }
            }
            14 => {
                for i in 0..3 {
                    let x = i * 5;
                    out[2 * i] = hex2(b[x], b[x + 1])?;
                    out[2 * i + 1] = hex2(b[x + 2], b[x + 3])?;
                    if i < 2 && b[x + 4] != b'.' {
                        return None;
                    }
                }
            }
            _ => return None,
        }
        Some(Self(out))
    }

    /// ff:ff:ff:ff:ff:ff.
    #[cfg(test)]
    pub(crate) const BROADCAST: Self = Self([0xff; 6]);

    /// Whether the group bit (the least significant bit of the first octet) is set: a
    /// multicast or broadcast address.
    #[cfg(test)]
    pub(crate) const fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// One byte from two hex digits, either case.
fn hex2(hi: u8, lo: u8) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    Some(digit(hi)? << 4 | digit(lo)?)
}

/// A number above 2^24 − 1 given as a VNI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a VNI is 24 bits: at most 16777215")]
pub struct VniOutOfRange;

/// A VXLAN Network Identifier: 24 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Vni(u32);

impl Vni {
    /// The largest VNI, 2^24 − 1.
    pub const MAX: u32 = 0x00ff_ffff;

    /// A VNI from a number.
    ///
    /// # Errors
    /// [`VniOutOfRange`] if `vni` does not fit in 24 bits.
    pub const fn new(vni: u32) -> Result<Self, VniOutOfRange> {
        if vni > Self::MAX { Err(VniOutOfRange) } else { Ok(Self(vni)) }
    }

    /// The VNI as a number (always below 2^24).
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<u32> for Vni {
    type Error = VniOutOfRange;

    fn try_from(vni: u32) -> Result<Self, VniOutOfRange> {
        Self::new(vni)
    }
}

impl std::fmt::Display for Vni {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
