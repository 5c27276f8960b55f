//! The kernel edges of the data plane: the TUN device and its interface configuration.
//!
//! Opening a TUN device is one `ioctl(TUNSETIFF)` on `/dev/net/tun`; configuring it is a handful
//! of classic interface ioctls (`SIOCSIFMTU`, `SIOCSIFADDR`, `SIOCSIFNETMASK`, `SIOCSIFFLAGS`,
//! `SIOCADDRT`). They are written here by hand rather than taken from a crate because weft needs
//! the raw, blocking file descriptor (for batched reads and, later, `IFF_VNET_HDR`,
//! `IFF_MULTI_QUEUE` and `TUNSETOFFLOAD`) and nothing else; an async netlink stack would be a large
//! dependency for five synchronous calls. All of them need only `CAP_NET_ADMIN`.

use std::ffi::CStr;
use std::io;
use std::mem;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use ipnet::Ipv4Net;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Why the TUN device could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TunError {
    /// The interface name is empty, too long (15 bytes at most) or has a NUL.
    #[error("bad interface name {0:?}: 1 to 15 bytes, no NUL")]
    BadName(String),
    /// `/dev/net/tun` could not be opened.
    #[error("opening /dev/net/tun: {0} (weft needs CAP_NET_ADMIN and the tun module)")]
    Open(#[source] io::Error),
    /// An ioctl failed.
    #[error("{call} on {name}: {source}")]
    Ioctl {
        /// Which call.
        call: &'static str,
        /// The interface.
        name: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn ifreq(name: &str) -> Result<libc::ifreq, TunError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(TunError::BadName(name.to_owned()));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_USO4: libc::c_uint = 0x20;
const TUN_F_USO6: libc::c_uint = 0x40;

/// Which offloads a TUN device with `IFF_VNET_HDR` accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TunOffloads {
    /// Checksum offload plus TCP segmentation (TSO4/TSO6): reads may return TCP
    /// super-packets of up to 64 KiB, and writes may carry GRO-coalesced ones.
    pub tso: bool,
    /// UDP segmentation (USO4/USO6, Linux 6.2 and later).
    pub uso: bool,
}

/// Options for opening the TUN device.
#[derive(Clone, Copy, Debug, Default)]
pub struct TunOptions {
    /// `IFF_MULTI_QUEUE`: one fd per worker.
    pub multi_queue: bool,
    /// `IFF_VNET_HDR`: a `virtio_net_hdr` before every packet (offloads).
    pub vnet_hdr: bool,
}

/// One queue (file descriptor) of a TUN device, in blocking mode.
#[derive(Debug)]
pub struct Tun {
    fd: OwnedFd,
    name: String,
    vnet_hdr: bool,
}

impl Tun {
    /// Creates (or attaches to) the TUN device `name` with `IFF_TUN | IFF_NO_PI`.
    pub fn open(name: &str, opts: TunOptions) -> Result<Self, TunError> {
        let mut req = ifreq(name)?;
        let mut flags = IFF_TUN | IFF_NO_PI;
        if opts.multi_queue {
            flags |= IFF_MULTI_QUEUE;
        }
        if opts.vnet_hdr {
            flags |= IFF_VNET_HDR;
        }
        req.ifr_ifru.ifru_flags = flags;
        // SAFETY: a plain open(2) of a NUL-terminated path.
        let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(TunError::Open(io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by open(2) and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            return Err(TunError::Ioctl {
                call: "TUNSETIFF",
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: the kernel NUL-terminates ifr_name within IFNAMSIZ.
        let actual = unsafe { CStr::from_ptr(req.ifr_name.as_ptr()) };
        let tun = Self { fd, name: actual.to_string_lossy().into_owned(), vnet_hdr: opts.vnet_hdr };
        // Non-blocking, so a worker can drain a batch of queued packets and stop at the end.
        // SAFETY: fcntl on an fd we own.
        unsafe {
            let flags = libc::fcntl(tun.fd.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(tun.fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        if opts.vnet_hdr {
            // A persistent device keeps an old offload mask across opens; start from none.
            let _ = tun.set_offload(0);
        }
        Ok(tun)
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether packets carry a `virtio_net_hdr`.
    pub fn vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }

    /// `TUNSETOFFLOAD` with `TUN_F_*` flags.
    pub fn set_offload(&self, flags: libc::c_uint) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Turns on checksum offload and TSO, then tries to add USO (Linux ≥ 6.2) and carries on
    /// without it if the kernel refuses, as wireguard-go does. Only meaningful with
    /// `IFF_VNET_HDR`.
    pub fn enable_offloads(&self, want_uso: bool) -> TunOffloads {
        let base = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
        if self.set_offload(base).is_err() {
            let _ = self.set_offload(0);
            return TunOffloads::default();
        }
        let uso = want_uso && self.set_offload(base | TUN_F_USO4 | TUN_F_USO6).is_ok();
        if !uso {
            let _ = self.set_offload(base);
        }
        TunOffloads { tso: true, uso }
    }

    /// Reads one packet (blocking).
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Writes one packet.
    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for reads of buf.len() bytes.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Writes one packet gathered from `parts` (`writev`): a GRO super-packet is written
    /// straight from the receive buffers it lies in.
    pub fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let count = libc::c_int::try_from(parts.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: IoSlice is ABI-compatible with iovec on Unix (std guarantees it), and every
        // part is valid for reads of its length for the duration of the call.
        let n = unsafe { libc::writev(self.fd.as_raw_fd(), parts.as_ptr().cast(), count) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Waits until a packet can be read, or `timeout` passes (`Ok(false)`).
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        poll_readable(self.fd.as_raw_fd(), timeout)
    }
}

impl AsRawFd for Tun {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// `poll(2)` one fd for input.
pub fn poll_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

/// A datagram socket for interface ioctls.
struct CtlSocket(OwnedFd);

impl CtlSocket {
    fn new() -> io::Result<Self> {
        // SAFETY: a plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by socket(2).
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn ioctl<T>(
        &self,
        call: &'static str,
        name: &str,
        req: libc::c_ulong,
        arg: &mut T,
    ) -> Result<(), TunError> {
        // SAFETY: every caller passes the struct type the request expects.
        if unsafe { libc::ioctl(self.0.as_raw_fd(), req, arg as *mut T) } < 0 {
            return Err(TunError::Ioctl {
                call,
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(addr).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; sockaddr is the generic view.
    unsafe { mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ctl_error<'a>(name: &'a str, call: &'static str) -> impl FnOnce(io::Error) -> TunError + 'a {
    move |source| TunError::Ioctl { call, name: name.to_owned(), source }
}

/// Sets an interface's MTU.
pub fn set_mtu(name: &str, mtu: u32) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_mtu = libc::c_int::try_from(mtu).unwrap_or(libc::c_int::MAX);
    s.ioctl("SIOCSIFMTU", name, libc::SIOCSIFMTU, &mut req)
}

/// Brings an interface up.
pub fn set_up(name: &str) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    s.ioctl("SIOCGIFFLAGS", name, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    s.ioctl("SIOCSIFFLAGS", name, libc::SIOCSIFFLAGS, &mut req)
}

/// Sets the interface's (primary) IPv4 address and prefix, replacing the previous one.
pub fn set_ipv4(name: &str, addr: Ipv4Net) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr.addr());
    s.ioctl("SIOCSIFADDR", name, libc::SIOCSIFADDR, &mut req)?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(addr.netmask());
    s.ioctl("SIOCSIFNETMASK", name, libc::SIOCSIFNETMASK, &mut req)
}

/// Adds a route to `dst` through the interface (no gateway). An existing route is fine.
pub fn add_route(name: &str, dst: Ipv4Net) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let dev = std::ffi::CString::new(name).map_err(|_| TunError::BadName(name.to_owned()))?;
    // SAFETY: rtentry is plain old data; all-zero is a valid value.
    let mut rt: libc::rtentry = unsafe { mem::zeroed() };
    rt.rt_dst = sockaddr_in(dst.network());
    rt.rt_genmask = sockaddr_in(dst.netmask());
    rt.rt_flags = libc::RTF_UP;
    rt.rt_dev = dev.as_ptr().cast_mut();
    match s.ioctl("SIOCADDRT", name, libc::SIOCADDRT, &mut rt) {
        Err(TunError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
            Ok(())
        }
        other => other,
    }
}

/// Reads an interface's MTU from sysfs.
pub fn mtu_of(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked_before_any_syscall() {
        assert!(matches!(ifreq(""), Err(TunError::BadName(_))));
        assert!(matches!(ifreq("a-name-far-too-long"), Err(TunError::BadName(_))));
        assert!(matches!(ifreq("we\0ft"), Err(TunError::BadName(_))));
        assert!(ifreq("weft0").is_ok());
    }
}
