//! Subnets and lease names: what the cluster network is cut into, in flannel's spellings.
//!
//! Contract: pure parsing and formatting. Parsers take text from the store, a file or a flag
//! (untrusted) and return a typed error naming the problem; they never panic.

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
}
