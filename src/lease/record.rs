//! Lease records as they sit in the store: subnet keys, flannel's `LeaseAttrs` value, revisions,
//! node identity and weft's allocation history.
//!
//! Contract: everything here is pure parsing and formatting. Parsers take bytes from the store
//! (untrusted: another tool, an operator or an older weft may have written them) and return a
//! typed error naming the problem; they never panic.

#![forbid(unsafe_code)]

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

/// A lease's identity: the subnet of the cluster network it leases, always held by its network
/// address. On an IPv4-only or dual-stack network it is the IPv4 subnet (`10.244.3.0/24`; a
/// dual-stack lease's IPv6 half goes with it, [`LeaseName`]); on an IPv6-only network
/// (`"EnableIPv4": false`) it is the IPv6 subnet (`fd00:10:244:3::/64`). History records,
/// departure markers and routes are named by it.
///
/// In the store it is spelled as flannel spells a key naming it alone: `10.244.3.0-24`, and
/// for an IPv6 subnet flannel's IPv6-only form `0.0.0.0-0&fd00:10:244:3::-64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subnet(Family);

/// The two kinds of [`Subnet`]; private so that every value holds its network address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Family {
    V4(Ipv4Net),
    V6(Ipv6Subnet),
}

/// The IPv4 part of flannel's IPv6-only key form, `0.0.0.0-0&<v6>-<len>`.
const NO_IPV4: &str = "0.0.0.0-0";

/// Why a subnet key or subnet text did not parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubnetError {
    /// Not of the form `a.b.c.d-len` (or `a.b.c.d/len`).
    #[error("not a subnet (expected a.b.c.d-len)")]
    Malformed,
    /// The address has host bits set for its prefix length.
    #[error("address is not the network address of its prefix")]
    NotNetworkAddress,
}

/// Why a well-formed subnet key is not a lease of the configured network: such a key is
/// ignored. It never makes another subnet look occupied, never becomes a route and never widens
/// receive validation (a stray `0.0.0.0-0` would otherwise cover every subnet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ForeignSubnet {
    /// Not inside the network (or wider than it).
    #[error("{subnet} is not inside the network {network}")]
    OutsideNetwork {
        /// The key's subnet.
        subnet: Subnet,
        /// The configured network.
        network: IpNet,
    },
    /// Inside the network, but not of the configured `SubnetLen`.
    #[error("{subnet} is not a /{subnet_len} (the network's SubnetLen)")]
    WrongLength {
        /// The key's subnet.
        subnet: Subnet,
        /// The configured subnet length.
        subnet_len: u8,
    },
    /// A lease of the other family: an IPv6-only lease (`0.0.0.0-0&…`) on a network that leases
    /// IPv4 subnets, or an IPv4 one on an IPv6-only network.
    #[error("{subnet} is not a lease of the {family} network {network}")]
    OtherFamily {
        /// The key's subnet.
        subnet: Subnet,
        /// The configured network.
        network: IpNet,
        /// Which family the network leases: "IPv4" or "IPv6-only".
        family: &'static str,
    },
}

impl Subnet {
    /// A subnet from a network; the address must be the network address.
    pub(crate) fn new(net: Ipv4Net) -> Result<Self, SubnetError> {
        if net.addr() != net.network() {
            return Err(SubnetError::NotNetworkAddress);
        }
        Ok(Self(Family::V4(net)))
    }

    /// An IPv4 subnet from an address and prefix length; the address must be the network
    /// address.
    pub fn from_parts(addr: Ipv4Addr, prefix_len: u8) -> Result<Self, SubnetError> {
        let net = Ipv4Net::new(addr, prefix_len).map_err(|_| SubnetError::Malformed)?;
        Self::new(net)
    }

    /// The subnet as an [`IpNet`].
    pub fn net(self) -> IpNet {
        match self.0 {
            Family::V4(net) => IpNet::V4(net),
            Family::V6(half) => IpNet::V6(half.net()),
        }
    }

    /// The IPv4 subnet, unless this is an IPv6-only lease.
    pub fn v4(self) -> Option<Ipv4Net> {
        match self.0 {
            Family::V4(net) => Some(net),
            Family::V6(_) => None,
        }
    }

    /// The IPv6 subnet of an IPv6-only lease (`None` for an IPv4 subnet, whose IPv6 half, on a
    /// dual-stack network, is in its [`LeaseName`]).
    pub fn v6(self) -> Option<Ipv6Subnet> {
        match self.0 {
            Family::V4(_) => None,
            Family::V6(half) => Some(half),
        }
    }

    /// The network address (`10.244.3.0`): the TUN address and the store key's address.
    pub fn network(self) -> IpAddr {
        self.net().network()
    }

    /// The prefix length.
    pub fn prefix_len(self) -> u8 {
        self.net().prefix_len()
    }

    /// The first host address (`10.244.3.1`), which flannel writes to `FLANNEL_SUBNET` (or
    /// `FLANNEL_IPV6_SUBNET`).
    pub fn first_host(self) -> IpAddr {
        match self.0 {
            Family::V4(net) => IpAddr::V4(Ipv4Addr::from(u32::from(net.network()).wrapping_add(1))),
            Family::V6(half) => IpAddr::V6(half.first_host()),
        }
    }

    /// Whether `addr` lies inside this subnet (never, for an address of the other family).
    pub fn contains(self, addr: impl Into<IpAddr>) -> bool {
        self.net().contains(&addr.into())
    }

    /// The name of a key under `subnets/` that names this subnet alone: `10.244.3.0-24`, or
    /// flannel's IPv6-only form `0.0.0.0-0&fd00:10:244:3::-64`. History records and departure
    /// markers are named by it too.
    pub fn key_name(self) -> String {
        match self.0 {
            Family::V4(net) => format!("{}-{}", net.network(), net.prefix_len()),
            Family::V6(half) => format!("{NO_IPV4}&{}", half.key_name()),
        }
    }

    /// Parses a store key's last path element: `10.244.3.0-24`, flannel's dual-stack form
    /// `10.244.3.0-24&fd00:10:244:3::-64`, whose IPv4 half this returns (the IPv6 half must be
    /// well-formed too; [`LeaseName::parse`] returns both), or flannel's IPv6-only form
    /// `0.0.0.0-0&<v6>-<len>`, an IPv6 subnet.
    pub fn parse_key_name(name: &str) -> Result<Self, SubnetError> {
        LeaseName::parse(name).map(|n| n.subnet)
    }

    /// Whether this subnet is a lease of `network` split into `/subnet_len`s: of its family,
    /// inside it and of exactly that length. Anything else under `subnets/` is ignored
    /// ([`ForeignSubnet`]).
    pub fn check_lease_of(self, network: IpNet, subnet_len: u8) -> Result<(), ForeignSubnet> {
        let net = self.net();
        let same_family =
            matches!((net, network), (IpNet::V4(_), IpNet::V4(_)) | (IpNet::V6(_), IpNet::V6(_)));
        if !same_family {
            let family = if network.addr().is_ipv4() { "IPv4" } else { "IPv6-only" };
            return Err(ForeignSubnet::OtherFamily { subnet: self, network, family });
        }
        if !network.contains(&net) {
            return Err(ForeignSubnet::OutsideNetwork { subnet: self, network });
        }
        if self.prefix_len() != subnet_len {
            return Err(ForeignSubnet::WrongLength { subnet: self, subnet_len });
        }
        Ok(())
    }

    fn parse_parts(addr: &str, len: &str) -> Result<Self, SubnetError> {
        let addr: Ipv4Addr = addr.parse().map_err(|_| SubnetError::Malformed)?;
        Self::from_parts(addr, canonical_prefix_len(len, 32)?)
    }
}

impl From<Ipv6Subnet> for Subnet {
    /// An IPv6-only lease's subnet.
    fn from(half: Ipv6Subnet) -> Self {
        Self(Family::V6(half))
    }
}

/// A prefix length in canonical digits only ("24", not "024" or "+24"), so that a key names
/// exactly one subnet; at most `max`.
fn canonical_prefix_len(len: &str, max: u8) -> Result<u8, SubnetError> {
    if len.is_empty()
        || len.len() > 3
        || (len.len() > 1 && len.starts_with('0'))
        || !len.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(SubnetError::Malformed);
    }
    len.parse::<u8>().ok().filter(|l| *l <= max).ok_or(SubnetError::Malformed)
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix_len())
    }
}

impl FromStr for Subnet {
    type Err = SubnetError;

    /// Accepts `10.244.3.0/24`, `fd00:10:244:3::/64` (an IPv6-only lease's subnet) and the key
    /// forms `10.244.3.0-24` and `0.0.0.0-0&fd00:10:244:3::-64`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.rsplit_once('/') {
            Some((addr, _)) if addr.contains(':') => s.parse::<Ipv6Subnet>().map(Self::from),
            Some((addr, len)) => Self::parse_parts(addr, len),
            None => Self::parse_key_name(s),
        }
    }
}

/// The IPv6 half of a dual-stack lease, always held by its network address
/// (`fd00:10:244:3::/64`). In a store key it is spelled as flannel spells it:
/// `fd00:10:244:3::-64` (lower-case, compressed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv6Subnet(Ipv6Net);

impl Ipv6Subnet {
    /// A subnet from a network; the address must be the network address.
    pub fn new(net: Ipv6Net) -> Result<Self, SubnetError> {
        if net.addr() != net.network() {
            return Err(SubnetError::NotNetworkAddress);
        }
        Ok(Self(net))
    }

    /// The subnet as an [`Ipv6Net`].
    pub fn net(self) -> Ipv6Net {
        self.0
    }

    /// The network address: the TUN's IPv6 address and the key's address.
    pub fn network(self) -> Ipv6Addr {
        self.0.network()
    }

    /// The prefix length.
    pub fn prefix_len(self) -> u8 {
        self.0.prefix_len()
    }

    /// The first host address (`fd00:10:244:3::1`), which flannel writes to
    /// `FLANNEL_IPV6_SUBNET`.
    pub fn first_host(self) -> Ipv6Addr {
        Ipv6Addr::from(u128::from(self.network()).wrapping_add(1))
    }

    /// The key-name form: `fd00:10:244:3::-64`.
    pub fn key_name(self) -> String {
        format!("{}-{}", self.network(), self.prefix_len())
    }

    /// Parses the key-name form `fd00:10:244:3::-64`.
    fn parse_key_name(name: &str) -> Result<Self, SubnetError> {
        let (addr, len) = name.rsplit_once('-').ok_or(SubnetError::Malformed)?;
        let addr: Ipv6Addr = addr.parse().map_err(|_| SubnetError::Malformed)?;
        let len = canonical_prefix_len(len, 128)?;
        Self::new(Ipv6Net::new(addr, len).map_err(|_| SubnetError::Malformed)?)
    }
}

impl fmt::Display for Ipv6Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix_len())
    }
}

impl FromStr for Ipv6Subnet {
    type Err = SubnetError;

    /// Accepts `fd00::/64` and the key form `fd00::-64`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.rsplit_once('/') {
            Some((addr, len)) => {
                let addr: Ipv6Addr = addr.parse().map_err(|_| SubnetError::Malformed)?;
                let len = canonical_prefix_len(len, 128)?;
                Self::new(Ipv6Net::new(addr, len).map_err(|_| SubnetError::Malformed)?)
            }
            None => Self::parse_key_name(s),
        }
    }
}

impl Serialize for Ipv6Subnet {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        ser.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv6Subnet {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        let text = String::deserialize(de)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Everything a key under `subnets/` names: the lease's [`Subnet`], which is its identity in
/// weft (it names the history record, the departure marker and the route), and its IPv6 half.
///
/// - IPv4-only: `10.244.3.0-24`, no half.
/// - Dual stack: `10.244.3.0-24&fd00:10:244:3::-64`. The two halves are one lease: created,
///   renewed and deleted together under one key, whose exact name every write must use (a
///   flannel node may have written `X&Y` where an IPv4-only node would write `X`).
/// - IPv6-only: `0.0.0.0-0&fd00:10:244:3::-64`; the subnet is the IPv6 one, and `ipv6` is that
///   same subnet, so that whatever carries IPv6 reads the half from one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseName {
    /// The lease's identity.
    pub subnet: Subnet,
    /// The IPv6 subnet the lease carries: the half of a dual-stack lease, or an IPv6-only
    /// lease's subnet.
    pub ipv6: Option<Ipv6Subnet>,
}

impl LeaseName {
    /// The name of a lease of one subnet alone: an IPv4-only lease, or an IPv6-only one.
    pub fn single(subnet: Subnet) -> Self {
        Self { subnet, ipv6: subnet.v6() }
    }

    /// The store key's last path element: `10.244.3.0-24`, `10.244.3.0-24&fd00::-64` or
    /// `0.0.0.0-0&fd00::-64`.
    pub fn key_name(self) -> String {
        match (self.subnet.v4(), self.ipv6) {
            (Some(_), Some(v6)) => format!("{}&{}", self.subnet.key_name(), v6.key_name()),
            _ => self.subnet.key_name(),
        }
    }

    /// Parses a store key's last path element in any of the three forms.
    pub fn parse(name: &str) -> Result<Self, SubnetError> {
        let (v4, ipv6) = match name.split_once('&') {
            None => (name, None),
            Some((v4, v6)) => {
                let v6 = Ipv6Subnet::parse_key_name(v6)?;
                if v4 == NO_IPV4 {
                    return Ok(Self::single(Subnet::from(v6)));
                }
                (v4, Some(v6))
            }
        };
        let (addr, len) = v4.rsplit_once('-').ok_or(SubnetError::Malformed)?;
        Ok(Self { subnet: Subnet::parse_parts(addr, len)?, ipv6 })
    }
}

impl fmt::Display for LeaseName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.subnet.v4(), self.ipv6) {
            (Some(_), Some(v6)) => write!(f, "{} & {v6}", self.subnet),
            _ => write!(f, "{}", self.subnet),
        }
    }
}

/// An etcd revision: the cluster's own logical clock. weft orders events by revisions, never by
/// hosts' wall clocks, which skew.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Revision(pub i64);

/// An etcd lease ID (the TTL handle a key is attached to). `0` means "no lease": a key that
/// never expires, which flannel calls a reservation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StoreLeaseId(pub i64);

/// A node's persistent identity, generated once and kept in `--state-dir`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct NodeId(String);

/// One process start of a node: random per start, written into the lease value so that a write by
/// this node's identity but not by this process is visible (a clone, or a second daemon).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Incarnation(String);

/// Why a node ID or incarnation text was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected 8 to 64 characters of [0-9a-z-]")]
pub struct IdError;

fn check_id(s: &str) -> Result<(), IdError> {
    let ok = (8..=64).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-');
    if ok { Ok(()) } else { Err(IdError) }
}

fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl NodeId {
    /// A fresh random node ID (128 bits, hex).
    pub fn generate() -> Self {
        Self(random_hex(16))
    }

    /// A node ID from text (the state dir file, or a test's chosen name).
    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_id(s)?;
        Ok(Self(s.to_owned()))
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Incarnation {
    /// A fresh random incarnation (64 bits, hex).
    pub fn generate() -> Self {
        Self(random_hex(8))
    }

    /// An incarnation from text.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        check_id(s)?;
        Ok(Self(s.to_owned()))
    }

    /// The incarnation as text.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for NodeId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        check_id(&s)?;
        Ok(Self(s))
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> Self {
        id.0
    }
}

impl TryFrom<String> for Incarnation {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        check_id(&s)?;
        Ok(Self(s))
    }
}

impl From<Incarnation> for String {
    fn from(id: Incarnation) -> Self {
        id.0
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// flannel's `LeaseAttrs`: the JSON value of a subnet key.
///
/// Field names and shapes are flannel's, so flannel reads weft's leases and weft reads flannel's.
/// weft adds `WeftNodeID` and `WeftIncarnation` (flannel ignores unknown fields). A lease
/// without them was written by flannel or by hand and belongs to no weft node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseAttrs {
    /// The holder's underlay address; flannel always writes it.
    #[serde(rename = "PublicIP")]
    pub public_ip: Ipv4Addr,
    /// flannel writes `null` on IPv4-only nodes (no omitempty), so weft does too.
    #[serde(rename = "PublicIPv6", default)]
    pub public_ipv6: Option<Ipv6Addr>,
    /// `vxlan`; absent for flannel's udp backend.
    #[serde(rename = "BackendType", default, skip_serializing_if = "Option::is_none")]
    pub backend_type: Option<String>,
    /// Backend data, e.g. `{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}` for vxlan.
    #[serde(rename = "BackendData", default, skip_serializing_if = "Option::is_none")]
    pub backend_data: Option<serde_json::Value>,
    /// IPv6 backend data, on a dual-stack vxlan lease: `{"VNI":1,"VtepMAC":"…"}`, the MAC of
    /// the holder's IPv6 VTEP (flannel's `flannel-v6.<VNI>` device has its own).
    #[serde(rename = "BackendV6Data", default, skip_serializing_if = "Option::is_none")]
    pub backend_v6_data: Option<serde_json::Value>,
    /// The holder's node identity (weft only).
    #[serde(rename = "WeftNodeID", default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// The holder's process incarnation (weft only).
    #[serde(rename = "WeftIncarnation", default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<Incarnation>,
}

/// Why a stored value did not parse.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    /// Not JSON, or JSON of the wrong shape.
    #[error("value is not valid JSON for this key: {0}")]
    Json(#[from] serde_json::Error),
}

impl LeaseAttrs {
    /// Parses a subnet key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ValueError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The JSON written to the store.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing a struct of plain fields and a `Value` cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The holder's address for people to read (logs, hooks): [`shown_addr`].
    pub fn public_addr(&self) -> IpAddr {
        shown_addr(self.public_ip, self.public_ipv6)
    }

    /// Whether this value was written by `node` (any incarnation).
    pub(crate) fn is_node(&self, node: &NodeId) -> bool {
        self.node_id.as_ref() == Some(node)
    }

    /// Whether this value was written by exactly this process.
    pub(crate) fn is_incarnation(&self, node: &NodeId, incarnation: &Incarnation) -> bool {
        self.is_node(node) && self.incarnation.as_ref() == Some(incarnation)
    }
}

/// A node's address for people to read (logs, hooks, errors): its `PublicIP`, or on an
/// IPv6-only network, where `PublicIP` is `0.0.0.0`, its `PublicIPv6`.
pub(crate) fn shown_addr(public_ip: Ipv4Addr, public_ipv6: Option<Ipv6Addr>) -> IpAddr {
    match public_ipv6 {
        Some(v6) if public_ip.is_unspecified() => IpAddr::V6(v6),
        _ => IpAddr::V4(public_ip),
    }
}

/// A subnet key as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredLease {
    /// The subnet named by the key.
    pub subnet: Subnet,
    /// The key's IPv6 half, on a dual-stack lease.
    pub ipv6: Option<Ipv6Subnet>,
    /// The parsed value.
    pub attrs: LeaseAttrs,
    /// The key's create revision: when this key was created. Unlike the mod revision, no
    /// renewal or rewrite of the key moves it, so it orders keys by who came first (route
    /// watchers give a contested IPv6 half to the first, `route::set`).
    pub create_revision: Revision,
    /// The key's mod revision: renew and adopt compare on it.
    pub mod_revision: Revision,
    /// The etcd lease the key is attached to (`0`: none, a reservation).
    pub lease_id: StoreLeaseId,
}

impl StoredLease {
    /// The key's full name: both halves.
    pub fn name(&self) -> LeaseName {
        LeaseName { subnet: self.subnet, ipv6: self.ipv6 }
    }
}

/// What weft's allocation history says about one subnet (`<prefix>/weft/history/<key>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HistoryState {
    /// Last written by a holder's create or renew; if the subnet key is gone now, the lease
    /// expired (or was revoked) after `HistoryEntry::mod_revision`.
    Held,
    /// Released by a clean shutdown with `--relinquish-on-exit`.
    Relinquished,
    /// Deleted by an operator (`weft lease revoke`): peers unroute it; the allocation policy
    /// treats it like an expired subnet, and a holder that still runs reclaims it.
    Revoked,
}

/// The JSON value of a history key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryRecord {
    /// Held or relinquished.
    pub state: HistoryState,
    /// The node that last held the subnet.
    pub node: NodeId,
    /// That node's public IP at the time.
    pub public_ip: Ipv4Addr,
    /// The IPv6 half the subnet was leased with, on a dual-stack network: whoever takes the
    /// subnet next takes it with this half, so the halves move together. Absent from records
    /// of IPv4-only leases (and from every record an older weft wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Subnet>,
}

impl HistoryRecord {
    /// The record a create, renew or refresh writes for `attrs`: `Held` by its node. `None`
    /// for a lease without a node identity (a test's or a tool's): it has no history.
    pub(crate) fn held(attrs: &LeaseAttrs, ipv6: Option<Ipv6Subnet>) -> Option<Self> {
        let node = attrs.node_id.clone()?;
        Some(Self { state: HistoryState::Held, node, public_ip: attrs.public_ip, ipv6 })
    }

    /// Parses a history key's value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ValueError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// The JSON written to the store.
    pub fn to_json(&self) -> Vec<u8> {
        // Plain fields only: cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A history key as read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// The subnet the history is about.
    pub subnet: Subnet,
    /// The parsed record.
    pub record: HistoryRecord,
    /// When it was last written, in the cluster's logical time: the lower the older.
    pub mod_revision: Revision,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnet_key_round_trips() {
        let s: Subnet = "10.244.3.0/24".parse().unwrap();
        assert_eq!(s.key_name(), "10.244.3.0-24");
        assert_eq!(Subnet::parse_key_name("10.244.3.0-24").unwrap(), s);
        assert_eq!(s.first_host(), IpAddr::V4(Ipv4Addr::new(10, 244, 3, 1)));
        assert_eq!(s.to_string(), "10.244.3.0/24");
    }

    #[test]
    fn subnet_key_rejects_garbage() {
        assert_eq!(Subnet::parse_key_name("10.244.3.1-24"), Err(SubnetError::NotNetworkAddress));
        assert_eq!(Subnet::parse_key_name("10.244.3.0"), Err(SubnetError::Malformed));
        assert_eq!(Subnet::parse_key_name("10.244.3.0-"), Err(SubnetError::Malformed));
        assert_eq!(Subnet::parse_key_name("10.244.3.0-33"), Err(SubnetError::Malformed));
        assert_eq!(Subnet::parse_key_name("10.244.3.0-+4"), Err(SubnetError::Malformed));
        assert_eq!(Subnet::parse_key_name("10.0.0.0-08"), Err(SubnetError::Malformed));
        assert_eq!(Subnet::parse_key_name("x-24"), Err(SubnetError::Malformed));
        // flannel's dual-stack form is a lease of its IPv4 half; the IPv6-only form is a lease
        // of its IPv6 subnet.
        let sn = |t: &str| t.parse::<Subnet>().unwrap();
        assert_eq!(
            Subnet::parse_key_name("10.244.1.0-24&fc00:0:0:1::-64"),
            Ok(sn("10.244.1.0/24"))
        );
        assert_eq!(Subnet::parse_key_name("0.0.0.0-0&fc00:0:0:1::-64"), Ok(sn("fc00:0:0:1::/64")));
        for bad in [
            "10.244.1.0-24&",
            "10.244.1.0-24&fc00::",
            "10.244.1.0-24&fc00::-129",
            "10.244.1.0-24&fc00::1-64",
            "10.244.1.0-24&x-64",
            "10.244.1.0-24&fc00::-064",
            "0.0.0.0-0&fc00::1-64",
            "10.244.1.0-24&fc00::-64&fc01::-64",
        ] {
            assert!(Subnet::parse_key_name(bad).is_err(), "{bad}");
        }
        let net: IpNet = "10.244.0.0/16".parse().unwrap();
        assert_eq!(sn("10.244.1.0/24").check_lease_of(net, 24), Ok(()));
        for foreign in [
            "0.0.0.0/0",
            "10.244.1.7/32",
            "10.244.1.128/25",
            "10.0.0.0/8",
            "10.9.1.0/24",
            "fd00:10:244:1::/64",
        ] {
            assert!(sn(foreign).check_lease_of(net, 24).is_err(), "{foreign}");
        }
        // An IPv6-only network leases IPv6 subnets, and an IPv4 one is foreign to it.
        let net6: IpNet = "fd00:10:244::/56".parse().unwrap();
        assert_eq!(sn("fd00:10:244:1::/64").check_lease_of(net6, 64), Ok(()));
        assert!(matches!(
            sn("10.244.1.0/24").check_lease_of(net6, 24),
            Err(ForeignSubnet::OtherFamily { family: "IPv6-only", .. })
        ));
        assert!(sn("fd00:10:245:1::/64").check_lease_of(net6, 64).is_err());
        assert!(sn("fd00:10:244:1::/80").check_lease_of(net6, 64).is_err());
    }

    #[test]
    fn lease_names_carry_both_halves_in_flannels_spelling() {
        let dual = LeaseName::parse("10.244.1.0-24&fd00:10:244:1::-64").unwrap();
        assert_eq!(dual.subnet, "10.244.1.0/24".parse().unwrap());
        assert_eq!(dual.ipv6, Some("fd00:10:244:1::/64".parse().unwrap()));
        assert_eq!(dual.key_name(), "10.244.1.0-24&fd00:10:244:1::-64");
        assert_eq!(dual.to_string(), "10.244.1.0/24 & fd00:10:244:1::/64");
        let v4 = LeaseName::parse("10.244.1.0-24").unwrap();
        assert_eq!((v4.ipv6, v4.key_name()), (None, "10.244.1.0-24".to_string()));
        // Upper-case or uncompressed hex reads as the same half, and is written flannel's way.
        let loud = LeaseName::parse("10.244.1.0-24&FD00:10:244:1:0:0:0:0-64").unwrap();
        assert_eq!(loud, dual);
        assert_eq!(loud.key_name(), "10.244.1.0-24&fd00:10:244:1::-64");
        let half = dual.ipv6.unwrap();
        assert_eq!(half.first_host(), "fd00:10:244:1::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!("fd00:10:244:1::-64".parse::<Ipv6Subnet>(), Ok(half));
        assert_eq!(
            "fd00:10:244:1::1/64".parse::<Ipv6Subnet>(),
            Err(SubnetError::NotNetworkAddress)
        );
        // History records carry the half, and records without one (older wefts) still read.
        let json = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1","ipv6":"fd00:10:244:1::/64"}"#;
        assert_eq!(HistoryRecord::from_json(json).unwrap().ipv6, Some(half));
        let old = br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1"}"#;
        let old = HistoryRecord::from_json(old).unwrap();
        assert_eq!(old.ipv6, None);
        assert!(!String::from_utf8(old.to_json()).unwrap().contains("ipv6"));
        let bad =
            br#"{"state":"held","node":"node-aaaa","public_ip":"192.0.2.1","ipv6":"fd00::1/64"}"#;
        assert!(HistoryRecord::from_json(bad).is_err());
        // flannel's IPv6-only form: the subnet is the IPv6 one, and so is the half; it reads
        // back as itself, and the subnet alone names the same key.
        let only = LeaseName::parse("0.0.0.0-0&fd00:10:244:1::-64").unwrap();
        assert_eq!(only, LeaseName::single(Subnet::from(half)));
        assert_eq!((only.subnet.v4(), only.subnet.v6(), only.ipv6), (None, Some(half), Some(half)));
        assert_eq!(only.key_name(), "0.0.0.0-0&fd00:10:244:1::-64");
        assert_eq!(only.subnet.key_name(), only.key_name());
        assert_eq!(only.to_string(), "fd00:10:244:1::/64");
        assert_eq!(only.subnet.first_host(), IpAddr::V6(half.first_host()));
        assert!(only.subnet.contains("fd00:10:244:1::9".parse::<Ipv6Addr>().unwrap()));
        assert!(!only.subnet.contains(Ipv4Addr::new(0, 0, 0, 1)));
        // Only 0.0.0.0-0 spells "no IPv4 subnet"; another IPv4 part of length 0 is a /0 lease
        // (foreign to every network), and garbage on either side is no lease.
        assert_eq!(
            LeaseName::parse("0.0.0.0-0").map(|n| n.subnet.v4()),
            Ok(Some("0.0.0.0/0".parse().unwrap()))
        );
        for bad in
            ["garbage&fd00:10:244:1::-64", "0.0.0.0-0&fd00:10:244:1::1-64", "0.0.0.0-00&fd00::-64"]
        {
            assert!(LeaseName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lease_attrs_read_flannel_values() {
        let v = br#"{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#;
        let a = LeaseAttrs::from_json(v).unwrap();
        assert_eq!(a.public_ip, Ipv4Addr::new(192, 168, 64, 3));
        assert_eq!(a.backend_type.as_deref(), Some("vxlan"));
        assert!(a.node_id.is_none());
        // flannel's udp backend writes no BackendType.
        let u = LeaseAttrs::from_json(br#"{"PublicIP":"192.0.2.1","PublicIPv6":null}"#).unwrap();
        assert!(u.backend_type.is_none());
        assert!(LeaseAttrs::from_json(b"not json").is_err());
        assert!(LeaseAttrs::from_json(br#"{"PublicIP":"nope"}"#).is_err());
        // A weft field that is not a valid ID makes the value unreadable, never trusted.
        assert!(
            LeaseAttrs::from_json(br#"{"PublicIP":"192.0.2.1","WeftNodeID":"BAD ID"}"#).is_err()
        );
    }

    #[test]
    fn lease_attrs_write_flannel_shape() {
        let a = LeaseAttrs {
            public_ip: Ipv4Addr::new(192, 0, 2, 1),
            public_ipv6: None,
            backend_type: Some("vxlan".into()),
            backend_data: Some(serde_json::json!({"VNI":1,"VtepMAC":"02:00:00:00:00:01"})),
            backend_v6_data: None,
            node_id: Some(NodeId::parse("node-aaaa").unwrap()),
            incarnation: Some(Incarnation::parse("inc-0001").unwrap()),
        };
        let text = String::from_utf8(a.to_json()).unwrap();
        assert!(
            text.starts_with(r#"{"PublicIP":"192.0.2.1","PublicIPv6":null,"BackendType":"vxlan""#)
        );
        assert_eq!(LeaseAttrs::from_json(text.as_bytes()).unwrap(), a);
    }
}
