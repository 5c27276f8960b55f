//! End to end in network namespaces, dual stack (docs/dual-stack.md): the lab's IPv6 underlay
//! (`2001:db8::N/64` on every host, the hub at `2001:db8::fe`), pods with an address of each
//! family from `FLANNEL_SUBNET` and `FLANNEL_IPV6_SUBNET`, and the vxlan backend on a
//! dual-stack network (`EnableIPv6`, `IPv6Network` fd00:10:244::/56) carrying IPv6 in VXLAN over
//! the IPv6 underlay as flannel's `flannel-v6.<VNI>` device does.
//!
//! - the lab itself: hosts reach each other and the hub over the IPv6 underlay (no weft);
//! - the kernel recipe: two kernel flannel nodes set up and programmed by
//!   `support::kernel_flannel` (no weft) reach each other's pods over both families. It proves
//!   the recipe, so that a failure of the interop test below is weft's;
//! - three weft hosts: dual-stack leases (`PublicIPv6`, `BackendV6Data` with the IPv4 VTEP MAC),
//!   `weft0` with `<v6 subnet base>/128` and a route for the IPv6 network, ping over both
//!   families between every pair of pods, iperf3 over IPv6 both ways;
//! - interop: a kernel flannel node with `flannel.1` and `flannel-v6.1`, programmed for the weft
//!   hosts as flannel programs peers, and weft's pods reach its pod over both families, both
//!   ways, TCP over IPv6 included;
//! - three weft hosts on an IPv6-only network (`EnableIPv4: false`) whose underlay still has
//!   the lab's IPv4 addresses: flannel's `0.0.0.0-0&<v6>-64` keys with `PublicIP` 0.0.0.0,
//!   subnet.env and `weft0` without IPv4, no IPv4 socket, pods with an IPv6 address alone,
//!   `ping -6` between every pair, iperf3 over IPv6 both ways.
//!
//! The udp backend on a dual-stack network (IPv4 carried, pods dual-stack) is in e2e.rs.
//! Needs root and the tools in `support::netns::REQUIRED_TOOLS`, like e2e.rs; each test builds
//! its own lab (namespaces `wt<4 hex>*`), removed on drop.

mod support;

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::Ipv6Net;
use support::kernel_flannel::{KernelFlannelPeer, VxlanLease};
use support::netns::{
    Families, HUB_IPV6, IPV6_NETWORK, Iperf3Server, Lab, PREFIX, Pod, Pod6, READY_WITHIN, Weft,
    host_ipv6, inet_addrs, iperf3_bps, ping_all_pairs, ping_ok, run, weft0_link,
};

/// flannel's dual-stack vxlan network, as the brief for weft's IPv6 data plane has it.
const DUAL_VXLAN: &str = r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;
const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
/// An IPv6-only vxlan network (`EnableIPv4: false`, no `Network`): hosts lease IPv6 subnets.
const IPV6_ONLY_VXLAN: &str = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;

/// The pods' MTU behind a kernel flannel node (flannel's FLANNEL_MTU for vxlan on a 1500 wire).
const KERNEL_MTU: u32 = 1450;

fn ip6_of(pod: &Pod) -> Ipv6Addr {
    pod.ip6.unwrap_or_else(|| panic!("pod {} has no IPv6 address (IPv4 {})", pod.ns, pod.ip))
}

/// iperf3 over IPv6 from `a` to `b`, then from `b` to `a` (2 s each); both must carry data.
fn iperf3_v6_both_ways(a: &Pod, b: &Pod, label: &str) {
    let server = Iperf3Server::start(&b.ns);
    let there = iperf3_bps(&a.ns, ip6_of(b), 2);
    drop(server);
    let _server = Iperf3Server::start(&a.ns);
    let back = iperf3_bps(&b.ns, ip6_of(a), 2);
    eprintln!(
        "iperf3 -6 {label}: {} -> {}: {:.3} Gbit/s; back: {:.3} Gbit/s",
        ip6_of(a),
        ip6_of(b),
        there / 1e9,
        back / 1e9
    );
    assert!(there > 0.0, "iperf3 -6 {label} {} -> {}: {there} bits/s", a.ns, b.ns);
    assert!(back > 0.0, "iperf3 -6 {label} {} -> {}: {back} bits/s", b.ns, a.ns);
}

/// The pod's IPv6 address lies in `subnet6` (its host's FLANNEL_IPV6_SUBNET's network).
fn assert_pod_in(pod: &Pod, subnet6: &str) {
    let net: Ipv6Net = subnet6.parse().expect("IPv6 subnet");
    let ip6 = ip6_of(pod);
    assert!(net.contains(&ip6), "pod {} has {ip6}, outside its host's {net}", pod.ns);
}

/// Host `w`'s lease as a dual-stack vxlan lease must be: a key naming both halves (the IPv6 one
/// that subnet.env names), `PublicIPv6` = the host's `2001:db8::N`, and `BackendV6Data` with
/// VNI 1 and weft's one VTEP MAC (the same as `BackendData`'s). Returns it parsed.
fn assert_dual_stack_lease(lab: &Lab, w: &Weft) -> VxlanLease {
    let subnet = w.subnet().expect("FLANNEL_SUBNET");
    let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
    assert!(
        env.contains(&format!("FLANNEL_IPV6_NETWORK={IPV6_NETWORK}\n")),
        "host {}: no FLANNEL_IPV6_NETWORK in subnet.env:\n{env}",
        w.n
    );
    let subnet6 = w
        .subnet6()
        .unwrap_or_else(|| panic!("host {}: no FLANNEL_IPV6_SUBNET in subnet.env:\n{env}", w.n));
    let (key, value) = lab.lease_entry(&subnet).unwrap_or_else(|| {
        panic!("host {}: no lease for {subnet} in etcd\n--- log ---\n{}", w.n, w.log_tail(30))
    });
    let want_key = format!(
        "/coreos.com/network/subnets/{}&{}",
        subnet.replace('/', "-"),
        subnet6.replace('/', "-")
    );
    assert_eq!(key, want_key, "host {}: lease key (value {value})", w.n);
    let ctx = format!("host {}: lease {key} = {value}", w.n);
    assert_eq!(value["BackendType"], "vxlan", "{ctx}");
    assert_eq!(value["PublicIP"], format!("192.0.2.{}", w.n), "{ctx}");
    assert_eq!(value["PublicIPv6"], host_ipv6(w.n).to_string(), "PublicIPv6, {ctx}");
    assert_eq!(value["BackendV6Data"]["VNI"], 1, "BackendV6Data.VNI, {ctx}");
    assert!(value["BackendData"]["VtepMAC"].is_string(), "BackendData.VtepMAC, {ctx}");
    assert_eq!(
        value["BackendV6Data"]["VtepMAC"], value["BackendData"]["VtepMAC"],
        "BackendV6Data.VtepMAC must be weft's one VTEP MAC, {ctx}"
    );
    VxlanLease::from_etcd(&key, &value)
}

/// weft0 on host `w` carries IPv6 as flannel's flannel-v6.1 does: `<v6 subnet base>/128` its
/// only global IPv6 address, and the IPv6 network routed through it.
fn assert_tun_configured_v6(lab: &Lab, w: &Weft) {
    let host = lab.host(w.n);
    let subnet6 = w.subnet6().expect("FLANNEL_IPV6_SUBNET");
    let link: serde_json::Value =
        serde_json::from_str(&run(&["ip", "-n", &host, "-6", "-j", "addr", "show", "weft0"]))
            .expect("ip -6 -j addr");
    let global: Vec<String> = link[0]["addr_info"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|a| a["family"] == "inet6" && a["scope"] == "global")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or("?"), a["prefixlen"]))
        .collect();
    let base = subnet6.split('/').next().expect("subnet6 address");
    assert_eq!(
        global,
        vec![format!("{base}/128")],
        "weft0's global IPv6 addresses on host {} ({link})\n--- log ---\n{}",
        w.n,
        w.log_tail(30)
    );
    let routes: serde_json::Value =
        serde_json::from_str(&run(&["ip", "-n", &host, "-6", "-j", "route", "show", IPV6_NETWORK]))
            .expect("ip -6 -j route");
    let through_weft0 = routes
        .as_array()
        .is_some_and(|r| r.iter().any(|r| r["dst"] == IPV6_NETWORK && r["dev"] == "weft0"));
    assert!(
        through_weft0,
        "no route for {IPV6_NETWORK} through weft0 on host {}: {routes}\n--- log ---\n{}",
        w.n,
        w.log_tail(30)
    );
}

// --- the lab ------------------------------------------------------------------------------

/// Every host has `2001:db8::N/64` (N in hex) on eth0, usable at once, and a default IPv6 route
/// via the hub: hosts reach each other and the hub with no weft running.
/// Host `w` has a UDP socket on its `PublicIPv6`, port 8472: VXLAN over the IPv6 underlay.
fn assert_vxlan_socket_on_public_ipv6(w: &Weft) {
    let want = format!("[{}]:8472", host_ipv6(w.n));
    let sockets = run(&["ip", "netns", "exec", &w.ns, "ss", "-H", "-u", "-a", "-n"]);
    assert!(
        sockets.split_whitespace().any(|a| a == want),
        "host {}: no UDP socket on {want}:\n{sockets}",
        w.n
    );
}

#[test]
fn lab_hosts_reach_each_other_and_the_hub_over_the_ipv6_underlay() {
    let lab = Lab::new(VXLAN);
    let (h1, h2, h10) = (lab.host(1), lab.host(2), lab.host(10));
    let eth0: serde_json::Value =
        serde_json::from_str(&run(&["ip", "-n", &h10, "-6", "-j", "addr", "show", "eth0"]))
            .expect("ip -6 -j addr");
    let global: Vec<&serde_json::Value> = eth0[0]["addr_info"]
        .as_array()
        .expect("addr_info")
        .iter()
        .filter(|a| a["scope"] == "global")
        .collect();
    assert_eq!(global.len(), 1, "host 10's global IPv6 addresses: {eth0}");
    assert_eq!(global[0]["local"], "2001:db8::a", "host 10 is 2001:db8::a (N in hex): {eth0}");
    assert!(global[0]["tentative"].is_null(), "host 10's address is tentative: {eth0}");
    ping_ok(&h1, host_ipv6(2), 2);
    ping_ok(&h2, host_ipv6(10), 2);
    ping_ok(&h10, HUB_IPV6, 2);
    // The IPv4 underlay is as it was.
    ping_ok(&h1, Ipv4Addr::new(192, 0, 2, 10), 1);
}

// --- the kernel recipe, before weft --------------------------------------------------------

/// Two kernel flannel nodes, each set up and programmed for the other by
/// `support::kernel_flannel` (the recipe the interop test uses against weft), reach each
/// other's pods over IPv4 and IPv6, TCP over IPv6 included. No weft runs here: when this passes
/// and the interop test fails, the failure is weft's.
#[test]
fn kernel_recipe_two_flannel_nodes_reach_each_other_over_both_families() {
    let lab = Lab::new(DUAL_VXLAN);
    let k8 = KernelFlannelPeer::new(&lab, 8, "10.244.201.0/24", Some("fd00:10:244:c9::/64"));
    let k9 = KernelFlannelPeer::new(&lab, 9, "10.244.200.0/24", Some("fd00:10:244:c8::/64"));
    // Their leases read back from etcd as flannel's vxlan backend reads a peer's.
    for k in [&k8, &k9] {
        let back = lab.vxlan_lease(&k.lease.subnet.to_string());
        assert_eq!(back.key(), k.lease.key(), "{back:?}");
        let (v6, want) = (back.v6.expect("IPv6 half"), k.lease.v6.as_ref().expect("IPv6 half"));
        assert_eq!((v6.public_ip, &v6.vtep_mac), (want.public_ip, &want.vtep_mac));
        assert_ne!(v6.vtep_mac, back.vtep_mac, "flannel-v6.1 has a MAC of its own");
    }
    k8.program(&k9.lease);
    k9.program(&k8.lease);
    let (p8, p9) = (k8.pod(&lab, KERNEL_MTU), k9.pod(&lab, KERNEL_MTU));
    assert_pod_in(&p8, "fd00:10:244:c9::/64");
    assert_pod_in(&p9, "fd00:10:244:c8::/64");
    ping_all_pairs(&[p8.clone(), p9.clone()], Families::Both);
    iperf3_v6_both_ways(&p8, &p9, "kernel node 8 <-> kernel node 9");
    // It went through the VTEPs (no other path exists: the hub forwards nothing).
    for k in [&k8, &k9] {
        for dev in ["flannel.1", "flannel-v6.1"] {
            let (tx, rx) = link_packets(&k.ns, dev);
            assert!(tx > 0 && rx > 0, "{dev} on host {}: {tx} packets out, {rx} in", k.n);
        }
    }
}

/// A link's packet counters (sent, received) in namespace `ns`.
fn link_packets(ns: &str, dev: &str) -> (u64, u64) {
    let link: serde_json::Value =
        serde_json::from_str(&run(&["ip", "-n", ns, "-s", "-j", "link", "show", dev]))
            .expect("ip -s -j link");
    let stats = &link[0]["stats64"];
    (stats["tx"]["packets"].as_u64().unwrap_or(0), stats["rx"]["packets"].as_u64().unwrap_or(0))
}

// --- weft, dual stack ----------------------------------------------------------------------

#[test]
fn vxlan_dual_stack_three_hosts_ping_both_families_and_carry_iperf3_over_ipv6() {
    let lab = Lab::new(DUAL_VXLAN);
    let (wefts, pods) = lab.up(&[1, 2, 3], &[]);
    for (w, pod) in wefts.iter().zip(&pods) {
        assert_dual_stack_lease(&lab, w);
        assert_tun_configured_v6(&lab, w);
        assert_pod_in(pod, &w.subnet6().expect("FLANNEL_IPV6_SUBNET"));
        // VXLAN over the IPv6 underlay: a UDP socket on the PublicIPv6, port 8472.
        assert_vxlan_socket_on_public_ipv6(w);
    }
    ping_all_pairs(&pods, Families::Both);
    iperf3_v6_both_ways(&pods[0], &pods[1], "weft host 1 <-> weft host 2");
    for w in &wefts {
        let routes = w.metric("weft_routes");
        assert!(routes.is_some_and(|r| r >= 2.0), "host {}: weft_routes {routes:?}", w.n);
    }
}

/// A kernel flannel node on a dual-stack network (`flannel.1` over 192.0.2.9 and
/// `flannel-v6.1` over 2001:db8::9, each with its own MAC) set up and programmed for the weft
/// hosts as flannel's vxlan backend does, its lease a reservation at the dual-stack key
/// `10.244.200.0-24&fd00:10:244:c8::-64`: weft's pods and the kernel node's pod reach each other
/// over both families, both ways, and TCP over IPv6 flows both ways.
#[test]
fn kernel_flannel_v6_peer_set_up_like_flannel_interoperates_both_ways() {
    let lab = Lab::new(DUAL_VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    let k9 = KernelFlannelPeer::new(&lab, 9, "10.244.200.0/24", Some("fd00:10:244:c8::/64"));
    assert_eq!(
        k9.lease.key(),
        "/coreos.com/network/subnets/10.244.200.0-24&fd00:10:244:c8::-64",
        "the kernel node's lease key"
    );
    for w in &wefts {
        let lease = assert_dual_stack_lease(&lab, w);
        k9.program(&lease);
    }
    let pod9 = k9.pod(&lab, KERNEL_MTU);
    assert_pod_in(&pod9, "fd00:10:244:c8::/64");
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 2.0);
    }
    for p in &pods {
        ping_ok(&pod9.ns, p.ip, 3);
        ping_ok(&p.ns, pod9.ip, 3);
        ping_ok(&pod9.ns, ip6_of(p), 3);
        ping_ok(&p.ns, ip6_of(&pod9), 3);
    }
    iperf3_v6_both_ways(&pods[0], &pod9, "weft host 1 <-> kernel node 9");
    let (tx, rx) = link_packets(&k9.ns, "flannel-v6.1");
    assert!(tx > 0 && rx > 0, "flannel-v6.1 on host 9: {tx} packets out, {rx} in");
}

/// Where `PublicIPv6` comes from: host 1's eth0 gets a second address, 2001:db8::91, which the
/// kernel lists first (newest first, for IPv6), so weft would pick it by itself; given
/// `--public-ipv6 2001:db8::1` it must publish that one instead. Host 2 gets neither `--iface` nor
/// any address flag, so weft takes the IPv4 default route's interface and its first global
/// IPv6 address. Each lease publishes its address, and the pods reach each other over IPv6
/// both ways, so the IPv6 sockets listen where the leases say.
#[test]
fn the_ipv6_underlay_is_the_flag_or_the_default_route_interfaces_address() {
    let lab = Lab::new(DUAL_VXLAN);
    let h1 = lab.host(1);
    run(&["ip", "-n", &h1, "-6", "addr", "add", "2001:db8::91/64", "dev", "eth0", "nodad"]);
    let listed =
        run(&["ip", "-n", &h1, "-6", "-br", "addr", "show", "dev", "eth0", "scope", "global"]);
    assert!(listed.contains("2001:db8::91/64 2001:db8::1/64"), "the kernel's order: {listed}");
    let mut w1 = lab.start_weft(1, &["--public-ipv6", "2001:db8::1"]);
    let mut w2 = lab.start_weft_by_default_route(2, &[]);
    w1.wait_ready(READY_WITHIN);
    w2.wait_ready(READY_WITHIN);
    for (w, want) in [(&w1, "2001:db8::1"), (&w2, "2001:db8::2")] {
        let subnet = w.subnet().expect("FLANNEL_SUBNET");
        let (key, value) = lab.lease_entry(&subnet).expect("a lease");
        assert_eq!(value["PublicIPv6"], want, "host {}: {key} = {value}", w.n);
    }
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    let p1 = lab.pod(1, &w1.subnet_file());
    let p2 = lab.pod(2, &w2.subnet_file());
    ping_ok(&p1.ns, ip6_of(&p2), 3);
    ping_ok(&p2.ns, ip6_of(&p1), 3);
}

// --- weft, IPv6 only -----------------------------------------------------------------------

/// Every key under `<prefix>/subnets/` and its value, parsed, in key order.
fn all_leases(lab: &Lab) -> Vec<(String, serde_json::Value)> {
    let out = lab.etcdctl(&["get", "--prefix", &format!("{PREFIX}/subnets/")]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .map(|kv| {
            let v = kv.get(1).copied().unwrap_or("");
            let json = serde_json::from_str(v)
                .unwrap_or_else(|e| panic!("lease {} is not JSON ({e}): {v:?}", kv[0]));
            (kv[0].to_owned(), json)
        })
        .collect()
}

/// Three weft hosts on an IPv6-only vxlan network. The underlay keeps the lab's IPv4 addresses
/// (192.0.2.N, an IPv4 default route), and hosts 1 and 2 are even given `--public-ip
/// 192.0.2.N` (with `--iface eth0`): weft must use none of it, and says the flag is ignored.
/// Host 3 gets no address or interface flag and finds eth0 by its IPv6 default route. Each
/// host must lease a distinct /64 of `IPv6Network` under flannel's IPv6-only key
/// `0.0.0.0-0&<v6>-64`, its value with `PublicIP` 0.0.0.0, the host's `PublicIPv6` and
/// `BackendV6Data`, no `BackendData`; write subnet.env with the IPv6 pair alone; give `weft0`
/// `<v6 subnet>::/128` and the IPv6 network's route, but no IPv4 address or route; and open
/// its VXLAN socket on `[2001:db8::N]:8472` and no IPv4 UDP socket. Pods attached by the CNI
/// bridge plugin from that subnet.env (as flannel's CNI plugin delegates) get an IPv6 address
/// alone, reach each other with `ping -6` between every pair of hosts, and carry iperf3 over
/// IPv6 both ways.
#[test]
fn vxlan_ipv6_only_network_three_hosts_ping6_every_pair_and_carry_iperf3() {
    let lab = Lab::new(IPV6_ONLY_VXLAN);
    let mut wefts = vec![
        lab.start_weft(1, &[]),
        lab.start_weft(2, &[]),
        lab.start_weft_by_default_route(3, &[]),
    ];
    let subnets: Vec<String> =
        wefts.iter_mut().map(|w| w.wait_ready_ipv6_only(READY_WITHIN)).collect();
    let network: Ipv6Net = IPV6_NETWORK.parse().expect("IPv6 network");
    for (w, subnet6) in wefts.iter().zip(&subnets) {
        let net: Ipv6Net = subnet6.parse().expect("IPv6 subnet");
        assert!(net.prefix_len() == 64 && network.contains(&net), "host {}: {net}", w.n);
    }
    for (i, a) in subnets.iter().enumerate() {
        assert!(!subnets[i + 1..].contains(a), "two hosts hold {a}: {subnets:?}");
    }

    // The leases: one per host, in flannel's IPv6-only form, and no other key.
    let leases = all_leases(&lab);
    assert_eq!(leases.len(), 3, "the keys under {PREFIX}/subnets/: {leases:?}");
    for (w, subnet6) in wefts.iter().zip(&subnets) {
        let want_key = format!("{PREFIX}/subnets/0.0.0.0-0&{}", subnet6.replace('/', "-"));
        let (key, value) = leases
            .iter()
            .find(|(k, _)| *k == want_key)
            .unwrap_or_else(|| panic!("host {}: no key {want_key} in {leases:?}", w.n));
        let ctx = format!("host {}: lease {key} = {value}", w.n);
        assert_eq!(value["PublicIP"], "0.0.0.0", "PublicIP, {ctx}");
        assert_eq!(value["PublicIPv6"], host_ipv6(w.n).to_string(), "PublicIPv6, {ctx}");
        assert_eq!(value["BackendType"], "vxlan", "{ctx}");
        assert_eq!(value["BackendV6Data"]["VNI"], 1, "BackendV6Data.VNI, {ctx}");
        assert!(value["BackendV6Data"]["VtepMAC"].is_string(), "BackendV6Data.VtepMAC, {ctx}");
        assert!(value.get("BackendData").is_none(), "BackendData on an IPv6-only lease, {ctx}");
    }
    for w in &wefts[..2] {
        w.wait_log("--public-ip is ignored", Duration::from_secs(1));
    }

    for w in &wefts {
        let host = lab.host(w.n);
        // subnet.env: the IPv6 pair, FLANNEL_MTU and FLANNEL_IPMASQ; no IPv4 pair.
        let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
        for absent in ["FLANNEL_NETWORK=", "FLANNEL_SUBNET="] {
            assert!(!env.contains(absent), "host {}: {absent} in subnet.env:\n{env}", w.n);
        }
        let network_line = format!("FLANNEL_IPV6_NETWORK={IPV6_NETWORK}\n");
        for present in [network_line.as_str(), "FLANNEL_IPMASQ="] {
            assert!(env.contains(present), "host {}: no {present} in subnet.env:\n{env}", w.n);
        }
        // weft0: the IPv6 half as on a dual-stack network, and no IPv4 address or route.
        assert_tun_configured_v6(&lab, w);
        let link = weft0_link(&host);
        assert_eq!(inet_addrs(&link), Vec::<String>::new(), "weft0's IPv4 addresses: {link}");
        let mtu = link[0]["mtu"].as_u64().expect("weft0 mtu");
        assert!(env.contains(&format!("FLANNEL_MTU={mtu}\n")), "weft0's MTU {mtu} vs:\n{env}");
        let routes4 = run(&["ip", "-n", &host, "-4", "route", "show", "dev", "weft0"]);
        assert_eq!(routes4.trim(), "", "IPv4 routes through weft0 on host {}", w.n);
        // Sockets: VXLAN on [PublicIPv6]:8472, and no IPv4 UDP socket at all.
        assert_vxlan_socket_on_public_ipv6(w);
        let sockets4 = run(&["ip", "netns", "exec", &w.ns, "ss", "-H", "-u", "-a", "-n", "-4"]);
        assert_eq!(sockets4.trim(), "", "host {}: IPv4 UDP sockets", w.n);
    }

    // Pods from the IPv6-only subnet.env: an IPv6 address alone, in their host's subnet.
    let pods: Vec<Pod6> = wefts.iter().map(|w| lab.pod_ipv6_only(w.n, &w.subnet_file())).collect();
    for (pod, subnet6) in pods.iter().zip(&subnets) {
        let net: Ipv6Net = subnet6.parse().expect("IPv6 subnet");
        assert!(net.contains(&pod.ip6), "pod {} has {}, outside {net}", pod.ns, pod.ip6);
        let v4 = run(&["ip", "-n", &pod.ns, "-4", "addr", "show", "dev", "eth0"]);
        assert_eq!(v4.trim(), "", "pod {}: IPv4 addresses", pod.ns);
    }
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 2.0);
    }
    std::thread::scope(|s| {
        for a in &pods {
            for b in &pods {
                if a.ns != b.ns {
                    s.spawn(move || ping_ok(&a.ns, b.ip6, 3));
                }
            }
        }
    });
    iperf3_v6_only_both_ways(&pods[0], &pods[2], "weft host 1 <-> weft host 3");
}

/// [`iperf3_v6_both_ways`] between pods of an IPv6-only network.
fn iperf3_v6_only_both_ways(a: &Pod6, b: &Pod6, label: &str) {
    let server = Iperf3Server::start(&b.ns);
    let there = iperf3_bps(&a.ns, b.ip6, 2);
    drop(server);
    let _server = Iperf3Server::start(&a.ns);
    let back = iperf3_bps(&b.ns, a.ip6, 2);
    eprintln!(
        "iperf3 -6 {label}: {} -> {}: {:.3} Gbit/s; back: {:.3} Gbit/s",
        a.ip6,
        b.ip6,
        there / 1e9,
        back / 1e9
    );
    assert!(there > 0.0, "iperf3 -6 {label} {} -> {}: {there} bits/s", a.ns, b.ns);
    assert!(back > 0.0, "iperf3 -6 {label} {} -> {}: {back} bits/s", b.ns, a.ns);
}
