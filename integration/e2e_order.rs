//! End to end in network namespaces: a flow keeps to one forwarding thread on both hosts, so
//! weft never reorders it. Two `weft run` processes with two workers each (two TUN queues, two
//! receiving sockets sharing the port), eight TCP streams from a pod behind one to a pod
//! behind the other, and `weft_dataplane_flow_moves_total` read on both (docs/dataplane.md,
//! "Flow order").
//!
//! What it guards against: with a sending pool per worker, a flow that changed TUN queues
//! changed its outer source port, so the peer received it on another worker, whose writes
//! moved the reverse flow to another queue there, and so on: about half the flows moved
//! between workers for as long as they ran (thousands of moves in 3 s), each move letting a
//! batch overtake the one before it, and TCP retransmitted about 1 % of what it sent.
//!
//! Needs root and the tools in `support::netns::REQUIRED_TOOLS`. Each test builds its own lab
//! (namespaces `wt<4 hex>*`), removed on drop.

mod support;

use std::net::Ipv4Addr;

use support::netns::{Iperf3Server, Lab, Weft, ns_output};

const TX_MOVES: &str = r#"weft_dataplane_flow_moves_total{dir="tx"}"#;
const RX_MOVES: &str = r#"weft_dataplane_flow_moves_total{dir="rx"}"#;
/// TCP streams per run: each flow has an even chance to be caught moving without the fix, so
/// eight make a miss unlikely (1 in 256).
const STREAMS: u32 = 8;

/// `iperf3 -P STREAMS` for `secs` from `client_ns` to `server_ip`; the sender's retransmits.
fn streams_retransmits(client_ns: &str, server_ip: Ipv4Addr, secs: u32) -> u64 {
    let (ip, t, p) = (server_ip.to_string(), secs.to_string(), STREAMS.to_string());
    let args = ["iperf3", "-c", &ip, "-t", &t, "-P", &p, "-J", "--connect-timeout", "3000"];
    for _ in 0..50 {
        let out = ns_output(client_ns, &args);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(r) = json["end"]["sum_sent"]["retransmits"].as_u64() {
            let bps = json["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(0.0);
            assert!(bps > 10e6, "{STREAMS} streams carried {bps} b/s");
            return r;
        }
        // The server may not listen yet.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("iperf3 -P {STREAMS} {client_ns} -> {server_ip} did not run");
}

fn moves(w: &Weft) -> (f64, f64) {
    let read = |name| w.metric(name).unwrap_or_else(|| panic!("weft {}: no {name}", w.n));
    (read(TX_MOVES), read(RX_MOVES))
}

/// Each flow moves at most once on each host (a TCP flow's first packets are read from the
/// queue the kernel's hash picks, the rest from the queue its reverse flow is written on), not
/// back and forth as long as it runs.
fn each_flow_stays_on_one_worker(backend: &str) {
    let cfg =
        format!(r#"{{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{{"Type":"{backend}"}}}}"#);
    let lab = Lab::new(&cfg);
    let (wefts, pods) = lab.up(&[1, 2], &["--workers", "2"]);
    let before: Vec<_> = wefts.iter().map(moves).collect();
    let _server = Iperf3Server::start(&pods[1].ns);
    let retransmits = streams_retransmits(&pods[0].ns, pods[1].ip, 3);
    // The eight streams and iperf3's control connection, a move each on each host at most,
    // with as much again for slack (a flow's start can take two).
    let bound = 2.0 * f64::from(STREAMS + 1);
    for (w, (tx0, rx0)) in wefts.iter().zip(before) {
        let (tx, rx) = moves(w);
        println!("{backend} host {}: flow moves tx {} rx {}", w.n, tx - tx0, rx - rx0);
        assert!(
            tx - tx0 <= bound && rx - rx0 <= bound,
            "{backend} host {}: flows moved between workers {} times reading TUN and {} times \
             receiving, for {} flows (TCP retransmitted {retransmits} segments)",
            w.n,
            tx - tx0,
            rx - rx0,
            STREAMS + 1
        );
    }
    println!("{backend}: {STREAMS} streams retransmitted {retransmits} segments");
}

#[test]
fn vxlan_flows_stay_on_one_worker_each_way() {
    each_flow_stays_on_one_worker("vxlan");
}

#[test]
fn udp_flows_stay_on_one_worker_each_way() {
    each_flow_stays_on_one_worker("udp");
}
