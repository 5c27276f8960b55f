//! What the data plane is started with ([`DataplaneConfig`], from the daemon's settings) and why
//! a start fails ([`DataplaneError`]): the front door's vocabulary, shared by the backends
//! (`tunnel`, `kernel_routes`) so that neither takes it from the other.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::{Ipv4Net, Ipv6Net};

use crate::config::BackendKind;
use crate::dataplane::sys::netlink::NetlinkError;
use crate::dataplane::sys::tun::TunError;
use crate::dataplane::sys::udp::UdpError;
use crate::dataplane::sys::udp::gso_retry::DEFAULT_RETRY_AFTER;
use crate::dataplane::wire::ethernet::MacAddr;
use crate::vocab::WgSecret;

/// The IPv6 half of the underlay and overlay, on a dual-stack or IPv6-only vxlan or wireguard
/// network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ipv6Dataplane {
    /// The cluster's IPv6 network, routed through the TUN device.
    pub(crate) network: Ipv6Net,
    /// Our public IPv6 address: IPv6 datagrams are sent from it when it is a local address.
    pub(crate) public_ip: Ipv6Addr,
}

/// What the data plane needs to start.
/// What the wireguard backend's sessions are made with (the rest of its options are the
/// port, the MTU and the underlay's, as for every tunnel).
#[derive(Clone, Debug)]
pub(crate) struct WireguardDataplane {
    /// This node's private key (never printed: [`WgSecret`]).
    pub(crate) private_key: WgSecret,
    /// `Backend.PSK`.
    pub(crate) psk: Option<WgSecret>,
    /// `Backend.PersistentKeepaliveInterval` in seconds; `None`: no keepalives.
    pub(crate) keepalive: Option<u16>,
    /// `Backend.ListenPortV6`: the IPv6 underlay's device listens on it (used with IPv6).
    pub(crate) port6: u16,
}

#[derive(Clone, Debug)]
pub(crate) struct DataplaneConfig {
    /// TUN device name.
    pub(crate) tun_name: String,
    /// vxlan or udp (or host-gw: no tunnel, kernel routes only).
    pub(crate) backend: BackendKind,
    /// vxlan's `DirectRouting`: peers on the underlay's link by kernel routes, beside the
    /// tunnel.
    pub(crate) direct_routing: bool,
    /// VNI (vxlan).
    pub(crate) vni: u32,
    /// The backend's UDP port.
    pub(crate) port: u16,
    /// Our VTEP MAC.
    pub(crate) our_mac: MacAddr,
    /// The underlay MTU; the TUN MTU is this minus the encapsulation overhead.
    pub(crate) underlay_mtu: u32,
    /// The encapsulation overhead (50 for vxlan, 28 for udp).
    pub(crate) overhead: u32,
    /// The cluster's IPv4 network, routed through the TUN device; `None` on an IPv6-only
    /// network, which has no IPv4 address, route or socket.
    pub(crate) network: Option<Ipv4Net>,
    /// Our public IP: datagrams are sent from it when it is a local address (unused on an
    /// IPv6-only network).
    pub(crate) public_ip: Ipv4Addr,
    /// The IPv6 half, on a dual-stack or IPv6-only vxlan or wireguard network.
    pub(crate) ipv6: Option<Ipv6Dataplane>,
    /// Workers (TUN queues); at least 1.
    pub(crate) workers: usize,
    /// TUN offloads (TSO, checksum, USO) with userspace split and GRO.
    pub(crate) tun_offload: bool,
    /// UDP GSO on send, and when to try it again after a send failed.
    pub(crate) udp_gso: UdpGsoConfig,
    /// UDP GRO on receive.
    pub(crate) udp_gro: bool,
    /// recvmmsg/sendmmsg batches (off: one packet per syscall).
    pub(crate) batching: bool,
    /// One thread per worker for both directions (else one per direction).
    pub(crate) one_thread: bool,
    /// The longest a one-thread worker keeps looking after a small step (`WorkerConfig::spin`).
    pub(crate) spin: Duration,
    /// The scheduler slice each forwarding thread asks for (`WorkerConfig::slice`).
    pub(crate) worker_slice: Duration,
    /// The wireguard backend's keys and keepalive (`None` on every other backend).
    pub(crate) wireguard: Option<WireguardDataplane>,
}

/// UDP GSO: whether to use it, how soon to try it again after a GSO send failed, and whether
/// its messages may end on a full segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpGsoConfig {
    /// Use `UDP_SEGMENT` when the kernel has it (not `--no-udp-gso`).
    pub on: bool,
    /// The first wait before a socket tries GSO again after a failed GSO send
    /// (`--gso-retry-after`); doubled on each failed retry, up to an hour.
    pub retry_after: Duration,
    /// Never end a GSO message on a full segment ([`crate::dataplane::sys::udp::gso_tail`]): on a kernel whose GSO
    /// mangles such messages.
    pub never_equal_tail: bool,
}

impl Default for UdpGsoConfig {
    fn default() -> Self {
        Self { on: true, retry_after: DEFAULT_RETRY_AFTER, never_equal_tail: false }
    }
}

/// Why the data plane could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DataplaneError {
    /// The VNI does not fit in 24 bits.
    #[error("VNI {0} does not fit in 24 bits")]
    BadVni(u32),
    /// The TUN device.
    #[error(transparent)]
    Tun(#[from] TunError),
    /// Configuring the TUN device's link over netlink.
    #[error(transparent)]
    Link(#[from] NetlinkError),
    /// A UDP socket (or, for ipip, a raw IP socket): its error says which.
    #[error(transparent)]
    Socket(#[from] UdpError),
    /// A thread.
    #[error("starting a worker thread: {0}")]
    Thread(#[source] io::Error),
    /// What was handed over does not fit this data plane.
    #[error("the handed-over data plane cannot be taken: {0}")]
    Handover(String),
    /// Neither family has a socket: a config with no IPv4 network and no IPv6 underlay.
    #[error("no underlay socket: the network has no IPv4 part and no IPv6 underlay was given")]
    NoSockets,
    /// host-gw with a public IP that no interface of this host has (NAT).
    #[error(
        "the public IP {0} is no address of this host (NAT?): host-gw does not work behind NAT \
         (flannel's refuses it too), as peers route to the public IP directly"
    )]
    HostGwNat(Ipv4Addr),
    #[error("the wireguard backend was started without this node's private key")]
    NoWireguardKey,
}

impl DataplaneError {
    /// Whether the start failed because another process has the TUN device attached (one
    /// created between the daemon's check and the start): the daemon then waits again.
    pub(crate) fn is_device_in_use(&self) -> bool {
        matches!(self, Self::Tun(TunError::InUse { .. }))
    }
}
