//! End to end in network namespaces: the underlay address changes while weft runs (the
//! interface is renumbered). weft notices (told by the kernel over netlink), re-binds its sockets on the new address, rewrites
//! its lease's `PublicIP` (keeping the subnet), peers follow, and every datagram leaves from
//! the published address. Needs root, like e2e.rs.

mod support;

use std::time::{Duration, Instant};

use support::netns::{Lab, finish_ping, ns_run, ns_spawn_nobody, ping_ok, run, spawn_ping};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(20);

/// The local addresses of every UDP socket in `ns` (`ss -uan`).
fn udp_local_addrs(ns: &str) -> Vec<String> {
    ns_run(ns, &["ss", "-H", "-u", "-a", "-n"])
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .collect()
}

#[test]
fn a_renumbered_underlay_is_followed_rebound_and_published_keeping_the_subnet() {
    let lab = Lab::new(VXLAN);
    // Its periodic listing of the addresses put off (an hour apart): the renumbering must be
    // noticed from the kernel's notifications.
    let mut w1 = lab.start_weft_following_eth0(1, &["--netlink-resync", "1h"]);
    let mut w2 = lab.start_weft(2, &[]);
    let subnet = w1.wait_ready(READY);
    w2.wait_ready(READY);
    let (p1, p2) = (lab.pod(1, &w1.subnet_file()), lab.pod(2, &w2.subnet_file()));
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    let published = |lab: &Lab| {
        lab.lease_value(&subnet).and_then(|v| v["PublicIP"].as_str().map(str::to_owned))
    };
    assert_eq!(published(&lab).as_deref(), Some("192.0.2.1"));
    ping_ok(&p2.ns, p1.ip, 2);

    // Renumber host 1's underlay while host 2's pod pings host 1's.
    let ping = spawn_ping(&p2.ns, p1.ip, 100, 0.1);
    std::thread::sleep(Duration::from_millis(500));
    let h1 = lab.host(1);
    run(&["ip", "-n", &h1, "addr", "del", "192.0.2.1/24", "dev", "eth0"]);
    run(&["ip", "-n", &h1, "addr", "add", "192.0.2.11/24", "dev", "eth0"]);
    let renumbered = Instant::now();
    while published(&lab).as_deref() != Some("192.0.2.11") {
        assert!(
            renumbered.elapsed() < Duration::from_secs(10),
            "the new address was not published in 10 s:\n{}",
            w1.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("published 192.0.2.11 {:?} after the renumbering", renumbered.elapsed());
    let r = finish_ping(ping);
    eprintln!("ping across the renumbering: {}/{} replies", r.received, r.transmitted);

    // The subnet is kept; both directions work again; the sockets moved.
    assert_eq!(w1.subnet().as_deref(), Some(subnet.as_str()), "the subnet changed");
    ping_ok(&p2.ns, p1.ip, 3);
    ping_ok(&p1.ns, p2.ip, 3);
    let addrs = udp_local_addrs(&h1);
    assert!(!addrs.is_empty(), "no UDP sockets in host 1");
    assert!(
        addrs.iter().all(|a| a.starts_with("192.0.2.11:")),
        "a socket is not bound on the published address: {addrs:?}"
    );
    assert!(w1.ready(), "{:?}", w1.get("/readyz"));
    let log = w1.log();
    assert_eq!(log.matches("the underlay address changed").count(), 1, "{}", w1.log_tail(30));
    assert!(log.contains("data plane sockets re-bound"), "{}", w1.log_tail(30));
    assert!(
        r.received + 40 >= r.transmitted,
        "more than 4 s of pings lost across the renumbering:\n{}",
        r.text
    );
}

/// Binds a UDP port on an address the host does not have yet (`IP_FREEBIND`, which needs no
/// privilege), says so, and holds it until killed. argv: address, port.
const SQUATTER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND
s.bind((sys.argv[1], int(sys.argv[2])))
print("bound", flush=True)
time.sleep(600)
"#;

/// An unprivileged local user binds the VXLAN port on the address the underlay is about to be
/// renumbered to. weft cannot re-bind there: it says so at every try (a WARN and
/// `weft_underlay_rebind_failures_total`), `/readyz` is 503 naming the address, and the lease
/// never publishes an address weft cannot receive on. Once the squatter goes, the next try
/// re-binds, publishes the new address and weft is ready again, the subnet kept.
#[test]
fn a_squatter_on_the_new_address_keeps_weft_unready_and_loud_until_it_goes() {
    let lab = Lab::new(VXLAN);
    let mut w1 = lab.start_weft_following_eth0(1, &["--netlink-resync", "1s"]);
    let mut w2 = lab.start_weft(2, &[]);
    let subnet = w1.wait_ready(READY);
    w2.wait_ready(READY);
    let (p1, p2) = (lab.pod(1, &w1.subnet_file()), lab.pod(2, &w2.subnet_file()));
    w2.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    let published = |lab: &Lab| {
        lab.lease_value(&subnet).and_then(|v| v["PublicIP"].as_str().map(str::to_owned))
    };
    let h1 = lab.host(1);
    let mut squatter = ns_spawn_nobody(&h1, &["python3", "-c", SQUATTER, "192.0.2.11", "8472"]);
    let mut line = String::new();
    let mut out = std::io::BufReader::new(squatter.stdout.take().expect("squatter's stdout"));
    std::io::BufRead::read_line(&mut out, &mut line).expect("squatter's word");
    assert_eq!(line.trim(), "bound", "the squatter could not bind");

    run(&["ip", "-n", &h1, "addr", "del", "192.0.2.1/24", "dev", "eth0"]);
    run(&["ip", "-n", &h1, "addr", "add", "192.0.2.11/24", "dev", "eth0"]);
    let failures = |w: &support::netns::Weft| w.metric("weft_underlay_rebind_failures_total");
    w1.wait_metric("weft_underlay_rebind_failures_total", Duration::from_secs(10), |v| v >= 3.0);
    let (status, body) = w1.get("/readyz");
    assert_eq!(status, 503, "ready while deaf: {body}");
    assert!(body.contains("not bound on 192.0.2.11"), "{body}");
    let warns = w1.log().matches("could not re-bind the data plane").count();
    assert!(warns >= 3, "{warns} WARN lines for {:?} failures", failures(&w1));
    assert_eq!(published(&lab).as_deref(), Some("192.0.2.1"), "published an address it is deaf on");

    let _ = squatter.kill();
    let _ = squatter.wait();
    let gone = Instant::now();
    while published(&lab).as_deref() != Some("192.0.2.11") {
        assert!(gone.elapsed() < Duration::from_secs(10), "{}", w1.log_tail(30));
        std::thread::sleep(Duration::from_millis(100));
    }
    let ready_by = Instant::now() + Duration::from_secs(15);
    while !w1.ready() {
        assert!(Instant::now() < ready_by, "not ready again: {:?}", w1.get("/readyz"));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(w1.subnet().as_deref(), Some(subnet.as_str()), "the subnet changed");
    ping_ok(&p2.ns, p1.ip, 3);
    ping_ok(&p1.ns, p2.ip, 3);
}
