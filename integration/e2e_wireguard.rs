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
//!
//! Needs root, the tools listed in `support::netns::REQUIRED_TOOLS`, and `wg` and
//! `wireguard-go` (scripts/setup.sh installs them).

mod support;

use std::time::Duration;

use support::netns::{Families, Lab, ping_all_pairs};

const WG: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"wireguard"}}"#;
const SOON: Duration = Duration::from_secs(5);

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
