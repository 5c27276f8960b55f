//! The forwarding loops, generic over their two I/O edges so the whole path runs in tests with
//! in-memory fakes (`fake`, `test-util` feature) and in the daemon with the TUN device
//! and batched UDP sockets ([`super::tunnel`]).
//!
//! # Layout
//! The loops (`tx.rs`, `rx.rs`, this file), the pure send planning (`plan.rs`: sockets, GSO
//! runs, order), the edges' traits (`io.rs`), waiting (`wait.rs`), spinning (`spin.rs`), the
//! dual-stack socket pair (`family.rs`), the threads' counters ([`counters`]), their
//! supervision (`supervise.rs`), the wireguard backend's timer thread (`timers.rs`) and the
//! fakes (`fake.rs`). It stands on [`super::transport`]
//! for every per-packet decision and on [`super::sys`] for the sockets' types; the backends
//! above start it.
//!
//! # TX: TUN → peers
//! Read up to a batch of packets from one TUN queue. A TSO/USO super-packet (behind a
//! `virtio_net_hdr`) is routed once, split into wire-sized segments laid out back to back
//! with the backend's encapsulation in front of each ([`offload::split`]), and goes out as few
//! `UDP_SEGMENT` (GSO) messages as the kernel allows. Single packets are encapsulated in place
//! in their read buffer; runs of them to one peer are copied back to back into GSO messages
//! ([`plan::coalesce_plan`]), and all go out in one `sendmmsg`. Packets leave in the order they
//! were read: TCP takes reordering for loss. wireguard seals instead of encapsulating: each
//! packet (each segment of a super-packet) is sealed into the send buffer back to back, and
//! runs of one size to one peer go out as GSO messages.
//!
//! # RX: peers → TUN
//! Receive a batch (`recvmmsg`; with UDP GRO each buffer may hold many datagrams), validate and
//! decapsulate every datagram ([`Forwarder::decap`]), and write the inner packets to TUN: with
//! TUN offloads, after TCP/UDP GRO ([`GroTable::coalesce_refs`]) coalesces them into
//! super-packets where they lie, one vectored write each, straight from the receive buffers.
//!
//! # Files
//! [`io`] (the two I/O traits), [`tx`] (the TX path), [`plan`] (pure: which socket, which
//! GSO runs, in which order), [`rx`] (the RX path), [`wait`] (where a thread sleeps, and the
//! stop signal); here, the threads that run them.
//!
//! # Contract
//! Buffers are allocated once per worker; the per-packet path allocates nothing, takes no lock
//! (the route table is loaded wait-free once per batch) and logs nothing (but one WARN, at most
//! every 10 minutes, about a peer whose datagrams arrive malformed at a rate: see
//! [`crate::dataplane::transport::malformed_peers`]): every drop is counted
//! by reason in the thread's own [`PacketCounters`] block (see
//! [`Counters::thread`](counters::Counters::thread): one per thread, on cache lines of
//! its own, summed only when `/metrics` is read). The TX path reads its [`Clock`] once per
//! batch read and passes that `now` to the pipeline (for the ICMP rate limit) and to the
//! sockets (for the GSO retry). A step never waits: a loop sleeps in its [`Idle`] (epoll) only
//! after a step found its queues empty, and returns as soon as the [`StopSignal`] is given.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::dataplane::sys::sched;
use crate::dataplane::transport::Forwarder;
use crate::route::Routes;
use crate::time::Clock;
use counters::{Counters, PacketCounters};
use supervise::{RestartPolicy, WorkerStates, supervise};

pub mod counters;
#[cfg(any(test, feature = "test-util"))]
pub mod fake;
mod family;
pub(crate) mod flows;
mod io;
mod plan;
mod rx;
mod spin;
pub(crate) mod supervise;
mod timers;
mod tx;
mod wait;

pub use counters::SpinEnd;
pub use family::FamilySockets;
pub use io::{TunIo, UdpIo};
pub use rx::RxPath;
use spin::Next;
pub(crate) use timers::run_wireguard_timers;
pub use tx::TxPath;
pub use wait::{Idle, StopSignal, Woken};

/// How one worker runs.
#[derive(Clone, Copy, Debug)]
pub struct WorkerConfig {
    /// Packets per batch (1: one packet per syscall, the baseline).
    pub batch: usize,
    /// The longest a thread sleeps in its [`Idle`] before it looks at its queues again (a
    /// safety net: readiness and the stop signal wake it at once).
    pub wake: Duration,
    /// Coalesce received TCP segments into super-packets (needs TUN TSO).
    pub gro_tcp: bool,
    /// Coalesce received UDP datagrams of one flow into super-packets (needs TUN USO).
    pub gro_udp: bool,
    /// Run TX and RX on one thread ([`run_both`]) instead of two.
    pub one_thread: bool,
    /// The longest a one-thread loop keeps looking after a small step before it sleeps
    /// ([`spin`]: request/response traffic only, backing off, within a CPU budget); zero: it
    /// sleeps at once. The two-thread loops never spin.
    pub spin: Duration,
    /// The scheduler slice each thread asks for as it starts ([`sched::shorten_slice`]: a woken
    /// thread preempts longer-sliced work at once); zero leaves the kernel's default.
    pub slice: Duration,
}

/// What a forwarding loop works with besides its own buffers and sockets: the TUN queue, the
/// forwarding configuration, the routes, and this thread's counters.
pub struct Context<'a, T> {
    /// The TUN queue.
    pub tun: &'a T,
    /// The forwarding configuration.
    pub fwd: &'a Forwarder,
    /// The route table.
    pub routes: &'a Routes,
    /// This thread's counters.
    pub counters: &'a PacketCounters,
}

/// The TX loop on its own thread: [`TxPath::step`] until `stop`, asleep in `idle` (the TUN
/// queue) whenever a step reads nothing.
pub(crate) fn run_tx<T: TunIo, U: UdpIo>(
    cx: &Context<'_, T>,
    pool: &mut [U],
    cfg: WorkerConfig,
    clock: Arc<dyn Clock>,
    idle: &mut Idle,
    stop: &StopSignal,
) {
    let mut tx = TxPath::new(cx.tun, &cfg, clock);
    while !stop.is_stopped() {
        supervise::beat();
        if tx.step(cx, pool) > 0 {
            supervise::injected_fault();
        } else {
            let _ = idle.wait(cx.tun);
            cx.counters.wakeups.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The RX loop on its own thread: [`RxPath::step`] until `stop`, asleep in `idle` (the
/// socket) whenever a step receives nothing.
pub(crate) fn run_rx<T: TunIo, U: UdpIo>(
    cx: &Context<'_, T>,
    sock: &mut U,
    cfg: WorkerConfig,
    clock: Arc<dyn Clock>,
    idle: &mut Idle,
    stop: &StopSignal,
) {
    let mut rx = RxPath::new(cx.tun, sock, &cfg, clock);
    while !stop.is_stopped() {
        supervise::beat();
        if rx.step(cx, sock) > 0 {
            supervise::injected_fault();
        } else {
            let _ = idle.wait(cx.tun);
            cx.counters.wakeups.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Both directions on one thread: drain TX and RX without waiting, and sleep in `idle` (the
/// TUN queue and the socket) only when both are idle. A reply the kernel generates inside our
/// TUN write (an ICMP echo reply, a TCP ACK) is then picked up by the same thread without a
/// wake-up, which on a VM costs tens of microseconds. After a small step the loop may keep
/// looking a little longer before it sleeps ([`spin::SpinPolicy`], at most `cfg.spin`), so
/// that a reply coming back soon is picked up without a wake-up either.
///
/// A wake-up by the socket alone runs the RX step first: the datagram that woke the thread is
/// delivered before the TUN queue is looked at, and the TX step right after it picks up what the
/// kernel answered inside that TUN write (a reply, an ACK) in the same round, without reading
/// the empty TUN queue once before each. Otherwise TX runs first.
pub(crate) fn run_both<T: TunIo, U: UdpIo>(
    cx: &Context<'_, T>,
    pool: &mut [U],
    sock: &mut U,
    cfg: WorkerConfig,
    clock: Arc<dyn Clock>,
    idle: &mut Idle,
    stop: &StopSignal,
) {
    let mut tx = TxPath::new(cx.tun, &cfg, clock.clone());
    let mut rx = RxPath::new(cx.tun, sock, &cfg, clock.clone());
    let mut spin = spin::SpinPolicy::new(cfg.spin, clock.now());
    // Reading the clock costs a few tens of nanoseconds (vDSO); only a spinning loop needs it.
    let spins = !cfg.spin.is_zero();
    let mut rx_first = false;
    while !stop.is_stopped() {
        supervise::beat();
        let moved = if rx_first {
            let received = rx.step(cx, sock);
            received + tx.step(cx, pool)
        } else {
            tx.step(cx, pool) + rx.step(cx, sock)
        };
        rx_first = false;
        if moved > 0 {
            if spins && let Some(end) = spin.worked(moved, clock.now()) {
                cx.counters.count_spin(end);
            }
            supervise::injected_fault();
            continue;
        }
        let next = if spins { spin.keep_looking(clock.now()) } else { Next::Sleep { ended: None } };
        match next {
            Next::Spin => std::hint::spin_loop(),
            Next::Sleep { ended } => {
                if let Some(end) = ended {
                    cx.counters.count_spin(end);
                }
                let woken = idle.wait(cx.tun);
                rx_first = woken.rest && !woken.first;
                cx.counters.wakeups.fetch_add(1, Ordering::Relaxed);
            }
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
    /// ([`Counters::thread`](counters::Counters::thread), by thread name).
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
        stop: Arc<StopSignal>,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let Self { tun, mut tx_pool, mut rx, fwd, routes, counters, cfg, clock, states } = self;
        let policy = RestartPolicy::default();
        if cfg.one_thread {
            let thread = name.to_owned();
            let counters = counters.thread(&thread);
            let fds = [tun.poll_fd(), rx.poll_fd()];
            let mut idle = Idle::new(&with_second(&fds, &rx), &stop, cfg.wake)?;
            let t = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
                ask_for_slice(&thread, cfg.slice);
                let cx = Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters };
                supervise(&thread, &states, policy, &*clock, stop.flag(), || {
                    run_both(&cx, &mut tx_pool, &mut rx, cfg, clock.clone(), &mut idle, &stop)
                })
            })?;
            return Ok(vec![t]);
        }
        let tx = {
            let thread = format!("{name}-tx");
            let mut idle = Idle::new(&[tun.poll_fd()], &stop, cfg.wake)?;
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
                ask_for_slice(&thread, cfg.slice);
                let cx = Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters };
                supervise(&thread, &states, policy, &*clock, stop.flag(), || {
                    run_tx(&cx, &mut tx_pool, cfg, clock.clone(), &mut idle, &stop)
                })
            })?
        };
        let thread = format!("{name}-rx");
        let counters = counters.thread(&thread);
        let mut idle = Idle::new(&with_second(&[rx.poll_fd()], &rx), &stop, cfg.wake)?;
        let rx = std::thread::Builder::new().name(thread.clone()).spawn(move || {
            ask_for_slice(&thread, cfg.slice);
            let cx = Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters };
            supervise(&thread, &states, policy, &*clock, stop.flag(), || {
                run_rx(&cx, &mut rx, cfg, clock.clone(), &mut idle, &stop)
            })
        })?;
        Ok(vec![tx, rx])
    }
}

/// Asks the scheduler for `slice` for the calling forwarding thread ([`sched::shorten_slice`]);
/// zero asks nothing. A kernel without per-thread slices (before 6.12) is said at debug: the
/// thread forwards as before.
fn ask_for_slice(thread: &str, slice: Duration) {
    if slice.is_zero() {
        return;
    }
    if let Err(e) = sched::shorten_slice(slice) {
        tracing::debug!(thread, error = %e, "the forwarding thread keeps the scheduler's default slice");
    }
}

/// `fds` and the socket's second descriptor, if it has one (an IPv6 socket beside the IPv4 one).
fn with_second<U: UdpIo>(
    fds: &[Option<std::os::fd::RawFd>],
    sock: &U,
) -> Vec<Option<std::os::fd::RawFd>> {
    fds.iter().copied().chain(sock.second_poll_fd().map(Some)).collect()
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
    use std::sync::atomic::Ordering;

    use super::tx::send_skipping;
    use super::*;
    use crate::config::BackendKind;
    use crate::dataplane::offload::testutil::Pkt;
    use crate::dataplane::sys::udp::gso_tail::{GsoLimits, TailRule};
    use crate::dataplane::sys::udp::{RecvMeta, Transmit, UdpError};
    use crate::dataplane::transport::OwnSubnet;
    use crate::dataplane::transport::{DropReason, HEADROOM};
    use crate::dataplane::wire::virtio_net::{self, Header};
    use crate::dataplane::wire::{ethernet::MacAddr, read_u32, vxlan::Vni};
    use crate::dataplane::worker::counters::PacketTotals;
    use crate::dataplane::worker::fake::{FakeNet, FakeTun};
    use crate::lease::record::NodeId;
    use crate::route::{Peer, PeerBackend, RouteTable};
    use crate::time::Instant;

    /// A socket on which the kernel refuses every message to `bad` (EHOSTUNREACH), the way
    /// sendmmsg reports it: the messages before it sent, an error for it.
    struct Refusing {
        bad: SocketAddr,
        sent: Vec<SocketAddr>,
    }

    impl UdpIo for Refusing {
        fn send_batch(&mut self, msgs: &[Transmit<'_>], _now: Instant) -> Result<usize, UdpError> {
            for (i, m) in msgs.iter().enumerate() {
                if m.dst == self.bad {
                    let source = std::io::Error::from_raw_os_error(libc::EHOSTUNREACH);
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
        fn gso_limits(&self) -> GsoLimits {
            GsoLimits::NONE
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
        fn gso_limits(&self) -> GsoLimits {
            GsoLimits::NONE
        }
        fn gro(&self) -> bool {
            false
        }
    }

    #[test]
    fn datagrams_left_behind_by_a_full_send_buffer_are_counted_as_drops() {
        let payload = [0u8; 100];
        let dst = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472).into();
        let txs = [Transmit { dst, contents: &payload, segment_size: None }; 5];
        let counters = PacketCounters::default();
        send_skipping(&mut Full { room: 2 }, &txs, Instant::ZERO, &counters);
        let mut totals = crate::dataplane::worker::counters::PacketTotals::default();
        counters.add_to(&mut totals);
        assert_eq!(totals.tx_packets, 2);
        assert_eq!(totals.drops(DropReason::TxSendBufferFull), 3);
        assert_eq!(totals.io_errors, 0);
    }

    #[test]
    fn a_refused_message_costs_only_itself_not_the_batch_behind_it() {
        let peer = |d| SocketAddr::from(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, d), 8472));
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
        host_with_peer_node(backend, n, peer, None)
    }

    /// Host `n` with one peer, `peer`, whose lease names `node` (a weft peer) or none (a
    /// kernel flannel peer).
    fn host_with_peer_node(
        backend: BackendKind,
        n: u8,
        peer: u8,
        node: Option<NodeId>,
    ) -> (Forwarder, Routes) {
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
                node,
                stale: false,
                incarnation: None,
                ipv6: None,
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
            malformed: Arc::default(),
            wireguard: None,
            ipv6: Default::default(),
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
        spin: Duration::ZERO,
        slice: Duration::ZERO,
    };

    /// The virtio header of a TCPv4 TSO super-packet of 1000-byte segments.
    fn tso_1000() -> Header {
        Header {
            flags: 0,
            gso_type: virtio_net::GSO_TCPV4,
            hdr_len: 40,
            gso_size: 1000,
            csum_start: 20,
            csum_offset: 16,
        }
    }

    /// Reads into host 1's TUN (with offloads) one flow's seq 1000..1500 alone, then
    /// 1500..4500 as a TSO super-packet of 1000-byte segments, then 4500..4600 alone; and
    /// returns the bytes of the stream.
    fn inject_stream(tun: &FakeTun) -> Vec<u8> {
        let tso = tso_1000();
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
        assert!(
            tx.step(
                &Context { tun: &*tun1, fwd: &fwd1, routes: &routes1, counters: &c1 },
                &mut pool,
            ) > 0
        );
        let mut rx = RxPath::new(&*tun2, &sock2, &CFG, clock());
        assert!(
            rx.step(
                &Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 },
                &mut sock2,
            ) > 0
        );
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

    /// From a weft peer (its lease names a node), whose datagrams carry a UDP checksum the
    /// kernel verified, segments merge without their own checksums being looked at: a middle
    /// segment with a corrupted TCP checksum still joins. From a kernel flannel peer (no node,
    /// no UDP checksum) the same segments are verified and the bad one is written alone.
    #[test]
    fn only_a_weft_peers_segments_skip_the_checksum_check() {
        for (node, writes) in [(Some(NodeId::generate()), 1), (None, 3)] {
            let net = FakeNet::new();
            let tun2 = FakeTun::with_vnet_hdr();
            let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001);
            let mut sock2 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
            let trusted = node.is_some();
            let (fwd2, routes2) = host_with_peer_node(BackendKind::Udp, 2, 1, node);
            let c2 = PacketCounters::default();
            // 10.244.1.2 -> 10.244.2.3: from the peer's subnet to ours.
            let mut segs = Pkt::tcp4(100).run(3, 100);
            segs[1][20 + 16] ^= 1;
            for s in &segs {
                net.send_raw(from, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472), s);
            }
            let mut rx = RxPath::new(&*tun2, &sock2, &CFG, clock());
            assert!(
                rx.step(
                    &Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 },
                    &mut sock2,
                ) > 0
            );
            let mut written = 0;
            while tun2.take_written(Duration::ZERO).is_some() {
                written += 1;
            }
            assert_eq!(written, writes, "trusted: {trusted}");
        }
    }

    /// A datagram longer than the receive buffer (the kernel's `MSG_TRUNC`) is dropped and
    /// counted as `truncated`, not as `malformed`, and nothing reaches TUN.
    #[test]
    fn a_datagram_longer_than_the_buffer_is_counted_as_truncated() {
        let net = FakeNet::new();
        let tun2 = FakeTun::with_vnet_hdr();
        let mut sock2 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
        let (fwd2, routes2) = host(BackendKind::Vxlan, 2, 1);
        let c2 = PacketCounters::default();
        let from = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001);
        net.send_raw(from, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472), &[0; 70_000]);
        let mut rx = RxPath::new(&*tun2, &sock2, &CFG, clock());
        assert!(
            rx.step(
                &Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 },
                &mut sock2,
            ) > 0
        );
        let mut totals = PacketTotals::default();
        c2.add_to(&mut totals);
        assert_eq!(totals.drops(DropReason::RxTruncated), 1);
        assert_eq!(totals.drops(DropReason::RxMalformed), 0);
        assert!(tun2.take_written(Duration::ZERO).is_none());
    }

    /// A known peer whose datagrams arrive malformed (VXLAN headers cut short) at a rate
    /// raises one alarm: counted, and logged through the data plane's shared log, which then
    /// holds back another alarm about that peer. Fewer than the threshold raise none, and an
    /// unknown sender's garbage none at all.
    #[test]
    fn a_peer_sending_malformed_datagrams_at_a_rate_raises_one_alarm() {
        use crate::dataplane::transport::malformed_peers::THRESHOLD;
        let net = FakeNet::new();
        let tun2 = FakeTun::with_vnet_hdr();
        let to = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472);
        let mut sock2 = net.bind(to);
        let (fwd2, routes2) = host(BackendKind::Vxlan, 2, 1);
        let c2 = PacketCounters::default();
        let peer = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001);
        let stranger = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 99), 40001);
        let mut rx = RxPath::new(&*tun2, &sock2, &CFG, clock());
        let mut drain = |rx: &mut RxPath| {
            let cx = Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 };
            while rx.step(&cx, &mut sock2) > 0 {}
            let mut totals = PacketTotals::default();
            c2.add_to(&mut totals);
            (totals.drops(DropReason::RxMalformed), totals.malformed_alarms)
        };
        for _ in 0..THRESHOLD - 1 {
            net.send_raw(peer, to, &[0x08, 0, 0]);
        }
        for _ in 0..3 * THRESHOLD {
            net.send_raw(stranger, to, &[0x08, 0, 0]);
        }
        let below = u64::from(THRESHOLD - 1 + 3 * THRESHOLD);
        assert_eq!(drain(&mut rx), (below, 0), "below the threshold, and a stranger's");
        net.send_raw(peer, to, &[0x08, 0, 0]);
        assert_eq!(drain(&mut rx), (below + 1, 1), "the threshold");
        for _ in 0..THRESHOLD {
            net.send_raw(peer, to, &[0x08, 0, 0]);
        }
        assert_eq!(drain(&mut rx).1, 1, "one alarm per window");
        assert!(!fwd2.malformed.admit(IpAddr::V4(*peer.ip()), Instant::ZERO), "it was logged");
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
        assert!(
            tx.step(
                &Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters },
                &mut pool,
            ) > 0
        );
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

    /// Under the equal-tail workaround (a socket whose GSO messages never end on a full
    /// segment), a TSO super-packet's equal segments and a run of equal single datagrams each
    /// leave as one GSO message ending on the pad; the peer delivers every packet and drops
    /// the pads as `gso_tail_pad`, never as malformed. Without it, no pad is sent.
    #[test]
    fn under_the_equal_tail_workaround_gso_messages_end_on_the_pad_the_peer_drops() {
        for (tail, pads) in [(TailRule::NeverEqual, 2), (TailRule::Any, 0)] {
            let net = FakeNet::new();
            let (tun1, tun2) = (FakeTun::with_vnet_hdr(), FakeTun::with_vnet_hdr());
            let mut pool = vec![net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 40001))];
            pool[0].set_gso_tail(tail);
            let mut sock2 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472));
            let ((fwd1, routes1), (fwd2, routes2)) =
                (host(BackendKind::Vxlan, 1, 2), host(BackendKind::Vxlan, 2, 1));
            let (c1, c2) = (PacketCounters::default(), PacketCounters::default());
            let tso = tso_1000();
            let mut frame = vec![0u8; virtio_net::LEN];
            tso.emit(&mut frame).unwrap();
            frame.extend(Pkt::tcp4(6000).build());
            tun1.inject(&frame);
            for i in 0..5 {
                let mut p = Pkt::tcp4(1000);
                p.seq = 10_000 + 1000 * i;
                let mut frame = vec![0u8; virtio_net::LEN];
                frame.extend(p.build());
                tun1.inject(&frame);
            }
            let mut tx = TxPath::new(&*tun1, &CFG, clock());
            let cx1 = Context { tun: &*tun1, fwd: &fwd1, routes: &routes1, counters: &c1 };
            assert!(tx.step(&cx1, &mut pool) > 0);
            assert_eq!(pool[0].pads_sent(), pads, "{tail:?}");
            assert_eq!(pool[0].messages_sent(), 2, "{tail:?}: one GSO message each");
            let mut rx = RxPath::new(&*tun2, &sock2, &CFG, clock());
            let cx2 = Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 };
            assert!(rx.step(&cx2, &mut sock2) > 0);
            let mut totals = PacketTotals::default();
            c2.add_to(&mut totals);
            assert_eq!(totals.rx_packets, 11, "{tail:?}");
            assert_eq!(totals.drops(DropReason::RxGsoPad), pads as u64, "{tail:?}");
            assert_eq!(totals.drops(DropReason::RxMalformed), 0, "{tail:?}");
            assert_eq!(totals.drops(DropReason::RxBadFlags), 0, "{tail:?}");
        }
    }

    /// A socket that turned GSO off sends one datagram per message. (The `udp_gso` gauge follows
    /// the sockets' state in the driver: see `tunnel::tests`.)
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
        assert!(
            tx.step(
                &Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters },
                &mut pool,
            ) > 0
        );
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
        assert!(
            tx.step(
                &Context { tun: &*tun, fwd: &fwd, routes: &routes, counters: &counters },
                &mut pool,
            ) > 0
        );

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

    /// Host `n` on the wireguard backend (10.244.n.0/24 behind 192.0.2.n:51820, key `[n; 32]`)
    /// knowing host `peer`: its forwarder and routes.
    fn wireguard_host(n: u8, peer: u8) -> (Forwarder, Routes) {
        use crate::dataplane::transport::wireguard::{Devices, PeerConfig, Sessions, public_key};
        use crate::vocab::WgSecret;
        let key = |n: u8| WgSecret::from_bytes([n; 32]);
        let peer_subnet: crate::lease::record::Subnet =
            format!("10.244.{peer}.0/24").parse().unwrap();
        let sessions = Sessions::new(&key(n), None, None, 1420);
        sessions.set_peers([PeerConfig {
            key: public_key(&key(peer)),
            endpoint: SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, peer), 51820).into(),
            subnet: peer_subnet,
            ipv6: None,
            epoch: 0,
        }]);
        let (mut fwd, _) = host(BackendKind::Udp, n, peer);
        fwd.backend = BackendKind::Wireguard;
        fwd.port = 51820;
        fwd.wireguard = Some(Arc::new(Devices::ipv4_only(sessions, 51820)));
        let routes = Routes::new(RouteTable::build(
            "10.244.0.0/16".parse().unwrap(),
            24,
            [Peer {
                subnet: peer_subnet,
                public_ip: Ipv4Addr::new(192, 0, 2, peer),
                backend: PeerBackend::Wireguard { key: public_key(&key(peer)), port: None },
                vtep_mac: None,
                vni: None,
                node: None,
                stale: false,
                incarnation: None,
                ipv6: None,
            }],
        ));
        (fwd, routes)
    }

    /// Two wireguard hosts through the workers: host 1's first packet waits for the
    /// handshake, which host 2's RX answers on its socket; once it completes the packet goes,
    /// and a TSO super-packet read after it is split, each segment sealed, and the segments
    /// leave as one GSO message and reach host 2's TUN coalesced again, the stream intact.
    #[test]
    fn wireguard_hosts_handshake_and_carry_a_split_super_packet() {
        let net = FakeNet::new();
        let (tun1, tun2) = (FakeTun::with_vnet_hdr(), FakeTun::with_vnet_hdr());
        let mut sock1 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 51820));
        let mut sock2 = net.bind(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 51820));
        let ((fwd1, routes1), (fwd2, routes2)) = (wireguard_host(1, 2), wireguard_host(2, 1));
        let (c1, c2) = (PacketCounters::default(), PacketCounters::default());
        let cx1 = Context { tun: &*tun1, fwd: &fwd1, routes: &routes1, counters: &c1 };
        let cx2 = Context { tun: &*tun2, fwd: &fwd2, routes: &routes2, counters: &c2 };
        let (mut tx1, mut rx1) =
            (TxPath::new(&*tun1, &CFG, clock()), RxPath::new(&*tun1, &sock1, &CFG, clock()));
        let mut rx2 = RxPath::new(&*tun2, &sock2, &CFG, clock());

        // The first packet: a handshake initiation leaves in its place.
        let mut first = Pkt::tcp4(500);
        first.seq = 1000;
        let mut frame = vec![0u8; virtio_net::LEN];
        frame.extend(first.build());
        tun1.inject(&frame);
        assert!(tx1.step(&cx1, std::slice::from_mut(&mut sock1)) > 0);
        assert!(rx2.step(&cx2, &mut sock2) > 0, "no initiation");
        assert!(tun2.take_written(Duration::ZERO).is_none(), "delivered before the handshake");
        // Host 1 takes the response: its keepalive and the queued packet go.
        assert!(rx1.step(&cx1, &mut sock1) > 0, "no response");
        assert!(rx2.step(&cx2, &mut sock2) > 0);
        let w = tun2.take_written(Duration::ZERO).expect("the queued packet");
        assert_eq!(&w[virtio_net::LEN + 40..], &first.payload[..]);

        // A super-packet of three segments, each sealed, in one GSO message.
        let sent = sock1.messages_sent();
        let mut p = Pkt::tcp4(3000);
        p.seq = 1500;
        let mut frame = vec![0u8; virtio_net::LEN];
        tso_1000().emit(&mut frame).unwrap();
        frame.extend(p.build());
        tun1.inject(&frame);
        assert!(tx1.step(&cx1, std::slice::from_mut(&mut sock1)) > 0);
        assert_eq!(sock1.messages_sent() - sent, 1, "the sealed segments left as one message");
        assert!(rx2.step(&cx2, &mut sock2) > 0);
        let merged = tun2.take_written(Duration::ZERO).expect("the segments");
        let hdr = Header::parse(&merged).unwrap();
        assert_eq!((hdr.gso_type, hdr.gso_size), (virtio_net::GSO_TCPV4, 1000));
        assert_eq!(&merged[virtio_net::LEN + 40..], &p.payload[..]);
        let mut totals = PacketTotals::default();
        c2.add_to(&mut totals);
        assert_eq!(totals.rx_packets, 4);
    }
}
