//! The forwarding loops, generic over their two I/O edges so the whole path runs in tests with
//! in-memory fakes (`super::fake`, `test-util` feature) and in the daemon with the TUN device
//! and batched UDP sockets ([`super::driver`]).
//!
//! # TX: TUN → peers
//! Read up to a batch of packets from one TUN queue. A TSO/USO super-packet (behind a
//! `virtio_net_hdr`) is routed once, split into wire-sized segments laid out back to back
//! with the backend's encapsulation in front of each ([`offload::split`]), and goes out as few
//! `UDP_SEGMENT` (GSO) messages as the kernel allows. Single packets are encapsulated in place
//! in their read buffer; runs of them to one peer are copied back to back into GSO messages
//! ([`udp::coalesce_plan`]), and all go out in one `sendmmsg`. Packets leave in the order they
//! were read: TCP takes reordering for loss.
//!
//! # RX: peers → TUN
//! Receive a batch (`recvmmsg`; with UDP GRO each buffer may hold many datagrams), validate and
//! decapsulate every datagram ([`Forwarder::decap`]), and write the inner packets to TUN: with
//! TUN offloads, after TCP/UDP GRO ([`GroTable::coalesce_refs`]) coalesces them into
//! super-packets where they lie, one vectored write each, straight from the receive buffers.
//!
//! # Contract
//! Buffers are allocated once per worker; the per-packet path allocates nothing, takes no lock
//! (the route table is loaded wait-free once per batch) and logs nothing: every drop is counted
//! by reason in the thread's own [`PacketCounters`] block (see [`Counters::thread`](super::counters::Counters::thread): one per
//! thread, on cache lines of its own, summed only when `/metrics` is read). The TX path reads its [`Clock`] once per batch read and passes
//! that `now` to the pipeline (for the ICMP rate limit) and to the sockets (for the GSO retry). Loops return when `stop` is set
//! (checked at least every `wake`).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::counters::{Counters, PacketCounters};
use super::offload::{self, GroConfig, GroTable, MAX_CHAIN, PacketRef};
use super::pipeline::{DropReason, Forwarder, HEADROOM, Refusal, Rx, Tx};
use super::supervise::{self, RestartPolicy, WorkerStates, supervise};
use super::udp::{self, MAX_BATCH, MAX_GSO_BYTES, RecvMeta, Transmit, UdpError};
use super::wire::virtio_net::{self, Header};
use crate::route::Routes;
use crate::time::{Clock, Instant};

/// One TUN queue, as the loops need it.
pub trait TunIo: Send + Sync {
    /// Reads one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]); `Ok(0)` or
    /// `WouldBlock` when nothing is queued.
    fn read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]).
    fn write(&self, buf: &[u8]) -> io::Result<usize>;
    /// Writes one packet gathered from `parts`, as [`TunIo::write`] would write their
    /// concatenation.
    fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize>;
    /// Waits until a packet can be read or `timeout` passes.
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool>;
    /// Whether packets carry a `virtio_net_hdr` (TUN offloads on).
    fn vnet_hdr(&self) -> bool;
    /// The file descriptor to `poll(2)` for readability, if the queue has one.
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

/// One UDP socket, as the loops need it (see [`udp::BatchSocket`]).
pub trait UdpIo: Send {
    /// Sends messages at `now` (the batch's time); see [`udp::BatchSocket::send_batch`].
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError>;
    /// Receives messages; see [`udp::BatchSocket::recv_batch`].
    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError>;
    /// Datagrams per GSO message (1: no GSO).
    fn max_gso_segments(&self) -> usize;
    /// Whether received buffers may hold several datagrams (UDP GRO).
    fn gro(&self) -> bool;
    /// The file descriptor to `poll(2)` for readability, if the socket has one.
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

impl UdpIo for udp::BatchSocket {
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError> {
        udp::BatchSocket::send_batch(self, msgs, now)
    }
    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        udp::BatchSocket::recv_batch(self, bufs, metas, timeout)
    }
    fn max_gso_segments(&self) -> usize {
        if self.gso_enabled() { udp::BatchSocket::max_gso_segments(self) } else { 1 }
    }
    fn gro(&self) -> bool {
        self.capabilities().gro
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

/// How one worker runs.
#[derive(Clone, Copy, Debug)]
pub struct WorkerConfig {
    /// Packets per batch (1: one packet per syscall, the baseline).
    pub batch: usize,
    /// How often loops look at the stop flag.
    pub wake: Duration,
    /// Coalesce received TCP segments into super-packets (needs TUN TSO).
    pub gro_tcp: bool,
    /// Coalesce received UDP datagrams of one flow into super-packets (needs TUN USO).
    pub gro_udp: bool,
    /// Run TX and RX on one thread ([`run_both`]) instead of two.
    pub one_thread: bool,
}

/// The largest packet a TUN read returns with offloads (64 KiB super-packet) plus its header.
const READ_LEN: usize = virtio_net::LEN + 65535;
/// Room for what is laid out for sending: one split super-packet (64 KiB of payload cut into
/// segments as small as 536 bytes, each with its headers and encapsulation headroom), or the
/// GSO runs of a batch of single datagrams.
const SEND_BUF_LEN: usize = 256 * 1024;

fn zero_vnet_hdr(buf: &mut [u8]) {
    buf[..virtio_net::LEN].fill(0);
}

/// The TX path's buffers, allocated once: TUN → encapsulation → UDP.
pub struct TxPath {
    slots: Vec<Vec<u8>>,
    /// Where super-packets are split and GSO runs laid out back to back.
    send_buf: Vec<u8>,
    reply: Vec<u8>,
    pending: Vec<Pending>,
    vnet: bool,
    clock: Arc<dyn Clock>,
}

impl TxPath {
    /// Buffers for batches of `cfg.batch` packets from `tun`; `clock` stamps each batch.
    pub fn new<T: TunIo>(tun: &T, cfg: &WorkerConfig, clock: Arc<dyn Clock>) -> Self {
        let batch = cfg.batch.clamp(1, MAX_BATCH);
        let vnet = tun.vnet_hdr();
        Self {
            // Slot i: [HEADROOM - hdr room][vnet hdr?][packet ...]; the packet at HEADROOM.
            slots: (0..batch).map(|_| vec![0u8; HEADROOM + READ_LEN]).collect(),
            send_buf: vec![0u8; SEND_BUF_LEN],
            reply: vec![0u8; virtio_net::LEN + 1500],
            pending: Vec::with_capacity(batch),
            vnet,
            clock,
        }
    }

    /// Waits up to `wait` for TUN, then reads what is queued (one batch), encapsulates and
    /// sends it. `pool` holds the sockets datagrams leave from; the inner flow's hash picks
    /// one, so the outer source port is stable per flow. Returns whether anything was read.
    pub fn step<T: TunIo, U: UdpIo>(
        &mut self,
        tun: &T,
        pool: &mut [U],
        fwd: &Forwarder,
        routes: &Routes,
        counters: &PacketCounters,
        wait: Duration,
    ) -> bool {
        if pool.is_empty() {
            return false;
        }
        let (vnet, hdr_room) = (self.vnet, if self.vnet { virtio_net::LEN } else { 0 });
        match tun.wait_readable(wait) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(wait.max(Duration::from_millis(1)));
                return false;
            }
        }
        let Self { slots, send_buf, reply, pending, clock, .. } = self;
        let now = clock.now();
        let table = routes.load();
        pending.clear();
        let mut read_any = false;
        for i in 0..slots.len() {
            let n = match tun.read(&mut slots[i][HEADROOM - hdr_room..]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    counters.io_errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
            read_any = true;
            let Some(len) = n.checked_sub(hdr_room) else {
                counters.count_drop(DropReason::TxMalformed);
                continue;
            };
            let hdr = if vnet {
                match Header::parse(&slots[i][HEADROOM - hdr_room..HEADROOM]) {
                    Ok(h) => h,
                    Err(_) => {
                        counters.count_drop(DropReason::TxMalformed);
                        continue;
                    }
                }
            } else {
                Header::NONE
            };
            if hdr.gso_type & !virtio_net::GSO_ECN != virtio_net::GSO_NONE {
                // Packets read before this one leave before it: a flow's short segments
                // (GSO_NONE) and super-packets interleave, and reordering them would make TCP
                // see losses that never happened.
                send_pending(slots, pending, pool, send_buf, counters, now);
                pending.clear();
                send_super_packet(
                    &hdr,
                    &slots[i][HEADROOM..HEADROOM + len],
                    send_buf,
                    pool,
                    fwd,
                    &table,
                    counters,
                    tun,
                    reply,
                    now,
                );
                continue;
            }
            let slot = &mut slots[i];
            if offload::finish_checksum(&hdr, &mut slot[HEADROOM..HEADROOM + len]).is_err() {
                counters.count_drop(DropReason::TxMalformed);
                continue;
            }
            match fwd.encap(&table, slot, len, &mut reply[virtio_net::LEN..], now) {
                Tx::Send { peer, range, flow } => pending.push((i, peer, range, flow)),
                Tx::Reply { len: r, reason } => {
                    counters.count_drop(reason);
                    write_reply(tun, reply, r, vnet);
                }
                Tx::Suppressed(reason) => {
                    counters.count_drop(reason);
                    counters.icmp_suppressed.fetch_add(1, Ordering::Relaxed);
                }
                Tx::Drop(reason) => counters.count_drop(reason),
            }
        }
        send_pending(slots, pending, pool, send_buf, counters, now);
        read_any
    }
}

/// A packet encapsulated in its read slot, waiting to be sent: (slot, peer, datagram range in
/// the slot, flow hash).
type Pending = (usize, SocketAddrV4, std::ops::Range<usize>, u32);

/// Where one message of [`send_pending`] lies.
#[derive(Clone, Copy)]
enum Message {
    /// One datagram, in its read slot: `slots[slot][start..end]`.
    Slot(usize, usize, usize),
    /// A GSO run copied back to back into the coalescing buffer: `buf[start..end]`.
    Run(usize, usize, u16),
}

/// Sends the pending datagrams in order. Consecutive datagrams to one peer from one socket go
/// out as one GSO message when the socket has GSO ([`udp::coalesce_plan`]'s runs, copied back
/// to back into `buf`): the kernel then builds, forwards and (with UDP GRO at the peer)
/// receives one packet where it would handle dozens. One `sendmmsg` per stretch of messages
/// leaving from the same socket (in practice one flow, one socket).
fn send_pending<U: UdpIo>(
    slots: &[Vec<u8>],
    pending: &[Pending],
    pool: &mut [U],
    buf: &mut [u8],
    counters: &PacketCounters,
    now: Instant,
) {
    let sockets = pool.len();
    let sock_of = |p: &Pending| p.3 as usize % sockets;
    let mut msgs =
        [(0usize, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), Message::Slot(0, 0, 0)); MAX_BATCH];
    let mut i = 0;
    while i < pending.len() {
        // Plan messages until the batch, the buffer or the datagrams run out.
        let (mut n, mut used) = (0, 0);
        while i < pending.len() && n < MAX_BATCH {
            let sock = sock_of(&pending[i]);
            let stretch = pending[i..].iter().take_while(|p| sock_of(p) == sock).count();
            let max_segments = pool[sock].max_gso_segments();
            let Some(run) =
                udp::coalesce_plan(&pending[i..i + stretch], max_segments, |p| (p.1, p.2.len()))
                    .next()
            else {
                break;
            };
            let first = &pending[i];
            let message = match run.segment_size {
                Some(seg) if used + run.bytes <= buf.len() => {
                    let mut at = used;
                    for (slot, _, range, _) in &pending[i..i + run.count] {
                        buf[at..at + range.len()].copy_from_slice(&slots[*slot][range.clone()]);
                        at += range.len();
                    }
                    used = at;
                    Message::Run(at - run.bytes, at, seg)
                }
                // No room left for the run: send what is planned first.
                Some(_) if n > 0 => break,
                _ => {
                    i += 1;
                    msgs[n] = (sock, first.1, Message::Slot(first.0, first.2.start, first.2.end));
                    n += 1;
                    continue;
                }
            };
            i += run.count;
            msgs[n] = (sock, first.1, message);
            n += 1;
        }
        send_messages(&msgs[..n], slots, buf, pool, counters, now);
    }
}

/// Sends planned messages, one `sendmmsg` per stretch leaving from the same socket.
fn send_messages<U: UdpIo>(
    msgs: &[(usize, SocketAddrV4, Message)],
    slots: &[Vec<u8>],
    buf: &[u8],
    pool: &mut [U],
    counters: &PacketCounters,
    now: Instant,
) {
    let mut txs = [Transmit {
        dst: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
        contents: &[],
        segment_size: None,
    }; MAX_BATCH];
    let mut which = usize::MAX;
    let mut k = 0;
    for &(sock, dst, message) in msgs {
        if (sock != which || k == MAX_BATCH) && k > 0 {
            send_skipping(&mut pool[which], &txs[..k], now, counters);
            k = 0;
        }
        which = sock;
        txs[k] = match message {
            Message::Slot(slot, start, end) => {
                Transmit { dst, contents: &slots[slot][start..end], segment_size: None }
            }
            Message::Run(start, end, seg) => {
                Transmit { dst, contents: &buf[start..end], segment_size: Some(seg) }
            }
        };
        k += 1;
    }
    if k > 0 {
        send_skipping(&mut pool[which], &txs[..k], now, counters);
    }
}

/// Sends `txs` on `sock`, as [`UdpError::Send`] asks: a message the kernel refuses (an
/// unreachable peer, a full queue to it) is skipped, counted in `io_errors`, and the rest of
/// the batch sent again, so that one bad destination costs only its own datagrams and not those
/// queued behind it to other peers. An error of the socket itself drops the rest of the batch.
/// A send that gave up on a full send buffer (a short count) drops the rest too, each message
/// counted as [`DropReason::TxSendBufferFull`]: before, those went uncounted.
fn send_skipping<U: UdpIo>(
    sock: &mut U,
    txs: &[Transmit<'_>],
    now: Instant,
    counters: &PacketCounters,
) {
    let mut rest = txs;
    // Each pass sends or skips at least one message, so this ends.
    while !rest.is_empty() {
        match sock.send_batch(rest, now) {
            Ok(n) => {
                let n = n.min(rest.len());
                account_sent(&rest[..n], counters);
                for _ in n..rest.len() {
                    counters.count_drop(DropReason::TxSendBufferFull);
                }
                return;
            }
            Err(UdpError::Send { sent, .. }) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                let sent = sent.min(rest.len());
                account_sent(&rest[..sent], counters);
                rest = rest.get(sent + 1..).unwrap_or(&[]);
            }
            Err(UdpError::InvalidTransmit { index, .. }) => {
                // Nothing was sent: send what came before it, and go on after it.
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                let index = index.min(rest.len());
                if index > 0 {
                    send_skipping(sock, &rest[..index], now, counters);
                }
                rest = rest.get(index + 1..).unwrap_or(&[]);
            }
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// The TX loop on its own thread: [`TxPath::step`] until `stop`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_tx<T: TunIo, U: UdpIo>(
    tun: &T,
    pool: &mut [U],
    fwd: &Forwarder,
    routes: &Routes,
    counters: &PacketCounters,
    cfg: WorkerConfig,
    clock: Arc<dyn Clock>,
    stop: &AtomicBool,
) {
    let mut tx = TxPath::new(tun, &cfg, clock);
    while !stop.load(Ordering::Relaxed) {
        if tx.step(tun, pool, fwd, routes, counters, cfg.wake) {
            supervise::injected_fault();
        }
    }
}

/// Counts the messages the kernel took.
fn account_sent(txs: &[Transmit<'_>], counters: &PacketCounters) {
    let mut packets = 0u64;
    let mut bytes = 0u64;
    for t in txs {
        let seg = t.segment_size.map_or(t.contents.len(), usize::from).max(1);
        packets += t.contents.len().div_ceil(seg) as u64;
        bytes += t.contents.len() as u64;
    }
    counters.tx_packets.fetch_add(packets, Ordering::Relaxed);
    counters.tx_bytes.fetch_add(bytes, Ordering::Relaxed);
}

fn write_reply<T: TunIo>(tun: &T, reply: &mut [u8], len: usize, vnet: bool) {
    // The reply was built after room for a virtio header; send that header (zeroed) only if
    // the device expects one.
    let start = if vnet {
        zero_vnet_hdr(reply);
        0
    } else {
        virtio_net::LEN
    };
    let _ = tun.write(&reply[start..virtio_net::LEN + len]);
}

/// Routes a TSO/USO super-packet once (every segment goes where it goes), splits it into
/// segments laid out back to back with the backend's encapsulation in front of each, and sends
/// the run as GSO messages (or single datagrams without GSO).
#[allow(clippy::too_many_arguments)]
fn send_super_packet<T: TunIo, U: UdpIo>(
    hdr: &Header,
    packet: &[u8],
    out: &mut [u8],
    pool: &mut [U],
    fwd: &Forwarder,
    table: &crate::route::RouteTable,
    counters: &PacketCounters,
    tun: &T,
    reply: &mut [u8],
    now: Instant,
) {
    let route = match fwd.route(table, packet, &mut reply[virtio_net::LEN..], now) {
        Ok(r) => r,
        Err(Refusal::Reply { len, reason }) => {
            counters.count_drop(reason);
            write_reply(tun, reply, len, tun.vnet_hdr());
            return;
        }
        Err(Refusal::Suppressed(reason)) => {
            counters.count_drop(reason);
            counters.icmp_suppressed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Err(Refusal::Drop(reason)) => {
            counters.count_drop(reason);
            return;
        }
    };
    let headroom = fwd.headroom();
    let segs = match offload::split(hdr, packet, out, headroom) {
        Ok(s) => s,
        Err(_) => {
            counters.count_drop(DropReason::TxMalformed);
            return;
        }
    };
    for i in 0..segs.count() {
        let slot = segs.slot(i);
        fwd.emit_encap(&route, &mut out[slot.start..slot.start + headroom]);
    }
    // The datagrams are back to back, each `stride` long but the last: GSO messages of as
    // many as the socket takes.
    let sock = route.flow as usize % pool.len();
    let stride = segs.stride();
    let per_msg = pool[sock].max_gso_segments().min(MAX_GSO_BYTES / stride.max(1)).max(1);
    let mut txs = [Transmit { dst: route.to, contents: &[], segment_size: None }; MAX_BATCH];
    let mut k = 0;
    let mut i = 0;
    while i < segs.count() {
        let end = (i + per_msg).min(segs.count());
        txs[k] = Transmit {
            dst: route.to,
            contents: &out[segs.slot(i).start..segs.slot(end - 1).end],
            segment_size: if end - i > 1 { u16::try_from(stride).ok() } else { None },
        };
        k += 1;
        i = end;
        if k == MAX_BATCH || i == segs.count() {
            send_skipping(&mut pool[sock], &txs[..k], now, counters);
            k = 0;
        }
    }
}

/// The RX path's buffers, allocated once: UDP → validation and decapsulation → (GRO) → TUN.
pub struct RxPath {
    bufs: Vec<Vec<u8>>,
    metas: Vec<RecvMeta>,
    /// Where the decapsulated packets of a batch lie in `bufs`, for GRO.
    refs: Vec<PacketRef>,
    gro: GroTable,
    vnet: bool,
}

/// The most datagrams UDP GRO puts in one receive buffer (the kernel's `UDP_GRO_CNT_MAX`).
const GRO_SEGMENTS: usize = 64;

/// The most packets one GRO pass takes: a full batch of receive buffers, each holding as many
/// datagrams as UDP GRO coalesces.
const GRO_PASS: usize = MAX_BATCH * GRO_SEGMENTS;

impl RxPath {
    /// Buffers for batches of `cfg.batch` messages from `sock` to `tun`.
    pub fn new<T: TunIo, U: UdpIo>(tun: &T, sock: &U, cfg: &WorkerConfig) -> Self {
        let batch = cfg.batch.clamp(1, MAX_BATCH);
        let vnet = tun.vnet_hdr();
        let buf_len = if sock.gro() { udp::GRO_BUFFER_LEN } else { 65536 };
        // With TUN offloads every write carries a virtio header, and GRO coalesces inner
        // packets where they lie in the receive buffers.
        let pass = if vnet { GRO_PASS } else { 0 };
        Self {
            bufs: (0..batch).map(|_| vec![0u8; buf_len]).collect(),
            metas: vec![RecvMeta::default(); batch],
            refs: Vec::with_capacity(pass),
            gro: GroTable::new(GroConfig { tcp: cfg.gro_tcp, udp: cfg.gro_udp }, pass.max(1)),
            vnet,
        }
    }

    /// Waits up to `wait` for datagrams, then receives a batch, validates, decapsulates and
    /// writes the inner packets to TUN. Returns whether anything was received.
    pub fn step<T: TunIo, U: UdpIo>(
        &mut self,
        tun: &T,
        sock: &mut U,
        fwd: &Forwarder,
        routes: &Routes,
        counters: &PacketCounters,
        wait: Duration,
    ) -> bool {
        let Self { bufs, metas, refs, gro, vnet } = self;
        let n = match sock.recv_batch(bufs, metas, wait) {
            Ok(n) => n,
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
                return false;
            }
        };
        if n == 0 {
            return false;
        }
        let table = routes.load();
        refs.clear();
        // Counted once per batch, not per packet: an atomic add is not free even on a cache
        // line no other thread writes.
        let (mut delivered, mut delivered_bytes) = (0u64, 0u64);
        for (b, meta) in metas.iter().enumerate().take(n) {
            if meta.truncated {
                counters.count_drop(DropReason::RxMalformed);
                continue;
            }
            let len = meta.len.min(bufs[b].len());
            let seg = meta.segment_size.filter(|s| *s > 0).unwrap_or(len).max(1);
            let mut off = 0;
            while off < len {
                let end = (off + seg).min(len);
                let datagram = &mut bufs[b][off..end];
                let dlen = datagram.len();
                match fwd.decap(&table, meta.src, datagram, dlen) {
                    Rx::Deliver(r) => {
                        delivered += 1;
                        delivered_bytes += r.len() as u64;
                        if *vnet {
                            refs.push(PacketRef { buf: b, start: off + r.start, len: r.len() });
                        } else if tun.write(&datagram[r]).is_err() {
                            counters.io_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Rx::Drop(reason) => counters.count_drop(reason),
                }
                off = end;
            }
            // Room for the next buffer's datagrams, or write what is gathered so far.
            if refs.len() + GRO_SEGMENTS > refs.capacity() {
                write_coalesced(tun, gro, bufs, refs, counters);
                refs.clear();
            }
        }
        write_coalesced(tun, gro, bufs, refs, counters);
        counters.rx_packets.fetch_add(delivered, Ordering::Relaxed);
        counters.rx_bytes.fetch_add(delivered_bytes, Ordering::Relaxed);
        true
    }
}

/// Coalesces the packets at `refs` (TCP/UDP GRO) and writes each result to TUN with one
/// vectored write, straight from the receive buffers.
fn write_coalesced<T: TunIo>(
    tun: &T,
    gro: &mut GroTable,
    bufs: &mut [Vec<u8>],
    refs: &[PacketRef],
    counters: &PacketCounters,
) {
    if refs.is_empty() {
        return;
    }
    gro.coalesce_refs(bufs, refs);
    let bufs = &*bufs;
    let mut parts = [io::IoSlice::new(&[]); MAX_CHAIN + 1];
    for w in gro.writes() {
        let head = &bufs[w.head.buf][w.head.start..w.head.start + w.head.len];
        parts[0] = io::IoSlice::new(&w.hdr);
        parts[1] = io::IoSlice::new(head);
        let mut k = 2;
        for r in gro.appended(w, refs) {
            parts[k] = io::IoSlice::new(&bufs[r.buf][r.start..r.start + r.len]);
            k += 1;
        }
        if tun.write_vectored(&parts[..k]).is_err() {
            counters.io_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The RX loop on its own thread: [`RxPath::step`] until `stop`.
pub(crate) fn run_rx<T: TunIo, U: UdpIo>(
    tun: &T,
    sock: &mut U,
    fwd: &Forwarder,
    routes: &Routes,
    counters: &PacketCounters,
    cfg: WorkerConfig,
    stop: &AtomicBool,
) {
    let mut rx = RxPath::new(tun, sock, &cfg);
    while !stop.load(Ordering::Relaxed) {
        if rx.step(tun, sock, fwd, routes, counters, cfg.wake) {
            supervise::injected_fault();
        }
    }
}

/// Both directions on one thread: drain TX and RX without waiting, and sleep on both file
/// descriptors only when both are idle. A reply the kernel generates inside our TUN write (an
/// ICMP echo reply, a TCP ACK) is then picked up by the same thread without a wake-up, which
/// on a VM costs tens of microseconds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_both<T: TunIo, U: UdpIo>(
    tun: &T,
    pool: &mut [U],
    sock: &mut U,
    fwd: &Forwarder,
    routes: &Routes,
    counters: &PacketCounters,
    cfg: WorkerConfig,
    clock: Arc<dyn Clock>,
    stop: &AtomicBool,
) {
    let mut tx = TxPath::new(tun, &cfg, clock);
    let mut rx = RxPath::new(tun, sock, &cfg);
    while !stop.load(Ordering::Relaxed) {
        let sent = tx.step(tun, pool, fwd, routes, counters, Duration::ZERO);
        let received = rx.step(tun, sock, fwd, routes, counters, Duration::ZERO);
        if !sent && !received {
            wait_either(tun, sock, cfg.wake);
        } else {
            supervise::injected_fault();
        }
    }
}

/// Sleeps until TUN or the socket is readable, or `wake` passes.
fn wait_either<T: TunIo, U: UdpIo>(tun: &T, sock: &U, wake: Duration) {
    match (tun.poll_fd(), sock.poll_fd()) {
        (Some(a), Some(b)) => super::sys::poll_either(a, b, wake),
        // Fakes have no file descriptors: wait on TUN briefly, then look at both again.
        _ => {
            let _ = tun.wait_readable(wake.min(Duration::from_millis(1)));
        }
    }
}

/// One queue's worth of forwarding: its TUN queue, its sockets and what they share.
pub struct Worker<T, U> {
    /// The TUN queue.
    pub tun: Arc<T>,
    /// Sockets datagrams leave from (picked by flow hash).
    pub tx_pool: Vec<U>,
    /// The socket on the backend port.
    pub rx: U,
    /// The forwarding configuration.
    pub fwd: Forwarder,
    /// The route table.
    pub routes: Arc<Routes>,
    /// The data plane's counters; each thread counts in its own block of them
    /// ([`Counters::thread`](super::counters::Counters::thread), by thread name).
    pub counters: Arc<Counters>,
    /// Batch size and timing.
    pub cfg: WorkerConfig,
    /// Where `now` comes from (the ICMP rate limit, restart back-off).
    pub clock: Arc<dyn Clock>,
    /// Where the threads report panics; see [`supervise`].
    pub states: Arc<WorkerStates>,
}

impl<T: TunIo + 'static, U: UdpIo + 'static> Worker<T, U> {
    /// Runs the worker until `stop` is set: [`run_both`] on one thread named `<name>`, or
    /// [`run_tx`] and [`run_rx`] on two named `<name>-tx` and `<name>-rx`. Each thread runs
    /// under [`supervise`]: a panic is caught, reported in `states`, and the loop restarted
    /// with fresh buffers on the same queue and sockets (both stay valid: a panic leaves no
    /// half-written state in a file descriptor).
    pub fn spawn(
        self,
        name: &str,
        stop: Arc<AtomicBool>,
    ) -> io::Result<Vec<std::thread::JoinHandle<()>>> {
        let Self { tun, mut tx_pool, mut rx, fwd, routes, counters, cfg, clock, states } = self;
        let policy = RestartPolicy::default();
        if cfg.one_thread {
            let thread = name.to_owned();
            let counters = counters.thread(&thread);
            let t = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
                supervise(&thread, &states, policy, &*clock, &stop, || {
                    run_both(
                        &*tun,
                        &mut tx_pool,
                        &mut rx,
                        &fwd,
                        &routes,
                        &counters,
                        cfg,
                        clock.clone(),
                        &stop,
                    )
                })
            })?;
            return Ok(vec![t]);
        }
        let tx = {
            let thread = format!("{name}-tx");
            let (tun, fwd, routes, counters, stop, states, clock) = (
                tun.clone(),
                fwd.clone(),
                routes.clone(),
                counters.thread(&thread),
                stop.clone(),
                states.clone(),
                clock.clone(),
            );
            std::thread::Builder::new().name(thread.clone()).spawn(move || {
                supervise(&thread, &states, policy, &*clock, &stop, || {
                    run_tx(&*tun, &mut tx_pool, &fwd, &routes, &counters, cfg, clock.clone(), &stop)
                })
            })?
        };
        let thread = format!("{name}-rx");
        let counters = counters.thread(&thread);
        let rx = std::thread::Builder::new().name(thread.clone()).spawn(move || {
            supervise(&thread, &states, policy, &*clock, &stop, || {
                run_rx(&*tun, &mut rx, &fwd, &routes, &counters, cfg, &stop)
            })
        })?;
        Ok(vec![tx, rx])
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::config::BackendKind;
    use crate::dataplane::fake::{FakeNet, FakeTun};
    use crate::dataplane::offload::testutil::Pkt;
    use crate::dataplane::pipeline::OwnSubnet;
    use crate::dataplane::wire::{ethernet::MacAddr, read_u32, vxlan::Vni};
    use crate::route::{Peer, PeerBackend, RouteTable};

    /// A socket on which the kernel refuses every message to `bad` (EHOSTUNREACH), the way
    /// sendmmsg reports it: the messages before it sent, an error for it.
    struct Refusing {
        bad: SocketAddrV4,
        sent: Vec<SocketAddrV4>,
    }

    impl UdpIo for Refusing {
        fn send_batch(&mut self, msgs: &[Transmit<'_>], _now: Instant) -> Result<usize, UdpError> {
            for (i, m) in msgs.iter().enumerate() {
                if m.dst == self.bad {
                    let source = io::Error::from_raw_os_error(libc::EHOSTUNREACH);
                    return Err(UdpError::Send { sent: i, source });
                }
                self.sent.push(m.dst);
            }
            Ok(msgs.len())
        }
        fn recv_batch(
            &mut self,
            _: &mut [Vec<u8>],
            _: &mut [RecvMeta],
            _: Duration,
        ) -> Result<usize, UdpError> {
            Ok(0)
        }
        fn max_gso_segments(&self) -> usize {
            1
        }
        fn gro(&self) -> bool {
            false
        }
    }

    /// A socket whose send buffer has room for `room` messages, then stays full (as
    /// `BatchSocket::send_batch` reports it: the count sent, after its waits for room).
    struct Full {
        room: usize,
    }

    impl UdpIo for Full {
        fn send_batch(&mut self, msgs: &[Transmit<'_>], _now: Instant) -> Result<usize, UdpError> {
            let n = msgs.len().min(self.room);
            self.room -= n;
            Ok(n)
        }
        fn recv_batch(
            &mut self,
            _: &mut [Vec<u8>],
            _: &mut [RecvMeta],
            _: Duration,
        ) -> Result<usize, UdpError> {
            Ok(0)
        }
        fn max_gso_segments(&self) -> usize {
            1
        }
        fn gro(&self) -> bool {
            false
        }
    }

    #[test]
    fn datagrams_left_behind_by_a_full_send_buffer_are_counted_as_drops() {
        let payload = [0u8; 100];
        let dst = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472);
        let txs = [Transmit { dst, contents: &payload, segment_size: None }; 5];
        let counters = PacketCounters::default();
        send_skipping(&mut Full { room: 2 }, &txs, Instant::ZERO, &counters);
        let mut totals = crate::dataplane::counters::PacketTotals::default();
        counters.add_to(&mut totals);
        assert_eq!(totals.tx_packets, 2);
        assert_eq!(totals.drops(DropReason::TxSendBufferFull), 3);
        assert_eq!(totals.io_errors, 0);
    }

    #[test]
    fn a_refused_message_costs_only_itself_not_the_batch_behind_it() {
        let peer = |d| SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, d), 8472);
        let mut sock = Refusing { bad: peer(9), sent: Vec::new() };
        let payload = [0u8; 100];
        let to = [peer(2), peer(9), peer(3), peer(9), peer(4)];
        let txs: Vec<Transmit<'_>> = to
            .iter()
            .map(|&dst| Transmit { dst, contents: &payload, segment_size: None })
            .collect();
        let counters = PacketCounters::default();
        send_skipping(&mut sock, &txs, Instant::ZERO, &counters);
        assert_eq!(sock.sent, vec![peer(2), peer(3), peer(4)], "live peers lost datagrams");
        assert_eq!(counters.io_errors.load(Ordering::Relaxed), 2);
        assert_eq!(counters.tx_packets.load(Ordering::Relaxed), 3);
        assert_eq!(counters.tx_bytes.load(Ordering::Relaxed), 300);
    }
    /// A TSO super-packet read after a short segment of the same flow (which the kernel hands
    /// over as GSO_NONE) must not overtake it: TCP reads reordering as loss.
    #[test]
    fn short_segments_and_super_packets_leave_in_the_order_read() {
        for backend in [BackendKind::Vxlan, BackendKind::Udp] {
            segments_leave_in_order(backend);
        }
    }

    /// Host `n` (10.244.n.0/24 behind 192.0.2.n) knowing host `peer`: its forwarder and routes.
    fn host(backend: BackendKind, n: u8, peer: u8) -> (Forwarder, Routes) {
        let peer_backend =
            if backend == BackendKind::Vxlan { PeerBackend::Vxlan } else { PeerBackend::Udp };
        let routes = Routes::new(RouteTable::build(
            "10.244.0.0/16".parse().unwrap(),
            24,
            [Peer {
                subnet: format!("10.244.{peer}.0/24").parse().unwrap(),
                public_ip: Ipv4Addr::new(192, 0, 2, peer),
                backend: peer_backend,
                vtep_mac: Some(MacAddr([2, 0, 0, 0, 0, peer])),
                vni: Some(1),
                node: None,
                stale: false,
            }],
        ));
        let own = Arc::new(OwnSubnet::default());
        own.set(Some(format!("10.244.{n}.0/24").parse().unwrap()));
        let fwd = Forwarder {
            backend,
            vni: Vni::new(1).unwrap(),
            port: 8472,
            our_mac: MacAddr([2, 0, 0, 0, 0, n]),
            own,
            icmp_source: Ipv4Addr::new(10, 244, 0, 0),
            icmp_limit: Arc::default(),
        };
        (fwd, routes)
    }

    fn clock() -> Arc<dyn Clock> {
        Arc::new(crate::time::ManualClock::new())
    }

    const CFG: WorkerConfig = WorkerConfig {
        batch: 16,
        wake: Duration::from_millis(10),
        gro_tcp: true,
        gro_udp: false,
        one_thread: true,
    };

    /// Reads into host 1's TUN (with offloads) one flow's seq 1000..1500 alone, then
    /// 1500..4500 as a TSO super-packet of 1000-byte segments, then 4500..4600 alone; and
    /// returns the bytes of the stream.
    fn inject_stream(tun: &FakeTun) -> Vec<u8> {
        let tso = Header {
            flags: 0,
            gso_type: virtio_net::GSO_TCPV4,
            hdr_len: 40,
            gso_size: 1000,
            csum_start: 20,
            csum_offset: 16,
        };
        let mut stream = Vec::new();
        for (seq, len, hdr) in
            [(1000, 500, Header::NONE), (1500, 3000, tso), (4500, 100, Header::NONE)]
        {
            let mut p = Pkt::tcp4(len);
            p.seq = seq;
            let mut frame = vec![0u8; virtio_net::LEN];
            hdr.emit(&mut frame).unwrap();
            frame.extend(p.build());
            tun.inject(&frame);
            stream.extend(&p.payload);
        }
        stream
    }

    /// Datagrams from host 1 reach host 2's RX path, which coalesces the segments where they
    /// lie and writes each run to TUN with one vectored write.
    #[test]
    fn received_segments_are_coalesced_into_one_write() {
        let net = FakeNet::new();
        let (tun1, tun2) = (FakeTun::with_vnet_hdr(), FakeTun::with_vnet_hdr());
        let mut pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001))];
        let mut sock2 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
        let ((fwd1, routes1), (fwd2, routes2)) =
            (host(BackendKind::Vxlan, 1, 2), host(BackendKind::Vxlan, 2, 1));
        let (c1, c2) = (PacketCounters::default(), PacketCounters::default());
        let stream = inject_stream(&tun1);
        let mut tx = TxPath::new(&*tun1, &CFG, clock());
        assert!(tx.step(&*tun1, &mut pool, &fwd1, &routes1, &c1, Duration::from_secs(1)));
        let mut rx = RxPath::new(&*tun2, &sock2, &CFG);
        assert!(rx.step(&*tun2, &mut sock2, &fwd2, &routes2, &c2, Duration::from_secs(1)));
        assert_eq!(c2.rx_packets.load(Ordering::Relaxed), 5);

        // The 500-byte segment alone (a larger one cannot follow it), then the rest merged.
        let alone = tun2.take_written(Duration::ZERO).expect("first write");
        assert_eq!(Header::parse(&alone).unwrap(), Header::NONE);
        let merged = tun2.take_written(Duration::ZERO).expect("second write");
        assert!(tun2.take_written(Duration::ZERO).is_none());
        let hdr = Header::parse(&merged).unwrap();
        assert_eq!((hdr.gso_type, hdr.gso_size), (virtio_net::GSO_TCPV4, 1000));
        let (p1, p2) = (&alone[virtio_net::LEN..], &merged[virtio_net::LEN..]);
        assert_eq!(usize::from(u16::from_be_bytes([p2[2], p2[3]])), p2.len());
        let mut got = p1[40..].to_vec();
        got.extend_from_slice(&p2[40..]);
        assert_eq!(got, stream);
    }

    /// Single datagrams to one peer leave as one GSO message: equal sizes, the last one
    /// shorter; a longer one starts the next message.
    #[test]
    fn single_datagrams_to_one_peer_share_a_gso_message() {
        let net = FakeNet::new();
        let tun = FakeTun::with_vnet_hdr();
        let mut pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001))];
        let mut peer_sock = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
        let (fwd, routes) = host(BackendKind::Vxlan, 1, 2);
        let counters = PacketCounters::default();
        let sizes = [1000, 1000, 1000, 1000, 600, 1200, 1200];
        for (i, size) in sizes.into_iter().enumerate() {
            let mut p = Pkt::tcp4(size);
            p.seq = i as u32;
            let mut frame = vec![0u8; virtio_net::LEN];
            frame.extend(p.build());
            tun.inject(&frame);
        }
        let mut tx = TxPath::new(&*tun, &CFG, clock());
        assert!(tx.step(&*tun, &mut pool, &fwd, &routes, &counters, Duration::from_secs(1)));
        assert_eq!(pool[0].messages_sent(), 2);
        let mut bufs = vec![vec![0u8; 2048]; 16];
        let mut metas = vec![RecvMeta::default(); 16];
        let n = peer_sock.recv_batch(&mut bufs, &mut metas, Duration::from_secs(1)).unwrap();
        let got: Vec<(u32, usize)> = bufs[..n]
            .iter()
            .zip(&metas)
            .map(|(b, m)| (read_u32(b, HEADROOM + 20 + 4), m.len - HEADROOM - 40))
            .collect();
        let want: Vec<(u32, usize)> =
            sizes.into_iter().enumerate().map(|(i, s)| (i as u32, s)).collect();
        assert_eq!(got, want);
        assert_eq!(counters.tx_packets.load(Ordering::Relaxed), 7);
    }

    /// A socket that turned GSO off sends one datagram per message. (The `udp_gso` gauge follows
    /// the sockets' state in the driver: see `driver::tests`.)
    #[test]
    fn a_socket_with_gso_off_sends_one_datagram_per_message() {
        let net = FakeNet::new();
        let tun = FakeTun::with_vnet_hdr();
        let mut pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001))];
        let _peer = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
        let (fwd, routes) = host(BackendKind::Vxlan, 1, 2);
        let counters = PacketCounters::default();
        pool[0].set_gso(false);
        inject_stream(&tun);
        let mut tx = TxPath::new(&*tun, &CFG, clock());
        assert!(tx.step(&*tun, &mut pool, &fwd, &routes, &counters, Duration::from_secs(1)));
        assert_eq!(pool[0].messages_sent(), 5);
    }

    fn segments_leave_in_order(backend: BackendKind) {
        let net = FakeNet::new();
        let tun = FakeTun::with_vnet_hdr();
        let mut pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001))];
        let mut peer_sock = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
        let (fwd, routes) = host(backend, 1, 2);
        let counters = PacketCounters::default();
        inject_stream(&tun);
        let mut tx = TxPath::new(&*tun, &CFG, clock());
        assert!(tx.step(&*tun, &mut pool, &fwd, &routes, &counters, Duration::from_secs(1)));

        let mut bufs = vec![vec![0u8; 2048]; 16];
        let mut metas = vec![RecvMeta::default(); 16];
        let n = peer_sock.recv_batch(&mut bufs, &mut metas, Duration::from_secs(1)).unwrap();
        // The encapsulation (VXLAN and inner Ethernet, or nothing), IPv4 (20), then the TCP
        // sequence number at 4.
        let at = fwd.headroom() + 20 + 4;
        let seqs: Vec<u32> = bufs[..n].iter().map(|b| read_u32(b, at)).collect();
        assert_eq!(seqs, [1000, 1500, 2500, 3500, 4500], "{backend:?}");
        let lens: Vec<usize> = metas[..n].iter().map(|m| m.len - fwd.headroom()).collect();
        assert_eq!(lens, [540, 1040, 1040, 1040, 140], "{backend:?}");
        assert_eq!(counters.tx_packets.load(Ordering::Relaxed), 5);
        // The short segment, the super-packet's three segments as one GSO message, the tail.
        assert_eq!(pool[0].messages_sent(), 3, "{backend:?}");
    }
}
