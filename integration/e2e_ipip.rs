//! flannel's ipip backend in user space, end to end in network namespaces: weft's TUN device,
//! IP-in-IP (protocol 4) on raw IP sockets.
//!
//! - Three weft hosts (one of them as uid 65534 with `CAP_NET_ADMIN` and `CAP_NET_RAW` only)
//!   ping every way and carry TCP; the packets on the underlay are decoded by tcpdump as the
//!   kernel's IP-in-IP, with the outer header flannel's `flannel.ipip` device writes (TTL and
//!   DF from the inner packet, TOS 0); datagrams from nobody, spoofed ones and garbage are
//!   dropped and counted; a host that leaves and comes back with a new address is reached
//!   there. Without `CAP_NET_RAW` weft refuses to start, naming it.
//! - `DirectRouting`: the hosts on one link route each other directly, the one on another link
//!   through IP-in-IP.
//! - With the `kernel-ipip` feature (a kernel with `CONFIG_NET_IPIP`; this project's test
//!   machine has none), a flannel ipip node set up as flanneld sets it up
//!   (`scripts/lib/flannel.sh`: `flannel_ipip_up`, `flannel_ipip_peer`) pings two wefts every
//!   way.
//!
//! Needs root and the tools listed in `support::netns::REQUIRED_TOOLS`.

mod support;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use support::netns::{Families, Lab, Pod, in_netns, ns_run, ns_spawn, ping_all_pairs, ping_ok};
use support::process::lib_run;

const IPIP: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"ipip"}}"#;
const DIRECT: &str =
    r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"ipip","DirectRouting":true}}"#;
const SOON: Duration = Duration::from_secs(5);

/// An IPv4/ICMP echo request `src` -> `dst` (TTL 64), checksummed: an inner packet to wrap.
fn echo(src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut p = vec![0u8; 28];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&28u16.to_be_bytes());
    p[8] = 64;
    p[9] = 1;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&p[..20]);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p[20] = 8;
    let sum = checksum(&p[20..]);
    p[22..24].copy_from_slice(&sum.to_be_bytes());
    p
}

fn checksum(b: &[u8]) -> u16 {
    let mut sum: u32 =
        b.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum > 0xffff {
        sum = (sum >> 16) + (sum & 0xffff);
    }
    !(sum as u16)
}

/// Sends `payload` in `ns` to `to` as protocol 4 on a raw socket: the kernel puts the outer
/// header (from the namespace's address) in front.
fn send_ipip(ns: &str, to: Ipv4Addr, payload: &[u8]) {
    let payload = payload.to_vec();
    in_netns(ns, move || {
        let s = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::RAW,
            Some(socket2::Protocol::from(4)),
        )
        .expect("raw socket");
        s.send_to(&payload, &SocketAddrV4::new(to, 0).into()).expect("send");
    });
}

/// The first pod address of `subnet` (`a.b.c.0/24` -> `a.b.c.2`).
fn in_subnet(subnet: &str, host: u8) -> Ipv4Addr {
    let net: ipnet::Ipv4Net = subnet.parse().expect("subnet");
    let o = net.network().octets();
    Ipv4Addr::new(o[0], o[1], o[2], host)
}

#[test]
fn ipip_wefts_ping_every_way_on_the_kernels_wire_format_and_follow_a_peer_that_moves() {
    let lab = Lab::new(IPIP);
    // Without CAP_NET_RAW there is no raw socket: weft says so and stops.
    let mut bare = lab.unstarted_weft_nonroot(3, &[]);
    bare.start();
    let deadline = Instant::now() + SOON * 2;
    while bare.running() {
        assert!(Instant::now() < deadline, "weft ran without CAP_NET_RAW:\n{}", bare.log_tail(30));
        std::thread::sleep(Duration::from_millis(50));
    }
    let said = "creating a raw IP socket for the ipip backend: Operation not permitted (os error 1) (raw IP sockets need CAP_NET_RAW";
    assert!(bare.log().contains(said), "{}", bare.log_tail(30));
    drop(bare);

    let mut wefts = vec![lab.start_weft(1, &[]), lab.start_weft(2, &["--workers", "1"])];
    let mut third = lab.unstarted_weft_nonroot(3, &[]);
    third.nonroot_caps = "+net_admin,+net_raw".to_owned();
    third.public_ip_flag = false;
    third.start();
    wefts.push(third);
    for w in &mut wefts {
        w.wait_ready(support::netns::READY_WITHIN);
    }
    let subnets: Vec<String> = wefts.iter().map(|w| w.subnet().expect("a subnet")).collect();
    let pods: Vec<Pod> = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    for w in &wefts {
        w.wait_metric("weft_routes", SOON, |v| v >= 2.0);
        // flannel's ipip lease: its type and no data; weft0's MTU and subnet.env's are the
        // underlay's less the outer header (flannel.ipip's).
        let lease = lab.lease_value(&subnets[usize::from(w.n) - 1]).expect("weft's lease");
        assert_eq!(lease["BackendType"], "ipip", "{lease}");
        assert!(lease.get("BackendData").is_none(), "{lease}");
        support::netns::assert_tun_configured(&lab, w, 20);
    }
    // Every way, each echo answered once: with two workers on host 1, each packet is read by
    // one raw socket only (a duplicate would show as "DUP!").
    for a in &pods {
        for b in &pods {
            if a.ns != b.ns {
                let r = ping_ok(&a.ns, b.ip, 3);
                assert!(!r.text.contains("DUP!"), "{} -> {}:\n{}", a.ns, b.ip, r.text);
            }
        }
    }

    // The wire, as tcpdump decodes it: IP-in-IP, the outer TTL and DF the inner packet's, TOS 0.
    let h2 = wefts[1].ns.clone();
    let pcap = lab.dir().join("ipip.pcap");
    let pcap_s = pcap.to_string_lossy().into_owned();
    let mut dump = ns_spawn(
        &h2,
        &["tcpdump", "-i", "eth0", "-n", "-U", "-c", "4", "-w", &pcap_s, "ip proto 4"],
    );
    std::thread::sleep(Duration::from_millis(500));
    ping_ok(&pods[0].ns, pods[1].ip, 2);
    let deadline = Instant::now() + SOON;
    while dump.try_wait().expect("tcpdump").is_none() {
        assert!(Instant::now() < deadline, "tcpdump saw fewer than 4 IP-in-IP packets");
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = ns_run(&h2, &["tcpdump", "-r", &pcap_s, "-n", "-t", "-v"]);
    let headers: Vec<&str> =
        text.lines().filter(|l| l.starts_with("IP") || l.contains(": IP")).collect();
    assert_eq!(headers.len(), 8, "4 packets, outer and inner header each:\n{text}");
    let mut dont_frag = 0;
    for pair in headers.chunks(2) {
        let (outer, inner) = (pair[0], pair[1]);
        assert!(outer.contains("proto IPIP (4)"), "{outer}");
        assert!(outer.starts_with("IP (tos 0x0,"), "{outer}");
        assert!(inner.contains("proto ICMP (1)"), "{inner}");
        let field = |l: &str, f: &str| {
            l.split(", ").find(|p| p.trim_start_matches("IP (").starts_with(f)).map(str::to_owned)
        };
        assert_eq!(field(outer, "ttl"), field(inner, "ttl"), "TTL inherited:\n{outer}\n{inner}");
        assert_eq!(field(outer, "flags"), field(inner, "flags"), "DF copied:\n{outer}\n{inner}");
        dont_frag += usize::from(inner.contains("flags [DF]"));
    }
    assert_eq!(dont_frag, 2, "ping's requests have DF, the kernel's replies not:\n{text}");
    assert!(
        text.contains("192.0.2.1 > 192.0.2.2: IP") && text.contains("192.0.2.2 > 192.0.2.1: IP"),
        "{text}"
    );

    // TCP through the tunnel (TSO super-packets split before encapsulation).
    let _server = support::netns::Iperf3Server::start(&pods[1].ns);
    let bps = support::netns::iperf3_bps(&pods[0].ns, pods[1].ip, 2);
    assert!(bps > 1e6, "iperf3 over ipip: {bps} b/s");

    // From nobody (the hub), spoofed by a peer (host 2, an inner source outside its subnet),
    // garbage from a peer: dropped by reason; forwarding goes on.
    let to_pod1 = pods[0].ip;
    send_ipip(&lab.hub(), Ipv4Addr::new(192, 0, 2, 1), &echo(in_subnet(&subnets[1], 9), to_pod1));
    wefts[0].wait_metric(
        r#"weft_dataplane_drops_total{dir="rx",reason="unknown_sender"}"#,
        SOON,
        |v| v >= 1.0,
    );
    send_ipip(&h2, Ipv4Addr::new(192, 0, 2, 1), &echo(in_subnet(&subnets[2], 9), to_pod1));
    wefts[0].wait_metric(
        r#"weft_dataplane_drops_total{dir="rx",reason="spoofed_source"}"#,
        SOON,
        |v| v >= 1.0,
    );
    send_ipip(&h2, Ipv4Addr::new(192, 0, 2, 1), &[0x45, 0, 0, 99, 1, 2, 3]);
    wefts[0].wait_metric(r#"weft_dataplane_drops_total{dir="rx",reason="malformed"}"#, SOON, |v| {
        v >= 1.0
    });
    ping_ok(&pods[1].ns, pods[0].ip, 2);

    // Host 3 leaves and comes back on a new address: its lease follows, and so do the peers.
    wefts[2].stop();
    let h3 = wefts[2].ns.clone();
    lib_run("netns.sh", "netns_readdress", &[h3.as_str(), "eth0", "192.0.2.3/24", "192.0.2.33/24"]);
    wefts[2].start();
    wefts[2].wait_ready(support::netns::READY_WITHIN);
    let deadline = Instant::now() + SOON;
    while lab.lease_value(&subnets[2]).map(|l| l["PublicIP"].clone()) != Some("192.0.2.33".into()) {
        assert!(Instant::now() < deadline, "host 3's lease: {:?}", lab.lease_value(&subnets[2]));
        std::thread::sleep(Duration::from_millis(50));
    }
    ping_all_pairs(&pods, Families::V4);
}

#[test]
fn ipip_direct_routing_routes_the_peers_on_the_link_and_tunnels_to_the_other() {
    let lab = Lab::new(DIRECT);
    let hub = lab.hub();
    // Two links on the lab's underlay: 192.0.2.0/25 (hosts 1 and 2) and 192.0.2.128/25 (host
    // 130), the hub routing between them.
    lib_run("flannel.sh", "flannel_forwarding", &[hub.as_str()]);
    ns_run(&hub, &["ip", "addr", "add", "192.0.2.126/25", "dev", "br0"]);
    for n in [1, 2] {
        let ns = lab.host(n);
        let (old, new) = (format!("192.0.2.{n}/24"), format!("192.0.2.{n}/25"));
        lib_run("netns.sh", "netns_readdress", &[ns.as_str(), "eth0", &old, &new, "192.0.2.126"]);
    }
    let far = lab.host(130);
    lib_run(
        "netns.sh",
        "netns_readdress",
        &[far.as_str(), "eth0", "192.0.2.130/24", "192.0.2.130/25", "192.0.2.254"],
    );
    for ns in [lab.host(1), lab.host(2), far.clone()] {
        lib_run("flannel.sh", "flannel_forwarding", &[ns.as_str()]);
    }
    // --ip-masq: the bridge masquerades nothing, so pods' packets cross with their addresses.
    let (wefts, pods) = lab.up(&[1, 2, 130], &["--ip-masq"]);
    let subnets: Vec<String> = wefts.iter().map(|w| w.subnet().expect("a subnet")).collect();
    let (h1, h2) = (wefts[0].ns.clone(), wefts[1].ns.clone());
    let direct = |ns: &str, subnet: &str, via: &str| {
        let want = format!("{subnet} via {via} dev eth0 proto 119");
        let deadline = Instant::now() + SOON;
        loop {
            let r = ns_run(ns, &["ip", "route", "show", subnet]).trim().to_owned();
            if r == want {
                return;
            }
            assert!(Instant::now() < deadline, "{ns}: the route to {subnet} is {r:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    direct(&h1, &subnets[1], "192.0.2.2");
    direct(&h2, &subnets[0], "192.0.2.1");
    assert_eq!(
        ns_run(&h1, &["ip", "route", "show", &subnets[2]]).trim(),
        "",
        "no direct route off the link"
    );
    let get = ns_run(&h1, &["ip", "route", "get", &pods[2].ip.to_string()]);
    assert!(get.contains("dev weft0"), "{get}");
    let tx = |w: &support::netns::Weft| w.metric("weft_dataplane_tx_packets_total").unwrap_or(0.0);
    let before = tx(&wefts[0]);
    ping_ok(&pods[0].ns, pods[1].ip, 5);
    assert_eq!(tx(&wefts[0]), before, "the direct route carried host 2's pings, not weft");
    ping_all_pairs(&pods, Families::V4);
    assert!(tx(&wefts[0]) > before, "the far host's pings went through weft's IP-in-IP");
}

/// A flannel ipip node with the kernel's `flannel.ipip` device, as flanneld programs it, in
/// one cluster with two wefts. Needs a kernel with `CONFIG_NET_IPIP` (`modprobe ipip`): run
/// with `--features netns,kernel-ipip`. Without the module `flannel_ipip_up` fails ("Unknown
/// device type"), so the test fails: it is never skipped.
#[cfg(feature = "kernel-ipip")]
#[test]
fn a_kernel_flannel_ipip_peer_and_two_wefts_ping_every_way() {
    let lab = Lab::new(IPIP);
    let flannel = support::kernel_flannel::RoutedPeer::ipip(&lab, 3, "10.244.200.0/24");
    let (wefts, mut pods) = lab.up(&[1, 2], &[]);
    for w in &wefts {
        w.wait_metric("weft_routes", SOON, |v| v >= 2.0);
        flannel.route(&w.subnet().expect("a subnet"), Ipv4Addr::new(192, 0, 2, w.n));
    }
    pods.push(flannel.pod(&lab));
    ping_all_pairs(&pods, Families::V4);
    let _server = support::netns::Iperf3Server::start(&pods[2].ns);
    let bps = support::netns::iperf3_bps(&pods[0].ns, pods[2].ip, 2);
    assert!(bps > 1e6, "iperf3 weft -> kernel ipip: {bps} b/s");
}
