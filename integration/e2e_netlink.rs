//! weft's netlink edge end to end (src/dataplane/sys/netlink/): the underlay picked from the
//! default route with its MTU, and the TUN device's address replaced as the interface ioctls
//! replaced it, both asked of and told to the kernel over rtnetlink.
//!
//! Real etcd, real `weft run` processes in network namespaces made by `support::netns::Lab`
//! (192.0.2.0/24 underlay, 10.244.0.0/16 overlay); nothing in the root namespace is touched.
//! Needs root and the tools in `support::netns::REQUIRED_TOOLS`.

mod support;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use support::netns::{
    Families, Lab, assert_tun_configured, inet_addrs, ns_run, ping_all_pairs, run, weft0_link,
};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(20);
/// "Within a few seconds": weft repairs as the kernel reports the change (its periodic read is
/// turned off where this is used: `--netlink-resync 1h`).
const REPAIRED_WITHIN: Duration = Duration::from_secs(5);

/// weft0's IPv4 addresses (`a.b.c.d/len`) and MTU on host `host`.
fn weft0(host: &str) -> (Vec<String>, u64) {
    let link = weft0_link(host);
    (inet_addrs(&link), link[0]["mtu"].as_u64().expect("weft0 mtu"))
}

/// With neither `--iface` nor `--public-ip`, weft takes the interface of the default route of
/// lowest metric (eth0, via 192.0.2.254; a second default route through a veth interface has
/// a higher one), publishes its address and sizes weft0 by its MTU (1400 here, so 1350).
#[test]
fn the_underlay_is_the_default_routes_interface_with_its_mtu() {
    let lab = Lab::new(VXLAN);
    let h1 = lab.host(1);
    run(&["ip", "-n", &h1, "link", "set", "eth0", "mtu", "1400"]);
    // A second way out, inside the host's namespace: a veth pair with nothing behind it.
    run(&["ip", "-n", &h1, "link", "add", "wx0", "type", "veth", "peer", "name", "wx1"]);
    run(&["ip", "-n", &h1, "addr", "add", "192.0.2.201/32", "dev", "wx0"]);
    run(&["ip", "-n", &h1, "link", "set", "wx1", "up"]);
    run(&["ip", "-n", &h1, "link", "set", "wx0", "up"]);
    run(&["ip", "-n", &h1, "route", "add", "default", "dev", "wx0", "metric", "500"]);

    let mut w1 = lab.start_weft_by_default_route(1, &[]);
    let mut w2 = lab.start_weft(2, &[]);
    w1.wait_ready(READY);
    w2.wait_ready(READY);
    let subnet = w1.subnet().expect("host 1's subnet");
    let lease = lab.lease_value(&subnet).expect("host 1's lease");
    assert_eq!(lease["PublicIP"], "192.0.2.1", "published address: {lease}\n{}", w1.log_tail(30));
    assert_eq!(weft0(&h1).1, 1350, "weft0's MTU: eth0's 1400 less vxlan's 50");
    let env = std::fs::read_to_string(w1.subnet_file()).expect("subnet.env");
    assert!(env.contains("FLANNEL_MTU=1350\n"), "subnet.env:\n{env}");

    let pods = [lab.pod(1, &w1.subnet_file()), lab.pod(2, &w2.subnet_file())];
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    ping_all_pairs(&pods, Families::V4);
}

/// Someone gives weft0 another address and removes weft's: weft puts its own back as its
/// primary address and removes the stranger, as `SIOCSIFADDR` overwrote it, without losing the
/// Network route (the new address is added before the old one goes), and traffic flows.
#[test]
fn a_replaced_address_is_swapped_back_keeping_the_network_route() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &["--netlink-resync", "1h"]);
    let w1 = &wefts[0];
    let h1 = lab.host(1);
    let subnet = w1.subnet().expect("host 1's subnet");
    let ours = format!("{}/32", subnet.split('/').next().expect("subnet address"));
    assert_tun_configured(&lab, w1, 50);

    run(&["ip", "-n", &h1, "addr", "add", "10.244.250.9/32", "dev", "weft0"]);
    run(&["ip", "-n", &h1, "addr", "del", &ours, "dev", "weft0"]);
    let t0 = Instant::now();
    loop {
        let (addrs, _) = weft0(&h1);
        if addrs == [ours.clone()] {
            break;
        }
        assert!(
            t0.elapsed() < REPAIRED_WITHIN,
            "weft0 still has {addrs:?}, not [{ours}]\n{}",
            w1.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_tun_configured(&lab, w1, 50);
    let metric = "weft_dataplane_link_repairs_total{what=\"address\"}";
    w1.wait_metric(metric, REPAIRED_WITHIN, |v| v == 1.0);
    let routes = "weft_dataplane_link_repairs_total{what=\"route\"}";
    assert_eq!(w1.metric(routes), Some(0.0), "the Network route was never lost");
    let addr: Ipv4Addr = ours.trim_end_matches("/32").parse().expect("address");
    w1.wait_log(
        &format!("weft0 had lost its address {addr}/32 (it had 10.244.250.9/32): set {addr}/32"),
        REPAIRED_WITHIN,
    );
    ping_all_pairs(&pods, Families::V4);
}

/// `--tun-name 'weft%d'` is a kernel name template: with two queues the kernel made one device
/// per queue (`weft0`, `weft1`), weft configured the literal `weft%d`, failed, and said ready.
/// It is refused at start, naming the flag, before any device is made; so is a name the
/// kernel would refuse.
#[test]
fn a_tun_name_template_is_refused_at_start_and_makes_no_device() {
    let lab = Lab::new(VXLAN);
    for name in ["weft%d", "weft 0", "a-name-of-16-byte"] {
        let mut w = lab.start_weft(1, &["--tun-name", name, "--workers", "2"]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while w.running() {
            let (status, body) = w.get("/readyz");
            assert_ne!(status, 200, "ready with --tun-name {name:?}: {body}\n{}", w.log_tail(20));
            assert!(
                Instant::now() < deadline,
                "still running 5 s after a start with --tun-name {name:?}:\n{}",
                w.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = w.log();
        assert!(log.contains("--tun-name") && log.contains(name), "{name:?}: {log}");
        let links = ns_run(&w.ns, &["ip", "-o", "link", "show"]);
        assert!(!links.contains("weft") && !links.contains("a-name"), "{name:?}: {links}");
    }
}
