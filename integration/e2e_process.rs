//! End to end in network namespaces: the process's own edges. A log reader that goes away
//! neither kills weft nor makes it deaf to SIGTERM (with etcd answering or not), and a task
//! that panics stops weft cleanly and non-zero instead of leaving it half alive.
//!
//! The panic is injected with the `fault-injection` feature's task hook
//! (`WEFT_FAULT_PANIC_TASK`, see `src/panics.rs`), so this file builds only with that feature
//! (`required-features` in Cargo.toml; `scripts/test.sh` passes it). Needs root, like e2e.rs.

mod support;

use std::time::{Duration, Instant};

use support::netns::{Lab, Pod, Stderr, Weft, finish_ping, spawn_ping};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(20);

/// SIGTERM, and the exit code if weft exits within `within`.
fn stop_within(w: &mut Weft, within: Duration) -> Option<i32> {
    let t0 = Instant::now();
    let code = w.stop();
    let took = t0.elapsed();
    eprintln!("host {} stopped in {took:?} with {code:?}", w.n);
    assert!(took <= within, "host {} took {took:?} to stop after SIGTERM", w.n);
    code
}

/// Pings pod 0 -> pod 1 for `secs` (10 a second) while checking each host's `/readyz`: 200
/// for the first `ready_secs`; asserts no loss.
fn traffic_while_ready(wefts: &[Weft], pods: &[Pod], secs: u32, ready_secs: u32) {
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, secs * 10, 0.1);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs.into()) {
        if t0.elapsed() < Duration::from_secs(ready_secs.into()) {
            for w in wefts {
                let (status, body) = w.get("/readyz");
                assert_eq!(status, 200, "host {} not ready: {body}", w.n);
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let r = finish_ping(ping);
    eprintln!("{}/{} replies", r.received, r.transmitted);
    assert!(
        r.transmitted == secs * 10 && r.received == r.transmitted,
        "traffic was lost:\n{}",
        r.text
    );
}

fn dropped_lines(w: &Weft) -> f64 {
    w.metric("weft_log_lines_dropped_total").expect("weft_log_lines_dropped_total")
}

/// Both hosts log to a pipe whose reader takes 200 bytes and exits. They go on holding their
/// leases and forwarding, count what they could not log, and stop at once on SIGTERM with
/// exit 0: first with etcd answering, then with etcd not answering (SIGSTOPped; ready then only
/// until the hosts' identities can no longer be confirmed).
#[test]
fn a_log_reader_that_goes_away_neither_kills_weft_nor_makes_it_deaf() {
    let lab = Lab::new(VXLAN);
    let mut wefts: Vec<Weft> = (1..=2)
        .map(|n| {
            let mut w = lab.unstarted_weft(n, &[]);
            w.stderr = Stderr::ReaderGoneAfter(200);
            // Long enough to stay ready through the outage below.
            w.ttl = "60s".into();
            w.start();
            w
        })
        .collect();
    for w in &mut wefts {
        w.wait_ready(READY);
    }
    let pods: Vec<Pod> = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    let before: Vec<f64> = wefts.iter().map(dropped_lines).collect();
    assert!(before.iter().all(|d| *d > 0.0), "nothing was dropped yet: {before:?}");

    // etcd answering: 30 s of traffic, ready throughout, lines dropped and counted.
    traffic_while_ready(&wefts, &pods, 30, 30);
    let after: Vec<f64> = wefts.iter().map(dropped_lines).collect();
    eprintln!("log lines dropped: {before:?} -> {after:?}");
    assert!(after.iter().zip(&before).all(|(a, b)| a > b), "{before:?} -> {after:?}");

    // etcd not answering: the same, then SIGTERM ends host 1 within 2 s, exit 0. Ready for as
    // long as each host's identity is still confirmed (its presence TTL, 10 s, from its last
    // keep-alive), then not ready, saying so; traffic goes on regardless.
    lab.pause_etcd(true);
    let before = after;
    traffic_while_ready(&wefts, &pods, 15, 5);
    for w in &wefts {
        let (status, body) = w.get("/readyz");
        assert_eq!(status, 503, "host {}: {body}", w.n);
        assert!(body.contains("identity is not confirmed"), "host {}: {body}", w.n);
    }
    let after: Vec<f64> = wefts.iter().map(dropped_lines).collect();
    eprintln!("log lines dropped while etcd is away: {before:?} -> {after:?}");
    assert!(after.iter().zip(&before).all(|(a, b)| a > b), "{before:?} -> {after:?}");
    assert_eq!(stop_within(&mut wefts[0], Duration::from_secs(2)), Some(0));

    // etcd answering again: SIGTERM ends host 2 within 2 s, exit 0.
    lab.pause_etcd(false);
    assert_eq!(stop_within(&mut wefts[1], Duration::from_secs(2)), Some(0));
}

/// A task that panics (the route watcher, here) stops weft as SIGTERM would — the data plane
/// stopped, the lease relinquished as `--relinquish-on-exit` asks — and weft exits non-zero,
/// within seconds.
#[test]
fn a_task_that_panics_stops_weft_cleanly_and_non_zero() {
    let lab = Lab::new(VXLAN);
    let trigger = lab.dir().join("panic-now");
    let mut w = lab.start_weft_with_env(
        1,
        &["--relinquish-on-exit"],
        &[
            ("WEFT_FAULT_PANIC_TASK", "route-watcher"),
            ("WEFT_FAULT_PANIC_ONCE_FILE", trigger.to_str().expect("path")),
        ],
    );
    let subnet = w.wait_ready(READY);
    assert!(lab.lease_value(&subnet).is_some(), "no lease for {subnet}");
    // The route watcher panics at the next batch it reads: a key put under subnets/.
    std::fs::write(&trigger, b"").expect("trigger");
    lab.etcdctl(&["put", "/coreos.com/network/subnets/10.9.9.0-24", "{}"]);
    let t0 = Instant::now();
    while w.running() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!w.running(), "weft still runs 10 s after a task panicked:\n{}", w.log_tail(30));
    let code = w.stop();
    assert!(matches!(code, Some(c) if c != 0), "weft exited with {code:?}, not non-zero");
    let log = w.log();
    assert!(log.contains("a task panicked"), "{}", w.log_tail(30));
    assert!(log.contains("injected fault in task route-watcher"), "{}", w.log_tail(30));
    assert!(log.contains("shutting down the lease keeper"), "{}", w.log_tail(30));
    assert!(
        lab.lease_value(&subnet).is_none(),
        "the lease on {subnet} was not relinquished:\n{}",
        w.log_tail(30)
    );
}
