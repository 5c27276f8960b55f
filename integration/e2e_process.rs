//! End to end in network namespaces: the process's own edges. A log reader that goes away
//! neither kills weft nor makes it deaf to SIGTERM (with etcd answering or not), a task
//! that panics stops weft cleanly and non-zero instead of leaving it half alive, and a
//! flanneld unit's command line starts weft with the binary's name changed.
//!
//! The panic is injected with the `fault-injection` feature's task hook
//! (`WEFT_FAULT_PANIC_TASK`, see `src/panics.rs`), so this file builds only with that feature
//! (`required-features` in Cargo.toml; `scripts/test.sh` passes it). Needs root, like e2e.rs.

mod support;

use std::time::{Duration, Instant};

use support::netns::{Lab, Pod, Stderr, Weft, finish_ping, in_netns, spawn_ping};
use support::process::Daemon;
use support::weft::http_get;

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

/// flanneld's unit in Fedora's `flannel` package (`/usr/lib/systemd/system/flanneld.service`),
/// as shipped, and its `/etc/sysconfig/flanneld` filled in for the lab.
const FLANNELD_SERVICE: &str = "\
[Unit]
Description=Flanneld overlay address etcd agent
After=network.target
Before=docker.service

[Service]
Type=notify
EnvironmentFile=/etc/sysconfig/flanneld
EnvironmentFile=-/etc/sysconfig/docker-network
ExecStart=/usr/bin/flanneld -etcd-endpoints=${FLANNEL_ETCD} -etcd-prefix=${FLANNEL_ETCD_KEY} $FLANNEL_OPTIONS

[Install]
RequiredBy=docker.service
";

/// The ExecStart line's words as systemd expands them with `env`: `${NAME}` in place, a
/// word that is `$NAME` alone split at whitespace (the unit has no quotes).
fn expand_exec_start(unit: &str, env: &[(&str, String)]) -> Vec<String> {
    let line = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart=");
    let value = |name: &str| {
        env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone()).unwrap_or_default()
    };
    let mut words = Vec::new();
    for word in line.split_whitespace() {
        if let Some(name) = word.strip_prefix('$').filter(|n| !n.starts_with('{')) {
            words.extend(value(name).split_whitespace().map(str::to_owned));
            continue;
        }
        let mut out = word.to_owned();
        while let Some(start) = out.find("${") {
            let end = out[start..].find('}').expect("a closing brace") + start;
            let name = out[start + 2..end].to_owned();
            out.replace_range(start..=end, &value(&name));
        }
        words.push(out);
    }
    words
}

/// A flanneld unit's ExecStart line, its first word changed to weft: weft tries the `-iface`
/// candidates in order (the first is absent), leases a subnet of the lab's network, writes
/// `subnet.env` where `-subnet-file` says, serves health where `-healthz-*` say, logs its debug
/// lines for `-v=1`, takes `-iptables-resync` as its own (with `-ip-masq=false` no nftables
/// table is made); SIGTERM ends it with 0.
#[test]
fn a_flanneld_unit_exec_start_line_runs_weft_with_the_binary_renamed() {
    let lab = Lab::new(VXLAN);
    let host = lab.host(1);
    let dir = lab.dir().join("flanneld-unit");
    std::fs::create_dir_all(&dir).expect("dir");
    let subnet_file = dir.join("subnet.env");
    let env = [
        ("FLANNEL_ETCD", "http://192.0.2.254:2379".to_owned()),
        ("FLANNEL_ETCD_KEY", "/coreos.com/network".to_owned()),
        (
            "FLANNEL_OPTIONS",
            format!(
                "-iface=bond0 -iface=eth0 -subnet-file={} -healthz-ip=127.0.0.1 \
                 -healthz-port=9797 -v=1 -ip-masq=false -iptables-resync=5",
                subnet_file.display()
            ),
        ),
    ];
    let mut argv = expand_exec_start(FLANNELD_SERVICE, &env);
    assert_eq!(argv[0], "/usr/bin/flanneld");
    argv[0] = env!("CARGO_BIN_EXE_weft").to_owned();
    let log_path = dir.join("weft.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", &host])
        .args(&argv)
        // What /etc/default/weft would say: where weft keeps its state.
        .env("WEFT_STATE_DIR", dir.join("state"))
        .env_remove("WEFT_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    let mut weft = Daemon::default();
    weft.start(&mut cmd);
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = Instant::now() + READY;
    let subnet = loop {
        let ready = in_netns(&host, || {
            http_get(std::net::SocketAddr::from(([127, 0, 0, 1], 9797)), "/readyz").0
        });
        let env = std::fs::read_to_string(&subnet_file).unwrap_or_default();
        if ready == 200
            && let Some(s) = env.lines().find_map(|l| l.strip_prefix("FLANNEL_SUBNET="))
        {
            break s.to_owned();
        }
        assert!(weft.running() && Instant::now() < deadline, "not ready:\n{}", read_log());
        std::thread::sleep(Duration::from_millis(50));
    };
    let (ip, len) = subnet.split_once('/').expect("CIDR");
    let ip: std::net::Ipv4Addr = ip.parse().expect("address");
    let leased = format!("{}/{len}", std::net::Ipv4Addr::from(u32::from(ip) - 1));
    let lease = lab.lease_value(&leased).unwrap_or_else(|| panic!("no lease {leased}"));
    assert_eq!(lease["PublicIP"], "192.0.2.1", "eth0's address: {lease}");
    let text = read_log();
    assert!(!text.contains("is ignored"), "{text}");
    let tables = lab.exec(&host, &["nft", "list", "tables"]);
    assert_eq!(String::from_utf8_lossy(&tables.stdout), "", "no table without -ip-masq");
    assert!(text.contains(" DEBUG "), "-v=1 shows no debug lines:\n{text}");
    assert_eq!(weft.stop(read_log), Some(0));
}
