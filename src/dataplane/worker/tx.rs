//! The TX path: TUN → encapsulation → UDP. Reads a batch from one TUN queue, routes and
//! encapsulates each packet (a TSO/USO super-packet once, split into segments), and sends the
//! datagrams in the order read, as [`super::plan`] lays them out.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Context;
use super::WorkerConfig;
use super::io::{TunIo, UdpIo};
use super::plan::{Carries, Pending, Planned, TxPlan};
use crate::dataplane::offload;
use crate::dataplane::sys::udp::{MAX_BATCH, Transmit, UdpError};
use crate::dataplane::transport::wireguard::{self, Devices, Sealed, Sessions, WgPublicKey};
use crate::dataplane::transport::{DropReason, HEADROOM, Refusal, Tx};
use crate::dataplane::wire::virtio_net::{self, Header};
use crate::dataplane::worker::counters::{Direction, PacketCounters};
use crate::time::{Clock, Instant};

/// The largest packet a TUN read returns with offloads (64 KiB super-packet) plus its header.
pub(super) const READ_LEN: usize = virtio_net::LEN + 65535;

/// Room for what is laid out for sending: one split super-packet (64 KiB of payload cut into
/// segments as small as 536 bytes, each with its headers and encapsulation headroom), or the
/// GSO runs of a batch of single datagrams.
const SEND_BUF_LEN: usize = 256 * 1024;

fn zero_vnet_hdr(buf: &mut [u8]) {
    buf[..virtio_net::LEN].fill(0);
}

/// Where the TX path lays out what it sends besides the read slots.
struct Scratch {
    /// Where super-packets are split and GSO runs laid out back to back.
    send_buf: Vec<u8>,
    /// An ICMP error for a pod, behind room for a `virtio_net_hdr`.
    reply: Vec<u8>,
    /// wireguard: where a super-packet is split before each segment is sealed (allocated on
    /// the first one).
    split_buf: Vec<u8>,
    /// wireguard: the sealed datagrams laid out in `send_buf` so far, in the order read.
    sealed: Vec<(SocketAddr, Range<usize>)>,
    /// wireguard: where the next sealed datagram goes in `send_buf`.
    sealed_at: usize,
}

/// The TX path's buffers, allocated once: TUN → encapsulation → UDP.
pub struct TxPath {
    slots: Vec<Vec<u8>>,
    scratch: Scratch,
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
            scratch: Scratch {
                send_buf: vec![0u8; SEND_BUF_LEN],
                reply: vec![0u8; virtio_net::LEN + 1500],
                split_buf: Vec::new(),
                sealed: Vec::new(),
                sealed_at: 0,
            },
            pending: Vec::with_capacity(batch),
            vnet,
            clock,
        }
    }

    /// Reads what is queued on TUN (one batch, without waiting), encapsulates and sends it.
    /// `pool` holds the sockets datagrams leave from; the inner flow's hash picks one, so the
    /// outer source port is stable per flow. Returns how many bytes were read (what the
    /// caller's [`super::spin::SpinPolicy`] weighs): 0 means the queue was found empty (or
    /// failed), and the caller may sleep on it.
    pub fn step<T: TunIo, U: UdpIo>(&mut self, cx: &Context<'_, T>, pool: &mut [U]) -> usize {
        let &Context { tun, fwd, routes, counters } = cx;
        if pool.is_empty() {
            return 0;
        }
        let (vnet, hdr_room) = (self.vnet, if self.vnet { virtio_net::LEN } else { 0 });
        let Self { slots, scratch, pending, clock, .. } = self;
        let now = clock.now();
        let table = routes.load();
        pending.clear();
        let mut read = 0usize;
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
            read += n;
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
            if let Some(wg) = fwd.wireguard.as_deref() {
                let packet = &mut slots[i][HEADROOM..HEADROOM + len];
                seal_read(cx, wg, &hdr, packet, scratch, pool, &table, now);
                continue;
            }
            if hdr.gso_type & !virtio_net::GSO_ECN != virtio_net::GSO_NONE {
                // Packets read before this one leave before it: a flow's short segments
                // (GSO_NONE) and super-packets interleave, and reordering them would make TCP
                // see losses that never happened.
                send_pending(slots, pending, pool, &mut scratch.send_buf, counters, now);
                pending.clear();
                let packet = &slots[i][HEADROOM..HEADROOM + len];
                send_super_packet(cx, &hdr, packet, scratch, pool, &table, now);
                continue;
            }
            let slot = &mut slots[i];
            if offload::finish_checksum(&hdr, &mut slot[HEADROOM..HEADROOM + len]).is_err() {
                counters.count_drop(DropReason::TxMalformed);
                continue;
            }
            match fwd.encap(&table, slot, len, &mut scratch.reply[virtio_net::LEN..], now) {
                Tx::Send { peer, range, flow } => {
                    counters.carried(flow, Direction::Tx);
                    pending.push(Pending { slot: i, dst: peer, range, flow })
                }
                Tx::Reply { len: r, reason } => {
                    counters.count_drop(reason);
                    write_reply(tun, &mut scratch.reply, r, vnet);
                }
                Tx::Suppressed(reason) => {
                    counters.count_drop(reason);
                    counters.icmp_suppressed.fetch_add(1, Ordering::Relaxed);
                }
                Tx::Drop(reason) => counters.count_drop(reason),
            }
        }
        send_pending(slots, pending, pool, &mut scratch.send_buf, counters, now);
        flush_sealed(scratch, pool, counters, now);
        if read > 0 {
            counters.tx_batches.fetch_add(1, Ordering::Relaxed);
        }
        read
    }
}

/// Sends the pending datagrams in order, as [`TxPlan`] lays them out: consecutive datagrams to
/// one peer from one socket go out as one GSO message when the socket has GSO, copied back to
/// back into `buf` (the kernel then builds, forwards and, with UDP GRO at the peer, receives
/// one packet where it would handle dozens), the rest from their read slots; one `sendmmsg`
/// per stretch of messages leaving from the same socket (in practice one flow, one socket).
fn send_pending<U: UdpIo>(
    slots: &[Vec<u8>],
    pending: &[Pending],
    pool: &mut [U],
    buf: &mut [u8],
    counters: &PacketCounters,
    now: Instant,
) {
    if pool.is_empty() {
        return;
    }
    let mut plan = TxPlan::new(pending);
    let mut msgs = [Planned {
        sock: 0,
        dst: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
        what: Carries::One { index: 0 },
    }; MAX_BATCH];
    loop {
        let n = plan.next_batch(pool.len(), |s| pool[s].gso_limits(), buf.len(), &mut msgs);
        if n == 0 {
            return;
        }
        for m in &msgs[..n] {
            if let Carries::Run { first, count, start, .. } = m.what {
                let mut at = start;
                for p in &pending[first..first + count] {
                    buf[at..at + p.range.len()].copy_from_slice(&slots[p.slot][p.range.clone()]);
                    at += p.range.len();
                }
            }
        }
        send_messages(&msgs[..n], pending, slots, buf, pool, counters, now);
    }
}

/// Sends planned messages, one `sendmmsg` per stretch leaving from the same socket.
fn send_messages<U: UdpIo>(
    msgs: &[Planned],
    pending: &[Pending],
    slots: &[Vec<u8>],
    buf: &[u8],
    pool: &mut [U],
    counters: &PacketCounters,
    now: Instant,
) {
    let mut txs = [Transmit {
        dst: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
        contents: &[],
        segment_size: None,
    }; MAX_BATCH];
    let mut which = usize::MAX;
    let mut k = 0;
    for m in msgs {
        if (m.sock != which || k == MAX_BATCH) && k > 0 {
            send_skipping(&mut pool[which], &txs[..k], now, counters);
            k = 0;
        }
        which = m.sock;
        txs[k] = match m.what {
            Carries::One { index } => {
                let p = &pending[index];
                Transmit {
                    dst: m.dst,
                    contents: &slots[p.slot][p.range.clone()],
                    segment_size: None,
                }
            }
            Carries::Run { start, bytes, segment_size, .. } => Transmit {
                dst: m.dst,
                contents: &buf[start..start + bytes],
                segment_size: Some(segment_size),
            },
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
/// counted as [`DropReason::TxSendBufferFull`].
pub(super) fn send_skipping<U: UdpIo>(
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
fn send_super_packet<T: TunIo, U: UdpIo>(
    cx: &Context<'_, T>,
    hdr: &Header,
    packet: &[u8],
    scratch: &mut Scratch,
    pool: &mut [U],
    table: &crate::route::RouteTable,
    now: Instant,
) {
    let &Context { fwd, counters, .. } = cx;
    let Scratch { send_buf: out, reply, .. } = scratch;
    let route = match fwd.route(table, packet, &mut reply[virtio_net::LEN..], now) {
        Ok(r) => r,
        Err(refusal) => return refuse(cx, refusal, reply),
    };
    counters.carried(route.flow, Direction::Tx);
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
        fwd.emit_encap(&route, &mut out[slot]);
    }
    // The datagrams are back to back, each `stride` long but the last: GSO messages of as
    // many as the socket takes.
    let sock = route.flow as usize % pool.len();
    let stride = segs.stride();
    let limits = pool[sock].gso_limits();
    let per_msg = limits.segments.min(limits.bytes / stride.max(1)).max(1);
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

/// Counts a packet [`crate::dataplane::transport::Forwarder::route`] refused, and writes the
/// ICMP error it made (in `reply`, behind room for a `virtio_net_hdr`) back to TUN.
fn refuse<T: TunIo>(cx: &Context<'_, T>, refusal: Refusal, reply: &mut [u8]) {
    let &Context { tun, counters, .. } = cx;
    match refusal {
        Refusal::Reply { len, reason } => {
            counters.count_drop(reason);
            write_reply(tun, reply, len, tun.vnet_hdr());
        }
        Refusal::Suppressed(reason) => {
            counters.count_drop(reason);
            counters.icmp_suppressed.fetch_add(1, Ordering::Relaxed);
        }
        Refusal::Drop(reason) => counters.count_drop(reason),
    }
}

/// wireguard: routes a packet read from TUN and seals it (a super-packet: each of its segments)
/// into `scratch`'s send buffer, after the datagrams sealed before it; they leave together at
/// [`flush_sealed`], in the order read. A packet waiting for a handshake stays in its peer's
/// queue and the handshake initiation is sent in its place.
#[allow(clippy::too_many_arguments)]
fn seal_read<T: TunIo, U: UdpIo>(
    cx: &Context<'_, T>,
    wg: &Devices,
    hdr: &Header,
    packet: &mut [u8],
    scratch: &mut Scratch,
    pool: &mut [U],
    table: &crate::route::RouteTable,
    now: Instant,
) {
    let &Context { fwd, counters, .. } = cx;
    let route = match fwd.route(table, packet, &mut scratch.reply[virtio_net::LEN..], now) {
        Ok(r) => r,
        Err(refusal) => return refuse(cx, refusal, &mut scratch.reply),
    };
    counters.carried(route.flow, Direction::Tx);
    let Some(key) = route.peer_key else {
        counters.count_drop(DropReason::TxBackendMismatch);
        return;
    };
    // The device of the underlay family the packet leaves over (flannel's `Mode` separate).
    let wg = wg.of(route.to);
    if hdr.gso_type & !virtio_net::GSO_ECN == virtio_net::GSO_NONE {
        if offload::finish_checksum(hdr, packet).is_err() {
            counters.count_drop(DropReason::TxMalformed);
            return;
        }
        return seal_one(wg, &key, packet, scratch, pool, counters, now);
    }
    if scratch.split_buf.is_empty() {
        scratch.split_buf = vec![0u8; SEND_BUF_LEN];
    }
    let mut split_buf = std::mem::take(&mut scratch.split_buf);
    match offload::split(hdr, packet, &mut split_buf, 0) {
        Ok(segs) => {
            for i in 0..segs.count() {
                seal_one(wg, &key, &split_buf[segs.slot(i)], scratch, pool, counters, now);
            }
        }
        Err(_) => counters.count_drop(DropReason::TxMalformed),
    }
    scratch.split_buf = split_buf;
}

/// Seals one inner packet for `key`'s session at the end of the sealed datagrams (sending
/// those first when the buffer is full).
fn seal_one<U: UdpIo>(
    wg: &Sessions,
    key: &WgPublicKey,
    packet: &[u8],
    scratch: &mut Scratch,
    pool: &mut [U],
    counters: &PacketCounters,
    now: Instant,
) {
    let room = (packet.len() + wireguard::OVERHEAD + wireguard::MAX_PADDING)
        .max(wireguard::HANDSHAKE_INIT_LEN);
    if scratch.sealed_at + room > scratch.send_buf.len() || scratch.sealed.len() == SEALED_MAX {
        flush_sealed(scratch, pool, counters, now);
    }
    let at = scratch.sealed_at;
    match wg.seal(key, packet, &mut scratch.send_buf[at..]) {
        Sealed::Send { to, len } | Sealed::Handshake { to, len } => {
            scratch.sealed.push((to, at..at + len));
            scratch.sealed_at = at + len;
        }
        Sealed::Queued => {}
        Sealed::Drop(reason) => counters.count_drop(reason),
    }
}

/// The most sealed datagrams gathered before they are sent.
const SEALED_MAX: usize = 1024;

/// wireguard: sends the sealed datagrams, in order. A stretch of datagrams to one peer of one
/// size (the last of it may be shorter: a super-packet's segments, a bulk flow's full-sized
/// packets) lies back to back in the send buffer and goes as one GSO message, as the socket's
/// limits allow. A wireguard worker sends from its one socket, on the listen port: WireGuard
/// peers answer the address a datagram came from.
fn flush_sealed<U: UdpIo>(
    scratch: &mut Scratch,
    pool: &mut [U],
    counters: &PacketCounters,
    now: Instant,
) {
    let Scratch { send_buf, sealed, sealed_at, .. } = scratch;
    if sealed.is_empty() || pool.is_empty() {
        sealed.clear();
        *sealed_at = 0;
        return;
    }
    let sock = &mut pool[0];
    let limits = sock.gso_limits();
    let mut txs = [Transmit {
        dst: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
        contents: &[],
        segment_size: None,
    }; MAX_BATCH];
    let mut k = 0;
    let mut i = 0;
    while i < sealed.len() {
        let (dst, first) = (sealed[i].0, sealed[i].1.clone());
        let size = first.len();
        let per_msg = limits.segments.min(limits.bytes / size.max(1)).max(1);
        let mut end = first.end;
        let mut j = i + 1;
        while j < sealed.len() && j - i < per_msg {
            let (d, r) = (&sealed[j].0, &sealed[j].1);
            if *d != dst || r.start != end || r.len() > size {
                break;
            }
            end = r.end;
            j += 1;
            if r.len() < size {
                break;
            }
        }
        txs[k] = Transmit {
            dst,
            contents: &send_buf[first.start..end],
            segment_size: if j - i > 1 { u16::try_from(size).ok() } else { None },
        };
        k += 1;
        i = j;
        if k == MAX_BATCH {
            send_skipping(sock, &txs[..k], now, counters);
            k = 0;
        }
    }
    if k > 0 {
        send_skipping(sock, &txs[..k], now, counters);
    }
    sealed.clear();
    *sealed_at = 0;
}
