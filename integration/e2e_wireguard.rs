//! flannel's wireguard backend in user space, end to end in network namespaces: weft's TUN
//! device, WireGuard data messages (gotatun's sessions) on the listen port's UDP sockets.
//!
//! - Two weft hosts lease with flannel's wireguard `BackendData` (`PublicKey`, `Port`), keep
//!   their private key 0600 in the state dir and never print it, ping each other and carry TCP;
//!   the datagrams on the underlay are WireGuard's (type 4 data messages from and to port
//!   51820); garbage, forged and replayed datagrams are dropped and counted.
//! - A flannel wireguard node without the kernel module, as flanneld sets it up
//!   (`scripts/lib/flannel.sh`: `wireguard-go` and `wg set` from the leases), pings both wefts
//!   every way.
//! - A weft restarting with a new key is reached again once its lease says so.
//! - Dual stack (`EnableIPv6`, flannel's default `Mode` `separate`): two wefts and a flannel
//!   node with two wireguard-go devices on one key (IPv4 on 51820, IPv6 on `ListenPortV6`
//!   51821), programmed from the leases' two halves as flanneld programs them, ping over both
//!   families every way; each of its devices hears each weft from that family's listen port.
//!
//! Needs root, the tools listed in `support::netns::REQUIRED_TOOLS`, and `wg` and
//! `wireguard-go` (scripts/setup.sh installs them).

mod support;

use std::time::Duration;

use support::netns::{Families, Lab, ping_all_pairs};
use support::process::lib_run;

const WG: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"wireguard"}}"#;
const SOON: Duration = Duration::from_secs(5);
/// flannel's dual-stack wireguard network (`Mode` defaults to `separate`).
const DUAL_WG: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"wireguard"}}"#;

/// The public key of the private key in `path`, as `wg pubkey` computes it.
fn wg_pubkey(path: &std::path::Path) -> String {
    let key = std::fs::read(path).expect("the key file");
    let mut child = std::process::Command::new("wg")
        .arg("pubkey")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wg");
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), &key).expect("write");
    let out = child.wait_with_output().expect("wg pubkey");
    String::from_utf8(out.stdout).expect("utf-8").trim().to_owned()
}

#[test]
fn wireguard_wefts_ping_and_carry_tcp_with_flannels_leases() {
    let lab = Lab::new(WG);
    let (wefts, pods) = lab.up(&[1, 2], &[]);
    for w in &wefts {
        let key_file = w.dir().join("state").join("wireguard-key");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&key_file).expect("the key file").permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{}", key_file.display());
        let lease = lab.lease_value(&w.subnet().expect("subnet")).expect("weft's lease");
        assert_eq!(lease["BackendType"], "wireguard", "{lease}");
        assert_eq!(lease["BackendData"]["PublicKey"], wg_pubkey(&key_file), "{lease}");
        assert_eq!(lease["BackendData"]["Port"], 51820, "{lease}");
        let private = std::fs::read_to_string(&key_file).expect("key");
        assert!(!w.log().contains(private.trim()), "the private key is in the log");
        // flannel's wireguard MTU: the underlay's less 80.
        support::netns::assert_tun_configured(&lab, w, 80);
    }
    ping_all_pairs(&pods, Families::V4);
    let server = support::netns::Iperf3Server::start(&pods[1].ns);
    let bps = support::netns::iperf3_bps(&pods[0].ns, pods[1].ip, 2);
    drop(server);
    assert!(bps > 1e7, "iperf3 over wireguard: {bps} b/s");
    eprintln!("iperf3 over weft's wireguard: {:.2} Gbit/s", bps / 1e9);
}

/// A flannel wireguard node on wireguard-go, configured from the leases as flanneld would,
/// and two wefts: every pod pings every other. Then weft 2 restarts with a new key: its lease
/// says so, weft 1 takes the new key (a new session), the flannel node is told as flanneld is
/// told (the old peer removed, the new one added), and every pod pings every other again.
#[test]
fn a_wireguard_go_flannel_node_and_two_wefts_ping_every_way_through_a_new_key() {
    let lab = Lab::new(WG);
    let flannel = support::kernel_flannel::WireguardPeer::new(&lab, 3, "10.244.200.0/24");
    let (mut wefts, mut pods) = lab.up(&[1, 2], &[]);
    let peer_with = |w: &support::netns::Weft| {
        w.wait_metric("weft_routes", SOON, |v| v >= 2.0);
        let subnet = w.subnet().expect("a subnet");
        let lease = lab.lease_value(&subnet).expect("weft's lease");
        let key = lease["BackendData"]["PublicKey"].as_str().expect("PublicKey").to_owned();
        flannel.peer(&key, &format!("192.0.2.{}:51820", w.n), &subnet);
        key
    };
    let keys: Vec<String> = wefts.iter().map(peer_with).collect();
    pods.push(flannel.pod(&lab));
    ping_all_pairs(&pods, Families::V4);
    let server = support::netns::Iperf3Server::start(&pods[2].ns);
    let bps = support::netns::iperf3_bps(&pods[0].ns, pods[2].ip, 2);
    drop(server);
    assert!(bps > 1e7, "iperf3 weft -> wireguard-go: {bps} b/s");

    // A new key: the file removed, weft 2 made one and published it with the same subnet.
    let w2 = &mut wefts[1];
    let subnet = w2.subnet().expect("subnet");
    w2.stop();
    std::fs::remove_file(w2.dir().join("state").join("wireguard-key")).expect("remove the key");
    w2.start();
    w2.wait_ready(support::netns::READY_WITHIN);
    assert_eq!(w2.subnet().expect("subnet"), subnet, "weft 2 kept its subnet");
    let lease = lab.lease_value(&subnet).expect("weft 2's lease");
    let new_key = lease["BackendData"]["PublicKey"].as_str().expect("PublicKey").to_owned();
    assert_ne!(new_key, keys[1], "weft 2's lease still has its old key");
    flannel.unpeer(&keys[1]);
    flannel.peer(&new_key, "192.0.2.2:51820", &subnet);
    ping_all_pairs(&pods, Families::V4);
}

/// The UDP payload of the first packet in the pcap file at `path` (Ethernet, IPv4, UDP).
fn first_udp_payload(path: &std::path::Path) -> Vec<u8> {
    let pcap = std::fs::read(path).expect("pcap");
    let frame = pcap.get(24 + 16..).expect("a packet in the pcap");
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    frame[14 + ihl + 8..].to_vec()
}

/// Sends `payload` from `ns` (its own address, an ephemeral port) to weft's listen port at
/// `to`.
fn send_udp(ns: &str, to: &str, payload: &[u8]) {
    let (to, payload) = (to.to_owned(), payload.to_vec());
    support::netns::in_netns(ns, move || {
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.send_to(&payload, to.as_str()).expect("send");
    });
}

/// What a host on the underlay can throw at weft's listen port: garbage, a data message of no
/// session, an initiation without a valid MAC, and a replay of a peer's real data message.
/// Each is dropped and counted under its reason, and forwarding goes on. Then host 2 moves to
/// a new address: its lease follows, weft 1's session follows the lease, and both ping again.
#[test]
fn forged_and_replayed_datagrams_are_counted_and_a_renumbered_peer_is_reached() {
    let lab = Lab::new(WG);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    ping_all_pairs(&pods, Families::V4);
    let (h1, h2) = (wefts[0].ns.clone(), wefts[1].ns.clone());
    let drops = |w: &support::netns::Weft, reason: &str| {
        let name = format!(r#"weft_dataplane_drops_total{{dir="rx",reason="{reason}"}}"#);
        w.metric(&name).unwrap_or(0.0)
    };
    let before: Vec<f64> = ["wg_malformed", "wg_no_session", "wg_decrypt", "wg_replay"]
        .iter()
        .map(|r| drops(&wefts[0], r))
        .collect();

    // A real data message from host 2, captured on host 1's underlay, to replay.
    let pcap = lab.dir().join("wg.pcap");
    let pcap_s = pcap.to_string_lossy().into_owned();
    let filter = "udp and src host 192.0.2.2 and dst port 51820 and greater 120";
    let mut dump = support::netns::ns_spawn(
        &h1,
        &["tcpdump", "-i", "eth0", "-n", "-U", "-c", "1", "-w", &pcap_s, filter],
    );
    std::thread::sleep(Duration::from_millis(500));
    support::netns::ping_ok(&pods[1].ns, pods[0].ip, 2);
    let deadline = std::time::Instant::now() + SOON;
    while dump.try_wait().expect("tcpdump").is_none() {
        assert!(std::time::Instant::now() < deadline, "tcpdump saw no data message");
        std::thread::sleep(Duration::from_millis(50));
    }
    let captured = first_udp_payload(&pcap);
    assert_eq!(captured[..4], [4, 0, 0, 0], "not a data message: {captured:?}");

    let mut no_session = vec![4, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef];
    no_session.resize(16 + 32, 7);
    let mut bad_mac = vec![1, 0, 0, 0];
    bad_mac.resize(148, 9);
    for payload in [vec![9u8; 100], no_session, bad_mac, captured] {
        send_udp(&h2, "192.0.2.1:51820", &payload);
    }
    for (i, reason) in
        ["wg_malformed", "wg_no_session", "wg_decrypt", "wg_replay"].iter().enumerate()
    {
        let name = format!(r#"weft_dataplane_drops_total{{dir="rx",reason="{reason}"}}"#);
        wefts[0].wait_metric(&name, SOON, |v| v >= before[i] + 1.0);
    }
    ping_all_pairs(&pods, Families::V4);

    // Host 2 moves: its lease's PublicIP changes, and weft 1 sends to the new address.
    let subnet = wefts[1].subnet().expect("subnet");
    wefts[1].stop();
    lib_run("netns.sh", "netns_readdress", &[h2.as_str(), "eth0", "192.0.2.2/24", "192.0.2.22/24"]);
    // Found on eth0 this time, not given.
    wefts[1].public_ip_flag = false;
    wefts[1].start();
    wefts[1].wait_ready(support::netns::READY_WITHIN);
    let deadline = std::time::Instant::now() + SOON;
    while lab.lease_value(&subnet).map(|l| l["PublicIP"].clone()) != Some("192.0.2.22".into()) {
        assert!(std::time::Instant::now() < deadline, "{:?}", lab.lease_value(&subnet));
        std::thread::sleep(Duration::from_millis(50));
    }
    ping_all_pairs(&pods, Families::V4);
}

/// An in-place upgrade (SIGHUP) of a wireguard weft: the new image has none of the old one's
/// sessions, starts a handshake with every peer as soon as its predecessor has stopped
/// reading the sockets, and the peer takes the new session
/// within a round trip. Pings 5 ms apart across three upgrades lose at most a few per
/// takeover; the count is printed.
#[test]
fn an_in_place_upgrade_re_handshakes_at_once() {
    let lab = Lab::new(WG);
    let (mut wefts, pods) = lab.up(&[1, 2], &[]);
    ping_all_pairs(&pods, Families::V4);
    let subnet = wefts[0].subnet().expect("subnet");
    let ping = support::netns::spawn_ping(&pods[1].ns, pods[0].ip, 600, 0.005);
    std::thread::sleep(Duration::from_millis(500));
    let handed_back =
        |w: &support::netns::Weft| w.log().matches("handed over: the next weft").count();
    for k in 0..3 {
        let before = handed_back(&wefts[0]);
        wefts[0].signal(nix::sys::signal::Signal::SIGHUP);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while handed_back(&wefts[0]) == before {
            assert!(wefts[0].running(), "weft 1 exited at upgrade {k}:\n{}", wefts[0].log_tail(40));
            assert!(
                std::time::Instant::now() < deadline,
                "no upgrade {k}:\n{}",
                wefts[0].log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(wefts[0].wait_ready(support::netns::READY_WITHIN), subnet);
        std::thread::sleep(Duration::from_millis(500));
    }
    let r = support::netns::finish_ping(ping);
    let lost = r.transmitted - r.received;
    eprintln!(
        "wireguard in-place upgrades: {lost} of {} pings 5 ms apart lost across 3",
        r.transmitted
    );
    // Each upgrade is two takeovers (the bridge's, then the new image's). A takeover loses
    // what the new process reads before its predecessor has stopped reading the sockets
    // (sealed for the predecessor's sessions) and one handshake round trip after: 4-7 in all
    // here. Starting the handshakes before the predecessor stopped lost 10 to 491 (a
    // response it read was lost, and gotatun retries after 5 s); a quiesce that waited for
    // the timer thread's 25 ms sleep (nobody forwarding meanwhile) lost 10-12 here and 21 in
    // CI's slower root. The bound leaves CI twice the room.
    assert!(lost <= 18, "{lost} of {} lost:\n{}", r.transmitted, r.text);
}

/// `wg show DEV WHAT` in host namespace `ns`: one line per peer, `<key>\t<value>`.
fn wg_show(ns: &str, dev: &str, what: &str) -> Vec<(String, String)> {
    support::netns::run(&["ip", "netns", "exec", ns, "wg", "show", dev, what])
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// flannel's wireguard backend on a dual-stack network, `Mode` `separate`: each weft leases
/// with both halves as flannel's `newSubnetAttrs` writes them (one key; `BackendData.Port`
/// 51820, `PublicIPv6` and `BackendV6Data.Port` 51821); a flannel node with two wireguard-go
/// devices on one key (`flannel-wg3` for IPv4 on 51820, `flannel-wg6-3` for IPv6 on 51821) is
/// programmed from those leases as flanneld programs them, and every pod pings every other over
/// IPv4 and IPv6. Each family's sessions are the device's of that family: the flannel node's
/// IPv6 device heard each weft from `[2001:db8::N]:51821`, its IPv4 one from `192.0.2.N:51820`
/// (a peer's endpoint is where its last authenticated datagram came from), and each device
/// allows its own family's subnet only, so IPv6 over the IPv4 sessions would be dropped.
#[test]
fn dual_stack_wefts_and_a_separate_mode_wireguard_go_node_ping_both_families_every_way() {
    let lab = Lab::new(DUAL_WG);
    let flannel = support::kernel_flannel::WireguardPeer::dual(
        &lab,
        3,
        "10.244.200.0/24",
        "fd00:10:244:c8::/64",
    );
    let (wefts, mut pods) = lab.up(&[1, 2], &[]);
    let mut keys = Vec::new();
    for w in &wefts {
        w.wait_metric("weft_routes", SOON, |v| v >= 2.0);
        let (subnet, subnet6) = (w.subnet().expect("subnet"), w.subnet6().expect("IPv6 subnet"));
        let (_, lease) = lab.lease_entry(&subnet).expect("weft's lease");
        let key = lease["BackendData"]["PublicKey"].as_str().expect("PublicKey").to_owned();
        assert_eq!(lease["BackendType"], "wireguard", "{lease}");
        assert_eq!(lease["BackendData"]["Port"], 51820, "{lease}");
        assert_eq!(lease["PublicIPv6"], format!("2001:db8::{}", w.n), "{lease}");
        assert_eq!(lease["BackendV6Data"]["PublicKey"], key.as_str(), "{lease}");
        assert_eq!(lease["BackendV6Data"]["Port"], 51821, "{lease}");
        flannel.peer(&key, &format!("192.0.2.{}:51820", w.n), &subnet);
        flannel.peer6(&key, &format!("[2001:db8::{}]:51821", w.n), &subnet6);
        keys.push(key);
    }
    pods.push(flannel.pod(&lab));
    ping_all_pairs(&pods, Families::Both);

    let ns = flannel.ns.as_str();
    let endpoints4 = wg_show(ns, "flannel-wg3", "endpoints");
    let endpoints6 = wg_show(ns, "flannel-wg6-3", "endpoints");
    for (w, key) in wefts.iter().zip(&keys) {
        let at = |list: &[(String, String)]| {
            list.iter().find(|(k, _)| k == key).map(|(_, e)| e.clone()).unwrap_or_default()
        };
        assert_eq!(at(&endpoints4), format!("192.0.2.{}:51820", w.n), "{endpoints4:?}");
        assert_eq!(at(&endpoints6), format!("[2001:db8::{}]:51821", w.n), "{endpoints6:?}");
    }
    // Both of the flannel node's devices completed handshakes with both wefts.
    for dev in ["flannel-wg3", "flannel-wg6-3"] {
        let handshakes = wg_show(ns, dev, "latest-handshakes");
        assert_eq!(handshakes.len(), 2, "{dev}: {handshakes:?}");
        assert!(handshakes.iter().all(|(_, t)| t != "0"), "{dev}: {handshakes:?}");
    }
    let server = support::netns::Iperf3Server::start(&pods[2].ns);
    let ip6 = pods[2].ip6.expect("the flannel pod's IPv6 address");
    let bps = support::netns::iperf3_bps(&pods[0].ns, ip6, 2);
    drop(server);
    assert!(bps > 1e7, "iperf3 -6 weft -> wireguard-go: {bps} b/s");
    eprintln!("iperf3 -6 weft -> wireguard-go's IPv6 device: {:.2} Gbit/s", bps / 1e9);
}
