//! End to end in network namespaces: a data plane worker thread that panics is never a silent
//! black hole. weft restarts it (traffic resumes, the panic is logged and counted), and one
//! that keeps panicking makes weft say so on `/readyz` and exit non-zero, keeping its lease for
//! the process its supervisor starts next.
//!
//! The panics are injected with the `fault-injection` feature's hook (`WEFT_FAULT_PANIC_THREAD`,
//! see `src/dataplane/worker/supervise.rs`), so this file builds only with that feature
//! (`required-features` in Cargo.toml; `scripts/test.sh` passes it). Needs root, like e2e.rs.

mod support;

use std::time::{Duration, Instant};

use support::netns::{Lab, Pod, Weft, finish_ping, ping_ok, spawn_ping};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(20);

/// Host 1 with the fault hook set by `env`, host 2 plain; both ready, a pod behind each, and
/// each routing to the other.
fn up_with_faulty_host1(lab: &Lab, env: &[(&str, &str)]) -> (Vec<Weft>, Vec<Pod>) {
    let mut wefts = vec![lab.start_weft_with_env(1, &[], env), lab.start_weft(2, &[])];
    for w in &mut wefts {
        w.wait_ready(READY);
    }
    let pods = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    (wefts, pods)
}

/// The sum of a labelled metric over all its label sets.
fn metric_sum(w: &Weft, name: &str) -> f64 {
    let (_, body) = w.get("/metrics");
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[test]
fn a_worker_thread_that_panics_once_is_restarted_and_traffic_resumes() {
    let lab = Lab::new(VXLAN);
    let (wefts, pods) = up_with_faulty_host1(
        &lab,
        &[("WEFT_FAULT_PANIC_THREAD", "weft-q"), ("WEFT_FAULT_PANIC_TIMES", "1")],
    );
    // The first batch host 1 forwards panics its worker; the pings go on through the restart.
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 40, 0.1);
    let r = finish_ping(ping);
    eprintln!("ping across a worker panic: {}/{} replies", r.received, r.transmitted);
    assert!(
        r.transmitted == 40 && r.received + 3 >= r.transmitted,
        "traffic did not resume after the worker panicked:\n{}",
        r.text
    );
    let log = wefts[0].log();
    assert_eq!(
        log.matches("data plane thread panicked: restarting it").count(),
        1,
        "the panic was not logged once:\n{}",
        wefts[0].log_tail(30)
    );
    assert!(log.contains("injected fault"), "the log does not name the panic");
    assert!(log.contains("data plane thread restarted"), "{}", wefts[0].log_tail(30));
    assert_eq!(metric_sum(&wefts[0], "weft_dataplane_worker_panics_total"), 1.0);
    let (_, metrics) = wefts[0].get("/metrics");
    assert!(
        metrics
            .lines()
            .filter(|l| l.starts_with("weft_dataplane_worker_up{"))
            .all(|l| l.ends_with(" 1")),
        "a worker is still down:\n{metrics}"
    );
    assert_eq!(wefts[0].get("/readyz").0, 200);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
}

#[test]
fn a_worker_thread_that_keeps_panicking_is_named_on_readyz_then_weft_exits_non_zero() {
    let lab = Lab::new(VXLAN);
    let (mut wefts, pods) = up_with_faulty_host1(
        &lab,
        &[("WEFT_FAULT_PANIC_THREAD", "weft-q"), ("WEFT_FAULT_PANIC_TIMES", "1000000")],
    );
    let subnet = wefts[0].subnet().expect("host 1's subnet");
    let ping = spawn_ping(&pods[0].ns, pods[1].ip, 100, 0.05);
    // While it backs off between restarts, /readyz is 503 and names the thread.
    let t0 = Instant::now();
    let mut named_down = None;
    while wefts[0].running() && t0.elapsed() < Duration::from_secs(30) {
        let (status, body) = wefts[0].get("/readyz");
        if status == 503 && body.contains("data plane worker down: weft-q") {
            named_down.get_or_insert(body);
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    let _ = finish_ping(ping);
    let body = named_down.expect("/readyz never said which worker was down");
    eprintln!("/readyz while the worker was down: {body}");
    assert!(body.contains("injected fault"), "{body}");
    assert!(!wefts[0].running(), "weft still runs 30 s after its worker kept panicking");
    let code = wefts[0].stop();
    assert!(matches!(code, Some(c) if c != 0), "weft exited with {code:?}, not non-zero");
    let log = wefts[0].log();
    assert!(log.contains("panicked too often: giving up"), "{}", wefts[0].log_tail(30));
    // Five restarts of one thread, then the sixth panic in a minute gives up (both workers'
    // threads panic here, so there may be a few more restarts of the other one).
    assert!(log.matches("data plane thread panicked: restarting it").count() >= 5);

    // Its supervisor starts it again (here: without the fault): it adopts the same subnet.
    wefts[0].env.clear();
    wefts[0].start();
    assert_eq!(wefts[0].wait_ready(READY), subnet, "the restarted weft took another subnet");
    wefts[1].wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    ping_ok(&pods[0].ns, pods[1].ip, 3);
}
