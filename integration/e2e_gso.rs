//! End to end in network namespaces: UDP GSO turns off while the path refuses it and back on
//! after the retry time (docs/dataplane.md, "Offloads"); on a kernel with a known GSO bug, no
//! GSO message ends on a full segment (docs/troubleshooting.md). Real etcd, two real `weft run`
//! processes, pods behind them and iperf3 across the overlay, as in integration/e2e.rs.
//!
//! What makes a GSO send fail on a veth underlay: on this machine's kernel (6.18), turning tx
//! checksum offload off (`ethtool -K eth0 tx off`) does not: since Linux 6.11 the kernel
//! segments and checksums such GSO sends in software ("udp: Allow GSO transmit from devices
//! with no checksum offload"). A path MTU below the GSO segment size does, with `EMSGSIZE`
//! (`EINVAL` on kernels before the 2025 fix "udp: gso: do not drop small packets when PMTU
//! reduces"), while the same datagrams sent one by one are fragmented and delivered. So the test
//! lowers the path MTU to the peer with a route (`ip route add <peer>/32 dev eth0 mtu 1400`, as
//! a smaller link on the way or a learned path MTU would), and removes it again.
//!
//! Needs root and the tools in `support::netns::REQUIRED_TOOLS`. Each test builds its own lab
//! (namespaces `wt<4 hex>*`), removed on drop.

mod support;

use std::net::Ipv4Addr;
use std::process::Child;
use std::time::{Duration, Instant};

#[cfg(feature = "fault-injection")]
use support::kernel_flannel::KernelFlannelPeer;
use support::netns::{Iperf3Server, Lab, Weft, iperf3_bps, ns_output, ns_spawn, run};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const GAUGE: &str = r#"weft_dataplane_offload{kind="udp_gso"}"#;
const FALLBACKS: &str = "weft_dataplane_gso_fallbacks_total";
const REPROBES: &str = "weft_dataplane_gso_reprobes_total";
const RX_BYTES: &str = "weft_dataplane_rx_bytes_total";

/// Waits until an iperf3 server listens in `ns`.
fn wait_listening(ns: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = ns_output(ns, &["ss", "-ltnH", "sport", "= :5201"]);
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "no iperf3 server listening in {ns}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An iperf3 client (one TCP stream, so one flow, one weft socket) running in the background
/// for `secs`; killed on drop.
struct Stream(Child);

impl Stream {
    fn start(client_ns: &str, server_ip: Ipv4Addr, secs: u32) -> Self {
        let (ip, t) = (server_ip.to_string(), secs.to_string());
        Self(ns_spawn(client_ns, &["iperf3", "-c", &ip, "-t", &t, "--connect-timeout", "3000"]))
    }

    fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Bytes host `w` delivered to its pods during `over`.
fn delivered(w: &Weft, over: Duration) -> f64 {
    let before = w.metric(RX_BYTES).unwrap_or(0.0);
    std::thread::sleep(over);
    w.metric(RX_BYTES).unwrap_or(0.0) - before
}

fn metric(w: &Weft, name: &str) -> f64 {
    w.metric(name).unwrap_or_else(|| panic!("weft {}: no {name} on /metrics", w.n))
}

/// A path MTU below the GSO segment size makes host 1's GSO sends fail: traffic goes on as
/// single datagrams, the failure is counted and logged, and the `udp_gso` gauge drops to 0.
/// Once the path takes GSO again, the socket tries it again at its retry time (2 s here, by
/// the hidden `--gso-retry-after`): GSO works again (logged at INFO, gauge 1, a re-probe
/// counted), and stays on for later traffic.
#[test]
fn gso_turns_off_while_the_path_refuses_it_and_on_again_after_the_retry_time() {
    let lab = Lab::new(VXLAN);
    // One worker, so that the one iperf3 stream's flow and its socket are the ones retried.
    let (wefts, pods) = lab.up(&[1, 2], &["--workers", "1", "--gso-retry-after", "2s"]);
    let (w1, w2) = (&wefts[0], &wefts[1]);
    let h1 = lab.host(1);
    assert_eq!(metric(w1, GAUGE), 1.0, "GSO is in use at start");
    assert_eq!((metric(w1, FALLBACKS), metric(w1, REPROBES)), (0.0, 0.0));

    // The path to host 2 takes 1400 bytes: weft's 1500-byte VXLAN datagrams (TUN MTU 1450)
    // can no longer leave as GSO segments.
    run(&["ip", "-n", &h1, "route", "add", "192.0.2.2/32", "dev", "eth0", "mtu", "1400"]);
    let server = Iperf3Server::start(&pods[1].ns);
    wait_listening(&pods[1].ns);
    let mut stream = Stream::start(&pods[0].ns, pods[1].ip, 60);

    // GSO fails, is turned off on that socket, and the stream goes on without it.
    w1.wait_metric(FALLBACKS, Duration::from_secs(10), |v| v >= 1.0);
    w1.wait_metric(GAUGE, Duration::from_secs(2), |v| v == 0.0);
    w1.wait_log("UDP GSO send from 192.0.2.1:", Duration::from_secs(2));
    assert!(w1.log().contains("to 192.0.2.2:8472 failed"), "{}", w1.log_tail(20));
    let bytes = delivered(w2, Duration::from_secs(1));
    assert!(bytes > 1e6, "only {bytes} bytes crossed in a second with GSO off");
    println!("with GSO off: {:.0} Mb/s delivered to host 2's pods", bytes * 8.0 / 1e6);
    assert!(stream.running(), "iperf3 ended early");

    // The path takes GSO again: within the retry time the socket tries it, and it works.
    run(&["ip", "-n", &h1, "route", "del", "192.0.2.2/32"]);
    let fixed = Instant::now();
    // At most 2 s after the first failure, or 4 s after a failed retry, or 8 s after two.
    w1.wait_log("UDP GSO works again on 192.0.2.1:", Duration::from_secs(20));
    let took = fixed.elapsed();
    w1.wait_metric(GAUGE, Duration::from_secs(2), |v| v == 1.0);
    assert!(metric(w1, REPROBES) >= 1.0);
    assert!(stream.running(), "iperf3 ended early");
    println!("GSO on again {took:?} after the path MTU was restored");
    drop(stream);

    // GSO stays on under new traffic: nothing fails any more.
    let fallbacks = metric(w1, FALLBACKS);
    drop(server);
    let _server = Iperf3Server::start(&pods[1].ns);
    let bps = iperf3_bps(&pods[0].ns, pods[1].ip, 2);
    assert!(bps > 10e6, "iperf3 after recovery: {bps} b/s");
    println!("with GSO on again: iperf3 {:.0} Mb/s", bps / 1e6);
    assert_eq!(metric(w1, FALLBACKS), fallbacks, "a GSO send failed after recovery");
    assert_eq!(metric(w1, GAUGE), 1.0);
    let log = w1.log();
    for line in log.lines().filter(|l| l.contains("GSO")) {
        println!("{line}");
    }
    let warns =
        log.matches("UDP GSO send from").count() + log.matches("UDP GSO still fails").count();
    assert_eq!(warns as f64, fallbacks, "one WARN per turn-off:\n{}", w1.log_tail(30));
    assert_eq!(log.matches("UDP GSO works again").count(), 1, "{}", w1.log_tail(30));
}

#[cfg(feature = "fault-injection")]
const PADS: &str = "weft_dataplane_gso_tail_pads_total";
#[cfg(feature = "fault-injection")]
const EQUAL_TAILS: &str = "weft_dataplane_gso_equal_tails_total";

#[cfg(feature = "fault-injection")]
/// `iperf3 --bidir` for `secs` from `client_ns` to `server_ip` (a server must listen there):
/// the bits per second received each way, client to server first.
fn iperf3_bidir(client_ns: &str, server_ip: Ipv4Addr, secs: u32) -> (f64, f64) {
    let (ip, t) = (server_ip.to_string(), secs.to_string());
    for _ in 0..20 {
        let out = ns_output(
            client_ns,
            &["iperf3", "-c", &ip, "-t", &t, "-J", "--bidir", "--connect-timeout", "3000"],
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let end = &json["end"];
        if let (Some(up), Some(down)) = (
            end["sum_received"]["bits_per_second"].as_f64(),
            end["sum_received_bidir_reverse"]["bits_per_second"].as_f64(),
        ) {
            return (up, down);
        }
        // The server may not listen yet.
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("iperf3 --bidir {client_ns} -> {server_ip} did not run");
}

#[cfg(feature = "fault-injection")]
/// The kernel's UDP error counters in `ns` (`/proc/net/snmp`): `InErrors` and `InCsumErrors`.
fn udp_errors(ns: &str) -> (u64, u64) {
    let snmp =
        String::from_utf8_lossy(&ns_output(ns, &["cat", "/proc/net/snmp"]).stdout).into_owned();
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let (names, values) = (udp.next().expect("Udp names"), udp.next().expect("Udp values"));
    let field = |name: &str| {
        let at = names.split_whitespace().position(|n| n == name).expect(name);
        values.split_whitespace().nth(at).and_then(|v| v.parse().ok()).expect(name)
    };
    (field("InErrors"), field("InCsumErrors"))
}

#[cfg(feature = "fault-injection")]
/// A device's receive errors and drops (`ip -s -j link`).
fn rx_errors_and_drops(ns: &str, dev: &str) -> (u64, u64) {
    let out = ns_output(ns, &["ip", "-s", "-j", "link", "show", dev]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j");
    let rx = &json[0]["stats64"]["rx"];
    (rx["errors"].as_u64().expect("rx errors"), rx["dropped"].as_u64().expect("rx dropped"))
}

/// On a kernel with the v7.0–v7.1.4 UDP GSO bug (made believed with the `fault-injection`
/// feature's `WEFT_FAULT_KERNEL_RELEASE`), weft keeps UDP GSO on with the equal-tail
/// workaround and says so in one WARN naming the kernel, the bug and what it did: while bulk
/// TCP flows both ways, none of host 1's GSO messages ends on a full segment (each that would
/// ends on the 18-byte pad instead: counted), host 2 drops the pads as `gso_tail_pad` and
/// nothing as malformed, and a kernel flannel peer (flannel.1) takes the same traffic with no
/// UDP or device error. The operator's `--udp-gso on` (host 2: a kernel with the fix
/// backported) keeps GSO without the workaround: its messages do end on full segments,
/// which shows the counter counts.
#[cfg(feature = "fault-injection")]
#[test]
fn on_a_kernel_with_the_udp_gso_bug_no_gso_message_ends_on_a_full_segment() {
    let lab = Lab::new(VXLAN);
    let env = [("WEFT_FAULT_KERNEL_RELEASE", "7.1.3-generic")];
    let mut w1 = lab.start_weft_with_env(1, &[], &env);
    let mut w2 = lab.start_weft_with_env(2, &["--udp-gso", "on"], &env);
    w1.wait_ready(Duration::from_secs(20));
    w2.wait_ready(Duration::from_secs(20));
    let (p1, p2) = (lab.pod(1, &w1.subnet_file()), lab.pod(2, &w2.subnet_file()));
    // A kernel flannel node, programmed for both weft hosts as flannel would.
    let k9 = KernelFlannelPeer::new(&lab, 9, "10.244.200.0/24", None);
    for w in [&w1, &w2] {
        k9.program(&lab.vxlan_lease(&w.subnet().expect("subnet")));
    }
    let pod9 = k9.pod(&lab, 1450);
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 2.0);
    }
    let workaround =
        r#"weft_dataplane_offload_enabled{offload="udp_gso",reason="udp_gso_mangled_v7_0"}"#;
    assert_eq!(w1.metric(workaround), Some(1.0), "{:?}", w1.get("/metrics"));
    assert_eq!(w1.metric(GAUGE), Some(1.0), "host 1's sockets do not use GSO");
    let on = r#"weft_dataplane_offload_enabled{offload="udp_gso",reason="flag"}"#;
    assert_eq!(w2.metric(on), Some(1.0));
    assert_eq!(w2.metric(GAUGE), Some(1.0), "host 2's sockets do not use GSO");
    let log1 = w1.log();
    assert_eq!(log1.matches("has a known bug").count(), 1, "{}", w1.log_tail(20));
    assert!(log1.contains("kernel 7.1.3-generic"), "{}", w1.log_tail(20));
    assert!(log1.contains("kept udp_gso on with a workaround"), "{}", w1.log_tail(20));
    assert!(log1.contains("--udp-gso off") && log1.contains("--udp-gso on"));
    assert!(w2.log().contains("--udp-gso on keeps udp_gso on"), "{}", w2.log_tail(20));

    // Bulk TCP both ways between the weft pods.
    let server2 = Iperf3Server::start(&p2.ns);
    wait_listening(&p2.ns);
    let (up, down) = iperf3_bidir(&p1.ns, p2.ip, 2);
    drop(server2);
    eprintln!(
        "iperf3 --bidir: host 1 (workaround) -> 2: {:.2} Gb/s; host 2 (--udp-gso on) -> 1: \
         {:.2} Gb/s",
        up / 1e9,
        down / 1e9
    );
    assert!(up > 50e6 && down > 50e6, "{up} / {down} b/s");
    let (pads1, equal1) = (metric(&w1, PADS), metric(&w1, EQUAL_TAILS));
    let (pads2, equal2) = (metric(&w2, PADS), metric(&w2, EQUAL_TAILS));
    eprintln!(
        "host 1: {pads1} pads, {equal1} equal tails; host 2: {pads2} pads, {equal2} equal tails"
    );
    assert!(pads1 > 0.0, "host 1 sent no pad");
    assert_eq!(equal1, 0.0, "a GSO message of host 1 ended on a full segment");
    assert!(equal2 > 0.0, "host 2 (no workaround) never ended a GSO message on a full segment");
    assert_eq!(pads2, 0.0);
    // Read in this order, every pad host 2 saw was sent before host 1 is asked.
    let seen = w2.rx_drops("gso_tail_pad");
    let sent = metric(&w1, PADS);
    eprintln!("host 2 dropped {seen} pads as gso_tail_pad; host 1 sent {sent}");
    assert!(seen > 0.0 && seen <= sent, "host 2 saw {seen} of host 1's {sent} pads");
    for reason in ["malformed", "bad_vxlan_flags"] {
        assert_eq!((w1.rx_drops(reason), w2.rx_drops(reason)), (0.0, 0.0), "{reason}");
    }

    // The kernel peer takes host 1's padded traffic: no UDP error, no device error or drop.
    let (udp_before, dev_before) = (udp_errors(&k9.ns), rx_errors_and_drops(&k9.ns, "flannel.1"));
    let _server9 = Iperf3Server::start(&pod9.ns);
    wait_listening(&pod9.ns);
    let to_kernel = iperf3_bps(&p1.ns, pod9.ip, 2);
    eprintln!("iperf3 host 1 (workaround) -> kernel flannel.1: {:.2} Gb/s", to_kernel / 1e9);
    assert!(to_kernel > 50e6, "{to_kernel} b/s");
    assert!(metric(&w1, PADS) > pads1, "no pad went to the kernel peer");
    assert_eq!(metric(&w1, EQUAL_TAILS), 0.0);
    assert_eq!(udp_errors(&k9.ns), udp_before, "UDP InErrors/InCsumErrors on the kernel peer");
    assert_eq!(rx_errors_and_drops(&k9.ns, "flannel.1"), dev_before, "flannel.1 rx errors/drops");
}
