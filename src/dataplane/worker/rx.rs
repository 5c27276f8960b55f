//! The RX path: UDP → validation and decapsulation → (GRO) → TUN. A peer whose datagrams
//! arrive malformed at a rate is said once at WARN ([`crate::dataplane::transport::malformed_peers`]).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::warn;

use super::Context;
use super::WorkerConfig;
use super::io::{TunIo, UdpIo};
use crate::dataplane::offload::{GroConfig, GroTable, MAX_CHAIN, PacketRef};
use crate::dataplane::sys::udp::{self, MAX_BATCH, RecvMeta, Transmit};
use crate::dataplane::transport::malformed_peers::{Alarm, MalformedWatch};
use crate::dataplane::transport::wireguard::{Opened, Sessions, WgPublicKey};
use crate::dataplane::transport::{DropReason, Forwarder, Rx};
use crate::dataplane::wire;
use crate::dataplane::worker::counters::{Direction, PacketCounters};
use crate::route::RouteTable;
use crate::time::{Clock, Instant};

/// The RX path's buffers, allocated once: UDP → validation and decapsulation → (GRO) → TUN.
pub struct RxPath {
    bufs: Vec<Vec<u8>>,
    metas: Vec<RecvMeta>,
    /// Where the decapsulated packets of a batch lie in `bufs`, for GRO.
    refs: Vec<PacketRef>,
    gro: GroTable,
    vnet: bool,
    /// Peers' suspect datagrams, counted for [`crate::dataplane::transport::malformed_peers`].
    watch: MalformedWatch,
    clock: Arc<dyn Clock>,
    /// wireguard: where datagrams are opened, each at the offset it was received at in its
    /// buffer of `bufs` (so GRO sees the inner packets laid out as it expects); allocated on
    /// the first wireguard batch.
    opened: Vec<Vec<u8>>,
    /// wireguard: where a peer's queued packets are sealed once its handshake completes.
    drained: Vec<u8>,
}

/// The most datagrams UDP GRO puts in one receive buffer (the kernel's `UDP_GRO_CNT_MAX`).
const GRO_SEGMENTS: usize = 64;

/// The most packets one GRO pass takes: a full batch of receive buffers, each holding as many
/// datagrams as UDP GRO coalesces.
const GRO_PASS: usize = MAX_BATCH * GRO_SEGMENTS;

impl RxPath {
    /// Buffers for batches of `cfg.batch` messages from `sock` to `tun`; `clock` dates the
    /// suspect datagrams ([`crate::dataplane::transport::malformed_peers`]).
    pub fn new<T: TunIo, U: UdpIo>(
        tun: &T,
        sock: &U,
        cfg: &WorkerConfig,
        clock: Arc<dyn Clock>,
    ) -> Self {
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
            watch: MalformedWatch::new(),
            clock,
            opened: Vec::new(),
            drained: Vec::new(),
        }
    }

    /// Receives a batch (without waiting), validates, decapsulates and writes the inner
    /// packets to TUN. Returns how many bytes were received (what the caller's
    /// [`super::spin::SpinPolicy`] weighs): 0 means the socket was found empty (or failed), and
    /// the caller may sleep on it.
    pub fn step<T: TunIo, U: UdpIo>(&mut self, cx: &Context<'_, T>, sock: &mut U) -> usize {
        let &Context { tun, fwd, routes, counters } = cx;
        let Self { bufs, metas, refs, gro, vnet, watch, clock, opened, drained } = self;
        let wg = fwd.wireguard.as_deref();
        if wg.is_some() && opened.len() != bufs.len() {
            *opened = bufs.iter().map(|b| vec![0u8; b.len()]).collect();
            *drained = vec![0u8; DRAINED_LEN];
        }
        let n = match sock.recv_batch(bufs, metas, Duration::ZERO) {
            Ok(n) => n,
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
                return 0;
            }
        };
        if n == 0 {
            return 0;
        }
        counters.rx_batches.fetch_add(1, Ordering::Relaxed);
        let table = routes.load();
        refs.clear();
        // Counted once per batch, not per packet: an atomic add is not free even on a cache
        // line no other thread writes.
        let (mut delivered, mut delivered_bytes) = (0u64, 0u64);
        let mut received = 0usize;
        for (b, meta) in metas.iter().enumerate().take(n) {
            if meta.truncated {
                counters.count_drop(DropReason::RxTruncated);
                continue;
            }
            let len = meta.len.min(bufs[b].len());
            received += len;
            let seg = meta.segment_size.filter(|s| *s > 0).unwrap_or(len).max(1);
            // One flow per buffer is looked at (its first inner packet): a buffer's datagrams
            // share an outer 5-tuple, so in practice one inner flow.
            let mut flow_seen = false;
            let mut off = 0;
            while off < len {
                let end = (off + seg).min(len);
                let datagram = &mut bufs[b][off..end];
                let dlen = datagram.len();
                if let Some(wg) = wg {
                    let out = &mut opened[b][off..];
                    let sealed = Sealed { src: meta.src, datagram, clock: &**clock };
                    let wg = wg.of(meta.src);
                    if let Some(r) = open(wg, fwd, &sealed, out, sock, drained, counters) {
                        if !flow_seen {
                            counters.carried(wire::flow_hash(&out[r.clone()]), Direction::Rx);
                            flow_seen = true;
                        }
                        delivered += 1;
                        delivered_bytes += r.len() as u64;
                        if *vnet {
                            refs.push(PacketRef {
                                buf: b,
                                start: off + r.start,
                                len: r.len(),
                                // Authenticated: what the peer sealed arrived unchanged,
                                // and it sealed packets whose checksums it had completed
                                // (the kernel's WireGuard marks them verified too).
                                checksums_trusted: true,
                            });
                        } else if tun.write(&out[r]).is_err() {
                            counters.io_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    off = end;
                    continue;
                }
                match fwd.decap(&table, meta.src, datagram, dlen) {
                    Rx::Deliver { range: r, checksums_trusted } => {
                        if !flow_seen {
                            counters.carried(wire::flow_hash(&datagram[r.clone()]), Direction::Rx);
                            flow_seen = true;
                        }
                        delivered += 1;
                        delivered_bytes += r.len() as u64;
                        if *vnet {
                            refs.push(PacketRef {
                                buf: b,
                                start: off + r.start,
                                len: r.len(),
                                checksums_trusted,
                            });
                        } else if tun.write(&datagram[r]).is_err() {
                            counters.io_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Rx::Drop(reason) => {
                        counters.count_drop(reason);
                        if reason.is_suspect() {
                            let (watch, clock) = (&mut *watch, &**clock);
                            note_suspect(watch, clock, fwd, &table, counters, meta.src, reason);
                        }
                    }
                }
                off = end;
            }
            // Room for the next buffer's datagrams, or write what is gathered so far.
            if refs.len() + GRO_SEGMENTS > refs.capacity() {
                write_coalesced(tun, gro, if wg.is_some() { opened } else { bufs }, refs, counters);
                refs.clear();
            }
        }
        write_coalesced(tun, gro, if wg.is_some() { opened } else { bufs }, refs, counters);
        counters.rx_packets.fetch_add(delivered, Ordering::Relaxed);
        counters.rx_bytes.fetch_add(delivered_bytes, Ordering::Relaxed);
        // A batch of truncated datagrams only still moved something: the caller must not sleep.
        received.max(1)
    }
}

/// Room for one sealed packet a peer's queue drains into: the largest inner packet and
/// WireGuard's overhead.
const DRAINED_LEN: usize = 65536 + 64;

/// A received wireguard datagram, where it came from, and the clock that dates what is sent back.
struct Sealed<'a> {
    src: SocketAddr,
    datagram: &'a [u8],
    clock: &'a dyn Clock,
}

/// wireguard: opens one datagram into `out`; returns where the inner packet lies in it, to be
/// delivered, if it is one for our subnet. A handshake message is answered on `sock` (the listen
/// port's), and a peer whose session may be new has its queued packets sent.
fn open<U: super::io::UdpIo>(
    wg: &Sessions,
    fwd: &Forwarder,
    sealed: &Sealed<'_>,
    out: &mut [u8],
    sock: &mut U,
    drained: &mut [u8],
    counters: &PacketCounters,
) -> Option<std::ops::Range<usize>> {
    match wg.open(sealed.src, sealed.datagram, out) {
        Opened::Deliver { range, peer, drain: queued } => {
            if queued {
                drain(wg, &peer, sock, drained, sealed.clock.now(), counters);
            }
            if for_us(fwd, out.get(range.clone()).unwrap_or(&[])) {
                Some(range)
            } else {
                counters.count_drop(DropReason::RxNotForUs);
                None
            }
        }
        Opened::Reply { to, len, peer } => {
            let now = sealed.clock.now();
            send_one(sock, to, out.get(..len).unwrap_or(&[]), now, counters);
            drain(wg, &peer, sock, drained, now, counters);
            None
        }
        Opened::Refuse { to, len, reason } => {
            counters.count_drop(reason);
            send_one(sock, to, out.get(..len).unwrap_or(&[]), sealed.clock.now(), counters);
            None
        }
        Opened::Consumed { peer } => {
            drain(wg, &peer, sock, drained, sealed.clock.now(), counters);
            None
        }
        Opened::Drop(reason) => {
            counters.count_drop(reason);
            None
        }
    }
}

/// Whether an opened inner packet is for our subnet (IPv4, or IPv6 on a dual-stack network):
/// what every transport checks before writing to TUN.
fn for_us(fwd: &Forwarder, packet: &[u8]) -> bool {
    match packet.first().map(|b| b >> 4) {
        Some(4) => packet
            .get(16..20)
            .and_then(|d| <[u8; 4]>::try_from(d).ok())
            .is_some_and(|d| fwd.own.contains(d.into())),
        Some(6) => packet
            .get(24..40)
            .and_then(|d| <[u8; 16]>::try_from(d).ok())
            .is_some_and(|d| fwd.ipv6.own.contains(d.into())),
        _ => false,
    }
}

/// Sends what waited in `peer`'s queue for its session.
fn drain<U: super::io::UdpIo>(
    wg: &Sessions,
    peer: &WgPublicKey,
    sock: &mut U,
    buf: &mut [u8],
    now: Instant,
    counters: &PacketCounters,
) {
    while let Some((to, len)) = wg.drain(peer, buf) {
        send_one(sock, to, buf.get(..len).unwrap_or(&[]), now, counters);
    }
}

fn send_one<U: super::io::UdpIo>(
    sock: &mut U,
    to: SocketAddr,
    contents: &[u8],
    now: Instant,
    counters: &PacketCounters,
) {
    let tx = Transmit { dst: to, contents, segment_size: None };
    super::tx::send_skipping(sock, &[tx], now, counters);
}

/// Counts a suspect datagram from `src` (a known peer's, else it is nobody's business here) and
/// says so, once, if its peer now sends them at a rate ([`crate::dataplane::transport::malformed_peers`]): the WARN at most
/// every [`crate::dataplane::transport::malformed_peers::QUIET`] per peer whichever worker saw it, the alarm always counted.
#[cold]
fn note_suspect(
    watch: &mut MalformedWatch,
    clock: &dyn Clock,
    fwd: &Forwarder,
    table: &RouteTable,
    counters: &PacketCounters,
    src: SocketAddr,
    reason: DropReason,
) {
    let known = match src.ip() {
        IpAddr::V4(ip) => table.is_known_peer(ip),
        IpAddr::V6(ip) => table.is_known_peer6(ip),
    };
    if !known {
        return;
    }
    let now = clock.now();
    let (_, label) = reason.labels();
    let Some(Alarm { peer, count, over, reason }) = watch.record(src.ip(), label, now) else {
        return;
    };
    counters.malformed_alarms.fetch_add(1, Ordering::Relaxed);
    if fwd.malformed.admit(peer, now) {
        let what = reason;
        warn!(
            %peer,
            count,
            over = ?over,
            last_reason = what,
            "datagrams from peer {peer} arrive malformed at a rate ({count} in {over:?}; the \
             last: {what}): likely its kernel mangles offloaded sends (a UDP GSO or VXLAN \
             segmentation bug); see docs/troubleshooting.md, \"Malformed datagrams from a \
             peer\" (said at most every 10 minutes per peer)"
        );
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
