//! The kernel edges of the data plane: the TUN device and its interface configuration.
//!
//! Opening a TUN device is one `ioctl(TUNSETIFF)` on `/dev/net/tun`; configuring it is a handful
//! of classic interface ioctls (`SIOCSIFMTU`, `SIOCSIFADDR`, `SIOCSIFNETMASK`, `SIOCSIFFLAGS`,
//! `SIOCADDRT`). They are written here by hand rather than taken from a crate because weft needs
//! the raw, blocking file descriptor (for batched reads, `IFF_VNET_HDR`, `IFF_MULTI_QUEUE` and
//! `TUNSETOFFLOAD`, all used) and nothing else; an async netlink stack would be a large
//! dependency for a handful of synchronous calls. All of them need only `CAP_NET_ADMIN`.
//! Reading the configuration back for drift repair ([`observe_link`]: flags, MTU, addresses,
//! routes) needs no privilege.

use std::ffi::CStr;
use std::io;
use std::mem;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use ipnet::Ipv4Net;

use super::link::{self, ObservedLink};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `TUNSETIFF` fails with `EBUSY` if the device exists (create only, never attach).
const IFF_TUN_EXCL: libc::c_short = 0x8000u16 as libc::c_short;

/// Why the TUN device could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TunError {
    /// The interface name is empty, too long (15 bytes at most) or has a NUL.
    #[error("bad interface name {0:?}: 1 to 15 bytes, no NUL")]
    BadName(String),
    /// `/dev/net/tun` could not be opened.
    #[error("opening /dev/net/tun: {0} (weft needs CAP_NET_ADMIN and the tun module)")]
    Open(#[source] io::Error),
    /// The device is attached by another process, or appeared while weft was creating it.
    #[error("TUN device {name} is in use by another process{}", queues.map_or_else(String::new, |q| format!(" ({q} queues attached)")))]
    InUse {
        /// The interface.
        name: String,
        /// Queues attached, when the kernel said.
        queues: Option<u32>,
    },
    /// An interface of that name exists and is no TUN device.
    #[error("interface {0} exists and is not a TUN device")]
    NotTun(String),
    /// Asking the kernel about the interface (`RTM_GETLINK`) failed.
    #[error("RTM_GETLINK {name}: {source}")]
    Netlink {
        /// The interface.
        name: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Reading the interface's state (its addresses, the route table) failed.
    #[error("reading {what} of {name}: {source}")]
    Observe {
        /// What was being read.
        what: &'static str,
        /// The interface.
        name: String,
        /// The error.
        #[source]
        source: io::Error,
    },
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
pub(crate) struct TunOffloads {
    /// Checksum offload plus TCP segmentation (TSO4/TSO6): reads may return TCP
    /// super-packets of up to 64 KiB, and writes may carry GRO-coalesced ones.
    pub(crate) tso: bool,
    /// UDP segmentation (USO4/USO6, Linux 6.2 and later).
    pub(crate) uso: bool,
}

/// Options for opening the TUN device.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TunOptions {
    /// `IFF_MULTI_QUEUE`: one fd per worker.
    pub(crate) multi_queue: bool,
    /// `IFF_VNET_HDR`: a `virtio_net_hdr` before every packet (offloads).
    pub(crate) vnet_hdr: bool,
    /// `IFF_TUN_EXCL`: create the device, and fail with [`TunError::InUse`] if it exists.
    pub(crate) exclusive: bool,
}

/// One queue (file descriptor) of a TUN device, in blocking mode.
#[derive(Debug)]
pub(crate) struct Tun {
    fd: OwnedFd,
    name: String,
    vnet_hdr: bool,
}

impl Tun {
    /// Creates (or attaches to) the TUN device `name` with `IFF_TUN | IFF_NO_PI`.
    pub(crate) fn open(name: &str, opts: TunOptions) -> Result<Self, TunError> {
        let mut req = ifreq(name)?;
        let mut flags = IFF_TUN | IFF_NO_PI;
        if opts.multi_queue {
            flags |= IFF_MULTI_QUEUE;
        }
        if opts.vnet_hdr {
            flags |= IFF_VNET_HDR;
        }
        if opts.exclusive {
            flags |= IFF_TUN_EXCL;
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
            let source = io::Error::last_os_error();
            if opts.exclusive && source.raw_os_error() == Some(libc::EBUSY) {
                return Err(TunError::InUse { name: name.to_owned(), queues: None });
            }
            return Err(TunError::Ioctl { call: "TUNSETIFF", name: name.to_owned(), source });
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
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Whether packets carry a `virtio_net_hdr`.
    pub(crate) fn vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }

    /// `TUNSETOFFLOAD` with `TUN_F_*` flags.
    pub(crate) fn set_offload(&self, flags: libc::c_uint) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Turns on checksum offload and TSO, then tries to add USO (Linux ≥ 6.2) and carries on
    /// without it if the kernel refuses, as wireguard-go does. Only meaningful with
    /// `IFF_VNET_HDR`.
    pub(crate) fn enable_offloads(&self, want_uso: bool) -> TunOffloads {
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
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Writes one packet.
    pub(crate) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for reads of buf.len() bytes.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Writes one packet gathered from `parts` (`writev`): a GRO super-packet is written
    /// straight from the receive buffers it lies in.
    pub(crate) fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let count = libc::c_int::try_from(parts.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: IoSlice is ABI-compatible with iovec on Unix (std guarantees it), and every
        // part is valid for reads of its length for the duration of the call.
        let n = unsafe { libc::writev(self.fd.as_raw_fd(), parts.as_ptr().cast(), count) };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }

    /// Waits until a packet can be read, or `timeout` passes (`Ok(false)`).
    pub(crate) fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        poll_readable(self.fd.as_raw_fd(), timeout)
    }
}

impl AsRawFd for Tun {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// `poll(2)` one fd for input.
pub(crate) fn poll_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
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

/// Sleeps until either of two descriptors is readable or `timeout` passes (one `poll(2)`); an
/// error or a signal just ends the wait early, and the caller looks at both again.
pub(crate) fn poll_either(a: RawFd, b: RawFd, timeout: Duration) {
    let mut fds = [
        libc::pollfd { fd: a, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: b, events: libc::POLLIN, revents: 0 },
    ];
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: two valid pollfds in a live array whose length is passed.
    unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
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
pub(crate) fn set_mtu(name: &str, mtu: u32) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_mtu = libc::c_int::try_from(mtu).unwrap_or(libc::c_int::MAX);
    s.ioctl("SIOCSIFMTU", name, libc::SIOCSIFMTU, &mut req)
}

/// Brings an interface up.
pub(crate) fn set_up(name: &str) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    s.ioctl("SIOCGIFFLAGS", name, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    s.ioctl("SIOCSIFFLAGS", name, libc::SIOCSIFFLAGS, &mut req)
}

/// Sets the interface's (primary) IPv4 address and prefix, replacing the previous one.
pub(crate) fn set_ipv4(name: &str, addr: Ipv4Net) -> Result<(), TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr.addr());
    s.ioctl("SIOCSIFADDR", name, libc::SIOCSIFADDR, &mut req)?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(addr.netmask());
    s.ioctl("SIOCSIFNETMASK", name, libc::SIOCSIFNETMASK, &mut req)
}

/// Adds a route to `dst` through the interface (no gateway). An existing route is fine.
pub(crate) fn add_route(name: &str, dst: Ipv4Net) -> Result<(), TunError> {
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

/// The interface's link state as the kernel reports it now, for drift repair
/// ([`super::link`]): `IFF_UP` (`SIOCGIFFLAGS`), the MTU (`SIOCGIFMTU`: of this network
/// namespace, whatever sysfs is mounted), its IPv4 addresses (`getifaddrs`) and the main table's
/// routes through it (`/proc/net/route`, which shows this thread's network namespace).
pub(crate) fn observe_link(name: &str) -> Result<ObservedLink, TunError> {
    let s = CtlSocket::new().map_err(ctl_error(name, "socket"))?;
    let mut req = ifreq(name)?;
    s.ioctl("SIOCGIFFLAGS", name, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    let mut req = ifreq(name)?;
    s.ioctl("SIOCGIFMTU", name, libc::SIOCGIFMTU, &mut req)?;
    // SAFETY: SIOCGIFMTU filled the mtu member.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    let observe = |what| move |source| TunError::Observe { what, name: name.to_owned(), source };
    let addresses = nix::ifaddrs::getifaddrs()
        .map_err(|e| observe("the addresses")(io::Error::from(e)))?
        .filter(|ifa| ifa.interface_name == name)
        .filter_map(|ifa| {
            let addr = ifa.address?.as_sockaddr_in()?.ip();
            // An address without a netmask is a host address.
            let mask = ifa.netmask.and_then(|m| m.as_sockaddr_in().map(|m| m.ip()));
            let prefix = mask.map_or(32, |m| u32::from(m).leading_ones());
            Ipv4Net::new(addr, u8::try_from(prefix).ok()?).ok()
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/route")
        .map_err(observe("the routes (/proc/net/route)"))?;
    Ok(ObservedLink {
        up: flags & libc::IFF_UP as libc::c_short != 0,
        mtu: u32::try_from(mtu).unwrap_or(0),
        addresses,
        routes: link::device_routes(&table, name),
    })
}

/// What the kernel says about the interface a TUN device would be opened as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TunStatus {
    /// No interface has the name.
    Absent,
    /// A TUN/TAP device with no queue attached (a persistent device nobody has open).
    Detached,
    /// A TUN/TAP device with queues attached: another process has it open. `None` when the
    /// kernel does not report queues (before Linux 4.15), then any existing device counts.
    Attached(Option<u32>),
    /// An interface of another kind.
    NotTun,
}

/// Asks the kernel (`RTM_GETLINK`, in this network namespace; needs no privilege) whether the
/// TUN device `name` exists and how many queues are attached to it. A non-persistent TUN
/// device exists only while a process holds a queue; a persistent one may have none.
pub(crate) fn tun_status(name: &str) -> Result<TunStatus, TunError> {
    use socket2::{Domain, Protocol, Socket, Type};
    use std::io::Read as _;
    ifreq(name)?;
    let err = |source| TunError::Netlink { name: name.to_owned(), source };
    let sock = Socket::new(
        Domain::from(libc::AF_NETLINK),
        Type::RAW,
        Some(Protocol::from(libc::NETLINK_ROUTE)),
    )
    .map_err(err)?;
    sock.set_read_timeout(Some(Duration::from_secs(2))).map_err(err)?;
    const SEQ: u32 = 1;
    sock.send(&netlink::getlink_request(name, SEQ)).map_err(err)?;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = (&sock).read(&mut buf).map_err(err)?;
        if let Some(status) = netlink::parse_getlink_reply(&buf[..n], SEQ).map_err(err)? {
            return Ok(status);
        }
    }
}

/// `RTM_GETLINK` request and reply, as bytes: pure, so the parser is tested on fixtures.
mod netlink {
    use std::io;

    use super::TunStatus;

    const NLMSG_HDR: usize = 16;
    const IFINFOMSG: usize = 16;
    const NLMSG_ERROR: u16 = 2;
    const RTM_GETLINK: u16 = 18;
    const RTM_NEWLINK: u16 = 16;
    const NLM_F_REQUEST: u16 = 1;
    // linux/if_link.h
    const IFLA_IFNAME: u16 = 3;
    const IFLA_LINKINFO: u16 = 18;
    const IFLA_INFO_KIND: u16 = 1;
    const IFLA_INFO_DATA: u16 = 2;
    const IFLA_TUN_PERSIST: u16 = 6;
    const IFLA_TUN_NUM_QUEUES: u16 = 8;
    const IFLA_TUN_NUM_DISABLED_QUEUES: u16 = 9;
    /// The nested and byte-order flags of an attribute type.
    const NLA_TYPE_MASK: u16 = 0x3fff;

    fn align4(n: usize) -> usize {
        n.div_ceil(4) * 4
    }

    /// A request for the link named `name` (by `IFLA_IFNAME`, index 0).
    pub(super) fn getlink_request(name: &str, seq: u32) -> Vec<u8> {
        let attr_len = 4 + name.len() + 1;
        let len = NLMSG_HDR + IFINFOMSG + align4(attr_len);
        let mut m = vec![0u8; len];
        m[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&RTM_GETLINK.to_ne_bytes());
        m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        m[8..12].copy_from_slice(&seq.to_ne_bytes());
        // ifinfomsg: family AF_UNSPEC, index 0: all zero.
        let a = NLMSG_HDR + IFINFOMSG;
        m[a..a + 2].copy_from_slice(&(attr_len as u16).to_ne_bytes());
        m[a + 2..a + 4].copy_from_slice(&IFLA_IFNAME.to_ne_bytes());
        m[a + 4..a + 4 + name.len()].copy_from_slice(name.as_bytes());
        m
    }

    fn u16_at(b: &[u8], at: usize) -> Option<u16> {
        Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
    }

    fn u32_at(b: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
    }

    /// The attributes in `b`: (type without flags, payload). Stops at the first malformed one.
    fn attrs(b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
        let mut at = 0;
        std::iter::from_fn(move || {
            let len = usize::from(u16_at(b, at)?);
            let kind = u16_at(b, at + 2)? & NLA_TYPE_MASK;
            let payload = b.get(at + 4..at.checked_add(len)?).filter(|_| len >= 4)?;
            at += align4(len);
            Some((kind, payload))
        })
    }

    fn bad(what: &str) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, format!("netlink reply: {what}"))
    }

    /// The status from a reply buffer to request `seq`: `Ok(None)` if the buffer holds no
    /// message for it (read again).
    pub(super) fn parse_getlink_reply(buf: &[u8], seq: u32) -> io::Result<Option<TunStatus>> {
        let mut at = 0;
        while let (Some(len), Some(kind), Some(msg_seq)) =
            (u32_at(buf, at), u16_at(buf, at + 4), u32_at(buf, at + 8))
        {
            let len = len as usize;
            let msg = buf.get(at..at.saturating_add(len)).filter(|_| len >= NLMSG_HDR);
            let Some(msg) = msg else { return Err(bad("truncated message")) };
            at += align4(len);
            if msg_seq != seq {
                continue;
            }
            match kind {
                NLMSG_ERROR => {
                    let errno = u32_at(msg, NLMSG_HDR).ok_or_else(|| bad("short error"))? as i32;
                    return match -errno {
                        0 => Err(bad("an ACK instead of a link")),
                        libc::ENODEV => Ok(Some(TunStatus::Absent)),
                        e => Err(io::Error::from_raw_os_error(e)),
                    };
                }
                RTM_NEWLINK => {
                    let body = msg.get(NLMSG_HDR + IFINFOMSG..).ok_or_else(|| bad("short link"))?;
                    return Ok(Some(link_status(body)));
                }
                _ => {}
            }
        }
        Ok(None)
    }

    /// The status from a link's attributes.
    fn link_status(attributes: &[u8]) -> TunStatus {
        let Some((_, info)) = attrs(attributes).find(|(k, _)| *k == IFLA_LINKINFO) else {
            return TunStatus::NotTun;
        };
        let kind = attrs(info).find(|(k, _)| *k == IFLA_INFO_KIND).map(|(_, v)| v);
        // The kind is NUL-terminated: "tun\0" (TAP devices too).
        if kind.map(|k| k.split(|b| *b == 0).next() == Some(b"tun")) != Some(true) {
            return TunStatus::NotTun;
        }
        let Some((_, data)) = attrs(info).find(|(k, _)| *k == IFLA_INFO_DATA) else {
            return TunStatus::Attached(None);
        };
        let (mut persist, mut queues, mut disabled) = (None, None, 0);
        for (k, v) in attrs(data) {
            match k {
                IFLA_TUN_PERSIST => persist = v.first().map(|b| *b != 0),
                IFLA_TUN_NUM_QUEUES => queues = u32_at(v, 0),
                IFLA_TUN_NUM_DISABLED_QUEUES => disabled = u32_at(v, 0).unwrap_or(0),
                _ => {}
            }
        }
        match (persist, queues) {
            (Some(true), Some(q)) if q.saturating_add(disabled) == 0 => TunStatus::Detached,
            (_, Some(q)) => TunStatus::Attached(Some(q.saturating_add(disabled))),
            (_, None) => TunStatus::Attached(None),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
            let mut a = Vec::new();
            a.extend(((4 + payload.len()) as u16).to_ne_bytes());
            a.extend(kind.to_ne_bytes());
            a.extend(payload);
            a.resize(align4(a.len()), 0);
            a
        }

        fn message(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
            let mut m = Vec::new();
            m.extend(((NLMSG_HDR + body.len()) as u32).to_ne_bytes());
            m.extend(kind.to_ne_bytes());
            m.extend(0u16.to_ne_bytes());
            m.extend(seq.to_ne_bytes());
            m.extend(0u32.to_ne_bytes());
            m.extend(body);
            m
        }

        fn newlink(seq: u32, kind: &[u8], data: Option<Vec<u8>>) -> Vec<u8> {
            let mut info = attr(IFLA_INFO_KIND, kind);
            if let Some(d) = data {
                info.extend(attr(IFLA_INFO_DATA | 0x8000, &d));
            }
            let mut body = vec![0u8; IFINFOMSG];
            body.extend(attr(IFLA_IFNAME, b"weft0\0"));
            body.extend(attr(IFLA_LINKINFO | 0x8000, &info));
            message(RTM_NEWLINK, seq, &body)
        }

        fn tun_data(persist: u8, queues: u32, disabled: u32) -> Vec<u8> {
            let mut d = attr(IFLA_TUN_PERSIST, &[persist]);
            d.extend(attr(IFLA_TUN_NUM_QUEUES, &queues.to_ne_bytes()));
            d.extend(attr(IFLA_TUN_NUM_DISABLED_QUEUES, &disabled.to_ne_bytes()));
            d
        }

        #[test]
        fn the_request_names_the_link() {
            let m = getlink_request("weft0", 7);
            assert_eq!(m.len(), 16 + 16 + 12);
            assert_eq!(u32_at(&m, 0), Some(44));
            assert_eq!(u16_at(&m, 4), Some(RTM_GETLINK));
            assert_eq!(u32_at(&m, 8), Some(7));
            let (k, v) = attrs(&m[32..]).next().unwrap();
            assert_eq!((k, v), (IFLA_IFNAME, &b"weft0\0"[..]));
        }

        #[test]
        fn replies_say_absent_detached_attached_or_not_tun() {
            let cases = [
                (newlink(1, b"tun\0", Some(tun_data(0, 2, 0))), TunStatus::Attached(Some(2))),
                (newlink(1, b"tun\0", Some(tun_data(1, 0, 0))), TunStatus::Detached),
                (newlink(1, b"tun\0", Some(tun_data(1, 0, 1))), TunStatus::Attached(Some(1))),
                (newlink(1, b"tun\0", Some(tun_data(1, 3, 0))), TunStatus::Attached(Some(3))),
                (newlink(1, b"tun\0", None), TunStatus::Attached(None)),
                (newlink(1, b"veth\0", None), TunStatus::NotTun),
                (message(NLMSG_ERROR, 1, &(-libc::ENODEV).to_ne_bytes()), TunStatus::Absent),
            ];
            for (reply, want) in cases {
                assert_eq!(parse_getlink_reply(&reply, 1).unwrap(), Some(want));
            }
            // No LINKINFO at all (a loopback, say).
            let mut body = vec![0u8; IFINFOMSG];
            body.extend(attr(IFLA_IFNAME, b"lo\0"));
            let lo = message(RTM_NEWLINK, 1, &body);
            assert_eq!(parse_getlink_reply(&lo, 1).unwrap(), Some(TunStatus::NotTun));
        }

        #[test]
        fn other_sequences_are_skipped_and_errors_reported() {
            let mut two = newlink(9, b"veth\0", None);
            two.extend(newlink(1, b"tun\0", Some(tun_data(0, 1, 0))));
            assert_eq!(parse_getlink_reply(&two, 1).unwrap(), Some(TunStatus::Attached(Some(1))));
            assert_eq!(parse_getlink_reply(&newlink(9, b"tun\0", None), 1).unwrap(), None);
            let eperm = message(NLMSG_ERROR, 1, &(-libc::EPERM).to_ne_bytes());
            let e = parse_getlink_reply(&eperm, 1).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        }

        #[test]
        fn garbage_never_panics() {
            let good = newlink(1, b"tun\0", Some(tun_data(1, 0, 0)));
            for cut in 0..good.len() {
                let _ = parse_getlink_reply(&good[..cut], 1);
            }
            let mut evil = good.clone();
            evil[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
            assert!(parse_getlink_reply(&evil, 1).is_err());
            let mut zero_attr = good.clone();
            zero_attr[32..34].copy_from_slice(&0u16.to_ne_bytes());
            let _ = parse_getlink_reply(&zero_attr, 1);
            for byte in 0..=255u8 {
                let _ = parse_getlink_reply(&[byte; 64], 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interface's MTU as sysfs says it: a second reading, independent of the ioctls.
    fn mtu_of(name: &str) -> Option<u32> {
        std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?.trim().parse().ok()
    }

    #[test]
    fn interface_names_are_checked_before_any_syscall() {
        assert!(matches!(ifreq(""), Err(TunError::BadName(_))));
        assert!(matches!(ifreq("a-name-far-too-long"), Err(TunError::BadName(_))));
        assert!(matches!(ifreq("we\0ft"), Err(TunError::BadName(_))));
        assert!(ifreq("weft0").is_ok());
    }

    #[test]
    fn the_link_state_is_read_back_without_privilege() {
        let lo = observe_link("lo").unwrap();
        assert_eq!(lo.mtu, mtu_of("lo").unwrap());
        if lo.up {
            let loopback: Ipv4Net = "127.0.0.1/8".parse().unwrap();
            assert!(lo.addresses.contains(&loopback), "{lo:?}");
        }
        assert!(
            matches!(observe_link("weftnosuch0"), Err(TunError::Ioctl { call: "SIOCGIFFLAGS", ref source, .. }) if source.raw_os_error() == Some(libc::ENODEV)),
        );
        assert!(matches!(observe_link(""), Err(TunError::BadName(_))));
    }

    #[test]
    fn a_name_nobody_uses_is_absent() {
        assert_eq!(tun_status("weftnosuch0").unwrap(), TunStatus::Absent);
        assert!(matches!(tun_status("lo"), Ok(TunStatus::NotTun)));
    }
}
