//! Per-packet forwarding decisions, without syscalls: TUN packet → route lookup → encapsulated
//! datagram, and datagram → validation → decapsulated packet.
//!
//! # Buffers
//! The caller owns every buffer. A packet read from TUN sits at `buf[HEADROOM..HEADROOM + n]`,
//! so that encapsulation writes the VXLAN header and inner Ethernet header into the headroom in
//! front of it and never copies the payload; the kernel adds the outer IP and UDP headers. A
//! received datagram sits at `buf[..n]`; decapsulation returns the range of the inner IP packet.
//!
//! # Contract
//! - Pure: no atomics but the shared [`IcmpLimit`] bucket and [`OwnSubnet`], no metrics, no
//!   syscalls. Nothing on the per-packet path ([`Forwarder`]) panics on any input, allocates,
//!   locks, or logs: every rejected packet is a [`Drop`] with a reason, which the caller counts
//!   in its thread's own counters ([`super::counters`]).
//! - Receive validation (docs/dataplane.md, "Receiving"): the outer source must be a known
//!   peer; the VNI must match; the inner Ethernet destination must be our VTEP MAC; the inner
//!   source must lie inside the sending peer's subnet; the inner destination must lie inside
//!   our own subnet.
//! - A destination outside every lease is answered as flannel's udp backend does: an ICMP
//!   destination-unreachable (net unreachable) written back to the TUN device, at most as
//!   often as the [`IcmpLimit`] token bucket allows (a pod flooding unleased addresses gets
//!   a burst of replies, then a steady trickle; the rest are counted, not answered).
//! - No clock is read here: the caller passes `now` to [`Forwarder::encap`] and
//!   [`Forwarder::route`].

#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::wire::ethernet::MacAddr;
use super::wire::{self, ethernet, icmpv4, ipv4, vxlan};
use crate::config::BackendKind;
use crate::lease::record::Subnet;
use crate::route::{PeerBackend, RouteTable};
use crate::time::Instant;

/// Bytes reserved in front of a TUN packet for the VXLAN header and the inner Ethernet header.
pub const HEADROOM: usize = vxlan::HEADER_LEN + ethernet::HEADER_LEN;

/// Why a packet was dropped. Each reason has its own counter on `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum DropReason {
    /// TX: not a valid IPv4 packet.
    TxMalformed,
    /// TX: IPv6 is not carried yet.
    TxIpv6,
    /// TX: the destination is in no lease (answered with ICMP net unreachable when allowed).
    TxNoRoute,
    /// TX: the destination is in our own subnet: it should never have reached the TUN device.
    TxOwnSubnet,
    /// TX: the peer's lease is of another backend (or a vxlan lease without a VtepMAC).
    TxBackendMismatch,
    /// TX: this host holds no subnet yet.
    TxNoSubnet,
    /// TX: the UDP socket's send buffer stayed full while the worker waited for room (the
    /// kernel queues to the peers faster than they drain): the rest of the batch is dropped,
    /// as a full kernel queue drops, rather than stall the TUN reads behind it.
    TxSendBufferFull,
    /// RX: shorter than the headers it claims, or not a valid IPv4 packet inside.
    RxMalformed,
    /// RX: the datagram was longer than the receive buffer (`MSG_TRUNC`; no peer weft talks
    /// to sends one: the buffers hold a whole 64 KiB GRO batch).
    RxTruncated,
    /// RX: VXLAN flags other than the I bit alone.
    RxBadFlags,
    /// RX: another VNI.
    RxWrongVni,
    /// RX: inner Ethernet destination is not our VTEP MAC.
    RxNotOurMac,
    /// RX: inner frame is not IPv4.
    RxNotIpv4,
    /// RX: the outer source address is not any peer's public IP.
    RxUnknownSender,
    /// RX: the inner source address is not inside the sending peer's subnet.
    RxSpoofedSource,
    /// RX: the inner destination is not inside our subnet.
    RxNotForUs,
    /// RX: the TTL ran out (loop protection for the udp backend).
    RxTtlExpired,
}

impl DropReason {
    /// Every reason, in counter order.
    pub(crate) const ALL: [DropReason; 17] = [
        DropReason::TxMalformed,
        DropReason::TxIpv6,
        DropReason::TxNoRoute,
        DropReason::TxOwnSubnet,
        DropReason::TxBackendMismatch,
        DropReason::TxNoSubnet,
        DropReason::TxSendBufferFull,
        DropReason::RxMalformed,
        DropReason::RxTruncated,
        DropReason::RxBadFlags,
        DropReason::RxWrongVni,
        DropReason::RxNotOurMac,
        DropReason::RxNotIpv4,
        DropReason::RxUnknownSender,
        DropReason::RxSpoofedSource,
        DropReason::RxNotForUs,
        DropReason::RxTtlExpired,
    ];

    /// The direction and reason labels for `/metrics`.
    pub(crate) fn labels(self) -> (&'static str, &'static str) {
        match self {
            DropReason::TxMalformed => ("tx", "malformed"),
            DropReason::TxIpv6 => ("tx", "ipv6"),
            DropReason::TxNoRoute => ("tx", "no_route"),
            DropReason::TxOwnSubnet => ("tx", "own_subnet"),
            DropReason::TxBackendMismatch => ("tx", "backend_mismatch"),
            DropReason::TxSendBufferFull => ("tx", "send_buffer_full"),
            DropReason::TxNoSubnet => ("tx", "no_subnet"),
            DropReason::RxMalformed => ("rx", "malformed"),
            DropReason::RxTruncated => ("rx", "truncated"),
            DropReason::RxBadFlags => ("rx", "bad_vxlan_flags"),
            DropReason::RxWrongVni => ("rx", "wrong_vni"),
            DropReason::RxNotOurMac => ("rx", "not_our_mac"),
            DropReason::RxNotIpv4 => ("rx", "not_ipv4"),
            DropReason::RxUnknownSender => ("rx", "unknown_sender"),
            DropReason::RxSpoofedSource => ("rx", "spoofed_source"),
            DropReason::RxNotForUs => ("rx", "not_for_us"),
            DropReason::RxTtlExpired => ("rx", "ttl_expired"),
        }
    }
}

/// What to do with a packet read from TUN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tx {
    /// Send `buf[range]` to `peer`; `flow` picks the outer source port.
    Send {
        /// The peer's underlay address and port.
        peer: SocketAddr,
        /// The datagram inside the caller's buffer.
        range: Range<usize>,
        /// A hash of the inner flow.
        flow: u32,
    },
    /// Write `reply[..len]` (an ICMP error) back to TUN, and count the drop.
    Reply {
        /// Bytes of the reply.
        len: usize,
        /// Why the original was dropped.
        reason: DropReason,
    },
    /// Drop it.
    Drop(DropReason),
    /// Drop it: it deserved an ICMP error, but the [`IcmpLimit`] bucket is empty. Count the
    /// drop and the suppressed reply.
    Suppressed(DropReason),
}

/// Why a TUN packet is not sent, from [`Forwarder::route`]: the [`Tx::Drop`], [`Tx::Reply`]
/// and [`Tx::Suppressed`] cases of [`Tx`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Drop it.
    Drop(DropReason),
    /// Write `reply[..len]` (an ICMP error) back to TUN, and count the drop.
    Reply {
        /// Bytes of the reply.
        len: usize,
        /// Why the original was dropped.
        reason: DropReason,
    },
    /// Drop it without the ICMP error it deserved (rate limit); count the drop and the
    /// suppression.
    Suppressed(DropReason),
}

impl From<Refusal> for Tx {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Drop(reason) => Tx::Drop(reason),
            Refusal::Reply { len, reason } => Tx::Reply { len, reason },
            Refusal::Suppressed(reason) => Tx::Suppressed(reason),
        }
    }
}

/// A token bucket for the ICMP errors weft writes back to TUN, shared by every worker.
///
/// The defaults are the kernel's host-wide limit for ICMP errors, `net.ipv4.icmp_msgs_per_sec`
/// = 1000 and `net.ipv4.icmp_msgs_burst` = 50 (Documentation/networking/ip-sysctl.rst): a
/// burst of 50 replies, then one per millisecond. (The kernel also limits per destination,
/// `icmp_ratelimit` = 1000 ms, in its peer cache; weft's replies all go to local pods, and one
/// host-wide bucket bounds the work a flooding pod can cause without a table.)
///
/// It is the generic cell rate algorithm, which is a token bucket kept as one number, the
/// "theoretical arrival time" `tat`: the bucket holds `(now + burst·interval − tat) / interval`
/// tokens, at most `burst`. A reply is allowed while `tat + interval ≤ now + burst·interval`,
/// and moves `tat` to `max(tat, now) + interval`. One atomic, no lock, no allocation.
///
/// Time is whatever `now` the caller passes (nanoseconds since its clock's epoch); nothing
/// here reads a clock. A huge gap only fills the bucket (never past `burst`); time going
/// backwards never adds tokens: the bucket counts as empty from the earlier `now` and refills
/// from there (so a step back stalls replies for at most one bucket's refill). At the end of
/// `u64` nanoseconds (584 years) nothing more is allowed rather than anything overflowing.
#[derive(Debug)]
pub struct IcmpLimit {
    interval_ns: u64,
    burst_ns: u64,
    tat: AtomicU64,
}

impl Default for IcmpLimit {
    /// [`IcmpLimit::PER_SEC`] replies a second, bursts of [`IcmpLimit::BURST`].
    fn default() -> Self {
        Self::new(Self::PER_SEC, Self::BURST)
    }
}

impl IcmpLimit {
    /// The default rate: the kernel's `icmp_msgs_per_sec`.
    pub(crate) const PER_SEC: u32 = 1000;
    /// The default burst: the kernel's `icmp_msgs_burst`.
    pub const BURST: u32 = 50;

    /// A full bucket of `burst` replies refilled at `per_sec` a second (both at least 1; at
    /// most one a nanosecond).
    pub fn new(per_sec: u32, burst: u32) -> Self {
        let interval_ns = (1_000_000_000 / u64::from(per_sec.max(1))).max(1);
        Self {
            interval_ns,
            burst_ns: interval_ns.saturating_mul(u64::from(burst.max(1))),
            tat: AtomicU64::new(0),
        }
    }

    /// Takes a token at `now` if there is one: whether a reply may be sent.
    pub(crate) fn allow(&self, now: Instant) -> bool {
        let now = u64::try_from(now.since_epoch().as_nanos()).unwrap_or(u64::MAX);
        // Past this, `tat` can only come from a later `now` than this one (time went back).
        let ceiling = now.saturating_add(self.burst_ns);
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let next = match tat.max(now).checked_add(self.interval_ns) {
                Some(next) if next <= ceiling && ceiling < u64::MAX => next,
                _ => {
                    if tat > ceiling {
                        // Time went back: empty from here, not for as long as the step.
                        let _ = self.tat.compare_exchange(
                            tat,
                            ceiling,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                    }
                    return false;
                }
            };
            match self.tat.compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(seen) => tat = seen,
            }
        }
    }
}

/// Where a TUN packet goes, from [`Forwarder::route`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TxRoute {
    /// The peer's address and backend port.
    pub(crate) to: SocketAddr,
    /// The inner flow's hash (picks the outer source port).
    pub(crate) flow: u32,
    /// The peer's VTEP MAC (vxlan only).
    pub(crate) peer_mac: Option<MacAddr>,
}

/// What to do with a received datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rx {
    /// Write `buf[range]` (the inner IP packet) to TUN.
    Deliver {
        /// Where the inner packet lies in the caller's buffer.
        range: Range<usize>,
        /// The sender is a weft peer (its lease names a weft node). weft always sends a UDP
        /// checksum, which the kernel verified before the datagram reached the socket, and it
        /// covers the inner packet: its checksums need not be verified again. A kernel VXLAN
        /// peer (flannel's `flannel.1`) sends none, so this is `false` for it.
        checksums_trusted: bool,
    },
    /// Drop it.
    Drop(DropReason),
}

/// This host's subnet, readable per packet without a lock (0 = none yet).
#[derive(Debug, Default)]
pub struct OwnSubnet(AtomicU64);

impl OwnSubnet {
    /// Sets (or clears) the subnet.
    pub fn set(&self, subnet: Option<Subnet>) {
        let v = subnet.map_or(0, |s| {
            (u64::from(u32::from(s.network())) << 8) | u64::from(s.prefix_len()) | 1 << 40
        });
        self.0.store(v, Ordering::Release);
    }

    /// Whether a subnet is set and contains `addr`: two loads and a mask, no validation,
    /// because this runs for every packet.
    #[inline]
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        let v = self.0.load(Ordering::Acquire);
        if v == 0 {
            return false;
        }
        let len = (v & 0xff) as u32;
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len.min(32)) };
        u32::from(addr) & mask == (v >> 8) as u32
    }

    /// Whether a subnet is set.
    #[inline]
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }

    /// The subnet.
    pub(crate) fn get(&self) -> Option<Subnet> {
        let v = self.0.load(Ordering::Acquire);
        if v == 0 {
            return None;
        }
        Subnet::from_parts(Ipv4Addr::from((v >> 8) as u32), (v & 0xff) as u8).ok()
    }
}

/// The per-host forwarding configuration.
#[derive(Clone, Debug)]
pub struct Forwarder {
    /// vxlan or udp.
    pub backend: BackendKind,
    /// The VXLAN network identifier.
    pub vni: vxlan::Vni,
    /// The UDP port peers listen on.
    pub port: u16,
    /// Our VTEP MAC (the inner Ethernet source, and the destination peers must use).
    pub our_mac: MacAddr,
    /// Our subnet.
    pub own: Arc<OwnSubnet>,
    /// The source address of the ICMP errors weft answers with: the cluster network's base
    /// address. It is routed through the TUN device but is no local address — a packet
    /// arriving on the TUN with a local source (such as the TUN's own `<subnet>.0`) is dropped
    /// by the kernel as a martian.
    pub icmp_source: Ipv4Addr,
    /// The bucket every ICMP error must take a token from (shared by the workers).
    pub icmp_limit: Arc<IcmpLimit>,
}

impl Forwarder {
    /// Decides what to do with the packet at `buf[HEADROOM..HEADROOM + len]`, read at `now`;
    /// may write the encapsulation headers into `buf[..HEADROOM]`, or an ICMP error into
    /// `reply`.
    pub fn encap(
        &self,
        routes: &RouteTable,
        buf: &mut [u8],
        len: usize,
        reply: &mut [u8],
        now: Instant,
    ) -> Tx {
        let Some(end) = HEADROOM.checked_add(len).filter(|e| *e <= buf.len()) else {
            return Tx::Drop(DropReason::TxMalformed);
        };
        let route = match self.route(routes, &buf[HEADROOM..end], reply, now) {
            Ok(r) => r,
            Err(refusal) => return refusal.into(),
        };
        let start = HEADROOM - self.headroom();
        self.emit_encap(&route, &mut buf[start..HEADROOM]);
        Tx::Send { peer: route.to, range: start..end, flow: route.flow }
    }

    /// The bytes of encapsulation in front of each packet in a datagram: [`HEADROOM`] for
    /// vxlan, none for udp (flannel's udp backend sends the bare IP packet).
    pub fn headroom(&self) -> usize {
        match self.backend {
            BackendKind::Vxlan => HEADROOM,
            BackendKind::Udp => 0,
        }
    }

    /// Where the TUN packet `packet`, read at `now`, goes: the peer and the flow hash, or why
    /// it does not go (a drop, or an ICMP error written into `reply` when [`IcmpLimit`]
    /// allows one at `now`).
    /// Every segment of a TSO super-packet goes where the super-packet goes, so one call
    /// routes them all.
    pub(crate) fn route(
        &self,
        routes: &RouteTable,
        packet: &[u8],
        reply: &mut [u8],
        now: Instant,
    ) -> Result<TxRoute, Refusal> {
        match wire::ip::version(packet) {
            Some(4) => {}
            Some(6) => return Err(Refusal::Drop(DropReason::TxIpv6)),
            _ => return Err(Refusal::Drop(DropReason::TxMalformed)),
        }
        let Ok(ip) = ipv4::Packet::new_checked(packet) else {
            return Err(Refusal::Drop(DropReason::TxMalformed));
        };
        let dst = ip.dst_addr();
        if !self.own.is_set() {
            return Err(Refusal::Drop(DropReason::TxNoSubnet));
        }
        if self.own.contains(dst) {
            return Err(Refusal::Drop(DropReason::TxOwnSubnet));
        }
        let Some(peer) = routes.lookup(dst) else {
            if !self.icmp_limit.allow(now) {
                return Err(Refusal::Suppressed(DropReason::TxNoRoute));
            }
            return Err(match icmpv4::emit_dest_unreachable(packet, 0, self.icmp_source, reply) {
                Ok(len) => Refusal::Reply { len, reason: DropReason::TxNoRoute },
                Err(_) => Refusal::Drop(DropReason::TxNoRoute),
            });
        };
        let flow = wire::flow_hash(packet);
        let to = SocketAddr::V4(SocketAddrV4::new(peer.public_ip, self.port));
        let peer_mac = match (self.backend, peer.backend, peer.vtep_mac) {
            (BackendKind::Udp, PeerBackend::Udp, _) => None,
            (BackendKind::Vxlan, PeerBackend::Vxlan, Some(mac)) => Some(mac),
            _ => return Err(Refusal::Drop(DropReason::TxBackendMismatch)),
        };
        Ok(TxRoute { to, flow, peer_mac })
    }

    /// Writes the encapsulation for `route` into `head`, which is [`Self::headroom`] bytes
    /// long (nothing for udp; the VXLAN and inner Ethernet headers for vxlan).
    pub(crate) fn emit_encap(&self, route: &TxRoute, head: &mut [u8]) {
        let (Some(peer_mac), Some((vx, eth))) =
            (route.peer_mac, head.split_at_mut_checked(vxlan::HEADER_LEN))
        else {
            return;
        };
        // Both emits write into room of at least their header length: they cannot fail, and
        // the VNI was validated when the forwarder was built.
        let _ = vxlan::Repr { vni: self.vni }.emit(vx);
        let _ = ethernet::Repr {
            src_addr: self.our_mac,
            dst_addr: peer_mac,
            ethertype: ethernet::EtherType::IPV4,
        }
        .emit(eth);
    }

    /// Validates and decapsulates the datagram at `buf[..len]`, received from `from`.
    pub fn decap(&self, routes: &RouteTable, from: SocketAddr, buf: &mut [u8], len: usize) -> Rx {
        // IPv6 peers come with the IPv6 data plane (docs/dual-stack.md, slice 3): none is known.
        let SocketAddr::V4(from) = from else {
            return Rx::Drop(DropReason::RxUnknownSender);
        };
        let Some(datagram) = buf.get_mut(..len) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        let inner = match self.backend {
            BackendKind::Vxlan => {
                let Ok(vx) = vxlan::Packet::new_checked(&datagram[..]) else {
                    return Rx::Drop(DropReason::RxMalformed);
                };
                let repr = match vxlan::Repr::parse(&vx) {
                    Ok(r) => r,
                    Err(_) => return Rx::Drop(DropReason::RxBadFlags),
                };
                if repr.vni != self.vni {
                    return Rx::Drop(DropReason::RxWrongVni);
                }
                let Ok(eth) = ethernet::Frame::new_checked(&datagram[vxlan::HEADER_LEN..]) else {
                    return Rx::Drop(DropReason::RxMalformed);
                };
                if eth.dst_addr() != self.our_mac {
                    return Rx::Drop(DropReason::RxNotOurMac);
                }
                if eth.ethertype() != ethernet::EtherType::IPV4 {
                    return Rx::Drop(DropReason::RxNotIpv4);
                }
                HEADROOM..len
            }
            BackendKind::Udp => 0..len,
        };
        let Ok(mut ip) = ipv4::Packet::new_checked(&mut datagram[inner.clone()]) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        let (src, dst) = (ip.src_addr(), ip.dst_addr());
        let checksums_trusted = match routes.lookup(src) {
            Some(peer) if peer.public_ip == *from.ip() => peer.node.is_some(),
            _ if routes.is_known_peer(*from.ip()) => return Rx::Drop(DropReason::RxSpoofedSource),
            _ => return Rx::Drop(DropReason::RxUnknownSender),
        };
        if !self.own.contains(dst) {
            return Rx::Drop(DropReason::RxNotForUs);
        }
        if self.backend == BackendKind::Udp {
            // flannel's udp proxy decrements the TTL on each hop; so do we, against loops.
            if ip.hop_limit() <= 1 {
                return Rx::Drop(DropReason::RxTtlExpired);
            }
            ip.decrement_ttl_incremental();
        }
        // Only the IP packet's own length is delivered, never trailing bytes.
        let total = usize::from(ip.total_len());
        Rx::Deliver { range: inner.start..inner.start + total, checksums_trusted }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn at(d: Duration) -> Instant {
        Instant::from_epoch(d)
    }

    /// How many of `tries` replies the bucket allows at `now`.
    fn allowed(limit: &IcmpLimit, now: Instant, tries: usize) -> usize {
        (0..tries).filter(|_| limit.allow(now)).count()
    }

    #[test]
    fn icmp_limit_allows_a_burst_then_one_per_interval() {
        let limit = IcmpLimit::default();
        let t0 = at(Duration::from_secs(100));
        assert_eq!(allowed(&limit, t0, 500), 50, "the burst");
        assert_eq!(allowed(&limit, t0 + MS / 2, 10), 0, "half an interval refills nothing");
        assert_eq!(allowed(&limit, t0 + MS, 10), 1, "one interval refills one");
        assert_eq!(allowed(&limit, t0 + 10 * MS, 10), 9, "ten intervals refill the other nine");
        // Steady flood: one a millisecond.
        let mut n = 0;
        for i in 11..1011u32 {
            n += allowed(&limit, t0 + i * MS, 3);
        }
        assert_eq!(n, 1000);
    }

    #[test]
    fn icmp_limit_refills_to_the_burst_and_no_further() {
        let limit = IcmpLimit::new(10, 5);
        let t0 = at(Duration::from_secs(1));
        assert_eq!(allowed(&limit, t0, 100), 5);
        // 1 s refills 10 tokens' worth into a bucket of 5.
        assert_eq!(allowed(&limit, t0 + Duration::from_secs(1), 100), 5);
        // An hour, a century: still a bucket of 5.
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(allowed(&limit, later, 100), 5);
        let much_later = later + Duration::from_secs(100 * 365 * 86400);
        assert_eq!(allowed(&limit, much_later, 100), 5);
    }

    #[test]
    fn icmp_limit_gains_nothing_when_time_goes_backwards() {
        let limit = IcmpLimit::new(1000, 50);
        let t = at(Duration::from_secs(10_000));
        assert_eq!(allowed(&limit, t, 100), 50);
        // An hour back: no tokens, however often asked...
        let back = t - Duration::from_secs(3600);
        assert_eq!(allowed(&limit, back, 100), 0);
        // ... and refilling from there, not stalled until the clock is back at `t`.
        assert_eq!(allowed(&limit, back + MS, 100), 1);
        assert_eq!(allowed(&limit, back + Duration::from_secs(1), 100), 50);
        // A fresh bucket fed a clock that starts high and steps down to zero.
        let limit = IcmpLimit::new(1000, 50);
        assert_eq!(allowed(&limit, at(Duration::from_secs(5)), 10), 10);
        assert_eq!(allowed(&limit, Instant::ZERO, 100), 0);
        assert_eq!(allowed(&limit, Instant::ZERO + 50 * MS, 100), 50);
    }

    #[test]
    fn icmp_limit_survives_the_ends_of_time_and_odd_settings() {
        for limit in
            [IcmpLimit::default(), IcmpLimit::new(0, 0), IcmpLimit::new(u32::MAX, u32::MAX)]
        {
            let end = at(Duration::MAX);
            let near_end = at(Duration::from_nanos(u64::MAX - 1));
            for now in [Instant::ZERO, near_end, end, Instant::ZERO, end] {
                assert!(allowed(&limit, now, 1000) <= 1000);
            }
            // Nothing is allowed at the end of time (rather than everything).
            assert_eq!(allowed(&limit, end, 10), 0, "{limit:?}");
        }
        // Zero rate and burst mean one a second, bursts of one.
        let limit = IcmpLimit::new(0, 0);
        assert_eq!(allowed(&limit, at(Duration::from_secs(10)), 10), 1);
        assert_eq!(allowed(&limit, at(Duration::from_millis(10_999)), 10), 0);
        assert_eq!(allowed(&limit, at(Duration::from_secs(11)), 10), 1);
    }

    #[test]
    fn icmp_limit_is_shared_exactly_between_threads() {
        let limit = IcmpLimit::new(1000, 50);
        let now = at(Duration::from_secs(7));
        let total: usize = std::thread::scope(|s| {
            let handles: Vec<_> =
                (0..4).map(|_| s.spawn(|| allowed(&limit, now, 10_000))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(total, 50);
    }

    #[test]
    fn own_subnet_contains_matches_the_subnet() {
        let own = OwnSubnet::default();
        assert!(!own.is_set());
        assert!(!own.contains(Ipv4Addr::new(10, 244, 3, 7)));
        own.set(Some("10.244.3.0/24".parse().unwrap()));
        assert!(own.contains(Ipv4Addr::new(10, 244, 3, 7)));
        assert!(own.contains(Ipv4Addr::new(10, 244, 3, 0)));
        assert!(!own.contains(Ipv4Addr::new(10, 244, 4, 7)));
        assert_eq!(own.get(), Some("10.244.3.0/24".parse().unwrap()));
        own.set(None);
        assert!(!own.contains(Ipv4Addr::new(10, 244, 3, 7)));
    }
}
