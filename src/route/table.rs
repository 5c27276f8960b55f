//! The route table: an immutable snapshot mapping overlay destinations to peers, built off the
//! hot path and read by the data plane's workers.
//!
//! # Contract
//! - [`RouteTable::lookup`] is a longest-prefix match over every peer's subnet. It is
//!   wait-free, takes no lock and allocates nothing: an index computation for the common case,
//!   plus one binary search per distinct odd prefix length (see below).
//! - A table never changes once built. Readers get one through [`super::Routes::load`] and
//!   see that snapshot for as long as they hold it; see [`super::Routes`] for how stale a
//!   snapshot can be.
//! - [`RouteTable::build`] accepts any peers, in any order: overlapping subnets, subnets of
//!   any length and subnets outside the network. Two peers with the same subnet are one route:
//!   the later one wins.
//! - [`Peer::from_lease`] parses untrusted store values and returns a typed [`PeerError`]; it
//!   never panics.
//! - [`RouteTable::lookup6`] is the same for IPv6 destinations, over the IPv6 halves of
//!   dual-stack peers ([`Peer6`]): one binary search per distinct prefix length (almost always
//!   one: the network's `IPv6SubnetLen`), wait-free and allocation-free too.
//!
//! # Layout
//! Almost every lease has the network's `SubnetLen` and lies inside `Network`, so those go into
//! a flat slot array indexed by `(dst - network) >> (32 - subnet_len)`; a slot holds an index
//! into the peer list, or [`NO_PEER`]. Leases of other lengths or outside the network (a
//! reservation written by hand, a subnet of an older config) go into per-length levels, each a
//! sorted array searched by `dst & mask`. A lookup tries the levels longer than `SubnetLen`
//! (longest first), then the slot array, then the remaining levels (longest first), so the first
//! hit is the longest match.
//!
//! The slot array has one `u32` per subnet of the network; it is used only while that is
//! affordable ([`DENSE_ALWAYS_SLOTS`], or up to [`DENSE_MAX_SLOTS`] when the table has at least
//! one peer per [`DENSE_SLOTS_PER_PEER`] slots). Otherwise every peer goes into the levels:
//! lookups stay correct and allocation-free, at the cost of a binary search.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};
use serde_json::Value;

use crate::lease::record::{Incarnation, NodeId, StoredLease};
use crate::vocab::{Ipv6Subnet, MacAddr, Subnet, Vni, WgPublicKey};

/// A slot of the slot array that names no peer.
pub(crate) const NO_PEER: u32 = u32::MAX;

/// Slot arrays up to this many slots (4 MiB) are always built.
pub(crate) const DENSE_ALWAYS_SLOTS: u64 = 1 << 20;

/// No slot array is larger than this many slots (64 MiB).
pub(crate) const DENSE_MAX_SLOTS: u64 = 1 << 24;

/// Above [`DENSE_ALWAYS_SLOTS`], a slot array is built only if it has at most this many slots
/// per peer that lands in it.
pub(crate) const DENSE_SLOTS_PER_PEER: u64 = 64;

/// How packets reach a peer, from its lease's `BackendType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PeerBackend {
    /// `"vxlan"`: VXLAN to the peer's `VtepMAC` (docs/store-layout.md, "Values").
    Vxlan,
    /// No `BackendType` (flannel's udp backend writes none, docs/store-layout.md), or `"udp"`:
    /// the raw IP packet in UDP.
    Udp,
    /// `"host-gw"`: reached by a kernel route via its `PublicIP`, never encapsulated.
    HostGw,
    /// `"ipip"`: the IPv4 packet behind an outer IPv4 header of protocol 4, to its `PublicIP`
    /// (flannel's ipip backend writes no `BackendData`).
    Ipip,
    /// `"wireguard"`: WireGuard to its `PublicIP`, with the key and port of its `BackendData`
    /// (`{"PublicKey":"<base64>","Port":51820}`).
    Wireguard {
        /// `BackendData.PublicKey`.
        key: WgPublicKey,
        /// `BackendData.Port`; `None` when absent or 0, which flannel reads as "the port I
        /// listen on" (leases of flannel before it wrote the port).
        port: Option<u16>,
    },
    /// Any other backend: the peer cannot decapsulate what weft sends.
    Other,
}

impl fmt::Display for PeerBackend {
    /// flannel's `BackendType` (`udp` for none); `another` for a type weft does not know.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Vxlan => "vxlan",
            Self::Udp => "udp",
            Self::HostGw => "host-gw",
            Self::Ipip => "ipip",
            Self::Wireguard { .. } => "wireguard",
            Self::Other => "another",
        })
    }
}

/// One remote host's route: where packets for its subnet go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// The peer's subnet (the lease key).
    pub subnet: Subnet,
    /// The underlay address to encapsulate to (`PublicIP`).
    pub public_ip: Ipv4Addr,
    /// The backend the peer's lease announces.
    pub backend: PeerBackend,
    /// The peer's VTEP MAC (vxlan only): the inner Ethernet destination.
    pub vtep_mac: Option<MacAddr>,
    /// The VNI the peer's lease announces (vxlan only, when present).
    pub vni: Option<u32>,
    /// The peer's weft node identity (absent for flannel peers and hand-written leases).
    pub node: Option<NodeId>,
    /// The weft process that wrote the lease (`WeftIncarnation`; absent for flannel peers): a
    /// new one is a restarted peer, which has forgotten its WireGuard sessions.
    pub incarnation: Option<Incarnation>,
    /// The lease key has expired or vanished, but the route is kept: the peer is most likely
    /// partitioned, not gone. Stale routes are still used for forwarding.
    pub stale: bool,
    /// The IPv6 half of a dual-stack peer that can carry IPv6 ([`Peer6::from_lease`]).
    pub ipv6: Option<Peer6>,
}

/// The IPv6 half of a peer's route: where IPv6 packets for its IPv6 subnet go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer6 {
    /// The IPv6 half of the lease key.
    pub subnet: Ipv6Subnet,
    /// The IPv6 underlay address to encapsulate to (`PublicIPv6`).
    pub public_ip: Ipv6Addr,
    /// The MAC of the peer's IPv6 VTEP (`BackendV6Data.VtepMAC`): the inner Ethernet
    /// destination (vxlan; all zeros for a wireguard half, whose lease names none).
    pub vtep_mac: MacAddr,
    /// A wireguard lease's IPv6 side: `BackendV6Data`'s key and port (flannel's IPv6 device,
    /// `flannel-wg-v6`, in `Mode` `separate`); `None` for vxlan.
    pub wireguard: Option<Wireguard6>,
}

/// A wireguard lease's `BackendV6Data` (`{"PublicKey":"<base64>","Port":51821}`, as flannel's
/// `newSubnetAttrs` writes it on a network with IPv6 enabled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wireguard6 {
    /// `BackendV6Data.PublicKey` (flannel's one key, the same as `BackendData`'s).
    pub key: WgPublicKey,
    /// `BackendV6Data.Port` (flannel's `ListenPortV6`); `None` when absent or 0: the
    /// receiver's own `ListenPortV6`, as flannel reads it.
    pub port: Option<u16>,
}

/// Why a dual-stack lease's IPv6 half cannot be routed. The IPv4 route stands either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Peer6Error {
    /// `PublicIPv6` is absent, unspecified or multicast: there is no host to send to. flannel's
    /// udp backend leases an IPv6 half but publishes no IPv6 address, as it carries no IPv6.
    #[error("PublicIPv6 is not a unicast address")]
    NoPublicIpv6,
    /// Neither a vxlan nor a wireguard lease: only those carry IPv6 (flannel's udp backend
    /// does not).
    #[error("only vxlan and wireguard carry IPv6")]
    NotVxlan,
    /// A vxlan or wireguard lease without a `BackendV6Data` object.
    #[error("lease has no BackendV6Data object")]
    MissingBackendData,
    /// A wireguard lease whose `BackendV6Data` has no valid `PublicKey` or `Port`.
    #[error("wireguard lease's BackendV6Data has no valid PublicKey and Port")]
    BadWireguard,
    /// `BackendV6Data.VtepMAC` is absent or not a 48-bit MAC.
    #[error("BackendV6Data has no valid VtepMAC")]
    BadVtepMac,
}

impl Peer6 {
    /// The IPv6 route a stored lease describes: `Ok(None)` for a lease without an IPv6 half,
    /// an error naming why a half cannot be carried (the IPv4 route stands either way).
    ///
    /// # Errors
    /// [`Peer6Error`] naming the first problem.
    pub fn from_lease(l: &StoredLease) -> Result<Option<Peer6>, Peer6Error> {
        let Some(subnet) = l.ipv6 else {
            return Ok(None);
        };
        let attrs = &l.attrs;
        let public_ip = attrs
            .public_ipv6
            .filter(|ip| !ip.is_unspecified() && !ip.is_multicast())
            .ok_or(Peer6Error::NoPublicIpv6)?;
        let wireguard = match attrs.backend_type.as_deref() {
            Some("vxlan") => false,
            Some("wireguard") => true,
            _ => return Err(Peer6Error::NotVxlan),
        };
        let Some(Value::Object(data)) = &attrs.backend_v6_data else {
            return Err(Peer6Error::MissingBackendData);
        };
        if wireguard {
            // The same format as BackendData's, read by the same code.
            let Ok(PeerBackend::Wireguard { key, port }) =
                wireguard_of(attrs.backend_v6_data.as_ref())
            else {
                return Err(Peer6Error::BadWireguard);
            };
            let wireguard = Some(Wireguard6 { key, port });
            return Ok(Some(Peer6 { subnet, public_ip, vtep_mac: MacAddr([0; 6]), wireguard }));
        }
        let vtep_mac = match json_field(data, "VtepMAC") {
            Some(Value::String(s)) => MacAddr::parse(s).ok_or(Peer6Error::BadVtepMac)?,
            _ => return Err(Peer6Error::BadVtepMac),
        };
        Ok(Some(Peer6 { subnet, public_ip, vtep_mac, wireguard: None }))
    }
}

/// Why a lease value cannot be turned into a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// `PublicIP` is unspecified (`0.0.0.0`, what flannel writes for "none"), broadcast or
    /// multicast: there is no host to send to.
    #[error("PublicIP {0} is not a unicast address")]
    BadPublicIp(Ipv4Addr),
    /// A vxlan lease without `BackendData`, or whose `BackendData` is not a JSON object.
    #[error("vxlan lease has no BackendData object")]
    MissingBackendData,
    /// A vxlan lease without a `VtepMAC` (or with `null`).
    #[error("vxlan lease has no VtepMAC")]
    MissingVtepMac,
    /// `VtepMAC` is not a 48-bit MAC in a form Go's `net.ParseMAC` accepts.
    #[error("VtepMAC is not a 48-bit MAC address")]
    BadVtepMac,
    /// `VNI` is not an integer in `0..=0xffffff`.
    #[error("VNI is not a 24-bit integer")]
    BadVni,
    /// A wireguard lease without a `BackendData` object holding a `PublicKey` in base64.
    #[error("wireguard lease has no valid BackendData.PublicKey")]
    BadWireguardKey,
    /// A wireguard lease whose `BackendData.Port` is not a port number.
    #[error("wireguard lease's BackendData.Port is not a port number")]
    BadWireguardPort,
    /// An IPv6-only lease (`0.0.0.0-0&…`) whose IPv6 half cannot be carried: it has nothing
    /// else to route.
    #[error("IPv6-only lease: {0}")]
    Ipv6Only(Peer6Error),
}

impl Peer {
    /// The route a stored lease describes (not stale).
    ///
    /// `BackendType` `"vxlan"` needs `BackendData.VtepMAC` in any 48-bit form Go's
    /// `net.ParseMAC` accepts (`aa:bb:cc:dd:ee:ff`, `aa-bb-cc-dd-ee-ff`, `aabb.ccdd.eeff`, any
    /// case); `VNI` is optional but must be a 24-bit integer when present. Field names inside
    /// `BackendData` match case-insensitively, as Go's `encoding/json` matches them.
    ///
    /// # Errors
    /// [`PeerError`] naming the first problem.
    pub fn from_lease(l: &StoredLease) -> Result<Peer, PeerError> {
        let attrs = &l.attrs;
        if l.subnet.v4().is_none() {
            return Self::from_ipv6_only_lease(l);
        }
        let ip = attrs.public_ip;
        if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
            return Err(PeerError::BadPublicIp(ip));
        }
        let backend = match attrs.backend_type.as_deref() {
            None | Some("udp") => PeerBackend::Udp,
            Some("vxlan") => PeerBackend::Vxlan,
            Some("host-gw") => PeerBackend::HostGw,
            Some("ipip") => PeerBackend::Ipip,
            Some("wireguard") => wireguard_of(attrs.backend_data.as_ref())?,
            Some(_) => PeerBackend::Other,
        };
        let (vtep_mac, vni) = match backend {
            PeerBackend::Vxlan => {
                let Some(Value::Object(data)) = &attrs.backend_data else {
                    return Err(PeerError::MissingBackendData);
                };
                let mac = match json_field(data, "VtepMAC") {
                    None | Some(Value::Null) => return Err(PeerError::MissingVtepMac),
                    Some(Value::String(s)) => MacAddr::parse(s).ok_or(PeerError::BadVtepMac)?,
                    Some(_) => return Err(PeerError::BadVtepMac),
                };
                (Some(mac), vni_of(data)?)
            }
            PeerBackend::Udp
            | PeerBackend::HostGw
            | PeerBackend::Ipip
            | PeerBackend::Wireguard { .. }
            | PeerBackend::Other => (None, None),
        };
        Ok(Peer {
            subnet: l.subnet,
            public_ip: ip,
            backend,
            vtep_mac,
            vni,
            node: attrs.node_id.clone(),
            stale: false,
            incarnation: attrs.incarnation.clone(),
            // An IPv6 half that cannot be carried leaves the peer IPv4-only.
            ipv6: Peer6::from_lease(l).ok().flatten(),
        })
    }

    /// The route of an IPv6-only lease: flannel writes `PublicIP` `0.0.0.0` and no
    /// `BackendData` there, so everything comes from the IPv6 half (`PublicIPv6`,
    /// `BackendV6Data`), which must be carried; `PublicIP` is never routed to. A wireguard
    /// half's key and port stand for the peer's backend too.
    fn from_ipv6_only_lease(l: &StoredLease) -> Result<Peer, PeerError> {
        let half = Peer6::from_lease(l)
            .map_err(PeerError::Ipv6Only)?
            .ok_or(PeerError::Ipv6Only(Peer6Error::MissingBackendData))?;
        let (backend, vni) = match (half.wireguard, &l.attrs.backend_v6_data) {
            (Some(Wireguard6 { key, port }), _) => (PeerBackend::Wireguard { key, port }, None),
            (None, Some(Value::Object(data))) => (PeerBackend::Vxlan, vni_of(data)?),
            (None, _) => (PeerBackend::Vxlan, None),
        };
        Ok(Peer {
            subnet: l.subnet,
            public_ip: Ipv4Addr::UNSPECIFIED,
            backend,
            vtep_mac: None,
            vni,
            node: l.attrs.node_id.clone(),
            stale: false,
            incarnation: l.attrs.incarnation.clone(),
            ipv6: Some(half),
        })
    }
}

/// A wireguard lease's backend: `BackendData`'s `PublicKey` (base64, required) and `Port`
/// (absent, `null` or 0: the receiver's own listen port, as flannel reads it).
fn wireguard_of(data: Option<&Value>) -> Result<PeerBackend, PeerError> {
    let Some(Value::Object(data)) = data else {
        return Err(PeerError::BadWireguardKey);
    };
    let key = match json_field(data, "PublicKey") {
        Some(Value::String(s)) => WgPublicKey::parse(s).map_err(|_| PeerError::BadWireguardKey)?,
        _ => return Err(PeerError::BadWireguardKey),
    };
    let port = match json_field(data, "Port") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64().map(u16::try_from) {
            Some(Ok(0)) => None,
            Some(Ok(p)) => Some(p),
            _ => return Err(PeerError::BadWireguardPort),
        },
    };
    Ok(PeerBackend::Wireguard { key, port })
}

/// The `VNI` of a backend data object: absent or `null` is `None`; anything but an integer in
/// `0..=0xffffff` is [`PeerError::BadVni`].
fn vni_of(data: &serde_json::Map<String, Value>) -> Result<Option<u32>, PeerError> {
    match json_field(data, "VNI") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|n| *n <= u64::from(Vni::MAX))
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(PeerError::BadVni),
    }
}

/// A field of a JSON object: the exact name if present, else the first case-insensitive match
/// (Go's `encoding/json` rule for struct fields).
fn json_field<'a>(obj: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).or_else(|| obj.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v))
}

/// The netmask of a prefix length (`0` for `/0`).
fn mask_of(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len.min(32))).unwrap_or(0)
}

/// The peers of one prefix length that are not in the slot array, sorted by network address.
#[derive(Clone, Debug)]
struct Level {
    mask: u32,
    /// `(network address, index into peers)`, sorted by address, unique.
    entries: Box<[(u32, u32)]>,
}

impl Level {
    fn find(&self, dst: u32) -> Option<u32> {
        let key = dst & self.mask;
        self.entries.binary_search_by_key(&key, |e| e.0).ok().map(|i| self.entries[i].1)
    }
}

fn find_in(levels: &[Level], dst: u32) -> Option<u32> {
    levels.iter().find_map(|level| level.find(dst))
}

/// The IPv6 halves of one prefix length, sorted by network address.
#[derive(Clone, Debug)]
struct Level6 {
    mask: u128,
    /// `(network address, index into peers)`, sorted by address, unique.
    entries: Box<[(u128, u32)]>,
}

impl Level6 {
    fn find(&self, dst: u128) -> Option<u32> {
        let key = dst & self.mask;
        self.entries.binary_search_by_key(&key, |e| e.0).ok().map(|i| self.entries[i].1)
    }
}

/// The IPv6 netmask of a prefix length (`0` for `/0`).
fn mask6_of(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len.min(128))).unwrap_or(0)
}

/// An immutable longest-prefix-match table from overlay destinations to [`Peer`]s. See the
/// module docs for the layout and the lookup contract.
#[derive(Clone)]
pub struct RouteTable {
    /// Every route, sorted by subnet, one per subnet.
    peers: Box<[Peer]>,
    /// The network's address and mask (the slot array's range).
    base: u32,
    net_mask: u32,
    /// `32 - subnet_len`: how far to shift an offset into the network to get its slot.
    shift: u32,
    /// One entry per subnet of the network (empty: no slot array).
    slots: Box<[u32]>,
    /// Levels longer than `subnet_len`, longest first.
    longer: Box<[Level]>,
    /// Levels of `subnet_len` or shorter that are not in the slot array, longest first.
    shorter: Box<[Level]>,
    /// Every peer's public IP, sorted, unique.
    public_ips: Box<[u32]>,
    /// The IPv6 halves, by prefix length, longest first.
    levels6: Box<[Level6]>,
    /// Every IPv6 half's public IPv6 address, sorted, unique.
    public_ips6: Box<[u128]>,
}

impl fmt::Debug for RouteTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteTable")
            .field("peers", &self.peers.len())
            .field("slots", &self.slots.len())
            .field("levels", &(self.longer.len() + self.shorter.len()))
            .finish_non_exhaustive()
    }
}

impl RouteTable {
    /// Builds a table for the IPv4 `network` (host bits are ignored) whose leases are normally
    /// `/subnet_len`, from `peers` in any order; for two peers with the same subnet, the later
    /// one wins. Never fails: peers that do not fit the slot array go into the levels.
    pub fn build(network: Ipv4Net, subnet_len: u8, peers: impl IntoIterator<Item = Peer>) -> Self {
        Self::build_in(IpNet::V4(network), subnet_len, peers)
    }

    /// [`RouteTable::build`] for the network leases are subnets of, of either family
    /// ([`crate::config::NetworkConfig::leased_network`]). On an IPv6-only network (`network`
    /// is IPv6) every peer's subnet is IPv6 and the IPv4 part stays empty: only peers with an
    /// IPv4 subnet ever enter it.
    pub fn build_in(network: IpNet, subnet_len: u8, peers: impl IntoIterator<Item = Peer>) -> Self {
        let (network, subnet_len) = match network {
            IpNet::V4(net) => (net.trunc(), subnet_len),
            // No IPv4 subnet is leased: a one-slot array no peer fits (a /32 network of /32
            // leases) and no levels.
            IpNet::V6(_) => (Ipv4Net::from(Ipv4Addr::UNSPECIFIED), 32),
        };
        let by_subnet: BTreeMap<Subnet, Peer> = peers.into_iter().map(|p| (p.subnet, p)).collect();
        let mut peers: Vec<Peer> = by_subnet.into_values().collect();
        // Indices are u32 with one value reserved; no machine holds 2^32 peers, but stay total.
        peers.truncate(NO_PEER as usize);

        let base = u32::from(network.network());
        let net_mask = mask_of(network.prefix_len());
        let fits_dense = |p: &Peer| {
            p.subnet.v4().is_some_and(|s| s.prefix_len() == subnet_len && network.contains(&s))
        };
        let slot_count = subnet_len
            .checked_sub(network.prefix_len())
            .filter(|_| subnet_len <= 32)
            .map(|extra| 1u64 << extra);
        let dense = slot_count.is_some_and(|n| {
            let eligible = peers.iter().filter(|p| fits_dense(p)).count() as u64;
            n <= DENSE_MAX_SLOTS
                && (n <= DENSE_ALWAYS_SLOTS || n <= eligible.saturating_mul(DENSE_SLOTS_PER_PEER))
        });
        let shift = 32 - u32::from(subnet_len.min(32));
        // At most DENSE_MAX_SLOTS when dense: fits in usize.
        let mut slots = vec![NO_PEER; if dense { slot_count.unwrap_or(0) as usize } else { 0 }];

        let mut by_len: BTreeMap<u8, Vec<(u32, u32)>> = BTreeMap::new();
        for (i, p) in peers.iter().enumerate() {
            // `peers` was truncated below NO_PEER, so `i` fits and is never NO_PEER.
            let idx = i as u32;
            let Some(subnet) = p.subnet.v4() else { continue };
            let addr = u32::from(subnet.network());
            if dense && fits_dense(p) {
                let slot = (u64::from(addr - base) >> shift) as usize;
                if let Some(s) = slots.get_mut(slot) {
                    *s = idx;
                }
                continue;
            }
            by_len.entry(p.subnet.prefix_len()).or_default().push((addr, idx));
        }
        let mut longer = Vec::new();
        let mut shorter = Vec::new();
        for (len, mut entries) in by_len.into_iter().rev() {
            // Subnets are unique and hold their network address: addresses are unique per length.
            entries.sort_unstable();
            let level = Level { mask: mask_of(len), entries: entries.into_boxed_slice() };
            if len > subnet_len { longer.push(level) } else { shorter.push(level) }
        }
        // An IPv6-only peer's PublicIP is 0.0.0.0: never an underlay address to accept from.
        let mut public_ips: Vec<u32> = peers
            .iter()
            .filter(|p| p.subnet.v4().is_some())
            .map(|p| u32::from(p.public_ip))
            .collect();
        public_ips.sort_unstable();
        public_ips.dedup();

        // Two peers may name the same IPv6 half (a create compares the IPv4 subnet only).
        // `RouteSet` leaves it on one live key's route (the one created first); for any other
        // caller, and for stale routes alone on a half, the lower IPv4 subnet keeps it, so
        // lookups stay deterministic.
        let mut by_len6: BTreeMap<u8, BTreeMap<u128, u32>> = BTreeMap::new();
        for (i, p) in peers.iter().enumerate() {
            if let Some(v6) = &p.ipv6 {
                let level = by_len6.entry(v6.subnet.prefix_len()).or_default();
                level.entry(u128::from(v6.subnet.network())).or_insert(i as u32);
            }
        }
        let levels6: Vec<Level6> = by_len6
            .into_iter()
            .rev()
            .map(|(len, entries)| Level6 {
                mask: mask6_of(len),
                entries: entries.into_iter().collect::<Vec<_>>().into_boxed_slice(),
            })
            .collect();
        let mut public_ips6: Vec<u128> =
            peers.iter().filter_map(|p| p.ipv6.map(|v6| u128::from(v6.public_ip))).collect();
        public_ips6.sort_unstable();
        public_ips6.dedup();

        Self {
            peers: peers.into_boxed_slice(),
            base,
            net_mask,
            shift,
            slots: slots.into_boxed_slice(),
            longer: longer.into_boxed_slice(),
            shorter: shorter.into_boxed_slice(),
            public_ips: public_ips.into_boxed_slice(),
            levels6: levels6.into_boxed_slice(),
            public_ips6: public_ips6.into_boxed_slice(),
        }
    }

    /// The peer whose IPv6 half is the longest prefix containing `dst`, if any, with that
    /// half. Wait-free, no allocation, no lock.
    #[inline]
    pub fn lookup6(&self, dst: Ipv6Addr) -> Option<(&Peer, Peer6)> {
        let d = u128::from(dst);
        let i = self.levels6.iter().find_map(|level| level.find(d))?;
        let peer = self.peers.get(i as usize)?;
        Some((peer, peer.ipv6?))
    }

    /// Whether `public_ip` is some peer's IPv6 underlay address. Stale peers count.
    pub fn is_known_peer6(&self, public_ip: Ipv6Addr) -> bool {
        self.public_ips6.binary_search(&u128::from(public_ip)).is_ok()
    }

    /// The peer whose subnet is the longest prefix containing `dst`, if any. Wait-free, no
    /// allocation, no lock.
    #[inline]
    pub fn lookup(&self, dst: Ipv4Addr) -> Option<&Peer> {
        let d = u32::from(dst);
        if let Some(i) = find_in(&self.longer, d) {
            return self.peers.get(i as usize);
        }
        if d & self.net_mask == self.base {
            let slot = (u64::from(d - self.base) >> self.shift) as usize;
            if let Some(&i) = self.slots.get(slot)
                && i != NO_PEER
            {
                return self.peers.get(i as usize);
            }
        }
        find_in(&self.shorter, d).and_then(|i| self.peers.get(i as usize))
    }

    /// Whether `public_ip` is some peer's underlay address (receive validation drops packets
    /// from anyone else). Stale peers count.
    pub fn is_known_peer(&self, public_ip: Ipv4Addr) -> bool {
        self.public_ips.binary_search(&u32::from(public_ip)).is_ok()
    }

    /// Every route, sorted by subnet, one per subnet.
    pub fn peers(&self) -> &[Peer] {
        &self.peers
    }

    /// The number of routes.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether the table has no routes.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// How many routes are stale (kept after their key expired).
    pub(crate) fn stale_count(&self) -> usize {
        self.peers.iter().filter(|p| p.stale).count()
    }

    /// Whether the slot array is in use (for tests and benchmarks).
    #[cfg(test)]
    pub(crate) fn is_dense(&self) -> bool {
        !self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::lease::record::{LeaseAttrs, Revision, StoreLeaseId};

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn peer(s: &str, ip: [u8; 4]) -> Peer {
        Peer {
            subnet: subnet(s),
            public_ip: Ipv4Addr::from(ip),
            backend: PeerBackend::Udp,
            vtep_mac: None,
            vni: None,
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        }
    }

    fn lease(json: &str) -> StoredLease {
        StoredLease {
            subnet: subnet("10.244.3.0/24"),
            ipv6: None,
            attrs: LeaseAttrs::from_json(json.as_bytes()).unwrap(),
            create_revision: Revision(7),
            mod_revision: Revision(7),
            lease_id: StoreLeaseId(1),
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    /// An IPv6-only lease (flannel's shape: `PublicIP` 0.0.0.0, `BackendV6Data` only) is routed
    /// by its IPv6 half alone: never by the IPv4 table, never to 0.0.0.0.
    #[test]
    fn an_ipv6_only_lease_is_routed_over_ipv6_alone() {
        let half: Ipv6Subnet = "fd00:10:244:3::/64".parse().unwrap();
        let only = |json: &str| StoredLease {
            subnet: Subnet::from(half),
            ipv6: Some(half),
            ..lease(json)
        };
        let p = Peer::from_lease(&only(
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendV6Data":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#,
        ))
        .unwrap();
        assert_eq!((p.public_ip, p.vtep_mac, p.vni), (Ipv4Addr::UNSPECIFIED, None, Some(1)));
        let v6 = p.ipv6.expect("the IPv6 half is the route");
        assert_eq!((v6.subnet, v6.public_ip), (half, "2001:db8::3".parse().unwrap()));
        let t = RouteTable::build_in("fd00:10:244::/56".parse().unwrap(), 64, [p.clone()]);
        assert_eq!(t.lookup6("fd00:10:244:3::9".parse().unwrap()).map(|(q, _)| q), Some(&p));
        assert!(t.lookup(ip("0.0.0.1")).is_none());
        assert!(!t.is_known_peer(Ipv4Addr::UNSPECIFIED), "0.0.0.0 is no underlay address");
        assert!(t.is_known_peer6("2001:db8::3".parse().unwrap()));
        // With nothing to carry it (no PublicIPv6, no BackendV6Data, not vxlan), it is no route.
        for bad in [
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":null,"BackendType":"vxlan","BackendV6Data":{"VtepMAC":"c6:d2:32:6f:8f:44"}}"#,
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendData":{"VtepMAC":"c6:d2:32:6f:8f:44"}}"#,
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::3"}"#,
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendV6Data":{"VNI":-1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#,
        ] {
            assert!(
                matches!(
                    Peer::from_lease(&only(bad)),
                    Err(PeerError::Ipv6Only(_) | PeerError::BadVni)
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn from_lease_reads_flannel_vxlan() {
        let p = Peer::from_lease(&lease(
            r#"{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#,
        ))
        .unwrap();
        assert_eq!(p.backend, PeerBackend::Vxlan);
        assert_eq!(p.public_ip, ip("192.168.64.3"));
        assert_eq!(p.vtep_mac, Some(MacAddr([0xc6, 0xd2, 0x32, 0x6f, 0x8f, 0x44])));
        assert_eq!(p.vni, Some(1));
        assert_eq!(p.subnet, subnet("10.244.3.0/24"));
        assert!(!p.stale);
        assert!(p.node.is_none());
    }

    #[test]
    fn from_lease_reads_udp_and_other_backends() {
        let p = Peer::from_lease(&lease(r#"{"PublicIP":"192.0.2.1","PublicIPv6":null}"#)).unwrap();
        assert_eq!(p.backend, PeerBackend::Udp);
        assert_eq!((p.vtep_mac, p.vni), (None, None));
        let p = Peer::from_lease(&lease(r#"{"PublicIP":"192.0.2.1","BackendType":"host-gw"}"#))
            .unwrap();
        assert_eq!(p.backend, PeerBackend::HostGw);
        // flannel's ipip lease: its type, no BackendData.
        let p = Peer::from_lease(&lease(
            r#"{"PublicIP":"192.0.2.1","PublicIPv6":null,"BackendType":"ipip"}"#,
        ))
        .unwrap();
        assert_eq!((p.backend, p.vtep_mac, p.vni), (PeerBackend::Ipip, None, None));
        let p = Peer::from_lease(&lease(r#"{"PublicIP":"192.0.2.1","BackendType":"extension"}"#))
            .unwrap();
        assert_eq!(p.backend, PeerBackend::Other);
        let p = Peer::from_lease(&lease(
            r#"{"PublicIP":"192.0.2.1","WeftNodeID":"node-aaaa","WeftIncarnation":"inc-00000001"}"#,
        ))
        .unwrap();
        assert_eq!(p.node.as_ref().map(NodeId::as_str), Some("node-aaaa"));
    }

    /// flannel's wireguard lease (`newSubnetAttrs`): the key and the listen port in
    /// `BackendData`; a lease of a flannel before the port was written leaves it to us.
    #[test]
    fn from_lease_reads_flannel_wireguard_and_refuses_one_without_a_key() {
        const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
        let key = WgPublicKey::parse(KEY).unwrap();
        let p = Peer::from_lease(&lease(&format!(
            r#"{{"PublicIP":"192.0.2.1","PublicIPv6":null,"BackendType":"wireguard","BackendData":{{"PublicKey":"{KEY}","Port":51820}}}}"#
        )))
        .unwrap();
        assert_eq!(p.backend, PeerBackend::Wireguard { key, port: Some(51820) });
        assert_eq!(p.backend.to_string(), "wireguard");
        for (data, port) in [
            (format!(r#"{{"PublicKey":"{KEY}"}}"#), None),
            (format!(r#"{{"publickey":"{KEY}","port":0}}"#), None),
            (format!(r#"{{"PublicKey":"{KEY}","Port":null}}"#), None),
            (format!(r#"{{"PublicKey":"{KEY}","Port":1}}"#), Some(1)),
        ] {
            let p = Peer::from_lease(&lease(&format!(
                r#"{{"PublicIP":"192.0.2.1","BackendType":"wireguard","BackendData":{data}}}"#
            )))
            .unwrap();
            assert_eq!(p.backend, PeerBackend::Wireguard { key, port }, "{data}");
        }
        for (data, why) in [
            ("null".to_owned(), PeerError::BadWireguardKey),
            ("{}".to_owned(), PeerError::BadWireguardKey),
            (r#"{"PublicKey":"not a key"}"#.to_owned(), PeerError::BadWireguardKey),
            (r#"{"PublicKey":7}"#.to_owned(), PeerError::BadWireguardKey),
            (format!(r#"{{"PublicKey":"{KEY}","Port":65536}}"#), PeerError::BadWireguardPort),
            (format!(r#"{{"PublicKey":"{KEY}","Port":"51820"}}"#), PeerError::BadWireguardPort),
            (format!(r#"{{"PublicKey":"{KEY}","Port":-1}}"#), PeerError::BadWireguardPort),
        ] {
            let json = format!(
                r#"{{"PublicIP":"192.0.2.1","BackendType":"wireguard","BackendData":{data}}}"#
            );
            assert_eq!(Peer::from_lease(&lease(&json)), Err(why), "{json}");
        }
    }

    fn dual_lease(json: &str) -> StoredLease {
        StoredLease { ipv6: Some("fd00:10:244:3::/64".parse().unwrap()), ..lease(json) }
    }

    #[test]
    fn the_ipv6_half_of_a_flannel_vxlan_lease_is_routed_and_a_bad_one_leaves_ipv4() {
        let good = r#"{"PublicIP":"192.0.2.3","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"02:00:00:00:00:03"},"BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:06:03"}}"#;
        let p = Peer::from_lease(&dual_lease(good)).unwrap();
        let v6 = p.ipv6.expect("an IPv6 half");
        assert_eq!(v6.subnet, "fd00:10:244:3::/64".parse().unwrap());
        assert_eq!(v6.public_ip, "2001:db8::3".parse::<Ipv6Addr>().unwrap());
        assert_eq!(v6.vtep_mac, MacAddr([2, 0, 0, 0, 6, 3]));
        // No half in the key: no IPv6 route, whatever the value says.
        assert_eq!(Peer6::from_lease(&lease(good)), Ok(None));
        // Halves that cannot be carried; the IPv4 route stands.
        for (json, why) in [
            (r#"{"PublicIP":"192.0.2.3","PublicIPv6":null}"#, Peer6Error::NoPublicIpv6),
            (r#"{"PublicIP":"192.0.2.3","PublicIPv6":"::"}"#, Peer6Error::NoPublicIpv6),
            (
                r#"{"PublicIP":"192.0.2.3","PublicIPv6":"ff02::1","BackendType":"vxlan","BackendData":{"VtepMAC":"02:00:00:00:00:03"}}"#,
                Peer6Error::NoPublicIpv6,
            ),
            (r#"{"PublicIP":"192.0.2.3","PublicIPv6":"2001:db8::3"}"#, Peer6Error::NotVxlan),
            (
                r#"{"PublicIP":"192.0.2.3","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendData":{"VtepMAC":"02:00:00:00:00:03"}}"#,
                Peer6Error::MissingBackendData,
            ),
            (
                r#"{"PublicIP":"192.0.2.3","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendData":{"VtepMAC":"02:00:00:00:00:03"},"BackendV6Data":{"VtepMAC":"zz"}}"#,
                Peer6Error::BadVtepMac,
            ),
            (
                r#"{"PublicIP":"192.0.2.3","PublicIPv6":"2001:db8::3","BackendType":"vxlan","BackendData":{"VtepMAC":"02:00:00:00:00:03"},"BackendV6Data":{"VNI":1}}"#,
                Peer6Error::BadVtepMac,
            ),
        ] {
            let l = dual_lease(json);
            assert_eq!(Peer6::from_lease(&l), Err(why), "{json}");
            assert_eq!(Peer::from_lease(&l).unwrap().ipv6, None, "{json}");
        }
    }

    /// flannel's wireguard lease on a dual-stack network (`newSubnetAttrs`: one key, the IPv4
    /// half at `ListenPort`, the IPv6 half at `ListenPortV6`), and on an IPv6-only one.
    #[test]
    fn both_halves_of_a_flannel_wireguard_lease_are_routed() {
        const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
        let key = WgPublicKey::parse(KEY).unwrap();
        let with = |v4: &str, v6: &str| {
            format!(
                r#"{{"PublicIP":"{v4}","PublicIPv6":"2001:db8::3","BackendType":"wireguard"{}{v6}}}"#,
                if v4 == "0.0.0.0" {
                    String::new()
                } else {
                    format!(r#","BackendData":{{"PublicKey":"{KEY}","Port":51820}}"#)
                }
            )
        };
        let v6_data = |port: &str| format!(r#","BackendV6Data":{{"PublicKey":"{KEY}"{port}}}"#);
        let dual = with("192.0.2.3", &v6_data(r#","Port":51821"#));
        let p = Peer::from_lease(&dual_lease(&dual)).unwrap();
        assert_eq!(p.backend, PeerBackend::Wireguard { key, port: Some(51820) });
        assert_eq!(p.public_ip, ip("192.0.2.3"));
        let v6 = p.ipv6.expect("an IPv6 half");
        assert_eq!(v6.subnet, "fd00:10:244:3::/64".parse().unwrap());
        assert_eq!(v6.public_ip, "2001:db8::3".parse::<Ipv6Addr>().unwrap());
        assert_eq!(v6.wireguard, Some(Wireguard6 { key, port: Some(51821) }));
        // A port of 0, null or none: the receiver's own ListenPortV6.
        for port in [r#","Port":0"#, r#","Port":null"#, ""] {
            let json = with("192.0.2.3", &v6_data(port));
            let v6 = Peer::from_lease(&dual_lease(&json)).unwrap().ipv6.unwrap();
            assert_eq!(v6.wireguard, Some(Wireguard6 { key, port: None }), "{json}");
        }
        // IPv6-only (`0.0.0.0-0&…`): PublicIP 0.0.0.0, BackendV6Data alone.
        let half: Ipv6Subnet = "fd00:10:244:3::/64".parse().unwrap();
        let only = |v6: &str| StoredLease {
            subnet: Subnet::from(half),
            ipv6: Some(half),
            ..lease(&with("0.0.0.0", v6))
        };
        let p = Peer::from_lease(&only(&v6_data(r#","Port":51821"#))).unwrap();
        assert_eq!(p.backend, PeerBackend::Wireguard { key, port: Some(51821) });
        assert_eq!(p.ipv6.unwrap().wireguard, Some(Wireguard6 { key, port: Some(51821) }));
        // A half that cannot be carried leaves the IPv4 route; an IPv6-only lease has none.
        for (bad, why) in [
            ("", Peer6Error::MissingBackendData),
            (r#","BackendV6Data":null"#, Peer6Error::MissingBackendData),
            (r#","BackendV6Data":{"PublicKey":"nope","Port":51821}"#, Peer6Error::BadWireguard),
            (&*v6_data(r#","Port":70000"#), Peer6Error::BadWireguard),
        ] {
            let l = dual_lease(&with("192.0.2.3", bad));
            assert_eq!(Peer6::from_lease(&l), Err(why), "{bad}");
            let p = Peer::from_lease(&l).unwrap();
            assert_eq!(
                (p.backend, p.ipv6),
                (PeerBackend::Wireguard { key, port: Some(51820) }, None)
            );
            assert_eq!(Peer::from_lease(&only(bad)), Err(PeerError::Ipv6Only(why)), "{bad}");
        }
    }

    #[test]
    fn ipv6_lookups_take_the_longest_half_and_miss_outside_every_half() {
        let half = |s: &str, host: u8| -> Peer {
            let mut p = peer(&format!("10.244.{host}.0/24"), [192, 0, 2, host]);
            p.ipv6 = Some(Peer6 {
                subnet: s.parse().unwrap(),
                public_ip: format!("2001:db8::{host}").parse().unwrap(),
                vtep_mac: MacAddr([2, 0, 0, 0, 6, host]),
                wireguard: None,
            });
            p
        };
        let peers = [
            half("fd00:10:244:1::/64", 1),
            half("fd00:10:244:2::/64", 2),
            // A longer half inside another's: it wins for its own addresses.
            half("fd00:10:244:2:8000::/65", 3),
            half("fd00:99::/32", 4),
            peer("10.244.5.0/24", [192, 0, 2, 5]),
        ];
        let t = RouteTable::build(net("10.244.0.0/16"), 24, peers);
        let host_of =
            |dst: &str| t.lookup6(dst.parse().unwrap()).map(|(p, _)| p.public_ip.octets()[3]);
        assert_eq!(host_of("fd00:10:244:1::7"), Some(1));
        assert_eq!(host_of("fd00:10:244:2::7"), Some(2));
        assert_eq!(host_of("fd00:10:244:2:8000::7"), Some(3));
        assert_eq!(host_of("fd00:10:244:2:ffff:ffff:ffff:ffff"), Some(3));
        assert_eq!(host_of("fd00:99:1::1"), Some(4));
        assert_eq!(host_of("fd00:10:244:3::1"), None);
        assert_eq!(host_of("::"), None);
        assert_eq!(host_of("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), None);
        let (p, v6) = t.lookup6("fd00:10:244:1::7".parse().unwrap()).unwrap();
        assert_eq!((p.subnet, v6.vtep_mac), (subnet("10.244.1.0/24"), MacAddr([2, 0, 0, 0, 6, 1])));
        // IPv4 lookups are unchanged, and the IPv4-only peer has no IPv6 route.
        assert_eq!(t.lookup(ip("10.244.5.9")).map(|p| p.public_ip), Some(ip("192.0.2.5")));
        assert!(t.is_known_peer6("2001:db8::3".parse().unwrap()));
        assert!(!t.is_known_peer6("2001:db8::5".parse().unwrap()));
        assert!(!t.is_known_peer6("192.0.2.1".parse::<Ipv4Addr>().unwrap().to_ipv6_mapped()));
        // An empty table, and one without IPv6 halves, find nothing.
        let t =
            RouteTable::build(net("10.244.0.0/16"), 24, [peer("10.244.1.0/24", [192, 0, 2, 1])]);
        assert!(t.lookup6("fd00::1".parse().unwrap()).is_none());
    }

    #[test]
    fn from_lease_refuses_unusable_vxlan() {
        let cases = [
            (r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan"}"#, PeerError::MissingBackendData),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":[1]}"#,
                PeerError::MissingBackendData,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VNI":1}}"#,
                PeerError::MissingVtepMac,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":null}}"#,
                PeerError::MissingVtepMac,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":"zz:d2:32:6f:8f:44"}}"#,
                PeerError::BadVtepMac,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":7}}"#,
                PeerError::BadVtepMac,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":"c6:d2:32:6f:8f:44","VNI":16777216}}"#,
                PeerError::BadVni,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":"c6:d2:32:6f:8f:44","VNI":"1"}}"#,
                PeerError::BadVni,
            ),
            (
                r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"VtepMAC":"c6:d2:32:6f:8f:44","VNI":-1}}"#,
                PeerError::BadVni,
            ),
            (r#"{"PublicIP":"0.0.0.0"}"#, PeerError::BadPublicIp(Ipv4Addr::UNSPECIFIED)),
            (r#"{"PublicIP":"224.0.0.1"}"#, PeerError::BadPublicIp(ip("224.0.0.1"))),
        ];
        for (json, want) in cases {
            assert_eq!(Peer::from_lease(&lease(json)), Err(want), "{json}");
        }
    }

    #[test]
    fn from_lease_matches_backend_data_fields_like_go() {
        let p = Peer::from_lease(&lease(
            r#"{"PublicIP":"192.0.2.1","BackendType":"vxlan","BackendData":{"vni":4096,"vtepmac":"C6-D2-32-6F-8F-44"}}"#,
        ))
        .unwrap();
        assert_eq!(p.vni, Some(4096));
        assert_eq!(p.vtep_mac, Some(MacAddr([0xc6, 0xd2, 0x32, 0x6f, 0x8f, 0x44])));
    }

    #[test]
    fn lookup_uses_slots_and_longest_prefix() {
        let t = RouteTable::build(
            net("10.244.0.0/16"),
            24,
            [
                peer("10.244.1.0/24", [192, 0, 2, 1]),
                peer("10.244.2.0/24", [192, 0, 2, 2]),
                // A hand-written reservation inside another host's subnet: more specific.
                peer("10.244.2.128/25", [192, 0, 2, 3]),
                // A short reservation covering part of the network: less specific.
                peer("10.244.0.0/20", [192, 0, 2, 4]),
                // Outside the network.
                peer("10.1.0.0/24", [192, 0, 2, 5]),
            ],
        );
        assert!(t.is_dense());
        assert_eq!(t.len(), 5);
        let at = |s: &str| t.lookup(ip(s)).map(|p| p.public_ip.octets()[3]);
        assert_eq!(at("10.244.1.7"), Some(1));
        assert_eq!(at("10.244.2.7"), Some(2));
        assert_eq!(at("10.244.2.200"), Some(3));
        assert_eq!(at("10.244.3.1"), Some(4));
        assert_eq!(at("10.244.15.255"), Some(4));
        assert_eq!(at("10.244.16.0"), None);
        assert_eq!(at("10.1.0.9"), Some(5));
        assert_eq!(at("10.245.1.7"), None);
        assert_eq!(at("0.0.0.0"), None);
        assert_eq!(at("255.255.255.255"), None);
        assert!(t.is_known_peer(ip("192.0.2.3")));
        assert!(!t.is_known_peer(ip("192.0.2.9")));
    }

    #[test]
    fn later_peer_with_same_subnet_wins() {
        let t = RouteTable::build(
            net("10.244.0.0/16"),
            24,
            [peer("10.244.1.0/24", [192, 0, 2, 1]), peer("10.244.1.0/24", [192, 0, 2, 2])],
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t.lookup(ip("10.244.1.1")).unwrap().public_ip, ip("192.0.2.2"));
        assert!(!t.is_known_peer(ip("192.0.2.1")));
    }

    #[test]
    fn empty_and_degenerate_tables() {
        let t = RouteTable::build(net("10.244.0.0/16"), 24, []);
        assert!(t.is_empty());
        assert_eq!(t.lookup(ip("10.244.1.1")), None);
        // A subnet length shorter than the network: no slots, still correct.
        let t = RouteTable::build(net("10.244.0.0/16"), 8, [peer("10.0.0.0/8", [192, 0, 2, 1])]);
        assert!(!t.is_dense());
        assert!(t.lookup(ip("10.9.9.9")).is_some());
        // /0 network with /32 subnets: far too many slots for one peer.
        let t = RouteTable::build(net("0.0.0.0/0"), 32, [peer("1.2.3.4/32", [192, 0, 2, 1])]);
        assert!(!t.is_dense());
        assert!(t.lookup(ip("1.2.3.4")).is_some());
        assert!(t.lookup(ip("1.2.3.5")).is_none());
        // /0 route and /0 subnet length.
        let t = RouteTable::build(net("0.0.0.0/0"), 0, [peer("0.0.0.0/0", [192, 0, 2, 1])]);
        assert!(t.is_dense());
        assert!(t.lookup(ip("255.255.255.255")).is_some());
        // The network's host bits are ignored.
        let t = RouteTable::build(net("10.244.7.7/16"), 24, [peer("10.244.1.0/24", [1, 1, 1, 1])]);
        assert!(t.is_dense());
        assert!(t.lookup(ip("10.244.1.1")).is_some());
    }

    /// The reference: the longest prefix by a linear scan, the later peer winning a duplicate.
    fn naive(peers: &[Peer], dst: Ipv4Addr) -> Option<&Peer> {
        let mut best: Option<&Peer> = None;
        for p in peers {
            if p.subnet.contains(dst)
                && best.is_none_or(|b| p.subnet.prefix_len() >= b.subnet.prefix_len())
            {
                best = Some(p);
            }
        }
        best
    }

    fn arb_subnet(base: u32, net_len: u8, subnet_len: u8) -> impl Strategy<Value = Subnet> {
        let in_net = (any::<u32>(), -3i8..=3).prop_map(move |(x, d)| {
            let len = (i16::from(subnet_len) + i16::from(d)).clamp(i16::from(net_len), 32) as u8;
            let addr = (base | (x & !mask_of(net_len))) & mask_of(len);
            Subnet::from_parts(Ipv4Addr::from(addr), len).unwrap()
        });
        let exact = any::<u32>().prop_map(move |x| {
            let addr = (base | (x & !mask_of(net_len))) & mask_of(subnet_len);
            Subnet::from_parts(Ipv4Addr::from(addr), subnet_len).unwrap()
        });
        let anywhere = (any::<u32>(), 0u8..=32).prop_map(|(x, len)| {
            Subnet::from_parts(Ipv4Addr::from(x & mask_of(len)), len).unwrap()
        });
        prop_oneof![6 => exact, 2 => in_net, 1 => anywhere]
    }

    fn arb_case() -> impl Strategy<Value = (Ipv4Net, u8, Vec<Peer>, Vec<u32>)> {
        // Mostly slot arrays; sometimes networks too sparse for one (all peers in levels).
        (any::<u32>(), 0u8..=30, prop_oneof![4 => 0u8..=12, 1 => 13u8..=26])
            .prop_flat_map(|(addr, net_len, extra)| {
                let subnet_len = (net_len + extra).min(32);
                let base = addr & mask_of(net_len);
                let network = Ipv4Net::new(Ipv4Addr::from(addr), net_len).unwrap();
                let peers = prop::collection::vec(
                    (arb_subnet(base, net_len, subnet_len), any::<u8>(), any::<bool>()),
                    0..60,
                )
                .prop_map(|v| {
                    v.into_iter()
                        .map(|(subnet, host, stale)| Peer {
                            subnet,
                            public_ip: Ipv4Addr::new(192, 0, 2, host),
                            backend: PeerBackend::Udp,
                            vtep_mac: None,
                            vni: None,
                            node: None,
                            stale,
                            incarnation: None,
                            ipv6: None,
                        })
                        .collect::<Vec<_>>()
                });
                let extra_addrs = prop::collection::vec(any::<u32>(), 0..40);
                (Just(network), Just(subnet_len), peers, extra_addrs)
            })
            .boxed()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// wireguard-go's allowedips_rand_test: the table agrees with a linear scan everywhere
        /// that matters (inside, at the edges of and next to every peer's subnet, and at random).
        #[test]
        fn lookup_matches_linear_scan((network, subnet_len, peers, extra) in arb_case()) {
            let table = RouteTable::build(network, subnet_len, peers.clone());
            let mut probes: Vec<u32> = extra;
            let base = u32::from(network.network());
            probes.extend([base, base | !mask_of(network.prefix_len()), base.wrapping_sub(1)]);
            probes.push(base.wrapping_add(!mask_of(network.prefix_len())).wrapping_add(1));
            for p in &peers {
                let lo = u32::from(p.subnet.v4().unwrap().network());
                let hi = lo | !mask_of(p.subnet.prefix_len());
                probes.extend([lo, hi, lo.wrapping_sub(1), hi.wrapping_add(1), lo + (hi - lo) / 2]);
            }
            for d in probes {
                let dst = Ipv4Addr::from(d);
                prop_assert_eq!(table.lookup(dst), naive(&peers, dst), "dst {}", dst);
            }
            // One route per subnet, the later peer winning; its public IP, and only those, known.
            let latest: BTreeMap<Subnet, &Peer> = peers.iter().map(|p| (p.subnet, p)).collect();
            let want: Vec<&Peer> = latest.values().copied().collect();
            let have: Vec<&Peer> = table.peers().iter().collect();
            prop_assert_eq!(have, want);
            for p in &peers {
                let known = latest.values().any(|q| q.public_ip == p.public_ip);
                prop_assert_eq!(table.is_known_peer(p.public_ip), known);
            }
        }
    }

    fn big_table(routes: u32) -> RouteTable {
        // 65,536 /24s fill a /8.
        let peers = (0..routes).map(|i| Peer {
            subnet: Subnet::from_parts(Ipv4Addr::from(0x0a00_0000 | (i << 8)), 24).unwrap(),
            public_ip: Ipv4Addr::from(0xc000_0000 | i),
            backend: PeerBackend::Vxlan,
            vtep_mac: Some(MacAddr([2, 0, 0, 0, (i >> 8) as u8, i as u8])),
            vni: Some(1),
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        });
        RouteTable::build(net("10.0.0.0/8"), 24, peers)
    }

    #[test]
    fn full_network_of_65536_routes() {
        let t = big_table(65_536);
        assert!(t.is_dense());
        assert_eq!(t.len(), 65_536);
        for i in (0..65_536u32).step_by(977) {
            let p = t.lookup(Ipv4Addr::from(0x0a00_0000 | (i << 8) | 9)).unwrap();
            assert_eq!(p.public_ip, Ipv4Addr::from(0xc000_0000 | i));
        }
    }
}
