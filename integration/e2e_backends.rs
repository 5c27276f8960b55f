//! flannel's other backends end to end, in network namespaces: for each, two weft hosts and one
//! reference peer set up as flanneld sets up a node of that backend, in one cluster, pinging
//! every way, and a peer leaving and coming back with a new address.
//!
//! - host-gw: the reference peer is a host with kernel routes `<subnet> via <PublicIP> dev
//!   eth0` (`support::kernel_flannel::RoutedPeer`); weft's routes are checked in the kernel,
//!   put back when deleted, kept across `weft run --takeover`, and a peer off the link is
//!   named.
//! - vxlan `DirectRouting`: the two weft hosts share a link and reach each other by direct
//!   routes, the kernel flannel peer is on another link (the hub routes between) and is reached
//!   through weft's VXLAN; then it moves onto the weft hosts' link and is routed directly.
//! - alloc: a lease and subnet.env, no data plane.
//! - A changed backend: two vxlan hosts while the network config is put again with host-gw;
//!   each says so once and keeps forwarding on vxlan, and once one is restarted on host-gw the
//!   other names it as a peer it cannot reach, staying ready.
//!
//! Needs root and the tools listed in `support::netns::REQUIRED_TOOLS`.

mod support;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use support::kernel_flannel::{KernelFlannelPeer, RoutedPeer};
use support::netns::{
    Families, Lab, PREFIX, Pod, READY_WITHIN, ns_output, ns_run, ping_all_pairs, ping_ok,
};
use support::process::lib_run;

const HOST_GW: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"host-gw"}}"#;
const DIRECT: &str =
    r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan","DirectRouting":true}}"#;
const ALLOC: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"alloc"}}"#;
const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const SOON: Duration = Duration::from_secs(5);

/// `ip route show <dst>` in `ns` (the main table's routes to exactly `dst`), one line.
fn route_to(ns: &str, dst: &str) -> String {
    ns_run(ns, &["ip", "route", "show", dst]).trim().to_owned()
}

/// Waits until `route_to(ns, dst)` satisfies `pred`; returns it.
fn wait_route(ns: &str, dst: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + SOON;
    loop {
        let r = route_to(ns, dst);
        if pred(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "{ns}: the route to {dst} is {r:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The route weft puts for a peer holding `subnet` at `via`: on eth0, weft's protocol (119).
fn weft_route(subnet: &str, via: &str) -> String {
    format!("{subnet} via {via} dev eth0 proto 119")
}

fn forwarding(ns: &str) {
    lib_run("flannel.sh", "flannel_forwarding", &[ns]);
}

#[test]
fn host_gw_wefts_and_a_flannel_host_gw_peer_ping_every_way_and_follow_the_peer() {
    let lab = Lab::new(HOST_GW);
    let mut flannel = RoutedPeer::new(&lab, 3, "10.244.200.0/24");
    for n in [1, 2] {
        forwarding(&lab.host(n));
    }
    // --ip-masq: subnet.env says so, and the bridge masquerades nothing (see
    // `Lab::pod_with_ipmasq`); pods' packets cross the underlay with their own addresses.
    let (mut wefts, mut pods) = lab.up(&[1, 2], &["--stale-route-ttl", "1s", "--ip-masq"]);
    let subnets: Vec<String> = wefts.iter().map(|w| w.subnet().expect("a subnet")).collect();
    for (w, subnet) in wefts.iter().zip(&subnets) {
        w.wait_metric("weft_dataplane_kernel_routes", SOON, |v| v == 2.0);
        flannel.route(subnet, Ipv4Addr::new(192, 0, 2, w.n));
        // flannel's host-gw lease: its type, no BackendData; the MTU is the interface's.
        let lease = lab.lease_value(subnet).expect("weft's lease");
        assert_eq!(lease["BackendType"], "host-gw", "{lease}");
        assert!(lease.get("BackendData").is_none(), "{lease}");
        let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
        assert!(env.contains("FLANNEL_MTU=1500\n"), "{env}");
        // No TUN device: the kernel forwards.
        assert!(!ns_output(&w.ns, &["ip", "link", "show", "weft0"]).status.success());
    }
    let (h1, h2) = (wefts[0].ns.clone(), wefts[1].ns.clone());
    assert_eq!(route_to(&h1, &subnets[1]), weft_route(&subnets[1], "192.0.2.2"));
    assert_eq!(route_to(&h2, "10.244.200.0/24"), weft_route("10.244.200.0/24", "192.0.2.3"));
    pods.push(flannel.pod(&lab));
    ping_all_pairs(&pods, Families::V4);

    // Drift: a deleted route is put back, and counted.
    ns_run(&h1, &["ip", "route", "del", "10.244.200.0/24"]);
    wait_route(&h1, "10.244.200.0/24", |r| r == weft_route("10.244.200.0/24", "192.0.2.3"));
    wefts[0].wait_metric("weft_dataplane_kernel_route_repairs_total", SOON, |v| v >= 1.0);

    // The peer leaves (its lease goes; the route goes once it is no longer trusted) and comes
    // back with a new address: the routes follow it.
    flannel.leave(&lab);
    for w in &wefts {
        wait_route(&w.ns, "10.244.200.0/24", str::is_empty);
        w.wait_metric("weft_dataplane_kernel_routes", SOON, |v| v == 1.0);
    }
    flannel.renumber(&lab, Ipv4Addr::new(192, 0, 2, 33));
    for (w, subnet) in wefts.iter().zip(&subnets) {
        flannel.route(subnet, Ipv4Addr::new(192, 0, 2, w.n));
    }
    for w in &wefts {
        wait_route(&w.ns, "10.244.200.0/24", |r| r == weft_route("10.244.200.0/24", "192.0.2.33"));
    }
    ping_all_pairs(&pods, Families::V4);

    // A host-gw peer off the link is named, and gets no route.
    let off = r#"{"PublicIP":"198.51.100.9","PublicIPv6":null,"BackendType":"host-gw"}"#;
    lab.etcdctl(&["put", "/coreos.com/network/subnets/10.244.201.0-24", off]);
    wefts[0]
        .wait_log("10.244.201.0/24 has PublicIP 198.51.100.9, which is not on eth0's link", SOON);
    wefts[0].wait_metric("weft_dataplane_off_link_peers", SOON, |v| v == 1.0);
    assert_eq!(route_to(&h1, "10.244.201.0/24"), "");

    // A takeover adopts the routes as they are: none is changed, pings go on.
    let before = ns_run(&h1, &["ip", "route", "show", "proto", "119"]);
    let monitor = support::netns::ns_spawn(&h1, &["ip", "monitor", "route"]);
    let ping = support::netns::spawn_ping(&pods[0].ns, pods[2].ip, 40, 0.05);
    let mut next = wefts[0].successor(1);
    next.wait_ready(SOON * 4);
    let ping = support::netns::finish_ping(ping);
    let mut monitor = monitor;
    let _ = monitor.kill();
    let seen = monitor.wait_with_output().expect("ip monitor");
    let changes = String::from_utf8_lossy(&seen.stdout).into_owned();
    assert!(ping.received == ping.transmitted, "pings lost across the takeover:\n{}", ping.text);
    assert_eq!(ns_run(&h1, &["ip", "route", "show", "proto", "119"]), before);
    assert!(
        !changes.contains("proto 119"),
        "weft's routes changed across the takeover:\n{changes}"
    );
    let deadline = Instant::now() + SOON;
    while wefts[0].running() {
        assert!(Instant::now() < deadline, "the previous weft still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    wefts[0] = next;
    ping_ok(&pods[2].ns, pods[0].ip, 3);

    // A restart (stop, start afresh) finds its routes in the kernel and changes none of them,
    // although it starts on an empty route table.
    let monitor = support::netns::ns_spawn(&h2, &["ip", "monitor", "route"]);
    wefts[1].stop();
    wefts[1].start();
    wefts[1].wait_ready(SOON * 4);
    wefts[1].wait_log("listed leases", SOON);
    std::thread::sleep(Duration::from_millis(300));
    let mut monitor = monitor;
    let _ = monitor.kill();
    let seen = monitor.wait_with_output().expect("ip monitor");
    let changes = String::from_utf8_lossy(&seen.stdout).into_owned();
    assert!(!changes.contains("proto 119"), "weft's routes changed across a restart:\n{changes}");
    ping_ok(&pods[1].ns, pods[2].ip, 3);
}

#[test]
fn vxlan_direct_routing_routes_the_peers_on_the_link_and_tunnels_to_the_others() {
    let lab = Lab::new(DIRECT);
    let hub = lab.hub();
    // Two links on the lab's underlay: 192.0.2.0/25 (the weft hosts) and 192.0.2.128/25 (the
    // kernel flannel peer), the hub routing between them.
    forwarding(&hub);
    ns_run(&hub, &["ip", "addr", "add", "192.0.2.126/25", "dev", "br0"]);
    for n in [1, 2] {
        let ns = lab.host(n);
        let (old, new) = (format!("192.0.2.{n}/24"), format!("192.0.2.{n}/25"));
        lib_run("netns.sh", "netns_readdress", &[ns.as_str(), "eth0", &old, &new, "192.0.2.126"]);
    }
    let far = 130;
    let flannel = KernelFlannelPeer::new(&lab, far, "10.244.200.0/24", None);
    lib_run(
        "netns.sh",
        "netns_readdress",
        &[flannel.ns.as_str(), "eth0", "192.0.2.130/24", "192.0.2.130/25", "192.0.2.254"],
    );
    forwarding(&flannel.ns);
    let (wefts, mut pods) = lab.up(&[1, 2], &["--ip-masq"]);
    let subnets: Vec<String> = wefts.iter().map(|w| w.subnet().expect("a subnet")).collect();
    // The kernel peer: no direct route to the weft hosts (another link), VXLAN as flannel's.
    for s in &subnets {
        flannel.program(&lab.vxlan_lease(s));
    }
    pods.push(flannel.pod_unmasqueraded(&lab, 1450));
    let (h1, h2) = (wefts[0].ns.clone(), wefts[1].ns.clone());
    // The weft hosts route each other directly, more specific than the TUN device's route.
    let direct = |ns: &str, subnet: &str, via: &str| {
        wait_route(ns, subnet, |r| r == weft_route(subnet, via));
    };
    direct(&h1, &subnets[1], "192.0.2.2");
    direct(&h2, &subnets[0], "192.0.2.1");
    let get = ns_run(&h1, &["ip", "route", "get", &pods[1].ip.to_string()]);
    assert!(get.contains("via 192.0.2.2 dev eth0"), "{get}");
    // ... and the far peer through the tunnel.
    assert_eq!(route_to(&h1, "10.244.200.0/24"), "");
    let get = ns_run(&h1, &["ip", "route", "get", &pods[2].ip.to_string()]);
    assert!(get.contains("dev weft0"), "{get}");
    for w in &wefts {
        w.wait_metric("weft_dataplane_kernel_routes", SOON, |v| v == 1.0);
    }
    let tx = |w: &support::netns::Weft| w.metric("weft_dataplane_tx_packets_total").unwrap_or(0.0);
    let before = tx(&wefts[0]);
    ping_ok(&pods[0].ns, pods[1].ip, 5);
    assert_eq!(tx(&wefts[0]), before, "the direct route carried host 2's pings, not weft");
    ping_all_pairs(&pods, Families::V4);
    assert!(tx(&wefts[0]) > before, "the far peer's pings went through weft");

    // The far peer leaves and comes back on the weft hosts' link: routed directly, both ways.
    lab.etcdctl(&["del", &flannel.lease.key()]);
    let near = "192.0.2.100";
    lib_run(
        "netns.sh",
        "netns_readdress",
        &[flannel.ns.as_str(), "eth0", "192.0.2.130/25", &format!("{near}/25"), "192.0.2.126"],
    );
    let mut lease = flannel.lease.clone();
    lease.public_ip = near.parse().expect("address");
    lab.etcdctl(&["put", &lease.key(), &lease.value()]);
    for s in &subnets {
        lib_run("flannel.sh", "flannel_unroute_peer", &[flannel.ns.as_str(), s]);
        flannel.route_direct(&lab.vxlan_lease(s));
    }
    for w in &wefts {
        wait_route(&w.ns, "10.244.200.0/24", |r| r == weft_route("10.244.200.0/24", near));
    }
    ping_all_pairs(&pods, Families::V4);
}

#[test]
fn alloc_leases_a_subnet_and_runs_no_data_plane() {
    let lab = Lab::new(ALLOC);
    let mut w = lab.start_weft(1, &[]);
    let subnet = w.wait_ready(SOON * 4);
    let lease = lab.lease_value(&subnet).expect("weft's lease");
    // flannel's alloc writes PublicIP alone.
    assert_eq!(lease["PublicIP"], "192.0.2.1", "{lease}");
    assert!(lease.get("BackendType").is_none() && lease.get("BackendData").is_none(), "{lease}");
    let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
    assert!(env.contains(&format!("FLANNEL_SUBNET={}", first_host(&subnet))), "{env}");
    assert!(env.contains("FLANNEL_MTU=1500\n"), "{env}");
    assert!(!ns_output(&w.ns, &["ip", "link", "show", "weft0"]).status.success());
    assert_eq!(ns_run(&w.ns, &["ip", "route", "show", "proto", "119"]), "");
    let pod: Pod = lab.pod(1, &w.subnet_file());
    assert!(subnet_contains(&subnet, pod.ip), "{pod:?} in {subnet}");
}

fn first_host(subnet: &str) -> String {
    let (net, len) = subnet.split_once('/').expect("subnet");
    let net: Ipv4Addr = net.parse().expect("subnet address");
    format!("{}/{len}", Ipv4Addr::from(u32::from(net) + 1))
}

fn subnet_contains(subnet: &str, ip: Ipv4Addr) -> bool {
    let net: ipnet::Ipv4Net = subnet.parse().expect("subnet");
    net.contains(&ip)
}

/// How many times `needle` is in weft `w`'s log.
fn logged(w: &support::netns::Weft, needle: &str) -> usize {
    w.log().matches(needle).count()
}

/// The network config put again with another backend while two vxlan hosts run (issue 37):
/// each weft says so once in a WARN naming the difference and what it does (keeps vxlan
/// until a restart), counts it, says nothing for the same config put again, says at INFO when
/// the store holds its own config again, and keeps forwarding. A host restarted cold comes up
/// host-gw; the other then names it (subnet, PublicIP, its backend and its own) in one WARN
/// and in `/readyz`'s 200 body, and stays ready, and so does the restarted one about it.
#[test]
fn a_backend_changed_in_the_store_is_told_once_and_a_host_restarted_on_it_is_named() {
    const DIFFERS: &str = "Backend.Type vxlan -> host-gw";
    const KEEPS: &str = "weft keeps running the config it started with until it is restarted";
    const AGAIN: &str = "the network config in the store is the one weft runs again";
    const CHANGES: &str = "weft_network_config_changes_total";
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    let config_key = format!("{PREFIX}/config");

    let host_gw = lab.dir().join("host-gw.json");
    std::fs::write(&host_gw, HOST_GW).expect("write the config");
    lab.admin(&["network", "set", &host_gw.to_string_lossy()]);
    for w in &wefts {
        w.wait_log(DIFFERS, SOON);
        assert!(w.log().contains(KEEPS), "weft {}: {}", w.n, w.log_tail(20));
        w.wait_metric(CHANGES, SOON, |v| v == 1.0);
        assert_eq!(w.metric("weft_network_config_differs"), Some(1.0));
        let (status, body) = w.get("/readyz");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(DIFFERS), "{body}");
    }
    // The same config again, as etcdctl writes it, then the running one: only the return is
    // told, and the watch sees writes in order, so the re-put was seen and said nothing.
    lab.etcdctl(&["put", &config_key, HOST_GW]);
    lab.etcdctl(&["put", &config_key, VXLAN]);
    for w in &wefts {
        w.wait_log(AGAIN, SOON);
        assert_eq!(logged(w, DIFFERS), 1, "weft {}: {}", w.n, w.log_tail(20));
        assert_eq!(w.metric(CHANGES), Some(1.0));
        assert_eq!(w.metric("weft_network_config_differs"), Some(0.0));
    }
    // host-gw again: a change of its own, told once more.
    lab.etcdctl(&["put", &config_key, HOST_GW]);
    for w in &wefts {
        w.wait_metric(CHANGES, SOON, |v| v == 2.0);
        assert_eq!(logged(w, DIFFERS), 2, "weft {}: {}", w.n, w.log_tail(20));
    }
    // Both still run vxlan, and forward.
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);

    // An in-place upgrade of host 1 keeps its config, and the new image says at once that the
    // store's differs (the bridge, a process of its own, may say so too while it holds on).
    let handed_back =
        |w: &support::netns::Weft| w.log().matches("handed over: the next weft").count();
    let before = (handed_back(&wefts[0]), logged(&wefts[0], DIFFERS));
    wefts[0].signal(nix::sys::signal::Signal::SIGHUP);
    let deadline = Instant::now() + READY_WITHIN;
    while handed_back(&wefts[0]) == before.0 {
        assert!(Instant::now() < deadline, "no in-place upgrade:\n{}", wefts[0].log_tail(40));
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + SOON;
    while logged(&wefts[0], DIFFERS) == before.1 {
        assert!(Instant::now() < deadline, "not said after SIGHUP:\n{}", wefts[0].log_tail(40));
        std::thread::sleep(Duration::from_millis(20));
    }
    wefts[0].wait_ready(READY_WITHIN);
    wefts[0].wait_metric(CHANGES, SOON, |v| v == 1.0);
    let subnet1 = wefts[0].subnet().expect("host 1's subnet");
    assert_eq!(lab.lease_value(&subnet1).expect("host 1's lease")["BackendType"], "vxlan");
    ping_ok(&pods[0].ns, pods[1].ip, 3);

    // Host 2 restarted cold: it comes up on the store's config, host-gw.
    wefts[1].stop();
    wefts[1].start();
    let subnet2 = wefts[1].wait_ready(READY_WITHIN);
    let lease = lab.lease_value(&subnet2).expect("host 2's lease");
    assert_eq!(lease["BackendType"], "host-gw", "{lease}");

    let named = format!(
        "cannot reach the peer holding {subnet2} at 192.0.2.2: its lease says backend host-gw, \
         this host runs vxlan"
    );
    wefts[0].wait_log(&named, SOON);
    wefts[0].wait_metric("weft_route_backend_mismatched_peers", SOON, |v| v == 1.0);
    let (status, body) = wefts[0].get("/readyz");
    assert_eq!(status, 200, "one bad peer leaves the host ready: {body}");
    assert!(body.contains(&format!("{subnet2} at 192.0.2.2 (host-gw)")), "{body}");
    assert!(body.contains("this host's vxlan"), "{body}");
    // The restarted host names the vxlan one too, and runs the store's config: nothing differs.
    let back = format!(
        "cannot reach the peer holding {subnet1} at 192.0.2.1: its lease says backend vxlan, \
         this host runs host-gw"
    );
    wefts[1].wait_log(&back, SOON);
    let (status, body) = wefts[1].get("/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&format!("{subnet1} at 192.0.2.1 (vxlan)")), "{body}");
    assert_eq!(wefts[1].metric("weft_network_config_differs"), Some(0.0));
    // Told once, however many tables the route watcher publishes meanwhile.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(logged(&wefts[0], &named), 1, "{}", wefts[0].log_tail(20));

    // Host 2 back on vxlan: host 1 says the peer is no longer one of another backend.
    lab.etcdctl(&["put", &config_key, VXLAN]);
    wefts[1].stop();
    wefts[1].start();
    wefts[1].wait_ready(READY_WITHIN);
    wefts[0].wait_log(
        &format!("the peer holding {subnet2} at 192.0.2.2 is no longer one of another backend"),
        SOON,
    );
    wefts[0].wait_metric("weft_route_backend_mismatched_peers", SOON, |v| v == 0.0);
    ping_ok(&pods[0].ns, pods[1].ip, 3);
}
