//! WireGuard (flannel's `wireguard` backend) in user space: the sans-IO core. The caller owns
//! the sockets, the buffers and the threads; this module turns an inner IP packet into the
//! datagram to send ([`Sessions::seal`]), a received datagram into an inner IP packet or a
//! protocol reply ([`Sessions::open`]), and time into handshake retries, rekeys and keepalives
//! ([`Sessions::tick`]). The workers call it through
//! [`super::Forwarder::wireguard`]; a timer thread of the tunnel ticks it and gives it the route
//! table's peers ([`peers_of`], [`peers6_of`]). With IPv6 enabled there are two [`Devices`], as
//! flannel's `Mode` `separate` has two WireGuard interfaces: one per underlay family.
//!
//! # The protocol crate
//! The Noise IK handshake, the sessions and their timers, cookies and the handshake rate limit
//! are Mullvad's `gotatun` 0.10 (MPL-2.0; a maintained fork of Cloudflare's boringtun, audited
//! in 2026), built with `default-features = false, features = ["ring"]`: its crypto on ring,
//! which rustls already brings, and none of its device, socket or TUN code. Read against
//! boringtun 0.7.1 (the sources, not the changelogs):
//! - replay window: gotatun 8192 counters (`noise/session.rs`, 128 words of 64, as Linux and
//!   wireguard-go); boringtun 1024 (16 words).
//! - Reject-After-Messages: gotatun refuses to seal once a session's counter reaches
//!   2^64 − 2^13 − 1 (`format_packet_data`, checked before the increment) and drops received
//!   counters at or past it; boringtun checks neither on send.
//! - handshake rate limit: gotatun counts per source IP (`noise/rate_limiter.rs`, a map reset
//!   every second); boringtun has one global counter, so one flooding source puts every peer
//!   under load.
//! - buffers: boringtun writes into a caller's buffer but panics when it is too small
//!   (`format_packet_data`); gotatun hands over an owned `Packet` (a `BytesMut`), so sealing
//!   allocates (below).
//!
//! # Threads and locks
//! One [`Sessions`] is shared by every worker (`Send + Sync`, behind an `Arc`). Each peer's
//! session (gotatun's `Tunn`) is behind a `Mutex` of its own: workers seal for the same peer
//! from different threads, and a `Tunn` is a state machine that takes `&mut self` for both
//! directions (its queue, timers and handshake state move together), so per-peer mutual
//! exclusion is what it asks for; peers do not contend with each other. The peer set is an
//! [`ArcSwap`] (wait-free lookups, replaced whole by [`Sessions::set_peers`]); the map from a
//! session's receiver index to its peer is an `RwLock` written only when a handshake message
//! is sent. No lock is held while another is taken, except a peer's while it registers an
//! index. This is a departure from the rest of [`super`], which takes no lock per packet.
//!
//! # Time
//! gotatun reads its own clock (its `sleepyinstant`, `CLOCK_BOOTTIME`) for timers, handshake
//! timestamps and cookie secrets; it has no way to be handed `now`. weft's rule is that pure
//! cores take `now` from the caller: this one cannot, and says so. weft's own code here reads
//! no clock; [`Sessions::tick`] is the caller's to call every 250 ms or so (gotatun's device
//! does so every 250 ms), and it is also what resets the per-source handshake counts.
//!
//! # Allocation
//! Per packet, as gotatun's API has it: sealing copies the inner packet into one `BytesMut`
//! (padded in place, no reallocation) and gotatun allocates the sealed datagram (two
//! allocations, then a copy into `out`); opening copies the datagram into one `BytesMut`, which
//! gotatun decrypts in place (one allocation, then a copy of the inner packet into `out`).
//! Handshake messages allocate more (rare). Garbage is refused before any allocation: the type
//! and length are checked first, and then the receiver index of every message but an
//! initiation.
//!
//! # Endpoints
//! A peer's endpoint is its lease's `PublicIP` and port, set by [`Sessions::set_peers`]; a
//! datagram authenticated as a peer from another address does **not** move it (no roaming):
//! the lease is the authority, as flannel publishes it, and a replayed datagram from elsewhere
//! cannot redirect a peer's traffic. Replies to a handshake message (a response, a cookie) go
//! back to the address it came from, as gotatun's device and the kernel answer them; data and
//! keepalives go to the endpoint.
//!
//! # Receive rules
//! A datagram is delivered only if it is a well-formed WireGuard message (type with zero
//! reserved bytes, as the kernel checks the 32-bit type, and the type's length), of a session
//! of ours (its receiver index; an initiation: from a peer's static key), authenticated (and
//! a handshake within its source's rate), not a replay, and the inner packet is IPv4 or
//! IPv6 whose source lies inside the sending peer's subnet or IPv6 half (the allowed IPs
//! flannel gives a peer). The inner destination is the caller's to check (the data plane's own
//! subnet), as for every transport.
//!
//! # Contract
//! Pure as the rest of [`super`] but for the locks and gotatun's clock: no sockets, no threads,
//! no logging here (gotatun itself emits `tracing` events at debug and trace level on
//! handshakes and errors). Nothing panics on any input: every refusal is a [`DropReason`].

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use arc_swap::ArcSwap;
use bytes::BytesMut;
use gotatun::noise::errors::WireGuardError;
use gotatun::noise::handshake::parse_handshake_anon;
use gotatun::noise::index_table::IndexTable;
use gotatun::noise::rate_limiter::RateLimiter;
use gotatun::noise::{Tunn, TunnResult};
use gotatun::packet::{Packet, WgKind};
use gotatun::tun::MtuWatcher;
use gotatun::x25519;

use super::DropReason;
use crate::dataplane::wire::{ipv4, ipv6};
use crate::lease::record::{Ipv6Subnet, Subnet};

pub use crate::vocab::{WgPublicKey, WgSecret};

/// The public key that goes with `private` (Curve25519's base-point multiplication, as
/// `wg pubkey` computes it): what our lease publishes.
pub fn public_key(private: &WgSecret) -> WgPublicKey {
    WgPublicKey(x25519::PublicKey::from(&x25519::StaticSecret::from(*private.expose())).to_bytes())
}

/// The WireGuard peers of a route table on the IPv4 underlay (flannel's `flannel-wg`): every
/// wireguard lease with an IPv4 subnet, its key at its `PublicIP` and `Port` (`port`, ours,
/// when its lease names none, as flannel reads it), allowed to send from its subnet. A lease of
/// another backend is no WireGuard peer (the route table counts it as a backend mismatch).
pub fn peers_of(table: &crate::route::RouteTable, port: u16) -> Vec<PeerConfig> {
    table
        .peers()
        .iter()
        .filter(|p| p.subnet.v4().is_some())
        .filter_map(|p| match p.backend {
            crate::route::PeerBackend::Wireguard { key, port: theirs } => Some(PeerConfig {
                key,
                endpoint: SocketAddr::from((p.public_ip, theirs.unwrap_or(port))),
                subnet: p.subnet,
                ipv6: None,
                epoch: epoch_of(p),
            }),
            _ => None,
        })
        .collect()
}

/// The WireGuard peers of a route table on the IPv6 underlay (flannel's `flannel-wg-v6`, `Mode`
/// `separate`): every wireguard lease's IPv6 half, its `BackendV6Data` key at its `PublicIPv6`
/// and `BackendV6Data.Port` (`port6`, our `ListenPortV6`, when it names none), allowed to send
/// from its IPv6 half only.
pub fn peers6_of(table: &crate::route::RouteTable, port6: u16) -> Vec<PeerConfig> {
    table
        .peers()
        .iter()
        .filter_map(|p| {
            let half = p.ipv6?;
            let wg = half.wireguard?;
            Some(PeerConfig {
                key: wg.key,
                endpoint: SocketAddr::from((half.public_ip, wg.port.unwrap_or(port6))),
                subnet: Subnet::from(half.subnet),
                ipv6: None,
                epoch: epoch_of(p),
            })
        })
        .collect()
}

/// Which process of the peer wrote its lease: a hash of its `WeftIncarnation`, 0 for none.
fn epoch_of(p: &crate::route::Peer) -> u64 {
    p.incarnation.as_ref().map_or(0, |i| {
        use std::hash::{Hash as _, Hasher as _};
        let mut h = std::hash::DefaultHasher::new();
        i.hash(&mut h);
        h.finish()
    })
}

/// The WireGuard devices of one data plane, as flannel's `Mode` `separate` lays them out: one
/// set of [`Sessions`] for the IPv4 underlay (flannel's `flannel-wg`, on `ListenPort`) and, with
/// IPv6 enabled, another for the IPv6 underlay (`flannel-wg-v6`, on `ListenPortV6`). flannel
/// gives both devices the same key, so a peer has two independent sessions with us, one per
/// family: they are kept apart here as two devices keep them apart (their own handshakes,
/// indices, counters and timers), and a datagram is opened by the device of the family it
/// arrived over and sealed by the device of the family it leaves over. weft has one TUN
/// device; which device an inner packet takes is its own family's (an IPv4 packet to the
/// peer's IPv4 endpoint, an IPv6 packet to its IPv6 one).
pub struct Devices {
    /// The IPv4 underlay's (the only one on an IPv4-only network; unused on an IPv6-only one).
    pub v4: Sessions,
    /// The IPv6 underlay's, with IPv6 enabled.
    pub v6: Option<Sessions>,
    /// Our `ListenPort`: a peer whose lease names no port listens on it too.
    port: u16,
    /// Our `ListenPortV6`.
    port6: u16,
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices")
            .field("v4", &self.v4)
            .field("v6", &self.v6)
            .field("port", &self.port)
            .field("port6", &self.port6)
            .finish()
    }
}

impl Devices {
    /// The devices under our `private` key (both: flannel's one key file), with the options
    /// [`Sessions::new`] takes; `port6`: `ListenPortV6` when IPv6 is enabled (a second device),
    /// `None` on an IPv4-only network.
    pub fn new(
        private: &WgSecret,
        psk: Option<WgSecret>,
        keepalive: Option<u16>,
        mtu: u16,
        port: u16,
        port6: Option<u16>,
    ) -> Self {
        Self {
            v4: Sessions::new(private, psk, keepalive, mtu),
            v6: port6.map(|_| Sessions::new(private, psk, keepalive, mtu)),
            port,
            port6: port6.unwrap_or(port),
        }
    }

    /// One device, as an IPv4-only network has (tests and tools).
    pub fn ipv4_only(v4: Sessions, port: u16) -> Self {
        Self { v4, v6: None, port, port6: port }
    }

    /// The device of `peer`'s underlay family: where a datagram from `peer` is opened and one
    /// to `peer` sealed.
    pub fn of(&self, peer: SocketAddr) -> &Sessions {
        match (peer, &self.v6) {
            (SocketAddr::V6(_), Some(v6)) => v6,
            _ => &self.v4,
        }
    }

    /// Our `ListenPortV6`: an IPv6 half's port when its lease names none.
    pub fn port6(&self) -> u16 {
        self.port6
    }

    /// Gives each device its peers from `table` ([`peers_of`], [`peers6_of`]).
    pub fn set_peers_of(&self, table: &crate::route::RouteTable) {
        self.v4.set_peers(peers_of(table, self.port));
        if let Some(v6) = &self.v6 {
            v6.set_peers(peers6_of(table, self.port6));
        }
    }

    /// Both devices' [`Sessions::initiate_all`].
    pub fn initiate_all(&self, mut emit: impl FnMut(SocketAddr, &[u8])) {
        for device in std::iter::once(&self.v4).chain(&self.v6) {
            device.initiate_all(&mut emit);
        }
    }

    /// Both devices' [`Sessions::tick`].
    pub fn tick(&self, mut emit: impl FnMut(SocketAddr, &[u8])) {
        for device in std::iter::once(&self.v4).chain(&self.v6) {
            device.tick(&mut emit);
        }
    }
}

/// Bytes in front of the inner packet: the data message's type, receiver index and counter.
pub const HEADROOM: usize = 16;
/// Bytes after the padded inner packet: the Poly1305 tag.
pub const TAILROOM: usize = 16;
/// Header and tag: what every data message adds besides padding.
pub const OVERHEAD: usize = HEADROOM + TAILROOM;
/// At most this much zero padding follows an inner packet (to a multiple of 16).
pub const MAX_PADDING: usize = 15;
/// A handshake initiation's length.
pub const HANDSHAKE_INIT_LEN: usize = 148;
/// A handshake response's length.
pub const HANDSHAKE_RESPONSE_LEN: usize = 92;
/// A cookie reply's length.
pub const COOKIE_REPLY_LEN: usize = 64;
/// Handshake messages one source IP may send in a second before the answer is a cookie reply
/// (WireGuard's "under load"), as gotatun's device sets it.
pub const HANDSHAKES_PER_SOURCE_PER_SEC: u64 = 100;

/// The padded length of an inner packet of `len` bytes: the next multiple of 16, but not past
/// `mtu` (and never shorter than the packet), as WireGuard pads.
pub const fn padded_len(len: usize, mtu: u16) -> usize {
    let next = len.next_multiple_of(16);
    let mtu = mtu as usize;
    let capped = if next < mtu { next } else { mtu };
    if capped > len { capped } else { len }
}

/// The data message that carries an inner packet of `len` bytes: header, padded packet, tag.
pub const fn sealed_len(len: usize, mtu: u16) -> usize {
    OVERHEAD + padded_len(len, mtu)
}

/// A peer as the route table gives it: its key, where it is, and what it may send from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerConfig {
    /// Its static public key (its lease's `WgPublicKey`).
    pub key: WgPublicKey,
    /// Its lease's `PublicIP` (or `PublicIPv6`) and the backend's port.
    pub endpoint: SocketAddr,
    /// Its lease's subnet: inner sources it may send from.
    pub subnet: Subnet,
    /// Its lease's IPv6 half, on a dual-stack network.
    pub ipv6: Option<Ipv6Subnet>,
    /// Which process of the peer wrote its lease (a hash of `WeftIncarnation`; 0 for a flannel
    /// peer): a new one restarted and forgot its sessions, so ours go too.
    pub epoch: u64,
}

impl PeerConfig {
    /// Whether an inner packet from `src` may come from this peer (its allowed IPs).
    fn allows(&self, src: IpAddr) -> bool {
        self.subnet.contains(src)
            || matches!((src, self.ipv6), (IpAddr::V6(a), Some(half)) if half.net().contains(&a))
    }
}

/// What [`Sessions::seal`] made of an inner packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sealed {
    /// Send `out[..len]`, a data message, to `to`.
    Send {
        /// The peer's endpoint.
        to: SocketAddr,
        /// The data message's length.
        len: usize,
    },
    /// No session yet: the packet waits in the peer's queue, and `out[..len]` is a handshake
    /// initiation to send to `to`. The packet goes once the handshake completes
    /// ([`Sessions::drain`]).
    Handshake {
        /// The peer's endpoint.
        to: SocketAddr,
        /// The initiation's length.
        len: usize,
    },
    /// A handshake is under way: the packet waits in the peer's queue (gotatun's, 256 packets;
    /// past that it is dropped there, unseen).
    Queued,
    /// Not sent.
    Drop(DropReason),
}

/// What [`Sessions::open`] made of a datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened {
    /// `out[range]` is an inner IP packet from `peer`, its source inside the peer's allowed
    /// networks (its padding cut off). Write it to TUN.
    Deliver {
        /// The inner packet inside `out`.
        range: Range<usize>,
        /// The peer it came from.
        peer: WgPublicKey,
        /// Packets wait in the peer's queue: [`Sessions::drain`] it. The session this packet
        /// came on may be the first one we can send on: a handshake both sides started at
        /// once completes for us as the responder, and our queued packets go only once the
        /// initiator's first data arrives (gotatun's own device leaves them queued until the
        /// next handshake).
        drain: bool,
    },
    /// Send `out[..len]` to `to`: a handshake response, or the keepalive that confirms a
    /// handshake we initiated. Then [`Sessions::drain`] `peer`'s queue: the session may be new.
    Reply {
        /// The datagram's source.
        to: SocketAddr,
        /// The reply's length.
        len: usize,
        /// The peer it answers.
        peer: WgPublicKey,
    },
    /// A handshake refused: send `out[..len]` (a cookie reply) to `to`, and count the drop.
    Refuse {
        /// The datagram's source.
        to: SocketAddr,
        /// The cookie reply's length.
        len: usize,
        /// Why the handshake was refused.
        reason: DropReason,
    },
    /// Taken in, nothing to deliver or send: a keepalive, or a cookie reply to our handshake.
    Consumed {
        /// The peer it came from.
        peer: WgPublicKey,
    },
    /// Dropped.
    Drop(DropReason),
}

/// One peer: its configuration and its session, together behind one lock.
struct Peer {
    key: WgPublicKey,
    state: Mutex<PeerState>,
}

struct PeerState {
    config: PeerConfig,
    tunn: Tunn,
    /// Packets wait in `tunn`'s queue or in `held` for a session (set when one is queued,
    /// cleared when a drain finds both empty).
    queued: bool,
    /// We answered an initiation (a responder session exists) since sessions last expired.
    answered: bool,
    /// The peer has confirmed a session of ours: we received its handshake response, or data
    /// (or a keepalive) on a session. Cleared when gotatun expires every session.
    confirmed: bool,
    /// Packets sealed while the only session is one we answered an initiation with and the
    /// initiator has not confirmed (see [`Sessions::seal`]); sent once it has.
    held: VecDeque<Packet>,
}

/// At most this many packets wait in `held` (gotatun's own queue takes as many).
const MAX_HELD: usize = 256;

impl PeerState {
    /// Whether data must wait: we have not been confirmed on any session. A fresh gotatun
    /// session puts the first session it makes in the slot it sends from, so once we answer
    /// an initiation it would send data on that responder session before the initiator
    /// confirmed it; the kernel and wireguard-go never do, and when both sides initiated at
    /// once the other side has dropped that handshake for ours, so what we send on it is lost.
    fn must_hold(&self) -> bool {
        self.answered && !self.confirmed
    }
}

impl Peer {
    fn lock(&self) -> MutexGuard<'_, PeerState> {
        // A panic elsewhere while holding it leaves a session gotatun can go on with.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every WireGuard peer's session, shared by all workers. See the [module](self) docs.
pub struct Sessions {
    private: x25519::StaticSecret,
    public: x25519::PublicKey,
    psk: Option<WgSecret>,
    keepalive: Option<u16>,
    mtu: u16,
    /// The local indices of every session and handshake, shared by all peers' `Tunn`s, so
    /// that none is used twice.
    indices: IndexTable,
    rate_limiter: Arc<RateLimiter>,
    peers: ArcSwap<HashMap<WgPublicKey, Arc<Peer>>>,
    /// Our local index (the `sender_idx` of a handshake message we sent) -> its peer: how a
    /// response, cookie reply or data message finds its session (as gotatun's device does).
    by_index: RwLock<HashMap<u32, Arc<Peer>>>,
    /// Serialises [`Self::set_peers`].
    writer: Mutex<()>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("public", &WgPublicKey(self.public.to_bytes()))
            .field("peers", &self.peers.load().len())
            .finish_non_exhaustive()
    }
}

impl Sessions {
    /// Sessions under our `private` key, with an optional preshared key and persistent
    /// keepalive (seconds) for every peer; inner packets are padded up to `mtu` (the TUN
    /// device's). No peers yet.
    pub fn new(
        private: &WgSecret,
        psk: Option<WgSecret>,
        keepalive: Option<u16>,
        mtu: u16,
    ) -> Self {
        let private = x25519::StaticSecret::from(*private.expose());
        let public = x25519::PublicKey::from(&private);
        Self {
            rate_limiter: Arc::new(RateLimiter::new(&public, HANDSHAKES_PER_SOURCE_PER_SEC)),
            private,
            public,
            psk,
            keepalive,
            mtu,
            indices: IndexTable::from_os_rng(),
            peers: ArcSwap::from_pointee(HashMap::new()),
            by_index: RwLock::new(HashMap::new()),
            writer: Mutex::new(()),
        }
    }

    /// Our public key (what our lease publishes).
    pub fn public_key(&self) -> WgPublicKey {
        WgPublicKey(self.public.to_bytes())
    }

    /// The peers now, in no order.
    pub fn peers(&self) -> Vec<PeerConfig> {
        self.peers.load().values().map(|p| p.lock().config).collect()
    }

    /// Replaces the peer set with `snapshot` (the route table's peers). A key already known
    /// keeps its session and takes the new endpoint and networks (a new epoch: a fresh one); a
    /// new key gets a fresh
    /// session (a handshake on its first packet); a key no longer there is dropped with its
    /// sessions. Our own key is skipped; of two entries with one key the last wins.
    pub fn set_peers(&self, snapshot: impl IntoIterator<Item = PeerConfig>) {
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.peers.load_full();
        let mut next: HashMap<WgPublicKey, Arc<Peer>> = HashMap::new();
        let own = self.public_key();
        for config in snapshot {
            if config.key == own {
                continue;
            }
            // A kept key keeps its session, unless the peer restarted (a new epoch): its side
            // of the session is gone, and what we sent on ours would be dropped until it
            // started a handshake itself.
            let kept = next
                .get(&config.key)
                .or_else(|| old.get(&config.key).filter(|p| p.lock().config.epoch == config.epoch));
            if let Some(peer) = kept {
                peer.lock().config = config;
                let peer = Arc::clone(peer);
                next.insert(config.key, peer);
                continue;
            }
            let tunn = Tunn::new(
                self.private.clone(),
                x25519::PublicKey::from(config.key.0),
                self.psk.map(|k| *k.expose()),
                self.keepalive,
                self.indices.clone(),
                Arc::clone(&self.rate_limiter),
            );
            let peer = Peer {
                key: config.key,
                state: Mutex::new(PeerState {
                    config,
                    tunn,
                    queued: false,
                    answered: false,
                    confirmed: false,
                    held: VecDeque::new(),
                }),
            };
            next.insert(config.key, Arc::new(peer));
        }
        self.peers.store(Arc::new(next));
        // A removed peer's indices go with it.
        let peers = self.peers.load();
        self.index_map_write()
            .retain(|_, p| peers.get(&p.key).is_some_and(|kept| Arc::ptr_eq(kept, p)));
    }

    fn index_map_write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u32, Arc<Peer>>> {
        self.by_index.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn peer_by_index(&self, index: u32) -> Option<Arc<Peer>> {
        self.by_index.read().unwrap_or_else(PoisonError::into_inner).get(&index).cloned()
    }

    /// Remembers that messages to `index` are `peer`'s, if `sent` is a handshake message (its
    /// `sender_idx` is our new local index).
    fn register(&self, sent: &WgKind, peer: &Arc<Peer>) {
        let index = match sent {
            WgKind::HandshakeInit(p) => p.sender_idx.get(),
            WgKind::HandshakeResp(p) => p.sender_idx.get(),
            _ => return,
        };
        self.index_map_write().insert(index, Arc::clone(peer));
    }

    /// Seals the inner IP packet `packet` for `peer` into `out`. `out` must hold
    /// `max(sealed_len(packet.len(), mtu), HANDSHAKE_INIT_LEN)` bytes.
    ///
    /// Drops: `tx wg_unknown_peer` for a key not in the peer set; `tx malformed` for an
    /// empty packet (that is a keepalive's shape) or an `out` too small.
    pub fn seal(&self, peer: &WgPublicKey, packet: &[u8], out: &mut [u8]) -> Sealed {
        let padded = padded_len(packet.len(), self.mtu);
        if packet.is_empty() || out.len() < (OVERHEAD + padded).max(HANDSHAKE_INIT_LEN) {
            return Sealed::Drop(DropReason::TxMalformed);
        }
        let peers = self.peers.load();
        let Some(peer) = peers.get(peer) else {
            return Sealed::Drop(DropReason::TxWgUnknownPeer);
        };
        let mut buf = BytesMut::with_capacity(padded);
        buf.extend_from_slice(packet);
        buf.resize(padded, 0);
        let mut state = peer.lock();
        let to = state.config.endpoint;
        if state.must_hold() {
            if state.held.len() < MAX_HELD {
                state.held.push_back(Packet::from_bytes(buf));
            }
            state.queued = true;
            return Sealed::Queued;
        }
        let Some(sent) = state.tunn.handle_outgoing_packet(Packet::from_bytes(buf), None) else {
            state.queued = true;
            return Sealed::Queued;
        };
        if matches!(sent, WgKind::HandshakeInit(_)) {
            state.queued = true;
            self.register(&sent, peer);
        }
        drop(state);
        let handshake = matches!(sent, WgKind::HandshakeInit(_));
        match copy_out(sent, out) {
            Some(len) if handshake => Sealed::Handshake { to, len },
            Some(len) => Sealed::Send { to, len },
            None => Sealed::Drop(DropReason::TxMalformed),
        }
    }

    /// The next packet `peer` queued while it had no session, sealed into `out` (which must
    /// hold the largest of them sealed, or [`HANDSHAKE_INIT_LEN`]): `(endpoint, len)` to send.
    /// `None` when the queue is empty or still waits for a handshake.
    ///
    /// The caller's loop: after [`Opened::Reply`], `while let Some((to, len)) = drain(&peer,
    /// out) { send(to, &out[..len]) }`. A queued packet too large for `out` is dropped.
    pub fn drain(&self, peer: &WgPublicKey, out: &mut [u8]) -> Option<(SocketAddr, usize)> {
        let peers = self.peers.load();
        let peer = peers.get(peer)?;
        let mut mtu = MtuWatcher::new(self.mtu);
        loop {
            let mut state = peer.lock();
            if state.must_hold() {
                return None;
            }
            let to = state.config.endpoint;
            let queued = state.tunn.get_queued_packets(&mut mtu).next();
            let sent = match queued {
                Some(sent) => sent,
                None => {
                    // Held packets are padded already.
                    let next = state.held.pop_front();
                    match next.and_then(|p| state.tunn.handle_outgoing_packet(p, None)) {
                        Some(sent) => sent,
                        None if state.held.is_empty() => {
                            state.queued = false;
                            return None;
                        }
                        None => continue,
                    }
                }
            };
            self.register(&sent, peer);
            drop(state);
            if let Some(len) = copy_out(sent, out) {
                return Some((to, len));
            }
        }
    }

    /// Opens the datagram `datagram` that arrived from `from`, writing what comes of it into
    /// `out` (which should hold a datagram's worth; an inner packet that does not fit is
    /// dropped as `rx truncated`). See [`Opened`] and the module's receive rules.
    pub fn open(&self, from: SocketAddr, datagram: &[u8], out: &mut [u8]) -> Opened {
        if !well_formed(datagram) {
            return Opened::Drop(DropReason::RxWgMalformed);
        }
        // Every message but an initiation names one of our sessions or handshakes by its
        // receiver index: looked up before anything is copied.
        let receiver = |at: usize| {
            let bytes = datagram.get(at..at + 4)?;
            Some(u32::from_le_bytes(bytes.try_into().ok()?))
        };
        let indexed = match datagram.first() {
            Some(1) => None,
            Some(2) => Some(receiver(8).and_then(|i| self.peer_by_index(i))),
            _ => Some(receiver(4).and_then(|i| self.peer_by_index(i))),
        };
        if let Some(None) = indexed {
            return Opened::Drop(DropReason::RxWgNoSession);
        }
        // mac1, and the per-source handshake count (a cookie reply when under load).
        let message = match self.rate_limiter.verify_packet(from, Packet::copy_from(datagram)) {
            Ok(message) => message,
            Err(TunnResult::WriteToNetwork(cookie)) => {
                return match copy_out(cookie, out) {
                    Some(len) => {
                        Opened::Refuse { to: from, len, reason: DropReason::RxWgUnderLoad }
                    }
                    None => Opened::Drop(DropReason::RxWgUnderLoad),
                };
            }
            Err(TunnResult::Err(e)) => return Opened::Drop(rx_reason(&e)),
            Err(_) => return Opened::Drop(DropReason::RxWgMalformed),
        };
        let peer = match (&message, indexed) {
            (WgKind::HandshakeInit(init), _) => {
                let Ok(half) = parse_handshake_anon(&self.private, &self.public, init) else {
                    return Opened::Drop(DropReason::RxWgDecrypt);
                };
                let Some(peer) =
                    self.peers.load().get(&WgPublicKey(half.peer_static_public)).cloned()
                else {
                    return Opened::Drop(DropReason::RxWgUnknownPeer);
                };
                peer
            }
            (_, Some(Some(peer))) => peer,
            (_, _) => return Opened::Drop(DropReason::RxWgNoSession),
        };
        let initiation = matches!(message, WgKind::HandshakeInit(_));
        let mut state = peer.lock();
        let result = state.tunn.handle_incoming_packet(message);
        match result {
            TunnResult::WriteToNetwork(_) if initiation => state.answered = true,
            // A handshake response, or data (a keepalive too) on one of our sessions.
            TunnResult::WriteToNetwork(_) | TunnResult::WriteToTunnel(_) => state.confirmed = true,
            TunnResult::Done | TunnResult::Err(_) => {}
        }
        match result {
            TunnResult::Done => Opened::Consumed { peer: peer.key },
            TunnResult::Err(e) => Opened::Drop(rx_reason(&e)),
            TunnResult::WriteToNetwork(reply) => {
                self.register(&reply, &peer);
                drop(state);
                match copy_out(reply, out) {
                    Some(len) => Opened::Reply { to: from, len, peer: peer.key },
                    None => Opened::Drop(DropReason::RxTruncated),
                }
            }
            TunnResult::WriteToTunnel(inner) => {
                let (config, queued) = (state.config, state.queued);
                drop(state);
                deliver(&config, inner.as_ref(), out, queued)
            }
        }
    }

    /// Starts a fresh handshake with every peer, `emit(to, initiation)` sending each. For a
    /// process that took over from another (an upgrade): it has none of its predecessor's
    /// sessions, and its peers go on sealing for those until a session of ours is confirmed
    /// to them; initiating at once makes that one round trip instead of the 15 s a peer waits
    /// before it starts a handshake itself. Fresh even where a handshake is under way: one a
    /// worker started for a packet it read before the predecessor let go of the sockets may
    /// have had its response read (and dropped) by the predecessor, and would be retried only
    /// after gotatun's 5 s.
    pub fn initiate_all(&self, mut emit: impl FnMut(SocketAddr, &[u8])) {
        let peers = self.peers.load();
        for peer in peers.values() {
            let mut state = peer.lock();
            let to = state.config.endpoint;
            let Some(init) = state.tunn.format_handshake_initiation(true) else { continue };
            let sent = WgKind::from(init);
            self.register(&sent, peer);
            drop(state);
            emit(to, Packet::from(sent).as_ref());
        }
    }

    /// Runs every session's timers (gotatun's clock): handshake retries and give-ups, rekeys,
    /// passive and persistent keepalives, expiry of old keys. `emit(to, datagram)` is called
    /// for each datagram to send, with no lock held. Also forgets the indices of sessions that
    /// expired and resets the per-source handshake counts.
    pub fn tick(&self, mut emit: impl FnMut(SocketAddr, &[u8])) {
        self.rate_limiter.try_reset_count();
        let peers = self.peers.load();
        for peer in peers.values() {
            let mut state = peer.lock();
            let to = state.config.endpoint;
            // `Err` is an expired connection (or nothing of note): nothing to send. Expired,
            // every session is gone: the next one must be confirmed again.
            let sent = match state.tunn.update_timers() {
                Ok(Some(sent)) => sent,
                Ok(None) => continue,
                Err(WireGuardError::ConnectionExpired) => {
                    (state.answered, state.confirmed) = (false, false);
                    continue;
                }
                Err(_) => continue,
            };
            self.register(&sent, peer);
            drop(state);
            emit(to, Packet::from(sent).as_ref());
        }
        self.index_map_write().retain(|index, _| self.indices.in_use(*index));
    }
}

/// Whether `datagram` has the shape of a WireGuard message: a known type with zero reserved
/// bytes (the kernel compares the whole little-endian 32-bit type), and its type's length (a
/// data message: at least header and tag).
fn well_formed(datagram: &[u8]) -> bool {
    match datagram {
        [1, 0, 0, 0, ..] => datagram.len() == HANDSHAKE_INIT_LEN,
        [2, 0, 0, 0, ..] => datagram.len() == HANDSHAKE_RESPONSE_LEN,
        [3, 0, 0, 0, ..] => datagram.len() == COOKIE_REPLY_LEN,
        [4, 0, 0, 0, ..] => datagram.len() >= OVERHEAD,
        _ => false,
    }
}

/// Copies a message gotatun made into `out`: its length, or `None` if it does not fit.
fn copy_out(message: WgKind, out: &mut [u8]) -> Option<usize> {
    let packet = Packet::from(message);
    let bytes = packet.as_ref();
    out.get_mut(..bytes.len())?.copy_from_slice(bytes);
    Some(bytes.len())
}

/// The drop a gotatun error on receive stands for.
fn rx_reason(e: &WireGuardError) -> DropReason {
    use WireGuardError as E;
    match e {
        E::WrongTai64nTimestamp
        | E::DuplicateCounter
        | E::InvalidCounter
        | E::ConnectionExpired => DropReason::RxWgReplay,
        E::InvalidMac | E::InvalidAeadTag | E::WrongKey => DropReason::RxWgDecrypt,
        E::UnexpectedPacket | E::NoCurrentSession | E::WrongIndex => DropReason::RxWgNoSession,
        E::DestinationBufferTooSmall
        | E::IncorrectPacketLength
        | E::WrongPacketType
        | E::InvalidTai64nTimestamp
        | E::InvalidPacket
        | E::LockFailed => DropReason::RxWgMalformed,
    }
}

/// The decrypted `inner` (an IP packet and its padding, or nothing: a keepalive) from the peer
/// `config`, checked and copied into `out`.
fn deliver(config: &PeerConfig, inner: &[u8], out: &mut [u8], queued: bool) -> Opened {
    let (src, len) = match inner.first().map(|b| b >> 4) {
        None => return Opened::Consumed { peer: config.key },
        Some(4) => match ipv4::Packet::new_checked(inner) {
            Ok(ip) => (IpAddr::V4(ip.src_addr()), usize::from(ip.total_len())),
            Err(_) => return Opened::Drop(DropReason::RxMalformed),
        },
        Some(6) => match ipv6::Packet::new_checked(inner) {
            Ok(ip) => (IpAddr::V6(ip.src_addr()), ipv6::HEADER_LEN + usize::from(ip.payload_len())),
            Err(_) => return Opened::Drop(DropReason::RxMalformed),
        },
        Some(_) => return Opened::Drop(DropReason::RxMalformed),
    };
    if !config.allows(src) {
        return Opened::Drop(DropReason::RxSpoofedSource);
    }
    // The checked length never exceeds `inner`; the padding after it is not delivered.
    let (Some(packet), Some(dst)) = (inner.get(..len), out.get_mut(..len)) else {
        return Opened::Drop(DropReason::RxTruncated);
    };
    dst.copy_from_slice(packet);
    Opened::Deliver { range: 0..len, peer: config.key, drain: queued }
}

#[cfg(test)]
mod tests;
