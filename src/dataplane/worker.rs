//! The forwarding loops, generic over their two I/O edges so the whole path runs in tests with
//! in-memory fakes ([`super::fake`]) and in the daemon with the TUN device and batched UDP
//! sockets ([`super::driver`]).
//!
//! # TX: TUN → peers
//! Read up to a batch of packets from one TUN queue. A TSO/USO super-packet (behind a
//! `virtio_net_hdr`) is split into wire-sized segments laid out back to back with encapsulation
//! headroom in front of each ([`offload::split`]), every segment is encapsulated in place, and
//! the run goes out as few `UDP_SEGMENT` (GSO) messages as the kernel allows. Single packets are
//! encapsulated in place in their read buffer and sent together in one `sendmmsg`.
//!
//! # RX: peers → TUN
//! Receive a batch (`recvmmsg`; with UDP GRO each buffer may hold many datagrams), validate and
//! decapsulate every datagram ([`Forwarder::decap`]), and write the inner packets to TUN: with
//! TUN offloads, after TCP GRO coalescing into super-packets ([`GroTable`]), one write each.
//!
//! # Contract
//! Buffers are allocated once per worker; the per-packet path allocates nothing, takes no lock
//! (the route table is loaded wait-free once per batch) and logs nothing: every drop is counted
//! by reason in [`Counters`]. Loops return when `stop` is set (checked at least every `wake`).

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::offload::{self, GroConfig, GroTable, VIRTIO_HEADROOM};
use super::pipeline::{Counters, DropReason, Forwarder, HEADROOM, Rx, Tx};
use super::udp::{self, MAX_BATCH, MAX_GSO_BYTES, RecvMeta, Transmit, UdpError};
use super::wire::virtio_net::{self, Header};
use crate::route::Routes;

/// One TUN queue, as the loops need it.
pub trait TunIo: Send + Sync {
    /// Reads one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]); `Ok(0)` or
    /// `WouldBlock` when nothing is queued.
    fn read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]).
    fn write(&self, buf: &[u8]) -> io::Result<usize>;
    /// Waits until a packet can be read or `timeout` passes.
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool>;
    /// Whether packets carry a `virtio_net_hdr` (TUN offloads on).
    fn vnet_hdr(&self) -> bool;
}

/// One UDP socket, as the loops need it (see [`udp::BatchSocket`]).
pub trait UdpIo: Send {
    /// Sends messages; see [`udp::BatchSocket::send_batch`].
    fn send_batch(&mut self, msgs: &[Transmit<'_>]) -> Result<usize, UdpError>;
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
}

impl UdpIo for udp::BatchSocket {
    fn send_batch(&mut self, msgs: &[Transmit<'_>]) -> Result<usize, UdpError> {
        udp::BatchSocket::send_batch(self, msgs)
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
}

/// The largest packet a TUN read returns with offloads (64 KiB super-packet) plus its header.
const READ_LEN: usize = virtio_net::LEN + 65535;
/// Output space for one split super-packet: 64 KiB of payload cut into segments as small as
/// 536 bytes, each with its headers and encapsulation headroom.
const SPLIT_LEN: usize = 256 * 1024;

fn zero_vnet_hdr(buf: &mut [u8]) {
    buf[..virtio_net::LEN].fill(0);
}

/// The TX loop: TUN → encapsulation → UDP. `pool` holds the sockets datagrams leave from;
/// the inner flow's hash picks one, so the outer source port is stable per flow.
pub fn run_tx<T: TunIo, U: UdpIo>(
    tun: &T,
    pool: &mut [U],
    fwd: &Forwarder,
    routes: &Routes,
    counters: &Counters,
    cfg: WorkerConfig,
    stop: &AtomicBool,
) {
    let batch = cfg.batch.clamp(1, MAX_BATCH);
    let vnet = tun.vnet_hdr();
    let hdr_room = if vnet { virtio_net::LEN } else { 0 };
    // Slot i: [HEADROOM - hdr_room free][vnet hdr?][packet ...]; the packet starts at HEADROOM.
    let mut slots: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; HEADROOM + READ_LEN]).collect();
    let mut split_out = vec![0u8; if vnet { SPLIT_LEN } else { 0 }];
    let mut reply = vec![0u8; virtio_net::LEN + 1500];
    let mut pending: Vec<(usize, SocketAddrV4, std::ops::Range<usize>, u32)> =
        Vec::with_capacity(batch);
    if pool.is_empty() {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        match tun.wait_readable(cfg.wake) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(cfg.wake);
                continue;
            }
        }
        let table = routes.load();
        pending.clear();
        for (i, slot) in slots.iter_mut().enumerate() {
            let n = match tun.read(&mut slot[HEADROOM - hdr_room..]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    counters.io_errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            };
            let Some(len) = n.checked_sub(hdr_room) else {
                counters.count_drop(DropReason::TxMalformed);
                continue;
            };
            let hdr = if vnet {
                match Header::parse(&slot[HEADROOM - hdr_room..HEADROOM]) {
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
                send_super_packet(
                    &hdr,
                    &slot[HEADROOM..HEADROOM + len],
                    &mut split_out,
                    pool,
                    fwd,
                    &table,
                    counters,
                    tun,
                    &mut reply,
                );
                continue;
            }
            if offload::finish_checksum(&hdr, &mut slot[HEADROOM..HEADROOM + len]).is_err() {
                counters.count_drop(DropReason::TxMalformed);
                continue;
            }
            match fwd.encap(&table, slot, len, &mut reply[virtio_net::LEN..]) {
                Tx::Send { peer, range, flow } => pending.push((i, peer, range, flow)),
                Tx::Reply { len: r, reason } => {
                    counters.count_drop(reason);
                    write_reply(tun, &mut reply, r, vnet);
                }
                Tx::Drop(reason) => counters.count_drop(reason),
            }
        }
        if pending.is_empty() {
            continue;
        }
        // One sendmmsg per socket used; in practice one flow, one socket.
        let mut txs = [Transmit {
            dst: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
            contents: &[],
            segment_size: None,
        }; MAX_BATCH];
        let mut which = usize::MAX;
        let mut k = 0;
        let flush = |txs: &[Transmit<'_>], sock: usize, pool: &mut [U]| {
            if txs.is_empty() {
                return;
            }
            account(pool[sock].send_batch(txs), txs, counters);
        };
        for (slot, peer, range, flow) in &pending {
            let sock = *flow as usize % pool.len();
            if sock != which && k > 0 {
                flush(&txs[..k], which, pool);
                k = 0;
            }
            which = sock;
            txs[k] =
                Transmit { dst: *peer, contents: &slots[*slot][range.clone()], segment_size: None };
            k += 1;
        }
        flush(&txs[..k], which, pool);
    }
}

fn account(result: Result<usize, UdpError>, txs: &[Transmit<'_>], counters: &Counters) {
    let sent = match result {
        Ok(n) => n,
        Err(UdpError::Send { sent, .. }) => {
            counters.io_errors.fetch_add(1, Ordering::Relaxed);
            sent
        }
        Err(_) => {
            counters.io_errors.fetch_add(1, Ordering::Relaxed);
            0
        }
    };
    let mut packets = 0u64;
    let mut bytes = 0u64;
    for t in &txs[..sent.min(txs.len())] {
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

/// Splits a TSO/USO super-packet, encapsulates each segment in place, and sends the run as GSO
/// messages (or single datagrams without GSO).
#[allow(clippy::too_many_arguments)]
fn send_super_packet<T: TunIo, U: UdpIo>(
    hdr: &Header,
    packet: &[u8],
    out: &mut [u8],
    pool: &mut [U],
    fwd: &Forwarder,
    table: &crate::route::RouteTable,
    counters: &Counters,
    tun: &T,
    reply: &mut [u8],
) {
    let segs = match offload::split(hdr, packet, out, HEADROOM) {
        Ok(s) => s,
        Err(_) => {
            counters.count_drop(DropReason::TxMalformed);
            return;
        }
    };
    // Every segment of one super-packet belongs to one flow: one peer, one socket.
    let mut dst = None;
    let mut flow = 0;
    let mut first_payload_off = 0;
    for i in 0..segs.count() {
        let slot = segs.slot(i);
        match fwd.encap(
            table,
            &mut out[slot.clone()],
            segs.seg_len(i),
            &mut reply[virtio_net::LEN..],
        ) {
            Tx::Send { peer, range, flow: f } => {
                if i == 0 {
                    dst = Some(peer);
                    flow = f;
                    first_payload_off = range.start;
                }
            }
            Tx::Reply { len, reason } => {
                counters.count_drop(reason);
                if i == 0 {
                    write_reply(tun, reply, len, tun.vnet_hdr());
                }
                return;
            }
            Tx::Drop(reason) => {
                counters.count_drop(reason);
                return;
            }
        }
    }
    let Some(dst) = dst else { return };
    // The udp backend encapsulates nothing: each datagram starts HEADROOM into its slot, so
    // datagrams are not back to back and go out one by one; VXLAN slots are contiguous.
    let sock = flow as usize % pool.len();
    if first_payload_off != 0 {
        let mut txs = [Transmit { dst, contents: &[], segment_size: None }; MAX_BATCH];
        let mut k = 0;
        for i in 0..segs.count() {
            txs[k] = Transmit { dst, contents: &out[segs.packet(i)], segment_size: None };
            k += 1;
            if k == MAX_BATCH || i + 1 == segs.count() {
                account(pool[sock].send_batch(&txs[..k]), &txs[..k], counters);
                k = 0;
            }
        }
        return;
    }
    let stride = segs.stride();
    let per_msg = pool[sock].max_gso_segments().min(MAX_GSO_BYTES / stride.max(1)).max(1);
    let mut i = 0;
    while i < segs.count() {
        let end = (i + per_msg).min(segs.count());
        let contents = &out[segs.slot(i).start..segs.slot(end - 1).end];
        let t = [Transmit {
            dst,
            contents,
            segment_size: if end - i > 1 { u16::try_from(stride).ok() } else { None },
        }];
        account(pool[sock].send_batch(&t), &t, counters);
        i = end;
    }
}

/// The RX loop: UDP → validation and decapsulation → (GRO) → TUN.
pub fn run_rx<T: TunIo, U: UdpIo>(
    tun: &T,
    sock: &mut U,
    fwd: &Forwarder,
    routes: &Routes,
    counters: &Counters,
    cfg: WorkerConfig,
    stop: &AtomicBool,
) {
    let batch = cfg.batch.clamp(1, MAX_BATCH);
    let vnet = tun.vnet_hdr();
    let buf_len = if sock.gro() { udp::GRO_BUFFER_LEN } else { 65536 };
    let mut bufs: Vec<Vec<u8>> = (0..batch).map(|_| vec![0u8; buf_len]).collect();
    let mut metas = vec![RecvMeta::default(); batch];
    // With TUN offloads every write carries a virtio header, so inner packets are copied into
    // slots with room for it, where GRO can also grow them into super-packets.
    let gro_slots = if vnet { 128 } else { 0 };
    let mut gro_bufs: Vec<Vec<u8>> =
        (0..gro_slots).map(|_| vec![0u8; VIRTIO_HEADROOM + 65535]).collect();
    let mut gro_lens = vec![0usize; gro_slots];
    let mut gro = GroTable::new(GroConfig { tcp: cfg.gro_tcp, udp: cfg.gro_udp }, gro_slots.max(1));
    let mut k = 0;
    let flush =
        |gro: &mut GroTable, gro_bufs: &mut [Vec<u8>], gro_lens: &mut [usize], k: &mut usize| {
            if *k == 0 {
                return;
            }
            for &j in gro.coalesce(&mut gro_bufs[..*k], &mut gro_lens[..*k]) {
                if tun.write(&gro_bufs[j][..gro_lens[j]]).is_err() {
                    counters.io_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            *k = 0;
        };
    while !stop.load(Ordering::Relaxed) {
        let n = match sock.recv_batch(&mut bufs, &mut metas, cfg.wake) {
            Ok(n) => n,
            Err(_) => {
                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if n == 0 {
            continue;
        }
        let table = routes.load();
        for (buf, meta) in bufs.iter_mut().zip(&metas).take(n) {
            if meta.truncated {
                counters.count_drop(DropReason::RxMalformed);
                continue;
            }
            let len = meta.len.min(buf.len());
            let seg = meta.segment_size.filter(|s| *s > 0).unwrap_or(len).max(1);
            let mut off = 0;
            while off < len {
                let end = (off + seg).min(len);
                let datagram = &mut buf[off..end];
                let dlen = datagram.len();
                match fwd.decap(&table, meta.src, datagram, dlen) {
                    Rx::Deliver(r) => {
                        let inner = &datagram[r];
                        counters.rx_packets.fetch_add(1, Ordering::Relaxed);
                        counters.rx_bytes.fetch_add(inner.len() as u64, Ordering::Relaxed);
                        if vnet {
                            let slot = &mut gro_bufs[k];
                            slot[VIRTIO_HEADROOM..VIRTIO_HEADROOM + inner.len()]
                                .copy_from_slice(inner);
                            gro_lens[k] = inner.len();
                            k += 1;
                            if k == gro_slots {
                                flush(&mut gro, &mut gro_bufs, &mut gro_lens, &mut k);
                            }
                        } else if tun.write(inner).is_err() {
                            counters.io_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Rx::Drop(reason) => counters.count_drop(reason),
                }
                off = end;
            }
        }
        flush(&mut gro, &mut gro_bufs, &mut gro_lens, &mut k);
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
    /// Counters.
    pub counters: Arc<Counters>,
    /// Batch size and timing.
    pub cfg: WorkerConfig,
}

impl<T: TunIo + 'static, U: UdpIo + 'static> Worker<T, U> {
    /// Runs [`run_tx`] and [`run_rx`] on two threads named `<name>-tx` and `<name>-rx`, until
    /// `stop` is set.
    pub fn spawn(
        self,
        name: &str,
        stop: Arc<AtomicBool>,
    ) -> io::Result<[std::thread::JoinHandle<()>; 2]> {
        let Self { tun, mut tx_pool, mut rx, fwd, routes, counters, cfg } = self;
        let tx = {
            let (tun, fwd, routes, counters, stop) =
                (tun.clone(), fwd.clone(), routes.clone(), counters.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("{name}-tx"))
                .spawn(move || run_tx(&*tun, &mut tx_pool, &fwd, &routes, &counters, cfg, &stop))?
        };
        let rx = std::thread::Builder::new()
            .name(format!("{name}-rx"))
            .spawn(move || run_rx(&*tun, &mut rx, &fwd, &routes, &counters, cfg, &stop))?;
        Ok([tx, rx])
    }
}
