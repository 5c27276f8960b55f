//! Per-packet forwarding decisions, without syscalls: TUN packet → route lookup → encapsulated
//! datagram, and datagram → validation → decapsulated packet.
//!
//! # Layout
//! This file holds what every transport shares: the [`Forwarder`] and its dispatch on the
//! backend, the drop reasons, the ICMP errors and the route lookups. Each transport's own
//! headers and receive checks are a file beside it (`vxlan.rs`, `udp.rs`, `ipip.rs`; a new
//! transport is a new file here); [`wireguard`], a stateful transport with sessions, is a
//! folder of its own, which the workers call through [`Forwarder::wireguard`]; [`malformed_peers`] watches for peers that send
//! garbage.
//! Below it only [`super::wire`], [`super::offload`] and [`super::sys`]'s plain constants.
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
//!   in its thread's own counters ([`crate::dataplane::worker::counters`]).
//! - Receive validation (docs/dataplane.md, "Receiving"): the outer source must be a known
//!   peer; the VNI must match; the inner Ethernet destination must be our VTEP MAC; the inner
//!   source must lie inside the sending peer's subnet; the inner destination must lie inside
//!   our own subnet.
//! - IPv6 (a dual-stack vxlan network, docs/dual-stack.md): the same rules over the IPv6
//!   halves. An IPv6 inner packet travels only over the IPv6 underlay (as flannel's
//!   `flannel-v6` device sends it), between the peers' `PublicIPv6` addresses, with EtherType
//!   IPv6; the inner source must lie inside the sender's IPv6 half and the destination inside
//!   ours. Without an own IPv6 subnet (an IPv4-only network, or the udp backend, which carries
//!   IPv4 only) IPv6 packets are dropped as before (`tx ipv6`).
//! - A destination outside every lease is answered as flannel's udp backend does: an ICMP
//!   destination-unreachable (net unreachable) written back to the TUN device, at most as
//!   often as the [`IcmpLimit`] token bucket allows (a pod flooding unleased addresses gets
//!   a burst of replies, then a steady trickle; the rest are counted, not answered).
//! - ipip (flannel's ipip backend, [`wire::ipip`]): the outer IPv4 header goes in front of the
//!   packet, in the headroom, with a zero source address that the raw socket's kernel fills in
//!   from the socket's binding (the public IP) as it fills a UDP datagram's source. A received
//!   datagram is the whole outer packet as the raw socket delivers it: its outer source must
//!   be a known peer's `PublicIP`, the inner packet IPv4 from inside that peer's subnet to
//!   ours, and ECN is decapsulated as RFC 6040 says (as Linux's `ip_tunnel_rcv`).
//! - No clock is read here: the caller passes `now` to [`Forwarder::encap`] and
//!   [`Forwarder::route`].

#![forbid(unsafe_code)]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwapOption;

use super::wire::ethernet::MacAddr;
use super::wire::{self, ethernet, icmpv4, icmpv6, ipv4, ipv6};
use crate::config::BackendKind;
use crate::dataplane::sys::udp::gso_tail;
use crate::lease::record::{Ipv6Subnet, Subnet};
use crate::route::{PeerBackend, RouteTable, backends};
use crate::time::Instant;

mod ipip;
pub mod malformed_peers;
mod udp;
mod vxlan;
pub mod wireguard;

use malformed_peers::MalformedLog;

/// Bytes reserved in front of a TUN packet for the VXLAN header and the inner Ethernet header.
pub const HEADROOM: usize = wire::vxlan::HEADER_LEN + ethernet::HEADER_LEN;

/// Why a packet was dropped. Each reason has its own counter on `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum DropReason {
    /// TX: not a valid IPv4 packet.
    TxMalformed,
    /// TX: an IPv6 packet where IPv6 is not carried: an IPv4-only network, or the udp
    /// backend (flannel's carries IPv4 only).
    TxIpv6,
    /// TX: the destination is in no lease (answered with ICMP net unreachable when allowed).
    TxNoRoute,
    /// TX: the destination is in our own subnet: it should never have reached the TUN device.
    TxOwnSubnet,
    /// TX: the peer's lease is of another backend ([`backends::reaches`]; each such peer is
    /// named in a WARN there), or a vxlan lease without a VtepMAC.
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
    /// RX: from an IPv6 sender, an inner frame that is not IPv6 (IPv4 travels over IPv4).
    RxNotIpv6,
    /// RX: the pad a weft peer ends a GSO message with, so that none ends on a full segment
    /// (`crate::dataplane::sys::udp::gso_tail`): filler, not a packet.
    RxGsoPad,
    /// RX (ipip): the outer header says congestion experienced (CE) over an inner packet that
    /// is not ECN-capable, which RFC 6040 (and the kernel's ipip device) drops.
    RxEcnNotEct,
    /// TX (wireguard): the route's peer has no session: its key is not among the WireGuard
    /// peers (a lease without a `PublicKey`, or one not yet in the peer set).
    TxWgUnknownPeer,
    /// RX (wireguard): not a WireGuard message: an unknown type, nonzero reserved bytes, or
    /// the wrong length for its type.
    RxWgMalformed,
    /// RX (wireguard): a handshake initiation from a static key that is no peer's.
    RxWgUnknownPeer,
    /// RX (wireguard): a message for no session or handshake of ours: an unknown receiver
    /// index, a response to no initiation in flight, a cookie reply nobody asked for.
    RxWgNoSession,
    /// RX (wireguard): authentication failed: a bad mac1, a bad AEAD tag (a flipped bit, a
    /// wrong key or preshared key).
    RxWgDecrypt,
    /// RX (wireguard): a replay: a data counter already seen or behind the window, or a
    /// handshake initiation no newer than the last from that peer.
    RxWgReplay,
    /// RX (wireguard): a handshake while its source is over the handshake rate: answered with
    /// a cookie reply instead (WireGuard's "under load").
    RxWgUnderLoad,
}

impl DropReason {
    /// Every reason, in counter order.
    pub(crate) const ALL: [DropReason; 27] = [
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
        DropReason::RxNotIpv6,
        DropReason::RxGsoPad,
        DropReason::RxEcnNotEct,
        DropReason::TxWgUnknownPeer,
        DropReason::RxWgMalformed,
        DropReason::RxWgUnknownPeer,
        DropReason::RxWgNoSession,
        DropReason::RxWgDecrypt,
        DropReason::RxWgReplay,
        DropReason::RxWgUnderLoad,
    ];

    /// Whether it is one a mangling sender leaves: a VXLAN header cut short or full of garbage,
    /// an inner frame or packet cut short (`malformed`, `bad_vxlan_flags`). Reasons of
    /// configuration (a wrong VNI or MAC, a spoofed source, a pad) are not
    /// (see [`malformed_peers`]).
    pub fn is_suspect(self) -> bool {
        matches!(self, DropReason::RxMalformed | DropReason::RxBadFlags)
    }

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
            DropReason::RxNotIpv6 => ("rx", "not_ipv6"),
            DropReason::RxGsoPad => ("rx", "gso_tail_pad"),
            DropReason::RxEcnNotEct => ("rx", "ecn_ce_not_ect"),
            DropReason::TxWgUnknownPeer => ("tx", "wg_unknown_peer"),
            DropReason::RxWgMalformed => ("rx", "wg_malformed"),
            DropReason::RxWgUnknownPeer => ("rx", "wg_unknown_peer"),
            DropReason::RxWgNoSession => ("rx", "wg_no_session"),
            DropReason::RxWgDecrypt => ("rx", "wg_decrypt"),
            DropReason::RxWgReplay => ("rx", "wg_replay"),
            DropReason::RxWgUnderLoad => ("rx", "wg_under_load"),
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
    /// The inner packet's EtherType (vxlan only): IPv4 or IPv6.
    pub(crate) ethertype: ethernet::EtherType,
    /// The peer's WireGuard public key (wireguard only): whose session seals the packet.
    pub(crate) peer_key: Option<wireguard::WgPublicKey>,
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
    /// Sets (or clears) the subnet. An IPv6-only lease's subnet has no IPv4 part: it clears
    /// it (its IPv6 subnet is [`OwnSubnet6`]'s).
    pub fn set(&self, subnet: Option<Subnet>) {
        let v = subnet.and_then(Subnet::v4).map_or(0, |s| {
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

/// This host's IPv6 subnet, readable per packet without a lock: 128 bits do not fit an atomic,
/// so it is an [`ArcSwapOption`], whose load takes no lock and allocates nothing.
#[derive(Debug, Default)]
pub struct OwnSubnet6(ArcSwapOption<Ipv6Subnet>);

impl OwnSubnet6 {
    /// Sets (or clears) the subnet.
    pub fn set(&self, subnet: Option<Ipv6Subnet>) {
        self.0.store(subnet.map(Arc::new));
    }

    /// Whether a subnet is set and contains `addr`.
    #[inline]
    pub fn contains(&self, addr: Ipv6Addr) -> bool {
        self.0.load().as_ref().is_some_and(|s| s.net().contains(&addr))
    }

    /// Whether a subnet is set.
    #[inline]
    pub fn is_set(&self) -> bool {
        self.0.load().is_some()
    }

    /// The subnet (the control plane's read; the packet path uses [`OwnSubnet6::contains`]).
    pub(crate) fn get(&self) -> Option<Ipv6Subnet> {
        self.0.load().as_deref().copied()
    }
}

/// The IPv6 half of the forwarding configuration, on a dual-stack vxlan network.
#[derive(Clone, Debug)]
pub struct Ipv6Forwarding {
    /// Our IPv6 subnet: unset on an IPv4-only network, and then IPv6 is not carried.
    pub own: Arc<OwnSubnet6>,
    /// The source of the ICMPv6 errors weft answers with: the IPv6 network's base address
    /// (as [`Forwarder::icmp_source`] for IPv4).
    pub icmp_source: Ipv6Addr,
}

impl Default for Ipv6Forwarding {
    /// No IPv6 subnet: IPv6 is not carried.
    fn default() -> Self {
        Self { own: Arc::default(), icmp_source: Ipv6Addr::UNSPECIFIED }
    }
}

/// The per-host forwarding configuration.
#[derive(Clone, Debug)]
pub struct Forwarder {
    /// vxlan or udp.
    pub backend: BackendKind,
    /// The VXLAN network identifier.
    pub vni: wire::vxlan::Vni,
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
    /// Which peers' malformed datagrams were last logged when (shared by the workers).
    pub malformed: Arc<MalformedLog>,
    /// IPv6, on a dual-stack network (our VTEP MAC serves both halves).
    pub ipv6: Ipv6Forwarding,
    /// The WireGuard sessions (wireguard only; one device per underlay family with IPv6),
    /// shared by the workers: they seal what [`Forwarder::route`] sends and open what arrives,
    /// in place of [`Forwarder::encap`] and [`Forwarder::decap`].
    pub wireguard: Option<Arc<wireguard::Devices>>,
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
        self.emit_encap(&route, &mut buf[start..end]);
        Tx::Send { peer: route.to, range: start..end, flow: route.flow }
    }

    /// The bytes of encapsulation in front of each packet in a datagram: [`HEADROOM`] for
    /// vxlan, the outer IPv4 header for ipip, none for udp (flannel's udp backend sends the
    /// bare IP packet).
    pub fn headroom(&self) -> usize {
        match self.backend {
            BackendKind::Vxlan => HEADROOM,
            BackendKind::Ipip => wire::ipip::OVERHEAD,
            // host-gw and alloc run no tunnel; wireguard seals whole datagrams in a transport
            // of its own rather than writing headers in front of the packet.
            BackendKind::Udp
            | BackendKind::HostGw
            | BackendKind::Alloc
            | BackendKind::Wireguard => 0,
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
            Some(6) => return self.route6(routes, packet, reply, now),
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
            return Err(self.no_route(now, || {
                icmpv4::emit_dest_unreachable(packet, 0, self.icmp_source, reply)
            }));
        };
        let flow = wire::flow_hash(packet);
        let mismatch = Refusal::Drop(DropReason::TxBackendMismatch);
        if !backends::reaches(self.backend, peer.backend) {
            return Err(mismatch);
        }
        // A wireguard peer listens where its lease says (flannel's `Port`), else on ours.
        let (port, peer_key) = match peer.backend {
            PeerBackend::Wireguard { key, port } => (port.unwrap_or(self.port), Some(key)),
            _ => (self.port, None),
        };
        let to = SocketAddr::V4(SocketAddrV4::new(peer.public_ip, port));
        // A vxlan peer has a VTEP MAC unless its lease is IPv6-only (no IPv4 route to it).
        let peer_mac = match self.backend {
            BackendKind::Vxlan => Some(peer.vtep_mac.ok_or(mismatch)?),
            _ => None,
        };
        Ok(TxRoute { to, flow, peer_mac, ethertype: ethernet::EtherType::IPV4, peer_key })
    }

    /// The refusal of a packet to a destination in no lease: the no-route error `emit` writes
    /// (ICMP or ICMPv6) when the [`IcmpLimit`] bucket has a token at `now`, else a suppressed
    /// drop; a plain drop when the rules forbid an error reply.
    fn no_route(&self, now: Instant, emit: impl FnOnce() -> Result<usize, wire::Error>) -> Refusal {
        if !self.icmp_limit.allow(now) {
            return Refusal::Suppressed(DropReason::TxNoRoute);
        }
        match emit() {
            Ok(len) => Refusal::Reply { len, reason: DropReason::TxNoRoute },
            Err(_) => Refusal::Drop(DropReason::TxNoRoute),
        }
    }

    /// [`Self::route`] for an IPv6 packet: to the peer whose IPv6 half holds the destination,
    /// over the IPv6 underlay (vxlan: to its IPv6 VTEP; wireguard: to its `BackendV6Data` key
    /// and port, flannel's IPv6 device); an ICMPv6 no-route error for a destination in no
    /// half.
    fn route6(
        &self,
        routes: &RouteTable,
        packet: &[u8],
        reply: &mut [u8],
        now: Instant,
    ) -> Result<TxRoute, Refusal> {
        let own = &self.ipv6.own;
        // IPv4 only: an IPv4-only network, or the udp backend (flannel's carries no IPv6).
        if !matches!(self.backend, BackendKind::Vxlan | BackendKind::Wireguard) || !own.is_set() {
            return Err(Refusal::Drop(DropReason::TxIpv6));
        }
        let Ok(ip) = ipv6::Packet::new_checked(packet) else {
            return Err(Refusal::Drop(DropReason::TxMalformed));
        };
        let dst = ip.dst_addr();
        if own.contains(dst) {
            return Err(Refusal::Drop(DropReason::TxOwnSubnet));
        }
        let Some((peer, half)) = routes.lookup6(dst) else {
            return Err(self.no_route(now, || {
                icmpv6::emit_dest_unreachable(packet, 0, self.ipv6.icmp_source, reply)
            }));
        };
        if !backends::reaches(self.backend, peer.backend) {
            return Err(Refusal::Drop(DropReason::TxBackendMismatch));
        }
        let flow = wire::flow_hash(packet);
        let ethertype = ethernet::EtherType::IPV6;
        if self.backend == BackendKind::Wireguard {
            // The peer's IPv6 device: its key and port (ours when its lease names none).
            let (Some(wg), Some(devices)) = (half.wireguard, self.wireguard.as_deref()) else {
                return Err(Refusal::Drop(DropReason::TxBackendMismatch));
            };
            let port = wg.port.unwrap_or(devices.port6());
            let to = SocketAddr::V6(SocketAddrV6::new(half.public_ip, port, 0, 0));
            return Ok(TxRoute { to, flow, peer_mac: None, ethertype, peer_key: Some(wg.key) });
        }
        Ok(TxRoute {
            to: SocketAddr::V6(SocketAddrV6::new(half.public_ip, self.port, 0, 0)),
            flow,
            peer_mac: Some(half.vtep_mac),
            ethertype,
            peer_key: None,
        })
    }

    /// Writes the encapsulation for `route` into the first [`Self::headroom`] bytes of
    /// `datagram`, in front of the packet that follows them (nothing for udp; the VXLAN and
    /// inner Ethernet headers for vxlan; the outer IPv4 header for ipip, which reads the
    /// packet's TTL, DF and ECN).
    pub(crate) fn emit_encap(&self, route: &TxRoute, datagram: &mut [u8]) {
        if self.backend == BackendKind::Ipip {
            ipip::emit(route, datagram);
            return;
        }
        self.emit_vxlan(route, datagram);
    }

    /// Validates and decapsulates the datagram at `buf[..len]`, received from `from`.
    pub fn decap(&self, routes: &RouteTable, from: SocketAddr, buf: &mut [u8], len: usize) -> Rx {
        let from = match from {
            SocketAddr::V4(from) => from,
            SocketAddr::V6(from) => return self.decap6(routes, *from.ip(), buf, len),
        };
        let Some(datagram) = buf.get_mut(..len) else {
            return Rx::Drop(DropReason::RxMalformed);
        };
        if self.backend == BackendKind::Ipip {
            return self.decap_ipip(routes, datagram);
        }
        if gso_tail::is_pad(datagram) {
            return Rx::Drop(DropReason::RxGsoPad);
        }
        let inner = match self.backend {
            BackendKind::Vxlan => match self.vxlan_ethertype(datagram) {
                Ok(ethernet::EtherType::IPV4) => HEADROOM..len,
                Ok(_) => return Rx::Drop(DropReason::RxNotIpv4),
                Err(reason) => return Rx::Drop(reason),
            },
            BackendKind::Udp | BackendKind::HostGw | BackendKind::Alloc | BackendKind::Ipip => {
                0..len
            }
            // WireGuard's datagrams are sealed: its own transport opens them, never this.
            BackendKind::Wireguard => return Rx::Drop(DropReason::RxMalformed),
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
        if self.backend == BackendKind::Udp
            && let Err(reason) = udp::hop(&mut ip)
        {
            return Rx::Drop(reason);
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
    use crate::dataplane::wire::vxlan;
    use crate::route::PeerBackend;

    #[test]
    fn only_what_a_mangling_sender_leaves_is_suspect() {
        let suspect: Vec<_> = DropReason::ALL.into_iter().filter(|r| r.is_suspect()).collect();
        assert_eq!(suspect, [DropReason::RxMalformed, DropReason::RxBadFlags]);
    }

    const MS: Duration = Duration::from_millis(1);

    fn at(d: Duration) -> Instant {
        Instant::from_epoch(d)
    }

    /// How many of `tries` replies the bucket allows at `now`.
    fn allowed(limit: &IcmpLimit, now: Instant, tries: usize) -> usize {
        (0..tries).filter(|_| limit.allow(now)).count()
    }

    /// Two dual-stack vxlan hosts: 1 (10.244.1.0/24, fd00:10:244:1::/64, 2001:db8::1) and 2
    /// (…:2), each with the other's route; host 2's lease names a weft node.
    fn dual_hosts() -> (Forwarder, Forwarder, RouteTable, RouteTable) {
        use crate::route::{Peer, Peer6};
        let half = |n: u16| -> Ipv6Subnet { format!("fd00:10:244:{n}::/64").parse().unwrap() };
        let peer = |n: u8| Peer {
            subnet: Subnet::from_parts(Ipv4Addr::new(10, 244, n, 0), 24).unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, n),
            backend: PeerBackend::Vxlan,
            vtep_mac: Some(MacAddr([2, 0, 0, 0, 0, n])),
            vni: Some(1),
            node: (n == 2).then(|| crate::lease::record::NodeId::parse("node-bbbb").unwrap()),
            stale: false,
            incarnation: None,
            ipv6: Some(Peer6 {
                wireguard: None,
                subnet: half(u16::from(n)),
                public_ip: Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(n)),
                vtep_mac: MacAddr([2, 0, 0, 0, 0, n]),
            }),
        };
        let host = |n: u8| {
            let own = Arc::new(OwnSubnet::default());
            own.set(Some(Subnet::from_parts(Ipv4Addr::new(10, 244, n, 0), 24).unwrap()));
            let own6 = Arc::new(OwnSubnet6::default());
            own6.set(Some(half(u16::from(n))));
            Forwarder {
                backend: BackendKind::Vxlan,
                vni: vxlan::Vni::new(1).unwrap(),
                port: 8472,
                our_mac: MacAddr([2, 0, 0, 0, 0, n]),
                own,
                icmp_source: Ipv4Addr::new(10, 244, 0, 0),
                icmp_limit: Arc::default(),
                malformed: Arc::default(),
                wireguard: None,
                ipv6: Ipv6Forwarding { own: own6, icmp_source: "fd00:10:244::".parse().unwrap() },
            }
        };
        let net = "10.244.0.0/16".parse().unwrap();
        (
            host(1),
            host(2),
            RouteTable::build(net, 24, [peer(2)]),
            RouteTable::build(net, 24, [peer(1)]),
        )
    }

    /// An IPv6/UDP packet of `payload` bytes, in a buffer with [`HEADROOM`] in front.
    fn udp6(src: &str, dst: &str, payload: usize) -> (Vec<u8>, usize) {
        let repr = ipv6::Repr {
            src_addr: src.parse().unwrap(),
            dst_addr: dst.parse().unwrap(),
            next_header: wire::ip::proto::UDP,
            payload_len: 8 + payload,
            hop_limit: 64,
        };
        let mut buf = vec![0u8; HEADROOM + repr.buffer_len() + 16];
        repr.emit(&mut buf[HEADROOM..]).unwrap();
        buf[HEADROOM + 40..HEADROOM + 42].copy_from_slice(&5000u16.to_be_bytes());
        buf[HEADROOM + 42..HEADROOM + 44].copy_from_slice(&5001u16.to_be_bytes());
        buf[HEADROOM + 44..HEADROOM + 46].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
        (buf, repr.buffer_len())
    }

    fn v6_peer(n: u16) -> SocketAddr {
        SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, n),
            8472,
            0,
            0,
        ))
    }

    #[test]
    fn ipv6_crosses_in_vxlan_over_the_ipv6_underlay_and_is_validated_on_arrival() {
        let (a, b, a_routes, b_routes) = dual_hosts();
        let mut reply = [0u8; 1500];
        let (mut buf, len) = udp6("fd00:10:244:1::5", "fd00:10:244:2::7", 100);
        let packet = buf[HEADROOM..HEADROOM + len].to_vec();
        let Tx::Send { peer, range, flow } =
            a.encap(&a_routes, &mut buf, len, &mut reply, Instant::ZERO)
        else {
            panic!("not sent")
        };
        assert_eq!(peer, v6_peer(2));
        assert_eq!(flow, wire::flow_hash(&packet));
        let vx = vxlan::Packet::new_checked(&buf[range.clone()]).unwrap();
        assert_eq!(vxlan::Repr::parse(&vx).unwrap().vni, a.vni);
        let eth = ethernet::Frame::new_checked(vx.payload()).unwrap();
        assert_eq!((eth.dst_addr(), eth.src_addr()), (b.our_mac, a.our_mac));
        assert_eq!(eth.ethertype(), ethernet::EtherType::IPV6);
        // As host 2's socket hands it over, from host 1's PublicIPv6, with trailing bytes.
        let mut datagram = buf[range].to_vec();
        let dlen = datagram.len();
        datagram.extend_from_slice(&[0xee; 7]);
        let rx = b.decap(&b_routes, v6_peer(1), &mut datagram, dlen);
        let Rx::Deliver { range, checksums_trusted } = rx else { panic!("{rx:?}") };
        assert_eq!(&datagram[range], &packet[..]);
        assert!(!checksums_trusted, "host 1's lease names no weft node");
        // Back the other way: host 2's lease names a weft node, so its checksums are trusted.
        let (mut buf, len) = udp6("fd00:10:244:2::7", "fd00:10:244:1::5", 10);
        let Tx::Send { range, .. } = b.encap(&b_routes, &mut buf, len, &mut reply, Instant::ZERO)
        else {
            panic!("not sent back")
        };
        let mut datagram = buf[range].to_vec();
        let dlen = datagram.len();
        let rx = a.decap(&a_routes, v6_peer(2), &mut datagram, dlen);
        assert!(matches!(rx, Rx::Deliver { checksums_trusted: true, .. }), "{rx:?}");
    }

    #[test]
    fn ipv6_arrivals_that_break_a_rule_are_dropped_by_reason() {
        let (a, b, a_routes, b_routes) = dual_hosts();
        let mut reply = [0u8; 1500];
        // A VXLAN datagram from host 1 carrying `inner`, with `ethertype`.
        let datagram = |src: &str, dst: &str, ethertype| {
            let (mut buf, len) = udp6(src, dst, 20);
            let route = TxRoute {
                to: v6_peer(2),
                flow: 0,
                peer_mac: Some(b.our_mac),
                ethertype,
                peer_key: None,
            };
            a.emit_encap(&route, &mut buf[..HEADROOM]);
            buf.truncate(HEADROOM + len);
            buf
        };
        let decap = |from: SocketAddr, mut d: Vec<u8>| {
            let n = d.len();
            b.decap(&b_routes, from, &mut d, n)
        };
        let ok = datagram("fd00:10:244:1::5", "fd00:10:244:2::7", ethernet::EtherType::IPV6);
        assert!(matches!(decap(v6_peer(1), ok.clone()), Rx::Deliver { .. }));
        // An inner source outside the sender's IPv6 half, and a sender no lease names.
        let spoofed = datagram("fd00:10:244:9::5", "fd00:10:244:2::7", ethernet::EtherType::IPV6);
        assert_eq!(decap(v6_peer(1), spoofed), Rx::Drop(DropReason::RxSpoofedSource));
        assert_eq!(decap(v6_peer(9), ok.clone()), Rx::Drop(DropReason::RxUnknownSender));
        // Not for us; an IPv4 EtherType from an IPv6 sender; another VNI; not our MAC.
        let elsewhere = datagram("fd00:10:244:1::5", "fd00:10:244:3::7", ethernet::EtherType::IPV6);
        assert_eq!(decap(v6_peer(1), elsewhere), Rx::Drop(DropReason::RxNotForUs));
        let v4_type = datagram("fd00:10:244:1::5", "fd00:10:244:2::7", ethernet::EtherType::IPV4);
        assert_eq!(decap(v6_peer(1), v4_type), Rx::Drop(DropReason::RxNotIpv6));
        let mut other_vni = ok.clone();
        other_vni[6] = 9;
        assert_eq!(decap(v6_peer(1), other_vni), Rx::Drop(DropReason::RxWrongVni));
        let mut other_mac = ok.clone();
        other_mac[vxlan::HEADER_LEN + 5] = 0x77;
        assert_eq!(decap(v6_peer(1), other_mac), Rx::Drop(DropReason::RxNotOurMac));
        assert_eq!(decap(v6_peer(1), ok[..60].to_vec()), Rx::Drop(DropReason::RxMalformed));
        // An IPv6 packet sent over IPv4 is not taken either: IPv6 travels over IPv6.
        let over_v4 = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 8472));
        assert_eq!(decap(over_v4, ok.clone()), Rx::Drop(DropReason::RxNotIpv4));

        // TX: our own half, a destination in no half (ICMPv6 no route), a malformed packet.
        let mut send = |src: &str, dst: &str| {
            let (mut buf, len) = udp6(src, dst, 10);
            a.encap(&a_routes, &mut buf, len, &mut reply, Instant::ZERO)
        };
        assert_eq!(send("fd00:10:244:1::5", "fd00:10:244:1::6"), Tx::Drop(DropReason::TxOwnSubnet));
        let Tx::Reply { len, reason: DropReason::TxNoRoute } =
            send("fd00:10:244:1::5", "fd00:99::1")
        else {
            panic!("no ICMPv6 no-route reply")
        };
        let icmp = ipv6::Packet::new_checked(&reply[..len]).unwrap();
        assert_eq!(icmp.dst_addr(), "fd00:10:244:1::5".parse::<Ipv6Addr>().unwrap());
        assert_eq!((icmp.next_header(), icmp.payload()[0]), (icmpv6::NEXT_HEADER, 1));
        let (mut short, _) = udp6("fd00:10:244:1::5", "fd00:10:244:2::7", 10);
        assert_eq!(
            a.encap(&a_routes, &mut short, 30, &mut reply, Instant::ZERO),
            Tx::Drop(DropReason::TxMalformed)
        );
    }

    #[test]
    fn without_an_ipv6_subnet_or_on_the_udp_backend_ipv6_is_not_carried() {
        let (a, b, a_routes, b_routes) = dual_hosts();
        let mut reply = [0u8; 1500];
        let v4_only = Forwarder { ipv6: Ipv6Forwarding::default(), ..a.clone() };
        let udp = Forwarder { backend: BackendKind::Udp, ..a };
        for fwd in [&v4_only, &udp] {
            let (mut buf, len) = udp6("fd00:10:244:1::5", "fd00:10:244:2::7", 10);
            let tx = fwd.encap(&a_routes, &mut buf, len, &mut reply, Instant::ZERO);
            assert_eq!(tx, Tx::Drop(DropReason::TxIpv6));
        }
        let v4_only = Forwarder { ipv6: Ipv6Forwarding::default(), ..b };
        let mut d = vec![0u8; 200];
        assert_eq!(
            v4_only.decap(&b_routes, v6_peer(1), &mut d, 200),
            Rx::Drop(DropReason::RxUnknownSender)
        );
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
