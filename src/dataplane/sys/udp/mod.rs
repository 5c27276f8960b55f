//! Batched UDP sockets for the data plane: `sendmmsg`/`recvmmsg`, with UDP GSO (`UDP_SEGMENT`) and
//! UDP GRO (`UDP_GRO`) when the kernel has them. This is the only data-plane code that makes UDP
//! syscalls; [`raw`] opens the same socket over raw IP for the ipip backend (no GSO, no GRO).
//!
//! # Contract
//! - **Blocking, poll-based.** The file descriptor is `O_NONBLOCK`, but the API blocks:
//!   [`BatchSocket::recv_batch`] waits in `poll(POLLIN)` for at most its `timeout` (so a worker can
//!   look at a stop flag between calls) and then takes whatever is queued with one `recvmmsg`;
//!   [`BatchSocket::send_batch`] hands everything to the kernel, waiting for `POLLOUT` in slices of
//!   [`SEND_POLL`] when the send buffer is full, and gives up (returning a short count) after
//!   [`SEND_STALL_POLLS`] slices without progress.
//! - **One owner, no allocation after `open`.** A [`BatchSocket`] belongs to one worker thread
//!   (every I/O method takes `&mut self`); workers that share a port each open their own socket
//!   with `SO_REUSEPORT`. The socket owns only syscall scratch (`mmsghdr`, `iovec`, a socket
//!   address and control-message storage for [`MAX_BATCH`] messages), allocated once in
//!   [`BatchSocket::open`]. Packet buffers belong to the caller: a send borrows
//!   [`Transmit::contents`] for the duration of the call, a receive writes into the caller's
//!   buffers. Nothing is logged; counters are in [`UdpStats`].
//! - **Probed at open.** `getsockopt(SOL_UDP, UDP_SEGMENT)` succeeding means GSO is supported;
//!   `setsockopt(SOL_UDP, UDP_GRO, 1)` succeeding means GRO is on. Both are also switchable off by
//!   configuration ([`UdpConfig::gso`], [`UdpConfig::gro`]), because offloads have had kernel bugs
//!   (see docs/benchmarks.md, "Why every offload is switchable"). The result is
//!   [`BatchSocket::capabilities`], for the caller to log once.
//! - **Degrades at run time, for now.** When a GSO send fails with `EIO`, `EINVAL` or `EMSGSIZE`
//!   (a segment larger than the path MTU, an IPsec route, or on older kernels an egress device
//!   without checksum offload; see [`gso_retry`]), GSO is turned off for this socket and
//!   the message is re-sent as single datagrams (as quinn-udp and wireguard-go do), counted in
//!   [`UdpStats::gso_fallbacks`]. Unlike them, GSO is not off for good: the first send at or
//!   after the retry time ([`UdpConfig::gso_retry`]: 30 s, doubling on each failed retry up to
//!   1 h) uses GSO again ([`UdpStats::gso_retries`]), and a GSO message the kernel accepts
//!   then turns it on ([`UdpStats::gso_recoveries`]). `now` comes from the caller, which reads
//!   its clock once per batch; the socket reads none. Without GSO, a [`Transmit`] with a
//!   `segment_size` is still delivered: it is split into one `mmsghdr` per datagram. Callers may
//!   therefore always coalesce with `worker::plan::coalesce_plan`, within
//!   [`BatchSocket::gso_limits`].
//! - **Never an equal tail, when asked.** Under [`TailRule::NeverEqual`]
//!   ([`UdpConfig::gso_tail`]) no GSO message goes to the kernel ending on a full segment: one
//!   that would gets [`gso_tail::PAD`] as its last segment (from a second `iovec`), or its
//!   first datagrams go alone ([`gso_tail`] decides). [`UdpStats`] counts the pads, the
//!   datagrams sent alone, and the GSO messages that end on a full segment (under
//!   [`TailRule::Any`]).
//! - **IPv4 only.** The socket is `AF_INET`; the underlay is IPv4.
//!
//! With GRO on, one received buffer can hold up to 64 datagrams of [`RecvMeta::segment_size`]
//! bytes (the last possibly shorter); every receive buffer must then be [`GRO_BUFFER_LEN`] bytes,
//! and the reader cuts it into datagrams (the worker's RX loop does, in place).

use std::io;
use std::mem;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr;
use std::time::Duration;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use self::msghdr::{CmsgBuf, Cmsgs, Encoder, SockName};
use crate::time::Instant;
use gso_retry::{GsoRetry, GsoRetryConfig, GsoState};
use gso_tail::{GsoLimits, Next, TailRule};
pub(crate) use gso_tail::{MAX_GSO_BYTES, MAX_GSO_SEGMENTS};

pub(crate) mod gso_retry;
pub mod gso_tail;
mod msghdr;
mod raw;

/// The most messages one `sendmmsg`/`recvmmsg` call carries; the socket's scratch is this big.
pub(crate) const MAX_BATCH: usize = 64;
/// The size every receive buffer must have when GRO is on (a coalesced buffer is up to 64 KiB).
pub(crate) const GRO_BUFFER_LEN: usize = 65536;
/// How long [`BatchSocket::send_batch`] waits for `POLLOUT` per slice.
pub(crate) const SEND_POLL: Duration = Duration::from_millis(10);
/// How many [`SEND_POLL`] slices without progress before [`BatchSocket::send_batch`] gives up.
pub(crate) const SEND_STALL_POLLS: u32 = 10;

/// `SO_SNDBUFFORCE` and `SO_RCVBUFFORCE` from the generic `asm/socket.h` (x86, arm, riscv);
/// the `libc` crate does not export them for glibc targets.
const SO_SNDBUFFORCE: libc::c_int = 32;
const SO_RCVBUFFORCE: libc::c_int = 33;

/// How to open a [`BatchSocket`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UdpConfig {
    /// The local address (IPv4 or IPv6: the socket's family follows it); port 0 picks an
    /// ephemeral port.
    pub(crate) bind: SocketAddr,
    /// `SO_REUSEPORT`: several sockets (one per worker) on the same port. Only sockets of the
    /// same effective UID can join the group; without it, no other socket can bind the port
    /// (`SO_REUSEADDR` is never set; see [`BatchSocket::open`]).
    pub(crate) reuse_port: bool,
    /// Use UDP GSO (`UDP_SEGMENT`) for sends when the kernel supports it.
    pub(crate) gso: bool,
    /// Turn on UDP GRO (`UDP_GRO`) for receives when the kernel supports it.
    pub(crate) gro: bool,
    /// When GSO is tried again after a GSO send failed (see [`gso_retry`]).
    pub(crate) gso_retry: GsoRetryConfig,
    /// How GSO messages may end: [`TailRule::NeverEqual`] on kernels whose GSO mangles one
    /// that ends on a full segment (see [`gso_tail`]).
    pub(crate) gso_tail: TailRule,
    /// `SO_RCVBUF`/`SO_SNDBUF`, then `SO_RCVBUFFORCE`/`SO_SNDBUFFORCE` (which need
    /// `CAP_NET_ADMIN` and are skipped without it); 0 keeps the kernel's defaults.
    pub(crate) buffer_bytes: usize,
}

impl UdpConfig {
    /// Binds `bind`, with GSO and GRO on, no `SO_REUSEPORT`, GSO retried after the default
    /// backoff, and 7 MiB socket buffers (the size wireguard-go settled on).
    pub(crate) fn new(bind: impl Into<SocketAddr>) -> Self {
        Self {
            bind: bind.into(),
            reuse_port: false,
            gso: true,
            gro: true,
            gso_retry: GsoRetryConfig::default(),
            gso_tail: TailRule::Any,
            buffer_bytes: 7 << 20,
        }
    }
}

/// What a socket found at open: the offloads in effect and the buffer sizes the kernel granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// GSO was asked for and `UDP_SEGMENT` is supported.
    pub(crate) gso: bool,
    /// GRO was asked for and `UDP_GRO` was turned on.
    pub(crate) gro: bool,
    /// Datagrams per GSO send: [`MAX_GSO_SEGMENTS`] with GSO, 1 without.
    pub(crate) max_gso_segments: usize,
    /// `SO_RCVBUF` as read back (the kernel doubles what is set, for bookkeeping).
    pub(crate) recv_buffer: usize,
    /// `SO_SNDBUF` as read back.
    pub(crate) send_buffer: usize,
}

/// Counters of the rare events on a socket; read them with [`BatchSocket::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct UdpStats {
    /// GSO sends that failed with `EIO`/`EINVAL`/`EMSGSIZE` and were re-sent as single
    /// datagrams; each turned GSO off until its retry time.
    pub(crate) gso_fallbacks: u64,
    /// The last such failure.
    pub(crate) gso_last_failure: Option<GsoFailure>,
    /// Times the retry time came and GSO was used again.
    pub(crate) gso_retries: u64,
    /// Retries that a GSO send confirmed: GSO works again.
    pub(crate) gso_recoveries: u64,
    /// `sendmmsg` calls that sent at least one message.
    pub(crate) send_calls: u64,
    /// `recvmmsg` calls that received at least one message.
    pub(crate) recv_calls: u64,
    /// [`BatchSocket::send_batch`] calls that gave up on a full send buffer.
    pub(crate) send_stalls: u64,
    /// GSO messages sent with [`gso_tail::PAD`] as their last segment
    /// ([`TailRule::NeverEqual`]).
    pub(crate) gso_tail_pads: u64,
    /// Datagrams sent on their own ahead of the rest of their message under
    /// [`TailRule::NeverEqual`], so that no GSO message ended on a full segment.
    pub(crate) gso_tail_singles: u64,
    /// GSO messages sent whose last datagram is as long as the segment size (none under
    /// [`TailRule::NeverEqual`]).
    pub(crate) gso_equal_tails: u64,
}

/// A GSO send that failed in a way single datagrams avoid (see [`UdpStats::gso_fallbacks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GsoFailure {
    /// `EIO`, `EINVAL` or `EMSGSIZE`.
    pub(crate) errno: i32,
    /// Where the message was going.
    pub(crate) dst: SocketAddr,
}

/// One message to send: a datagram, or with `segment_size` several.
#[derive(Clone, Copy, Debug)]
pub struct Transmit<'a> {
    /// Where to (of the socket's family).
    pub(crate) dst: SocketAddr,
    /// The payload: one datagram, or with `segment_size` several back to back.
    pub(crate) contents: &'a [u8],
    /// `contents` holds datagrams of this many bytes, back to back, the last possibly shorter;
    /// sent as one GSO message (or split, without GSO). At most [`MAX_GSO_SEGMENTS`] datagrams
    /// and [`MAX_GSO_BYTES`] in all.
    pub(crate) segment_size: Option<u16>,
}

/// What [`BatchSocket::recv_batch`] says about one filled buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvMeta {
    /// The sender.
    pub(crate) src: SocketAddr,
    /// Bytes in the buffer: one datagram, or with `segment_size` several. 0 when `truncated`.
    pub(crate) len: usize,
    /// From the `UDP_GRO` control message: the buffer holds datagrams of this size back to back,
    /// the last possibly shorter.
    pub(crate) segment_size: Option<usize>,
    /// The message did not fit its buffer (`MSG_TRUNC`); it is dropped (`len` is 0) and the
    /// caller should count it.
    pub(crate) truncated: bool,
}

impl Default for RecvMeta {
    fn default() -> Self {
        Self {
            src: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
            len: 0,
            segment_size: None,
            truncated: false,
        }
    }
}

/// Why a [`Transmit`] was refused before any syscall.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransmitError {
    /// The destination port is 0.
    #[error("destination port 0")]
    ZeroPort,
    /// `segment_size` is `Some(0)`.
    #[error("segment size 0")]
    ZeroSegmentSize,
    /// More datagrams than [`MAX_GSO_SEGMENTS`].
    #[error("{segments} segments, at most {MAX_GSO_SEGMENTS}")]
    TooManySegments {
        /// How many the contents hold.
        segments: usize,
    },
    /// More bytes than [`MAX_GSO_BYTES`] in a GSO message.
    #[error("{len} bytes in a segmented transmit, at most {MAX_GSO_BYTES}")]
    TooLarge {
        /// The contents' length.
        len: usize,
    },
}

/// Why a UDP operation failed.
///
/// [`UdpError::Send`] and [`UdpError::InvalidTransmit`] concern one message: count it as a drop
/// and carry on with the rest. The others are about the socket itself.
#[derive(Debug, thiserror::Error)]
pub enum UdpError {
    /// `socket()` failed.
    #[error("creating a UDP socket: {0}")]
    Socket(#[source] io::Error),
    /// `socket()` of a raw IP socket (the ipip backend's) failed.
    #[error("creating a raw IP socket for the ipip backend: {0}{hint}", hint = if .0.raw_os_error() == Some(libc::EPERM) { " (raw IP sockets need CAP_NET_RAW, beside CAP_NET_ADMIN: docs/install.md)" } else { "" })]
    RawSocket(io::Error),
    /// A socket option could not be set.
    #[error("setting {option} on a UDP socket: {source}")]
    SetOption {
        /// Which option.
        option: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// `bind()` failed.
    #[error("binding UDP {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// `getsockname()` failed or did not give an IP address.
    #[error("reading the UDP socket's local address: {0}")]
    LocalAddr(#[source] io::Error),
    /// `poll()` failed.
    #[error("poll on a UDP socket: {0}")]
    Poll(#[source] io::Error),
    /// `recvmmsg()` failed.
    #[error("recvmmsg: {0}")]
    Recv(#[source] io::Error),
    /// `sendmmsg()` failed on message `sent`; the `sent` messages before it went out (and, if it
    /// was being split for want of GSO, maybe some of its datagrams). Skip it (count a drop) and
    /// send the rest again.
    #[error("sendmmsg: message {sent} of the batch: {source}")]
    Send {
        /// Messages at the front of the batch that were sent.
        sent: usize,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A [`Transmit`] was malformed; nothing of the batch was sent.
    #[error("transmit {index} of the batch: {reason}")]
    InvalidTransmit {
        /// Its index in the batch.
        index: usize,
        /// What is wrong.
        reason: TransmitError,
    },
    /// With GRO on, every receive buffer must be [`GRO_BUFFER_LEN`] bytes.
    #[error("receive buffer {index} has {len} bytes; with UDP GRO it needs {GRO_BUFFER_LEN}")]
    BufferTooSmall {
        /// The buffer's index.
        index: usize,
        /// Its length.
        len: usize,
    },
}

impl UdpError {
    /// True when the error is about one message, not the socket: count a drop and go on.
    #[cfg(test)]
    pub(crate) fn is_per_message(&self) -> bool {
        matches!(self, Self::Send { .. } | Self::InvalidTransmit { .. })
    }
}

/// Syscall scratch for [`MAX_BATCH`] messages. The pointers inside `hdrs` are rewritten before
/// every syscall and never read otherwise; between calls they dangle harmlessly.
struct Scratch {
    hdrs: Box<[libc::mmsghdr]>,
    /// Each entry's data: one `iovec`, and on send a second one for [`gso_tail::PAD`].
    iovs: Box<[[libc::iovec; 2]]>,
    names: Box<[SockName]>,
    cmsgs: Box<[CmsgBuf]>,
    /// Send only: for each entry, which message it belongs to and where in its contents it ends.
    origin: Box<[(usize, usize)]>,
    /// Send only: what each entry is, for [`UdpStats`] once the kernel took it.
    shapes: Box<[Shape]>,
}

/// What one send entry is, as [`UdpStats`] counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// A datagram, or a GSO message ending on a shorter datagram.
    Plain,
    /// A GSO message ending on a full segment.
    EqualTail,
    /// A GSO message with the pad as its last segment.
    Padded,
    /// A datagram sent alone so that no GSO message ends on a full segment.
    Single,
}

// SAFETY: the raw pointers in `hdrs` and `iovs` are only dereferenced (by the kernel) during a
// syscall made through `&mut BatchSocket`, after being pointed at memory that the call borrows;
// nothing reads them between calls, so moving the scratch to another thread is sound.
unsafe impl Send for Scratch {}

impl Scratch {
    fn new() -> Self {
        // SAFETY: mmsghdr is plain old data; all-zero (null pointers, zero lengths) is a valid
        // value.
        let zeroed = || unsafe { mem::zeroed() };
        Self {
            hdrs: (0..MAX_BATCH).map(|_| zeroed()).collect(),
            iovs: (0..MAX_BATCH)
                .map(|_| [libc::iovec { iov_base: ptr::null_mut(), iov_len: 0 }; 2])
                .collect(),
            names: (0..MAX_BATCH).map(|_| SockName::new()).collect(),
            cmsgs: vec![CmsgBuf::new(); MAX_BATCH].into_boxed_slice(),
            origin: vec![(0, 0); MAX_BATCH].into_boxed_slice(),
            shapes: vec![Shape::Plain; MAX_BATCH].into_boxed_slice(),
        }
    }
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").field("entries", &self.hdrs.len()).finish()
    }
}

/// A UDP socket for one data-plane worker, with batched, offloaded sends and receives.
#[derive(Debug)]
pub(crate) struct BatchSocket {
    socket: Socket,
    local: SocketAddr,
    caps: Capabilities,
    /// GSO asked for, supported by the kernel, and not switched off ([`BatchSocket::set_gso`]);
    /// whether it is used now is also up to `gso_retry`.
    gso_wanted: bool,
    gso_retry: GsoRetry,
    gso_tail: TailRule,
    stats: UdpStats,
    scratch: Scratch,
    /// A raw IP socket ([`raw`], the ipip backend's): no ports.
    raw: bool,
    /// Test hook: this many GSO sends fail with `fail_gso_errno` without reaching the kernel.
    #[cfg(test)]
    fail_gso_sends: u32,
    #[cfg(test)]
    fail_gso_errno: i32,
}

impl BatchSocket {
    /// Opens and binds a socket, sizes its buffers and probes GSO and GRO (see the module docs).
    pub(crate) fn open(cfg: UdpConfig) -> Result<Self, UdpError> {
        let socket = Socket::new(Domain::for_address(cfg.bind), Type::DGRAM, Some(Protocol::UDP))
            .map_err(UdpError::Socket)?;
        let opt = |option: &'static str| move |source| UdpError::SetOption { option, source };
        // No SO_REUSEADDR, ever: on UDP it lets a socket of *any* user bind the same port
        // beside ours (on the wildcard or a specific address), and the newest or most specific
        // socket then receives the datagrams. SO_REUSEPORT only when asked (weft's own
        // workers): Linux admits a socket to a reuseport group only if it has the same
        // effective UID as the group's sockets, so another user still cannot join.
        if cfg.reuse_port {
            socket.set_reuse_port(true).map_err(opt("SO_REUSEPORT"))?;
        }
        size_buffers(&socket, cfg.buffer_bytes)?;
        if cfg.bind.is_ipv6() {
            // An IPv6 socket carries IPv6 only: the IPv4 sockets keep the port to themselves.
            socket.set_only_v6(true).map_err(opt("IPV6_V6ONLY"))?;
        }
        socket
            .bind(&SockAddr::from(cfg.bind))
            .map_err(|source| UdpError::Bind { addr: cfg.bind, source })?;
        Self::ready(socket, cfg)
    }

    /// Takes over a bound UDP socket another process (or this one's previous image) opened:
    /// its binding and buffers stay as they are; GSO and GRO are probed again as `cfg` asks.
    pub(crate) fn adopt(fd: std::os::fd::OwnedFd, cfg: UdpConfig) -> Result<Self, UdpError> {
        let socket = Socket::from(fd);
        let bad = |what: &str| {
            UdpError::Socket(io::Error::new(io::ErrorKind::InvalidInput, format!("not {what}")))
        };
        match (socket.r#type(), socket.protocol()) {
            (Ok(Type::DGRAM), Ok(Some(Protocol::UDP))) => {}
            // The ipip backend's: no GSO or GRO to probe (raw IP has neither).
            _ if Self::is_raw(&socket) => {
                return Self::ready(socket, UdpConfig { gso: false, gro: false, ..cfg });
            }
            _ => return Err(bad("a UDP socket or an ipip raw socket")),
        }
        Self::ready(socket, cfg)
    }

    /// A second descriptor of this socket (to hand over), close-on-exec.
    pub(crate) fn duplicate(&self) -> io::Result<std::os::fd::OwnedFd> {
        Ok(self.socket.try_clone()?.into())
    }

    /// The rest of [`BatchSocket::open`] and [`BatchSocket::adopt`]: non-blocking, the local
    /// address, the offloads probed.
    fn ready(socket: Socket, cfg: UdpConfig) -> Result<Self, UdpError> {
        let opt = |option: &'static str| move |source| UdpError::SetOption { option, source };
        socket.set_nonblocking(true).map_err(opt("O_NONBLOCK"))?;
        let local = socket
            .local_addr()
            .and_then(|a| {
                a.as_socket().ok_or_else(|| io::Error::from(io::ErrorKind::AddrNotAvailable))
            })
            .map_err(UdpError::LocalAddr)?;

        let raw = Self::is_raw(&socket);
        let gso = cfg.gso && getsockopt_int(&socket, libc::SOL_UDP, libc::UDP_SEGMENT).is_ok();
        let gro = cfg.gro && setsockopt_int(&socket, libc::SOL_UDP, libc::UDP_GRO, 1).is_ok();
        let caps = Capabilities {
            gso,
            gro,
            max_gso_segments: if gso { MAX_GSO_SEGMENTS } else { 1 },
            recv_buffer: socket.recv_buffer_size().map_err(opt("SO_RCVBUF"))?,
            send_buffer: socket.send_buffer_size().map_err(opt("SO_SNDBUF"))?,
        };
        Ok(Self {
            socket,
            local,
            caps,
            gso_wanted: gso,
            gso_retry: GsoRetry::new(cfg.gso_retry),
            gso_tail: cfg.gso_tail,
            stats: UdpStats::default(),
            scratch: Scratch::new(),
            raw,
            #[cfg(test)]
            fail_gso_sends: 0,
            #[cfg(test)]
            fail_gso_errno: 0,
        })
    }

    /// Hands `msgs` to the kernel, in order, with as few `sendmmsg` calls as [`MAX_BATCH`] and GSO
    /// allow, and returns how many messages (from the front) were sent: all of them, unless the
    /// send buffer stayed full for [`SEND_STALL_POLLS`] × [`SEND_POLL`] (then fewer; the rest are
    /// the caller's to drop or retry). `EINTR` is retried; `EIO`/`EINVAL`/`EMSGSIZE` on a GSO
    /// message turns GSO off until `now` plus the backoff and re-sends it split; once that time
    /// has come, this call uses GSO again (see the module docs). `now` is the caller's clock,
    /// read once per batch.
    ///
    /// # Errors
    /// [`UdpError::InvalidTransmit`] before sending anything if a message is malformed;
    /// [`UdpError::Send`] when a message fails (unreachable network, too big, ...): the messages
    /// before it were sent, and the caller can skip it and send the rest; [`UdpError::Poll`].
    pub(crate) fn send_batch(
        &mut self,
        msgs: &[Transmit<'_>],
        now: Instant,
    ) -> Result<usize, UdpError> {
        for (index, t) in msgs.iter().enumerate() {
            t.check(self.raw).map_err(|reason| UdpError::InvalidTransmit { index, reason })?;
        }
        if self.gso_wanted && self.gso_retry.poll(now) {
            self.stats.gso_retries += 1;
        }
        // The cursor: the first unsent message, and how much of it (split without GSO) is sent.
        let (mut msg, mut off) = (0, 0);
        let mut stalls = 0;
        while msg < msgs.len() {
            let (entries, first_gso) = self.fill_send(msgs, msg, off);
            match self.sendmmsg(entries) {
                Ok(sent) => {
                    self.stats.send_calls += 1;
                    stalls = 0;
                    // The kernel took a GSO message: if GSO was being retried, it works again.
                    if first_gso.is_some_and(|i| i < sent) && self.gso_retry.succeeded() {
                        self.stats.gso_recoveries += 1;
                    }
                    // sendmmsg sends at least one entry when it succeeds.
                    let sent = sent.clamp(1, entries);
                    self.count_shapes(sent);
                    let (m, end) = self.scratch.origin[sent - 1];
                    (msg, off) = if end == msgs[m].contents.len() { (m + 1, 0) } else { (m, end) };
                }
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) => {
                        if stalls == SEND_STALL_POLLS {
                            self.stats.send_stalls += 1;
                            return Ok(msg);
                        }
                        stalls += 1;
                        wait(self.socket.as_raw_fd(), libc::POLLOUT, SEND_POLL)?;
                    }
                    // The entry that failed is the first one (a failure after it would have
                    // made sendmmsg return a short count), so it is the GSO message at `msg`:
                    // its path refuses GSO (see gso_retry), and the next round sends it split.
                    // The message passed `check`, so EMSGSIZE is the path MTU, not its size.
                    Some(errno @ (libc::EIO | libc::EINVAL | libc::EMSGSIZE))
                        if first_gso == Some(0) =>
                    {
                        self.gso_retry.failed(now);
                        self.stats.gso_fallbacks += 1;
                        self.stats.gso_last_failure =
                            Some(GsoFailure { errno, dst: msgs[msg].dst });
                    }
                    _ => return Err(UdpError::Send { sent: msg, source: e }),
                },
            }
        }
        Ok(msgs.len())
    }

    /// Waits up to `timeout` for datagrams, then receives as many as are queued, up to
    /// `min(bufs.len(), metas.len(), MAX_BATCH)` messages, one per buffer: `metas[i]` describes
    /// `bufs[i]`. Returns how many buffers were filled; 0 on timeout or a signal, so the caller
    /// can check for a stop and call again. A zero `timeout` makes no `poll` call: one
    /// non-blocking `recvmmsg`, 0 if nothing is queued (the forwarding loops wait in their own
    /// epoll, `worker::Idle`).
    ///
    /// With GRO on, a buffer can hold several datagrams ([`RecvMeta::segment_size`]). A message that did not fit is reported with
    /// [`RecvMeta::truncated`] and `len` 0.
    ///
    /// # Errors
    /// [`UdpError::BufferTooSmall`] if GRO is on and a buffer is shorter than
    /// [`GRO_BUFFER_LEN`]; [`UdpError::Poll`], [`UdpError::Recv`].
    pub(crate) fn recv_batch<B: AsMut<[u8]>>(
        &mut self,
        bufs: &mut [B],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        let n = bufs.len().min(metas.len()).min(MAX_BATCH);
        if n == 0 {
            return Ok(0);
        }
        let s = &mut self.scratch;
        for (i, buf) in bufs[..n].iter_mut().enumerate() {
            let buf = buf.as_mut();
            if self.caps.gro && buf.len() < GRO_BUFFER_LEN {
                return Err(UdpError::BufferTooSmall { index: i, len: buf.len() });
            }
            s.iovs[i][0] = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
            let h = &mut s.hdrs[i];
            h.msg_hdr.msg_name = (&raw mut s.names[i]).cast();
            h.msg_hdr.msg_namelen = SockName::LEN as libc::socklen_t;
            h.msg_hdr.msg_iov = s.iovs[i].as_mut_ptr();
            h.msg_hdr.msg_iovlen = 1;
            h.msg_hdr.msg_control = s.cmsgs[i].as_mut_ptr();
            h.msg_hdr.msg_controllen = CmsgBuf::LEN as _;
            h.msg_hdr.msg_flags = 0;
            h.msg_len = 0;
        }
        let mut flags = libc::MSG_WAITFORONE;
        if timeout.is_zero() {
            flags |= libc::MSG_DONTWAIT;
        } else if !wait(self.socket.as_raw_fd(), libc::POLLIN, timeout)? {
            return Ok(0);
        }
        // SAFETY: the first `n` headers point at `n` live, writable buffers borrowed from `bufs`
        // (exclusive for this call) and at this socket's name and control storage, with their
        // lengths; recvmmsg writes only within those.
        let got = unsafe {
            libc::recvmmsg(
                self.socket.as_raw_fd(),
                s.hdrs.as_mut_ptr(),
                n as libc::c_uint,
                flags,
                ptr::null_mut(),
            )
        };
        if got < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EINTR | libc::EAGAIN) => Ok(0),
                _ => Err(UdpError::Recv(e)),
            };
        }
        let got = (got as usize).min(n);
        if got > 0 {
            self.stats.recv_calls += 1;
        }
        for (i, meta) in metas[..got].iter_mut().enumerate() {
            let h = &s.hdrs[i].msg_hdr;
            let truncated = h.msg_flags & libc::MSG_TRUNC != 0;
            let src = s.names[i]
                .get(h.msg_namelen)
                .unwrap_or(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)));
            *meta = RecvMeta {
                src,
                len: if truncated {
                    0
                } else {
                    (s.hdrs[i].msg_len as usize).min(s.iovs[i][0].iov_len)
                },
                segment_size: if truncated {
                    None
                } else {
                    gro_segment_size(Cmsgs::of(&s.cmsgs[i], h))
                },
                truncated,
            };
        }
        Ok(got)
    }

    /// Turns GSO on or off for later sends (tests drive the fallback with it); it stays off if
    /// the kernel does not support it. Turning it on forgets earlier failures and their backoff. Returns
    /// whether GSO is now on.
    #[cfg(test)]
    pub(crate) fn set_gso(&mut self, on: bool) -> bool {
        self.gso_wanted = on && self.caps.gso;
        if on {
            self.gso_retry = GsoRetry::new(self.gso_retry.config());
        }
        self.gso_enabled()
    }

    /// The offloads and buffer sizes found at open, for the caller to log once.
    pub(crate) fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Whether sends use GSO now: the probe, the configuration, [`BatchSocket::set_gso`] and a
    /// run-time failure (until its retry time) all have a say.
    pub(crate) fn gso_enabled(&self) -> bool {
        self.gso_wanted && self.gso_retry.uses_gso()
    }

    /// Where GSO stands after run-time failures and retries; `None` when GSO is not used at
    /// all (not asked for, not supported, or switched off).
    pub(crate) fn gso_state(&self) -> Option<GsoState> {
        self.gso_wanted.then(|| self.gso_retry.state())
    }

    /// Datagrams per [`Transmit`] worth coalescing now: [`MAX_GSO_SEGMENTS`] with GSO on, 1 off.
    pub(crate) fn max_gso_segments(&self) -> usize {
        if self.gso_enabled() { MAX_GSO_SEGMENTS } else { 1 }
    }

    /// How big a [`Transmit`] to lay out now: [`BatchSocket::max_gso_segments`] and
    /// [`MAX_GSO_BYTES`], less the room the pad needs under [`TailRule::NeverEqual`]. Larger
    /// ones are still sent, partly as single datagrams.
    pub(crate) fn gso_limits(&self) -> GsoLimits {
        self.gso_tail.limits(self.max_gso_segments())
    }

    /// The bound address (with the port the kernel picked, if 0 was asked for).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The socket's counters.
    pub(crate) fn stats(&self) -> UdpStats {
        self.stats
    }

    /// Test hook: the next `count` GSO sends fail with `errno` without reaching the kernel.
    #[cfg(test)]
    pub(crate) fn fail_gso_sends(&mut self, count: u32, errno: i32) {
        (self.fail_gso_sends, self.fail_gso_errno) = (count, errno);
    }

    /// Points up to [`MAX_BATCH`] scratch entries at `msgs`, from message `msg` byte `off` on.
    /// Returns the entry count and the index of the first entry that carries a `UDP_SEGMENT`
    /// message, if any.
    fn fill_send(
        &mut self,
        msgs: &[Transmit<'_>],
        mut msg: usize,
        mut off: usize,
    ) -> (usize, Option<usize>) {
        let gso = self.gso_enabled();
        let tail = self.gso_tail;
        let s = &mut self.scratch;
        let mut first_gso = None;
        let mut i = 0;
        while i < MAX_BATCH && msg < msgs.len() {
            let t = &msgs[msg];
            let len = t.contents.len();
            // Segmentation matters only when more than one datagram is left.
            let seg = t.segment_size.map(usize::from).filter(|&seg| seg < len - off);
            let (end, cmsg, shape) = match seg {
                Some(seg) if gso => match tail.next(len - off, seg) {
                    Next::Gso { pad: true } => (len, Some(seg as u16), Shape::Padded),
                    Next::Gso { pad: false } if (len - off).is_multiple_of(seg) => {
                        (len, Some(seg as u16), Shape::EqualTail)
                    }
                    Next::Gso { pad: false } => (len, Some(seg as u16), Shape::Plain),
                    Next::Single => (off + seg, None, Shape::Single),
                },
                Some(seg) => (off + seg, None, Shape::Plain),
                None => (len, None, Shape::Plain),
            };
            let chunk = &t.contents[off..end];
            s.iovs[i][0] =
                libc::iovec { iov_base: chunk.as_ptr().cast_mut().cast(), iov_len: chunk.len() };
            // The kernel only reads a send's data: the pad is never written through.
            s.iovs[i][1] = libc::iovec {
                iov_base: gso_tail::PAD.as_ptr().cast_mut().cast(),
                iov_len: gso_tail::PAD_LEN,
            };
            let namelen = s.names[i].set(t.dst);
            let h = &mut s.hdrs[i].msg_hdr;
            h.msg_name = (&raw mut s.names[i]).cast();
            h.msg_namelen = namelen;
            h.msg_iov = s.iovs[i].as_mut_ptr();
            h.msg_iovlen = if shape == Shape::Padded { 2 } else { 1 };
            h.msg_flags = 0;
            match cmsg {
                Some(seg) => {
                    let mut cmsgs = Encoder::new(&mut s.cmsgs[i]);
                    // One message always fits the storage (msghdr's const assertions).
                    cmsgs.push(libc::SOL_UDP, libc::UDP_SEGMENT, seg);
                    h.msg_controllen = cmsgs.len() as _;
                    h.msg_control = s.cmsgs[i].as_mut_ptr();
                    first_gso = first_gso.or(Some(i));
                }
                None => {
                    h.msg_control = ptr::null_mut();
                    h.msg_controllen = 0;
                }
            }
            s.origin[i] = (msg, end);
            s.shapes[i] = shape;
            i += 1;
            (msg, off) = if end == len { (msg + 1, 0) } else { (msg, end) };
        }
        (i, first_gso)
    }

    /// Counts what the first `sent` scratch entries were, once the kernel took them.
    fn count_shapes(&mut self, sent: usize) {
        for shape in &self.scratch.shapes[..sent] {
            match shape {
                Shape::Plain => {}
                Shape::EqualTail => self.stats.gso_equal_tails += 1,
                Shape::Padded => self.stats.gso_tail_pads += 1,
                Shape::Single => self.stats.gso_tail_singles += 1,
            }
        }
    }

    /// One `sendmmsg` over the first `entries` scratch entries.
    fn sendmmsg(&mut self, entries: usize) -> io::Result<usize> {
        #[cfg(test)]
        let entries =
            match self.scratch.hdrs[..entries].iter().position(|h| h.msg_hdr.msg_controllen != 0) {
                // Like the kernel: the entries before the failing one go out, and a later call
                // fails on it.
                Some(0) if self.fail_gso_sends > 0 => {
                    self.fail_gso_sends -= 1;
                    return Err(io::Error::from_raw_os_error(self.fail_gso_errno));
                }
                Some(k) if self.fail_gso_sends > 0 && k > 0 => k,
                _ => entries,
            };
        // SAFETY: fill_send pointed the first `entries` headers at buffers borrowed from the
        // caller's `msgs` (alive for the whole send_batch call) and at scratch storage, with
        // their lengths; sendmmsg only reads them (and writes msg_len).
        let n = unsafe {
            libc::sendmmsg(
                self.socket.as_raw_fd(),
                self.scratch.hdrs.as_mut_ptr(),
                entries as libc::c_uint,
                0,
            )
        };
        if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
    }
}

impl AsFd for BatchSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl AsRawFd for BatchSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

impl Transmit<'_> {
    /// Whether the kernel can send it; `raw`: on a raw IP socket, which has no ports.
    fn check(&self, raw: bool) -> Result<(), TransmitError> {
        if self.dst.port() == 0 && !raw {
            return Err(TransmitError::ZeroPort);
        }
        let Some(seg) = self.segment_size else { return Ok(()) };
        let len = self.contents.len();
        if seg == 0 {
            return Err(TransmitError::ZeroSegmentSize);
        }
        if len > MAX_GSO_BYTES && len > usize::from(seg) {
            return Err(TransmitError::TooLarge { len });
        }
        let segments = len.div_ceil(usize::from(seg));
        if segments > MAX_GSO_SEGMENTS {
            return Err(TransmitError::TooManySegments { segments });
        }
        Ok(())
    }
}

/// `poll()` on `fd` for `events` up to `timeout`; true if ready, false on timeout or a signal.
fn wait(fd: RawFd, events: libc::c_short, timeout: Duration) -> Result<bool, UdpError> {
    let mut pfd = libc::pollfd { fd, events, revents: 0 };
    let ms = timeout.as_nanos().div_ceil(1_000_000).min(libc::c_int::MAX as u128);
    // SAFETY: pfd is one valid pollfd on the stack.
    let n = unsafe { libc::poll(&mut pfd, 1, ms as libc::c_int) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINTR) {
            Ok(false)
        } else {
            Err(UdpError::Poll(e))
        };
    }
    Ok(n > 0)
}

/// `SO_RCVBUF`/`SO_SNDBUF` of `bytes` (0: the kernel's defaults), then the `*FORCE` options past
/// `net.core.{r,w}mem_max`, which need `CAP_NET_ADMIN`: EPERM there only means "as above".
fn size_buffers(socket: &Socket, bytes: usize) -> Result<(), UdpError> {
    if bytes == 0 {
        return Ok(());
    }
    let opt = |option: &'static str| move |source| UdpError::SetOption { option, source };
    socket.set_recv_buffer_size(bytes).map_err(opt("SO_RCVBUF"))?;
    socket.set_send_buffer_size(bytes).map_err(opt("SO_SNDBUF"))?;
    let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for (option, name) in [(SO_RCVBUFFORCE, "SO_RCVBUFFORCE"), (SO_SNDBUFFORCE, "SO_SNDBUFFORCE")] {
        match setsockopt_int(socket, libc::SOL_SOCKET, option, size) {
            Err(e) if e.raw_os_error() != Some(libc::EPERM) => return Err(opt(name)(e)),
            _ => {}
        }
    }
    Ok(())
}

/// The `UDP_GRO` segment size among a received message's control messages.
fn gro_segment_size(mut cmsgs: Cmsgs<'_>) -> Option<usize> {
    let gro = cmsgs.find(|c| c.level == libc::SOL_UDP && c.ty == libc::UDP_GRO)?;
    gro.read::<libc::c_int>().and_then(|size| usize::try_from(size).ok()).filter(|&s| s > 0)
}

fn setsockopt_int(
    s: &Socket,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: passes a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

fn getsockopt_int(s: &Socket, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: passes a pointer to a live c_int and its size, which the kernel may update.
    let r =
        unsafe { libc::getsockopt(s.as_raw_fd(), level, name, (&raw mut value).cast(), &mut len) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(value) }
}

/// How [`loopback_run`] sends.
#[cfg(feature = "test-util")]
#[derive(Clone, Copy, Debug)]
pub enum LoopbackSend {
    /// One `sendto` per datagram, from std's socket.
    SendTo,
    /// [`BatchSocket`] without GSO: `sendmmsg`, one datagram per message.
    Sendmmsg,
    /// [`BatchSocket`] with UDP GSO: `sendmmsg`, as many datagrams per message as fit.
    SendmmsgGso,
}

/// What [`loopback_run`] measured.
#[cfg(feature = "test-util")]
#[derive(Clone, Copy, Debug)]
pub struct LoopbackRun {
    /// The time to send every datagram.
    pub send: Duration,
    /// Send syscalls made.
    pub send_calls: u64,
    /// Datagrams received (after splitting GRO buffers): loopback drops what the receiver
    /// cannot keep up with.
    pub received: usize,
}

/// Sends `total` datagrams of `size` bytes (at most [`MAX_GSO_BYTES`] / 2) over loopback to a
/// [`BatchSocket`] that receives them, with UDP GRO if `gro`, on a thread of its own. For the
/// `udp_loopback` bench; panics if a socket cannot be opened or a call fails.
#[cfg(feature = "test-util")]
pub fn loopback_run(how: LoopbackSend, gro: bool, total: usize, size: usize) -> LoopbackRun {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let loopback = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
    let rx_cfg = UdpConfig { gro, buffer_bytes: 32 << 20, ..UdpConfig::new(loopback) };
    let mut rx = BatchSocket::open(rx_cfg).expect("open the receiving socket");
    let dst = rx.local_addr();
    let done = Arc::new(AtomicBool::new(false));
    let receiver = std::thread::spawn({
        let done = done.clone();
        move || {
            let mut bufs = vec![vec![0u8; GRO_BUFFER_LEN]; if gro { 8 } else { 64 }];
            let mut metas = vec![RecvMeta::default(); bufs.len()];
            let mut count = 0;
            loop {
                let n = rx.recv_batch(&mut bufs, &mut metas, Duration::from_millis(10));
                let n = n.expect("recv");
                if n == 0 && done.load(Ordering::Relaxed) {
                    return count;
                }
                for m in &metas[..n] {
                    let seg = m.segment_size.filter(|&s| s > 0).unwrap_or(m.len).max(1);
                    count += m.len.div_ceil(seg);
                }
            }
        }
    });
    let data = vec![0xabu8; size * MAX_GSO_SEGMENTS];
    let start = std::time::Instant::now();
    let send_calls = match how {
        LoopbackSend::SendTo => {
            let s = std::net::UdpSocket::bind(loopback).expect("bind");
            for _ in 0..total {
                let _ = s.send_to(&data[..size], dst);
            }
            total as u64
        }
        LoopbackSend::Sendmmsg | LoopbackSend::SendmmsgGso => {
            let gso = matches!(how, LoopbackSend::SendmmsgGso);
            let mut tx = BatchSocket::open(UdpConfig { gso, ..UdpConfig::new(loopback) })
                .expect("open the sending socket");
            let per =
                if tx.gso_enabled() { (MAX_GSO_BYTES / size).min(MAX_GSO_SEGMENTS) } else { 1 };
            let t = Transmit {
                dst,
                contents: &data[..per * size],
                segment_size: (per > 1).then_some(size as u16),
            };
            let batch = [t; MAX_BATCH];
            let mut sent = 0;
            while sent < total {
                let left = total - sent;
                let full = (left / per).min(MAX_BATCH);
                sent += if full > 0 {
                    tx.send_batch(&batch[..full], Instant::ZERO).expect("send") * per
                } else {
                    let last = Transmit { contents: &data[..left * size], ..t };
                    tx.send_batch(&[last], Instant::ZERO).expect("send") * left
                };
            }
            tx.stats().send_calls
        }
    };
    let send = start.elapsed();
    done.store(true, Ordering::Relaxed);
    let received = receiver.join().expect("the receiving thread");
    LoopbackRun { send, send_calls, received }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::{Ipv6Addr, SocketAddrV6};
    use std::time::Instant;

    use super::*;

    /// The datagrams in a received buffer: `buf[..meta.len]` cut every `meta.segment_size`
    /// bytes (the last piece possibly shorter), or whole without GRO; nothing for an empty
    /// message. The worker's RX loop cuts them the same way, in place.
    fn split_gro<'a>(buf: &'a [u8], meta: &RecvMeta) -> impl Iterator<Item = &'a [u8]> + 'a {
        let data = &buf[..meta.len.min(buf.len())];
        let seg = meta.segment_size.filter(|&s| s > 0).unwrap_or(data.len()).max(1);
        data.chunks(seg)
    }

    const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
    const WAIT: Duration = Duration::from_secs(2);
    /// `now` for sends in tests that do not look at the GSO retry.
    const T0: crate::time::Instant = crate::time::Instant::ZERO;

    fn open(gso: bool, gro: bool) -> BatchSocket {
        let cfg = UdpConfig { gso, gro, ..UdpConfig::new(SocketAddrV4::new(LOOPBACK, 0)) };
        BatchSocket::open(cfg).expect("open a loopback socket")
    }

    fn payload(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i * 31 + j) as u8).collect()
    }

    /// Receives until `want` datagrams (after splitting GRO buffers) arrived or nothing comes for
    /// `WAIT`; returns the datagrams and the metas of the buffers they came in.
    fn recv_all(rx: &mut BatchSocket, want: usize) -> (Vec<Vec<u8>>, Vec<RecvMeta>) {
        let mut bufs = vec![vec![0u8; GRO_BUFFER_LEN]; 8];
        let mut metas = [RecvMeta::default(); 8];
        let (mut got, mut seen) = (Vec::new(), Vec::new());
        while got.len() < want {
            let n = rx.recv_batch(&mut bufs, &mut metas, WAIT).expect("recv");
            if n == 0 {
                break;
            }
            for (buf, meta) in bufs.iter().zip(&metas[..n]) {
                seen.push(*meta);
                got.extend(split_gro(buf, meta).map(<[u8]>::to_vec));
            }
        }
        (got, seen)
    }

    /// An IPv6 socket (bound to an IPv6 address: the family follows the bind address) sends a
    /// GSO run and receives it coalesced, with the sender's IPv6 address; it is IPv6-only.
    #[test]
    fn an_ipv6_socket_sends_gso_and_receives_gro_with_ipv6_addresses() {
        let v6 = |gso, gro| {
            let cfg = UdpConfig {
                gso,
                gro,
                ..UdpConfig::new(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 0, 0, 0))
            };
            BatchSocket::open(cfg).expect("open an IPv6 loopback socket")
        };
        let (mut tx, mut rx) = (v6(true, false), v6(false, true));
        assert!(tx.local_addr().is_ipv6() && rx.local_addr().is_ipv6());
        let contents: Vec<u8> = (0..4).flat_map(|i| payload(i, 1000)).collect();
        let t = Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1000) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        let (got, metas) = recv_all(&mut rx, 4);
        assert_eq!(got, (0..4).map(|i| payload(i, 1000)).collect::<Vec<_>>());
        assert!(metas.iter().all(|m| m.src == tx.local_addr()), "{metas:?}");
        if tx.capabilities().gso && rx.capabilities().gro {
            assert_eq!(metas.len(), 1, "one coalesced buffer: {metas:?}");
        }
        // IPv6 only: an IPv4-mapped destination is refused, never sent over IPv4.
        let mapped = SocketAddr::V6(SocketAddrV6::new(LOOPBACK.to_ipv6_mapped(), 9, 0, 0));
        let t = Transmit { dst: mapped, contents: &contents[..10], segment_size: None };
        assert!(tx.send_batch(&[t], T0).is_err());
    }

    #[test]
    fn a_socket_can_move_to_its_worker_thread() {
        fn assert_send<T: Send>() {}
        assert_send::<BatchSocket>();
    }

    #[test]
    fn capabilities_are_probed_on_this_kernel() {
        let s = open(true, true);
        let caps = s.capabilities();
        println!("capabilities: {caps:?}");
        assert!(caps.gso, "UDP_SEGMENT is in every kernel since 4.18");
        assert!(caps.gro, "UDP_GRO is in every kernel since 5.0");
        assert_eq!(caps.max_gso_segments, MAX_GSO_SEGMENTS);
        assert!(s.gso_enabled());
        // Asked off, they stay off, whatever the kernel has.
        let off = open(false, false).capabilities();
        assert_eq!((off.gso, off.gro, off.max_gso_segments), (false, false, 1));
        // The kernel doubles SO_RCVBUF; at least the default buffer was granted.
        assert!(caps.recv_buffer > 0 && caps.send_buffer > 0);
    }

    #[test]
    fn mixed_sizes_round_trip_in_order_across_several_syscalls() {
        let (mut tx, mut rx) = (open(false, false), open(false, false));
        let sizes: Vec<usize> = (0..150).map(|i| [1, 60, 1400, 9000, 0, 333][i % 6]).collect();
        let data: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| payload(i, n)).collect();
        let msgs: Vec<Transmit<'_>> = data
            .iter()
            .map(|d| Transmit { dst: rx.local_addr(), contents: d, segment_size: None })
            .collect();
        assert_eq!(tx.send_batch(&msgs, T0).expect("send"), msgs.len());
        assert!(tx.stats().send_calls >= 3, "150 messages need 3 sendmmsg calls of 64");

        let mut bufs = vec![vec![0u8; 9000]; MAX_BATCH];
        let mut metas = vec![RecvMeta::default(); MAX_BATCH];
        let mut got = Vec::new();
        while got.len() < data.len() {
            let n = rx.recv_batch(&mut bufs, &mut metas, WAIT).expect("recv");
            assert!(n > 0, "timed out after {} datagrams", got.len());
            for (buf, meta) in bufs.iter().zip(&metas[..n]) {
                assert_eq!(meta.src, tx.local_addr());
                assert_eq!(meta.segment_size, None);
                assert!(!meta.truncated);
                got.push(buf[..meta.len].to_vec());
            }
        }
        assert_eq!(got, data);
    }

    #[test]
    fn gso_send_arrives_as_datagrams_at_a_receiver_without_gro() {
        let (mut tx, mut rx) = (open(true, false), open(true, false));
        let dgrams: Vec<Vec<u8>> = (0..10).map(|i| payload(i, 1000)).collect();
        let contents = dgrams.concat();
        let t = Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1000) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        assert_eq!(tx.stats().send_calls, 1);
        let (got, metas) = recv_all(&mut rx, dgrams.len());
        assert_eq!(got, dgrams);
        assert!(metas.iter().all(|m| m.segment_size.is_none() && m.len == 1000));
    }

    #[test]
    fn gso_send_arrives_coalesced_at_a_receiver_with_gro_and_splits_back() {
        let (mut tx, mut rx) = (open(true, false), open(false, true));
        let dgrams: Vec<Vec<u8>> = (0..10).map(|i| payload(i, 1000)).collect();
        let contents = dgrams.concat();
        let t = Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1000) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        let (got, metas) = recv_all(&mut rx, dgrams.len());
        assert_eq!(got, dgrams);
        assert_eq!(metas.len(), 1, "one coalesced buffer: {metas:?}");
        assert_eq!(metas[0].segment_size, Some(1000));
        assert_eq!(metas[0].len, 10_000);
    }

    #[test]
    fn gso_send_with_a_shorter_last_segment() {
        let mut tx = open(true, false);
        let mut dgrams: Vec<Vec<u8>> = (0..9).map(|i| payload(i, 1000)).collect();
        dgrams.push(payload(9, 300));
        let contents = dgrams.concat();
        for gro in [false, true] {
            let mut rx = open(false, gro);
            let t =
                Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1000) };
            assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
            let (got, metas) = recv_all(&mut rx, dgrams.len());
            assert_eq!(got, dgrams, "gro {gro}");
            if gro {
                assert_eq!(metas.len(), 1);
                assert_eq!((metas[0].len, metas[0].segment_size), (9300, Some(1000)));
            }
        }
    }

    fn never_equal_sender() -> BatchSocket {
        let cfg = UdpConfig {
            gro: false,
            gso_tail: TailRule::NeverEqual,
            ..UdpConfig::new(SocketAddrV4::new(LOOPBACK, 0))
        };
        BatchSocket::open(cfg).expect("open a loopback socket")
    }

    /// Under `TailRule::NeverEqual` a GSO message that would end on a full segment goes with
    /// the pad as its last segment (a receiver with GRO gets it in the same buffer, one
    /// without as a datagram of its own); one too short to pad goes as single datagrams; one
    /// that ends shorter goes as it is. Without the rule, the first is an equal tail.
    #[test]
    fn under_never_equal_no_gso_message_ends_on_a_full_segment() {
        let dgrams: Vec<Vec<u8>> = (0..5).map(|i| payload(i, 1200)).collect();
        let full = dgrams.concat();
        let mut want = dgrams.clone();
        want.push(gso_tail::PAD.to_vec());
        for gro in [true, false] {
            let (mut tx, mut rx) = (never_equal_sender(), open(false, gro));
            assert_eq!(tx.gso_limits(), TailRule::NeverEqual.limits(MAX_GSO_SEGMENTS));
            let t = Transmit { dst: rx.local_addr(), contents: &full, segment_size: Some(1200) };
            assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
            let (got, metas) = recv_all(&mut rx, 6);
            assert_eq!(got, want, "gro {gro}");
            if gro {
                assert_eq!((metas.len(), metas[0].len), (1, 6018), "one buffer: {metas:?}");
            }
            let st = tx.stats();
            assert_eq!((st.gso_tail_pads, st.gso_tail_singles, st.gso_equal_tails), (1, 0, 0));
        }
        // Three equal datagrams: each alone (two split off ahead of the last).
        let (mut tx, mut rx) = (never_equal_sender(), open(false, true));
        let three = dgrams[..3].concat();
        let t = Transmit { dst: rx.local_addr(), contents: &three, segment_size: Some(1200) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        let (got, metas) = recv_all(&mut rx, 3);
        assert_eq!(got, dgrams[..3].to_vec());
        assert!(metas.iter().all(|m| m.len == 1200), "{metas:?}");
        let st = tx.stats();
        assert_eq!((st.gso_tail_pads, st.gso_tail_singles, st.gso_equal_tails), (0, 2, 0));
        // A shorter last datagram: as it is.
        let mut short = full.clone();
        short.truncate(4 * 1200 + 100);
        let t = Transmit { dst: rx.local_addr(), contents: &short, segment_size: Some(1200) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        let (got, metas) = recv_all(&mut rx, 5);
        assert_eq!(got.concat(), short);
        assert_eq!(metas.len(), 1);
        assert_eq!(tx.stats().gso_tail_pads, 0);
        // Without the rule the same full message ends on a full segment, and is counted.
        let (mut tx, mut rx) = (open(true, false), open(false, true));
        let t = Transmit { dst: rx.local_addr(), contents: &full, segment_size: Some(1200) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        assert_eq!(recv_all(&mut rx, 5).0, dgrams);
        let st = tx.stats();
        assert_eq!((st.gso_tail_pads, st.gso_tail_singles, st.gso_equal_tails), (0, 0, 1));
    }

    /// A message laid out beyond the padded limits (64 full segments) still goes: the first
    /// datagram alone, the other 63 with the pad.
    #[test]
    fn a_message_beyond_the_padded_limits_still_goes_without_an_equal_tail() {
        let (mut tx, mut rx) = (never_equal_sender(), open(false, false));
        let dgrams: Vec<Vec<u8>> = (0..64).map(|i| payload(i, 500)).collect();
        let all = dgrams.concat();
        let t = Transmit { dst: rx.local_addr(), contents: &all, segment_size: Some(500) };
        assert_eq!(tx.send_batch(&[t], T0).expect("send"), 1);
        let (got, _) = recv_all(&mut rx, 65);
        let mut want = dgrams;
        want.push(gso_tail::PAD.to_vec());
        assert_eq!(got, want);
        let st = tx.stats();
        assert_eq!((st.gso_tail_pads, st.gso_tail_singles, st.gso_equal_tails), (1, 1, 0));
    }

    #[test]
    fn a_batch_mixes_gso_and_plain_messages_and_destinations() {
        let mut tx = open(true, false);
        let (mut a, mut b) = (open(false, false), open(false, true));
        let run: Vec<Vec<u8>> = (0..5).map(|i| payload(i, 500)).collect();
        let run_bytes = run.concat();
        let single = payload(99, 77);
        let msgs = [
            Transmit { dst: a.local_addr(), contents: &run_bytes, segment_size: Some(500) },
            Transmit { dst: b.local_addr(), contents: &single, segment_size: None },
            // A segment size at least the length: one plain datagram.
            Transmit { dst: a.local_addr(), contents: &single, segment_size: Some(1400) },
            Transmit { dst: b.local_addr(), contents: &run_bytes, segment_size: Some(500) },
        ];
        assert_eq!(tx.send_batch(&msgs, T0).expect("send"), 4);
        let (got_a, _) = recv_all(&mut a, 6);
        let mut want_a = run.clone();
        want_a.push(single.clone());
        assert_eq!(got_a, want_a);
        let (got_b, _) = recv_all(&mut b, 6);
        let mut want_b = vec![single.clone()];
        want_b.extend(run);
        assert_eq!(got_b, want_b);
    }

    #[test]
    fn without_gso_a_segmented_transmit_is_split() {
        let mut tx = open(true, false);
        assert!(!tx.set_gso(false));
        assert_eq!(tx.max_gso_segments(), 1);
        let mut rx = open(false, true);
        // 3 messages of 40 datagrams: 120 entries, more than one sendmmsg, split mid-message.
        let dgrams: Vec<Vec<u8>> = (0..120).map(|i| payload(i, 100)).collect();
        let contents: Vec<Vec<u8>> = dgrams.chunks(40).map(<[Vec<u8>]>::concat).collect();
        let msgs: Vec<Transmit<'_>> = contents
            .iter()
            .map(|c| Transmit { dst: rx.local_addr(), contents: c, segment_size: Some(100) })
            .collect();
        assert_eq!(tx.send_batch(&msgs, T0).expect("send"), 3);
        assert_eq!(tx.stats().send_calls, 2);
        let (got, metas) = recv_all(&mut rx, dgrams.len());
        assert_eq!(got, dgrams);
        assert!(metas.iter().all(|m| m.segment_size.is_none()), "nothing was coalesced");
        assert!(tx.set_gso(true), "the switch turns it back on");
    }

    /// At `secs` seconds on the data plane's clock.
    fn at(secs: u64) -> crate::time::Instant {
        crate::time::Instant::from_epoch(Duration::from_secs(secs))
    }

    fn off_until(secs: u64) -> Option<GsoState> {
        Some(GsoState::Off { until: at(secs) })
    }

    /// A GSO sender whose GSO is retried `retry_after` seconds after a failure.
    fn gso_sender(retry_after: u64) -> BatchSocket {
        let cfg = UdpConfig {
            gro: false,
            gso_retry: GsoRetryConfig::new(Duration::from_secs(retry_after)),
            ..UdpConfig::new(SocketAddrV4::new(LOOPBACK, 0))
        };
        BatchSocket::open(cfg).expect("open a loopback socket")
    }

    /// Sends five 1200-byte datagrams to `rx` as one segmented transmit at `now`; returns
    /// whether they arrived as one GSO message (one coalesced buffer at a GRO receiver) rather
    /// than as five datagrams.
    fn send_run(tx: &mut BatchSocket, rx: &mut BatchSocket, now: crate::time::Instant) -> bool {
        let dgrams: Vec<Vec<u8>> = (0..5).map(|i| payload(i, 1200)).collect();
        let contents = dgrams.concat();
        let t = Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1200) };
        assert_eq!(tx.send_batch(&[t], now).expect("send"), 1);
        let (got, metas) = recv_all(rx, dgrams.len());
        assert_eq!(got, dgrams, "every datagram arrives, in order, either way");
        match metas.len() {
            1 => true,
            5 => false,
            n => panic!("{n} buffers for one run: {metas:?}"),
        }
    }

    #[test]
    fn a_failed_gso_send_turns_gso_off_for_now_and_still_delivers() {
        // EIO: IPsec, or no checksum offload before Linux 6.11; EMSGSIZE: a segment larger
        // than the path MTU (EINVAL on kernels before that fix).
        for errno in [libc::EIO, libc::EINVAL, libc::EMSGSIZE] {
            let (mut tx, mut rx) = (open(true, false), open(false, false));
            tx.fail_gso_sends(1, errno);
            let dgrams: Vec<Vec<u8>> = (0..5).map(|i| payload(i, 1200)).collect();
            let contents = dgrams.concat();
            let single = payload(7, 10);
            let msgs = [
                Transmit { dst: rx.local_addr(), contents: &single, segment_size: None },
                Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1200) },
                Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1200) },
            ];
            assert_eq!(tx.send_batch(&msgs, at(100)).expect("send"), 3, "errno {errno}");
            let stats = tx.stats();
            assert_eq!(stats.gso_fallbacks, 1);
            let failure = GsoFailure { errno, dst: rx.local_addr() };
            assert_eq!(stats.gso_last_failure, Some(failure));
            assert_eq!((stats.gso_retries, stats.gso_recoveries), (0, 0));
            assert!(!tx.gso_enabled());
            assert_eq!(tx.max_gso_segments(), 1);
            assert_eq!(tx.gso_state(), off_until(130), "off for the default 30 s");
            assert!(tx.capabilities().gso, "the probe result is unchanged");
            let (got, _) = recv_all(&mut rx, 11);
            let mut want = vec![single];
            want.extend(dgrams.iter().cloned());
            want.extend(dgrams);
            assert_eq!(got, want, "errno {errno}");
        }
    }

    #[test]
    fn gso_is_tried_again_at_the_retry_time_and_is_on_again_when_it_works() {
        let (mut tx, mut rx) = (gso_sender(2), open(false, true));
        assert!(send_run(&mut tx, &mut rx, at(10)), "GSO at first");
        tx.fail_gso_sends(1, libc::EMSGSIZE);
        assert!(!send_run(&mut tx, &mut rx, at(10)), "the failed message went out split");
        assert_eq!(tx.gso_state(), off_until(12));
        assert!(!send_run(&mut tx, &mut rx, at(11)), "still off a second later");
        assert_eq!(tx.stats().gso_retries, 0);
        // The retry time: this very send uses GSO again, and the kernel takes it.
        assert!(send_run(&mut tx, &mut rx, at(12)), "GSO again at the retry time");
        let stats = tx.stats();
        assert_eq!((stats.gso_fallbacks, stats.gso_retries, stats.gso_recoveries), (1, 1, 1));
        assert_eq!(tx.gso_state(), Some(GsoState::On));
        assert_eq!(tx.max_gso_segments(), MAX_GSO_SEGMENTS);
        // The wait was reset: the next failure is off for 2 s again, not 4.
        tx.fail_gso_sends(1, libc::EIO);
        assert!(!send_run(&mut tx, &mut rx, at(50)));
        assert_eq!(tx.gso_state(), off_until(52));
    }

    #[test]
    fn a_failed_retry_turns_gso_off_again_for_twice_as_long() {
        let (mut tx, mut rx) = (gso_sender(2), open(false, true));
        tx.fail_gso_sends(2, libc::EMSGSIZE);
        assert!(!send_run(&mut tx, &mut rx, at(0)));
        assert_eq!(tx.gso_state(), off_until(2));
        // The retry at 2 s fails too: off until 2 + 4.
        assert!(!send_run(&mut tx, &mut rx, at(2)));
        assert_eq!(tx.gso_state(), off_until(6));
        let stats = tx.stats();
        assert_eq!((stats.gso_fallbacks, stats.gso_retries, stats.gso_recoveries), (2, 1, 0));
        assert!(!send_run(&mut tx, &mut rx, at(5)));
        assert!(send_run(&mut tx, &mut rx, at(6)), "the second retry works");
        assert_eq!(tx.gso_state(), Some(GsoState::On));
        assert_eq!((tx.stats().gso_retries, tx.stats().gso_recoveries), (2, 1));
    }

    #[test]
    fn a_retry_without_a_gso_message_stays_unconfirmed() {
        let (mut tx, mut rx) = (gso_sender(2), open(false, true));
        tx.fail_gso_sends(1, libc::EIO);
        assert!(!send_run(&mut tx, &mut rx, at(0)));
        let single = payload(1, 100);
        let t = Transmit { dst: rx.local_addr(), contents: &single, segment_size: None };
        assert_eq!(tx.send_batch(&[t], at(3)).expect("send"), 1);
        assert_eq!(recv_all(&mut rx, 1).0, [single]);
        assert_eq!(tx.gso_state(), Some(GsoState::Retrying), "GSO used again, not yet proven");
        assert!(tx.gso_enabled());
        assert_eq!(tx.stats().gso_recoveries, 0);
        assert!(send_run(&mut tx, &mut rx, at(3)));
        assert_eq!(tx.gso_state(), Some(GsoState::On));
    }

    #[test]
    fn switching_gso_on_forgets_failures_and_off_means_no_retry() {
        let (mut tx, mut rx) = (gso_sender(2), open(false, true));
        tx.fail_gso_sends(1, libc::EIO);
        assert!(!send_run(&mut tx, &mut rx, at(0)));
        assert!(!tx.set_gso(false));
        assert_eq!(tx.gso_state(), None);
        assert!(!send_run(&mut tx, &mut rx, at(100)), "switched off: no retry, ever");
        assert_eq!(tx.stats().gso_retries, 0);
        assert!(tx.set_gso(true));
        assert_eq!(tx.gso_state(), Some(GsoState::On));
        assert!(send_run(&mut tx, &mut rx, at(100)));
    }

    #[test]
    fn other_send_errors_on_a_gso_message_do_not_touch_gso() {
        let (mut tx, rx) = (open(true, false), open(false, false));
        tx.fail_gso_sends(1, libc::ENETUNREACH);
        let contents = payload(1, 2400);
        let t = Transmit { dst: rx.local_addr(), contents: &contents, segment_size: Some(1200) };
        let err = tx.send_batch(&[t], T0).unwrap_err();
        assert!(matches!(err, UdpError::Send { sent: 0, .. }), "{err}");
        assert_eq!(tx.gso_state(), Some(GsoState::On));
        assert_eq!(tx.stats().gso_fallbacks, 0);
    }

    #[test]
    fn two_sockets_share_a_port_with_reuse_port() {
        let mut rx = open(false, false);
        let first =
            UdpConfig { reuse_port: true, ..UdpConfig::new(SocketAddrV4::new(LOOPBACK, 0)) };
        let mut a = BatchSocket::open(first).expect("first");
        let second = UdpConfig { bind: a.local_addr(), ..first };
        let mut b = BatchSocket::open(second).expect("second socket on the same port");
        assert_eq!(a.local_addr(), b.local_addr());
        // A socket without SO_REUSEPORT cannot join.
        assert!(std::net::UdpSocket::bind(a.local_addr()).is_err());

        for (s, byte) in [(&mut a, 1u8), (&mut b, 2u8)] {
            let t = Transmit { dst: rx.local_addr(), contents: &[byte], segment_size: None };
            assert_eq!(s.send_batch(&[t], T0).expect("send"), 1);
        }
        let (got, metas) = recv_all(&mut rx, 2);
        assert_eq!(got, [vec![1], vec![2]]);
        let srcs: HashSet<_> = metas.iter().map(|m| m.src).collect();
        assert_eq!(srcs, HashSet::from([a.local_addr()]));
    }

    /// Tries to bind `addr` as a neighbour would, with `SO_REUSEADDR` and/or `SO_REUSEPORT`.
    fn neighbour_binds(addr: SocketAddrV4, reuse_addr: bool, reuse_port: bool) -> bool {
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).expect("socket");
        s.set_reuse_address(reuse_addr).expect("SO_REUSEADDR");
        s.set_reuse_port(reuse_port).expect("SO_REUSEPORT");
        s.bind(&SockAddr::from(SocketAddr::V4(addr))).is_ok()
    }

    /// The kernel's rules, as weft relies on them (checked on Linux 6.x): a socket without
    /// `SO_REUSEADDR` shares its port with nobody's `SO_REUSEADDR` socket, whether that one
    /// binds the wildcard or the specific address, and whatever its UID; `SO_REUSEPORT` joins
    /// only a group that has it, and (not testable here, see integration/e2e.rs) only with the same
    /// effective UID.
    #[test]
    fn no_neighbour_binds_our_port_with_so_reuseaddr() {
        for ours in [LOOPBACK, Ipv4Addr::UNSPECIFIED] {
            for reuse_port in [false, true] {
                let cfg = UdpConfig { reuse_port, ..UdpConfig::new(SocketAddrV4::new(ours, 0)) };
                let sock = BatchSocket::open(cfg).expect("open");
                let port = sock.local_addr().port();
                for theirs in [LOOPBACK, Ipv4Addr::UNSPECIFIED] {
                    let at = SocketAddrV4::new(theirs, port);
                    let case = format!("ours {ours} reuse_port={reuse_port}, theirs {at}");
                    assert!(!neighbour_binds(at, false, false), "plain bind: {case}");
                    assert!(!neighbour_binds(at, true, false), "SO_REUSEADDR: {case}");
                    // Same UID: SO_REUSEPORT joins exactly when our sockets have it too.
                    assert_eq!(
                        neighbour_binds(at, false, true),
                        reuse_port,
                        "SO_REUSEPORT: {case}"
                    );
                }
            }
        }
    }

    #[test]
    fn recv_times_out_with_zero() {
        let mut rx = open(false, true);
        let mut bufs = [vec![0u8; GRO_BUFFER_LEN]];
        let mut metas = [RecvMeta::default()];
        let start = Instant::now();
        assert_eq!(rx.recv_batch(&mut bufs, &mut metas, Duration::from_millis(50)).unwrap(), 0);
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(45) && waited < Duration::from_secs(1),
            "{waited:?}"
        );
        assert_eq!(rx.recv_batch(&mut bufs, &mut metas, Duration::ZERO).unwrap(), 0);
        assert_eq!(rx.recv_batch(&mut bufs, &mut [], WAIT).unwrap(), 0, "no metas, no wait");
    }

    #[test]
    fn truncated_messages_are_flagged_and_counted() {
        let (mut tx, mut rx) = (open(false, false), open(false, false));
        let (big, small) = (payload(1, 200), payload(2, 50));
        let msgs = [
            Transmit { dst: rx.local_addr(), contents: &big, segment_size: None },
            Transmit { dst: rx.local_addr(), contents: &small, segment_size: None },
        ];
        tx.send_batch(&msgs, T0).expect("send");
        let mut bufs = [[0u8; 100]; 2];
        let mut metas = [RecvMeta::default(); 2];
        assert_eq!(rx.recv_batch(&mut bufs, &mut metas, WAIT).expect("recv"), 2);
        assert!(metas[0].truncated && metas[0].len == 0);
        assert_eq!(split_gro(&bufs[0], &metas[0]).count(), 0);
        assert!(!metas[1].truncated);
        assert_eq!(&bufs[1][..metas[1].len], &small[..]);
    }

    #[test]
    fn gro_needs_full_size_buffers() {
        let mut rx = open(false, true);
        let mut bufs = [vec![0u8; GRO_BUFFER_LEN], vec![0u8; 1500]];
        let mut metas = [RecvMeta::default(); 2];
        let err = rx.recv_batch(&mut bufs, &mut metas, Duration::ZERO).unwrap_err();
        assert!(matches!(err, UdpError::BufferTooSmall { index: 1, len: 1500 }), "{err}");
    }

    #[test]
    fn malformed_transmits_are_refused_before_sending() {
        let mut tx = open(true, false);
        let dst = SocketAddr::from(SocketAddrV4::new(LOOPBACK, 9));
        let big = vec![0u8; 70_000];
        let cases = [
            (Transmit { dst, contents: &big[..650], segment_size: Some(10) }, 1),
            (Transmit { dst, contents: &big[..10], segment_size: Some(0) }, 2),
            (Transmit { dst, contents: &big, segment_size: Some(1400) }, 3),
            (
                Transmit {
                    dst: SocketAddrV4::new(LOOPBACK, 0).into(),
                    contents: &big[..1],
                    segment_size: None,
                },
                4,
            ),
        ];
        for (t, case) in cases {
            let ok = Transmit { dst, contents: &big[..1], segment_size: None };
            let err = tx.send_batch(&[ok, t], T0).unwrap_err();
            assert!(err.is_per_message(), "case {case}");
            let UdpError::InvalidTransmit { index: 1, reason } = err else {
                panic!("case {case}: {err}")
            };
            let want = match case {
                1 => TransmitError::TooManySegments { segments: 65 },
                2 => TransmitError::ZeroSegmentSize,
                3 => TransmitError::TooLarge { len: 70_000 },
                _ => TransmitError::ZeroPort,
            };
            assert_eq!(reason, want, "case {case}");
        }
        assert_eq!(tx.stats().send_calls, 0);
    }

    #[test]
    fn an_oversized_datagram_fails_alone() {
        let (mut tx, mut rx) = (open(false, false), open(false, false));
        let (big, ok) = (vec![0u8; 70_000], payload(3, 30));
        let msgs = [
            Transmit { dst: rx.local_addr(), contents: &ok, segment_size: None },
            Transmit { dst: rx.local_addr(), contents: &big, segment_size: None },
            Transmit { dst: rx.local_addr(), contents: &ok, segment_size: None },
        ];
        let err = tx.send_batch(&msgs, T0).unwrap_err();
        let UdpError::Send { sent: 1, source } = &err else { panic!("{err}") };
        assert_eq!(source.raw_os_error(), Some(libc::EMSGSIZE));
        assert_eq!(tx.send_batch(&msgs[2..], T0).expect("the rest"), 1);
        let (got, _) = recv_all(&mut rx, 2);
        assert_eq!(got, [ok.clone(), ok]);
    }

    #[test]
    fn split_gro_walks_segments() {
        let buf: Vec<u8> = (0..10).collect();
        let meta = |len, segment_size| RecvMeta { len, segment_size, ..RecvMeta::default() };
        let split = |m: RecvMeta| split_gro(&buf, &m).map(<[u8]>::to_vec).collect::<Vec<_>>();
        assert_eq!(split(meta(10, None)), [buf[..].to_vec()]);
        assert_eq!(split(meta(7, None)), [buf[..7].to_vec()]);
        assert_eq!(split(meta(9, Some(3))), [vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8]]);
        assert_eq!(split(meta(10, Some(4))), [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        assert_eq!(split(meta(0, Some(4))).len(), 0);
        assert_eq!(split(meta(0, None)).len(), 0);
        assert_eq!(split(meta(99, Some(0))), [buf[..].to_vec()], "clamped, no panic");
    }
}
