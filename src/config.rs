//! The network config (`<prefix>/config`): flannel's JSON schema, parsed case-insensitively as
//! Go's encoding/json does, with flannel's defaults, and validated with errors that name the
//! field and the problem.
//!
//! Contract:
//! - [`NetworkConfig::parse`] accepts every IPv4, dual-stack and IPv6-only config flannel's
//!   `CheckNetworkConfig` accepts, with the same defaults, except for options weft does not
//!   implement. Those are refused with an error naming the option rather than silently ignored: a
//!   config that asks for a backend or an option weft lacks must not come up as something else.
//! - Backends: `vxlan` (with `DirectRouting`), `udp`, `host-gw` (IPv4), `ipip` (IPv4, with
//!   `DirectRouting`), `wireguard` ([`WireguardOptions`]; IPv6 in `Mode` `separate` only) and `alloc` (a lease and no
//!   data plane). host-gw and alloc take no options, and ipip only `DirectRouting`; each
//!   ignores every other field, as flannel's do.
//! - IPv6-only (`"EnableIPv4": false` with `"EnableIPv6": true`): [`NetworkConfig::ipv4`] is
//!   `None` and leases are IPv6 subnets. The backend must be vxlan or wireguard (`Mode`
//!   `separate`; flannel's udp backend carries no IPv6), and IPv4 fields are refused, as IPv6
//!   fields are without `EnableIPv6`.
//! - Dual stack: with `"EnableIPv6": true`, the IPv6 fields (`IPv6Network`, `IPv6SubnetLen`,
//!   `IPv6SubnetMin`, `IPv6SubnetMax`) are parsed and validated by flannel's rules into
//!   [`NetworkConfig::ipv6`]; without it, that is `None`.
//! - Field names match ASCII-case-insensitively (`"network"`, `"NETWORK"`), like Go's
//!   encoding/json. Unknown fields are ignored, as flannel ignores them. JSON `null` means "not
//!   given", and so do the zero values flannel treats as unset (`"SubnetLen": 0`,
//!   `"SubnetMin": "0.0.0.0"`, `"IPv6SubnetLen": 0`, `"IPv6SubnetMin": "::"`).
//! - The input is untrusted (anyone with etcd access writes it): parsing never panics, and every
//!   error names the field and the problem.
//! - A parsed config is valid: `network` has no host bits, `subnet_len` is in
//!   `network.prefix_len() + 2 ..= 30`, and `subnet_min <= subnet_max` are aligned subnet
//!   addresses inside `network`; the same holds for `ipv6` with lengths up to 126 (and an
//!   `IPv6Network` of at most /124). [`NetworkConfig::to_json`] writes it back in flannel's
//!   spelling, and that text parses to an equal config.
//!
//! Deliberate differences from flannel, all on inputs flannel handles oddly:
//! - IPv6 fields set without `"EnableIPv6": true` are refused, naming the field (flannel
//!   ignores them, and a cluster meant to be dual-stack silently comes up IPv4-only).
//! - An IPv6 field must hold IPv6 text: flannel reads `"10.0.0.1"` as `::ffff:10.0.0.1`, and an
//!   IPv4 CIDR as an IPv4-mapped network with the IPv4 prefix length.
//! - `SubnetMin > SubnetMax` is refused (flannel accepts it and then can lease nothing); so is
//!   `IPv6SubnetMin > IPv6SubnetMax`.
//! - An `IPv6Network` with host bits set (`"fd00::1/64"`) is refused with a suggestion (flannel's
//!   parser clears them silently).
//! - Two keys that differ only in case (`"Network"` and `"network"`) are refused, and so is one
//!   key given twice in one object (`"Network"` and `"Network"`), at any depth. Go keeps the
//!   one that comes last in the text, silently: a config edited by hand with a field added
//!   instead of changed would otherwise mean something its reader does not see.
//! - A `Backend` object with fields but no `Type` is refused (flannel fails later, asking for
//!   backend type `""`); only a missing, `null` or empty `Backend` means udp.
//! - `Backend.Port` and `Backend.VNI` of 0 are refused rather than meaning "kernel default".
//! - Matching is ASCII-only: Go also folds a few non-ASCII letters (`ſ`, the Kelvin sign).

#![forbid(unsafe_code)]

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde_json::{Map, Value};

use crate::vocab::{ForeignSubnet, Ipv6Subnet, LeaseName, Subnet, Vni, WgSecret};

/// flannel's vxlan port: the Linux kernel's legacy VXLAN port, from before IANA assigned 4789.
/// A peer on 4789 does not interoperate with a default flannel. This and the two below are the
/// only home of weft's port and VNI defaults: everything else takes them from the config.
pub(crate) const DEFAULT_VXLAN_PORT: u16 = 8472;

/// flannel's udp backend port.
pub(crate) const DEFAULT_UDP_PORT: u16 = 8285;

/// flannel's wireguard `ListenPort` default: WireGuard's customary port.
pub(crate) const DEFAULT_WIREGUARD_PORT: u16 = 51820;

/// flannel's wireguard `ListenPortV6` default.
pub(crate) const DEFAULT_WIREGUARD_PORT_V6: u16 = 51821;

/// What flannel's wireguard backend takes off the MTU (`overhead` in its
/// `wireguard_network.go`): the IPv6 underlay's worst case, outer IPv6 40 + UDP 8 + WireGuard's
/// header 16 and tag 16; the padding to 16 bytes fits in what an IPv4 underlay leaves over.
pub(crate) const WIREGUARD_OVERHEAD: u16 = 80;

/// flannel's `defaultVNI`.
pub(crate) const DEFAULT_VNI: u32 = 1;

/// The largest VXLAN network identifier: the field is 24 bits (RFC 7348 §5). The wire view's
/// bound is the one source.
pub(crate) const MAX_VNI: u32 = Vni::MAX;

/// The longest `SubnetLen` flannel allows: a host needs room for its gateway and at least one
/// more address.
pub(crate) const MAX_SUBNET_LEN: u8 = 30;

/// The longest `IPv6SubnetLen` flannel allows ("SubnetLen must be less than /127"): the IPv6
/// counterpart of [`MAX_SUBNET_LEN`].
pub(crate) const MAX_IPV6_SUBNET_LEN: u8 = 126;

/// The data-plane backend named by `Backend.Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// VXLAN (RFC 7348), flannel's `vxlan`: default port 8472, VNI 1.
    Vxlan,
    /// flannel's `udp`: the raw IP packet in UDP, default port 8285.
    Udp,
    /// flannel's `host-gw`: no encapsulation; each peer's subnet is a kernel route via the
    /// peer's `PublicIP` on the underlay (the hosts share a link).
    HostGw,
    /// flannel's `alloc`: the lease alone, no data plane.
    Alloc,
    /// flannel's `ipip`: the IPv4 packet inside an outer IPv4 header of protocol 4 (RFC 2003),
    /// which weft sends and receives on raw IP sockets instead of the kernel's `ipip` module.
    Ipip,
    /// flannel's `wireguard`: WireGuard data messages over UDP, sealed in user space instead
    /// of by the kernel's `wireguard` module. Default port 51820.
    Wireguard,
}

impl BackendKind {
    /// The name as flannel spells it in `Backend.Type`: `"vxlan"`, `"udp"`, `"host-gw"`,
    /// `"alloc"`, `"ipip"`, `"wireguard"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vxlan => "vxlan",
            Self::Udp => "udp",
            Self::HostGw => "host-gw",
            Self::Alloc => "alloc",
            Self::Ipip => "ipip",
            Self::Wireguard => "wireguard",
        }
    }

    /// The port peers send to when the config does not name one (0: the backend has none).
    pub fn default_port(self) -> u16 {
        match self {
            Self::Vxlan => DEFAULT_VXLAN_PORT,
            Self::Udp => DEFAULT_UDP_PORT,
            Self::Wireguard => DEFAULT_WIREGUARD_PORT,
            Self::HostGw | Self::Alloc | Self::Ipip => 0,
        }
    }

    /// Whether the backend sends over a UDP port named `Backend.Port` (wireguard's is
    /// `Backend.ListenPort`, in [`WireguardOptions`]).
    pub fn has_port(self) -> bool {
        matches!(self, Self::Vxlan | Self::Udp)
    }

    /// Whether the backend forwards through weft's TUN device (vxlan, udp, ipip, wireguard):
    /// host-gw programs kernel routes instead, and alloc has no data plane.
    pub fn uses_tun(self) -> bool {
        matches!(self, Self::Vxlan | Self::Udp | Self::Ipip | Self::Wireguard)
    }

    /// Whether the backend carries IPv6 over the IPv6 underlay on a network with IPv6 enabled
    /// (vxlan, and wireguard in `Mode` `separate`, the only mode [`NetworkConfig::parse`]
    /// accepts with IPv6): its lease publishes `PublicIPv6` and `BackendV6Data`.
    pub fn carries_ipv6(self) -> bool {
        matches!(self, Self::Vxlan | Self::Wireguard)
    }

    /// Whether the backend reads `Backend.DirectRouting` (vxlan and ipip, as flannel's).
    pub fn has_direct_routing(self) -> bool {
        matches!(self, Self::Vxlan | Self::Ipip)
    }

    /// Parses `Backend.Type`. flannel's backend manager lowercases the type, so any case works.
    fn from_type(name: &str) -> Option<Self> {
        [Self::Vxlan, Self::Udp, Self::HostGw, Self::Alloc, Self::Ipip, Self::Wireguard]
            .into_iter()
            .find(|k| name.eq_ignore_ascii_case(k.as_str()))
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// flannel's wireguard `Mode`: how many WireGuard devices, and which underlay a peer is
/// reached over. On an IPv4-only network every mode means one device on the IPv4 underlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WireguardMode {
    /// `"separate"` (the default): one device per family, on its own port.
    #[default]
    Separate,
    /// `"auto"`: one device; each peer over IPv4 unless only IPv6 is likely to connect.
    Auto,
    /// `"ipv4"`: one device; every peer over the IPv4 underlay.
    Ipv4,
    /// `"ipv6"`: one device; every peer over the IPv6 underlay.
    Ipv6,
}

impl WireguardMode {
    /// flannel's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Separate => "separate",
            Self::Auto => "auto",
            Self::Ipv4 => "ipv4",
            Self::Ipv6 => "ipv6",
        }
    }

    /// Parses `Backend.Mode`. flannel compares it as written (`"Auto"` is not a mode there), so
    /// weft does too.
    fn parse(text: &str) -> Option<Self> {
        [Self::Separate, Self::Auto, Self::Ipv4, Self::Ipv6]
            .into_iter()
            .find(|m| m.as_str() == text)
    }
}

impl fmt::Display for WireguardMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The wireguard backend's options, with flannel's names and defaults (its
/// `pkg/backend/wireguard`): `ListenPort` 51820 (in [`Backend`]'s port), `ListenPortV6` 51821,
/// `MTU` (the underlay's when unset; the overlay gets it less [`WIREGUARD_OVERHEAD`]), `PSK`,
/// `PersistentKeepaliveInterval` (seconds; 0 is off) and `Mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WireguardOptions {
    /// `ListenPortV6`: the IPv6 device's port in `separate` mode.
    pub(crate) listen_port_v6: u16,
    /// `MTU`: the link MTU the overlay's is taken from instead of the underlay's.
    pub(crate) mtu: Option<u32>,
    /// `PSK`: a preshared key mixed into every handshake (never printed: [`WgSecret`]).
    pub(crate) psk: Option<WgSecret>,
    /// `PersistentKeepaliveInterval`, in seconds: a keepalive to each peer after this long
    /// without sending (0: none).
    pub(crate) keepalive_secs: u16,
    /// `Mode`.
    pub(crate) mode: WireguardMode,
}

impl Default for WireguardOptions {
    fn default() -> Self {
        Self {
            listen_port_v6: DEFAULT_WIREGUARD_PORT_V6,
            mtu: None,
            psk: None,
            keepalive_secs: 0,
            mode: WireguardMode::Separate,
        }
    }
}

/// The backend section of the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend {
    /// The backend type.
    pub kind: BackendKind,
    /// The UDP port peers send to.
    pub(crate) port: u16,
    /// The VXLAN network identifier (vxlan only; 1 by default). A parsed udp backend always
    /// carries [`DEFAULT_VNI`] here: flannel's udp backend has no VNI and ignores the field.
    pub(crate) vni: u32,
    /// `DirectRouting` (vxlan, ipip): peers whose `PublicIP` is on the underlay's link are
    /// reached by a kernel route via that address, without encapsulation.
    pub(crate) direct_routing: bool,
    /// The wireguard options (defaults for every other backend).
    pub(crate) wireguard: WireguardOptions,
}

impl Backend {
    /// A backend of `kind` with flannel's defaults (port 8472 and VNI 1 for vxlan, port 8285 for
    /// udp, 51820 for wireguard).
    pub(crate) fn new(kind: BackendKind) -> Self {
        Self {
            kind,
            port: kind.default_port(),
            vni: DEFAULT_VNI,
            direct_routing: false,
            wireguard: WireguardOptions::default(),
        }
    }

    /// The link MTU the overlay's MTU is taken from: wireguard's `Backend.MTU` when set, else
    /// `underlay_mtu`, the underlay interface's.
    pub fn mtu_base(&self, underlay_mtu: u32) -> u32 {
        match (self.kind, self.wireguard.mtu) {
            (BackendKind::Wireguard, Some(mtu)) => mtu,
            _ => underlay_mtu,
        }
    }

    /// The overlay's MTU on an underlay of `underlay_mtu`: [`Self::mtu_base`] less
    /// [`Self::encap_overhead`].
    pub fn overlay_mtu(&self, underlay_mtu: u32) -> u32 {
        self.mtu_base(underlay_mtu).saturating_sub(u32::from(self.encap_overhead()))
    }

    /// Bytes each packet grows by on the underlay, which the overlay MTU must leave room for:
    /// vxlan 50 (outer IPv4 20 + UDP 8 + VXLAN 8 + inner Ethernet 14), udp 28 (IPv4 20 + UDP 8),
    /// ipip 20 (the outer IPv4 header: flannel sets `flannel.ipip`'s MTU to the interface's
    /// minus 20), wireguard 80 ([`WIREGUARD_OVERHEAD`], flannel's), host-gw and alloc none
    /// (flannel's MTU for both is the interface's).
    pub fn encap_overhead(&self) -> u16 {
        match self.kind {
            BackendKind::Vxlan => 50,
            BackendKind::Udp => 28,
            BackendKind::Ipip => 20,
            BackendKind::Wireguard => WIREGUARD_OVERHEAD,
            BackendKind::HostGw | BackendKind::Alloc => 0,
        }
    }
}

impl Default for Backend {
    /// flannel's code default, udp (its documentation says vxlan; the code wins).
    fn default() -> Self {
        Self::new(BackendKind::Udp)
    }
}

/// A validated network config: IPv4-only, dual-stack or IPv6-only (at least one family).
///
/// The family that leases ([`NetworkConfig::leases_ipv4`]) is IPv4 whenever IPv4 is enabled: a
/// lease's identity is then its IPv4 subnet, and on a dual-stack network its IPv6 half goes
/// with it. On an IPv6-only network the IPv6 subnet is the lease's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// The IPv4 network: `Some` unless the config says `"EnableIPv4": false`.
    pub ipv4: Option<Ipv4NetworkConfig>,
    /// The IPv6 network: `Some` exactly when the config says `"EnableIPv6": true`.
    pub ipv6: Option<Ipv6NetworkConfig>,
    /// The backend.
    pub backend: Backend,
}

/// The IPv4 part of a network config (`Network`, `SubnetLen`, `SubnetMin`, `SubnetMax`),
/// validated: `network` has no host bits and is at most a /28, `subnet_len` is in
/// `network.prefix_len() + 2 ..= 30`, and `subnet_min <= subnet_max` are aligned subnet
/// addresses inside `network`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4NetworkConfig {
    /// The cluster network (`Network`).
    pub network: Ipv4Net,
    /// The prefix length of each host's subnet (`SubnetLen`).
    pub subnet_len: u8,
    /// The lowest subnet that may be leased (`SubnetMin`).
    pub(crate) subnet_min: Ipv4Addr,
    /// The highest subnet that may be leased (`SubnetMax`).
    pub(crate) subnet_max: Ipv4Addr,
}

/// The IPv6 half of a dual-stack network config (`"EnableIPv6": true`), validated: `network`
/// has no host bits and is at most a /124 (and not `::/0`), `subnet_len` is in
/// `network.prefix_len() + 2 ..= 126`, and `subnet_min <= subnet_max` are aligned subnet
/// addresses inside `network`.
///
/// flannel's defaults: `IPv6SubnetLen` 64 if the network is a /62 or larger, else its prefix
/// length + 2; `IPv6SubnetMin` the second subnet (the first is skipped, as for IPv4);
/// `IPv6SubnetMax` the last subnet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv6NetworkConfig {
    /// The cluster's IPv6 network (`IPv6Network`).
    pub network: Ipv6Net,
    /// The prefix length of each host's IPv6 subnet (`IPv6SubnetLen`).
    pub subnet_len: u8,
    /// The lowest IPv6 subnet that may be leased (`IPv6SubnetMin`).
    pub(crate) subnet_min: Ipv6Addr,
    /// The highest IPv6 subnet that may be leased (`IPv6SubnetMax`).
    pub(crate) subnet_max: Ipv6Addr,
}

/// Why a config was refused. Every message starts with the field it is about.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The bytes are not JSON.
    #[error("not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// The JSON is not an object.
    #[error("config must be a JSON object")]
    NotObject,
    /// A field holds the wrong kind of JSON value.
    #[error("{field}: expected {expected}, found {found}")]
    WrongType {
        /// The field, e.g. `SubnetLen` or `Backend.Port`.
        field: &'static str,
        /// What the field takes, e.g. "a non-negative integer".
        expected: &'static str,
        /// The value found, as (shortened) JSON text.
        found: String,
    },
    /// One key given twice in one object (any key, at any depth).
    #[error("{key:?}: given twice in one object")]
    RepeatedKey {
        /// The key, as written (shortened).
        key: String,
    },
    /// Two keys name the same field, differing only in case.
    #[error("{field}: given twice, as {first:?} and {second:?}")]
    DuplicateField {
        /// The field.
        field: &'static str,
        /// One spelling.
        first: String,
        /// The other spelling.
        second: String,
    },
    /// A required field is absent.
    #[error("{field}: missing ({})", missing_hint(.field))]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A CIDR field does not parse.
    #[error("{field}: {value:?} is not an IPv4 CIDR (expected a.b.c.d/len)")]
    BadCidr {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// The network has bits set below its prefix.
    #[error("{field}: {value:?} has host bits set (did you mean {suggestion}?)")]
    HostBits {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
        /// The same prefix with the host bits cleared.
        suggestion: Ipv4Net,
    },
    /// An IPv6 CIDR field does not parse (an IPv4 CIDR included).
    #[error("{field}: {value:?} is not an IPv6 CIDR (expected e.g. fd00:10:244::/56)")]
    BadCidr6 {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// The IPv6 network has bits set below its prefix.
    #[error("{field}: {value:?} has host bits set (did you mean {suggestion}?)")]
    HostBits6 {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
        /// The same prefix with the host bits cleared.
        suggestion: Ipv6Net,
    },
    /// `0.0.0.0/0`, which flannel treats as "no network given".
    #[error("Network: 0.0.0.0/0 is not a usable cluster network")]
    NetworkEmpty,
    /// `::/0`, refused like `0.0.0.0/0`.
    #[error("IPv6Network: ::/0 is not a usable cluster network")]
    Ipv6NetworkEmpty,
    /// The network is too small to hold four subnets of at least four addresses.
    #[error("Network: {network} is too small (the smallest useful network is a /28)")]
    NetworkTooSmall {
        /// The network given.
        network: Ipv4Net,
    },
    /// The IPv6 network is too small to hold four subnets of at least four addresses.
    #[error("IPv6Network: {network} is too small (the smallest useful network is a /124)")]
    Ipv6NetworkTooSmall {
        /// The network given.
        network: Ipv6Net,
    },
    /// `SubnetLen` is longer than [`MAX_SUBNET_LEN`].
    #[error("SubnetLen: {len} is longer than {MAX_SUBNET_LEN}")]
    SubnetLenTooLong {
        /// The length given.
        len: u64,
    },
    /// `SubnetLen` leaves room for fewer than four subnets in the network.
    #[error(
        "SubnetLen: {len} is too short for Network {network} (at least /{min}, so that the \
         network holds four subnets)"
    )]
    SubnetLenTooShort {
        /// The length given.
        len: u8,
        /// The network.
        network: Ipv4Net,
        /// The shortest length allowed.
        min: u8,
    },
    /// `IPv6SubnetLen` is longer than 126 (flannel's limit).
    #[error("IPv6SubnetLen: {len} is longer than {MAX_IPV6_SUBNET_LEN}")]
    Ipv6SubnetLenTooLong {
        /// The length given.
        len: u64,
    },
    /// `IPv6SubnetLen` leaves room for fewer than four subnets in the IPv6 network.
    #[error(
        "IPv6SubnetLen: {len} is too short for IPv6Network {network} (at least /{min}, so that \
         the network holds four subnets)"
    )]
    Ipv6SubnetLenTooShort {
        /// The length given.
        len: u8,
        /// The network.
        network: Ipv6Net,
        /// The shortest length allowed.
        min: u8,
    },
    /// An address field does not parse.
    #[error("{field}: {value:?} is not an IPv4 address")]
    BadAddress {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// An IPv6 address field does not parse (an IPv4 address included).
    #[error("{field}: {value:?} is not an IPv6 address")]
    BadAddress6 {
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// `SubnetMin` or `SubnetMax` lies outside `Network`.
    #[error("{field}: {addr} is outside Network {network}")]
    OutsideNetwork {
        /// The field.
        field: &'static str,
        /// The address given.
        addr: Ipv4Addr,
        /// The network.
        network: Ipv4Net,
    },
    /// `SubnetMin` or `SubnetMax` is not the network address of a subnet.
    #[error("{field}: {addr} is not aligned to /{len}")]
    Unaligned {
        /// The field.
        field: &'static str,
        /// The address given.
        addr: Ipv4Addr,
        /// The subnet length it must be aligned to.
        len: u8,
    },
    /// `SubnetMin` is above `SubnetMax`: no subnet could be leased.
    #[error("SubnetMin: {min} is above SubnetMax {max}")]
    MinAboveMax {
        /// `SubnetMin`.
        min: Ipv4Addr,
        /// `SubnetMax`.
        max: Ipv4Addr,
    },
    /// `IPv6SubnetMin` or `IPv6SubnetMax` lies outside `IPv6Network`.
    #[error("{field}: {addr} is outside IPv6Network {network}")]
    OutsideIpv6Network {
        /// The field.
        field: &'static str,
        /// The address given.
        addr: Ipv6Addr,
        /// The network.
        network: Ipv6Net,
    },
    /// `IPv6SubnetMin` or `IPv6SubnetMax` is not the network address of a subnet.
    #[error("{field}: {addr} is not aligned to /{len}")]
    Unaligned6 {
        /// The field.
        field: &'static str,
        /// The address given.
        addr: Ipv6Addr,
        /// The subnet length it must be aligned to.
        len: u8,
    },
    /// `IPv6SubnetMin` is above `IPv6SubnetMax`: no IPv6 subnet could be leased.
    #[error("IPv6SubnetMin: {min} is above IPv6SubnetMax {max}")]
    MinAboveMax6 {
        /// `IPv6SubnetMin`.
        min: Ipv6Addr,
        /// `IPv6SubnetMax`.
        max: Ipv6Addr,
    },
    /// An integer field is out of its range.
    #[error("{field}: {value} is out of range {min}..={max}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value allowed.
        min: u64,
        /// The largest value allowed.
        max: u64,
    },
    /// An IPv6 field (`IPv6Network`, ...) is set but `EnableIPv6` is not `true`. flannel would
    /// ignore it; whoever wrote it meant IPv6, so weft refuses rather than come up IPv4-only.
    #[error(
        "{field}: set, but IPv6 is not enabled (add \"EnableIPv6\": true for a dual-stack \
         network, or remove the field)"
    )]
    Ipv6NotEnabled {
        /// The field.
        field: &'static str,
    },
    /// `EnableIPv4: false` without `"EnableIPv6": true`: no network at all.
    #[error(
        "EnableIPv4: false needs \"EnableIPv6\": true and an IPv6Network (an IPv6-only \
         network); a config must enable at least one family"
    )]
    NoFamily,
    /// An IPv6-only network with the udp backend, which carries no IPv6.
    #[error(
        "Backend.Type: udp carries IPv4 only (as flannel's), so an IPv6-only network \
         (\"EnableIPv4\": false) needs \"Type\": \"vxlan\""
    )]
    Ipv6OnlyUdp,
    /// An IPv4 field set on an IPv6-only network (`"EnableIPv4": false`).
    #[error(
        "{field}: set, but \"EnableIPv4\" is false (an IPv6-only network has no IPv4 fields; \
         remove it, or drop \"EnableIPv4\": false for dual stack)"
    )]
    Ipv4NotEnabled {
        /// The field.
        field: &'static str,
    },
    /// `Backend` has fields but no `Type`.
    #[error(
        "Backend.Type: missing (Backend has other fields, so name the backend: vxlan, udp, \
         host-gw, ipip, wireguard or alloc)"
    )]
    MissingBackendType,
    /// `Backend.Type` names a backend weft does not implement.
    #[error(
        "Backend.Type: {value:?} is not supported (weft supports vxlan, udp, host-gw, ipip, \
         wireguard and alloc)"
    )]
    UnsupportedBackend {
        /// The type given.
        value: String,
    },
    /// A backend that carries IPv4 only on a network with IPv6 enabled.
    #[error(
        "EnableIPv6: the {backend} backend carries IPv4 only in weft (flannel's routes IPv6 \
         too); use vxlan for dual stack"
    )]
    Ipv6Unsupported {
        /// The backend.
        backend: &'static str,
    },
    /// ipip on a network with IPv6 enabled: IP-in-IP of protocol 4 carries IPv4 only, and
    /// flannel's ipip backend programs no IPv6 route.
    #[error(
        "EnableIPv6: the ipip backend carries IPv4 only (IPv4 in IPv4, protocol 4; flannel's \
         ipip backend programs no IPv6 route either); use vxlan for IPv6"
    )]
    Ipv6Ipip,
    /// wireguard on a network with IPv6 enabled, in a `Mode` other than `separate`.
    #[error(
        "Backend.Mode: \"{mode}\" is not supported with EnableIPv6 (weft's wireguard backend \
         carries IPv6 in Mode \"separate\" only, flannel's default: one session per family, \
         IPv6 over the IPv6 underlay to ListenPortV6); use \"separate\", or wireguard on an \
         IPv4-only network"
    )]
    Ipv6WireguardMode {
        /// The mode given.
        mode: WireguardMode,
    },
    /// `Backend.Mode` is none of flannel's.
    #[error("Backend.Mode: {value:?} is not a mode (separate, auto, ipv4 or ipv6)")]
    BadWireguardMode {
        /// The value given.
        value: String,
    },
    /// `Backend.PSK` is not a WireGuard key. The error never holds the key's text.
    #[error("Backend.PSK: not a WireGuard key (32 bytes in base64, as `wg genpsk` writes)")]
    BadPsk,
    /// A backend option weft does not implement is set to a non-default value.
    #[error("{field}: {value} is not supported yet")]
    UnsupportedOption {
        /// The field, e.g. `Backend.DirectRouting`.
        field: &'static str,
        /// The value given, as JSON text.
        value: String,
    },
}

impl NetworkConfig {
    /// Parses and validates config JSON.
    ///
    /// A missing, `null` or empty `Backend` means udp, which is what flannel's code does
    /// (`parseBackendType`); flannel's documentation says vxlan, but weft follows the code so
    /// that one config means the same thing to both. `"EnableIPv6": true` makes it dual-stack
    /// (see [`Ipv6NetworkConfig`] for the IPv6 rules and defaults); IPv6 fields without it are
    /// refused. See the module docs for the rules.
    ///
    /// # Errors
    /// [`ConfigError`], naming the field and the problem.
    pub fn parse(json: &[u8]) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_slice(json).map_err(ConfigError::NotJson)?;
        no_repeated_key(json)?;
        let Value::Object(obj) = &value else {
            return Err(ConfigError::NotObject);
        };

        let enable_ipv4 = bool_field(obj, "EnableIPv4", "EnableIPv4")? != Some(false);
        let enable_ipv6 = bool_field(obj, "EnableIPv6", "EnableIPv6")? == Some(true);
        if !enable_ipv4 {
            if !enable_ipv6 {
                return Err(ConfigError::NoFamily);
            }
            // flannel ignores them without EnableIPv4; refused for the same reason as IPv6
            // fields without EnableIPv6, below.
            for name in IPV4_FIELDS {
                if field(obj, name, name)?.is_some_and(is_set) {
                    return Err(ConfigError::Ipv4NotEnabled { field: name });
                }
            }
            let ipv6 = parse_ipv6(obj)?;
            let backend = parse_backend(field(obj, "Backend", "Backend")?)?;
            return Self::ipv6_only(ipv6, backend);
        }
        if !enable_ipv6 {
            // flannel reads these only with EnableIPv6, but whoever wrote them meant IPv6:
            // refusing is louder than a cluster that silently comes up IPv4-only.
            for name in IPV6_FIELDS {
                if field(obj, name, name)?.is_some_and(is_set) {
                    return Err(ConfigError::Ipv6NotEnabled { field: name });
                }
            }
        }

        let network = match str_field(obj, "Network", "Network")? {
            Some(text) => parse_network(text)?,
            None => return Err(ConfigError::Missing { field: "Network" }),
        };
        let subnet_len = match uint_field(obj, "SubnetLen", "SubnetLen")? {
            // flannel's SubnetLen is a uint whose zero value means "unset".
            None | Some(0) => None,
            Some(len) if len > u64::from(MAX_SUBNET_LEN) => {
                return Err(ConfigError::SubnetLenTooLong { len });
            }
            // Fits: at most 30.
            Some(len) => Some(len as u8),
        };
        let subnet_min = addr_field(obj, "SubnetMin")?;
        let subnet_max = addr_field(obj, "SubnetMax")?;
        let backend = parse_backend(field(obj, "Backend", "Backend")?)?;
        let mut config = Self::new(network, subnet_len, subnet_min, subnet_max, backend)?;
        if enable_ipv6 {
            match backend.kind {
                BackendKind::HostGw => {
                    return Err(ConfigError::Ipv6Unsupported { backend: backend.kind.as_str() });
                }
                BackendKind::Ipip => return Err(ConfigError::Ipv6Ipip),
                BackendKind::Wireguard => wireguard_ipv6_mode(&backend)?,
                _ => {}
            }
            config.ipv6 = Some(parse_ipv6(obj)?);
        }
        Ok(config)
    }

    /// A config from its parts, with flannel's defaults for the parts not given, validated as
    /// [`NetworkConfig::parse`] validates.
    ///
    /// - `subnet_len`: default 24 if the network is a /22 or larger, else the network's prefix
    ///   length + 2.
    /// - `subnet_min`: default the second subnet (flannel skips the first, which holds the
    ///   network address).
    /// - `subnet_max`: default the last subnet.
    ///
    /// The config is IPv4-only (`ipv6` is `None`); set `ipv6` to an [`Ipv6NetworkConfig`] for
    /// dual stack.
    ///
    /// # Errors
    /// [`ConfigError`], naming the field and the problem.
    pub(crate) fn new(
        network: Ipv4Net,
        subnet_len: Option<u8>,
        subnet_min: Option<Ipv4Addr>,
        subnet_max: Option<Ipv4Addr>,
        backend: Backend,
    ) -> Result<Self, ConfigError> {
        let ipv4 = Ipv4NetworkConfig::new(network, subnet_len, subnet_min, subnet_max)?;
        check_backend(&backend)?;
        Ok(Self { ipv4: Some(ipv4), ipv6: None, backend })
    }

    /// An IPv6-only config (`"EnableIPv4": false`). Its backend must be vxlan or wireguard (in
    /// `Mode` `separate`): flannel's udp backend carries IPv4 only, so an IPv6-only udp network
    /// could carry nothing.
    ///
    /// # Errors
    /// [`ConfigError::Ipv6OnlyUdp`], [`ConfigError::Ipv6WireguardMode`], or backend values
    /// out of range.
    pub(crate) fn ipv6_only(
        ipv6: Ipv6NetworkConfig,
        backend: Backend,
    ) -> Result<Self, ConfigError> {
        check_backend(&backend)?;
        match backend.kind {
            BackendKind::Vxlan => {}
            BackendKind::Wireguard => wireguard_ipv6_mode(&backend)?,
            BackendKind::Udp => return Err(ConfigError::Ipv6OnlyUdp),
            BackendKind::Ipip => return Err(ConfigError::Ipv6Ipip),
            other => return Err(ConfigError::Ipv6Unsupported { backend: other.as_str() }),
        }
        Ok(Self { ipv4: None, ipv6: Some(ipv6), backend })
    }

    /// The config as flannel-style JSON, every field explicit, e.g.
    /// `{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0",
    /// "SubnetMax":"10.244.255.0","Backend":{"Type":"vxlan","VNI":1,"Port":8472}}`.
    /// A udp backend is written without `VNI`. A dual-stack config adds, before `Backend`,
    /// `"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":64,
    /// "IPv6SubnetMin":"fd00:10:244:1::","IPv6SubnetMax":"fd00:10:244:ff::"`. It parses back to
    /// an equal config.
    pub fn to_json(&self) -> String {
        // Every value is a number, an address or a fixed name: nothing needs escaping.
        let backend = match self.backend.kind {
            BackendKind::Vxlan => format!(
                r#"{{"Type":"vxlan","VNI":{},"Port":{}{}}}"#,
                self.backend.vni,
                self.backend.port,
                if self.backend.direct_routing { r#","DirectRouting":true"# } else { "" }
            ),
            BackendKind::Udp => format!(r#"{{"Type":"udp","Port":{}}}"#, self.backend.port),
            BackendKind::Ipip => format!(
                r#"{{"Type":"ipip"{}}}"#,
                if self.backend.direct_routing { r#","DirectRouting":true"# } else { "" }
            ),
            BackendKind::Wireguard => {
                let wg = &self.backend.wireguard;
                format!(
                    r#"{{"Type":"wireguard","ListenPort":{},"ListenPortV6":{},"Mode":"{}","PersistentKeepaliveInterval":{}{}{}}}"#,
                    self.backend.port,
                    wg.listen_port_v6,
                    wg.mode,
                    wg.keepalive_secs,
                    wg.mtu.map(|m| format!(r#","MTU":{m}"#)).unwrap_or_default(),
                    // The handover to a re-executed weft is this text's one reader: it needs
                    // the key as the config gave it.
                    wg.psk.map(|k| format!(r#","PSK":"{}""#, k.expose_text())).unwrap_or_default(),
                )
            }
            BackendKind::HostGw | BackendKind::Alloc => {
                format!(r#"{{"Type":"{}"}}"#, self.backend.kind.as_str())
            }
        };
        let ipv6 = match &self.ipv6 {
            Some(v6) => format!(
                concat!(
                    r#""EnableIPv6":true,"IPv6Network":"{}","IPv6SubnetLen":{},"#,
                    r#""IPv6SubnetMin":"{}","IPv6SubnetMax":"{}","#,
                ),
                v6.network, v6.subnet_len, v6.subnet_min, v6.subnet_max
            ),
            None => String::new(),
        };
        let ipv4 = match &self.ipv4 {
            Some(v4) => format!(
                r#""Network":"{}","SubnetLen":{},"SubnetMin":"{}","SubnetMax":"{}","#,
                v4.network, v4.subnet_len, v4.subnet_min, v4.subnet_max
            ),
            None => r#""EnableIPv4":false,"#.to_owned(),
        };
        format!(r#"{{{ipv4}{ipv6}"Backend":{backend}}}"#)
    }

    /// Whether leases are IPv4 subnets (IPv4-only and dual-stack networks), rather than IPv6
    /// ones (an IPv6-only network).
    pub fn leases_ipv4(&self) -> bool {
        self.ipv4.is_some()
    }

    /// The network leases are subnets of, and their length: the IPv4 `Network` and
    /// `SubnetLen`, or on an IPv6-only network `IPv6Network` and `IPv6SubnetLen`. A config of
    /// neither family (which no parser or constructor makes; only a hand-built value) leases
    /// nothing: `0.0.0.0/0` in /33s, a length no subnet has.
    pub fn leased_network(&self) -> (IpNet, u8) {
        match (&self.ipv4, &self.ipv6) {
            (Some(v4), _) => (IpNet::V4(v4.network), v4.subnet_len),
            (None, Some(v6)) => (IpNet::V6(v6.network), v6.subnet_len),
            (None, None) => (IpNet::V4(Ipv4Net::default()), 33),
        }
    }

    /// The number of leasable subnets (of the family that leases).
    pub fn subnet_count(&self) -> u128 {
        match (&self.ipv4, &self.ipv6) {
            (Some(v4), _) => u128::from(v4.subnet_count()),
            (None, Some(v6)) => v6.subnet_count(),
            (None, None) => 0,
        }
    }

    /// Every leasable subnet (of the family that leases), ascending; lazily, since an IPv6
    /// range may hold up to 2^125 of them.
    pub fn subnets(&self) -> impl Iterator<Item = Subnet> + '_ {
        let v4 = self.ipv4.iter().flat_map(Ipv4NetworkConfig::subnets);
        let v6_only = self.ipv6.iter().filter(|_| self.ipv4.is_none());
        v4.chain(v6_only.flat_map(|v6| v6.subnets().map(Subnet::from)))
    }

    /// Whether a subnet key names a lease of this network (of the family that leases, inside
    /// the network, exactly its subnet length), whether or not inside the allocation range:
    /// anything else under `subnets/` is ignored.
    pub fn check_lease(&self, subnet: Subnet) -> Result<(), ForeignSubnet> {
        let (network, len) = self.leased_network();
        subnet.check_lease_of(network, len)
    }

    /// Whether `subnet` may be leased under this config (of the family that leases, inside the
    /// network and the range, right length).
    pub fn fits(&self, subnet: Subnet) -> bool {
        match (&self.ipv4, &self.ipv6, subnet.v4(), subnet.v6()) {
            (Some(v4), _, Some(net), _) => v4.fits(net),
            (None, Some(v6), _, Some(half)) => v6.fits(half.net()),
            _ => false,
        }
    }

    /// The IPv6 half that pairs with `subnet` by position on a dual-stack network: the `i`-th
    /// leasable IPv6 subnet for the `i`-th leasable IPv4 one (`SubnetMin` with
    /// `IPv6SubnetMin`, the next with the next, ...). `None` on a network of one family, for a
    /// subnet that does not fit, or past `IPv6SubnetMax` (an IPv6 range smaller than the IPv4
    /// one). Nodes that lease different subnets at the same moment thus never pick the same
    /// half (see `policy::pair_ipv6`).
    pub fn home_ipv6_half(&self, subnet: Subnet) -> Option<Ipv6Subnet> {
        let (v4, v6) = (self.ipv4.as_ref()?, self.ipv6.as_ref()?);
        let net = subnet.v4()?;
        if !v4.fits(net) {
            return None;
        }
        let shift = 32u32.checked_sub(u32::from(v4.subnet_len))?;
        let index = (u32::from(net.network()) - u32::from(v4.subnet_min)).checked_shr(shift)?;
        let step = 1u128.checked_shl(128u32.checked_sub(u32::from(v6.subnet_len))?)?;
        let addr = u128::from(v6.subnet_min).checked_add(u128::from(index).checked_mul(step)?)?;
        let net = Ipv6Net::new(Ipv6Addr::from(addr), v6.subnet_len).ok()?;
        Ipv6Subnet::new(net).ok().filter(|h| v6.fits(h.net()))
    }

    /// Whether a lease may be held under this config: its subnet fits, and it carries an IPv6
    /// subnet exactly when the config enables IPv6, one that fits too (flannel reuses a
    /// previous lease only if both halves fit); on an IPv6-only network that is the subnet.
    pub fn fits_lease(&self, name: LeaseName) -> bool {
        self.fits(name.subnet)
            && match (&self.ipv4, &self.ipv6, name.ipv6) {
                (Some(_), None, None) => true,
                (Some(_), Some(v6), Some(half)) => v6.fits(half.net()),
                (None, Some(_), Some(half)) => name.subnet.v6() == Some(half),
                _ => false,
            }
    }
}

impl Ipv4NetworkConfig {
    /// The IPv4 part of a config from its parts, with flannel's defaults for the parts not
    /// given, validated as [`NetworkConfig::parse`] validates (see [`NetworkConfig::new`]).
    ///
    /// # Errors
    /// [`ConfigError`], naming the field and the problem.
    pub(crate) fn new(
        network: Ipv4Net,
        subnet_len: Option<u8>,
        subnet_min: Option<Ipv4Addr>,
        subnet_max: Option<Ipv4Addr>,
    ) -> Result<Self, ConfigError> {
        if network.addr() != network.network() {
            return Err(ConfigError::HostBits {
                field: "Network",
                value: network.to_string(),
                suggestion: network.trunc(),
            });
        }
        let prefix = network.prefix_len();
        if prefix == 0 {
            return Err(ConfigError::NetworkEmpty);
        }
        if prefix > MAX_SUBNET_LEN - 2 {
            return Err(ConfigError::NetworkTooSmall { network });
        }
        let subnet_len = match subnet_len {
            Some(len) if len > MAX_SUBNET_LEN => {
                return Err(ConfigError::SubnetLenTooLong { len: u64::from(len) });
            }
            Some(len) if len < prefix + 2 => {
                return Err(ConfigError::SubnetLenTooShort { len, network, min: prefix + 2 });
            }
            Some(len) => len,
            None if prefix <= 22 => 24,
            None => prefix + 2,
        };

        // u64 so that the end of 255.0.0.0/8 (2^32) needs no special case.
        let size = 1u64 << (32 - u32::from(subnet_len));
        let start = u64::from(u32::from(network.network()));
        let end = start + (1u64 << (32 - u32::from(prefix)));
        let check = |name: &'static str, addr: Ipv4Addr| {
            if !network.contains(&addr) {
                return Err(ConfigError::OutsideNetwork { field: name, addr, network });
            }
            if u64::from(u32::from(addr)) % size != 0 {
                return Err(ConfigError::Unaligned { field: name, addr, len: subnet_len });
            }
            Ok(addr)
        };
        // Both defaults lie inside the network: it holds at least four subnets.
        let subnet_min = match subnet_min {
            Some(addr) => check("SubnetMin", addr)?,
            None => Ipv4Addr::from((start + size) as u32),
        };
        let subnet_max = match subnet_max {
            Some(addr) => check("SubnetMax", addr)?,
            None => Ipv4Addr::from((end - size) as u32),
        };
        if subnet_min > subnet_max {
            return Err(ConfigError::MinAboveMax { min: subnet_min, max: subnet_max });
        }
        Ok(Self { network, subnet_len, subnet_min, subnet_max })
    }

    /// The lowest subnet that may be leased (`SubnetMin`), as its network address.
    pub fn subnet_min(&self) -> Ipv4Addr {
        self.subnet_min
    }

    /// The highest subnet that may be leased (`SubnetMax`), as its network address.
    pub fn subnet_max(&self) -> Ipv4Addr {
        self.subnet_max
    }

    /// The number of leasable subnets, `subnet_min` to `subnet_max` inclusive (0 if the fields
    /// were set by hand to something invalid).
    pub fn subnet_count(&self) -> u64 {
        let Some(shift) = 32u32.checked_sub(u32::from(self.subnet_len)) else {
            return 0;
        };
        let lo = u32::from(self.subnet_min);
        let hi = u32::from(self.subnet_max);
        if lo > hi {
            return 0;
        }
        (u64::from(hi - lo) >> shift) + 1
    }

    /// Every leasable subnet, from `subnet_min` to `subnet_max` inclusive, ascending.
    pub fn subnets(&self) -> impl Iterator<Item = Subnet> + '_ {
        // shl of a u64 by at most 32 cannot overflow; subnet_count is 0 if the length is over 32.
        let step = 1u64 << 32u32.saturating_sub(u32::from(self.subnet_len));
        let lo = u64::from(u32::from(self.subnet_min));
        (0..self.subnet_count()).filter_map(move |i| {
            // At most subnet_max, so it fits in a u32.
            let addr = Ipv4Addr::from((lo + i * step) as u32);
            Subnet::from_parts(addr, self.subnet_len).ok()
        })
    }

    /// Whether `subnet` may be leased under this config: exactly `subnet_len` long, no host
    /// bits, inside the network and within `subnet_min ..= subnet_max`.
    pub fn fits(&self, subnet: Ipv4Net) -> bool {
        subnet.prefix_len() == self.subnet_len
            && subnet.addr() == subnet.network()
            && self.network.contains(&subnet)
            && (self.subnet_min..=self.subnet_max).contains(&subnet.addr())
    }
}

impl Ipv6NetworkConfig {
    /// The IPv6 half of a dual-stack config from its parts, with flannel's defaults for the
    /// parts not given, validated as [`NetworkConfig::parse`] validates `"EnableIPv6": true`.
    ///
    /// - `network`: no host bits, not `::/0`, at most a /124.
    /// - `subnet_len`: at most 126 and at least the network's prefix length + 2; default 64 if
    ///   the network is a /62 or larger, else the network's prefix length + 2.
    /// - `subnet_min`: default the second subnet (flannel skips the first, which holds the
    ///   network address).
    /// - `subnet_max`: default the last subnet.
    ///
    /// # Errors
    /// [`ConfigError`], naming the field (`IPv6Network`, `IPv6SubnetLen`, ...) and the problem.
    pub(crate) fn new(
        network: Ipv6Net,
        subnet_len: Option<u8>,
        subnet_min: Option<Ipv6Addr>,
        subnet_max: Option<Ipv6Addr>,
    ) -> Result<Self, ConfigError> {
        if network.addr() != network.network() {
            return Err(ConfigError::HostBits6 {
                field: "IPv6Network",
                value: network.to_string(),
                suggestion: network.trunc(),
            });
        }
        let prefix = network.prefix_len();
        if prefix == 0 {
            return Err(ConfigError::Ipv6NetworkEmpty);
        }
        if prefix > MAX_IPV6_SUBNET_LEN - 2 {
            return Err(ConfigError::Ipv6NetworkTooSmall { network });
        }
        let subnet_len = match subnet_len {
            Some(len) if len > MAX_IPV6_SUBNET_LEN => {
                return Err(ConfigError::Ipv6SubnetLenTooLong { len: u64::from(len) });
            }
            Some(len) if len < prefix + 2 => {
                return Err(ConfigError::Ipv6SubnetLenTooShort { len, network, min: prefix + 2 });
            }
            Some(len) => len,
            None if prefix <= 62 => 64,
            None => prefix + 2,
        };

        // 1 <= prefix <= 124 and 3 <= subnet_len <= 126: no shift reaches 128. The last address
        // is computed with `|`, not as start + network size, which would overflow for ffff::/16.
        let size = 1u128 << (128 - u32::from(subnet_len));
        let start = u128::from(network.network());
        let last = start | (u128::MAX >> prefix);
        let check = |name: &'static str, addr: Ipv6Addr| {
            if !network.contains(&addr) {
                return Err(ConfigError::OutsideIpv6Network { field: name, addr, network });
            }
            if u128::from(addr) & (size - 1) != 0 {
                return Err(ConfigError::Unaligned6 { field: name, addr, len: subnet_len });
            }
            Ok(addr)
        };
        // Both defaults lie inside the network: it holds at least four subnets.
        let subnet_min = match subnet_min {
            Some(addr) => check("IPv6SubnetMin", addr)?,
            None => Ipv6Addr::from(start + size),
        };
        let subnet_max = match subnet_max {
            Some(addr) => check("IPv6SubnetMax", addr)?,
            None => Ipv6Addr::from(last - (size - 1)),
        };
        if subnet_min > subnet_max {
            return Err(ConfigError::MinAboveMax6 { min: subnet_min, max: subnet_max });
        }
        Ok(Self { network, subnet_len, subnet_min, subnet_max })
    }

    /// The lowest IPv6 subnet that may be leased (`IPv6SubnetMin`), as its network address.
    pub fn subnet_min(&self) -> Ipv6Addr {
        self.subnet_min
    }

    /// The highest IPv6 subnet that may be leased (`IPv6SubnetMax`), as its network address.
    pub fn subnet_max(&self) -> Ipv6Addr {
        self.subnet_max
    }

    /// The number of leasable IPv6 subnets, `subnet_min` to `subnet_max` inclusive. A u128, so
    /// exact for every parsed config (at most 2^125 - 1: a /1 in /126s); 0 if the fields were
    /// set by hand to something invalid, and saturating at `u128::MAX` for the one hand-built
    /// range too big for it (every /128 of the whole address space).
    pub fn subnet_count(&self) -> u128 {
        let Some(shift) = 128u32.checked_sub(u32::from(self.subnet_len)) else {
            return 0;
        };
        let lo = u128::from(self.subnet_min);
        let hi = u128::from(self.subnet_max);
        if lo > hi {
            return 0;
        }
        // A shift of 128 (a /0 "subnet") has a single subnet: checked_shr's None means 0.
        (hi - lo).checked_shr(shift).unwrap_or(0).saturating_add(1)
    }

    /// Every leasable IPv6 subnet, from `subnet_min` up, ascending; lazily, since a range may
    /// hold up to 2^125 of them.
    pub fn subnets(&self) -> impl Iterator<Item = Ipv6Subnet> + '_ {
        let shift = 128u32.saturating_sub(u32::from(self.subnet_len));
        let step = 1u128.checked_shl(shift).unwrap_or(0);
        let lo = u128::from(self.subnet_min);
        let count = self.subnet_count();
        (0..count).map_while(move |i| {
            let addr = lo.checked_add(i.checked_mul(step)?)?;
            let net = Ipv6Net::new(Ipv6Addr::from(addr), self.subnet_len).ok()?;
            Ipv6Subnet::new(net).ok()
        })
    }

    /// Whether `subnet` may be leased under this config: exactly `subnet_len` long, no host
    /// bits, inside the network and within `subnet_min ..= subnet_max`.
    pub fn fits(&self, subnet: Ipv6Net) -> bool {
        subnet.prefix_len() == self.subnet_len
            && subnet.addr() == subnet.network()
            && self.network.contains(&subnet)
            && (self.subnet_min..=self.subnet_max).contains(&subnet.addr())
    }
}

/// An address the overlay must never swallow: traffic to it has to leave by the underlay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnderlayAddr {
    /// What it is, for the error: "this host's public IP", "etcd endpoint http://…".
    pub(crate) what: String,
    /// The address.
    pub(crate) addr: Ipv4Addr,
}

/// A Network that contains an underlay address: routing it into the TUN device would route the
/// underlay (peers, etcd) into the overlay, and cut the host off.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the Network {network} contains {what} ({addr}): routing it into the overlay would cut the \
     host off from its underlay; choose a Network that does not overlap the underlay"
)]
pub struct SwallowsUnderlay {
    /// The configured network.
    pub(crate) network: Ipv4Net,
    /// What it contains.
    pub(crate) what: String,
    /// The address.
    pub(crate) addr: Ipv4Addr,
}

impl NetworkConfig {
    /// Refuses a Network that contains any of `underlay` (the host's public IP, the etcd
    /// endpoints' addresses), naming the first overlap.
    pub fn check_underlay(&self, underlay: &[UnderlayAddr]) -> Result<(), SwallowsUnderlay> {
        let Some(v4) = &self.ipv4 else { return Ok(()) };
        match underlay.iter().find(|u| v4.network.contains(&u.addr)) {
            Some(u) => {
                Err(SwallowsUnderlay { network: v4.network, what: u.what.clone(), addr: u.addr })
            }
            None => Ok(()),
        }
    }
}

impl NetworkConfig {
    /// What differs from `self` in `other`, one `<field> <ours> -> <theirs>` each, in flannel's
    /// field names (`Backend.Type vxlan -> host-gw`, `Network 10.244.0.0/16 -> 10.8.0.0/16`);
    /// empty when the two are equal. A backend's options are compared only when both name the
    /// same backend: across backends they mean different things, and the type says it all.
    pub fn differences(&self, other: &Self) -> Vec<String> {
        fn put<T: PartialEq + fmt::Display>(out: &mut Vec<String>, field: &str, a: T, b: T) {
            if a != b {
                out.push(format!("{field} {a} -> {b}"));
            }
        }
        /// An optional value as weft says it in a difference: `none` when absent.
        fn shown<T: fmt::Display>(v: Option<T>) -> String {
            v.map_or_else(|| "none".to_owned(), |v| v.to_string())
        }
        let mut out = Vec::new();
        let (a4, b4) = (self.ipv4.as_ref(), other.ipv4.as_ref());
        put(&mut out, "Network", shown(a4.map(|c| c.network)), shown(b4.map(|c| c.network)));
        if let (Some(a), Some(b)) = (a4, b4) {
            put(&mut out, "SubnetLen", a.subnet_len, b.subnet_len);
            put(&mut out, "SubnetMin", a.subnet_min, b.subnet_min);
            put(&mut out, "SubnetMax", a.subnet_max, b.subnet_max);
        }
        let (a6, b6) = (self.ipv6.as_ref(), other.ipv6.as_ref());
        put(&mut out, "IPv6Network", shown(a6.map(|c| c.network)), shown(b6.map(|c| c.network)));
        if let (Some(a), Some(b)) = (a6, b6) {
            put(&mut out, "IPv6SubnetLen", a.subnet_len, b.subnet_len);
            put(&mut out, "IPv6SubnetMin", a.subnet_min, b.subnet_min);
            put(&mut out, "IPv6SubnetMax", a.subnet_max, b.subnet_max);
        }
        let (a, b) = (&self.backend, &other.backend);
        put(&mut out, "Backend.Type", a.kind, b.kind);
        if a.kind == b.kind {
            if a.kind.has_port() {
                put(&mut out, "Backend.Port", a.port, b.port);
            }
            if a.kind == BackendKind::Vxlan {
                put(&mut out, "Backend.VNI", a.vni, b.vni);
            }
            if a.kind.has_direct_routing() {
                put(&mut out, "Backend.DirectRouting", a.direct_routing, b.direct_routing);
            }
            if a.kind == BackendKind::Wireguard {
                let (x, y) = (&a.wireguard, &b.wireguard);
                put(&mut out, "Backend.ListenPort", a.port, b.port);
                put(&mut out, "Backend.ListenPortV6", x.listen_port_v6, y.listen_port_v6);
                put(&mut out, "Backend.MTU", shown(x.mtu), shown(y.mtu));
                put(&mut out, "Backend.Mode", x.mode, y.mode);
                put(
                    &mut out,
                    "Backend.PersistentKeepaliveInterval",
                    x.keepalive_secs,
                    y.keepalive_secs,
                );
                // Whether a key is set, and that it changed, but never the key.
                let psk = |k: Option<WgSecret>| if k.is_some() { "set" } else { "none" };
                if x.psk != y.psk {
                    let (p, q) = (psk(x.psk), psk(y.psk));
                    out.push(format!("Backend.PSK {p} -> {}", if p == q { "another" } else { q }));
                }
            }
        }
        out
    }
}

/// The IPv4 address of an etcd endpoint URL (`http://10.0.0.5:2379`, `10.0.0.5:2379`), if it
/// names one literally (a host name is resolved by the client, not checked here).
pub(crate) fn endpoint_ipv4(endpoint: &str) -> Option<Ipv4Addr> {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    host.parse().ok()
}

/// Checks the backend values [`NetworkConfig::new`] may be handed directly.
fn check_backend(backend: &Backend) -> Result<(), ConfigError> {
    if backend.kind.has_port() && backend.port == 0 {
        return Err(ConfigError::OutOfRange {
            field: "Backend.Port",
            value: 0,
            min: 1,
            max: u64::from(u16::MAX),
        });
    }
    if backend.kind == BackendKind::Vxlan && !(1..=MAX_VNI).contains(&backend.vni) {
        return Err(ConfigError::OutOfRange {
            field: "Backend.VNI",
            value: u64::from(backend.vni),
            min: 1,
            max: u64::from(MAX_VNI),
        });
    }
    Ok(())
}

fn parse_backend(value: Option<&Value>) -> Result<Backend, ConfigError> {
    let obj = match value {
        None => return Ok(Backend::default()),
        Some(Value::Object(obj)) if obj.is_empty() => return Ok(Backend::default()),
        Some(Value::Object(obj)) => obj,
        Some(other) => return Err(wrong_type("Backend", "an object", other)),
    };
    let kind = match str_field(obj, "Type", "Backend.Type")? {
        None | Some("") => return Err(ConfigError::MissingBackendType),
        Some(name) => BackendKind::from_type(name)
            .ok_or_else(|| ConfigError::UnsupportedBackend { value: name.to_owned() })?,
    };
    let mut backend = Backend::new(kind);
    if kind == BackendKind::Wireguard {
        parse_wireguard(obj, &mut backend)?;
        return Ok(backend);
    }
    // flannel's ipip backend reads DirectRouting alone.
    if kind == BackendKind::Ipip {
        backend.direct_routing = direct_routing(obj)?;
        return Ok(backend);
    }
    // flannel's host-gw and alloc read no option at all.
    if !kind.has_port() {
        return Ok(backend);
    }
    if let Some(port) = uint_field(obj, "Port", "Backend.Port")? {
        backend.port = in_range("Backend.Port", port, 1, u64::from(u16::MAX))? as u16;
    }
    // flannel's udp backend reads only Port; like flannel, weft ignores the rest for udp.
    if kind == BackendKind::Vxlan {
        if let Some(vni) = uint_field(obj, "VNI", "Backend.VNI")? {
            backend.vni = in_range("Backend.VNI", vni, 1, u64::from(MAX_VNI))? as u32;
        }
        // weft sizes its MTU from the underlay itself and has no kernel VXLAN device to tune.
        if let Some(mtu) = uint_field(obj, "MTU", "Backend.MTU")?
            && mtu != 0
        {
            return Err(ConfigError::UnsupportedOption {
                field: "Backend.MTU",
                value: mtu.to_string(),
            });
        }
        backend.direct_routing = direct_routing(obj)?;
        for (name, path) in [("GBP", "Backend.GBP"), ("Learning", "Backend.Learning")] {
            if bool_field(obj, name, path)? == Some(true) {
                return Err(ConfigError::UnsupportedOption {
                    field: path,
                    value: "true".to_owned(),
                });
            }
        }
    }
    Ok(backend)
}

/// The wireguard backend's options into `backend` (flannel's `RegisterNetwork` reads them
/// with these names and defaults).
fn parse_wireguard(obj: &Map<String, Value>, backend: &mut Backend) -> Result<(), ConfigError> {
    let port = |name: &str, path: &'static str| -> Result<Option<u16>, ConfigError> {
        // flannel lets 0 mean a random port, which no peer can learn before the lease; weft
        // refuses it, as it refuses Port 0.
        uint_field(obj, name, path)?
            .map(|p| in_range(path, p, 1, u64::from(u16::MAX)).map(|p| p as u16))
            .transpose()
    };
    if let Some(p) = port("ListenPort", "Backend.ListenPort")? {
        backend.port = p;
    }
    let wg = &mut backend.wireguard;
    if let Some(p) = port("ListenPortV6", "Backend.ListenPortV6")? {
        wg.listen_port_v6 = p;
    }
    // 0 means unset, as for vxlan; anything else must leave a usable overlay MTU (IPv4's
    // minimum of 576 after the overhead).
    wg.mtu = match uint_field(obj, "MTU", "Backend.MTU")? {
        None | Some(0) => None,
        Some(mtu) => {
            let min = 576 + u64::from(WIREGUARD_OVERHEAD);
            Some(in_range("Backend.MTU", mtu, min, u64::from(u16::MAX))? as u32)
        }
    };
    if let Some(text) = str_field(obj, "PSK", "Backend.PSK")?.filter(|t| !t.is_empty()) {
        wg.psk = Some(WgSecret::parse(text).map_err(|_| ConfigError::BadPsk)?);
    }
    // flannel reads a time.Duration (a number) and multiplies it by a second: it is seconds.
    // WireGuard's field is 16 bits.
    if let Some(secs) =
        uint_field(obj, "PersistentKeepaliveInterval", "Backend.PersistentKeepaliveInterval")?
    {
        wg.keepalive_secs =
            in_range("Backend.PersistentKeepaliveInterval", secs, 0, u64::from(u16::MAX))? as u16;
    }
    if let Some(text) = str_field(obj, "Mode", "Backend.Mode")? {
        wg.mode = WireguardMode::parse(text)
            .ok_or_else(|| ConfigError::BadWireguardMode { value: text.to_owned() })?;
    }
    Ok(())
}

/// wireguard with IPv6 enabled: only `Mode` `separate` (flannel's default) is carried. flannel's
/// other modes put both families on one device; `ipv6` and `auto` also advertise
/// `ListenPortV6` in `BackendV6Data` while that one device listens on `ListenPort`, so a peer
/// that sends IPv6 to the advertised port reaches nothing unless the two ports are equal.
fn wireguard_ipv6_mode(backend: &Backend) -> Result<(), ConfigError> {
    match backend.wireguard.mode {
        WireguardMode::Separate => Ok(()),
        mode => Err(ConfigError::Ipv6WireguardMode { mode }),
    }
}

/// `Backend.DirectRouting` (vxlan, ipip): false unless given.
fn direct_routing(obj: &Map<String, Value>) -> Result<bool, ConfigError> {
    Ok(bool_field(obj, "DirectRouting", "Backend.DirectRouting")?.unwrap_or(false))
}

/// The IPv4 fields, which flannel reads only with `"EnableIPv4": true` (its default).
const IPV4_FIELDS: [&str; 4] = ["Network", "SubnetLen", "SubnetMin", "SubnetMax"];

/// The IPv6 fields, which flannel reads only with `"EnableIPv6": true`.
const IPV6_FIELDS: [&str; 4] = ["IPv6Network", "IPv6SubnetLen", "IPv6SubnetMin", "IPv6SubnetMax"];

/// The IPv6 half of a config that says `"EnableIPv6": true`.
fn parse_ipv6(obj: &Map<String, Value>) -> Result<Ipv6NetworkConfig, ConfigError> {
    let network = match str_field(obj, "IPv6Network", "IPv6Network")? {
        None | Some("") => return Err(ConfigError::Missing { field: "IPv6Network" }),
        Some(text) => parse_network6(text)?,
    };
    let subnet_len = match uint_field(obj, "IPv6SubnetLen", "IPv6SubnetLen")? {
        // Like SubnetLen, a uint whose zero value means "unset".
        None | Some(0) => None,
        Some(len) if len > u64::from(MAX_IPV6_SUBNET_LEN) => {
            return Err(ConfigError::Ipv6SubnetLenTooLong { len });
        }
        // Fits: at most 126.
        Some(len) => Some(len as u8),
    };
    let subnet_min = addr6_field(obj, "IPv6SubnetMin")?;
    let subnet_max = addr6_field(obj, "IPv6SubnetMax")?;
    Ipv6NetworkConfig::new(network, subnet_len, subnet_min, subnet_max)
}

/// The hint after "missing" for a required field.
fn missing_hint(field: &str) -> &'static str {
    if field == "IPv6Network" {
        "\"EnableIPv6\" is true, so weft needs an IPv6 cluster network, e.g. \"fd00:10:244::/56\""
    } else {
        "weft needs an IPv4 cluster network, e.g. \"10.244.0.0/16\""
    }
}

fn in_range(field: &'static str, value: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::OutOfRange { field, value, min, max })
    }
}

/// Parses `Network`: `a.b.c.d/len`, no host bits. Written by hand rather than with ipnet's
/// `FromStr` so that only plain decimal lengths pass.
fn parse_network(text: &str) -> Result<Ipv4Net, ConfigError> {
    let bad = || ConfigError::BadCidr { field: "Network", value: text.to_owned() };
    let (addr, len) = text.split_once('/').ok_or_else(bad)?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
    if len.is_empty() || len.len() > 2 || !len.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let len: u8 = len.parse().map_err(|_| bad())?;
    let net = Ipv4Net::new(addr, len).map_err(|_| bad())?;
    if net.addr() != net.network() {
        return Err(ConfigError::HostBits {
            field: "Network",
            value: text.to_owned(),
            suggestion: net.trunc(),
        });
    }
    Ok(net)
}

/// Parses `IPv6Network`: `addr/len` with an IPv6 address (IPv4 text such as `10.0.0.0/8` is
/// refused), a plain decimal length up to 128, no host bits.
fn parse_network6(text: &str) -> Result<Ipv6Net, ConfigError> {
    let bad = || ConfigError::BadCidr6 { field: "IPv6Network", value: text.to_owned() };
    let (addr, len) = text.split_once('/').ok_or_else(bad)?;
    let addr: Ipv6Addr = addr.parse().map_err(|_| bad())?;
    if len.is_empty() || len.len() > 3 || !len.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let len: u8 = len.parse().map_err(|_| bad())?;
    let net = Ipv6Net::new(addr, len).map_err(|_| bad())?;
    if net.addr() != net.network() {
        return Err(ConfigError::HostBits6 {
            field: "IPv6Network",
            value: text.to_owned(),
            suggestion: net.trunc(),
        });
    }
    Ok(net)
}

/// Fails on an object of `json` (valid JSON) that has one key twice: serde_json's [`Value`]
/// keeps the last silently.
fn no_repeated_key(json: &[u8]) -> Result<(), ConfigError> {
    use serde::de::{self, Deserializer as _};
    /// A visitor that walks a whole JSON value and keeps nothing but the first repeated key.
    struct Walk;
    impl<'de> de::DeserializeSeed<'de> for Walk {
        type Value = ();
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> de::Visitor<'de> for Walk {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Walk)?.is_some() {}
            Ok(())
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = std::collections::BTreeSet::new();
            while let Some(key) = map.next_key::<String>()? {
                if !seen.insert(key.clone()) {
                    return Err(de::Error::custom(RepeatedKey(key)));
                }
                map.next_value_seed(Walk)?;
            }
            Ok(())
        }
    }
    /// The repeated key, carried through serde_json's error as its message.
    struct RepeatedKey(String);
    impl fmt::Display for RepeatedKey {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }
    let mut d = serde_json::Deserializer::from_slice(json);
    match d.deserialize_any(Walk) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Only a repeated key fails here: the text parsed as a Value before.
            let text = e.to_string();
            let key = text.split(" at line ").next().unwrap_or(&text);
            Err(ConfigError::RepeatedKey { key: key.chars().take(64).collect() })
        }
    }
}

/// The value of field `name` in `obj`, matched ASCII-case-insensitively; `null` counts as absent,
/// as it leaves a Go struct field untouched. `path` names the field in errors.
fn field<'a>(
    obj: &'a Map<String, Value>,
    name: &str,
    path: &'static str,
) -> Result<Option<&'a Value>, ConfigError> {
    let mut found: Option<(&String, &Value)> = None;
    for (key, value) in obj {
        if !key.eq_ignore_ascii_case(name) {
            continue;
        }
        if let Some((first, _)) = found {
            return Err(ConfigError::DuplicateField {
                field: path,
                first: first.clone(),
                second: key.clone(),
            });
        }
        found = Some((key, value));
    }
    Ok(found.map(|(_, v)| v).filter(|v| !v.is_null()))
}

fn str_field<'a>(
    obj: &'a Map<String, Value>,
    name: &str,
    path: &'static str,
) -> Result<Option<&'a str>, ConfigError> {
    match field(obj, name, path)? {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(path, "a string", other)),
    }
}

/// A non-negative integer field. Floats (even `24.0`) and negatives are refused, as Go refuses
/// them for a `uint`.
fn uint_field(
    obj: &Map<String, Value>,
    name: &str,
    path: &'static str,
) -> Result<Option<u64>, ConfigError> {
    match field(obj, name, path)? {
        None => Ok(None),
        Some(v) => {
            v.as_u64().map(Some).ok_or_else(|| wrong_type(path, "a non-negative integer", v))
        }
    }
}

fn bool_field(
    obj: &Map<String, Value>,
    name: &str,
    path: &'static str,
) -> Result<Option<bool>, ConfigError> {
    match field(obj, name, path)? {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong_type(path, "true or false", other)),
    }
}

/// `SubnetMin` or `SubnetMax`; `"0.0.0.0"` means unset, as flannel compares with `ip.IP4(0)`.
fn addr_field(
    obj: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<Ipv4Addr>, ConfigError> {
    let Some(text) = str_field(obj, name, name)? else {
        return Ok(None);
    };
    let addr: Ipv4Addr = text
        .parse()
        .map_err(|_| ConfigError::BadAddress { field: name, value: text.to_owned() })?;
    Ok(Some(addr).filter(|a| !a.is_unspecified()))
}

/// `IPv6SubnetMin` or `IPv6SubnetMax`; `"::"` means unset, as flannel's `ip.IsEmpty` says.
fn addr6_field(
    obj: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<Ipv6Addr>, ConfigError> {
    let Some(text) = str_field(obj, name, name)? else {
        return Ok(None);
    };
    let addr: Ipv6Addr = text
        .parse()
        .map_err(|_| ConfigError::BadAddress6 { field: name, value: text.to_owned() })?;
    Ok(Some(addr).filter(|a| !a.is_unspecified()))
}

/// Whether a value differs from Go's zero value (`null` is filtered out before this), for the
/// IPv6 fields: `""` and `"::"` (an unset `IPv6SubnetMin`) are zero too.
fn is_set(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => {
            !s.is_empty() && !s.parse::<Ipv6Addr>().is_ok_and(|a| a.is_unspecified())
        }
        Value::Array(a) => !a.is_empty(),
        Value::Object(_) => true,
    }
}

fn wrong_type(field: &'static str, expected: &'static str, found: &Value) -> ConfigError {
    // Bounded: the value came from an untrusted, possibly huge, document.
    const LIMIT: usize = 40;
    let mut text = found.to_string();
    if text.len() > LIMIT {
        let mut cut = LIMIT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    ConfigError::WrongType { field, expected, found: text }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use std::net::IpAddr;

    fn parse(json: &str) -> Result<NetworkConfig, ConfigError> {
        NetworkConfig::parse(json.as_bytes())
    }

    fn ok(json: &str) -> NetworkConfig {
        match parse(json) {
            Ok(c) => c,
            Err(e) => panic!("{json}: {e}"),
        }
    }

    fn err(json: &str) -> String {
        match parse(json) {
            Ok(c) => panic!("{json}: accepted as {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    /// Differences name each field that differs, in flannel's spelling, ours first; a
    /// backend's options only beside an unchanged type; none between equal configs.
    #[test]
    fn differences_name_each_field_that_differs() {
        let vxlan = ok(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan","VNI":4}}"#);
        assert_eq!(vxlan.differences(&vxlan.clone()), Vec::<String>::new());
        let spelled = ok(r#"{"network":"10.244.0.0/16","backend":{"type":"VXLAN","vni":4}}"#);
        assert_eq!(vxlan.differences(&spelled), Vec::<String>::new());
        let host_gw = ok(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"host-gw"}}"#);
        assert_eq!(vxlan.differences(&host_gw), ["Backend.Type vxlan -> host-gw"]);
        assert_eq!(host_gw.differences(&vxlan), ["Backend.Type host-gw -> vxlan"]);
        let moved = ok(
            r#"{"Network":"10.8.0.0/16","SubnetLen":26,"Backend":{"Type":"vxlan","VNI":5,"Port":4789,"DirectRouting":true}}"#,
        );
        assert_eq!(
            vxlan.differences(&moved),
            [
                "Network 10.244.0.0/16 -> 10.8.0.0/16",
                "SubnetLen 24 -> 26",
                "SubnetMin 10.244.1.0 -> 10.8.0.64",
                "SubnetMax 10.244.255.0 -> 10.8.255.192",
                "Backend.Port 8472 -> 4789",
                "Backend.VNI 4 -> 5",
                "Backend.DirectRouting false -> true",
            ]
        );
        let dual = ok(
            r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan","VNI":4}}"#,
        );
        assert_eq!(vxlan.differences(&dual), ["IPv6Network none -> fd00:10:244::/56"]);
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    #[rustfmt::skip]
    fn defaults_follow_flannel() {
        // (config, SubnetLen, SubnetMin, SubnetMax)
        let cases = [
            (r#"{"Network":"10.244.0.0/16"}"#, 24, "10.244.1.0", "10.244.255.0"),
            (r#"{"Network":"10.0.0.0/8"}"#, 24, "10.0.1.0", "10.255.255.0"),
            (r#"{"Network":"10.5.0.0/22"}"#, 24, "10.5.1.0", "10.5.3.0"),
            (r#"{"Network":"10.5.0.0/23"}"#, 25, "10.5.0.128", "10.5.1.128"),
            (r#"{"Network":"10.5.0.0/26"}"#, 28, "10.5.0.16", "10.5.0.48"),
            (r#"{"Network":"10.5.0.0/28"}"#, 30, "10.5.0.4", "10.5.0.12"),
            (r#"{"Network":"255.0.0.0/8"}"#, 24, "255.0.1.0", "255.255.255.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetLen":0}"#, 24, "10.0.1.0", "10.255.255.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetLen":16}"#, 16, "10.1.0.0", "10.255.0.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetLen":10}"#, 10, "10.64.0.0", "10.192.0.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetLen":30}"#, 30, "10.0.0.4", "10.255.255.252"),
            (r#"{"Network":"10.0.0.0/8","SubnetMin":"0.0.0.0"}"#, 24, "10.0.1.0", "10.255.255.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetMax":null}"#, 24, "10.0.1.0", "10.255.255.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetMin":"10.0.0.0"}"#, 24, "10.0.0.0", "10.255.255.0"),
            (r#"{"Network":"10.0.0.0/8","SubnetMax":"10.0.1.0"}"#, 24, "10.0.1.0", "10.0.1.0"),
        ];
        for (json, len, min, max) in cases {
            let c = ok(json).ipv4.unwrap();
            assert_eq!((c.subnet_len, c.subnet_min, c.subnet_max), (len, ip(min), ip(max)), "{json}");
        }
    }

    #[test]
    #[rustfmt::skip]
    fn backend_defaults_follow_flannel_code() {
        use BackendKind::{Alloc, HostGw, Ipip, Udp, Vxlan};
        const NET: &str = r#""Network":"10.0.0.0/8""#;
        let cases = [
            (format!("{{{NET}}}"), Udp, 8285, 1),
            (format!(r#"{{{NET},"Backend":null}}"#), Udp, 8285, 1),
            (format!(r#"{{{NET},"Backend":{{}}}}"#), Udp, 8285, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"udp"}}}}"#), Udp, 8285, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan"}}}}"#), Vxlan, 8472, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"VXLAN","VNI":42}}}}"#), Vxlan, 8472, 42),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Port":4789}}}}"#), Vxlan, 4789, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":16777215,"Port":65535}}}}"#),
                Vxlan, 65535, 16_777_215),
            // Options at their defaults are fine.
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","MTU":0,"GBP":false,"Learning":false,"DirectRouting":false}}}}"#),
                Vxlan, 8472, 1),
            // udp ignores vxlan's fields, as flannel's udp backend does.
            (format!(r#"{{{NET},"Backend":{{"Type":"udp","VNI":9,"DirectRouting":true}}}}"#), Udp, 8285, 1),
            // host-gw and alloc read nothing but the type.
            (format!(r#"{{{NET},"Backend":{{"Type":"host-gw"}}}}"#), HostGw, 0, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"Host-GW","Port":0,"VNI":"x","DirectRouting":true}}}}"#), HostGw, 0, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"alloc","Port":"x"}}}}"#), Alloc, 0, 1),
            // ipip reads DirectRouting alone (below), as flannel's.
            (format!(r#"{{{NET},"Backend":{{"Type":"ipip"}}}}"#), Ipip, 0, 1),
            (format!(r#"{{{NET},"Backend":{{"Type":"IPIP","Port":"x","VNI":9,"MTU":1400,"DirectRouting":false}}}}"#), Ipip, 0, 1),
        ];
        for (json, kind, port, vni) in cases {
            let b = ok(&json).backend;
            assert_eq!(b, Backend { kind, port, vni, direct_routing: false, wireguard: WireguardOptions::default() }, "{json}");
            assert_eq!(ok(&ok(&json).to_json()).backend, b, "{json} round trip");
        }
        let direct = ok(&format!(r#"{{{NET},"Backend":{{"Type":"vxlan","DirectRouting":true}}}}"#));
        assert!(direct.backend.direct_routing);
        assert!(direct.to_json().contains(r#""DirectRouting":true"#), "{}", direct.to_json());
        assert_eq!(ok(&direct.to_json()), direct);
        let ipip = ok(&format!(r#"{{{NET},"Backend":{{"Type":"ipip","DirectRouting":true}}}}"#));
        assert_eq!(ipip.backend.kind, Ipip);
        assert!(ipip.backend.direct_routing);
        assert_eq!(ipip.to_json().matches(r#""Backend":{"Type":"ipip","DirectRouting":true}"#).count(), 1, "{}", ipip.to_json());
        assert_eq!(ok(&ipip.to_json()), ipip);
        assert_eq!(ipip.backend.encap_overhead(), 20);
        assert!(Ipip.uses_tun() && !Ipip.has_port());
        assert_eq!(Backend::default().kind, Udp);
    }

    #[test]
    fn flannel_doc_example() {
        let c = ok(
            r#"{"Network":"10.0.0.0/8","SubnetLen":20,"SubnetMin":"10.10.0.0","SubnetMax":"10.99.0.0","Backend":{"Type":"udp","Port":7890}}"#,
        );
        assert_eq!(
            c,
            NetworkConfig {
                ipv4: Some(Ipv4NetworkConfig {
                    network: net("10.0.0.0/8"),
                    subnet_len: 20,
                    subnet_min: ip("10.10.0.0"),
                    subnet_max: ip("10.99.0.0"),
                }),
                ipv6: None,
                backend: Backend {
                    kind: BackendKind::Udp,
                    port: 7890,
                    vni: 1,
                    direct_routing: false,
                    wireguard: WireguardOptions::default(),
                },
            }
        );
        // 10.10.0.0 ..= 10.99.0.0 in steps of 16 addresses * 256.
        assert_eq!(c.subnet_count(), (99 - 10) * 16 + 1);
        assert_eq!(NetworkConfig::parse(c.to_json().as_bytes()).unwrap(), c);
    }

    #[test]
    fn field_names_are_case_insensitive() {
        let canonical = ok(
            r#"{"Network":"10.5.0.0/16","SubnetLen":26,"SubnetMin":"10.5.1.0","SubnetMax":"10.5.2.0","Backend":{"Type":"vxlan","VNI":7,"Port":4789}}"#,
        );
        for json in [
            r#"{"network":"10.5.0.0/16","subnetlen":26,"subnetmin":"10.5.1.0","subnetmax":"10.5.2.0","backend":{"type":"vxlan","vni":7,"port":4789}}"#,
            r#"{"NETWORK":"10.5.0.0/16","SUBNETLEN":26,"SUBNETMIN":"10.5.1.0","SUBNETMAX":"10.5.2.0","BACKEND":{"TYPE":"Vxlan","VNI":7,"PORT":4789}}"#,
            r#"{"nEtWoRk":"10.5.0.0/16","subnetLen":26,"subnetMin":"10.5.1.0","SubnetMAX":"10.5.2.0","Backend":{"Type":"vXlAn","Vni":7,"pOrt":4789}}"#,
        ] {
            assert_eq!(ok(json), canonical, "{json}");
        }
        let e = err(r#"{"ENABLEIPV6":true,"Network":"10.5.0.0/16"}"#);
        assert!(e.starts_with("IPv6Network: missing"), "{e}");
        let e = err(r#"{"ipv6network":"fd00::/56","Network":"10.5.0.0/16"}"#);
        assert!(e.starts_with("IPv6Network: set, but IPv6 is not enabled"), "{e}");
    }

    #[test]
    fn unknown_and_ignored_fields_pass() {
        let c = ok(
            r#"{"Network":"10.5.0.0/16","EnableIPv4":true,"EnableIPv6":false,"EnableNFTables":true,"IPv6Network":"","IPv6SubnetLen":0,"Whatever":[1,2,{"x":null}],"Backend":{"Type":"vxlan","Extra":"x"}}"#,
        );
        assert_eq!(c.ipv4.unwrap().network, net("10.5.0.0/16"));
    }

    #[test]
    #[rustfmt::skip]
    fn every_error_names_the_field() {
        const NET: &str = r#""Network":"10.5.0.0/16""#;
        let cases: &[(String, &str)] = &[
            ("".into(), "not JSON: "),
            ("{".into(), "not JSON: "),
            ("[1]".into(), "config must be a JSON object"),
            ("\"x\"".into(), "config must be a JSON object"),
            ("{}".into(), "Network: missing"),
            (r#"{"Network":null}"#.into(), "Network: missing"),
            (r#"{"Network":16}"#.into(), "Network: expected a string, found 16"),
            (r#"{"Network":"10.5.0.0"}"#.into(), r#"Network: "10.5.0.0" is not an IPv4 CIDR"#),
            (r#"{"Network":"10.5.0.0/33"}"#.into(), r#"Network: "10.5.0.0/33" is not an IPv4 CIDR"#),
            (r#"{"Network":"10.5.0.0/+8"}"#.into(), r#"Network: "10.5.0.0/+8" is not an IPv4 CIDR"#),
            (r#"{"Network":"fc00::/64"}"#.into(), r#"Network: "fc00::/64" is not an IPv4 CIDR"#),
            (r#"{"Network":"10.244.0.1/16"}"#.into(),
                r#"Network: "10.244.0.1/16" has host bits set (did you mean 10.244.0.0/16?)"#),
            (r#"{"Network":"0.0.0.0/0"}"#.into(), "Network: 0.0.0.0/0 is not a usable"),
            (r#"{"Network":"10.5.0.0/29"}"#.into(), "Network: 10.5.0.0/29 is too small"),
            (r#"{"Network":"10.5.0.0/29","SubnetLen":30}"#.into(), "Network: 10.5.0.0/29 is too small"),
            (format!(r#"{{{NET},"SubnetLen":31}}"#), "SubnetLen: 31 is longer than 30"),
            (format!(r#"{{{NET},"SubnetLen":4096}}"#), "SubnetLen: 4096 is longer than 30"),
            (format!(r#"{{{NET},"SubnetLen":17}}"#),
                "SubnetLen: 17 is too short for Network 10.5.0.0/16 (at least /18"),
            (format!(r#"{{{NET},"SubnetLen":"24"}}"#),
                r#"SubnetLen: expected a non-negative integer, found "24""#),
            (format!(r#"{{{NET},"SubnetLen":24.0}}"#),
                "SubnetLen: expected a non-negative integer, found 24.0"),
            (format!(r#"{{{NET},"SubnetLen":-1}}"#),
                "SubnetLen: expected a non-negative integer, found -1"),
            (format!(r#"{{{NET},"SubnetMin":"10.5.0.7"}}"#), "SubnetMin: 10.5.0.7 is not aligned to /24"),
            (format!(r#"{{{NET},"SubnetMax":"10.5.3.1"}}"#), "SubnetMax: 10.5.3.1 is not aligned to /24"),
            (format!(r#"{{{NET},"SubnetMin":"10.6.0.0"}}"#),
                "SubnetMin: 10.6.0.0 is outside Network 10.5.0.0/16"),
            (format!(r#"{{{NET},"SubnetMax":"10.4.255.0"}}"#),
                "SubnetMax: 10.4.255.0 is outside Network 10.5.0.0/16"),
            (format!(r#"{{{NET},"SubnetMin":"10.5.9"}}"#), r#"SubnetMin: "10.5.9" is not an IPv4 address"#),
            (format!(r#"{{{NET},"SubnetMin":""}}"#), r#"SubnetMin: "" is not an IPv4 address"#),
            (format!(r#"{{{NET},"SubnetMax":167772160}}"#), "SubnetMax: expected a string"),
            (format!(r#"{{{NET},"SubnetMin":"10.5.9.0","SubnetMax":"10.5.3.0"}}"#),
                "SubnetMin: 10.5.9.0 is above SubnetMax 10.5.3.0"),
            (format!(r#"{{{NET},"EnableIPv6":true}}"#),
                r#"IPv6Network: missing ("EnableIPv6" is true, so weft needs an IPv6 cluster network"#),
            (format!(r#"{{{NET},"IPv6Network":"fc00::/48"}}"#),
                r#"IPv6Network: set, but IPv6 is not enabled (add "EnableIPv6": true"#),
            (format!(r#"{{{NET},"IPv6SubnetLen":64}}"#), "IPv6SubnetLen: set, but IPv6 is not enabled"),
            (format!(r#"{{{NET},"EnableIPv6":"yes"}}"#), "EnableIPv6: expected true or false"),
            (format!(r#"{{{NET},"EnableIPv4":false}}"#),
                r#"EnableIPv4: false needs "EnableIPv6": true and an IPv6Network"#),
            (format!(r#"{{{NET},"EnableIPv4":1}}"#), "EnableIPv4: expected true or false"),
            (format!(r#"{{{NET},"network":"10.6.0.0/16"}}"#), "Network: given twice"),
            (format!(r#"{{{NET},"Network":"10.6.0.0/16"}}"#), r#""Network": given twice"#),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Type":"udp"}}}}"#), r#""Type": given twice"#),
            (format!(r#"{{{NET},"Foo":[{{"a":1,"a":1}}]}}"#), r#""a": given twice"#),
            (format!(r#"{{{NET},"Backend":"vxlan"}}"#), r#"Backend: expected an object, found "vxlan""#),
            (format!(r#"{{{NET},"Backend":{{"Port":8472}}}}"#), "Backend.Type: missing"),
            (format!(r#"{{{NET},"Backend":{{"Type":""}}}}"#), "Backend.Type: missing"),
            (format!(r#"{{{NET},"Backend":{{"Type":7}}}}"#), "Backend.Type: expected a string, found 7"),
            (format!(r#"{{{NET},"Backend":{{"Type":"extension"}}}}"#),
                r#"Backend.Type: "extension" is not supported (weft supports vxlan, udp, host-gw, ipip, wireguard and alloc)"#),
            (format!(r#"{{{NET},"EnableIPv6":true,"IPv6Network":"fc00::/48","Backend":{{"Type":"host-gw"}}}}"#),
                "EnableIPv6: the host-gw backend carries IPv4 only in weft"),
            (format!(r#"{{{NET},"Backend":{{"Type":"ipsec"}}}}"#),
                r#"Backend.Type: "ipsec" is not supported"#),
            // IP-in-IP of protocol 4 carries IPv4 alone, dual stack or IPv6-only.
            (format!(r#"{{{NET},"EnableIPv6":true,"IPv6Network":"fc00::/48","Backend":{{"Type":"ipip"}}}}"#),
                "EnableIPv6: the ipip backend carries IPv4 only"),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fc00::/48","Backend":{"Type":"ipip"}}"#.to_owned(),
                "EnableIPv6: the ipip backend carries IPv4 only"),
            (format!(r#"{{{NET},"Backend":{{"Type":"ipip","DirectRouting":"yes"}}}}"#),
                "Backend.DirectRouting: expected true or false"),
            (format!(r#"{{{NET},"Backend":{{"Type":"ipsec"}}}}"#), r#"Backend.Type: "ipsec" is not supported"#),
            (format!(r#"{{{NET},"Backend":{{"type":"vxlan","TYPE":"udp"}}}}"#), "Backend.Type: given twice"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":0}}}}"#),
                "Backend.VNI: 0 is out of range 1..=16777215"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":16777216}}}}"#),
                "Backend.VNI: 16777216 is out of range 1..=16777215"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":"1"}}}}"#),
                "Backend.VNI: expected a non-negative integer"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":1.5}}}}"#),
                "Backend.VNI: expected a non-negative integer"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","VNI":-1}}}}"#),
                "Backend.VNI: expected a non-negative integer"),
            (format!(r#"{{{NET},"Backend":{{"Type":"udp","Port":0}}}}"#),
                "Backend.Port: 0 is out of range 1..=65535"),
            (format!(r#"{{{NET},"Backend":{{"Type":"udp","Port":65536}}}}"#),
                "Backend.Port: 65536 is out of range 1..=65535"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Port":"8472"}}}}"#),
                "Backend.Port: expected a non-negative integer"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Port":-8472}}}}"#),
                "Backend.Port: expected a non-negative integer"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","MTU":1400}}}}"#),
                "Backend.MTU: 1400 is not supported yet"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","DirectRouting":1}}}}"#),
                "Backend.DirectRouting: expected true or false"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","GBP":true}}}}"#),
                "Backend.GBP: true is not supported yet"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Learning":true}}}}"#),
                "Backend.Learning: true is not supported yet"),
            (format!(r#"{{{NET},"Backend":{{"Type":"vxlan","Learning":"no"}}}}"#),
                "Backend.Learning: expected true or false"),
        ];
        for (json, want) in cases {
            let got = err(json);
            assert!(got.starts_with(want), "{json}\n  got:  {got}\n  want: {want}...");
        }
    }

    fn ip6(s: &str) -> Ipv6Addr {
        s.parse().unwrap()
    }

    fn net6(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    /// A dual-stack config: 10.244.0.0/16 plus `fields`, with `"EnableIPv6":true`.
    fn dual(fields: &str) -> String {
        format!(r#"{{"Network":"10.244.0.0/16","EnableIPv6":true,{fields}}}"#)
    }

    /// The IPv6 half of [`dual`]`(fields)`, which must parse.
    fn v6(fields: &str) -> Ipv6NetworkConfig {
        let json = dual(fields);
        ok(&json).ipv6.unwrap_or_else(|| panic!("{json}: no ipv6"))
    }

    #[test]
    #[rustfmt::skip]
    fn ipv6_defaults_follow_flannel() {
        // (IPv6 fields, IPv6SubnetLen, IPv6SubnetMin, IPv6SubnetMax)
        let cases = [
            (r#""IPv6Network":"fd00::/8""#, 64, "fd00:0:0:1::", "fdff:ffff:ffff:ffff::"),
            (r#""IPv6Network":"fd00:10:244::/56""#, 64, "fd00:10:244:1::", "fd00:10:244:ff::"),
            (r#""IPv6Network":"fd00:10:244::/62""#, 64, "fd00:10:244:1::", "fd00:10:244:3::"),
            (r#""IPv6Network":"fd00:10:244::/63""#, 65, "fd00:10:244:0:8000::", "fd00:10:244:1:8000::"),
            (r#""IPv6Network":"fd00::/124""#, 126, "fd00::4", "fd00::c"),
            // The top of the address space: no overflow past ffff:...:ffff.
            (r#""IPv6Network":"ffff::/16""#, 64, "ffff:0:0:1::", "ffff:ffff:ffff:ffff::"),
            (r#""IPv6Network":"ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff0/124""#, 126,
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff4", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffc"),
            (r#""IPv6Network":"8000::/1","IPv6SubnetLen":126"#, 126, "8000::4", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffc"),
            // Zero values and null mean unset.
            (r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":0"#, 64, "fd00:10:244:1::", "fd00:10:244:ff::"),
            (r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":null"#, 64, "fd00:10:244:1::", "fd00:10:244:ff::"),
            (r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetMin":"::","IPv6SubnetMax":null"#,
                64, "fd00:10:244:1::", "fd00:10:244:ff::"),
            // Explicit lengths: prefix + 2 and 126 are the bounds.
            (r#""IPv6Network":"fd00::/56","IPv6SubnetLen":58"#, 58, "fd00:0:0:40::", "fd00:0:0:c0::"),
            (r#""IPv6Network":"fd00::/64","IPv6SubnetLen":126"#, 126, "fd00::4", "fd00::ffff:ffff:ffff:fffc"),
            (r#""IPv6Network":"fd00::/48","IPv6SubnetLen":80"#, 80, "fd00::1:0:0:0", "fd00:0:0:ffff:ffff::"),
            // Explicit bounds, including the first subnet and a single-subnet range.
            (r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetMin":"fd00:10:244::""#,
                64, "fd00:10:244::", "fd00:10:244:ff::"),
            (r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetMin":"fd00:10:244:7::","IPv6SubnetMax":"fd00:10:244:7::""#,
                64, "fd00:10:244:7::", "fd00:10:244:7::"),
            // Any case of the IPv6 address text.
            (r#""IPv6Network":"FD00:10:244::/56","IPv6SubnetMax":"FD00:10:244:0F::""#,
                64, "fd00:10:244:1::", "fd00:10:244:f::"),
        ];
        for (fields, len, min, max) in cases {
            let c = v6(fields);
            assert_eq!(
                (c.subnet_len, c.subnet_min, c.subnet_max),
                (len, ip6(min), ip6(max)),
                "{fields}"
            );
            assert_eq!((c.subnet_min(), c.subnet_max()), (c.subnet_min, c.subnet_max));
        }
        // The IPv4 half is untouched by the IPv6 half.
        let c = ok(&dual(r#""IPv6Network":"fd00:10:244::/56""#));
        let v4 = c.ipv4.unwrap();
        assert_eq!((v4.network, v4.subnet_len), (net("10.244.0.0/16"), 24));
        assert_eq!(c.ipv6.unwrap().network, net6("fd00:10:244::/56"));
    }

    #[test]
    #[rustfmt::skip]
    fn ipv6_errors_name_the_field() {
        const N: &str = r#""IPv6Network":"fd00:10:244::/56""#;
        let cases: &[(String, &str)] = &[
            (dual(r#""IPv6Network":"""#), "IPv6Network: missing"),
            (dual(r#""IPv6Network":null"#), "IPv6Network: missing"),
            (dual(r#""IPv6SubnetLen":64"#), "IPv6Network: missing"),
            (dual(r#""IPv6Network":56"#), "IPv6Network: expected a string, found 56"),
            (dual(r#""IPv6Network":"10.244.0.0/16""#),
                r#"IPv6Network: "10.244.0.0/16" is not an IPv6 CIDR (expected e.g. fd00:10:244::/56)"#),
            (dual(r#""IPv6Network":"::ffff:10.244.0.0/200""#), "IPv6Network: \"::ffff:10.244.0.0/200\" is not an IPv6 CIDR"),
            (dual(r#""IPv6Network":"fd00::""#), r#"IPv6Network: "fd00::" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fd00::/129""#), r#"IPv6Network: "fd00::/129" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fd00::/+64""#), r#"IPv6Network: "fd00::/+64" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fd00::/0064""#), r#"IPv6Network: "fd00::/0064" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fd00::/""#), r#"IPv6Network: "fd00::/" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"/64""#), r#"IPv6Network: "/64" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fe80::%eth0/64""#), r#"IPv6Network: "fe80::%eth0/64" is not an IPv6 CIDR"#),
            (dual(r#""IPv6Network":"fd00:10:244::1/56""#),
                r#"IPv6Network: "fd00:10:244::1/56" has host bits set (did you mean fd00:10:244::/56?)"#),
            (dual(r#""IPv6Network":"::/0""#), "IPv6Network: ::/0 is not a usable cluster network"),
            (dual(r#""IPv6Network":"::/0","IPv6SubnetLen":64"#), "IPv6Network: ::/0 is not a usable"),
            (dual(r#""IPv6Network":"fd00::/125""#),
                "IPv6Network: fd00::/125 is too small (the smallest useful network is a /124)"),
            (dual(r#""IPv6Network":"fd00::/125","IPv6SubnetLen":126"#), "IPv6Network: fd00::/125 is too small"),
            (dual(r#""IPv6Network":"fd00::/128""#), "IPv6Network: fd00::/128 is too small"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":127"#)), "IPv6SubnetLen: 127 is longer than 126"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":128"#)), "IPv6SubnetLen: 128 is longer than 126"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":4096"#)), "IPv6SubnetLen: 4096 is longer than 126"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":57"#)),
                "IPv6SubnetLen: 57 is too short for IPv6Network fd00:10:244::/56 (at least /58, so that \
                 the network holds four subnets)"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":56"#)), "IPv6SubnetLen: 56 is too short"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":1"#)), "IPv6SubnetLen: 1 is too short"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":"64""#)),
                r#"IPv6SubnetLen: expected a non-negative integer, found "64""#),
            (dual(&format!(r#"{N},"IPv6SubnetLen":-1"#)), "IPv6SubnetLen: expected a non-negative integer"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":64.0"#)), "IPv6SubnetLen: expected a non-negative integer"),
            (dual(&format!(r#"{N},"IPv6SubnetMin":"fd00:10:245::""#)),
                "IPv6SubnetMin: fd00:10:245:: is outside IPv6Network fd00:10:244::/56"),
            (dual(&format!(r#"{N},"IPv6SubnetMax":"fd00:10:243:ff::""#)),
                "IPv6SubnetMax: fd00:10:243:ff:: is outside IPv6Network fd00:10:244::/56"),
            (dual(&format!(r#"{N},"IPv6SubnetMin":"fd00:10:244:1::1""#)),
                "IPv6SubnetMin: fd00:10:244:1::1 is not aligned to /64"),
            (dual(&format!(r#"{N},"IPv6SubnetMax":"fd00:10:244:f0:8000::""#)),
                "IPv6SubnetMax: fd00:10:244:f0:8000:: is not aligned to /64"),
            (dual(&format!(r#"{N},"IPv6SubnetLen":60,"IPv6SubnetMax":"fd00:10:244:f8::""#)),
                "IPv6SubnetMax: fd00:10:244:f8:: is not aligned to /60"),
            (dual(&format!(r#"{N},"IPv6SubnetMin":"10.244.1.0""#)),
                r#"IPv6SubnetMin: "10.244.1.0" is not an IPv6 address"#),
            (dual(&format!(r#"{N},"IPv6SubnetMax":"""#)), r#"IPv6SubnetMax: "" is not an IPv6 address"#),
            (dual(&format!(r#"{N},"IPv6SubnetMax":"fd00:10:244:f::/64""#)),
                r#"IPv6SubnetMax: "fd00:10:244:f::/64" is not an IPv6 address"#),
            (dual(&format!(r#"{N},"IPv6SubnetMin":5"#)), "IPv6SubnetMin: expected a string, found 5"),
            (dual(&format!(r#"{N},"IPv6SubnetMin":"fd00:10:244:9::","IPv6SubnetMax":"fd00:10:244:3::""#)),
                "IPv6SubnetMin: fd00:10:244:9:: is above IPv6SubnetMax fd00:10:244:3::"),
            // The default IPv6SubnetMin is the second subnet: a Max below it leaves nothing.
            (dual(&format!(r#"{N},"IPv6SubnetMax":"fd00:10:244::""#)),
                "IPv6SubnetMin: fd00:10:244:1:: is above IPv6SubnetMax fd00:10:244::"),
            (dual(&format!(r#"{N},"ipv6network":"fd00::/56""#)), "IPv6Network: given twice"),
            (dual(&format!(r#"{N},"IPV6SUBNETLEN":64,"IPv6SubnetLen":64"#)), "IPv6SubnetLen: given twice"),
            // The IPv4 half is checked first.
            (r#"{"Network":"10.5.0.0/29","EnableIPv6":true,"IPv6Network":"fd00::/125"}"#.into(),
                "Network: 10.5.0.0/29 is too small"),
            (r#"{"EnableIPv6":true,"IPv6Network":"fd00::/56"}"#.into(), "Network: missing"),
            // IPv6-only: vxlan only, no IPv4 field, and the IPv6 half's own errors.
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00::/56"}"#.into(),
                "Backend.Type: udp carries IPv4 only (as flannel's), so an IPv6-only network"),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00::/56","Backend":{"Type":"udp"}}"#.into(),
                "Backend.Type: udp carries IPv4 only"),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00::/56","Network":"10.5.0.0/16","Backend":{"Type":"vxlan"}}"#.into(),
                r#"Network: set, but "EnableIPv4" is false (an IPv6-only network has no IPv4 fields"#),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00::/56","subnetlen":24,"Backend":{"Type":"vxlan"}}"#.into(),
                r#"SubnetLen: set, but "EnableIPv4" is false"#),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"Backend":{"Type":"vxlan"}}"#.into(),
                "IPv6Network: missing"),
            (r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00::/125","Backend":{"Type":"vxlan"}}"#.into(),
                "IPv6Network: fd00::/125 is too small"),
            (r#"{"EnableIPv4":false,"Backend":{"Type":"vxlan"}}"#.into(),
                r#"EnableIPv4: false needs "EnableIPv6": true"#),
            // IPv6 fields without EnableIPv6: true name the field.
            (r#"{"Network":"10.5.0.0/16","EnableIPv6":false,"IPv6Network":"fd00::/56"}"#.into(),
                r#"IPv6Network: set, but IPv6 is not enabled (add "EnableIPv6": true for a dual-stack network, or remove the field)"#),
            (r#"{"Network":"10.5.0.0/16","EnableIPv6":null,"ipv6network":"fd00::/56"}"#.into(),
                "IPv6Network: set, but IPv6 is not enabled"),
            (r#"{"Network":"10.5.0.0/16","IPv6SubnetMin":"fd00::"}"#.into(),
                "IPv6SubnetMin: set, but IPv6 is not enabled"),
            (r#"{"Network":"10.5.0.0/16","IPv6SubnetMax":"garbage"}"#.into(),
                "IPv6SubnetMax: set, but IPv6 is not enabled"),
            (r#"{"Network":"10.5.0.0/16","IPv6SubnetLen":1}"#.into(), "IPv6SubnetLen: set, but IPv6 is not enabled"),
        ];
        for (json, want) in cases {
            let got = err(json);
            assert!(got.starts_with(want), "{json}\n  got:  {got}\n  want: {want}...");
        }
    }

    #[test]
    fn ipv6_field_names_are_case_insensitive() {
        let canonical = v6(
            r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":60,"IPv6SubnetMin":"fd00:10:244:20::","IPv6SubnetMax":"fd00:10:244:80::""#,
        );
        for json in [
            r#"{"network":"10.244.0.0/16","enableipv6":true,"ipv6network":"fd00:10:244::/56","ipv6subnetlen":60,"ipv6subnetmin":"fd00:10:244:20::","ipv6subnetmax":"fd00:10:244:80::"}"#,
            r#"{"NETWORK":"10.244.0.0/16","ENABLEIPV6":true,"IPV6NETWORK":"fd00:10:244::/56","IPV6SUBNETLEN":60,"IPV6SUBNETMIN":"fd00:10:244:20::","IPV6SUBNETMAX":"fd00:10:244:80::"}"#,
            r#"{"Network":"10.244.0.0/16","EnableIpv6":true,"Ipv6Network":"fd00:10:244::/56","iPv6SubnetLen":60,"IPv6subnetMin":"fd00:10:244:20::","IPV6SubnetMax":"fd00:10:244:80::"}"#,
        ] {
            assert_eq!(ok(json).ipv6, Some(canonical), "{json}");
        }
    }

    #[test]
    fn ipv6_zero_values_without_enable_pass() {
        for json in [
            r#"{"Network":"10.5.0.0/16","EnableIPv6":false,"IPv6Network":"","IPv6SubnetLen":0,"IPv6SubnetMin":"::","IPv6SubnetMax":null}"#,
            r#"{"Network":"10.5.0.0/16","ipv6subnetmin":"0::0","IPv6SubnetMax":"","EnableIPv4":true}"#,
            r#"{"Network":"10.5.0.0/16","EnableIPv6":null,"IPv6Network":null}"#,
        ] {
            assert_eq!(ok(json).ipv6, None, "{json}");
        }
    }

    #[test]
    fn ipv6_to_json_is_canonical_and_round_trips() {
        let c = ok(
            r#"{"network":"10.244.0.0/16","ENABLEIPV6":true,"ipv6network":"FD00:10:244::/56","backend":{"type":"vxlan"}}"#,
        );
        assert_eq!(
            c.to_json(),
            r#"{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.255.0","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","IPv6SubnetLen":64,"IPv6SubnetMin":"fd00:10:244:1::","IPv6SubnetMax":"fd00:10:244:ff::","Backend":{"Type":"vxlan","VNI":1,"Port":8472}}"#
        );
        assert_eq!(NetworkConfig::parse(c.to_json().as_bytes()).unwrap(), c);
        // IPv4-only configs gain nothing.
        let u = ok(r#"{"Network":"10.244.0.0/16","EnableIPv6":false}"#);
        assert!(!u.to_json().contains("IPv6"), "{}", u.to_json());
        // The edges round-trip too: the top of the space, a /1, an explicit first subnet.
        for fields in [
            r#""IPv6Network":"ffff::/16""#,
            r#""IPv6Network":"8000::/1","IPv6SubnetLen":126"#,
            r#""IPv6Network":"::/1","IPv6SubnetMin":"0:0:0:1::""#,
            r#""IPv6Network":"fd00::/124","IPv6SubnetMin":"fd00::","IPv6SubnetMax":"fd00::""#,
        ] {
            let c = ok(&dual(fields));
            assert_eq!(NetworkConfig::parse(c.to_json().as_bytes()).unwrap(), c, "{fields}");
        }
    }

    #[test]
    fn ipv6_new_validates_like_parse() {
        let n = net6("fd00:10:244::/56");
        assert!(Ipv6NetworkConfig::new(net6("fd00:10:244::1/56"), None, None, None).is_err());
        assert!(Ipv6NetworkConfig::new(net6("::/0"), Some(64), None, None).is_err());
        assert!(Ipv6NetworkConfig::new(net6("fd00::/125"), None, None, None).is_err());
        assert!(Ipv6NetworkConfig::new(n, Some(0), None, None).is_err());
        assert!(Ipv6NetworkConfig::new(n, Some(57), None, None).is_err());
        assert!(Ipv6NetworkConfig::new(n, Some(127), None, None).is_err());
        assert!(Ipv6NetworkConfig::new(n, Some(255), None, None).is_err());
        let outside = Some(ip6("fd00:10:245::"));
        assert!(Ipv6NetworkConfig::new(n, None, outside, None).is_err());
        assert!(Ipv6NetworkConfig::new(n, None, None, outside).is_err());
        assert!(Ipv6NetworkConfig::new(n, None, Some(ip6("fd00:10:244:1::1")), None).is_err());
        let c = Ipv6NetworkConfig::new(n, None, None, None).unwrap();
        assert_eq!(c, v6(r#""IPv6Network":"fd00:10:244::/56""#));
        // Unlike the parser, new takes `::` literally: an address, here outside the network.
        assert!(Ipv6NetworkConfig::new(n, None, Some(Ipv6Addr::UNSPECIFIED), None).is_err());
    }

    #[test]
    fn ipv6_fits_and_subnet_count_at_the_edges() {
        let c = v6(r#""IPv6Network":"fd00:10:244::/56""#);
        assert_eq!(c.subnet_count(), 255);
        assert!(!c.fits(net6("fd00:10:244::/64")), "the first subnet is skipped");
        assert!(c.fits(net6("fd00:10:244:1::/64")));
        assert!(c.fits(net6("fd00:10:244:ff::/64")), "the last subnet is usable");
        assert!(!c.fits(net6("fd00:10:245::/64")), "outside the network");
        assert!(!c.fits(net6("fd00:10:243:ff::/64")), "outside the network");
        assert!(!c.fits(net6("fd00:10:244:2::/65")), "wrong length");
        assert!(!c.fits(net6("fd00:10:244::/56")), "the network itself");
        assert!(!c.fits(net6("fd00:10:244:2::1/64")), "host bits");
        let r = v6(
            r#""IPv6Network":"fd00:10:244::/56","IPv6SubnetMin":"fd00:10:244:3::","IPv6SubnetMax":"fd00:10:244:5::""#,
        );
        assert_eq!(r.subnet_count(), 3);
        assert!(!r.fits(net6("fd00:10:244:2::/64")) && !r.fits(net6("fd00:10:244:6::/64")));
        assert!(r.fits(net6("fd00:10:244:3::/64")) && r.fits(net6("fd00:10:244:5::/64")));

        // A /48 holds 65,536 /64s, a /8 2^56; the defaults skip the first.
        assert_eq!(v6(r#""IPv6Network":"fd00:1::/48""#).subnet_count(), 65_535);
        assert_eq!(
            v6(r#""IPv6Network":"fd00:1::/48","IPv6SubnetMin":"fd00:1::""#).subnet_count(),
            65_536
        );
        assert_eq!(v6(r#""IPv6Network":"fd00::/8""#).subnet_count(), (1 << 56) - 1);
        assert_eq!(
            v6(r#""IPv6Network":"fd00::/8","IPv6SubnetMin":"fd00::""#).subnet_count(),
            1 << 56
        );
        // The largest a parsed config gets: a /1 in /126s.
        let huge = v6(r#""IPv6Network":"::/1","IPv6SubnetLen":126,"IPv6SubnetMin":"::1:0""#);
        assert_eq!(huge.subnet_count(), (1 << 125) - (1 << 14));
        let huge = v6(r#""IPv6Network":"8000::/1","IPv6SubnetLen":126"#);
        assert_eq!(huge.subnet_count(), (1 << 125) - 1);
        assert!(huge.fits(net6("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffc/126")));
        assert!(!huge.fits(net6("8000::/126")));
        assert!(!huge.fits(net6("7fff:ffff:ffff:ffff:ffff:ffff:ffff:fffc/126")));
        // The top of the address space.
        let top = v6(r#""IPv6Network":"ffff::/16""#);
        assert_eq!(top.subnet_count(), (1 << 48) - 1);
        assert!(top.fits(net6("ffff:ffff:ffff:ffff::/64")));
    }

    #[test]
    fn hand_built_invalid_ipv6_configs_do_not_panic() {
        let mut c = v6(r#""IPv6Network":"fd00:10:244::/56""#);
        c.subnet_len = 200;
        assert_eq!(c.subnet_count(), 0);
        assert!(!c.fits(net6("fd00:10:244:1::/64")));
        c.subnet_len = 64;
        c.subnet_min = ip6("fd00:10:244:9::");
        c.subnet_max = ip6("fd00:10:244:1::");
        assert_eq!(c.subnet_count(), 0);
        assert!(!c.fits(net6("fd00:10:244:5::/64")));
        // A /0 "subnet": one, with no shift by 128.
        c.subnet_len = 0;
        c.subnet_min = Ipv6Addr::UNSPECIFIED;
        c.subnet_max = Ipv6Addr::UNSPECIFIED;
        assert_eq!(c.subnet_count(), 1);
        // Every /128 there is: 2^128, which saturates.
        c.subnet_len = 128;
        c.subnet_max = Ipv6Addr::from(u128::MAX);
        assert_eq!(c.subnet_count(), u128::MAX);
        c.network = net6("::/0");
        assert!(
            c.fits(net6("::/128")) && c.fits(net6("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff/128"))
        );
        let json = NetworkConfig { ipv6: Some(c), ..ok(r#"{"Network":"10.5.0.0/16"}"#) }.to_json();
        assert!(NetworkConfig::parse(json.as_bytes()).is_err(), "{json}");
    }

    #[test]
    fn wrong_type_message_is_bounded() {
        let long = "x".repeat(10_000);
        let e = err(&format!(r#"{{"Network":"10.5.0.0/16","SubnetLen":"{long}"}}"#));
        assert!(e.len() < 120, "{e}");
    }

    #[test]
    fn new_validates_like_parse() {
        let vx = Backend::new(BackendKind::Vxlan);
        assert!(NetworkConfig::new(net("10.5.0.1/16"), None, None, None, vx).is_err());
        assert!(NetworkConfig::new(net("10.5.0.0/16"), Some(31), None, None, vx).is_err());
        let bad_vni = Backend { vni: 0, ..vx };
        assert!(NetworkConfig::new(net("10.5.0.0/16"), None, None, None, bad_vni).is_err());
        let bad_port = Backend { port: 0, ..vx };
        assert!(NetworkConfig::new(net("10.5.0.0/16"), None, None, None, bad_port).is_err());
        let c = NetworkConfig::new(net("10.5.0.0/16"), None, None, None, vx).unwrap();
        assert_eq!(c, ok(r#"{"Network":"10.5.0.0/16","Backend":{"Type":"vxlan"}}"#));
    }

    #[test]
    fn to_json_is_canonical() {
        let c = ok(r#"{"network":"10.244.0.0/16","backend":{"type":"VXLAN"}}"#);
        assert_eq!(
            c.to_json(),
            r#"{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.255.0","Backend":{"Type":"vxlan","VNI":1,"Port":8472}}"#
        );
        let u = ok(r#"{"Network":"10.244.0.0/16"}"#);
        assert_eq!(
            u.to_json(),
            r#"{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.255.0","Backend":{"Type":"udp","Port":8285}}"#
        );
    }

    const PSK: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";

    #[test]
    fn wireguard_takes_flannels_options_and_defaults() {
        let c = ok(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"wireguard"}}"#);
        assert_eq!(c.backend.kind, BackendKind::Wireguard);
        assert_eq!(c.backend.port, 51820);
        assert_eq!(c.backend.wireguard, WireguardOptions::default());
        assert_eq!(c.backend.wireguard.listen_port_v6, 51821);
        assert_eq!(c.backend.wireguard.mode, WireguardMode::Separate);
        // flannel's MTU: the underlay's less 80.
        assert_eq!(c.backend.overlay_mtu(1500), 1420);
        assert_eq!(c.backend.encap_overhead(), 80);

        let json = format!(
            r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"WireGuard","ListenPort":51000,"ListenPortV6":51001,"MTU":9000,"PSK":"{PSK}","PersistentKeepaliveInterval":25,"Mode":"auto"}}}}"#
        );
        let c = ok(&json);
        let wg = c.backend.wireguard;
        assert_eq!(c.backend.port, 51000);
        assert_eq!(wg.listen_port_v6, 51001);
        assert_eq!(wg.mtu, Some(9000));
        assert_eq!(wg.psk, Some(WgSecret::parse(PSK).unwrap()));
        assert_eq!(wg.keepalive_secs, 25);
        assert_eq!(wg.mode, WireguardMode::Auto);
        // Backend.MTU stands for the underlay's.
        assert_eq!(c.backend.overlay_mtu(1500), 8920);
        // Written back, it parses to the same config (the handover's round trip).
        assert_eq!(ok(&c.to_json()), c);
        // An MTU of 0 and an empty PSK are unset, as in flannel.
        let c =
            ok(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"wireguard","MTU":0,"PSK":""}}"#);
        assert_eq!((c.backend.wireguard.mtu, c.backend.wireguard.psk), (None, None));
        assert_eq!(ok(&c.to_json()), c);
    }

    #[test]
    fn wireguard_options_out_of_range_or_of_the_wrong_shape_are_refused_by_name() {
        let wg = |opts: &str| {
            err(&format!(
                r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"wireguard",{opts}}}}}"#
            ))
        };
        assert!(
            wg(r#""Mode":"Auto""#).contains(r#"Backend.Mode: "Auto" is not a mode"#),
            "{}",
            wg(r#""Mode":"Auto""#)
        );
        assert!(wg(r#""Mode":"both""#).contains("Backend.Mode"));
        assert!(wg(r#""ListenPort":0"#).contains("Backend.ListenPort"));
        assert!(wg(r#""ListenPortV6":65536"#).contains("Backend.ListenPortV6"));
        assert!(wg(r#""MTU":600"#).contains("Backend.MTU"));
        assert!(
            wg(r#""PersistentKeepaliveInterval":-1"#)
                .contains("Backend.PersistentKeepaliveInterval")
        );
        assert!(
            wg(r#""PersistentKeepaliveInterval":65536"#)
                .contains("Backend.PersistentKeepaliveInterval")
        );
        // A bad PSK is named, and its text is never repeated.
        let bad = "c2VjcmV0LXRoYXQtaXMtdG9vLXNob3J0";
        let e = wg(&format!(r#""PSK":"{bad}""#));
        assert!(e.contains("Backend.PSK") && !e.contains(bad), "{e}");
        // IPv6 is carried in Mode separate (the default), dual-stack and IPv6-only; the
        // other modes are refused with IPv6, naming the mode.
        let dual = r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"wireguard""#;
        let only = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"wireguard""#;
        for head in [dual, only] {
            for mode in ["", r#","Mode":"separate""#] {
                let c = ok(&format!("{head}{mode}}}}}"));
                assert_eq!(c.backend.wireguard.mode, WireguardMode::Separate);
                assert_eq!(c.ipv6.unwrap().network, "fd00:10:244::/56".parse().unwrap());
                assert_eq!(c.ipv4.is_some(), head == dual);
                assert_eq!(NetworkConfig::parse(c.to_json().as_bytes()).unwrap(), c);
            }
            for mode in ["auto", "ipv4", "ipv6"] {
                let e = err(&format!(r#"{head},"Mode":"{mode}"}}}}"#));
                assert!(
                    e.contains(&format!(
                        "Backend.Mode: \"{mode}\" is not supported with EnableIPv6"
                    )),
                    "{e}"
                );
            }
        }
        // Without IPv6 every mode is one IPv4 device, as in flannel.
        for mode in ["separate", "auto", "ipv4", "ipv6"] {
            ok(&format!(
                r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"wireguard","Mode":"{mode}"}}}}"#
            ));
        }
    }

    #[test]
    fn a_changed_wireguard_option_is_named_and_a_psk_never_shown() {
        let a = ok(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"wireguard"}}"#);
        let b = ok(&format!(
            r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"wireguard","ListenPort":51000,"PSK":"{PSK}","Mode":"ipv4"}}}}"#
        ));
        let d = a.differences(&b);
        assert_eq!(
            d,
            [
                "Backend.ListenPort 51820 -> 51000",
                "Backend.Mode separate -> ipv4",
                "Backend.PSK none -> set"
            ]
        );
        let other = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        let c = ok(&format!(
            r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"wireguard","ListenPort":51000,"PSK":"{other}","Mode":"ipv4"}}}}"#
        ));
        assert_eq!(b.differences(&c), ["Backend.PSK set -> another"]);
        // Neither the differences nor the config's Debug show a key.
        let shown = format!("{d:?} {b:?} {c:?}");
        assert!(!shown.contains(&PSK[..10]) && !shown.contains(&other[..10]), "{shown}");
    }

    #[test]
    fn backend_names_and_overheads() {
        assert_eq!(BackendKind::Vxlan.as_str(), "vxlan");
        assert_eq!(BackendKind::Udp.as_str(), "udp");
        assert_eq!(BackendKind::Vxlan.to_string(), "vxlan");
        assert_eq!(Backend::new(BackendKind::Vxlan).encap_overhead(), 50);
        assert_eq!(Backend::new(BackendKind::Udp).encap_overhead(), 28);
    }

    #[test]
    fn a_network_that_contains_the_underlay_is_refused_naming_the_overlap() {
        let c = ok(r#"{"Network":"10.0.0.0/8"}"#);
        let u = |what: &str, a: &str| UnderlayAddr { what: what.into(), addr: ip(a) };
        assert_eq!(
            c.check_underlay(&[u("public IP", "192.0.2.1"), u("etcd", "127.0.0.1")]),
            Ok(())
        );
        let e = c
            .check_underlay(&[
                u("this host's public IP", "192.0.2.1"),
                u("etcd endpoint x", "10.1.2.3"),
            ])
            .unwrap_err();
        assert_eq!(e.addr, ip("10.1.2.3"));
        let text = e.to_string();
        assert!(
            text.contains("10.0.0.0/8")
                && text.contains("etcd endpoint x")
                && text.contains("10.1.2.3"),
            "{text}"
        );
    }

    #[test]
    fn endpoint_addresses_are_read_from_urls() {
        assert_eq!(endpoint_ipv4("http://10.0.0.5:2379"), Some(ip("10.0.0.5")));
        assert_eq!(endpoint_ipv4("https://user@10.0.0.6:2379/x"), Some(ip("10.0.0.6")));
        assert_eq!(endpoint_ipv4("10.0.0.7:2379"), Some(ip("10.0.0.7")));
        assert_eq!(endpoint_ipv4("10.0.0.8"), Some(ip("10.0.0.8")));
        assert_eq!(endpoint_ipv4("http://etcd.example:2379"), None);
        assert_eq!(endpoint_ipv4("http://[2001:db8::1]:2379"), None);
        assert_eq!(endpoint_ipv4(""), None);
    }

    #[test]
    fn subnets_and_fits() {
        let c = ok(r#"{"Network":"10.5.0.0/22"}"#);
        let all: Vec<String> = c.subnets().map(|s| s.to_string()).collect();
        assert_eq!(all, ["10.5.1.0/24", "10.5.2.0/24", "10.5.3.0/24"]);
        assert_eq!(c.subnet_count(), 3);
        let s = |t: &str| t.parse::<Subnet>().unwrap();
        assert!(!c.fits(s("10.5.0.0/24")), "the first subnet is skipped");
        assert!(c.fits(s("10.5.3.0/24")), "the last subnet is usable");
        assert!(!c.fits(s("10.5.2.0/25")));
        assert!(!c.fits(s("10.5.4.0/24")));
        // The top of the address space: no overflow past 255.255.255.255.
        let top = ok(r#"{"Network":"255.255.255.0/24","SubnetLen":26}"#);
        assert_eq!(top.ipv4.unwrap().subnet_max, ip("255.255.255.192"));
        assert_eq!(top.subnets().count(), 3);
    }

    #[test]
    fn hand_built_invalid_configs_do_not_panic() {
        let mut c = ok(r#"{"Network":"10.5.0.0/16"}"#).ipv4.unwrap();
        c.subnet_len = 40;
        assert_eq!(c.subnet_count(), 0);
        assert_eq!(c.subnets().count(), 0);
        c.subnet_len = 24;
        c.subnet_min = ip("10.5.9.0");
        c.subnet_max = ip("10.5.1.0");
        assert_eq!(c.subnet_count(), 0);
        c.subnet_len = 0;
        c.subnet_min = ip("0.0.0.0");
        c.subnet_max = ip("0.0.0.0");
        assert_eq!(c.subnet_count(), 1);
    }

    /// A valid config as JSON with randomly cased keys, and what it must parse to. Sizes are
    /// kept to at most 256 subnets so that properties can walk them all.
    fn valid_config() -> impl Strategy<Value = (String, NetworkConfig)> {
        (8u8..=28, any::<u32>())
            .prop_flat_map(|(prefix, addr)| {
                let net = Ipv4Net::new(Ipv4Addr::from(addr), prefix).unwrap().trunc();
                let max_len = (prefix + 8).min(MAX_SUBNET_LEN);
                (
                    Just(net),
                    prop::option::of(prefix + 2..=max_len),
                    any::<u64>(),
                    any::<u64>(),
                    any::<bool>(),
                    any::<bool>(),
                    any::<bool>(),
                    prop::option::of(1u16..),
                    prop::option::of(1..=MAX_VNI),
                    any::<u64>(),
                    prop::option::of(valid_ipv6()),
                    any::<bool>(),
                )
            })
            .prop_map(|(net, len, a, b, give_min, give_max, vxlan, port, vni, case, ipv6, only)| {
                let prefix = net.prefix_len();
                let eff_len = len.unwrap_or(if prefix <= 22 { 24 } else { prefix + 2 });
                let count = 1u64 << (eff_len - prefix);
                let size = 1u64 << (32 - eff_len);
                let start = u64::from(u32::from(net.network()));
                let (i, j) = (a % count, b % count);
                let (lo, hi) = (i.min(j), i.max(j));
                // "0.0.0.0" means unset, so an explicit bound is never 0.0.0.0 (in 0.0.0.0/8).
                let min = give_min
                    .then(|| Ipv4Addr::from((start + lo * size) as u32))
                    .filter(|a| !a.is_unspecified());
                let max = give_max
                    .then(|| Ipv4Addr::from((start + hi * size) as u32))
                    .filter(|a| !a.is_unspecified());
                let kind = if vxlan { BackendKind::Vxlan } else { BackendKind::Udp };
                let mut backend = Backend::new(kind);
                let mut be = serde_json::Map::new();
                be.insert(flip("Type", case), Value::from(kind.as_str()));
                if let Some(p) = port {
                    backend.port = p;
                    be.insert(flip("Port", case >> 4), Value::from(p));
                }
                if let (Some(v), true) = (vni, vxlan) {
                    backend.vni = v;
                    be.insert(flip("VNI", case >> 8), Value::from(v));
                }
                let mut obj = serde_json::Map::new();
                obj.insert(flip("Network", case >> 12), Value::from(net.to_string()));
                if let Some(l) = len {
                    obj.insert(flip("SubnetLen", case >> 20), Value::from(l));
                }
                if let Some(m) = min {
                    obj.insert(flip("SubnetMin", case >> 30), Value::from(m.to_string()));
                }
                if let Some(m) = max {
                    obj.insert(flip("SubnetMax", case >> 40), Value::from(m.to_string()));
                }
                obj.insert(flip("Backend", case >> 50), Value::Object(be));
                let ipv6 = ipv6.map(|(fields, v6)| {
                    obj.extend(fields);
                    v6
                });
                // An IPv6-only config (vxlan only): the IPv4 fields go, EnableIPv4 false.
                if let (Some(v6), true, true) = (ipv6, only, vxlan) {
                    for name in IPV4_FIELDS {
                        obj.retain(|k, _| !k.eq_ignore_ascii_case(name));
                    }
                    obj.insert(flip("EnableIPv4", case >> 56), Value::from(false));
                    let want = NetworkConfig::ipv6_only(v6, backend);
                    return (Value::Object(obj).to_string(), want);
                }
                // The default Min is the second subnet; an explicit Max may sit below it, so
                // mirror NetworkConfig::new's behaviour instead of assuming success.
                let want = NetworkConfig::new(net, len, min, max, backend)
                    .map(|c| NetworkConfig { ipv6, ..c });
                (Value::Object(obj).to_string(), want)
            })
            .prop_filter_map("min above max", |(json, want)| want.ok().map(|w| (json, w)))
    }

    /// The IPv6 fields of a valid dual-stack config (`EnableIPv6` included) with randomly
    /// cased keys, and the IPv6 half they must parse to. Any size, up to a /1 in /126s.
    fn valid_ipv6() -> impl Strategy<Value = (Vec<(String, Value)>, Ipv6NetworkConfig)> {
        (1u8..=MAX_IPV6_SUBNET_LEN - 2, any::<u128>())
            .prop_flat_map(|(prefix, addr)| {
                let net = Ipv6Net::new(Ipv6Addr::from(addr), prefix).unwrap().trunc();
                (
                    Just(net),
                    prop::option::of(prefix + 2..=MAX_IPV6_SUBNET_LEN),
                    any::<u128>(),
                    any::<u128>(),
                    any::<bool>(),
                    any::<bool>(),
                    any::<u64>(),
                )
            })
            .prop_map(|(net, len, a, b, give_min, give_max, case)| {
                let prefix = net.prefix_len();
                let eff_len = len.unwrap_or(if prefix <= 62 { 64 } else { prefix + 2 });
                // eff_len - prefix is 2..=125 and 128 - eff_len 2..=125: no shift by 128.
                let count = 1u128 << (eff_len - prefix);
                let size = 1u128 << (128 - eff_len);
                let start = u128::from(net.network());
                let (i, j) = (a % count, b % count);
                let (lo, hi) = (i.min(j), i.max(j));
                // "::" means unset, so an explicit bound is never :: (in ::/1).
                let min = give_min
                    .then(|| Ipv6Addr::from(start + lo * size))
                    .filter(|a| !a.is_unspecified());
                let max = give_max
                    .then(|| Ipv6Addr::from(start + hi * size))
                    .filter(|a| !a.is_unspecified());
                let mut fields = vec![
                    (flip("EnableIPv6", case), Value::from(true)),
                    (flip("IPv6Network", case >> 10), Value::from(net.to_string())),
                ];
                if let Some(l) = len {
                    fields.push((flip("IPv6SubnetLen", case >> 21), Value::from(l)));
                }
                if let Some(m) = min {
                    fields.push((flip("IPv6SubnetMin", case >> 34), Value::from(m.to_string())));
                }
                if let Some(m) = max {
                    fields.push((flip("IPv6SubnetMax", case >> 47), Value::from(m.to_string())));
                }
                (fields, Ipv6NetworkConfig::new(net, len, min, max))
            })
            .prop_filter_map("min above max", |(fields, want)| want.ok().map(|w| (fields, w)))
    }

    /// `name` with the case of each letter flipped where `bits` says so.
    fn flip(name: &str, bits: u64) -> String {
        name.chars()
            .enumerate()
            .map(|(i, c)| {
                if bits >> (i % 64) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect()
    }

    fn any_json() -> impl Strategy<Value = Value> {
        let keys = prop_oneof![
            Just("Network".to_owned()),
            Just("subnetlen".to_owned()),
            Just("SubnetMin".to_owned()),
            Just("SUBNETMAX".to_owned()),
            Just("Backend".to_owned()),
            Just("Type".to_owned()),
            Just("VNI".to_owned()),
            Just("port".to_owned()),
            Just("EnableIPv4".to_owned()),
            Just("IPv6Network".to_owned()),
            Just("EnableIPv6".to_owned()),
            Just("ipv6subnetlen".to_owned()),
            Just("IPv6SubnetMin".to_owned()),
            Just("IPV6SUBNETMAX".to_owned()),
            "[a-zA-Z]{0,8}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            "[0-9./:a-z-]{0,20}".prop_map(Value::from),
            Just(Value::from("10.5.0.0/16")),
            Just(Value::from("10.5.3.0")),
            Just(Value::from("vxlan")),
            Just(Value::from("udp")),
            Just(Value::from("fd00:10:244::/56")),
            Just(Value::from("fd00:10:244:3::")),
        ];
        leaf.prop_recursive(4, 64, 8, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(keys.clone(), inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn valid_configs_round_trip((json, want) in valid_config()) {
            let got = NetworkConfig::parse(json.as_bytes());
            prop_assert!(got.is_ok(), "{}: {:?}", json, got);
            let got = got.unwrap();
            prop_assert_eq!(&got, &want);
            let again = NetworkConfig::parse(got.to_json().as_bytes());
            prop_assert!(again.is_ok(), "{}: {:?}", got.to_json(), again);
            prop_assert_eq!(again.unwrap(), got);
        }

        #[test]
        fn subnets_fit_and_are_counted((_json, c) in valid_config()) {
            if !c.leases_ipv4() {
                // IPv6-only: up to 2^125 subnets (ipv6_ranges_fit_and_are_counted walks the
                // range); the first ones are leases of it, with their subnet as their half.
                for s in c.subnets().take(64) {
                    prop_assert!(c.fits(s) && c.check_lease(s).is_ok(), "{} does not fit", s);
                    prop_assert!(c.fits_lease(LeaseName::single(s)), "{}", s);
                    prop_assert!(!c.fits_lease(LeaseName { subnet: s, ipv6: None }), "{}", s);
                    prop_assert_eq!(c.home_ipv6_half(s), None);
                }
                return Ok(());
            }
            let all: Vec<Subnet> = c.subnets().collect();
            prop_assert_eq!(all.len() as u128, c.subnet_count());
            prop_assert!(c.subnet_count() >= 1);
            let v4 = c.ipv4.unwrap();
            prop_assert_eq!(all.first().map(|s| s.network()), Some(IpAddr::V4(v4.subnet_min)));
            prop_assert_eq!(all.last().map(|s| s.network()), Some(IpAddr::V4(v4.subnet_max)));
            for pair in all.windows(2) {
                prop_assert!(pair[0] < pair[1]);
            }
            for s in all {
                prop_assert!(c.fits(s), "{} does not fit", s);
                prop_assert!(IpNet::V4(v4.network).contains(&s.net()), "{} is outside {}", s, v4.network);
            }
        }

        #[test]
        fn ipv6_ranges_fit_and_are_counted((_fields, c) in valid_ipv6()) {
            let (prefix, len) = (c.network.prefix_len(), c.subnet_len);
            prop_assert_eq!(c.network, c.network.trunc());
            prop_assert!((1..=MAX_IPV6_SUBNET_LEN - 2).contains(&prefix), "{}", c.network);
            prop_assert!((prefix + 2..=MAX_IPV6_SUBNET_LEN).contains(&len), "/{}", len);
            prop_assert!(c.subnet_min <= c.subnet_max);
            let size = 1u128 << (128 - u32::from(len));
            let (lo, hi) = (u128::from(c.subnet_min), u128::from(c.subnet_max));
            prop_assert_eq!(c.subnet_count(), (hi - lo) / size + 1);
            let at = |a: u128| Ipv6Net::new(Ipv6Addr::from(a), len).unwrap();
            prop_assert!(c.fits(at(lo)), "{} does not fit", at(lo));
            prop_assert!(c.fits(at(hi)), "{} does not fit", at(hi));
            prop_assert!(!c.fits(at(lo + 1)), "host bits fit");
            prop_assert!(!c.fits(Ipv6Net::new(c.subnet_min, len - 1).unwrap()));
            if let Some(below) = lo.checked_sub(size) {
                prop_assert!(!c.fits(at(below)), "{} below the range fits", at(below));
            }
            if let Some(above) = hi.checked_add(size) {
                prop_assert!(!c.fits(at(above)), "{} above the range fits", at(above));
            }
        }

        #[test]
        fn parse_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = NetworkConfig::parse(&bytes);
        }

        #[test]
        fn parse_never_panics_on_json(v in any_json()) {
            if let Ok(c) = NetworkConfig::parse(v.to_string().as_bytes()) {
                // Whatever it accepts is valid and round-trips.
                prop_assert_eq!(NetworkConfig::parse(c.to_json().as_bytes()).ok(), Some(c));
            }
        }

        #[test]
        fn parse_never_panics_on_mangled_configs(
            (json, _) in valid_config(),
            key in "[A-Za-z]{1,12}",
            v in any_json(),
        ) {
            let mut obj: Value = serde_json::from_str(&json).unwrap();
            if let Some(o) = obj.as_object_mut() {
                o.insert(key, v);
            }
            let _ = NetworkConfig::parse(obj.to_string().as_bytes());
        }
    }
}
