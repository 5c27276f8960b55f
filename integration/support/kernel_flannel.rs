//! A kernel flannel node in the [`netns`](super::netns) lab: a host that runs no weft, whose
//! VXLAN devices, neighbours, FDB entries and routes are set up exactly as flannel's vxlan
//! backend sets them up (flannel-io/flannel, `pkg/backend/vxlan`: `vxlan.go` RegisterNetwork,
//! `device.go`, `vxlan_network.go` handleSubnetEvents), for every interop test, IPv4-only or
//! dual-stack. The recipe itself is `scripts/lib/flannel.sh` (`flannel_vtep_up`,
//! `flannel_vtep_peer`), which the bench's kernel rows also run; this module adds the lease.
//!
//! - [`KernelFlannelPeer::new`]: host N's VTEPs (`flannel_vtep_up`): `flannel.1` over
//!   192.0.2.N and, with an IPv6 subnet, `flannel-v6.1` over `2001:db8::N` (the lab's
//!   [`host_ipv6`]). Each device has its own random MAC, published in `BackendData` and
//!   `BackendV6Data`. Its lease goes into etcd as a reservation (no etcd lease, so no TTL)
//!   under flannel's key.
//! - [`KernelFlannelPeer::program`]: what handleSubnetEvents does on `EventAdded` for another
//!   node's [`VxlanLease`], per half (`flannel_vtep_peer`): neighbour, FDB entry, route.
//! - [`KernelFlannelPeer::pod`]: a pod behind it (bridge at the subnets' `.1` / `::1`), from a
//!   `subnet.env` as flannel would write it ([`Lab::pod_with_ipv6`]).
//!
//! The kernel host's eth0 has transmit checksum offload off ([`set_tx_checksum`]): see there.
//!
//! - [`RoutedPeer`]: a host running flannel's host-gw backend (`pkg/backend/hostgw`,
//!   `route_network.go`): no device, a lease of `BackendType "host-gw"`, and a kernel route
//!   `<subnet> via <PublicIP> dev eth0` per other node (`flannel_route_peer`). The same
//!   recipe without the device is vxlan's `DirectRouting` route ([`KernelFlannelPeer::route_direct`]).

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

use super::netns::{Lab, PREFIX, Pod, host_ipv6, set_tx_checksum};
use super::process::lib_run;

/// The VNI flannel uses by default, and the lab's (flannel.sh's `FLANNEL_VNI`): its leases say so.
pub const VNI: u32 = 1;

/// One node's vxlan lease as flannel's vxlan backend reads it: the IPv4 half always, the IPv6
/// half when the key names one and the value carries `PublicIPv6` and `BackendV6Data`.
#[derive(Clone, Debug)]
pub struct VxlanLease {
    /// `10.244.1.0/24`.
    pub subnet: Ipv4Net,
    /// `PublicIP`.
    pub public_ip: Ipv4Addr,
    /// `BackendData.VtepMAC`.
    pub vtep_mac: String,
    /// The IPv6 half.
    pub v6: Option<VxlanLeaseV6>,
}

/// The IPv6 half of a [`VxlanLease`].
#[derive(Clone, Debug)]
pub struct VxlanLeaseV6 {
    /// `fd00:10:244:1::/64`, from the key.
    pub subnet: Ipv6Net,
    /// `PublicIPv6`.
    pub public_ip: Ipv6Addr,
    /// `BackendV6Data.VtepMAC`.
    pub vtep_mac: String,
}

impl VxlanLease {
    /// Parses a lease: its key (`<prefix>/subnets/10.244.1.0-24`, or with
    /// `&fd00:10:244:1::-64`) and its value (flannel's JSON). Panics, quoting both, on a lease
    /// flannel's vxlan backend would not program: another backend, no IPv4 VtepMAC, or a key
    /// with an IPv6 half whose value lacks `PublicIPv6` or `BackendV6Data.VtepMAC`.
    pub fn from_etcd(key: &str, value: &serde_json::Value) -> Self {
        let ctx = || format!("lease {key} = {value}");
        let name = key.rsplit('/').next().unwrap_or(key);
        let (v4, v6) = match name.split_once('&') {
            Some((a, b)) => (a, Some(b)),
            None => (name, None),
        };
        let net = |half: &str| half.replacen('-', "/", 1);
        let subnet: Ipv4Net = net(v4).parse().unwrap_or_else(|e| panic!("{e}: {}", ctx()));
        assert_eq!(value["BackendType"], "vxlan", "not a vxlan lease: {}", ctx());
        let text = |v: &serde_json::Value, what: &str| -> String {
            v.as_str().unwrap_or_else(|| panic!("no {what} in {}", ctx())).to_owned()
        };
        let public_ip = text(&value["PublicIP"], "PublicIP")
            .parse()
            .unwrap_or_else(|e| panic!("PublicIP: {e}: {}", ctx()));
        let vtep_mac = text(&value["BackendData"]["VtepMAC"], "BackendData.VtepMAC");
        let v6 = v6.map(|half| {
            let subnet: Ipv6Net = net(half).parse().unwrap_or_else(|e| panic!("{e}: {}", ctx()));
            let public_ip = text(&value["PublicIPv6"], "PublicIPv6 (the key has an IPv6 half)")
                .parse()
                .unwrap_or_else(|e| panic!("PublicIPv6: {e}: {}", ctx()));
            let vtep_mac = text(
                &value["BackendV6Data"]["VtepMAC"],
                "BackendV6Data.VtepMAC (the key has an IPv6 half)",
            );
            VxlanLeaseV6 { subnet, public_ip, vtep_mac }
        });
        Self { subnet, public_ip, vtep_mac, v6 }
    }

    /// flannel's key for this lease: `<prefix>/subnets/<v4>-<len>[&<v6>-<len>]`.
    pub fn key(&self) -> String {
        let mut key =
            format!("{PREFIX}/subnets/{}-{}", self.subnet.addr(), self.subnet.prefix_len());
        if let Some(v6) = &self.v6 {
            key.push_str(&format!("&{}-{}", v6.subnet.addr(), v6.subnet.prefix_len()));
        }
        key
    }

    /// flannel's value for this lease (vxlan.go newSubnetAttrs).
    pub fn value(&self) -> String {
        let mut v = serde_json::json!({
            "PublicIP": self.public_ip.to_string(),
            "PublicIPv6": null,
            "BackendType": "vxlan",
            "BackendData": {"VNI": VNI, "VtepMAC": self.vtep_mac},
        });
        if let Some(v6) = &self.v6 {
            v["PublicIPv6"] = v6.public_ip.to_string().into();
            v["BackendV6Data"] = serde_json::json!({"VNI": VNI, "VtepMAC": v6.vtep_mac});
        }
        v.to_string()
    }
}

/// A host running flannel's vxlan data plane in the kernel; see the module docs.
pub struct KernelFlannelPeer {
    /// The host number (192.0.2.N, 2001:db8::N).
    pub n: u8,
    /// The host namespace.
    pub ns: String,
    /// Its own lease, as written to etcd.
    pub lease: VxlanLease,
}

impl KernelFlannelPeer {
    /// Host `n` of `lab` as a kernel flannel node holding `subnet` (`10.244.200.0/24`) and, on a
    /// dual-stack network, `subnet6` (`fd00:10:244:c8::/64`); its lease is put into etcd.
    pub fn new(lab: &Lab, n: u8, subnet: &str, subnet6: Option<&str>) -> Self {
        let ns = lab.host(n);
        let subnet: Ipv4Net = subnet.parse().expect("IPv4 subnet");
        let public_ip = Ipv4Addr::new(192, 0, 2, n);
        // Finish inner checksums on the kernel host's "wire", as a physical NIC would (see
        // `set_tx_checksum`): without it, TCP from the kernel peer reaches weft with partial sums.
        set_tx_checksum(&ns, "eth0", false);
        let vtep_mac = vtep_up(&ns, n, &subnet.to_string());
        let v6 = subnet6.map(|s6| {
            let s6: Ipv6Net = s6.parse().expect("IPv6 subnet");
            let vtep_mac = vtep_up(&ns, n, &s6.to_string());
            VxlanLeaseV6 { subnet: s6, public_ip: host_ipv6(n), vtep_mac }
        });
        let lease = VxlanLease { subnet, public_ip, vtep_mac, v6 };
        // A reservation, as an operator writes one: no etcd lease attached.
        lab.etcdctl(&["put", &lease.key(), &lease.value()]);
        Self { n, ns, lease }
    }

    /// Programs the route to another node holding `peer`, as flannel's handleSubnetEvents does
    /// on `EventAdded` (no DirectRouting; `flannel_vtep_peer`): the IPv4 half on `flannel.1`,
    /// and the IPv6 half on `flannel-v6.1` when both this node and `peer` have one.
    pub fn program(&self, peer: &VxlanLease) {
        self.program_half(&peer.subnet.to_string(), &peer.vtep_mac, &peer.public_ip.to_string());
        if let (Some(_), Some(p6)) = (&self.lease.v6, &peer.v6) {
            self.program_half(&p6.subnet.to_string(), &p6.vtep_mac, &p6.public_ip.to_string());
        }
    }

    /// Programs the route to another node holding `peer` on this node's link, as flannel's
    /// vxlan backend does with `DirectRouting` (`flannel_route_peer` without a device: `S via
    /// P`), instead of [`KernelFlannelPeer::program`]'s neighbour, FDB entry and route.
    pub fn route_direct(&self, peer: &VxlanLease) {
        let (subnet, public) = (peer.subnet.to_string(), peer.public_ip.to_string());
        lib_run("flannel.sh", "flannel_route_peer", &[self.ns.as_str(), &subnet, &public]);
    }

    /// [`KernelFlannelPeer::pod`] (IPv4-only) for a node whose flanneld runs with `--ip-masq`
    /// ([`Lab::pod_with_ipmasq`]): what direct routing needs.
    pub fn pod_unmasqueraded(&self, lab: &Lab, mtu: u32) -> Pod {
        let cni = format!("{}/{}", first_host(self.lease.subnet), self.lease.subnet.prefix_len());
        lab.pod_with_ipmasq(self.n, &cni, mtu)
    }

    fn program_half(&self, subnet: &str, mac: &str, public: &str) {
        lib_run("flannel.sh", "flannel_vtep_peer", &[self.ns.as_str(), subnet, mac, public]);
    }

    /// A pod behind this host: its bridge at the subnet's `.1` (and `::1` on dual stack), the
    /// pod's MTU `mtu` (FLANNEL_MTU).
    pub fn pod(&self, lab: &Lab, mtu: u32) -> Pod {
        let cni = format!("{}/{}", first_host(self.lease.subnet), self.lease.subnet.prefix_len());
        match &self.lease.v6 {
            None => lab.pod_with(self.n, &cni, mtu),
            Some(v6) => {
                let first = Ipv6Addr::from(u128::from(v6.subnet.addr()) + 1);
                let cni6 = format!("{first}/{}", v6.subnet.prefix_len());
                lab.pod_with_ipv6(self.n, &cni, &cni6, mtu)
            }
        }
    }
}

fn first_host(net: Ipv4Net) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.addr()) + 1)
}

/// The VTEP of the half holding `subnet` on host `n` (`flannel_vtep_up`): `flannel.1` for an
/// IPv4 subnet, `flannel-v6.1` for an IPv6 one; returns its MAC.
fn vtep_up(ns: &str, n: u8, subnet: &str) -> String {
    let mac = lib_run("flannel.sh", "flannel_vtep_up", &[ns, n.to_string().as_str(), subnet]);
    mac.trim().to_owned()
}

/// A host running flannel's host-gw backend (or, made by [`RoutedPeer::ipip`], its ipip
/// backend): see the module docs.
pub struct RoutedPeer {
    /// The lease's `BackendType`: `host-gw`, or `ipip`.
    pub backend: &'static str,
    /// The host number.
    pub n: u8,
    /// The host namespace.
    pub ns: String,
    /// Its subnet.
    pub subnet: Ipv4Net,
    /// Its `PublicIP` (eth0's address).
    pub public_ip: Ipv4Addr,
}

impl RoutedPeer {
    /// Host `n` of `lab` as a flannel host-gw node holding `subnet`: forwarding on, its lease
    /// (`{"PublicIP":"192.0.2.N","PublicIPv6":null,"BackendType":"host-gw"}`, hostgw.go's
    /// attrs) put into etcd as a reservation.
    pub fn new(lab: &Lab, n: u8, subnet: &str) -> Self {
        let ns = lab.host(n);
        lib_run("flannel.sh", "flannel_forwarding", &[ns.as_str()]);
        let peer = Self {
            backend: "host-gw",
            n,
            ns,
            subnet: subnet.parse().expect("IPv4 subnet"),
            public_ip: Ipv4Addr::new(192, 0, 2, n),
        };
        peer.announce(lab);
        peer
    }

    /// Host `n` of `lab` as a flannel ipip node holding `subnet`: forwarding on, its
    /// `flannel.ipip` device as flanneld makes it (`flannel_ipip_up`; needs the kernel's ipip
    /// module), its lease (`{"PublicIP":"192.0.2.N","PublicIPv6":null,"BackendType":"ipip"}`,
    /// ipip.go's attrs) put into etcd as a reservation.
    pub fn ipip(lab: &Lab, n: u8, subnet: &str) -> Self {
        let ns = lab.host(n);
        lib_run("flannel.sh", "flannel_forwarding", &[ns.as_str()]);
        lib_run("flannel.sh", "flannel_ipip_up", &[ns.as_str(), n.to_string().as_str(), subnet]);
        let peer = Self {
            backend: "ipip",
            n,
            ns,
            subnet: subnet.parse().expect("IPv4 subnet"),
            public_ip: Ipv4Addr::new(192, 0, 2, n),
        };
        peer.announce(lab);
        peer
    }

    /// flannel's key for its lease.
    pub fn key(&self) -> String {
        format!("{PREFIX}/subnets/{}-{}", self.subnet.addr(), self.subnet.prefix_len())
    }

    /// Puts its lease into etcd.
    pub fn announce(&self, lab: &Lab) {
        let value = serde_json::json!({
            "PublicIP": self.public_ip.to_string(),
            "PublicIPv6": null,
            "BackendType": self.backend,
        });
        lab.etcdctl(&["put", &self.key(), &value.to_string()]);
    }

    /// Leaves the cluster: its lease is deleted (as when a node goes and its lease is removed).
    pub fn leave(&self, lab: &Lab) {
        lab.etcdctl(&["del", &self.key()]);
    }

    /// Moves its eth0 to `ip` (the /24 of the lab) and announces its lease with that
    /// `PublicIP`. The kernel drops its routes to other nodes with the old address (their
    /// gateways were reachable through it): program them again ([`RoutedPeer::route`]), as
    /// flanneld does when it comes back.
    pub fn renumber(&mut self, lab: &Lab, ip: Ipv4Addr) {
        let (old, new) = (format!("{}/24", self.public_ip), format!("{ip}/24"));
        lib_run("netns.sh", "netns_readdress", &[self.ns.as_str(), "eth0", &old, &new]);
        self.public_ip = ip;
        self.announce(lab);
    }

    /// Programs the route to another node's `subnet` via its `public_ip`, as host-gw's
    /// `routeAdd` does on `EventAdded` (ipip: `via <public_ip> dev flannel.ipip onlink`).
    pub fn route(&self, subnet: &str, public_ip: Ipv4Addr) {
        let public = public_ip.to_string();
        let ns = self.ns.as_str();
        match self.backend {
            "ipip" => lib_run("flannel.sh", "flannel_ipip_peer", &[ns, subnet, &public]),
            _ => lib_run("flannel.sh", "flannel_route_peer", &[ns, subnet, &public, "eth0"]),
        };
    }

    /// A pod behind this host (bridge at the subnet's `.1`; MTU 1500, host-gw's, the
    /// interface's; 1480 for ipip, flannel.ipip's), unmasqueraded ([`Lab::pod_with_ipmasq`]).
    pub fn pod(&self, lab: &Lab) -> Pod {
        let cni = format!("{}/{}", first_host(self.subnet), self.subnet.prefix_len());
        lab.pod_with_ipmasq(self.n, &cni, if self.backend == "ipip" { 1480 } else { 1500 })
    }
}

/// A host running flannel's wireguard backend where the kernel has no WireGuard: its
/// `flannel-wgN` device served by `wireguard-go` and programmed with `wg set` as flanneld
/// programs it (`flannel_wg_up`, `flannel_wg_peer` in `scripts/lib/flannel.sh`), its lease
/// (`{"PublicIP":"192.0.2.N","PublicIPv6":null,"BackendType":"wireguard","BackendData":
/// {"PublicKey":"<base64>","Port":51820}}`, wireguard.go's attrs) put into etcd. Its device
/// (and so its wireguard-go) goes on drop.
///
/// Dual stack ([`WireguardPeer::dual`]): flannel's `Mode` `separate` with IPv6 enabled, two
/// devices on the one key: `flannel-wgN` for IPv4 on 51820 and `flannel-wg6-N` (flannel's
/// `flannel-wg-v6`) for IPv6 on `ListenPortV6` 51821 (`flannel_wg6_up`), and the lease's IPv6
/// half: `PublicIPv6` 2001:db8::N and `BackendV6Data {"PublicKey","Port":51821}`.
pub struct WireguardPeer {
    /// The host number.
    pub n: u8,
    /// The host namespace.
    pub ns: String,
    /// Its subnet.
    pub subnet: Ipv4Net,
    /// Its IPv6 subnet (dual stack).
    pub subnet6: Option<Ipv6Net>,
    /// Its `PublicIP` (eth0's address).
    pub public_ip: Ipv4Addr,
    /// Its public key (`wg pubkey`).
    pub public_key: String,
}

impl WireguardPeer {
    /// Host `n` of `lab` as a flannel wireguard node holding `subnet` in the lab's network, on
    /// a fresh key (`wg genkey`, 0600 in the lab's directory).
    pub fn new(lab: &Lab, n: u8, subnet: &str) -> Self {
        Self::up(lab, n, subnet, None)
    }

    /// [`WireguardPeer::new`] on a dual-stack network in `Mode` `separate`: a second device
    /// for the IPv6 half `subnet6` (of the lab's `IPV6_NETWORK`), on the same key.
    pub fn dual(lab: &Lab, n: u8, subnet: &str, subnet6: &str) -> Self {
        Self::up(lab, n, subnet, Some(subnet6))
    }

    fn up(lab: &Lab, n: u8, subnet: &str, subnet6: Option<&str>) -> Self {
        let ns = lab.host(n);
        lib_run("flannel.sh", "flannel_forwarding", &[ns.as_str()]);
        let key_file = lab.dir().join(format!("h{n}-wg.key"));
        let key = super::netns::run(&["wg", "genkey"]);
        std::fs::write(&key_file, key).expect("write the key");
        std::fs::set_permissions(&key_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod the key");
        let key_path = key_file.to_string_lossy().into_owned();
        let n_text = n.to_string();
        let public_key = lib_run(
            "flannel.sh",
            "flannel_wg_up",
            &[ns.as_str(), n_text.as_str(), subnet, "10.244.0.0/16", key_path.as_str()],
        )
        .trim()
        .to_owned();
        if let Some(s6) = subnet6 {
            let network6 = super::netns::IPV6_NETWORK;
            let v6_key = lib_run(
                "flannel.sh",
                "flannel_wg6_up",
                &[ns.as_str(), n_text.as_str(), s6, network6, key_path.as_str()],
            );
            assert_eq!(v6_key.trim(), public_key, "flannel's two devices share one key");
        }
        let peer = Self {
            n,
            ns,
            subnet: subnet.parse().expect("IPv4 subnet"),
            subnet6: subnet6.map(|s| s.parse().expect("IPv6 subnet")),
            public_ip: Ipv4Addr::new(192, 0, 2, n),
            public_key,
        };
        peer.announce(lab);
        peer
    }

    /// flannel's key for its lease.
    pub fn key(&self) -> String {
        let mut key =
            format!("{PREFIX}/subnets/{}-{}", self.subnet.addr(), self.subnet.prefix_len());
        if let Some(v6) = &self.subnet6 {
            key.push_str(&format!("&{}-{}", v6.addr(), v6.prefix_len()));
        }
        key
    }

    /// Puts its lease into etcd (wireguard.go newSubnetAttrs).
    pub fn announce(&self, lab: &Lab) {
        let mut value = serde_json::json!({
            "PublicIP": self.public_ip.to_string(),
            "PublicIPv6": null,
            "BackendType": "wireguard",
            "BackendData": {"PublicKey": self.public_key, "Port": 51820},
        });
        if self.subnet6.is_some() {
            value["PublicIPv6"] = host_ipv6(self.n).to_string().into();
            value["BackendV6Data"] =
                serde_json::json!({"PublicKey": self.public_key, "Port": 51821});
        }
        lab.etcdctl(&["put", &self.key(), &value.to_string()]);
    }

    /// Adds another node as flanneld does on its lease (`addPeer`): its key, `PublicIP:Port`,
    /// its subnet as the allowed IPs.
    pub fn peer(&self, key: &str, endpoint: &str, subnet: &str) {
        let n = self.n.to_string();
        lib_run(
            "flannel.sh",
            "flannel_wg_peer",
            &[self.ns.as_str(), n.as_str(), key, endpoint, subnet],
        );
    }

    /// Adds another node's IPv6 half as flanneld does in `Mode` `separate` (`v6Dev.addPeer`):
    /// on the IPv6 device, its `BackendV6Data` key, `[PublicIPv6]:Port`, its IPv6 subnet as the
    /// allowed IPs.
    pub fn peer6(&self, key: &str, endpoint: &str, subnet6: &str) {
        let n = self.n.to_string();
        lib_run(
            "flannel.sh",
            "flannel_wg6_peer",
            &[self.ns.as_str(), n.as_str(), key, endpoint, subnet6],
        );
    }

    /// Removes another node (`removePeer`, on its lease's removal or a new key).
    pub fn unpeer(&self, key: &str) {
        let n = self.n.to_string();
        lib_run("flannel.sh", "flannel_wg_unpeer", &[self.ns.as_str(), n.as_str(), key]);
    }

    /// A pod behind this host (bridge at the subnet's `.1`, and `::1` of the IPv6 subnet on
    /// dual stack; MTU 1420, flannel-wg's), unmasqueraded ([`Lab::pod_with_ipmasq`]).
    pub fn pod(&self, lab: &Lab) -> Pod {
        let cni = format!("{}/{}", first_host(self.subnet), self.subnet.prefix_len());
        match &self.subnet6 {
            None => lab.pod_with_ipmasq(self.n, &cni, 1420),
            Some(v6) => {
                let first = Ipv6Addr::from(u128::from(v6.addr()) + 1);
                let cni6 = format!("{first}/{}", v6.prefix_len());
                lab.pod_with_ipv6_ipmasq(self.n, &cni, &cni6, 1420)
            }
        }
    }
}

impl Drop for WireguardPeer {
    fn drop(&mut self) {
        let n = self.n.to_string();
        for down in ["flannel_wg_down", "flannel_wg6_down"] {
            let _ =
                super::process::lib_command("flannel.sh", down, &[self.ns.as_str(), &n]).status();
        }
    }
}
