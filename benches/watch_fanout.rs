//! etcd's watch fan-out alone, the floor under the 1,000-host join: N clients each
//! watch the subnets prefix, as N route watchers do, and one client puts N lease-sized keys,
//! one after another, as N joining hosts' creates would with no race lost, no listing and no
//! history. Prints the time until every watcher has every event and etcd's CPU seconds.
//! Not part of CI or test.sh.
//!
//! `cargo bench --bench watch_fanout -- [N] [members]` (default 1000 hosts, 1 member; 3 for a
//! cluster as `scripts/bench-leases.sh` runs). Run it with `TMPDIR=/dev/shm`, so that etcd's
//! data is on tmpfs as there, and with `ulimit -n` above N + 100.

#[path = "../integration/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, WatchOptions};

/// CPU seconds (user + system) the process `pid` has used.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The etcd processes this bench started (its children).
fn etcd_pids() -> Vec<i32> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1));
            stat.contains("(etcd)") && ppid == Some(me.as_str())
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let members: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let (_single, _cluster, endpoints) = if members == 1 {
        let s = support::etcd::EtcdServer::start();
        let e = vec![s.endpoint()];
        (Some(s), None, e)
    } else {
        let c = support::etcd::EtcdCluster::start_with_timing(Some((100, 1000)));
        let e = c.endpoints();
        (None, Some(c), e)
    };
    let pids = etcd_pids();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let done = Arc::new(AtomicUsize::new(0));
        let mut clients = Vec::new();
        for i in 0..n {
            // Each watcher on a connection of its own, spread over the members.
            let ep = endpoints[i % endpoints.len()].clone();
            let mut c = Client::connect([ep], None).await.expect("connect");
            let opts = WatchOptions::new().with_prefix();
            let mut stream = c.watch("/fanout/subnets/", Some(opts)).await.expect("watch");
            let done = done.clone();
            tokio::spawn(async move {
                let mut seen = 0;
                while let Ok(Some(resp)) = stream.message().await {
                    seen += resp.events().len();
                    if seen >= n {
                        done.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            });
            clients.push(c);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cpu_before: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
        let start = Instant::now();
        let mut writer = Client::connect(endpoints.clone(), None).await.expect("connect");
        // About a flannel lease's size.
        let value = "x".repeat(250);
        for i in 0..n {
            let key = format!("/fanout/subnets/10.{}.{}.0-24", i / 256, i % 256);
            writer.put(key, value.clone(), None).await.expect("put");
        }
        let puts = start.elapsed();
        while done.load(Ordering::Relaxed) < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let all = start.elapsed();
        let cpu: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>() - cpu_before;
        println!(
            "watch fan-out: {n} watchers, {n} puts, {members} member(s): puts done {:.2} s, every watcher has every event {:.2} s, etcd CPU {cpu:.1} s for {} events",
            puts.as_secs_f64(),
            all.as_secs_f64(),
            n * n
        );
    });
}
