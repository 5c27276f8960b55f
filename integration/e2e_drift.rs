//! Drift repair end to end (README, "Reliability"; docs/dataplane.md, "The TUN device"): an
//! admin changes `weft0` under a running weft — deletes the Network route, sets the link down,
//! flushes its address, changes its MTU — and weft puts it back within a few seconds, told of
//! the change by the kernel (its periodic read is turned off here): traffic
//! between pods on two hosts resumes, `weft_dataplane_link_repairs_total{what=...}` counts each
//! repair, and the log names each repair exactly once.
//!
//! Real etcd, real `weft run` processes in network namespaces made by `support::netns::Lab`
//! (192.0.2.0/24 underlay, 10.244.0.0/16 overlay); nothing in the root namespace is touched.
//! Needs root and the tools in `support::netns::REQUIRED_TOOLS`.

mod support;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use support::netns::{
    IPV6_NETWORK, Lab, assert_tun_configured, first_reply, ns_output, ping_ok, run,
};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
/// weft0's MTU on a 1500-byte underlay with vxlan (50 bytes of encapsulation).
const TUN_MTU: u32 = 1450;
/// "Within a few seconds". weft repairs as the kernel reports the change (a netlink watch);
/// its periodic read is put off here ([`NO_RESYNC`]), so only the watch can meet this.
const REPAIRED_WITHIN: Duration = Duration::from_secs(5);
/// Turns off weft's periodic read of weft0's state (an hour apart): drift must be noticed by
/// the kernel's notifications.
const NO_RESYNC: [&str; 2] = ["--netlink-resync", "1h"];
/// How long to watch after a repair for a second (wrong) log line or count: several checks.
const SETTLE: Duration = Duration::from_secs(3);
const KINDS: [&str; 4] = ["route", "up", "address", "mtu"];

/// Two full-MTU echoes (1450 bytes) with DF set, from `ns` to `dst`; panics unless both come
/// back. Sent only when weft0's MTU should be weft's: a pod told "fragmentation needed" by a
/// smaller MTU caches that path MTU for ten minutes (and this `ping` has no `-M probe`).
fn full_mtu_ping_ok(ns: &str, dst: Ipv4Addr, when: &str) {
    let size = (TUN_MTU - 28).to_string();
    let d = dst.to_string();
    let args = ["ping", "-n", "-c", "2", "-i", "0.2", "-W", "1", "-M", "do", "-s", &size, &d];
    let out = ns_output(ns, &args);
    assert!(
        out.status.success(),
        "full-MTU ping ({size}-byte payload, DF) {when} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn repairs_metric(what: &str) -> String {
    format!("weft_dataplane_link_repairs_total{{what=\"{what}\"}}")
}

/// The repairs a drift must cause, given weft0's address on host 1 (its subnet's `.0`): each
/// a `what` label and the log line.
type Repairs<'a> = &'a dyn Fn(Ipv4Addr) -> Vec<(&'static str, String)>;

/// Host 1's weft0 drifts by `ip -n <host 1> <drift>`; weft must put it back: pod 1 reaches
/// pod 2 again within a few seconds, each of `repairs` is counted once and logged once and
/// nothing else is, and full-MTU packets cross again.
fn drift_is_repaired(drift: &[&str], repairs: Repairs<'_>) {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &NO_RESYNC);
    let w1 = &wefts[0];
    let subnet = w1.subnet().expect("host 1's subnet");
    let addr: Ipv4Addr = subnet.split('/').next().and_then(|a| a.parse().ok()).expect("subnet");
    let repairs = repairs(addr);
    assert_tun_configured(&lab, w1, 50);
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    full_mtu_ping_ok(&pods[0].ns, pods[1].ip, "before the drift");
    for what in KINDS {
        assert_eq!(w1.metric(&repairs_metric(what)), Some(0.0), "{what} repairs before the drift");
    }

    let host1 = lab.host(1);
    let mut cmd = vec!["ip", "-n", host1.as_str()];
    cmd.extend_from_slice(drift);
    let drifted = Instant::now();
    run(&cmd);

    let resumed = first_reply(&pods[0].ns, pods[1].ip, Duration::from_secs(10));
    let since_drift = drifted.elapsed();
    eprintln!("`{}`: pod 1 reached pod 2 again {since_drift:?} after it", drift.join(" "));
    assert!(
        resumed.is_some() && since_drift < REPAIRED_WITHIN,
        "after `{}`, pod 1 did not reach pod 2 again within {REPAIRED_WITHIN:?} ({since_drift:?} \
         of pinging)\n--- host 1 log ---\n{}",
        drift.join(" "),
        w1.log_tail(30)
    );
    for (what, line) in &repairs {
        w1.wait_metric(&repairs_metric(what), REPAIRED_WITHIN, |v| v >= 1.0);
        w1.wait_log(line, REPAIRED_WITHIN);
    }
    full_mtu_ping_ok(&pods[0].ns, pods[1].ip, "after the repair");
    eprintln!("a full-MTU ping crossed again {:?} after the drift", drifted.elapsed());
    // Several more checks: no repair is made, counted or logged twice.
    std::thread::sleep(SETTLE);
    assert_tun_configured(&lab, w1, 50);
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
    let log = w1.log();
    for what in KINDS {
        let want = repairs.iter().filter(|(w, _)| *w == what).count() as f64;
        assert_eq!(
            w1.metric(&repairs_metric(what)),
            Some(want),
            "{what} repairs after `{}`\n--- host 1 log ---\n{}",
            drift.join(" "),
            w1.log_tail(30)
        );
    }
    for (_, line) in &repairs {
        assert_eq!(log.matches(line.as_str()).count(), 1, "{line:?} in host 1's log:\n{log}");
    }
    // The repair came from the kernel's notification, not from polling (the fallback when no
    // watch can be started).
    assert!(!log.contains("polling instead"), "weft fell back to polling:\n{log}");
    let warnings = log.lines().filter(|l| l.contains(" WARN ") && l.contains("tun=weft0")).count();
    assert_eq!(warnings, repairs.len(), "WARN lines about weft0 in host 1's log:\n{log}");
    // The other host saw no drift.
    for what in KINDS {
        assert_eq!(wefts[1].metric(&repairs_metric(what)), Some(0.0), "{what} on host 2");
    }
}

const ROUTE_GONE: &str = "the route for 10.244.0.0/16 via weft0 was gone: added it back";

#[test]
fn a_deleted_network_route_is_added_back() {
    drift_is_repaired(&["route", "del", "10.244.0.0/16", "dev", "weft0"], &|_| {
        vec![("route", ROUTE_GONE.to_owned())]
    });
}

#[test]
fn a_link_set_down_is_set_up_again_with_its_route() {
    // The kernel drops a device's routes when it goes down: both come back.
    drift_is_repaired(&["link", "set", "weft0", "down"], &|_| {
        vec![("up", "weft0 was down: set it up".to_owned()), ("route", ROUTE_GONE.to_owned())]
    });
}

#[test]
fn a_flushed_address_is_set_again_with_its_route() {
    // The kernel drops a device's routes with its last address: both come back.
    drift_is_repaired(&["addr", "flush", "dev", "weft0"], &|addr| {
        vec![
            (
                "address",
                format!(
                    "weft0 had lost its address {addr}/32 (it had no IPv4 address): set {addr}/32"
                ),
            ),
            ("route", ROUTE_GONE.to_owned()),
        ]
    });
}

#[test]
fn a_changed_mtu_is_set_back() {
    // While weft0's MTU is 1000 a full-size packet with DF set cannot cross (small ones do):
    // the full-MTU ping after the repair is what shows the MTU is put right.
    drift_is_repaired(&["link", "set", "weft0", "mtu", "1000"], &|_| {
        vec![("mtu", format!("weft0's MTU was 1000, not {TUN_MTU}: set it back to {TUN_MTU}"))]
    });
}

/// flannel's dual-stack vxlan network (docs/dual-stack.md).
const DUAL_VXLAN: &str = r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;

/// The IPv6 half of weft0 drifts: its global addresses are flushed, then the IPv6 network's
/// route is deleted. weft puts each back (`<v6 subnet>::/128`, the route with its path MTU),
/// counts each under its own `what`, logs each once, and pod 1 reaches pod 2 over IPv6 again;
/// the IPv4 half is never touched.
#[test]
fn the_ipv6_address_and_route_are_put_back_on_a_dual_stack_network() {
    let lab = Lab::new(DUAL_VXLAN);
    let (wefts, pods) = lab.up(&[1, 2], &NO_RESYNC);
    let w1 = &wefts[0];
    let host1 = lab.host(1);
    let pod2_v6 = pods[1].ip6.expect("pod 2 has an IPv6 address");
    ping_ok(&pods[0].ns, pod2_v6, 3);
    let half = w1.subnet6().expect("host 1's IPv6 half");
    let addr6 = format!("{}/128", half.split('/').next().expect("subnet address"));
    let what6 = ["ipv6_address", "ipv6_route"];
    for what in what6 {
        assert_eq!(w1.metric(&repairs_metric(what)), Some(0.0), "{what} before the drift");
    }
    let drifts: [(&[&str], &str, String); 2] = [
        (
            &["-6", "addr", "flush", "dev", "weft0", "scope", "global"],
            "ipv6_address",
            format!("weft0 had lost its IPv6 address {addr6}: set {addr6}"),
        ),
        (
            &["-6", "route", "del", IPV6_NETWORK, "dev", "weft0"],
            "ipv6_route",
            format!("the route for {IPV6_NETWORK} via weft0 was gone: added it back"),
        ),
    ];
    for (drift, what, line) in &drifts {
        let mut cmd = vec!["ip", "-n", host1.as_str()];
        cmd.extend_from_slice(drift);
        let drifted = Instant::now();
        run(&cmd);
        w1.wait_metric(&repairs_metric(what), REPAIRED_WITHIN, |v| v >= 1.0);
        w1.wait_log(line, REPAIRED_WITHIN);
        let resumed = first_reply(&pods[0].ns, pod2_v6, Duration::from_secs(10));
        assert!(
            resumed.is_some() && drifted.elapsed() < REPAIRED_WITHIN * 2,
            "after `{}`, pod 1 did not reach pod 2 over IPv6 again ({:?})\n--- host 1 log ---\n{}",
            drift.join(" "),
            drifted.elapsed(),
            w1.log_tail(30)
        );
    }
    std::thread::sleep(SETTLE);
    let shown = run(&["ip", "-n", &host1, "-6", "addr", "show", "dev", "weft0", "scope", "global"]);
    assert!(shown.contains(&addr6), "weft0 lacks {addr6}:\n{shown}");
    let route = run(&["ip", "-n", &host1, "-6", "route", "show", IPV6_NETWORK]);
    assert!(route.contains("dev weft0") && route.contains("mtu 1430"), "{route}");
    let log = w1.log();
    for (_, what, line) in &drifts {
        assert_eq!(w1.metric(&repairs_metric(what)), Some(1.0), "{what} repairs\n{log}");
        assert_eq!(log.matches(line.as_str()).count(), 1, "{line:?} in host 1's log:\n{log}");
    }
    for what in KINDS {
        assert_eq!(w1.metric(&repairs_metric(what)), Some(0.0), "{what}: the IPv4 half drifted?");
    }
    assert_tun_configured(&lab, w1, 50);
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip6.expect("pod 1's IPv6 address"), 3);
}

/// A route of the Network that is not weft's (`10.244.0.0/16 via 192.0.2.254`) is replaced,
/// never taken as "already there": one in the table before weft starts, and one put in place
/// of weft's later (by `ip route replace`, which the kernel reports as a route through eth0,
/// so it is found by the periodic read, here every second). Pods reach each other both ways,
/// the route goes through weft0, each replacement is logged once with a WARN naming the route
/// in the way, and only the real repair is counted.
#[test]
fn a_foreign_route_of_the_network_is_replaced_never_counted_as_there() {
    let lab = Lab::new(VXLAN);
    let host1 = lab.host(1);
    run(&["ip", "-n", &host1, "route", "add", "10.244.0.0/16", "via", "192.0.2.254"]);
    let (wefts, pods) = lab.up(&[1, 2], &["--netlink-resync", "1s"]);
    let w1 = &wefts[0];
    let in_the_way = "a route of the Network that is not weft's was in the way";
    let shown = |when: &str| {
        let route = run(&["ip", "-n", &host1, "route", "show", "10.244.0.0/16"]);
        assert!(route.contains("dev weft0") && !route.contains("via"), "{when}: {route}");
    };
    shown("at start");
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
    assert_eq!(w1.log().matches(in_the_way).count(), 1, "{}", w1.log_tail(30));
    assert_eq!(w1.metric(&repairs_metric("route")), Some(0.0), "nothing was repaired yet");

    let drifted = Instant::now();
    run(&["ip", "-n", &host1, "route", "replace", "10.244.0.0/16", "via", "192.0.2.254"]);
    let resumed = first_reply(&pods[0].ns, pods[1].ip, Duration::from_secs(10));
    assert!(
        resumed.is_some() && drifted.elapsed() < REPAIRED_WITHIN,
        "pod 1 did not reach pod 2 again ({:?}):\n{}",
        drifted.elapsed(),
        w1.log_tail(30)
    );
    std::thread::sleep(SETTLE);
    shown("after the replace");
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
    assert_eq!(w1.metric(&repairs_metric("route")), Some(1.0), "{}", w1.log_tail(30));
    let log = w1.log();
    assert_eq!(log.matches(ROUTE_GONE).count(), 1, "{log}");
    assert_eq!(log.matches(in_the_way).count(), 2, "{log}");
}
