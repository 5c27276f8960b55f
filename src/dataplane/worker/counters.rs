//! The data plane's metrics: each forwarding thread's [`PacketCounters`] (drops by reason,
//! packets and bytes, I/O errors, suppressed ICMP errors) and what the driver counts and sets
//! ([`Counters`]: GSO fallbacks and retries, offloads in use, link repairs), and how they
//! appear on `/metrics`. The per-packet decisions they count are in [`crate::dataplane::transport`], which
//! stays pure.
//!
//! # Contract
//! - A forwarding thread counts only in its own block ([`Counters::thread`]), padded to cache
//!   lines of its own: relaxed adds, no lock, no allocation, on the per-packet path.
//! - [`Counters`] locks only when a thread starts and when `/metrics` sums the blocks; a block
//!   is never removed, so the sums never go back.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crossbeam_utils::CachePadded;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::flows::FlowOwners;
use crate::dataplane::transport::DropReason;
use crate::metrics;

/// What one forwarding thread counts as packets go through it: drops by [`DropReason`], packets
/// and bytes each way, I/O errors and suppressed ICMP errors.
///
/// Every thread has a block of its own ([`Counters::thread`]), padded to cache lines of its
/// own ([`CachePadded`]), so that the threads' adds (relaxed, a few per batch) never contend
/// for a cache line; `/metrics` shows the sums ([`Counters::packets`]).
#[derive(Debug, Default)]
pub struct PacketCounters {
    drops: [AtomicU64; DropReason::ALL.len()],
    /// Packets sent to peers.
    pub tx_packets: AtomicU64,
    /// Bytes of inner packets sent.
    pub tx_bytes: AtomicU64,
    /// Packets delivered to TUN.
    pub(crate) rx_packets: AtomicU64,
    /// Bytes delivered.
    pub(crate) rx_bytes: AtomicU64,
    /// Send or write errors from the kernel.
    pub(crate) io_errors: AtomicU64,
    /// ICMP errors not sent because the [`IcmpLimit`] bucket was empty.
    pub(crate) icmp_suppressed: AtomicU64,
    /// Times the thread woke from its sleep (`worker::Idle`) to look at its queues.
    pub(crate) wakeups: AtomicU64,
    /// Batches read from TUN that held at least one packet.
    pub(crate) tx_batches: AtomicU64,
    /// `recvmmsg` calls that received at least one datagram.
    pub(crate) rx_batches: AtomicU64,
    /// Times a peer's datagrams were found arriving malformed at a rate
    /// (`crate::dataplane::transport::malformed_peers`).
    pub(crate) malformed_alarms: AtomicU64,
    /// Spins of a one-thread loop (`worker::spin`), by how they ended.
    spins: [AtomicU64; SpinEnd::ALL.len()],
    /// Flows this thread took over from another thread ([`super::flows`]), by [`Direction`].
    flow_moves: [AtomicU64; 2],
    /// Where this thread records the flows it carries, and as whom.
    seat: FlowSeat,
}

/// A thread's place in the data plane's [`FlowOwners`] tables.
#[derive(Debug)]
struct FlowSeat {
    /// The flows sent to peers (`tx`) and delivered to TUN (`rx`), by last carrier.
    tables: Arc<[FlowOwners; 2]>,
    /// This thread's number in them (from 1).
    owner: u32,
}

impl Default for FlowSeat {
    /// A block of its own (a thread outside [`Counters`], in tests): nobody to move from.
    fn default() -> Self {
        Self { tables: Arc::default(), owner: 1 }
    }
}

/// Which way a flow is carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum Direction {
    /// Read from TUN, sent to peers.
    Tx,
    /// Received from peers, written to TUN.
    Rx,
}

impl Direction {
    /// The `dir` label.
    fn label(self) -> &'static str {
        match self {
            Self::Tx => "tx",
            Self::Rx => "rx",
        }
    }
}

impl PacketCounters {
    /// Records that this thread carries the flow hashed `flow` (`wire::flow_hash` of the inner
    /// packet) in direction `dir`, and counts a move if another thread carried it last.
    pub(crate) fn carried(&self, flow: u32, dir: Direction) {
        if self.seat.tables[dir as usize].carried(flow, self.seat.owner) {
            self.flow_moves[dir as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a drop.
    pub(crate) fn count_drop(&self, reason: DropReason) {
        self.drops[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a spin that ended.
    pub(crate) fn count_spin(&self, end: SpinEnd) {
        self.spins[end as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Adds this block's counts to `totals`.
    pub(crate) fn add_to(&self, totals: &mut PacketTotals) {
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        for (total, v) in totals.drops.iter_mut().zip(&self.drops) {
            *total += load(v);
        }
        totals.tx_packets += load(&self.tx_packets);
        totals.tx_bytes += load(&self.tx_bytes);
        totals.rx_packets += load(&self.rx_packets);
        totals.rx_bytes += load(&self.rx_bytes);
        totals.io_errors += load(&self.io_errors);
        totals.icmp_suppressed += load(&self.icmp_suppressed);
        totals.wakeups += load(&self.wakeups);
        totals.tx_batches += load(&self.tx_batches);
        totals.rx_batches += load(&self.rx_batches);
        totals.malformed_alarms += load(&self.malformed_alarms);
        for (total, v) in totals.spins.iter_mut().zip(&self.spins) {
            *total += load(v);
        }
        for (total, v) in totals.flow_moves.iter_mut().zip(&self.flow_moves) {
            *total += load(v);
        }
    }
}

/// The sums of every thread's [`PacketCounters`] at one time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketTotals {
    drops: [u64; DropReason::ALL.len()],
    /// Packets sent to peers.
    pub tx_packets: u64,
    /// Bytes of inner packets sent.
    pub(crate) tx_bytes: u64,
    /// Packets delivered to TUN.
    pub rx_packets: u64,
    /// Bytes delivered.
    pub(crate) rx_bytes: u64,
    /// Send or write errors from the kernel.
    pub(crate) io_errors: u64,
    /// ICMP errors not sent because of the rate limit.
    pub icmp_suppressed: u64,
    /// Wake-ups of the forwarding threads.
    pub wakeups: u64,
    /// Batches read from TUN.
    pub tx_batches: u64,
    /// Batches received from the sockets.
    pub rx_batches: u64,
    /// Times a peer's datagrams were found arriving malformed at a rate.
    pub malformed_alarms: u64,
    spins: [u64; SpinEnd::ALL.len()],
    flow_moves: [u64; 2],
}

impl PacketTotals {
    /// The count for one reason.
    pub(crate) fn drops(&self, reason: DropReason) -> u64 {
        self.drops[reason as usize]
    }

    /// The spins that ended one way.
    pub fn spins(&self, end: SpinEnd) -> u64 {
        self.spins[end as usize]
    }

    /// Flows taken over from another thread, one way.
    pub(crate) fn flow_moves(&self, dir: Direction) -> u64 {
        self.flow_moves[dir as usize]
    }
}

/// The data plane's metrics: every forwarding thread's [`PacketCounters`], and what the
/// driver counts and sets (GSO fallbacks and retries, offloads in use, link repairs).
#[derive(Debug, Default)]
pub struct Counters {
    /// One block per forwarding thread, by thread name. A block is never removed, so the sums
    /// never go back; a thread restarted under the same name counts on in its block.
    threads: Mutex<Vec<(String, Arc<CachePadded<PacketCounters>>)>>,
    /// GSO sends that failed (`EIO`/`EINVAL`/`EMSGSIZE`) and were re-sent as single datagrams,
    /// each turning GSO off on its socket for now.
    pub(crate) gso_fallbacks: AtomicU64,
    /// Times a socket's retry time came and it used GSO again.
    pub(crate) gso_reprobes: AtomicU64,
    /// Sockets whose GSO is off after a failure, or back on but not yet confirmed by a GSO send
    /// that went through. While it is not 0, the `udp_gso` gauge shows 0.
    pub(crate) gso_off_sockets: AtomicU64,
    /// Which offloads are in use (gauges, one per [`Offload`]): set when the data plane
    /// starts; `udp_gso` also needs `gso_off_sockets` to be 0.
    offloads: [AtomicBool; Offload::ALL.len()],
    /// Repairs of the TUN device's link state after someone else changed it, by what drifted.
    link_repairs: [AtomicU64; RepairKind::ALL.len()],
    /// How the sockets' GSO messages ended (`crate::dataplane::sys::udp::gso_tail`): added to after most sends, so
    /// on cache lines of their own.
    pub(crate) gso_tails: CachePadded<GsoTailCounts>,
    /// Which thread last carried each flow, each way: shared by every thread's block.
    flows: Arc<[FlowOwners; 2]>,
}

/// How the sockets' GSO messages ended, summed over every socket.
#[derive(Debug, Default)]
pub(crate) struct GsoTailCounts {
    /// GSO messages sent with the pad as their last segment.
    pub(crate) pads: AtomicU64,
    /// Datagrams sent on their own ahead of the rest of their message, so that no GSO
    /// message ended on a full segment.
    pub(crate) singles: AtomicU64,
    /// GSO messages sent whose last datagram is as long as the segment size.
    pub(crate) equal_tails: AtomicU64,
}

/// An offload the data plane may use; each is a gauge on `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum Offload {
    /// TUN TSO with user-space segmentation (and TCP GRO on write).
    TunTso,
    /// TUN USO (UDP segmentation offload, Linux 6.2+; UDP GRO on write).
    TunUso,
    /// `UDP_SEGMENT` on send.
    UdpGso,
    /// `UDP_GRO` on receive.
    UdpGro,
}

impl Offload {
    /// Every offload, in metric order.
    pub(crate) const ALL: [Self; 4] = [Self::TunTso, Self::TunUso, Self::UdpGso, Self::UdpGro];

    /// The `kind` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::TunTso => "tun_tso",
            Self::TunUso => "tun_uso",
            Self::UdpGso => "udp_gso",
            Self::UdpGro => "udp_gro",
        }
    }
}

impl Counters {
    /// The packet counters of the forwarding thread named `name`: the same block again for a
    /// name asked for before (a restarted or re-bound worker counts on where it was).
    pub fn thread(&self, name: &str) -> Arc<CachePadded<PacketCounters>> {
        let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, block)) = threads.iter().find(|(n, _)| n == name) {
            return block.clone();
        }
        let seat = FlowSeat {
            tables: self.flows.clone(),
            owner: u32::try_from(threads.len() + 1).unwrap_or(u32::MAX),
        };
        let block =
            Arc::new(CachePadded::new(PacketCounters { seat, ..PacketCounters::default() }));
        threads.push((name.to_owned(), block.clone()));
        block
    }

    /// Every thread's packet counters, summed now.
    pub fn packets(&self) -> PacketTotals {
        let mut totals = PacketTotals::default();
        for (_, block) in self.threads.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            block.add_to(&mut totals);
        }
        totals
    }

    /// Drops for one reason, summed over every thread.
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.packets().drops(reason)
    }

    /// Records whether `offload` is in use.
    pub(crate) fn set_offload(&self, offload: Offload, on: bool) {
        self.offloads[offload as usize].store(on, Ordering::Relaxed);
    }

    /// Whether `offload` is in use: as set when the data plane started, and for UDP GSO, on
    /// every socket now (none has it off after a failure).
    pub(crate) fn offload(&self, offload: Offload) -> bool {
        let on = self.offloads[offload as usize].load(Ordering::Relaxed);
        match offload {
            Offload::UdpGso => on && self.gso_off_sockets.load(Ordering::Relaxed) == 0,
            _ => on,
        }
    }

    /// Counts a repair of the TUN device's link state.
    pub(crate) fn count_link_repair(&self, what: RepairKind) {
        self.link_repairs[what as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Repairs of one kind so far.
    pub(crate) fn link_repairs(&self, what: RepairKind) -> u64 {
        self.link_repairs[what as usize].load(Ordering::Relaxed)
    }
}

impl Collector for Counters {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let p = self.packets();
        metrics::counter_family(
            &mut e,
            "weft_dataplane_drops_total",
            "Packets dropped, by direction and reason.",
            DropReason::ALL.map(|r| {
                let (dir, reason) = r.labels();
                ([("dir", dir), ("reason", reason)], p.drops(r))
            }),
        )?;
        metrics::counter_family(
            &mut e,
            "weft_dataplane_batches_total",
            "Batches of packets read from TUN (tx) or received from the sockets (rx): one read \
             loop or one recvmmsg each.",
            [([("dir", "tx")], p.tx_batches), ([("dir", "rx")], p.rx_batches)],
        )?;
        metrics::gauge_family(
            &mut e,
            "weft_dataplane_offload",
            "Whether an offload is in use (1) or not (0), by kind.",
            Offload::ALL.map(|o| ([("kind", o.label())], u64::from(self.offload(o)))),
        )?;
        metrics::counter_family(
            &mut e,
            "weft_dataplane_spins_total",
            "Times a forwarding thread kept looking instead of sleeping after a small step \
             (--spin), by how the spin ended: caught (work came: a wake-up saved), missed \
             (nothing came: time spent for nothing), cut (the CPU budget ran out).",
            SpinEnd::ALL.map(|end| ([("outcome", end.label())], p.spins(end))),
        )?;
        metrics::counter_family(
            &mut e,
            "weft_dataplane_flow_moves_total",
            "Times a flow went on from another forwarding thread than the one that carried it \
             last, by direction: tx (read from another TUN queue), rx (received on another \
             socket). One at a flow's start is normal; more can reorder it (docs/dataplane.md).",
            [Direction::Tx, Direction::Rx].map(|d| ([("dir", d.label())], p.flow_moves(d))),
        )?;
        metrics::counter_family(
            &mut e,
            "weft_dataplane_link_repairs_total",
            "Repairs of the TUN device's link state after someone else changed it, by what had \
             drifted.",
            RepairKind::ALL.map(|what| ([("what", what.label())], self.link_repairs(what))),
        )?;
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        for (name, help, v) in [
            (
                "weft_dataplane_tx_packets_total",
                "Packets encapsulated and sent to peers.",
                p.tx_packets,
            ),
            ("weft_dataplane_tx_bytes_total", "Bytes of inner packets sent to peers.", p.tx_bytes),
            (
                "weft_dataplane_rx_packets_total",
                "Packets decapsulated and delivered.",
                p.rx_packets,
            ),
            ("weft_dataplane_rx_bytes_total", "Bytes of inner packets delivered.", p.rx_bytes),
            ("weft_dataplane_io_errors_total", "Send and write errors.", p.io_errors),
            (
                "weft_dataplane_icmp_suppressed_total",
                "ICMP errors not sent to pods because of the rate limit.",
                p.icmp_suppressed,
            ),
            (
                "weft_dataplane_wakeups_total",
                "Times a forwarding thread woke from its sleep (epoll) to look at its queues.",
                p.wakeups,
            ),
            (
                "weft_dataplane_malformed_peer_alarms_total",
                "Times a peer's datagrams arrived malformed (a VXLAN header or inner packet cut \
                 short, bad VXLAN flags) at a rate: 20 within 10 s, counted per receiving \
                 thread; each logged at WARN, at most every 10 minutes per peer.",
                p.malformed_alarms,
            ),
            (
                "weft_dataplane_gso_fallbacks_total",
                "UDP GSO sends that failed and went out as single datagrams; each turned GSO off \
                 on its socket until a retry.",
                load(&self.gso_fallbacks),
            ),
            (
                "weft_dataplane_gso_reprobes_total",
                "Times a socket tried UDP GSO again after its retry time.",
                load(&self.gso_reprobes),
            ),
            (
                "weft_dataplane_gso_tail_pads_total",
                "UDP GSO messages sent with an 18-byte pad datagram as their last segment, so \
                 that none ends on a full segment (the workaround for kernels whose GSO \
                 mangles those; docs/troubleshooting.md).",
                load(&self.gso_tails.pads),
            ),
            (
                "weft_dataplane_gso_tail_singles_total",
                "Datagrams that workaround sent on their own ahead of the rest of their GSO \
                 message: runs too short to pad, or without room for the pad.",
                load(&self.gso_tails.singles),
            ),
            (
                "weft_dataplane_gso_equal_tails_total",
                "UDP GSO messages sent whose last datagram is as long as the segment size \
                 (none while the workaround is on).",
                load(&self.gso_tails.equal_tails),
            ),
        ] {
            metrics::counter(&mut e, name, help, v)?;
        }
        Ok(())
    }
}

/// How a spin ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinEnd {
    /// Work came before the spin's time was up: a wake-up saved.
    Caught,
    /// Nothing came within the whole spin: time spent for nothing, and a back-off.
    Missed,
    /// The CPU budget ran out first.
    Cut,
}

impl SpinEnd {
    /// Every outcome, in label order.
    pub const ALL: [Self; 3] = [Self::Caught, Self::Missed, Self::Cut];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Caught => "caught",
            Self::Missed => "missed",
            Self::Cut => "cut",
        }
    }
}

/// What drifted, and so what was repaired: the `what` label of
/// `weft_dataplane_link_repairs_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(usize)]
pub(crate) enum RepairKind {
    /// The route for the Network through the device.
    Route,
    /// The link's `IFF_UP` flag.
    Up,
    /// The device's address, `<subnet>.0/32`.
    Address,
    /// The device's MTU.
    Mtu,
    /// The route for the IPv6 network through the device.
    Route6,
    /// The device's IPv6 address, `<v6 subnet>::/128`.
    Address6,
}

impl RepairKind {
    /// Every kind, in metric order.
    pub(crate) const ALL: [Self; 6] =
        [Self::Route, Self::Up, Self::Address, Self::Mtu, Self::Route6, Self::Address6];

    /// The `what` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Up => "up",
            Self::Address => "address",
            Self::Mtu => "mtu",
            Self::Route6 => "ipv6_route",
            Self::Address6 => "ipv6_address",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_are_gauges_on_metrics() {
        let c = Arc::new(Counters::default());
        c.set_offload(Offload::TunTso, true);
        c.set_offload(Offload::UdpGso, true);
        c.set_offload(Offload::UdpGso, false);
        let out = render(&c);
        assert!(out.contains("# TYPE weft_dataplane_offload gauge\n"));
        for (kind, v) in [("tun_tso", 1), ("tun_uso", 0), ("udp_gso", 0), ("udp_gro", 0)] {
            let line = format!("weft_dataplane_offload{{kind=\"{kind}\"}} {v}\n");
            assert!(out.contains(&line), "{line} missing from\n{out}");
        }
    }

    fn render(c: &Arc<Counters>) -> String {
        metrics::render_collector(c.clone()).unwrap()
    }

    /// The data plane metrics byte for byte as weft's hand-written renderer wrote them before
    /// prometheus-client (`tests/golden/metrics_dataplane.prom` is its output for the same
    /// counts, then in one shared block), here the sums of two threads' blocks; and the
    /// metrics added since (the GSO tail counts, the pad drop, the flow moves) in the same
    /// format.
    #[test]
    fn dataplane_metrics_are_the_threads_sums_rendered_exactly_as_before() {
        let c = Arc::new(Counters::default());
        let (q0, q1) = (c.thread("weft-q0"), c.thread("weft-q1"));
        q0.count_drop(DropReason::TxNoRoute);
        q1.count_drop(DropReason::RxWrongVni);
        q0.count_drop(DropReason::RxWrongVni);
        q0.tx_packets.fetch_add(4, Ordering::Relaxed);
        q1.tx_packets.fetch_add(6, Ordering::Relaxed);
        q0.tx_bytes.fetch_add(1000, Ordering::Relaxed);
        q1.rx_packets.fetch_add(20, Ordering::Relaxed);
        q0.rx_bytes.fetch_add(2000, Ordering::Relaxed);
        q1.io_errors.fetch_add(5, Ordering::Relaxed);
        q0.icmp_suppressed.fetch_add(6, Ordering::Relaxed);
        q0.wakeups.fetch_add(7, Ordering::Relaxed);
        q1.wakeups.fetch_add(1, Ordering::Relaxed);
        q0.tx_batches.fetch_add(9, Ordering::Relaxed);
        q1.rx_batches.fetch_add(10, Ordering::Relaxed);
        q0.malformed_alarms.fetch_add(1, Ordering::Relaxed);
        q1.malformed_alarms.fetch_add(1, Ordering::Relaxed);
        q0.count_spin(SpinEnd::Caught);
        q1.count_spin(SpinEnd::Caught);
        q1.count_spin(SpinEnd::Missed);
        c.set_offload(Offload::TunTso, true);
        c.set_offload(Offload::UdpGso, true);
        c.gso_fallbacks.fetch_add(3, Ordering::Relaxed);
        c.gso_reprobes.fetch_add(4, Ordering::Relaxed);
        c.count_link_repair(RepairKind::Mtu);
        q1.count_drop(DropReason::RxGsoPad);
        c.gso_tails.pads.fetch_add(11, Ordering::Relaxed);
        c.gso_tails.singles.fetch_add(12, Ordering::Relaxed);
        c.gso_tails.equal_tails.fetch_add(13, Ordering::Relaxed);
        // A flow sent by q0 then q1 (a move), one received by q1 then q0 then q0 (one move).
        q0.carried(7, Direction::Tx);
        q1.carried(7, Direction::Tx);
        q1.carried(9, Direction::Rx);
        q0.carried(9, Direction::Rx);
        q0.carried(9, Direction::Rx);
        assert_eq!(render(&c), include_str!("../../../tests/golden/metrics_dataplane.prom"));
    }

    /// Each thread counts in a block of its own, on cache lines no other block shares; a thread
    /// started again under its name counts on in its block; the sums are exact while threads
    /// add.
    #[test]
    fn each_thread_counts_in_its_own_cache_lines_and_the_sums_are_exact() {
        let c = Counters::default();
        let (q0, q1) = (c.thread("weft-q0"), c.thread("weft-q1"));
        assert!(!Arc::ptr_eq(&q0, &q1), "two threads share one block");
        let line = 64;
        let (a0, a1) = (&**q0 as *const PacketCounters as usize, &**q1 as *const _ as usize);
        assert_eq!((a0 % line, a1 % line), (0, 0), "a block does not start a cache line");
        let size = std::mem::size_of::<CachePadded<PacketCounters>>();
        assert_eq!(size % line, 0, "a block shares its last cache line");
        q0.tx_packets.fetch_add(1, Ordering::Relaxed);
        drop(q0);
        assert!(Arc::ptr_eq(&c.thread("weft-q0"), &c.thread("weft-q0")));
        assert_eq!(c.thread("weft-q0").tx_packets.load(Ordering::Relaxed), 1);
        std::thread::scope(|s| {
            for name in ["weft-q0", "weft-q1", "weft-q2"] {
                let block = c.thread(name);
                s.spawn(move || {
                    for _ in 0..10_000 {
                        block.tx_packets.fetch_add(1, Ordering::Relaxed);
                        block.tx_bytes.fetch_add(100, Ordering::Relaxed);
                    }
                });
            }
        });
        let p = c.packets();
        assert_eq!((p.tx_packets, p.tx_bytes), (30_001, 3_000_000));
    }

    #[test]
    fn the_udp_gso_gauge_is_0_while_any_socket_has_gso_off_and_1_again_after() {
        let c = Arc::new(Counters::default());
        c.set_offload(Offload::UdpGso, true);
        let gauge = "weft_dataplane_offload{kind=\"udp_gso\"} ";
        assert!(render(&c).contains(&format!("{gauge}1\n")));
        c.gso_off_sockets.fetch_add(2, Ordering::Relaxed);
        assert!(!c.offload(Offload::UdpGso));
        assert!(render(&c).contains(&format!("{gauge}0\n")));
        c.gso_off_sockets.fetch_sub(1, Ordering::Relaxed);
        assert!(!c.offload(Offload::UdpGso), "one socket is still off");
        c.gso_off_sockets.fetch_sub(1, Ordering::Relaxed);
        assert!(c.offload(Offload::UdpGso));
        assert!(render(&c).contains(&format!("{gauge}1\n")));
        // Switched off at start, it stays 0 whatever the sockets do.
        c.set_offload(Offload::UdpGso, false);
        assert!(render(&c).contains(&format!("{gauge}0\n")));
        // The other offloads do not look at GSO's sockets.
        c.set_offload(Offload::UdpGro, true);
        c.gso_off_sockets.fetch_add(1, Ordering::Relaxed);
        assert!(c.offload(Offload::UdpGro));
    }

    #[test]
    fn gso_fallbacks_and_reprobes_are_counters_on_metrics() {
        let c = Arc::new(Counters::default());
        c.gso_fallbacks.fetch_add(3, Ordering::Relaxed);
        c.gso_reprobes.fetch_add(2, Ordering::Relaxed);
        let out = render(&c);
        for (name, v) in
            [("weft_dataplane_gso_fallbacks_total", 3), ("weft_dataplane_gso_reprobes_total", 2)]
        {
            assert!(out.contains(&format!("# TYPE {name} counter\n")), "{out}");
            assert!(out.contains(&format!("\n{name} {v}\n")), "{out}");
        }
    }

    #[test]
    fn link_repairs_are_counters_by_what_drifted_on_metrics() {
        let c = Arc::new(Counters::default());
        c.count_link_repair(RepairKind::Route);
        c.count_link_repair(RepairKind::Route);
        c.count_link_repair(RepairKind::Mtu);
        let out = render(&c);
        assert!(out.contains("# TYPE weft_dataplane_link_repairs_total counter\n"), "{out}");
        for (what, v) in [("route", 2), ("up", 0), ("address", 0), ("mtu", 1)] {
            let line = format!("weft_dataplane_link_repairs_total{{what=\"{what}\"}} {v}\n");
            assert!(out.contains(&line), "{line} missing from\n{out}");
        }
    }

    #[test]
    fn suppressed_icmp_errors_are_a_counter_on_metrics() {
        let c = Arc::new(Counters::default());
        c.thread("weft-q0").icmp_suppressed.fetch_add(3, Ordering::Relaxed);
        c.thread("weft-q1").icmp_suppressed.fetch_add(4, Ordering::Relaxed);
        let out = render(&c);
        assert!(out.contains("# TYPE weft_dataplane_icmp_suppressed_total counter\n"), "{out}");
        assert!(out.contains("\nweft_dataplane_icmp_suppressed_total 7\n"), "{out}");
    }
}
