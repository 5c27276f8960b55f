//! End to end in network namespaces (docs/scenarios.md, "Test levels", 3): real etcd on an
//! underlay bridge, real `weft run` processes with the TUN data plane in host namespaces, pods
//! behind them, and ping / iperf3 across the overlay. Also a kernel VXLAN peer programmed the way
//! flannel's vxlan backend programs one, a non-root run, garbage at the UDP port, an etcd
//! partition under traffic, an unprivileged local user after the VXLAN port, and a flood of
//! idle connections to the health port.
//!
//! Needs root and the tools listed in `support::netns::REQUIRED_TOOLS`; without them every test
//! fails loudly. Each test builds its own lab (namespaces `wt<4 hex>*`), removed on drop.

mod support;

use std::io::Read as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::os::unix::fs::MetadataExt as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::kernel_flannel::KernelFlannelPeer;
use support::netns::{
    Families, HEALTH_PORT, HUB_IPV6, Iperf3Server, Lab, Pod, assert_tun_configured, finish_ping,
    first_reply, host_ipv6, in_netns, iperf3_bps, ns_output, ns_run, ns_spawn_nobody,
    ping_all_pairs, ping_lossy, ping_ok, run, spawn_ping,
};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const UDP: &str = r#"{"Network":"10.244.0.0/16","Backend":{"Type":"udp"}}"#;
const READY: Duration = Duration::from_secs(20);

fn ip_of(pod: &Pod) -> Ipv4Addr {
    pod.ip
}

/// The `.2` address in a subnet like `10.244.3.0/24`.
fn dot2(subnet: &str) -> Ipv4Addr {
    let net: Ipv4Addr = subnet.split('/').next().expect("subnet").parse().expect("subnet address");
    Ipv4Addr::from(u32::from(net) + 2)
}

fn vtep_mac(lab: &Lab, subnet: &str) -> String {
    let v = lab.lease_value(subnet).unwrap_or_else(|| panic!("no lease for {subnet}"));
    v["BackendData"]["VtepMAC"].as_str().unwrap_or_else(|| panic!("no VtepMAC in {v}")).to_owned()
}

// --- 1, 2: multi-host forwarding -----------------------------------------------------------

fn three_hosts(network: &str, label: &str, overhead: u32) {
    let lab = Lab::new(network);
    let (wefts, pods) = lab.up(&[1, 2, 3], &[]);
    for w in &wefts {
        assert_tun_configured(&lab, w, overhead);
    }
    ping_all_pairs(&pods, Families::V4);
    // A full-MTU packet with DF set crosses without fragmentation.
    let size = (1500 - overhead - 28).to_string();
    let big = ns_output(
        &pods[0].ns,
        &[
            "ping",
            "-n",
            "-c",
            "2",
            "-i",
            "0.2",
            "-W",
            "1",
            "-M",
            "do",
            "-s",
            &size,
            &pods[2].ip.to_string(),
        ],
    );
    assert!(
        big.status.success(),
        "full-MTU ping ({size}-byte payload, DF) failed:\n{}{}",
        String::from_utf8_lossy(&big.stdout),
        String::from_utf8_lossy(&big.stderr)
    );
    let _server = Iperf3Server::start(&pods[1].ns);
    let bps = iperf3_bps(&pods[0].ns, ip_of(&pods[1]), 3);
    eprintln!("iperf3 {label} pod1 -> pod2: {:.3} Gbit/s", bps / 1e9);
    assert!(bps > 0.0, "iperf3 {label} reported {bps} bits/s");
    // The kernels these tests run on (Linux 6.x, veth underlay) take every offload but USO,
    // which is optional; /metrics says which are in use.
    for kind in ["tun_tso", "udp_gso", "udp_gro"] {
        let name = format!("weft_dataplane_offload{{kind=\"{kind}\"}}");
        assert_eq!(wefts[0].metric(&name), Some(1.0), "{name} on host 1 ({label})");
    }
}

// --- 0: the lab itself ----------------------------------------------------------------------

/// A host keeps reaching the hub (etcd's address) when a port with a lower MAC joins the hub's
/// bridge. Without a MAC of its own the bridge takes the new lowest port MAC, and a host that
/// had resolved 192.0.2.254 before loses it for up to 45 s.
#[test]
fn a_host_keeps_reaching_the_hub_when_a_lower_mac_joins_its_bridge() {
    let lab = Lab::new(VXLAN);
    let hub = lab.hub();
    lab.host(1);
    let h2 = lab.host(2);
    // Host 1's port has the lower MAC, so a bridge without a MAC of its own answers host 2 with
    // host 1's port's: a frame to a port's MAC is taken in only through that port.
    ns_run(&hub, &["ip", "link", "set", "h1", "address", "02:00:00:00:00:01"]);
    ns_run(&hub, &["ip", "link", "set", "h2", "address", "02:00:00:00:00:02"]);
    ping_ok(&h2, Ipv4Addr::new(192, 0, 2, 254), 1);
    // A port with a still lower MAC joins, within the second in which host 2's neighbour entry
    // ignores the gratuitous ARP that the bridge sends when its own MAC changes.
    ns_run(&hub, &["ip", "link", "add", "x0", "address", "00:00:00:00:00:01", "type", "veth"]);
    ns_run(&hub, &["ip", "link", "set", "x0", "master", "br0", "up"]);
    ping_ok(&h2, Ipv4Addr::new(192, 0, 2, 254), 2);
}

#[test]
fn vxlan_three_hosts_ping_every_pair_and_carry_iperf3() {
    three_hosts(VXLAN, "vxlan", 50);
}

#[test]
fn udp_three_hosts_ping_every_pair_and_carry_iperf3() {
    three_hosts(UDP, "udp", 28);
}

// --- 2b: a dual-stack network on the udp backend ----------------------------------------------

/// flannel's udp backend on a dual-stack network: every lease gets an IPv6 half (in its key and
/// in subnet.env, where flannel's CNI plugin reads it), IPv4 is carried, and the start says that
/// IPv6 is not (docs/dual-stack.md).
#[test]
fn udp_dual_stack_network_leases_both_halves_and_carries_ipv4() {
    let lab = Lab::new(
        r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"udp"}}"#,
    );
    let (wefts, pods) = lab.up(&[1, 2, 3], &[]);
    ping_all_pairs(&pods, Families::V4);
    let keys = lab.etcdctl(&["get", "--prefix", "--keys-only", "/coreos.com/network/subnets/"]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    let mut halves = std::collections::BTreeSet::new();
    for w in &wefts {
        let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
        assert!(env.contains("FLANNEL_IPV6_NETWORK=fd00:10:244::/56\n"), "{env}");
        let half = env
            .lines()
            .find_map(|l| l.strip_prefix("FLANNEL_IPV6_SUBNET="))
            .unwrap_or_else(|| panic!("no FLANNEL_IPV6_SUBNET:\n{env}"));
        // `fd00:10:244:N::1/64` names the key `<v4>&fd00:10:244:N::-64`.
        let (first, len) = half.split_once('/').expect("addr/len");
        let net = first.strip_suffix('1').expect("the first host address");
        let v4 = w.subnet().expect("FLANNEL_SUBNET").replace('/', "-");
        let key = format!("/coreos.com/network/subnets/{v4}&{net}-{len}");
        assert!(keys.contains(&key.as_str()), "{key} not among {keys:?}");
        assert!(halves.insert(half.to_owned()), "two hosts with {half}");
        assert!(w.log().contains("the udp backend carries IPv4 only"), "{}", w.log_tail(20));
    }
    // The pods are dual-stack all the same, as flannel's CNI plugin makes them: an IPv6 address
    // from their host's FLANNEL_IPV6_SUBNET.
    for (w, p) in wefts.iter().zip(&pods) {
        let half: ipnet::Ipv6Net = w.subnet6().expect("FLANNEL_IPV6_SUBNET").parse().expect("v6");
        let ip6 = p.ip6.unwrap_or_else(|| panic!("pod {} has no IPv6 address", p.ns));
        assert!(half.contains(&ip6), "pod {} has {ip6}, outside its host's {half}", p.ns);
    }
    // The lab's IPv6 underlay: hosts reach each other and the hub over 2001:db8::/64.
    ping_ok(&lab.host(1), host_ipv6(2), 2);
    ping_ok(&lab.host(3), HUB_IPV6, 1);
    // `weft lease list` shows each half beside its subnet.
    let list = lab.admin(&["lease", "list"]);
    assert!(list.starts_with("SUBNET             IPV6-SUBNET"), "{list}");
    for w in &wefts {
        let v4 = w.subnet().expect("subnet");
        let row = list.lines().find(|l| l.starts_with(&v4)).unwrap_or_else(|| panic!("{list}"));
        assert!(row.contains("fd00:10:244:") && row.contains("::/64"), "{row}");
    }
}

// --- 3: a host joining later ---------------------------------------------------------------

#[test]
fn late_joiner_is_reachable_within_a_second_of_turning_ready() {
    let lab = Lab::new(VXLAN);
    let (_wefts, pods) = lab.up(&[1, 2], &[]);
    let mut w3 = lab.start_weft(3, &[]);
    let deadline = Instant::now() + READY;
    while !w3.ready() {
        assert!(
            w3.running() && Instant::now() < deadline,
            "host 3 never ready:\n{}",
            w3.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let ready_at = Instant::now();
    let pod3 = lab.pod(3, &w3.subnet_file());
    let pod_setup = ready_at.elapsed();
    let first = first_reply(&pods[0].ns, pod3.ip, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("pod 1 never reached the late joiner's pod {}", pod3.ip));
    let since_ready = ready_at.elapsed();
    eprintln!(
        "late joiner: pod set up {pod_setup:?} after ready; first reply {since_ready:?} after \
         ready ({first:?} of pinging)"
    );
    assert!(
        since_ready < Duration::from_secs(1) + pod_setup,
        "first reply {since_ready:?} after host 3 turned ready (pod setup took {pod_setup:?})"
    );
    ping_ok(&pod3.ns, pods[1].ip, 3);
}

// --- 4: a host leaving with --relinquish-on-exit ------------------------------------------

#[test]
fn relinquishing_host_is_unrouted_on_the_others() {
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    let mut w3 = lab.start_weft(3, &["--relinquish-on-exit"]);
    let s3 = w3.wait_ready(READY);
    let pod3 = lab.pod(3, &w3.subnet_file());
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 2.0);
    }
    ping_ok(&pods[0].ns, pod3.ip, 3);
    assert_eq!(w3.stop(), Some(0), "weft 3 exit code after SIGTERM");
    assert!(lab.lease_value(&s3).is_none(), "host 3's lease {s3} is still in etcd");
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(3), |v| v == 1.0);
    }
    let no_route = "weft_dataplane_drops_total{dir=\"tx\",reason=\"no_route\"}";
    let before = wefts[0].metric(no_route).unwrap_or(0.0);
    let r = ping_lossy(&pods[0].ns, pod3.ip, 3, 0.2);
    eprintln!("ping to the departed host's pod:\n{}", r.text);
    assert_eq!(r.received, 0, "the departed host's pod still answers:\n{}", r.text);
    let after = wefts[0].metric(no_route).unwrap_or(0.0);
    assert!(after >= before + 3.0, "no_route drops on host 1 went {before} -> {after}");
    ping_ok(&pods[0].ns, pods[1].ip, 2);
    assert!(wefts[0].running() && wefts[1].running());
}

// --- 5: a restarted host ------------------------------------------------------------------

#[test]
fn restarted_host_keeps_its_subnet_and_traffic_resumes() {
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    ping_ok(&pods[0].ns, pods[1].ip, 2);
    let env_before = std::fs::read(wefts[1].subnet_file()).expect("subnet.env");
    let subnet = wefts[1].subnet().expect("subnet");
    let mac_before = vtep_mac(&lab, &subnet);
    assert_eq!(wefts[1].stop(), Some(0), "weft 2 exit code after SIGTERM");
    wefts[1].start();
    let again = wefts[1].wait_ready(READY);
    assert_eq!(again, subnet, "host 2 changed subnet across a restart");
    let env_after = std::fs::read(wefts[1].subnet_file()).expect("subnet.env");
    assert_eq!(env_before, env_after, "subnet.env changed across a restart");
    // Kernel peers hold the VtepMAC in permanent neighbour entries: it must survive a restart.
    assert_eq!(vtep_mac(&lab, &subnet), mac_before, "VtepMAC changed across a restart");
    let first = first_reply(&pods[0].ns, pods[1].ip, Duration::from_secs(5));
    eprintln!("restart: first reply {first:?} after ready");
    assert!(first.is_some(), "traffic did not resume after the restart");
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
}

// --- 6: a kernel VXLAN peer programmed as flannel does ------------------------------------

#[test]
fn kernel_vxlan_peer_set_up_like_flannel_interoperates_both_ways() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    // flannel.1 over 192.0.2.9, addressed 10.244.200.0/32, its lease a reservation in etcd.
    let k9 = KernelFlannelPeer::new(&lab, 9, "10.244.200.0/24", None);
    // Program the kernel host for each weft host, as flannel's handleSubnetEvents does.
    for w in &wefts {
        let lease = lab.vxlan_lease(&w.subnet().expect("subnet"));
        assert_eq!(lease.public_ip, Ipv4Addr::new(192, 0, 2, w.n));
        k9.program(&lease);
    }
    let pod9 = k9.pod(&lab, 1450);
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 2.0);
    }
    for p in &pods {
        ping_ok(&pod9.ns, p.ip, 3);
        ping_ok(&p.ns, pod9.ip, 3);
    }
    let server = Iperf3Server::start(&pod9.ns);
    let to_kernel = iperf3_bps(&pods[0].ns, pod9.ip, 2);
    drop(server);
    let _server = Iperf3Server::start(&pods[0].ns);
    let from_kernel = iperf3_bps(&pod9.ns, pods[0].ip, 2);
    eprintln!(
        "iperf3 weft pod1 -> kernel pod9: {:.3} Gbit/s; kernel pod9 -> weft pod1: {:.3} Gbit/s",
        to_kernel / 1e9,
        from_kernel / 1e9
    );
    assert!(to_kernel > 0.0 && from_kernel > 0.0);
}

// --- 7: non-root with only CAP_NET_ADMIN -------------------------------------------------

#[test]
fn nonroot_weft_with_only_cap_net_admin_forwards() {
    let lab = Lab::new(VXLAN);
    let mut w1 = lab.start_weft(1, &[]);
    let mut w2 = lab.start_weft_nonroot(2, &[]);
    w1.wait_ready(READY);
    w2.wait_ready(READY);
    let status = std::fs::read_to_string(format!("/proc/{}/status", w2.pid())).expect("status");
    let field = |k: &str| {
        status.lines().find_map(|l| l.strip_prefix(k)).map(str::trim).unwrap_or("?").to_owned()
    };
    eprintln!(
        "non-root weft: Uid {} Gid {} CapEff {}",
        field("Uid:"),
        field("Gid:"),
        field("CapEff:")
    );
    assert!(field("Uid:").split_whitespace().all(|u| u == "65534"), "uids: {}", field("Uid:"));
    assert!(field("Gid:").split_whitespace().all(|g| g == "65534"), "gids: {}", field("Gid:"));
    // CAP_NET_ADMIN is bit 12.
    assert_eq!(field("CapEff:"), "0000000000001000", "effective capabilities");
    assert_eq!(field("CapBnd:"), "0000000000001000", "bounding set");
    let p1 = lab.pod(1, &w1.subnet_file());
    let p2 = lab.pod(2, &w2.subnet_file());
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    ping_ok(&p1.ns, p2.ip, 3);
    ping_ok(&p2.ns, p1.ip, 3);
}

/// As in a Kubernetes container: uid 65534, NET_ADMIN in the bounding set only (no ambient
/// capabilities), the binary carrying it as a permitted file capability (the image's,
/// scripts/package.sh). weft raises it at start and forwards.
#[test]
fn nonroot_weft_takes_cap_net_admin_from_its_binary_without_ambient_capabilities() {
    let lab = Lab::new(VXLAN);
    let bin = lab.dir().join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let exe = bin.join("weft");
    std::fs::copy(env!("CARGO_BIN_EXE_weft"), &exe).expect("copy weft");
    run(&["setcap", "cap_net_admin,cap_net_raw+p", exe.to_str().unwrap()]);
    let mut w1 = lab.start_weft(1, &[]);
    let mut w2 = lab.unstarted_weft_nonroot(2, &[]);
    w2.exe = Some(exe);
    w2.nonroot_ambient = false;
    w2.start();
    w1.wait_ready(READY);
    w2.wait_ready(READY);
    assert!(w2.log().contains("raised the capabilities the binary permits"), "{}", w2.log_tail(20));
    let status = std::fs::read_to_string(format!("/proc/{}/status", w2.pid())).expect("status");
    let field = |k: &str| {
        status.lines().find_map(|l| l.strip_prefix(k)).map(str::trim).unwrap_or("?").to_owned()
    };
    assert_eq!(field("CapAmb:"), "0000000000000000", "ambient capabilities");
    assert_eq!(field("CapEff:"), "0000000000001000", "effective: NET_ADMIN alone (the bound)");
    let p1 = lab.pod(1, &w1.subnet_file());
    let p2 = lab.pod(2, &w2.subnet_file());
    w2.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    ping_ok(&p1.ns, p2.ip, 3);
    ping_ok(&p2.ns, p1.ip, 3);
}

// --- 8: garbage at the UDP port while traffic flows ----------------------------------------

fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 =
        bytes.chunks(2).map(|c| u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4/UDP packet to port 9999 (UDP checksum 0: none).
fn ipv4_udp(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    let total = 28 + payload.len();
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&p[..20]);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&9999u16.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p[28..].copy_from_slice(payload);
    p
}

/// A VXLAN payload: header (flags, VNI), inner Ethernet to `dst_mac`, then `inner`.
fn vxlan(flags: u8, vni: u32, dst_mac: [u8; 6], inner: &[u8]) -> Vec<u8> {
    let v = vni.to_be_bytes();
    let mut f = vec![flags, 0, 0, 0, v[1], v[2], v[3], 0];
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x33, 0x08, 0x00]);
    f.extend_from_slice(inner);
    f
}

fn send_all(ns: &str, from: Ipv4Addr, to: SocketAddrV4, frames: &[Vec<u8>]) {
    in_netns(ns, || {
        let s = UdpSocket::bind((from, 0)).expect("bind garbage sender");
        for f in frames {
            s.send_to(f, to).expect("send garbage");
            std::thread::sleep(Duration::from_millis(2));
        }
    });
}

#[test]
fn garbage_at_the_vxlan_port_is_dropped_and_counted_while_traffic_flows() {
    const K: usize = 20;
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2, 3], &[]);
    let (s1, s2, s3) = (
        wefts[0].subnet().expect("s1"),
        wefts[1].subnet().expect("s2"),
        wefts[2].subnet().expect("s3"),
    );
    let mac2 =
        weft::dataplane::wire::ethernet::MacAddr::parse(&vtep_mac(&lab, &s2)).expect("a VtepMAC").0;
    let pod2 = pods[1].ip;

    // A listener in pod 2: it must get the legitimate datagrams and none of the garbage.
    let listener = in_netns(&pods[1].ns, || UdpSocket::bind(("0.0.0.0", 9999)).expect("bind 9999"));
    listener.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
    let stop = Arc::new(AtomicBool::new(false));
    let got = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::SeqCst) {
                if let Ok((n, from)) = listener.recv_from(&mut buf) {
                    got.push((from, buf[..n].to_vec()));
                }
            }
            got
        })
    };

    let reasons = [
        "malformed",
        "bad_vxlan_flags",
        "wrong_vni",
        "not_our_mac",
        "spoofed_source",
        "not_for_us",
        "unknown_sender",
    ];
    let before: Vec<f64> = reasons.iter().map(|r| wefts[1].rx_drops(r)).collect();
    let rx_before = wefts[1].metric("weft_dataplane_rx_packets_total").unwrap_or(0.0);

    let ping = spawn_ping(&pods[0].ns, pod2, 150, 0.02);
    std::thread::sleep(Duration::from_millis(300));

    let garbage = |src: Ipv4Addr, dst: Ipv4Addr| ipv4_udp(src, dst, b"garbage");
    let good_inner = garbage(dot2(&s3), pod2);
    let mut from_host3: Vec<(&str, Vec<u8>)> = Vec::new();
    for i in 0..K {
        // Short: a few bytes; a VXLAN header alone; an IPv4 header cut short inside the frame.
        let short = match i % 4 {
            0 => vec![0x08],
            1 => vec![0x08, 0, 0, 0, 0, 0, 1],
            2 => vec![0x08, 0, 0, 0, 0, 0, 1, 0],
            _ => vxlan(0x08, 1, mac2, &good_inner[..10]),
        };
        from_host3.push(("malformed", short));
        let flags = if i % 2 == 0 { 0x00 } else { 0x88 };
        from_host3.push(("bad_vxlan_flags", vxlan(flags, 1, mac2, &good_inner)));
        from_host3.push(("wrong_vni", vxlan(0x08, 2 + i as u32, mac2, &good_inner)));
        from_host3.push(("not_our_mac", vxlan(0x08, 1, [0x02, 0, 0, 0, 0, 0x99], &good_inner)));
        from_host3.push(("spoofed_source", vxlan(0x08, 1, mac2, &garbage(dot2(&s1), pod2))));
        from_host3.push(("not_for_us", vxlan(0x08, 1, mac2, &garbage(dot2(&s3), dot2(&s1)))));
    }
    let frames3: Vec<Vec<u8>> = from_host3.iter().map(|(_, f)| f.clone()).collect();
    // From the hub: a perfectly formed frame, but 192.0.2.254 is no peer.
    let frames_hub: Vec<Vec<u8>> = (0..K).map(|_| vxlan(0x08, 1, mac2, &good_inner)).collect();
    let to = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 8472);
    let h3 = lab.host(3);
    std::thread::scope(|s| {
        s.spawn(|| send_all(&h3, Ipv4Addr::new(192, 0, 2, 3), to, &frames3));
        s.spawn(|| send_all(&lab.hub(), Ipv4Addr::new(192, 0, 2, 254), to, &frames_hub));
    });
    // Legitimate datagrams from pod 1 through the overlay, as a control for the listener.
    in_netns(&pods[0].ns, || {
        let s = UdpSocket::bind(("0.0.0.0", 0)).expect("bind");
        for _ in 0..5 {
            s.send_to(b"legit", (pod2, 9999)).expect("send legit");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let r = finish_ping(ping);
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let got = got.join().expect("listener thread");

    assert!(wefts[1].running(), "weft 2 died under garbage:\n{}", wefts[1].log_tail(40));
    assert_eq!(wefts[1].get("/healthz").0, 200, "weft 2 /healthz after garbage");
    eprintln!("ping under garbage: {}/{} replies", r.received, r.transmitted);
    assert!(r.loss() < 0.1, "ping under garbage lost {:.1}%:\n{}", r.loss() * 100.0, r.text);
    let mut report = Vec::new();
    for (i, reason) in reasons.iter().enumerate() {
        let after = wefts[1].rx_drops(reason);
        report.push(format!("{reason}: {} -> {after}", before[i]));
        assert!(
            after - before[i] >= K as f64,
            "rx drops {reason} rose by {} < {K}: {report:?}",
            after - before[i]
        );
    }
    eprintln!("drop counters on host 2: {report:?}");
    let rx_after = wefts[1].metric("weft_dataplane_rx_packets_total").unwrap_or(0.0);
    eprintln!(
        "rx packets on host 2: {rx_before} -> {rx_after} (ping {} requests + 5 legit)",
        r.transmitted
    );
    let garbage_got: Vec<_> = got.iter().filter(|(_, p)| p.as_slice() != b"legit").collect();
    assert!(garbage_got.is_empty(), "garbage delivered to pod 2: {garbage_got:?}");
    assert_eq!(got.len(), 5, "pod 2's listener got {} legit datagrams, expected 5", got.len());
    for w in &mut wefts {
        assert!(w.running(), "weft {} died", w.n);
    }
}

// --- 9: partitioned from etcd under traffic (S5) ------------------------------------------

#[test]
fn etcd_partition_of_three_ttls_keeps_traffic_and_the_subnet() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    let s1 = wefts[0].subnet().expect("s1");
    let h1 = lab.host(1);
    // 10 pings/s for 19 s: 2 s before, 12 s (three 4 s TTLs) partitioned, 5 s after.
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 190, 0.1);
    std::thread::sleep(Duration::from_secs(2));
    run(&["ip", "-n", &h1, "route", "add", "blackhole", "192.0.2.254/32"]);
    std::thread::sleep(Duration::from_secs(12));
    let stale = wefts[1].metric("weft_routes_stale");
    let key_gone = lab.lease_value(&s1).is_none();
    run(&["ip", "-n", &h1, "route", "del", "blackhole", "192.0.2.254/32"]);
    let r = finish_ping(ping);
    eprintln!(
        "partition: ping {}/{} replies ({:.1}% loss); during it host 1's key gone: {key_gone}, \
         host 2 weft_routes_stale={stale:?}",
        r.received,
        r.transmitted,
        r.loss() * 100.0
    );
    assert!(r.loss() < 0.1, "ping lost {:.1}% across the partition:\n{}", r.loss() * 100.0, r.text);
    // Three TTLs cut off: host 1's key expired, and host 2 routes to it on, as a stale route.
    assert!(key_gone, "host 1's key outlived three TTLs without renewal");
    assert_eq!(stale, Some(1.0), "host 2 does not keep host 1's route as stale");
    wefts[0].wait_log("recovered", Duration::from_secs(20));
    let ready_deadline = Instant::now() + Duration::from_secs(10);
    while !wefts[0].ready() {
        assert!(Instant::now() < ready_deadline, "host 1 not ready after the partition");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(wefts[0].subnet().as_deref(), Some(s1.as_str()), "host 1 changed subnet");
    assert!(lab.lease_value(&s1).is_some(), "host 1's lease is not back in etcd");
    ping_ok(&pods[1].ns, pods[0].ip, 3);
}

// --- a destination in no lease ------------------------------------------------------------

/// flannel's udp backend answers a destination outside every lease with ICMP net unreachable
/// written back into the TUN device; weft does the same (src/dataplane/transport/), and the pod must see it.
#[test]
fn unleased_destination_gets_icmp_net_unreachable_at_the_pod() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    let no_route = "weft_dataplane_drops_total{dir=\"tx\",reason=\"no_route\"}";
    let before = wefts[0].metric(no_route).unwrap_or(0.0);
    let r = ping_lossy(&pods[0].ns, Ipv4Addr::new(10, 244, 250, 2), 2, 0.2);
    let after = wefts[0].metric(no_route).unwrap_or(0.0);
    assert!(after >= before + 2.0, "weft 1 counted no_route drops {before} -> {after}");
    let h1 = lab.host(1);
    let stats = run(&["ip", "-n", &h1, "-s", "link", "show", "weft0"]);
    assert!(
        r.text.contains("Destination Net Unreachable"),
        "weft answered (no_route {before} -> {after}), but pod 1 saw no ICMP net \
         unreachable:\n{}\nweft0 on host 1:\n{stats}",
        r.text
    );
}

// --- hostile neighbours: a local user after the VXLAN port -----------------------------------

/// Binds UDP `argv[1]:8472` with `argv[2]` (`SO_REUSEADDR` or `SO_REUSEPORT`) and counts what
/// it receives for `argv[3]` seconds: prints `refused <errno>`, or `bound` then `received <n>`.
const PORT_THIEF: &str = r#"
import socket, sys, time
addr, opt, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), 1)
try:
    s.bind((addr, 8472))
except OSError as e:
    print("refused", e.errno, flush=True)
    sys.exit(0)
print("bound", flush=True)
s.settimeout(0.1)
n, end = 0, time.time() + secs
while time.time() < end:
    try:
        s.recv(65536)
        n += 1
    except socket.timeout:
        pass
print("received", n, flush=True)
"#;

/// An unprivileged user on host 2 (uid 65534, no capabilities) tries to bind weft's VXLAN port
/// beside it — on the wildcard and on the public IP, with `SO_REUSEADDR` and with
/// `SO_REUSEPORT` — while pod traffic flows: every bind must fail or receive nothing, and no
/// ping may be lost.
#[test]
fn an_unprivileged_local_user_cannot_take_the_vxlan_port() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    let h2 = lab.host(2);
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 50, 0.1);
    std::thread::sleep(Duration::from_millis(500));
    let tries: Vec<(String, std::process::Child)> = ["0.0.0.0", "192.0.2.2"]
        .into_iter()
        .flat_map(|addr| ["SO_REUSEADDR", "SO_REUSEPORT"].map(|opt| (addr, opt)))
        .map(|(addr, opt)| {
            let child = ns_spawn_nobody(&h2, &["python3", "-c", PORT_THIEF, addr, opt, "3"]);
            (format!("{addr}:8472 with {opt}"), child)
        })
        .collect();
    let outcomes: Vec<(String, String)> = tries
        .into_iter()
        .map(|(what, child)| {
            let out = child.wait_with_output().expect("wait for the binder");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (what, text)
        })
        .collect();
    let r = finish_ping(ping);
    eprintln!("ping while a neighbour tries the port: {}/{} replies", r.received, r.transmitted);
    for (what, text) in &outcomes {
        eprintln!("neighbour binding {what}: {}", text.trim().replace('\n', "; "));
        assert!(
            text.starts_with("refused") || text.contains("received 0\n"),
            "a neighbour bound {what} and received weft's traffic:\n{text}"
        );
    }
    assert!(
        r.transmitted == 50 && r.loss() < 0.05,
        "ping lost {:.1}% while a neighbour tried the port:\n{}",
        r.loss() * 100.0,
        r.text
    );
    assert!(wefts.iter().all(|w| w.get("/healthz").0 == 200));
}

// --- hostile neighbours: idle connections to the health port ---------------------------------

/// The open file descriptors of process `pid`.
fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Whether the other end closed `conn` (EOF or reset); `conn` must be non-blocking.
fn closed_by_peer(mut conn: &TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// 1,100 idle TCP connections to the health port once took every file
/// descriptor weft had, for good, so `/readyz` stopped answering and `subnet.env` could not be
/// written after a lease loss. Here weft's limit is the usual 1,024 (set with `prlimit` after
/// its start, as hard, so its own raise at start cannot hide the flood) and a neighbour on the
/// host opens 1,100 connections and sends nothing. Every expectation is checked and all that
/// fail are reported together:
/// - weft holds at most its cap of them: its descriptors stay under 200;
/// - `/readyz` answers 200 within a second while the flood is open;
/// - a revoked lease is reclaimed and `subnet.env` rewritten (a new inode) without a failed
///   write;
/// - the held connections have TCP keepalive on, and weft closes every one of the 1,100
///   within the idle timeout (`--healthz-idle-timeout 3s`) and a little.
#[test]
fn an_idle_flood_of_the_health_port_takes_no_more_than_its_cap_and_starves_nothing() {
    const FLOOD: usize = 1100;
    let idle_timeout = Duration::from_secs(3);
    let lab = Lab::new(VXLAN);
    let mut w = lab.start_weft(1, &["--healthz-idle-timeout", "3s"]);
    let subnet = w.wait_ready(READY);
    assert!(
        w.log().contains("open file limit (RLIMIT_NOFILE)"),
        "the start did not log its open file limit:\n{}",
        w.log_tail(40)
    );
    let pid = w.pid();
    run(&["prlimit", "--pid", &pid.to_string(), "--nofile=1024:1024"]);
    let before = open_fds(pid);
    // The flood's client ends are this test's own descriptors.
    let mine = weft::rlimit::raise_nofile_to_hard().expect("raising the test's own fd limit");
    assert!(mine.new_soft > 2 * FLOOD as u64, "the test's fd limit is too low: {mine:?}");

    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, HEALTH_PORT));
    let mut most = before;
    let (flood, failed) = in_netns(&w.ns, || {
        let (mut flood, mut failed) = (Vec::new(), Vec::new());
        for i in 0..FLOOD {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(c) => flood.push(c),
                Err(e) => failed.push(format!("connection {i}: {e}")),
            }
            if i % 20 == 0 {
                most = most.max(open_fds(pid));
            }
        }
        (flood, failed)
    });
    let flood_open = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    most = most.max(open_fds(pid));
    let mut problems = Vec::new();
    if !failed.is_empty() {
        problems.push(format!("{} connects failed, first: {}", failed.len(), failed[0]));
    }
    if most >= 200 {
        problems.push(format!("weft had {most} open fds during the flood ({before} before)"));
    }

    let asked = Instant::now();
    let (status, body) = w.get("/readyz");
    let answered = asked.elapsed();
    if status != 200 || answered > Duration::from_secs(1) {
        problems.push(format!("/readyz during the flood: {status} {body:?} after {answered:?}"));
    }

    let ss = String::from_utf8_lossy(
        &ns_output(&w.ns, &["ss", "-tnoH", "state", "established", "( sport = :9797 )"]).stdout,
    )
    .into_owned();
    let held: Vec<&str> = ss.lines().filter(|l| !l.trim().is_empty()).collect();
    let keepalive = held.iter().filter(|l| l.contains("timer:(keepalive")).count();
    if held.is_empty() || held.len() > 64 || keepalive < held.len() {
        problems.push(format!(
            "{} health connections established, {keepalive} of them with TCP keepalive; the \
             first:\n{}",
            held.len(),
            held[..held.len().min(3)].join("\n")
        ));
    }

    // A lease revoked during the flood is reclaimed and subnet.env written again.
    let inode = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.ino()).ok();
    let old_inode = inode(&w.subnet_file());
    lab.admin(&["lease", "revoke", &subnet]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while inode(&w.subnet_file()) == old_inode && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let recovered = w.metric("weft_lease_recoveries_total");
    let write_failures = w.metric("weft_subnet_file_write_failures_total");
    if inode(&w.subnet_file()) == old_inode
        || recovered != Some(1.0)
        || write_failures != Some(0.0)
        || w.subnet().as_deref() != Some(subnet.as_str())
    {
        problems.push(format!(
            "after a revoke during the flood: subnet.env rewritten: {}, recoveries {recovered:?}, \
             subnet.env write failures {write_failures:?}, subnet.env names {:?}",
            inode(&w.subnet_file()) != old_inode,
            w.subnet()
        ));
    }
    if w.log().contains("Too many open files") {
        problems.push("weft logged \"Too many open files\"".to_owned());
    }

    // Every connection closed by weft within the idle timeout (after the flood) and a little.
    for c in &flood {
        c.set_nonblocking(true).expect("non-blocking");
    }
    let deadline = flood_open + idle_timeout + Duration::from_secs(3);
    let mut open = flood.len();
    while open > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        open = flood.iter().filter(|c| !closed_by_peer(c)).count();
    }
    if open > 0 {
        problems.push(format!(
            "{open} of {} connections still open {:?} after the flood",
            flood.len(),
            flood_open.elapsed()
        ));
    }
    let closed_early = w.metric("weft_health_connections_evicted_total").unwrap_or(0.0)
        + w.metric("weft_health_connections_refused_total").unwrap_or(0.0);
    let timed_out = w.metric("weft_health_connections_timed_out_total").unwrap_or(0.0);
    eprintln!(
        "health port flood: {most} fds at most ({before} before, {} after); /readyz in \
         {answered:?}; {closed_early} connections closed for room, {timed_out} timed out",
        open_fds(pid)
    );
    if closed_early < (FLOOD - 64) as f64 || timed_out < 1.0 {
        problems.push(format!(
            "counted {closed_early} connections closed for room (evicted or refused), \
             {timed_out} timed out"
        ));
    }
    assert!(w.running(), "weft exited:\n{}", w.log_tail(40));
    assert!(
        problems.is_empty(),
        "under a flood of {FLOOD} idle connections to the health port:\n- {}\n--- log ---\n{}",
        problems.join("\n- "),
        w.log_tail(30)
    );
}

// --- a second weft on the same host -----------------------------------------------------------

/// A second `weft run` with the same flags (state dir, subnet file, TUN name) in the same
/// namespace waits — says so in its log and on `/readyz` — without touching the TUN device or
/// the port, so the first one's traffic loses nothing; when the first exits, it takes over.
#[test]
fn a_second_weft_on_the_same_state_dir_and_tun_waits_then_takes_over() {
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    let subnet = wefts[0].subnet().expect("host 1's subnet");
    let first_pid = wefts[0].pid();
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 60, 0.1);
    std::thread::sleep(Duration::from_millis(300));
    let mut twin = wefts[0].twin(9798);
    twin.wait_log("waiting for it to exit", Duration::from_secs(10));
    let waited_from = Instant::now();
    let log = twin.log();
    let line = log.lines().find(|l| l.contains("waiting for it to exit")).expect("the line");
    assert!(line.contains(" WARN "), "not a warning: {line}");
    assert!(line.contains(&format!("/state/lock (pid {first_pid})")), "{line}");
    // Several seconds of waiting: not ready, saying why, and nothing of the data plane.
    while waited_from.elapsed() < Duration::from_secs(4) {
        let (status, body) = twin.get("/readyz");
        assert_eq!(status, 503, "the second weft's /readyz: {body}");
        assert!(body.contains("another weft holds") && body.contains("waiting"), "{body}");
        assert!(twin.running(), "the second weft exited:\n{}", twin.log_tail(20));
        std::thread::sleep(Duration::from_millis(250));
    }
    let log = twin.log();
    assert_eq!(log.matches("waiting for it to exit").count(), 1, "logged more than once:\n{log}");
    assert!(!log.contains("data plane up"), "the second weft started a data plane:\n{log}");
    let r = finish_ping(ping);
    eprintln!("ping while a second weft waits: {}/{} replies", r.received, r.transmitted);
    assert!(
        r.transmitted == 60 && r.received == r.transmitted,
        "the first weft's traffic lost packets while the second waited:\n{}",
        r.text
    );
    assert!(wefts[0].ready(), "the first weft is no longer ready");

    // The first exits: the second takes the state dir and the TUN device, with the lease.
    assert_eq!(wefts[0].stop(), Some(0), "weft 1 exit code after SIGTERM");
    let again = twin.wait_ready(READY);
    assert_eq!(again, subnet, "the second weft took another subnet");
    assert!(twin.log().contains("data plane up"));
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
}

/// A second weft with its own state dir but the TUN name of a running one waits for the TUN
/// device instead of attaching queues to it.
#[test]
fn a_second_weft_on_the_same_tun_device_waits_for_it() {
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 40, 0.1);
    // Same namespace and TUN name, another state dir and subnet file (a copy of host 1's
    // identity would be a clone; a fresh one is another node).
    let mut other = wefts[0].sibling_in(lab.dir().join("h1-other"), 9799);
    other.wait_log("TUN device weft0 is in use by another process", Duration::from_secs(10));
    let (status, body) = other.get("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("TUN device weft0 is in use"), "{body}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(!other.log().contains("data plane up"), "{}", other.log_tail(20));
    let r = finish_ping(ping);
    assert!(r.received == r.transmitted && r.transmitted == 40, "{}", r.text);
    assert_eq!(wefts[0].stop(), Some(0));
    other.wait_ready(READY);
    assert!(other.log().contains("data plane up"));
}

// --- a cloned disk during a partition ------------------------------------------------------

/// Host 1 is cut off from etcd (its 60 s lease still valid locally) and its state dir is copied
/// to host 3, which starts with it: a clone. Host 1 must stop saying ready once it can no longer
/// confirm its identity in the store (its presence TTL, 10 s), while the clone, once host 1's
/// presence key has expired, adopts the lease and is ready: never two ready hosts on one subnet.
/// After the heal host 1 finds the clone alive (an identity clash): it withdraws the subnet —
/// no address or route on weft0, no subnet.env — and says why on /readyz.
#[test]
fn a_cloned_disk_during_a_partition_never_gives_two_ready_hosts_one_subnet() {
    let lab = Lab::new(VXLAN);
    let mut a = lab.unstarted_weft(1, &[]);
    a.ttl = "60s".into();
    a.start();
    let subnet = a.wait_ready(READY);
    let h1 = lab.host(1);
    run(&["ip", "-n", &h1, "route", "add", "blackhole", "192.0.2.254/32"]);
    let cut = Instant::now();
    let mut b = lab.unstarted_weft(3, &[]);
    b.ttl = "60s".into();
    let state = b.dir().join("state");
    std::fs::create_dir_all(&state).expect("clone's state dir");
    for f in ["node-id", "vtep-mac"] {
        std::fs::copy(a.dir().join("state").join(f), state.join(f)).expect("copy the state");
    }
    b.start();
    // Until the clone is ready, and 3 s beyond: never both ready.
    let mut b_ready_at = None;
    let mut a_unready_after = None;
    while b_ready_at.is_none_or(|t: Instant| t.elapsed() < Duration::from_secs(3)) {
        assert!(cut.elapsed() < Duration::from_secs(45), "the clone never became ready");
        let (a_ready, b_ready) = (a.ready(), b.ready());
        assert!(
            !(a_ready && b_ready),
            "both hosts ready {:?} after the cut\n--- host 1 ---\n{}\n--- host 3 ---\n{}",
            cut.elapsed(),
            a.log_tail(20),
            b.log_tail(20)
        );
        if !a_ready {
            a_unready_after.get_or_insert(cut.elapsed());
        }
        if b_ready {
            b_ready_at.get_or_insert_with(Instant::now);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("host 1 not ready {a_unready_after:?} after the cut; the clone ready since then");
    assert_eq!(b.subnet().as_deref(), Some(subnet.as_str()), "the clone took another subnet");
    let (_, body) = a.get("/readyz");
    assert!(body.contains("identity is not confirmed"), "{body}");

    // The heal: host 1 meets the clone and withdraws.
    run(&["ip", "-n", &h1, "route", "del", "blackhole", "192.0.2.254/32"]);
    a.wait_log("WITHDREW subnet", Duration::from_secs(30));
    let (status, body) = a.get("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("identity clash"), "{body}");
    assert!(!a.subnet_file().exists(), "host 1 still has a subnet.env");
    let addrs = run(&["ip", "-n", &h1, "-4", "addr", "show", "dev", "weft0"]);
    assert!(!addrs.contains("inet "), "weft0 on host 1 still has an address:\n{addrs}");
    let routes = run(&["ip", "-n", &h1, "route", "show", "10.244.0.0/16"]);
    assert!(routes.trim().is_empty(), "host 1 still routes the network: {routes}");
    assert!(b.ready(), "the clone is no longer ready");
}

// --- a departed peer's address, taken over ----------------------------------------------------

/// Host 2 dies; its key expires, and host 1 keeps its route, stale (an etcd outage must break
/// nothing). With etcd answering, that trust lasts `--stale-route-ttl` (3 s here): then a
/// listing confirms the key still gone and the route is dropped. A new machine on host 2's
/// address sending VXLAN as host 2 is no longer accepted: nothing reaches pod 1, and each
/// datagram counts as an unknown sender.
#[test]
fn a_departed_peers_address_is_no_longer_trusted_after_the_stale_route_ttl() {
    const K: usize = 20;
    let lab = Lab::new(VXLAN);
    let mut w1 = lab.start_weft(1, &["--stale-route-ttl", "3s"]);
    let mut w2 = lab.start_weft(2, &[]);
    let s1 = w1.wait_ready(READY);
    let s2 = w2.wait_ready(READY);
    let pod1 = lab.pod(1, &w1.subnet_file());
    w1.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    w2.kill();
    let dropped =
        w1.wait_metric("weft_routes_stale_dropped_total", Duration::from_secs(20), |v| v >= 1.0);
    assert_eq!(dropped, 1.0);
    assert_eq!(w1.metric("weft_routes"), Some(0.0), "{}", w1.log_tail(20));
    assert!(w1.log().contains("dropped the stale route"), "{}", w1.log_tail(20));

    let listener = in_netns(&pod1.ns, || UdpSocket::bind(("0.0.0.0", 9999)).expect("bind 9999"));
    listener.set_read_timeout(Some(Duration::from_millis(300))).expect("timeout");
    let mac1 =
        weft::dataplane::wire::ethernet::MacAddr::parse(&vtep_mac(&lab, &s1)).expect("a VtepMAC").0;
    let inner = ipv4_udp(dot2(&s2), pod1.ip, b"impostor");
    let frames: Vec<Vec<u8>> = (0..K).map(|_| vxlan(0x08, 1, mac1, &inner)).collect();
    let before = w1.rx_drops("unknown_sender");
    let to = SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 8472);
    send_all(&lab.host(2), Ipv4Addr::new(192, 0, 2, 2), to, &frames);
    let mut buf = [0u8; 2048];
    let got = listener.recv_from(&mut buf).ok().map(|(n, from)| (from, buf[..n].to_vec()));
    assert!(got.is_none(), "the impostor's datagram reached pod 1: {got:?}");
    let after = w1.rx_drops("unknown_sender");
    assert!(after - before >= K as f64, "unknown_sender drops {before} -> {after}");
}
