//! The TUN device: one `ioctl(TUNSETIFF)` on `/dev/net/tun` per queue, `TUNSETOFFLOAD`, and the
//! queue's blocking reads and writes. Its link, address and routes are configured over netlink
//! ([`super::netlink`]).
//!
//! Why by hand and not with the `tun` crate: `tun` (0.8.14, the latest, and 0.7) refuses more
//! than one queue (`Configuration::queues` is deprecated, "the queues will always be 1", and
//! any other number fails with `Error::InvalidQueuesNumber`), so `IFF_MULTI_QUEUE` cannot be
//! set and no second queue can be attached; it cannot pass `IFF_TUN_EXCL` either, which weft
//! uses never to attach to a device another process has open. (Its `vnet_hdr` option and
//! `ensure_root_privileges(false)` would do for the rest.) `tun-rs` has multi-queue, but only
//! `IFF_VNET_HDR` together with its own offload engine, where weft keeps its own. What is left
//! is small: the two ioctls, declared with nix's ioctl macros on libc's request codes and
//! flags (no numbers of weft's own), and `read`/`write`/`writev` through nix. Both ioctls
//! need only `CAP_NET_ADMIN`; weft checks for no root.

use std::ffi::CStr;
use std::io;
use std::mem;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;

// TUNSETIFF reads the ifreq (name, flags) and writes the device's name back into it.
nix::ioctl_readwrite_bad!(tunsetiff, libc::TUNSETIFF, libc::ifreq);
// TUNSETOFFLOAD takes its TUN_F_* mask by value.
nix::ioctl_write_int_bad!(tunsetoffload, libc::TUNSETOFFLOAD);
// TUNGETIFF writes the queue's device name and flags into an ifreq.
nix::ioctl_read_bad!(tungetiff, libc::TUNGETIFF, libc::ifreq);

/// A `TUNSETIFF` flag (libc's are `c_int`; the ifreq member is a `c_short`, and every TUN flag
/// fits in its 16 bits).
fn tun_flag(flag: libc::c_int) -> libc::c_short {
    flag as u16 as libc::c_short
}

/// Why the TUN device could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TunError {
    /// The interface name is refused ([`check_tun_name`]).
    #[error("bad TUN device name {name:?}: {why}")]
    BadName {
        /// The name.
        name: String,
        /// Why it is refused.
        why: String,
    },
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
    // Also refuses a template (`weft%d`), which would make the kernel name the device.
    check_tun_name(name).map_err(|why| TunError::BadName { name: name.to_owned(), why })?;
    let bytes = name.as_bytes();
    if bytes.len() >= libc::IFNAMSIZ {
        return Err(TunError::BadName { name: name.to_owned(), why: "too long".into() });
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

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
        let mut flags = libc::IFF_TUN | libc::IFF_NO_PI;
        if opts.multi_queue {
            flags |= libc::IFF_MULTI_QUEUE;
        }
        if opts.vnet_hdr {
            flags |= libc::IFF_VNET_HDR;
        }
        if opts.exclusive {
            // TUNSETIFF fails with EBUSY if the device exists (create only, never attach).
            flags |= libc::IFF_TUN_EXCL;
        }
        req.ifr_ifru.ifru_flags = tun_flag(flags);
        // Non-blocking, so a worker can drain a batch of queued packets and stop at the end.
        let fd = open(
            c"/dev/net/tun",
            OFlag::O_RDWR | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
            Mode::empty(),
        )
        .map_err(|e| TunError::Open(e.into()))?;
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is; `fd` is open.
        if let Err(errno) = unsafe { tunsetiff(fd.as_raw_fd(), &mut req) } {
            if opts.exclusive && errno == nix::errno::Errno::EBUSY {
                return Err(TunError::InUse { name: name.to_owned(), queues: None });
            }
            let source = errno.into();
            return Err(TunError::Ioctl { call: "TUNSETIFF", name: name.to_owned(), source });
        }
        // SAFETY: the kernel NUL-terminates ifr_name within IFNAMSIZ.
        let actual = unsafe { CStr::from_ptr(req.ifr_name.as_ptr()) };
        let tun = Self { fd, name: actual.to_string_lossy().into_owned(), vnet_hdr: opts.vnet_hdr };
        if opts.vnet_hdr {
            // A persistent device keeps an old offload mask across opens; start from none.
            let _ = tun.set_offload(0);
        }
        Ok(tun)
    }

    /// Takes over a queue another process (or this one's previous image) opened: `TUNGETIFF`
    /// says it is a TUN queue, of which device, and whether it carries a `virtio_net_hdr`. Its
    /// offloads are left as they are.
    pub(crate) fn adopt(fd: OwnedFd) -> Result<Self, TunError> {
        // SAFETY: ifreq is plain old data; all-zero is a valid value.
        let mut req: libc::ifreq = unsafe { mem::zeroed() };
        // SAFETY: TUNGETIFF writes an ifreq, which `req` is; `fd` is open. On a descriptor
        // that is no TUN queue it fails (EBADFD/ENOTTY/EINVAL) and writes nothing.
        if let Err(errno) = unsafe { tungetiff(fd.as_raw_fd(), &mut req) } {
            let source = errno.into();
            return Err(TunError::Ioctl {
                call: "TUNGETIFF",
                name: "(handed over)".into(),
                source,
            });
        }
        // SAFETY: the kernel NUL-terminates ifr_name within IFNAMSIZ.
        let name = unsafe { CStr::from_ptr(req.ifr_name.as_ptr()) }.to_string_lossy().into_owned();
        // SAFETY: TUNGETIFF filled the flags member of the union.
        let flags = unsafe { req.ifr_ifru.ifru_flags };
        if flags & tun_flag(libc::IFF_TUN) == 0 {
            return Err(TunError::NotTun(name));
        }
        nix::fcntl::fcntl(
            fd.as_fd(),
            nix::fcntl::FcntlArg::F_SETFL(OFlag::O_RDWR | OFlag::O_NONBLOCK),
        )
        .map_err(|e| TunError::Ioctl {
            call: "F_SETFL",
            name: name.clone(),
            source: e.into(),
        })?;
        Ok(Self { fd, name, vnet_hdr: flags & tun_flag(libc::IFF_VNET_HDR) != 0 })
    }

    /// A second descriptor of this queue (to hand over), close-on-exec.
    pub(crate) fn duplicate(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
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
        let flags = libc::c_int::try_from(flags)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the fd is ours and open.
        unsafe { tunsetoffload(self.fd.as_raw_fd(), flags) }?;
        Ok(())
    }

    /// Turns on checksum offload and TSO, then tries to add USO (Linux ≥ 6.2) and carries on
    /// without it if the kernel refuses, as wireguard-go does. Only meaningful with
    /// `IFF_VNET_HDR`.
    pub(crate) fn enable_offloads(&self, want_uso: bool) -> TunOffloads {
        let base = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6;
        if self.set_offload(base).is_err() {
            let _ = self.set_offload(0);
            return TunOffloads::default();
        }
        let uso = want_uso && self.set_offload(base | libc::TUN_F_USO4 | libc::TUN_F_USO6).is_ok();
        if !uso {
            let _ = self.set_offload(base);
        }
        TunOffloads { tso: true, uso }
    }

    /// Reads one packet.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(nix::unistd::read(self.fd.as_fd(), buf)?)
    }

    /// Writes one packet.
    pub(crate) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        Ok(nix::unistd::write(self.fd.as_fd(), buf)?)
    }

    /// Writes one packet gathered from `parts` (`writev`): a GRO super-packet is written
    /// straight from the receive buffers it lies in.
    pub(crate) fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
        Ok(nix::sys::uio::writev(self.fd.as_fd(), parts)?)
    }
}

impl AsRawFd for Tun {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The longest interface name: `IFNAMSIZ` less its NUL.
pub const MAX_TUN_NAME: usize = 15;

/// Whether `name` can be weft's TUN device: one fixed name of 1 to [`MAX_TUN_NAME`] bytes of
/// ASCII letters, digits and punctuation, not `.` or `..`, without `/`, `:` or `%`. Refused,
/// with why (for `--tun-name`, at parsing):
/// - `%`: the kernel takes `%d` as a template and names the device itself (`weft%d` makes
///   `weft0`, `weft1`, …: with several queues, one device per queue, each queue's first
///   `TUNSETIFF` a new device), and any other `%` is an error. weft configures its device by
///   name (MTU, address, routes, drift repair), and finds a second weft on the same device by
///   it, so it takes one fixed name and never a template.
/// - what the kernel's `dev_valid_name` refuses: empty, longer than 15 bytes, `.`, `..`, `/`,
///   `:`, whitespace;
/// - anything else outside printable ASCII (control characters, non-ASCII, which the kernel
///   would mostly take, and which no tool shows reliably).
///
/// # Errors
/// Why the name is refused.
pub fn check_tun_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TUN_NAME {
        return Err(format!(
            "an interface name is 1 to {MAX_TUN_NAME} bytes; this one is {}",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} is no interface name"));
    }
    if name.contains('%') {
        return Err("'%' makes it a kernel name template (weft%d names one device per queue: \
                    weft0, weft1, ...); weft needs one fixed name, such as weft0"
            .into());
    }
    if let Some(c) = name.chars().find(|c| matches!(c, '/' | ':')) {
        return Err(format!("the kernel refuses {c:?} in an interface name"));
    }
    if name.chars().any(char::is_whitespace) {
        return Err("the kernel refuses whitespace in an interface name".into());
    }
    if !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("use ASCII letters, digits and punctuation only".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_are_checked_before_any_syscall() {
        for bad in ["", "a-name-far-too-long", "we\0ft", "weft%d"] {
            assert!(matches!(ifreq(bad), Err(TunError::BadName { .. })), "{bad:?}");
        }
        assert!(ifreq("weft0").is_ok());
    }
}
