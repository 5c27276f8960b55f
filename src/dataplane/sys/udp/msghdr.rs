//! What a `msghdr` carries besides the payload, in the kernel's layouts: control messages
//! (`cmsghdr`s), written with [`Encoder`] and read with [`Cmsgs`], and the peer's socket
//! address ([`SockName`]). Every `unsafe` these need is here, each with its reason; the socket
//! code ([`super`]) only points its `msghdr`s at them. The shape is quinn-udp's `cmsg` module:
//! an encoder and an iterator over the kernel's layout, so that no caller walks `CMSG_*`
//! pointers itself.
//!
//! # Contract
//! - [`CmsgBuf`] holds one message's control messages, aligned as `cmsghdr` wants.
//! - [`Encoder`] appends control messages to a [`CmsgBuf`] as `CMSG_FIRSTHDR` and `CMSG_NXTHDR`
//!   lay them out; one that does not fit is refused (nothing is written past the end).
//!   [`Encoder::len`] is the `msg_controllen` to pass.
//! - [`Cmsgs`] walks what the kernel wrote into a [`CmsgBuf`] (its first `msg_controllen`
//!   bytes): each message in order, as `CMSG_NXTHDR` steps, ending at a header that is shorter
//!   than a header or runs past the end. It never reads outside the buffer, whatever the bytes
//!   say; [`Cmsg::read`] reads a value only if the message holds one.
//! - [`SockName`] holds an IPv4 or IPv6 socket address as `msg_name`: written for a send,
//!   read back after a receive (`None` unless the kernel wrote a whole one of either family).

use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr;

/// Bytes of control-message storage per message: room for one `UDP_SEGMENT` (u16) or
/// `UDP_GRO` (int) message, with margin.
const CMSG_BUF_LEN: usize = 64;

// SAFETY: CMSG_LEN is pure arithmetic on its argument.
const HDR_LEN: usize = unsafe { libc::CMSG_LEN(0) } as usize;

/// `CMSG_SPACE(len)`: the room one message with `len` bytes of data takes, its padding
/// included.
const fn space(len: usize) -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
    (unsafe { libc::CMSG_SPACE(len as u32) }) as usize
}

/// `CMSG_LEN(len)`: a message's `cmsg_len` for `len` bytes of data.
const fn cmsg_len(len: usize) -> usize {
    // SAFETY: CMSG_LEN is pure arithmetic on its argument.
    (unsafe { libc::CMSG_LEN(len as u32) }) as usize
}

/// What `CMSG_ALIGN` rounds to: `CMSG_SPACE(1)` is one such unit past the aligned header.
const ALIGN: usize = space(1) - HDR_LEN;

/// `CMSG_ALIGN(len)`.
const fn align(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN
}

const _: () = assert!(ALIGN.is_power_of_two() && HDR_LEN >= mem::size_of::<libc::cmsghdr>());
const _: () = assert!(space(mem::size_of::<libc::c_int>()) <= CMSG_BUF_LEN);
const _: () = assert!(mem::align_of::<CmsgBuf>() >= mem::align_of::<libc::cmsghdr>());

/// One message's control-message storage, with `cmsghdr` alignment.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub(crate) struct CmsgBuf([u8; CMSG_BUF_LEN]);

impl CmsgBuf {
    /// Its size: the `msg_controllen` to offer the kernel on receive.
    pub(crate) const LEN: usize = CMSG_BUF_LEN;

    /// Empty (zeroed) storage.
    pub(crate) const fn new() -> Self {
        Self([0; CMSG_BUF_LEN])
    }

    /// Where it starts, for `msg_control`.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut libc::c_void {
        self.0.as_mut_ptr().cast()
    }
}

/// A value a control message carries, in the host's byte order.
pub(crate) trait Datum: Copy {
    /// Its size in bytes.
    const SIZE: usize;
    /// Writes it into `out` (exactly [`Datum::SIZE`] bytes).
    fn write(self, out: &mut [u8]);
    /// Reads one from `bytes` (exactly [`Datum::SIZE`] bytes).
    fn read(bytes: &[u8]) -> Self;
}

impl Datum for u16 {
    const SIZE: usize = 2;
    fn write(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_ne_bytes());
    }
    fn read(bytes: &[u8]) -> Self {
        Self::from_ne_bytes([bytes[0], bytes[1]])
    }
}

impl Datum for i32 {
    const SIZE: usize = 4;
    fn write(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_ne_bytes());
    }
    fn read(bytes: &[u8]) -> Self {
        Self::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

/// Appends control messages to a [`CmsgBuf`]; see the module docs.
pub(crate) struct Encoder<'a> {
    buf: &'a mut CmsgBuf,
    len: usize,
}

impl<'a> Encoder<'a> {
    /// Encodes into `buf`, from its start.
    pub(crate) fn new(buf: &'a mut CmsgBuf) -> Self {
        Self { buf, len: 0 }
    }

    /// Appends a message of `level` and `ty` carrying `value`; false (and nothing written) if
    /// it does not fit.
    pub(crate) fn push<T: Datum>(&mut self, level: libc::c_int, ty: libc::c_int, value: T) -> bool {
        let Some(room) = self.buf.0.get_mut(self.len..self.len + space(T::SIZE)) else {
            return false;
        };
        // SAFETY: cmsghdr is plain old data (integers, and on some libcs private padding):
        // all-zero is a valid value.
        let mut hdr: libc::cmsghdr = unsafe { mem::zeroed() };
        hdr.cmsg_len = cmsg_len(T::SIZE) as _;
        hdr.cmsg_level = level;
        hdr.cmsg_type = ty;
        // SAFETY: `room` is at least CMSG_SPACE(T::SIZE) >= size_of::<cmsghdr>() bytes of the
        // buffer, borrowed exclusively; write_unaligned needs no alignment.
        unsafe { ptr::write_unaligned(room.as_mut_ptr().cast::<libc::cmsghdr>(), hdr) };
        room[mem::size_of::<libc::cmsghdr>()..HDR_LEN].fill(0);
        value.write(&mut room[HDR_LEN..HDR_LEN + T::SIZE]);
        room[HDR_LEN + T::SIZE..].fill(0);
        self.len += room.len();
        true
    }

    /// The bytes written so far: the `msg_controllen` to pass (0: no control messages).
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// One control message the kernel wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cmsg<'a> {
    /// `cmsg_level`.
    pub(crate) level: libc::c_int,
    /// `cmsg_type`.
    pub(crate) ty: libc::c_int,
    /// Its data: `cmsg_len` minus the header.
    pub(crate) data: &'a [u8],
}

impl Cmsg<'_> {
    /// The value at the start of the data, if the data holds one.
    pub(crate) fn read<T: Datum>(&self) -> Option<T> {
        self.data.get(..T::SIZE).map(T::read)
    }
}

/// The control messages in a [`CmsgBuf`] the kernel filled; see the module docs.
pub(crate) struct Cmsgs<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cmsgs<'a> {
    /// The messages in the first `controllen` bytes of `buf` (as the kernel set
    /// `msg_controllen`; more than the buffer holds is read as all of it).
    pub(crate) fn new(buf: &'a CmsgBuf, controllen: usize) -> Self {
        Self { bytes: &buf.0[..controllen.min(CMSG_BUF_LEN)], at: 0 }
    }

    /// The messages the kernel wrote into `buf` for the message `hdr` describes.
    pub(crate) fn of(buf: &'a CmsgBuf, hdr: &libc::msghdr) -> Self {
        // `msg_controllen` is a size_t on glibc and a socklen_t on musl.
        #[allow(clippy::useless_conversion)]
        let controllen = usize::try_from(hdr.msg_controllen).unwrap_or(usize::MAX);
        Self::new(buf, controllen)
    }
}

impl<'a> Iterator for Cmsgs<'a> {
    type Item = Cmsg<'a>;

    fn next(&mut self) -> Option<Cmsg<'a>> {
        let rest = self.bytes.get(self.at..)?;
        if rest.len() < mem::size_of::<libc::cmsghdr>() {
            return None;
        }
        // SAFETY: `rest` holds at least size_of::<cmsghdr>() bytes; cmsghdr is plain old
        // data, valid for any bytes, and read_unaligned needs no alignment.
        let hdr = unsafe { ptr::read_unaligned(rest.as_ptr().cast::<libc::cmsghdr>()) };
        // `cmsg_len` is a size_t on glibc and a socklen_t on musl.
        #[allow(clippy::useless_conversion)]
        let len = usize::try_from(hdr.cmsg_len).unwrap_or(usize::MAX);
        if len < HDR_LEN || len > rest.len() {
            self.at = self.bytes.len();
            return None;
        }
        self.at += align(len);
        Some(Cmsg { level: hdr.cmsg_level, ty: hdr.cmsg_type, data: &rest[HDR_LEN..len] })
    }
}

/// Room for a socket address of either family, as `msg_name` of one message: the kernel writes
/// the sender's there on receive, and reads the destination from it on send. By hand because
/// the batch needs one per message, in place, without `sockaddr_storage`'s 128 bytes each.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union SockName {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl SockName {
    /// Its size: the `msg_namelen` to offer the kernel on receive.
    pub(crate) const LEN: usize = mem::size_of::<Self>();

    /// An empty one (all zero: no family).
    pub(crate) fn new() -> Self {
        // SAFETY: both variants are plain old data; all-zero is a valid value of each.
        unsafe { mem::zeroed() }
    }

    /// Writes `a`; returns the length to give the kernel.
    pub(crate) fn set(&mut self, a: SocketAddr) -> libc::socklen_t {
        match a {
            SocketAddr::V4(a) => {
                self.v4 = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                    sin_zero: [0; 8],
                };
                mem::size_of::<libc::sockaddr_in>() as libc::socklen_t
            }
            SocketAddr::V6(a) => {
                self.v6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                    sin6_scope_id: a.scope_id(),
                };
                mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t
            }
        }
    }

    /// The address the kernel wrote, `len` bytes of it; `None` if it is of neither family or
    /// shorter than its family's.
    pub(crate) fn get(&self, len: libc::socklen_t) -> Option<SocketAddr> {
        let len = len as usize;
        // SAFETY: both variants are plain old data, valid for every bit pattern, and both start
        // with the family field, so reading it (and then the variant it names) is sound.
        let family = libc::c_int::from(unsafe { self.v4.sin_family });
        match family {
            libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
                // SAFETY: as above.
                let a = unsafe { self.v4 };
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
                // SAFETY: as above.
                let a = unsafe { self.v6 };
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The messages libc's own `CMSG_FIRSTHDR`/`CMSG_NXTHDR` walk finds in `buf[..controllen]`
    /// (level, type, `cmsg_len`), cut at the first that does not lie whole inside (libc leaves
    /// that check to its caller).
    fn libc_walk(buf: &mut CmsgBuf, controllen: usize) -> Vec<(i32, i32, usize)> {
        // SAFETY: all-zero is a valid msghdr.
        let mut h: libc::msghdr = unsafe { mem::zeroed() };
        h.msg_control = buf.as_mut_ptr();
        h.msg_controllen = controllen as _;
        let mut out = Vec::new();
        // SAFETY: msg_control points at CMSG_BUF_LEN >= controllen readable bytes with cmsghdr
        // alignment; CMSG_NXTHDR returns only headers that lie within them, and each header's
        // fields are read only after checking it is whole.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&h);
            while !c.is_null() {
                let len = (*c).cmsg_len as usize;
                let start = c.cast::<u8>().offset_from(buf.0.as_ptr()) as usize;
                if len < HDR_LEN || start + len > controllen {
                    break;
                }
                out.push(((*c).cmsg_level, (*c).cmsg_type, len));
                c = libc::CMSG_NXTHDR(&h, c);
            }
        }
        out
    }

    fn ours(buf: &CmsgBuf, controllen: usize) -> Vec<(i32, i32, usize)> {
        Cmsgs::new(buf, controllen).map(|c| (c.level, c.ty, c.data.len() + HDR_LEN)).collect()
    }

    #[test]
    fn encoded_messages_read_back_as_libc_lays_them_out() {
        let mut buf = CmsgBuf::new();
        let mut e = Encoder::new(&mut buf);
        assert!(e.push(libc::SOL_UDP, libc::UDP_SEGMENT, 1400u16));
        assert!(e.push(libc::SOL_UDP, libc::UDP_GRO, -7i32));
        let len = e.len();
        assert_eq!(len, space(2) + space(4));
        let got: Vec<_> = Cmsgs::new(&buf, len).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].level, got[0].ty, got[0].read::<u16>()),
            (libc::SOL_UDP, libc::UDP_SEGMENT, Some(1400))
        );
        assert_eq!((got[1].ty, got[1].read::<i32>()), (libc::UDP_GRO, Some(-7)));
        assert_eq!(got[0].read::<i32>(), None, "a u16 message holds no int");
        assert_eq!(ours(&buf, len), libc_walk(&mut buf, len));
        assert_eq!(libc_walk(&mut buf, len).len(), 2);
    }

    #[test]
    fn a_message_that_does_not_fit_is_refused() {
        let mut buf = CmsgBuf::new();
        let mut e = Encoder::new(&mut buf);
        let mut n = 0;
        while e.push(libc::SOL_UDP, libc::UDP_GRO, n) {
            n += 1;
        }
        assert_eq!(n as usize, CMSG_BUF_LEN / space(4));
        assert!(e.len() <= CMSG_BUF_LEN);
        let read: Vec<i32> = Cmsgs::new(&buf, CMSG_BUF_LEN).filter_map(|c| c.read()).collect();
        assert_eq!(read, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn nothing_encoded_is_no_control_message() {
        let mut buf = CmsgBuf::new();
        assert_eq!(Encoder::new(&mut buf).len(), 0);
        assert_eq!(Cmsgs::new(&buf, 0).count(), 0);
        assert_eq!(Cmsgs::new(&buf, HDR_LEN - 1).count(), 0);
    }

    #[test]
    fn socket_names_round_trip_and_short_ones_are_refused() {
        let v4: SocketAddr = "192.0.2.7:8472".parse().unwrap();
        let v6: SocketAddr = "[2001:db8::7]:8472".parse().unwrap();
        for a in [v4, v6] {
            let mut n = SockName::new();
            let len = n.set(a);
            assert_eq!(n.get(len), Some(a));
            assert_eq!(n.get(len - 1), None);
        }
        assert_eq!(SockName::new().get(SockName::LEN as libc::socklen_t), None, "no family");
    }

    proptest! {
        /// Whatever the kernel (or anything) wrote, the walk reads what libc's walk reads and
        /// never leaves the buffer.
        #[test]
        fn any_bytes_walk_as_libc_walks_them(
            bytes in proptest::collection::vec(any::<u8>(), CMSG_BUF_LEN),
            lens in proptest::collection::vec(0usize..40, 0..4),
            controllen in 0usize..80,
        ) {
            let mut buf = CmsgBuf::new();
            buf.0.copy_from_slice(&bytes);
            // Plant plausible headers so the walk goes past the first one now and then.
            let mut at = 0;
            for l in lens {
                if at + mem::size_of::<libc::cmsghdr>() > CMSG_BUF_LEN {
                    break;
                }
                // SAFETY: zeroed cmsghdr is valid; the write stays in the buffer (checked).
                let mut hdr: libc::cmsghdr = unsafe { mem::zeroed() };
                hdr.cmsg_len = l as _;
                // SAFETY: at + size_of::<cmsghdr>() <= CMSG_BUF_LEN, checked above.
                unsafe { ptr::write_unaligned(buf.0.as_mut_ptr().add(at).cast(), hdr) };
                at += align(l.max(1));
            }
            // Past the planted headers, a zero length ends both walks (libc's CMSG_ALIGN of a
            // random length would overflow).
            if at > 0 {
                buf.0[at.min(CMSG_BUF_LEN)..].fill(0);
            }
            let controllen = controllen.min(CMSG_BUF_LEN);
            prop_assert_eq!(ours(&buf, controllen), libc_walk(&mut buf, controllen));
        }
    }
}
