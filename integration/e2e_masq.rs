//! Masquerading (`--ip-masq`) end to end, in network namespaces, on a dual-stack vxlan
//! network: host 1 runs weft with `--ip-masq`, host 2 without; each has a pod whose bridge does
//! not masquerade, and an "outside" node on the underlay (192.0.2.200, 2001:db8::c8) that has
//! no route to the overlay runs a TCP listener that reports each connection's peer address.
//!
//! - Host 1's pod reaches the outside node, over IPv4 and IPv6, arriving with host 1's
//!   underlay address; host 2's pod does not reach it at all (its packets arrive with the
//!   pod's address, to which nothing routes back).
//! - Pod to pod, both ways, arrives with the pod's own address: never masqueraded.
//! - `nft list ruleset`: host 1 has weft's two tables and nothing else; host 2 has none.
//! - The table deleted by hand, or a chain flushed, comes back within the resync, counted.
//! - An in-place upgrade (SIGHUP) keeps the table as it is (the same handle); a clean stop
//!   removes it.
//! - A kernel without nf_tables (simulated with the `fault-injection` feature): one ERROR,
//!   counted failures, `/readyz` 503 naming it, and the pods still reach each other.
//!
//! Needs root, the tools listed in `support::netns::REQUIRED_TOOLS` and `nft` (Debian's
//! nftables, which scripts/setup.sh installs).

mod support;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use support::netns::{Lab, Pod, READY_WITHIN, Weft, in_netns, ns_output, ns_run, ping_ok};

const DUAL_VXLAN: &str = r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;
const OUTSIDE: u8 = 200;
const SOON: Duration = Duration::from_secs(5);

/// The peer address a TCP listener on `at` (in `listen_ns`) sees when `client_ns` connects to
/// it; `None` when the connection is not made within 3 s.
fn peer_seen(listen_ns: &str, at: SocketAddr, client_ns: &str) -> Option<IpAddr> {
    let listener = in_netns(listen_ns, || TcpListener::bind(at)).expect("bind the listener");
    listener.set_nonblocking(true).expect("nonblocking listener");
    let accept = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(4);
        while Instant::now() < deadline {
            match listener.accept() {
                Ok((_, peer)) => return Some(peer.ip()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        None
    });
    let connected =
        in_netns(client_ns, || TcpStream::connect_timeout(&at, Duration::from_secs(3)).is_ok());
    let peer = accept.join().expect("the accept thread");
    if connected { peer } else { None }
}

/// `nft list tables` in `ns`, one table a line (`table ip weft`).
fn tables(ns: &str) -> Vec<String> {
    let out = ns_output(ns, &["nft", "list", "tables"]);
    assert!(out.status.success(), "nft list tables: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
}

/// The handle of weft's IPv4 table (`nft -a list table ip weft`'s `# handle N`).
fn table_handle(ns: &str) -> Option<String> {
    let out = ns_output(ns, &["nft", "-a", "list", "table", "ip", "weft"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let first = text.lines().next()?;
    first.split("# handle ").nth(1).map(|h| h.trim().to_owned())
}

fn wait_until(what: &str, w: &Weft, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + SOON;
    while !pred() {
        assert!(Instant::now() < deadline, "{what}\n{}", w.log_tail(40));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The lab: hosts 1 (`extra1`) and 2 (`extra2`), ready, each with an unmasqueraded pod, and the
/// outside node.
fn up(lab: &Lab, extra1: &[&str], extra2: &[&str]) -> (Weft, Weft, Pod, Pod, String) {
    let mut w1 = lab.start_weft(1, extra1);
    let mut w2 = lab.start_weft(2, extra2);
    w1.wait_ready(READY_WITHIN);
    w2.wait_ready(READY_WITHIN);
    let p1 = lab.pod_unmasqueraded(1, &w1.subnet_file());
    let p2 = lab.pod_unmasqueraded(2, &w2.subnet_file());
    w1.wait_metric("weft_routes", SOON, |v| v >= 1.0);
    w2.wait_metric("weft_routes", SOON, |v| v >= 1.0);
    let outside = lab.outside(OUTSIDE);
    (w1, w2, p1, p2, outside)
}

#[test]
fn ip_masq_masquerades_traffic_leaving_the_network_and_nothing_else() {
    let lab = Lab::new(DUAL_VXLAN);
    let (mut w1, w2, p1, p2, outside) = up(&lab, &["--ip-masq", "--iptables-resync", "1"], &[]);
    let h1 = lab.host(1);
    let h2 = lab.host(2);
    let out4: SocketAddr = "192.0.2.200:8080".parse().unwrap();
    let out6: SocketAddr = "[2001:db8::c8]:8080".parse().unwrap();

    // Leaving the network: host 1's pod arrives with host 1's address; host 2's not at all.
    assert_eq!(peer_seen(&outside, out4, &p1.ns), Some("192.0.2.1".parse().unwrap()));
    assert_eq!(peer_seen(&outside, out6, &p1.ns), Some("2001:db8::1".parse().unwrap()));
    assert_eq!(peer_seen(&outside, out4, &p2.ns), None, "host 2 runs without --ip-masq");

    // Pod to pod, both ways: the pods' own addresses.
    let at = |ip: IpAddr| SocketAddr::new(ip, 8081);
    assert_eq!(peer_seen(&p2.ns, at(p2.ip.into()), &p1.ns), Some(p1.ip.into()));
    assert_eq!(peer_seen(&p1.ns, at(p1.ip.into()), &p2.ns), Some(p2.ip.into()));
    let (p1v6, p2v6) = (p1.ip6.expect("pod 1 IPv6"), p2.ip6.expect("pod 2 IPv6"));
    assert_eq!(peer_seen(&p2.ns, at(p2v6.into()), &p1.ns), Some(p1v6.into()));

    // Only weft's tables on host 1; none on host 2.
    assert_eq!(tables(&h1), ["table ip weft", "table ip6 weft"]);
    assert_eq!(tables(&h2), Vec::<String>::new());
    let ruleset = ns_run(&h1, &["nft", "list", "ruleset"]);
    let subnet = w1.subnet().expect("host 1's subnet");
    for rule in [
        format!("ip saddr {subnet} ip daddr 10.244.0.0/16 return"),
        "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random".to_owned(),
        "ip6 saddr fd00:10:244::/56 ip6 daddr != ff00::/8 masquerade fully-random".to_owned(),
        "ip saddr 10.244.0.0/16 accept".to_owned(),
    ] {
        assert!(ruleset.contains(&rule), "{rule:?} not in:\n{ruleset}");
    }
    assert_eq!(w1.metric("weft_masq_installed"), Some(1.0));
    assert_eq!(w1.metric("weft_masq_rules"), Some(16.0));
    assert_eq!(w2.metric("weft_masq_installed"), None, "no masquerading without --ip-masq");

    // Drift: the table deleted, then a chain flushed; each back within the resync.
    ns_run(&h1, &["nft", "delete", "table", "ip", "weft"]);
    wait_until("the table did not come back", &w1, || tables(&h1).len() == 2);
    w1.wait_metric("weft_masq_repairs_total", SOON, |v| v >= 1.0);
    ns_run(&h1, &["nft", "flush", "chain", "ip6", "weft", "postrouting"]);
    w1.wait_metric("weft_masq_repairs_total", SOON, |v| v >= 2.0);
    assert_eq!(peer_seen(&outside, out6, &p1.ns), Some("2001:db8::1".parse().unwrap()));
    assert!(w1.log().contains("put them back"), "{}", w1.log_tail(20));

    // An in-place upgrade keeps the table as it is.
    let handle = table_handle(&h1).expect("the table's handle");
    let handed_back = |w: &Weft| w.log().matches("handed over: the next weft").count();
    let before = handed_back(&w1);
    w1.signal(nix::sys::signal::Signal::SIGHUP);
    wait_until("no in-place upgrade", &w1, || handed_back(&w1) > before);
    w1.wait_ready(READY_WITHIN);
    w1.wait_log("already in place", SOON);
    assert_eq!(table_handle(&h1), Some(handle), "the table was rewritten across the upgrade");
    assert!(!w1.log().contains("removed weft's masquerade tables"), "{}", w1.log_tail(40));
    assert_eq!(peer_seen(&outside, out4, &p1.ns), Some("192.0.2.1".parse().unwrap()));

    // A clean stop removes it.
    assert_eq!(w1.stop(), Some(0));
    assert_eq!(tables(&h1), Vec::<String>::new());
}

/// A kernel without nf_tables (the fault hook makes the netlink socket fail as such a kernel
/// does): one ERROR, failures counted, `/readyz` names it, forwarding goes on.
#[cfg(feature = "fault-injection")]
#[test]
fn without_nf_tables_weft_forwards_and_says_so_once() {
    let lab = Lab::new(DUAL_VXLAN);
    let mut w1 = lab.start_weft_with_env(
        1,
        &["--ip-masq", "--iptables-resync", "1"],
        &[("WEFT_FAULT_NO_NFTABLES", "1")],
    );
    let mut w2 = lab.start_weft(2, &[]);
    w2.wait_ready(READY_WITHIN);
    // Not ready: the rules asked for are not in place.
    wait_until("w1 has no subnet", &w1, || w1.subnet().is_some());
    w1.wait_metric("weft_masq_failures_total", SOON, |v| v >= 3.0);
    let (status, body) = w1.get("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("masquerading (--ip-masq) is not in place"), "{body}");
    assert!(body.contains("the kernel has no nf_tables"), "{body}");
    let errors = w1.log().matches("masquerading (--ip-masq) is not in place").count();
    assert_eq!(errors, 1, "said once:\n{}", w1.log_tail(30));
    // Forwarding goes on.
    let p1 = lab.pod_unmasqueraded(1, &w1.subnet_file());
    let p2 = lab.pod_unmasqueraded(2, &w2.subnet_file());
    w1.wait_metric("weft_routes", SOON, |v| v >= 1.0);
    w2.wait_metric("weft_routes", SOON, |v| v >= 1.0);
    ping_ok(&p1.ns, p2.ip, 3);
    assert_eq!(tables(&lab.host(1)), Vec::<String>::new());
    assert_eq!(w1.stop(), Some(0));
}

/// With `CAP_NET_ADMIN` alone (uid 65534, no root), beside a table of another weft's (another
/// node ID in its comment: a second weft on this host): that table is left alone, said once,
/// `/readyz` names it; once it is gone, this weft installs its own.
#[test]
fn cap_net_admin_is_enough_and_another_weft_s_table_is_left_alone() {
    let lab = Lab::new(DUAL_VXLAN);
    let h1 = lab.host(1);
    ns_run(&h1, &["nft", "add", "table", "ip", "weft", "{ comment \"weft node someone-else\"; }"]);
    let mut w1 = lab.start_weft_nonroot(1, &["--ip-masq", "--iptables-resync", "1"]);
    wait_until("w1 has no subnet", &w1, || w1.subnet().is_some());
    w1.wait_metric("weft_masq_failures_total", SOON, |v| v >= 3.0);
    let (status, body) = w1.get("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("another weft's masquerade table is in place"), "{body}");
    assert_eq!(w1.log().matches("another weft's masquerade table").count(), 1, "said once");
    let theirs = ns_run(&h1, &["nft", "list", "table", "ip", "weft"]);
    assert!(theirs.contains("someone-else") && !theirs.contains("chain"), "{theirs}");
    assert_eq!(tables(&h1), ["table ip weft"], "not even this host's ip6 table");

    ns_run(&h1, &["nft", "delete", "table", "ip", "weft"]);
    w1.wait_metric("weft_masq_installed", SOON, |v| v == 1.0);
    w1.wait_ready(READY_WITHIN);
    assert_eq!(tables(&h1), ["table ip weft", "table ip6 weft"]);
    assert!(w1.log().contains("after_failing=true"), "{}", w1.log_tail(20));
    assert_eq!(w1.stop(), Some(0));
    assert_eq!(tables(&h1), Vec::<String>::new());
}

/// A subnet change (the lease taken by another node: weft moves to another subnet) rewrites the
/// rules for the new subnet in one transaction: sampled all along, the table is always there
/// with its six masquerade rules, first for the old subnet, then for the new one.
#[test]
fn a_subnet_change_rewrites_the_rules_without_a_gap() {
    let lab = Lab::new(DUAL_VXLAN);
    let h1 = lab.host(1);
    let mut w1 = lab.start_weft(1, &["--ip-masq", "--iptables-resync", "1"]);
    let old = w1.wait_ready(READY_WITHIN);
    w1.wait_metric("weft_masq_installed", SOON, |v| v == 1.0);
    let (key, _) = lab.lease_entry(&old).expect("host 1's lease");
    // Sample the table every few milliseconds while another node takes the lease.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, h1) = (stop.clone(), h1.clone());
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = ns_output(&h1, &["nft", "list", "chain", "ip", "weft", "postrouting"]);
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                let rules = text
                    .lines()
                    .filter(|l| l.contains("return") || l.contains("masquerade"))
                    .count();
                seen.push((out.status.success(), rules, text));
            }
            seen
        })
    };
    let theirs = r#"{"PublicIP":"192.0.2.9","PublicIPv6":"2001:db8::9","BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"},"BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"}}"#;
    lab.etcdctl(&["put", &key, theirs]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let new = loop {
        if let Some(s) = w1.subnet().filter(|s| *s != old) {
            break s;
        }
        assert!(Instant::now() < deadline, "no new subnet:\n{}", w1.log_tail(40));
        std::thread::sleep(Duration::from_millis(50));
    };
    let want = format!("ip saddr {new} ip daddr 10.244.0.0/16 return");
    wait_until("the rules do not name the new subnet", &w1, || {
        let out = ns_output(&h1, &["nft", "list", "table", "ip", "weft"]);
        String::from_utf8_lossy(&out.stdout).contains(&want)
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = sampler.join().expect("sampler");
    assert!(seen.len() > 10, "too few samples: {}", seen.len());
    for (ok, rules, text) in &seen {
        assert!(*ok && *rules == 6, "a moment without the rules:\n{text}");
    }
    let named = |s: &str| seen.iter().any(|(_, _, t)| t.contains(&format!("ip saddr {s} ")));
    assert!(named(&old) && named(&new), "both subnets' rules were sampled");
    let ruleset = ns_run(&h1, &["nft", "list", "ruleset"]);
    assert!(!ruleset.contains(&old), "the old subnet is gone:\n{ruleset}");
    let new6 = w1.subnet6().expect("the new IPv6 subnet");
    assert!(ruleset.contains(&format!("ip6 saddr {new6} ")), "{ruleset}");
    assert_eq!(w1.stop(), Some(0));
}
