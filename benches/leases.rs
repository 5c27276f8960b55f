//! "1,000 hosts on one etcd cluster": a benchmark, not a test. Run it with
//! `scripts/bench-leases.sh [N]`; `cargo bench` skips it unless given `--hosts`.
//!
//! The coordinator (this binary without `--worker`) starts a real 3-member etcd on loopback
//! (integration/support/etcd.rs, raft heartbeat/election 100/1000 ms, etcd's defaults, data dirs under
//! `$TMPDIR`, which scripts/bench-leases.sh points at tmpfs: see there),
//! writes the network config (10.244.0.0/16, SubnetLen 28: 4,094 leasable subnets) and
//! re-executes itself as worker processes, each running its share of hosts: per host weft's own
//! [`LeaseDriver`] + [`Keeper`] on its own [`EtcdStore`] client, and a route watcher on the same
//! client; no TUN device, nothing is sent. Public IPs come from 198.18.0.0/15 (RFC 2544).
//! Host state dirs and subnet.env files live on tmpfs (`/dev/shm`), so the bench's disk is
//! etcd's alone. Workers report JSON lines on stdout; their logs (WARN and up) go to
//! `<bench dir>/worker-<n>.log`.
//!
//! Phases: join (all at once), renew (2 TTLs), suspend (SIGSTOP one worker past the TTL, then
//! SIGCONT), churn (SIGTERM one worker, its hosts relinquishing, while a new worker joins).
//!
//! `--policy flannel` (default `weft`) runs flanneld's lease logic instead of weft's driver and
//! keeper in every host (see [`flanneld`]: acquire by public IP or create-if-absent, renew by
//! an unconditional put on a fresh etcd lease, exit on a lost create race or on its own key's
//! delete, restarted by a supervisor after 1 s), for a side-by-side row. Everything else is the
//! same in both modes: the store client per host, weft's route watcher per host, the phases and
//! the measurements. In the churn phase flanneld's SIGTERMed hosts release nothing: their keys
//! just expire.
//!
//! Store calls are counted per worker, the lease drivers' and the route watchers' apart: every
//! phase reports the drivers' listings and creates, and the watchers' listings (the first one
//! of each and re-lists).
//!
//! Propagation latency: every create or relinquish is stamped (CLOCK_MONOTONIC) by the worker
//! whose store call committed it, when the call returns; each worker polls its hosts' published
//! route tables every 5 ms and reports when all of them have the route (or no longer have it);
//! the latency is the last worker's report minus the stamp.

#[path = "../integration/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::watch;

use weft::config::NetworkConfig;
use weft::lease::driver::{DriverConfig, LeaseDriver};
use weft::lease::etcd::{EtcdOptions, EtcdStore};
use weft::lease::keeper::{Keeper, KeeperConfig};
use weft::lease::record::{
    Incarnation, LeaseAttrs, LeaseName, NodeId, Revision, StoreLeaseId, StoredLease, Subnet,
};
use weft::lease::status::LeaseHealth;
use weft::lease::store::{
    CreateOutcome, HeldLease, LeaseFeed, Listing, PresenceOutcome, PresenceRecord, ReleaseOutcome,
    RenewOutcome, Store, StoreError, WatchEvent, WatchStream,
};
use weft::route::{RouteStats, RouteTable, Routes};
use weft::time::{BootClock, Clock, Instant};

const NETWORK_JSON: &str =
    r#"{"Network":"10.244.0.0/16","SubnetLen":28,"Backend":{"Type":"vxlan","VNI":1}}"#;
const PREFIX: &str = "/coreos.com/network";
const POLL: Duration = Duration::from_millis(10);
/// The deadline of every single etcd call (weft's daemon default).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// CLOCK_MONOTONIC in nanoseconds: system-wide, so workers' stamps compare.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn emit(v: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn host_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + 1 + i)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
    };
    let policy = match get("--policy").unwrap_or("weft") {
        "weft" => Policy::Weft,
        "flannel" => Policy::Flannel,
        other => {
            eprintln!("leases: --policy is weft or flannel, not {other:?}");
            std::process::exit(2);
        }
    };
    if args.iter().any(|a| a == "--floor-worker") {
        let endpoints: Vec<String> =
            get("--endpoints").expect("--endpoints").split(',').map(String::from).collect();
        let first: u32 = get("--first").expect("--first").parse().expect("--first");
        let count: u32 = get("--count").expect("--count").parse().expect("--count");
        let total: u32 = get("--hosts").expect("--hosts").parse().expect("--hosts");
        let ttl: u64 = get("--ttl").expect("--ttl").parse().expect("--ttl");
        floor_worker(endpoints, first, count, total, ttl);
        return;
    }
    if args.iter().any(|a| a == "--worker") {
        let endpoints: Vec<String> =
            get("--endpoints").expect("--endpoints").split(',').map(String::from).collect();
        let first: u32 = get("--first").expect("--first").parse().expect("--first");
        let count: u32 = get("--count").expect("--count").parse().expect("--count");
        let ttl: u64 = get("--ttl").expect("--ttl").parse().expect("--ttl");
        let dir = PathBuf::from(get("--dir").expect("--dir"));
        worker(endpoints, first, count, Duration::from_secs(ttl), &dir, policy);
        return;
    }
    let Some(hosts) = get("--hosts") else {
        println!(
            "leases: the 1,000-host lease benchmark runs only with --hosts N (scripts/bench-leases.sh)"
        );
        return;
    };
    let hosts: u32 = hosts.parse().expect("--hosts N");
    let workers: u32 = get("--workers").map_or(10, |w| w.parse().expect("--workers N"));
    let ttl: u64 = get("--ttl").map_or(10, |t| t.parse().expect("--ttl SECONDS"));
    coordinator(hosts, workers, ttl, policy);
}

/// Which lease logic the hosts run (`--policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    /// weft's own [`LeaseDriver`] and [`Keeper`].
    Weft,
    /// flanneld's lease logic ([`flanneld`]).
    Flannel,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Weft => "weft",
            Policy::Flannel => "flannel",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------------------------

/// What a worker's hosts' store calls did, summed over the worker: one for the lease drivers'
/// calls, one for the route watchers'.
#[derive(Default)]
struct Calls {
    lists: AtomicU64,
    creates: AtomicU64,
    creates_lost: AtomicU64,
    renews: AtomicU64,
    renew_conflicts: AtomicU64,
    releases: AtomicU64,
    errors: AtomicU64,
}

/// A host's store as its lease driver or route watcher sees it: counts calls and stamps
/// committed creates and releases.
struct Counting {
    inner: Arc<dyn Store>,
    calls: Arc<Calls>,
    host: u32,
    ip: Ipv4Addr,
}

impl Counting {
    fn err<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if r.is_err() {
            self.calls.errors.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

#[async_trait::async_trait]
impl Store for Counting {
    async fn list_with_presence(&self) -> Result<Listing, StoreError> {
        self.calls.lists.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.list_with_presence().await;
        self.err(r)
    }
    async fn config(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.config().await
    }
    async fn set_config(&self, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set_config(value).await
    }
    async fn watch_config(&self) -> Result<weft::lease::store::ConfigWatchStream, StoreError> {
        self.inner.watch_config().await
    }
    async fn get(
        &self,
        subnet: Subnet,
    ) -> Result<Option<Result<StoredLease, weft::lease::store::BadEntry>>, StoreError> {
        self.inner.get(subnet).await
    }
    async fn create_pruning(
        &self,
        name: LeaseName,
        attrs: &LeaseAttrs,
        ttl: Duration,
        prune: &[weft::lease::store::HistoryPrune],
    ) -> Result<CreateOutcome, StoreError> {
        self.calls.creates.fetch_add(1, Ordering::Relaxed);
        let issued = mono_ns();
        let r = self.inner.create_pruning(name, attrs, ttl, prune).await;
        match &r {
            Ok(CreateOutcome::Created(_)) => emit(json!({
                "ev": "created", "h": self.host, "s": name.subnet.to_string(), "ip": self.ip.to_string(),
                "t_issue": issued, "t": mono_ns(),
            })),
            Ok(CreateOutcome::Exists(_)) => {
                self.calls.creates_lost.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
        self.err(r)
    }
    async fn renew(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
        ttl: Duration,
    ) -> Result<RenewOutcome, StoreError> {
        self.calls.renews.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.renew(held, attrs, ttl).await;
        if matches!(r, Ok(RenewOutcome::Changed(_) | RenewOutcome::Unreadable)) {
            self.calls.renew_conflicts.fetch_add(1, Ordering::Relaxed);
        }
        self.err(r)
    }
    async fn refresh(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
    ) -> Result<RenewOutcome, StoreError> {
        self.calls.renews.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.refresh(held, attrs).await;
        if matches!(r, Ok(RenewOutcome::Changed(_) | RenewOutcome::Unreadable)) {
            self.calls.renew_conflicts.fetch_add(1, Ordering::Relaxed);
        }
        self.err(r)
    }
    async fn release(&self, held: &HeldLease, node: &NodeId) -> Result<ReleaseOutcome, StoreError> {
        let issued = mono_ns();
        let r = self.inner.release(held, node).await;
        if matches!(r, Ok(ReleaseOutcome::Released)) {
            self.calls.releases.fetch_add(1, Ordering::Relaxed);
            emit(json!({
                "ev": "released", "h": self.host, "s": held.subnet.to_string(),
                "ip": self.ip.to_string(), "t_issue": issued, "t": mono_ns(),
            }));
        }
        self.err(r)
    }
    async fn revoke(&self, subnet: Subnet) -> Result<bool, StoreError> {
        self.inner.revoke(subnet).await
    }
    async fn claim_presence(
        &self,
        node: &NodeId,
        record: &PresenceRecord,
        ttl: Duration,
    ) -> Result<PresenceOutcome, StoreError> {
        let r = self.inner.claim_presence(node, record, ttl).await;
        self.err(r)
    }
    async fn keep_presence(
        &self,
        node: &NodeId,
        lease: StoreLeaseId,
        beat: bool,
    ) -> Result<bool, StoreError> {
        let r = self.inner.keep_presence(node, lease, beat).await;
        self.err(r)
    }
    async fn drop_presence(&self, node: &NodeId, lease: StoreLeaseId) -> Result<(), StoreError> {
        self.inner.drop_presence(node, lease).await
    }
    fn reconnect(&self) {
        self.inner.reconnect()
    }
}

#[async_trait::async_trait]
impl LeaseFeed for Counting {
    async fn list(&self) -> Result<Listing, StoreError> {
        self.calls.lists.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.list().await;
        self.err(r)
    }

    async fn watch(
        &self,
        from: Revision,
        only: Option<LeaseName>,
    ) -> Result<WatchStream, StoreError> {
        self.inner.watch(from, only).await
    }
}

struct Host {
    idx: u32,
    ip: Ipv4Addr,
    routes: Arc<Routes>,
    stats: Arc<RouteStats>,
    health: Arc<LeaseHealth>,
    subnet: watch::Receiver<Option<LeaseName>>,
    /// The last table looked at (kept, so that a new table is never mistaken for it).
    table: Arc<RouteTable>,
    /// Last reported (subnet, ready).
    reported: (Option<Subnet>, bool),
    /// The own subnet at the last tick.
    own: Option<Subnet>,
    /// Set after the worker was stopped: report the first time this host is ready again.
    await_rehold: bool,
    /// How many times this host's flanneld exited (weft's driver never does).
    exits: Arc<AtomicU64>,
    /// `exits` at the last tick.
    exits_seen: u64,
    /// Whether the worker was stopped and resumed: from then on an exit of flanneld asks for
    /// the rehold again (it is the restarted process whose lease counts).
    resumed: bool,
}

/// A route change some host of this worker saw, until every host has it.
struct Pending {
    seen: Vec<bool>,
    left: usize,
    /// Discovered this tick: look at every host once, not only those whose table changed.
    fresh: bool,
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn cpu_ticks(pid: &str) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // Fields after the command (which may hold spaces): state is field 3; utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

fn worker(
    endpoints: Vec<String>,
    first: u32,
    count: u32,
    ttl: Duration,
    dir: &Path,
    policy: Policy,
) {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("WEFT_LOG"))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let opts = EtcdOptions {
        endpoints: endpoints.clone(),
        prefix: PREFIX.into(),
        call_timeout: CALL_TIMEOUT,
        ..EtcdOptions::default()
    };
    let (stores, putters, network) = rt.block_on(async {
        let mut stores = Vec::new();
        let mut putters = Vec::new();
        for _ in 0..count {
            stores.push(EtcdStore::connect(opts.clone()).await.expect("etcd client"));
            if policy == Policy::Flannel {
                putters.push(flannel_client(&endpoints).await.expect("etcd client for puts"));
            }
        }
        let raw = stores[0].config().await.expect("read config").expect("config set");
        (stores, putters, NetworkConfig::parse(&raw).expect("valid config"))
    });
    emit(json!({"ev": "ready", "pid": std::process::id(), "rss_kb": rss_kb()}));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    rt.block_on(run_hosts(stores, putters, network, first, ttl, dir));
}

/// etcd's own floor under the join (the RATIO line), in one worker process: `count` plain etcd
/// clients (hosts `first..first + count` of `total`), each watching the subnets prefix and, on
/// "go" (a stdin line), creating one subnet key: a store lease of the TTL and a
/// create-if-absent transaction of a lease-sized value, as weft's create is, less its history
/// record. Each host has a subnet of its own (no race is lost), lists nothing and claims no
/// presence: the least work that leaves every host with a live key and every watcher with
/// every key. Reports `floor_done` when all of its watchers have seen all `total` keys; on
/// the next stdin line revokes its store leases (which deletes the keys) and exits.
fn floor_worker(endpoints: Vec<String>, first: u32, count: u32, total: u32, ttl: u64) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let network = NetworkConfig::parse(NETWORK_JSON.as_bytes()).expect("valid config");
    let subnets: Vec<Subnet> =
        network.subnets().skip(first as usize).take(count as usize).collect();
    let dir = format!("{PREFIX}/subnets/");
    rt.block_on(async {
        let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let mut clients = Vec::new();
        for _ in 0..count {
            let mut c = flannel_client(&endpoints).await.expect("etcd client");
            let opts = etcd_client::WatchOptions::new().with_prefix();
            let mut stream = c.watch(dir.clone(), Some(opts)).await.expect("watch");
            // The first reply says the watch is in place: only then is the host ready.
            let created = stream.message().await.expect("watch reply").expect("watch reply");
            assert!(created.created(), "the first watch reply creates the watch");
            let tx = seen_tx.clone();
            let total = total as usize;
            tokio::spawn(async move {
                let mut keys = HashSet::new();
                while let Ok(Some(resp)) = stream.message().await {
                    for ev in resp.events() {
                        if ev.event_type() == etcd_client::EventType::Put
                            && let Some(kv) = ev.kv()
                        {
                            keys.insert(kv.key().to_vec());
                        }
                    }
                    if keys.len() >= total {
                        let _ = tx.send(mono_ns());
                        break;
                    }
                }
            });
            clients.push(c);
        }
        drop(seen_tx);
        emit(json!({"ev": "ready", "pid": std::process::id(), "rss_kb": rss_kb()}));
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        let ttl_secs = i64::try_from(ttl).unwrap_or(i64::MAX).max(1);
        let mut creates = Vec::new();
        for (c, s) in clients.iter().cloned().zip(&subnets) {
            let key = subnet_key(*s);
            let mac = weft::dataplane::wire::ethernet::MacAddr([0x02, 0, 0, 0, 0, 1]);
            let value = weft::daemon::lease_attrs(&network, host_ip(0), None, mac, None).to_json();
            creates.push(tokio::spawn(async move {
                let mut c = c;
                loop {
                    let r = async {
                        let lease = etcd_call(c.lease_grant(ttl_secs, None)).await?;
                        let put = etcd_client::PutOptions::new().with_lease(lease.id());
                        let txn = etcd_client::Txn::new()
                            .when([etcd_client::Compare::version(
                                key.clone(),
                                etcd_client::CompareOp::Equal,
                                0,
                            )])
                            .and_then([etcd_client::TxnOp::put(
                                key.clone(),
                                value.clone(),
                                Some(put),
                            )]);
                        etcd_call(c.txn(txn)).await?;
                        Ok::<i64, StoreError>(lease.id())
                    }
                    .await;
                    match r {
                        Ok(lease) => return (c, lease),
                        Err(e) => eprintln!("floor: create of {key} failed, again: {e}"),
                    }
                }
            }));
        }
        let mut leases = Vec::new();
        for f in creates {
            leases.push(f.await.expect("create task"));
        }
        let mut last = 0;
        for _ in 0..count {
            last = last.max(seen_rx.recv().await.expect("every watcher reports"));
        }
        let cpu_s = cpu_ticks("self") as f64 / clk_tck();
        emit(json!({"ev": "floor_done", "t": last, "cpu_s": cpu_s}));
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        for (mut c, lease) in leases {
            let _ = etcd_call(c.lease_revoke(lease)).await;
        }
        emit(json!({"ev": "exit", "t": mono_ns()}));
    });
}

/// Runs this worker's hosts until SIGTERM: weft's driver per host, or flanneld's logic per host
/// when `putters` (one raw etcd client per host, for flannel's unconditional puts) is not
/// empty; weft's route watcher per host in both cases.
async fn run_hosts(
    stores: Vec<EtcdStore>,
    putters: Vec<etcd_client::Client>,
    network: NetworkConfig,
    first: u32,
    ttl: Duration,
    dir: &Path,
) {
    let clock: Arc<dyn Clock> = Arc::new(BootClock);
    let calls = Arc::new(Calls::default());
    let route_calls = Arc::new(Calls::default());
    let flannel_counts = Arc::new(FlannelCounts::default());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut hosts = Vec::new();
    let mut drivers = Vec::new();
    let mut putters = putters.into_iter();
    for (k, store) in stores.into_iter().enumerate() {
        let idx = first + k as u32;
        let ip = host_ip(idx);
        let etcd = store.clone();
        let raw: Arc<dyn Store> = Arc::new(store);
        let counting: Arc<dyn Store> =
            Arc::new(Counting { inner: raw.clone(), calls: calls.clone(), host: idx, ip });
        let node = NodeId::generate();
        let state_dir = dir.join(format!("h{idx}"));
        std::fs::create_dir_all(&state_dir).expect("host dir");
        let mac = weft::dataplane::wire::ethernet::MacAddr([
            0x02,
            0,
            (idx >> 16) as u8,
            (idx >> 8) as u8,
            idx as u8,
            1,
        ]);
        let attrs = weft::daemon::lease_attrs(&network, ip, None, mac, None);
        let health = Arc::new(LeaseHealth::new(clock.clone()));
        let (subnet_tx, subnet_rx) = watch::channel(None);
        let routes = Arc::new(Routes::new({
            let (net, len) = network.leased_network();
            RouteTable::build_in(net, len, [])
        }));
        let stats = Arc::new(RouteStats::default());
        let route_store: Arc<dyn Store> =
            Arc::new(Counting { inner: raw, calls: route_calls.clone(), host: idx, ip });
        tokio::spawn(weft::route::watcher::run(
            route_store,
            routes.clone(),
            network.clone(),
            subnet_rx.clone(),
            stats.clone(),
            std::time::Duration::from_secs(300),
            shutdown_rx.clone(),
        ));
        let exits = Arc::new(AtomicU64::new(0));
        let table = routes.load().clone();
        let host = Host {
            idx,
            ip,
            routes,
            stats,
            health: health.clone(),
            subnet: subnet_rx,
            table,
            reported: (None, false),
            own: None,
            await_rehold: false,
            exits: exits.clone(),
            exits_seen: 0,
            resumed: false,
        };
        if let Some(putter) = putters.next() {
            // flannel knows a host by its public IP: that is the identity the store check uses.
            emit(
                json!({"ev": "host_info", "h": idx, "node": ip.to_string(), "ip": ip.to_string()}),
            );
            let f = FlannelHost {
                idx,
                store: counting,
                etcd,
                putter,
                network: network.clone(),
                attrs,
                ttl,
                clock: clock.clone(),
                health,
                subnet_tx,
                calls: calls.clone(),
                counts: flannel_counts.clone(),
                exits,
            };
            drivers.push(tokio::spawn(flannel_supervisor(f, shutdown_rx.clone())));
            hosts.push(host);
            continue;
        }
        emit(json!({"ev": "host_info", "h": idx, "node": node.as_str(), "ip": ip.to_string()}));
        let (presence_ttl, retry_min, retry_max) = KeeperConfig::timings_for(ttl);
        let keeper = Keeper::new(
            KeeperConfig {
                network: network.clone(),
                attrs,
                node: node.clone(),
                incarnation: Incarnation::generate(),
                ttl,
                renew_margin: (ttl / 4).min(Duration::from_secs(3600)),
                presence_ttl,
                previous: None,
                retry_min,
                retry_max,
                seed: rand::random(),
            },
            clock.now(),
        );
        let driver = LeaseDriver::new(
            counting,
            keeper,
            node,
            clock.clone(),
            health,
            DriverConfig {
                network: network.clone(),
                subnet_file: state_dir.join("subnet.env"),
                mtu: 1450,
                ip_masq: false,
                on_subnet_change: None,
                on_lease_lost: None,
                hook_timeout: Duration::from_secs(30),
                state_dir,
                relinquish_on_exit: true,
            },
            subnet_tx,
        );
        drivers.push(tokio::spawn(driver.run(shutdown_rx.clone())));
        hosts.push(host);
    }
    let poller = tokio::spawn(poll(hosts, calls, route_calls, flannel_counts, shutdown_rx.clone()));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    term.recv().await;
    let t = mono_ns();
    emit(json!({"ev": "terminating", "t": t}));
    shutdown_tx.send_replace(true);
    for d in drivers {
        let _ = tokio::time::timeout(Duration::from_secs(15), d).await;
    }
    poller.abort();
    emit(json!({"ev": "exit", "t": mono_ns()}));
}

/// Every 10 ms: which route changes every host of this worker has, and each host's lease state.
async fn poll(
    mut hosts: Vec<Host>,
    calls: Arc<Calls>,
    route_calls: Arc<Calls>,
    flannel: Arc<FlannelCounts>,
    shutdown: watch::Receiver<bool>,
) {
    let n = hosts.len();
    // What the discovering hosts (the first two: a host's table lacks its own subnet) last saw.
    let mut known: Vec<HashSet<(Subnet, Ipv4Addr)>> = vec![HashSet::new(); n.min(2)];
    let mut pending: HashMap<(Subnet, Ipv4Addr, bool), Pending> = HashMap::new();
    let mut done: HashSet<(Subnet, Ipv4Addr, bool)> = HashSet::new();
    let mut listed = false;
    let mut last_tick = mono_ns();
    let mut last_stats = 0u64;
    let mut interval = tokio::time::interval(POLL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ticks = clk_tck();
    loop {
        interval.tick().await;
        if *shutdown.borrow() {
            return;
        }
        let now = mono_ns();
        if now - last_tick > 1_000_000_000 {
            // We were stopped (SIGSTOP): report when each host holds a lease again.
            emit(json!({"ev": "resumed", "t": now, "gap_ms": (now - last_tick) / 1_000_000}));
            for h in &mut hosts {
                h.await_rehold = true;
                h.resumed = true;
            }
        }
        last_tick = now;
        if !listed && hosts.iter().all(|h| h.stats.updates.load(Ordering::Relaxed) > 0) {
            listed = true;
            emit(json!({"ev": "listed", "t": now}));
        }
        // Discover route changes from the first hosts' tables.
        // A host can only have come to see a change if its table or its own subnet changed
        // since the last tick: only those are looked at (with 1,000 changes pending and 100
        // hosts per worker, looking at every host every tick cost the hosts most of the CPU).
        let mut changed = vec![false; n];
        for (k, h) in hosts.iter_mut().enumerate() {
            let table = h.routes.load();
            if !Arc::ptr_eq(&table, &h.table) {
                h.table = table.clone();
                changed[k] = true;
            }
            let own = h.subnet.borrow().map(|l| l.subnet);
            if own != h.own {
                h.own = own;
                changed[k] = true;
            }
        }
        for d in 0..known.len() {
            if !changed[d] {
                continue;
            }
            let now_set: HashSet<(Subnet, Ipv4Addr)> =
                hosts[d].table.peers().iter().map(|p| (p.subnet, p.public_ip)).collect();
            for &(s, ip) in now_set.difference(&known[d]) {
                if !done.contains(&(s, ip, false)) {
                    pending.entry((s, ip, false)).or_insert_with(|| Pending {
                        seen: vec![false; n],
                        left: n,
                        fresh: true,
                    });
                }
            }
            for &(s, ip) in known[d].difference(&now_set) {
                if !done.contains(&(s, ip, true)) {
                    pending.entry((s, ip, true)).or_insert_with(|| Pending {
                        seen: vec![false; n],
                        left: n,
                        fresh: true,
                    });
                }
            }
            known[d] = now_set;
        }
        // Which hosts have each pending change now.
        let mut finished = Vec::new();
        for (key, p) in pending.iter_mut() {
            let (s, ip, gone) = *key;
            let fresh = std::mem::take(&mut p.fresh);
            for (k, h) in hosts.iter().enumerate() {
                if p.seen[k]
                    || !(fresh || changed[k])
                    || h.stats.updates.load(Ordering::Relaxed) == 0
                {
                    continue;
                }
                let own = h.ip == ip && h.subnet.borrow().map(|l| l.subnet) == Some(s);
                let has = own
                    || h.table
                        .lookup(s.v4().map_or(std::net::Ipv4Addr::UNSPECIFIED, |n| n.network()))
                        .is_some_and(|peer| peer.public_ip == ip && peer.subnet == s);
                if has != gone {
                    p.seen[k] = true;
                    p.left -= 1;
                }
            }
            if p.left == 0 {
                finished.push(*key);
            }
        }
        for key in finished {
            pending.remove(&key);
            done.insert(key);
            emit(json!({
                "ev": "prop", "s": key.0.to_string(), "ip": key.1.to_string(), "gone": key.2,
                "t": now,
            }));
        }
        // Lease state per host.
        for h in &mut hosts {
            let exits = h.exits.load(Ordering::Relaxed);
            if exits != h.exits_seen {
                h.exits_seen = exits;
                // A flanneld that held its lease again after the stop and then exited (its
                // own key's delete came after): the rehold is the restarted process's.
                if h.resumed {
                    h.await_rehold = true;
                }
            }
            let subnet = h.subnet.borrow().map(|l| l.subnet);
            let ready = h.health.readiness().is_ok();
            if (subnet, ready) != h.reported {
                h.reported = (subnet, ready);
                emit(json!({
                    "ev": "host", "h": h.idx, "s": subnet.map(|s| s.to_string()), "held": ready,
                    "t": now,
                }));
            }
            if h.await_rehold && ready {
                h.await_rehold = false;
                emit(json!({
                    "ev": "rehold", "h": h.idx, "s": subnet.map(|s| s.to_string()), "t": now,
                }));
            }
        }
        if now - last_stats >= 1_000_000_000 {
            last_stats = now;
            let sum = |f: fn(&weft::lease::status::LeaseCounters) -> &AtomicU64| -> u64 {
                hosts.iter().map(|h| f(&h.health.counters).load(Ordering::Relaxed)).sum()
            };
            let relists: u64 = hosts.iter().map(|h| h.stats.relists.load(Ordering::Relaxed)).sum();
            let watch_errors: u64 =
                hosts.iter().map(|h| h.stats.watch_errors.load(Ordering::Relaxed)).sum();
            // Each publish builds a whole route table (see route_lookup's route_table_build).
            let publishes: u64 =
                hosts.iter().map(|h| h.stats.updates.load(Ordering::Relaxed)).sum();
            let c = &calls;
            emit(json!({
                "ev": "stats", "t": now, "rss_kb": rss_kb(),
                "cpu_s": cpu_ticks("self") as f64 / ticks,
                "acquisitions": sum(|c| &c.acquisitions),
                "renewals": sum(|c| &c.renewals),
                "losses": sum(|c| &c.losses),
                "recoveries": sum(|c| &c.recoveries),
                "subnet_changes": sum(|c| &c.subnet_changes),
                "store_errors": sum(|c| &c.store_errors),
                "exhaustions": sum(|c| &c.exhaustions),
                "identity_clashes": sum(|c| &c.identity_clashes),
                "route_relists": relists,
                "route_watch_errors": watch_errors,
                "route_publishes": publishes,
                "lists": c.lists.load(Ordering::Relaxed),
                "route_lists": route_calls.lists.load(Ordering::Relaxed),
                "route_call_errors": route_calls.errors.load(Ordering::Relaxed),
                "creates": c.creates.load(Ordering::Relaxed),
                "creates_lost": c.creates_lost.load(Ordering::Relaxed),
                "renews": c.renews.load(Ordering::Relaxed),
                "renew_conflicts": c.renew_conflicts.load(Ordering::Relaxed),
                "releases": c.releases.load(Ordering::Relaxed),
                "call_errors": c.errors.load(Ordering::Relaxed),
                "pending_props": pending.len(),
                "restarts": hosts.iter().map(|h| h.exits.load(Ordering::Relaxed)).sum::<u64>(),
                "exits_race": flannel.exits_race.load(Ordering::Relaxed),
                "exits_revoked": flannel.exits_revoked.load(Ordering::Relaxed),
                "exits_exhausted": flannel.exits_exhausted.load(Ordering::Relaxed),
                "flannel_puts": flannel.puts.load(Ordering::Relaxed),
                "flannel_ttl_reads": flannel.ttl_reads.load(Ordering::Relaxed),
            }));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// flannel's lease policy (--policy flannel)
// ---------------------------------------------------------------------------------------------
//
// tests/sim/mod.rs (`FlannelProc`, `step_flannel`, `flannel_acquire`, `flannel_put`,
// `flannel_margin`; docs/lease-rules.md, "flannel's lease logic") is the model of what follows:
// flanneld v0.18 and later (`FlannelVersion::V0_18`). It is duplicated here rather than shared
// because the simulation's is synchronous, one store call per step over the in-memory store
// and its manual clock, while this runs flanneld's loop as it runs: async, against real etcd,
// on real timers.

/// flanneld's renew retry: "trying again in 1 min" of a 24 h lease, scaled as the simulation
/// scales it (200 ms of its 4 s TTL: TTL/20, 500 ms at the bench's 10 s).
fn flannel_retry(ttl: Duration) -> Duration {
    ttl / 20
}

/// flannel's renew margin (1 h before a 24 h expiry), scaled as the simulation scales it: TTL/4,
/// weft's daemon default for short TTLs, so that both renew at comparable points.
fn flannel_margin(ttl: Duration) -> Duration {
    ttl / 4
}

/// How long flanneld's acquire loop waits after a failed store call (the etcd client blocks
/// and retries; flanneld does not exit), as in the simulation.
const FLANNEL_ACQUIRE_RETRY: Duration = Duration::from_secs(1);

/// How long the supervisor (systemd's `Restart=always`, a DaemonSet's restart) waits before it
/// starts an exited flanneld again. Real ones wait longer and back off (kubelet: 10 s doubling
/// to 5 min); 1 s is the simulation's and the kindest to flannel.
const FLANNEL_RESTART: Duration = Duration::from_secs(1);

/// What the flannel hosts of a worker did, beyond the store calls [`Counting`] sees.
#[derive(Default)]
struct FlannelCounts {
    /// Unconditional puts (acquire by public IP and renewals), each on a fresh etcd lease.
    puts: AtomicU64,
    /// `LeaseTimeToLive` calls, one per event of its own key's watch.
    ttl_reads: AtomicU64,
    /// Exits after a create that lost its race (`errSubnetAlreadyexists`).
    exits_race: AtomicU64,
    /// Exits on a delete of its own key ("Lease has been revoked. Shutting down daemon.").
    exits_revoked: AtomicU64,
    /// Exits with no free subnet left.
    exits_exhausted: AtomicU64,
}

/// One flannel host: what its flanneld process and its supervisor need.
struct FlannelHost {
    idx: u32,
    /// The host's store client, counted: listings, creates (weft's create-if-absent is
    /// flannel's: `version == 0`, no history record for a value without weft's node ID) and
    /// the own-key watch.
    store: Arc<dyn Store>,
    /// The same client, uncounted, for `LeaseTimeToLive` ([`EtcdStore::lease_ttl`]).
    etcd: EtcdStore,
    /// A raw etcd client for the unconditional put, which the [`Store`] contract leaves out.
    putter: etcd_client::Client,
    network: NetworkConfig,
    /// flannel's value: [`LeaseAttrs`] without weft's node fields.
    attrs: LeaseAttrs,
    ttl: Duration,
    clock: Arc<dyn Clock>,
    /// Ready while flanneld runs and its last write's etcd lease is live as far as it knows.
    health: Arc<LeaseHealth>,
    subnet_tx: watch::Sender<Option<LeaseName>>,
    calls: Arc<Calls>,
    counts: Arc<FlannelCounts>,
    exits: Arc<AtomicU64>,
}

/// Why a flanneld process ended.
enum FlannelExit {
    RaceLost(Subnet),
    Revoked(Subnet),
    Exhausted,
}

/// A raw etcd client like [`EtcdStore`]'s (bounded dials, leader required), for
/// [`flannel_put`].
async fn flannel_client(endpoints: &[String]) -> Result<etcd_client::Client, etcd_client::Error> {
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(CALL_TIMEOUT)
        .with_require_leader(true);
    etcd_client::Client::connect(endpoints, Some(opts)).await
}

fn subnet_key(s: Subnet) -> String {
    format!("{PREFIX}/subnets/{}", s.key_name())
}

/// One etcd call of [`flannel_put`] under the call deadline.
async fn etcd_call<T>(
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(StoreError::Unavailable(Box::new(e))),
        Err(_) => Err(StoreError::Timeout(CALL_TIMEOUT)),
    }
}

/// flannel's `updateSubnet`: a fresh etcd lease and an unconditional put of the subnet key, no
/// compare (the old etcd lease is left to expire, as flannel leaves it). Returns the put's
/// revision. Counted as a driver store call (errors too).
async fn flannel_put(h: &mut FlannelHost, s: Subnet) -> Result<Revision, StoreError> {
    h.counts.puts.fetch_add(1, Ordering::Relaxed);
    let ttl_secs = i64::try_from(h.ttl.as_secs()).unwrap_or(i64::MAX).max(1);
    let (key, value) = (subnet_key(s), h.attrs.to_json());
    let client = &mut h.putter;
    let r = async {
        let lease = etcd_call(client.lease_grant(ttl_secs, None)).await?;
        let opts = etcd_client::PutOptions::new().with_lease(lease.id());
        let put = etcd_call(client.put(key, value, Some(opts))).await?;
        Ok(Revision(put.header().map_or(0, |hd| hd.revision())))
    }
    .await;
    if r.is_err() {
        h.calls.errors.fetch_add(1, Ordering::Relaxed);
    }
    r
}

fn store_trouble(h: &FlannelHost, what: &str, s: Option<Subnet>, e: &StoreError) {
    weft::lease::status::LeaseCounters::inc(&h.health.counters.store_errors);
    tracing::warn!(host = h.idx, subnet = ?s.map(|s| s.to_string()), error = %e, "flanneld: {what} failed");
}

/// Marks the host's lease held until `expires` (its last write plus the TTL).
fn flannel_held(h: &FlannelHost, s: Subnet, expires: Instant) {
    h.health.set_lease(weft::lease::status::LeaseStatus {
        state: "held",
        subnet: Some(s),
        expires_at: Some(expires),
        identity_until: None,
        not_ready: None,
    });
}

/// The supervisor: runs flanneld, restarts it [`FLANNEL_RESTART`] after every exit, until the
/// worker is told to stop. On SIGTERM flanneld just ends: it never releases its lease.
async fn flannel_supervisor(mut h: FlannelHost, mut shutdown: watch::Receiver<bool>) {
    // subnet.env: written by one flanneld process, read by the next.
    let mut subnet_env: Option<Subnet> = None;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    loop {
        let exit = tokio::select! {
            exit = flanneld(&mut h, &mut subnet_env, &mut rng) => exit,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let (counter, reason) = match exit {
            FlannelExit::RaceLost(s) => {
                (&h.counts.exits_race, format!("{s}: errSubnetAlreadyexists (exit 1)"))
            }
            FlannelExit::Revoked(s) => (
                &h.counts.exits_revoked,
                format!("{s}: Lease has been revoked. Shutting down daemon. (exit 0)"),
            ),
            FlannelExit::Exhausted => (&h.counts.exits_exhausted, "out of subnets (exit 1)".into()),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        h.health.set_lease(weft::lease::status::LeaseStatus {
            state: "exited",
            not_ready: Some(reason.clone()),
            ..Default::default()
        });
        h.exits.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(host = h.idx, "flanneld exits: {reason}; restarted in {FLANNEL_RESTART:?}");
        tokio::select! {
            _ = tokio::time::sleep(FLANNEL_RESTART) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

/// What one flanneld process acquired.
struct FlannelLease {
    subnet: Subnet,
    revision: Revision,
    expires: tokio::time::Instant,
}

/// One flanneld process: acquire, then renew and watch its own key until it exits.
async fn flanneld(
    h: &mut FlannelHost,
    subnet_env: &mut Option<Subnet>,
    rng: &mut rand::rngs::StdRng,
) -> FlannelExit {
    let lease = loop {
        match flannel_acquire(h, *subnet_env, rng).await {
            Ok(Some(lease)) => break lease,
            Ok(None) => tokio::time::sleep(FLANNEL_ACQUIRE_RETRY).await,
            Err(exit) => return exit,
        }
    };
    let s = lease.subnet;
    weft::lease::status::LeaseCounters::inc(&h.health.counters.acquisitions);
    if *subnet_env != Some(s) {
        if subnet_env.is_some() {
            weft::lease::status::LeaseCounters::inc(&h.health.counters.subnet_changes);
        }
        *subnet_env = Some(s);
    }
    h.subnet_tx.send_replace(Some(LeaseName::single(s)));
    let ttl = h.ttl;
    let margin = flannel_margin(ttl);
    // flannel's MonitorLease: a timer to expiry − margin, re-armed by every event of its own
    // key's watch (from the lease's TimeToLive); a delete of the key ends the process.
    let mut renew_at = lease.expires - margin;
    let mut watch: Option<WatchStream> = None;
    let mut watch_from = Revision(lease.revision.0 + 1);
    let mut watch_retry_at = tokio::time::Instant::now();
    let mut watch_backoff = Duration::from_millis(100);
    enum Wake {
        Renew,
        Watched(Option<Result<weft::lease::store::WatchBatch, StoreError>>),
        Rewatch,
    }
    loop {
        let watching = watch.is_some();
        let next = async {
            match watch.as_mut() {
                Some(w) => w.next().await,
                None => std::future::pending().await,
            }
        };
        // Go's select picks at random among ready cases; so does tokio's.
        let wake = tokio::select! {
            _ = tokio::time::sleep_until(renew_at) => Wake::Renew,
            item = next => Wake::Watched(item),
            _ = tokio::time::sleep_until(watch_retry_at), if !watching => Wake::Rewatch,
        };
        match wake {
            Wake::Renew => {
                let issued = tokio::time::Instant::now();
                let issued_clock = h.clock.now();
                match flannel_put(h, s).await {
                    Ok(_) => {
                        weft::lease::status::LeaseCounters::inc(&h.health.counters.renewals);
                        flannel_held(h, s, issued_clock + ttl);
                        renew_at = issued + ttl - margin;
                    }
                    Err(e) => {
                        store_trouble(h, "renew", Some(s), &e);
                        renew_at = tokio::time::Instant::now() + flannel_retry(ttl);
                    }
                }
            }
            Wake::Rewatch => match h.store.watch(watch_from, Some(LeaseName::single(s))).await {
                Ok(w) => {
                    watch = Some(w);
                    watch_backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    store_trouble(h, "watch", Some(s), &e);
                    watch_retry_at = tokio::time::Instant::now() + watch_backoff;
                    watch_backoff = (watch_backoff * 2).min(Duration::from_secs(5));
                }
            },
            Wake::Watched(Some(Ok(batch))) => {
                watch_from = Revision(batch.revision.0 + 1);
                for ev in batch.events {
                    match ev {
                        // EventAdded: the new expiration, from the key's etcd lease.
                        WatchEvent::Put(l) => {
                            h.counts.ttl_reads.fetch_add(1, Ordering::Relaxed);
                            let now = tokio::time::Instant::now();
                            let now_clock = h.clock.now();
                            let left = match h.etcd.lease_ttl(l.lease_id).await {
                                Ok(Some(left)) => left,
                                Ok(None) => ttl,
                                Err(e) => {
                                    store_trouble(h, "lease TimeToLive", Some(s), &e);
                                    ttl
                                }
                            };
                            flannel_held(h, s, now_clock + left);
                            renew_at = (now + left).checked_sub(margin).unwrap_or(now);
                        }
                        WatchEvent::Delete { .. } => return FlannelExit::Revoked(s),
                        WatchEvent::Bad(_)
                        | WatchEvent::DeleteUnparsed { .. }
                        | WatchEvent::Departed(_) => {}
                    }
                }
            }
            Wake::Watched(Some(Err(StoreError::Compacted { .. }))) => {
                // v0.28.9: read the key again; gone means an EventRemoved.
                match h.store.get(s).await {
                    Ok(None) => return FlannelExit::Revoked(s),
                    Ok(Some(_)) => watch_from = Revision(0),
                    Err(e) => store_trouble(h, "get", Some(s), &e),
                }
                watch = None;
                watch_retry_at = tokio::time::Instant::now();
            }
            Wake::Watched(Some(Err(StoreError::Rewound { .. }))) => {
                // EtcdStore's watch says "rewound" when the member serving it has not applied
                // the revision asked for yet: here, a follower a few revisions behind our own
                // write. etcd's watch would just wait for it and flanneld see nothing, so
                // this is no store error: watch again from the same revision.
                watch = None;
                watch_retry_at = tokio::time::Instant::now() + Duration::from_millis(100);
            }
            Wake::Watched(other) => {
                if let Some(Err(e)) = &other {
                    store_trouble(h, "watch", Some(s), e);
                }
                watch = None;
                watch_retry_at = tokio::time::Instant::now() + watch_backoff;
                watch_backoff = (watch_backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// flannel's `tryAcquireLease`, one attempt: `Ok(None)` after a failed store call (try again in
/// [`FLANNEL_ACQUIRE_RETRY`]); `Err` when flanneld exits.
async fn flannel_acquire(
    h: &mut FlannelHost,
    subnet_env: Option<Subnet>,
    rng: &mut rand::rngs::StdRng,
) -> Result<Option<FlannelLease>, FlannelExit> {
    let listing = match h.store.list().await {
        Ok(l) => l,
        Err(e) => {
            store_trouble(h, "list", None, &e);
            return Ok(None);
        }
    };
    let ip = h.attrs.public_ip;
    let fits = |s: Subnet| h.network.fits(s);
    // 1. Reuse the first lease whose PublicIP is ours: an unconditional put.
    if let Some(s) =
        listing.leases.iter().find(|l| l.attrs.public_ip == ip && fits(l.subnet)).map(|l| l.subnet)
    {
        let issued = tokio::time::Instant::now();
        let (issued_clock, issued_ns) = (h.clock.now(), mono_ns());
        return match flannel_put(h, s).await {
            Ok(revision) => {
                emit(json!({
                    "ev": "created", "h": h.idx, "s": s.to_string(), "ip": ip.to_string(),
                    "t_issue": issued_ns, "t": mono_ns(),
                }));
                flannel_held(h, s, issued_clock + h.ttl);
                Ok(Some(FlannelLease { subnet: s, revision, expires: issued + h.ttl }))
            }
            Err(e) => {
                store_trouble(h, "put", Some(s), &e);
                Ok(None)
            }
        };
    }
    let taken: HashSet<Subnet> = listing.leases.iter().map(|l| l.subnet).collect();
    // 2. The subnet.env subnet if no key exists for it; else 3. random among the lowest 100 free.
    let candidate = match subnet_env {
        Some(prev) if fits(prev) && !taken.contains(&prev) => prev,
        _ => {
            let free: Vec<Subnet> =
                h.network.subnets().filter(|s| !taken.contains(s)).take(100).collect();
            if free.is_empty() {
                return Err(FlannelExit::Exhausted);
            }
            free[rng.random_range(0..free.len())]
        }
    };
    let issued = tokio::time::Instant::now();
    let issued_clock = h.clock.now();
    // `Counting` stamps a committed create for the propagation figures.
    match h.store.create(candidate, &h.attrs, h.ttl).await {
        Ok(CreateOutcome::Created(held)) => {
            flannel_held(h, candidate, issued_clock + h.ttl);
            Ok(Some(FlannelLease {
                subnet: candidate,
                revision: held.mod_revision,
                expires: issued + h.ttl,
            }))
        }
        Ok(CreateOutcome::Exists(_)) => Err(FlannelExit::RaceLost(candidate)),
        Err(e) => {
            store_trouble(h, "create", Some(candidate), &e);
            Ok(None)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Coordinator
// ---------------------------------------------------------------------------------------------

struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    count: u32,
    pid: i32,
    rss_ready_kb: u64,
    listed_t: Option<u64>,
    terminated: bool,
    exit_t: Option<u64>,
    stats: Value,
}

#[derive(Clone, Default)]
struct HostState {
    worker: usize,
    node: String,
    subnet: Option<String>,
    held: bool,
    held_t: u64,
    alive: bool,
    /// When its release of `subnet` was issued (it stopped using it then).
    released_t: Option<u64>,
}

/// A lease change to time: a create or a release, as its worker stamped it.
struct Change {
    s: String,
    ip: String,
    gone: bool,
    t_ack: u64,
    phase: &'static str,
    /// A create of a (subnet, IP) routed before (a recovery after expiry): not timed.
    repeat: bool,
}

struct Coord {
    workers: Vec<Worker>,
    hosts: BTreeMap<u32, HostState>,
    rx: mpsc::Receiver<(usize, String)>,
    tx: mpsc::Sender<(usize, String)>,
    changes: Vec<Change>,
    routed: HashSet<(String, String)>,
    props: HashMap<(String, String, bool), HashMap<usize, u64>>,
    reholds: HashMap<u32, (Option<String>, u64)>,
    phase: &'static str,
    /// (phase, host, other host, time): a host reported holding a subnet another live host had
    /// reported holding; a duplicate unless the other's release was issued before `time`.
    dup_candidates: Vec<(&'static str, u32, u32, u64)>,
    exe: PathBuf,
    endpoints: String,
    ttl: u64,
    dir: PathBuf,
    policy: Policy,
}

impl Coord {
    fn spawn_worker(&mut self, first: u32, count: u32) -> usize {
        let w = self.workers.len();
        let log = std::fs::File::create(self.dir.join(format!("worker-{w}.log"))).expect("log");
        // The hosts run at a lower priority than etcd: in a real cluster they are 1,000
        // machines and etcd has its own, while here all share two cores. Starved of CPU by
        // them, etcd's members missed their heartbeats, lost their leader over and over, and
        // every call timed out ("etcdserver: no leader", "request timed out, waiting for the
        // applied index"): a benchmark of this machine, not of weft. WEFT_BENCH_NICE=0 turns
        // it off.
        let nice = std::env::var("WEFT_BENCH_NICE").unwrap_or_else(|_| "10".into());
        let mut child = Command::new("nice")
            .args(["-n", &nice])
            .arg(&self.exe)
            .args(["--worker", "--endpoints", &self.endpoints])
            .args(["--first", &first.to_string(), "--count", &count.to_string()])
            .args(["--ttl", &self.ttl.to_string()])
            .args(["--policy", self.policy.name()])
            .arg("--dir")
            .arg(self.dir.join("hosts"))
            .env("WEFT_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn a worker");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((w, line)).is_err() {
                    break;
                }
            }
        });
        let pid = child.id() as i32;
        self.workers.push(Worker {
            child,
            stdin,
            count,
            pid,
            rss_ready_kb: 0,
            listed_t: None,
            terminated: false,
            exit_t: None,
            stats: json!({}),
        });
        w
    }

    /// Handles worker lines until `deadline` (monotonic ns) or until `done` holds.
    fn pump(&mut self, deadline: u64, mut done: impl FnMut(&Coord) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            let now = mono_ns();
            if now >= deadline {
                return false;
            }
            let wait = Duration::from_nanos((deadline - now).min(50_000_000));
            match self.rx.recv_timeout(wait) {
                Ok((w, line)) => {
                    self.handle(w, &line);
                    while let Ok((w, line)) = self.rx.try_recv() {
                        self.handle(w, &line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return done(self),
            }
        }
    }

    fn sleep(&mut self, d: Duration) {
        let until = mono_ns() + d.as_nanos() as u64;
        self.pump(until, |_| false);
    }

    fn handle(&mut self, w: usize, line: &str) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            eprintln!("worker {w}: {line}");
            return;
        };
        let t = v["t"].as_u64().unwrap_or(0);
        let text = |k: &str| v[k].as_str().map(String::from);
        match v["ev"].as_str().unwrap_or("") {
            "ready" => self.workers[w].rss_ready_kb = v["rss_kb"].as_u64().unwrap_or(0),
            "host_info" => {
                let h = v["h"].as_u64().unwrap_or(0) as u32;
                self.hosts.insert(
                    h,
                    HostState {
                        worker: w,
                        node: text("node").unwrap_or_default(),
                        alive: true,
                        ..HostState::default()
                    },
                );
            }
            "host" => {
                let h = v["h"].as_u64().unwrap_or(0) as u32;
                let subnet = text("s");
                let held = v["held"].as_bool().unwrap_or(false);
                if held && let Some(s) = &subnet {
                    let others: Vec<u32> = self
                        .hosts
                        .iter()
                        .filter(|(o, st)| {
                            **o != h && st.alive && st.held && st.subnet.as_ref() == Some(s)
                        })
                        .map(|(o, _)| *o)
                        .collect();
                    for o in others {
                        self.dup_candidates.push((self.phase, h, o, t));
                    }
                }
                let st = self.hosts.entry(h).or_default();
                st.subnet = subnet;
                if held && !st.held {
                    st.held_t = t;
                }
                st.held = held;
            }
            "rehold" => {
                let h = v["h"].as_u64().unwrap_or(0) as u32;
                self.reholds.insert(h, (text("s"), t));
            }
            "created" | "released" => {
                let gone = v["ev"] == "released";
                let (s, ip) = (text("s").unwrap_or_default(), text("ip").unwrap_or_default());
                let repeat = !gone && !self.routed.insert((s.clone(), ip.clone()));
                if gone {
                    let h = v["h"].as_u64().unwrap_or(0) as u32;
                    let st = self.hosts.entry(h).or_default();
                    st.released_t = v["t_issue"].as_u64();
                    st.held = false;
                }
                self.changes.push(Change { s, ip, gone, t_ack: t, phase: self.phase, repeat });
            }
            "prop" => {
                let key = (
                    text("s").unwrap_or_default(),
                    text("ip").unwrap_or_default(),
                    v["gone"].as_bool().unwrap_or(false),
                );
                self.props.entry(key).or_default().insert(w, t);
            }
            "listed" => self.workers[w].listed_t = Some(t),
            "stats" => self.workers[w].stats = v,
            "exit" => {
                self.workers[w].exit_t = Some(t);
                for st in self.hosts.values_mut().filter(|st| st.worker == w) {
                    st.alive = false;
                    st.held = false;
                }
            }
            _ => {}
        }
    }

    /// Hosts that believed they held a subnet while another did, in `phase`.
    fn believed_dups(&self, phase: &str) -> u64 {
        let mut n = 0;
        for &(p, h, o, t) in &self.dup_candidates {
            if p == phase && self.hosts[&o].released_t.is_none_or(|r| r > t) {
                eprintln!("DUPLICATE in {p}: host {h} holds the subnet host {o} holds");
                n += 1;
            }
        }
        n
    }

    fn live_hosts(&self) -> impl Iterator<Item = (&u32, &HostState)> {
        self.hosts.iter().filter(|(_, st)| st.alive)
    }

    /// Whether every live host holds a lease, all distinct.
    fn all_hold_distinct(&self) -> bool {
        let mut seen = HashSet::new();
        self.live_hosts()
            .all(|(_, st)| st.held && st.subnet.as_ref().is_some_and(|s| seen.insert(s.clone())))
    }

    fn stat_sum(&self, key: &str) -> u64 {
        self.workers.iter().map(|w| w.stats[key].as_u64().unwrap_or(0)).sum()
    }

    fn counters(&self) -> BTreeMap<&'static str, u64> {
        [
            "acquisitions",
            "renewals",
            "losses",
            "recoveries",
            "subnet_changes",
            "store_errors",
            "exhaustions",
            "identity_clashes",
            "route_relists",
            "route_lists",
            "route_call_errors",
            "route_watch_errors",
            "route_publishes",
            "lists",
            "creates",
            "creates_lost",
            "renews",
            "renew_conflicts",
            "releases",
            "call_errors",
            "restarts",
            "exits_race",
            "exits_revoked",
            "exits_exhausted",
            "flannel_puts",
            "flannel_ttl_reads",
        ]
        .into_iter()
        .map(|k| (k, self.stat_sum(k)))
        .collect()
    }

    /// When every live watcher routed every live host's lease (the last worker's report of
    /// the last one), or `None` while some host holds none or some worker has yet to report.
    fn all_routed(&self) -> Option<u64> {
        let mut last = 0;
        for (h, st) in self.live_hosts() {
            let key = (st.subnet.clone()?, host_ip(*h).to_string(), false);
            let reports = self.props.get(&key)?;
            for (w, wk) in self.workers.iter().enumerate() {
                if wk.terminated {
                    continue;
                }
                last = last.max(*reports.get(&w)?);
            }
        }
        Some(last)
    }

    /// Per host RSS: each live worker's RSS over its host count; median and max.
    fn memory_per_host_kb(&self) -> (f64, f64) {
        let mut v: Vec<f64> = self
            .workers
            .iter()
            .filter(|w| !w.terminated && w.count > 0)
            .map(|w| w.stats["rss_kb"].as_u64().unwrap_or(0) as f64 / f64::from(w.count))
            .collect();
        v.sort_by(f64::total_cmp);
        (v.get(v.len() / 2).copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0))
    }

    /// Propagation latencies (ms) of this phase's changes, and how many are still missing.
    fn propagation(&self, phase: &str) -> (Vec<f64>, usize, usize) {
        self.propagation_of(phase, None)
    }

    /// As [`Coord::propagation`], of creates only (`Some(false)`) or releases (`Some(true)`).
    fn propagation_of(&self, phase: &str, gone: Option<bool>) -> (Vec<f64>, usize, usize) {
        let mut lat = Vec::new();
        let mut missing = 0;
        let mut repeats = 0;
        for c in
            self.changes.iter().filter(|c| c.phase == phase && gone.is_none_or(|g| g == c.gone))
        {
            if c.repeat {
                repeats += 1;
                continue;
            }
            let reports = self.props.get(&(c.s.clone(), c.ip.clone(), c.gone));
            let mut last = 0u64;
            let mut complete = true;
            for (w, wk) in self.workers.iter().enumerate() {
                // Every worker alive to the end whose watchers had listed before the change.
                if wk.terminated || wk.listed_t.is_none_or(|t| t > c.t_ack) {
                    continue;
                }
                match reports.and_then(|r| r.get(&w)) {
                    Some(&t) => last = last.max(t),
                    None => complete = false,
                }
            }
            if complete {
                lat.push(last.saturating_sub(c.t_ack) as f64 / 1e6);
            } else {
                missing += 1;
            }
        }
        lat.sort_by(f64::total_cmp);
        (lat, missing, repeats)
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn etcd_pids() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{name}/stat")) else { continue };
        let comm_ok = stat.contains("(etcd)");
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1));
        if comm_ok && ppid == Some(me.as_str()) {
            pids.push(name);
        }
    }
    pids.sort();
    pids
}

fn etcd_cpu_s(pids: &[String]) -> f64 {
    pids.iter().map(|p| cpu_ticks(p)).sum::<u64>() as f64 / clk_tck()
}

/// etcd's requests so far, by gRPC method, summed over the members: each member's
/// `grpc_server_msg_received_total` (its `/metrics` on the client URL), which counts a unary
/// call (Range, Txn, Put, DeleteRange, LeaseGrant, LeaseRevoke, LeaseTimeToLive) once and a
/// stream's every message (a Watch stream's create and cancel requests, a LeaseKeepAlive
/// stream's keep-alives). A member that does not answer counts nothing.
fn etcd_requests(endpoints: &[String]) -> BTreeMap<String, u64> {
    use std::io::Read;
    let mut by_method = BTreeMap::new();
    for e in endpoints {
        let addr = e.trim_start_matches("http://");
        let Ok(mut conn) = std::net::TcpStream::connect(addr) else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = write!(conn, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        let mut text = String::new();
        let _ = conn.read_to_string(&mut text);
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("grpc_server_msg_received_total{") else { continue };
            let Some((labels, value)) = rest.split_once("} ") else { continue };
            let method = labels
                .split(',')
                .find_map(|l| l.strip_prefix("grpc_method=\""))
                .map(|m| m.trim_end_matches('"').to_owned());
            let (Some(method), Ok(v)) = (method, value.trim().parse::<f64>()) else { continue };
            *by_method.entry(method).or_insert(0) += v as u64;
        }
    }
    by_method
}

/// The requests of a phase (`after` less `before`), per host, the busiest methods first:
/// `Txn 1.00, LeaseGrant 1.00, ...`; methods under 0.005 per host left out.
fn requests_per_host(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    hosts: u32,
) -> String {
    let mut d: Vec<(String, u64)> = after
        .iter()
        .map(|(m, v)| (m.clone(), v.saturating_sub(before.get(m).copied().unwrap_or(0))))
        .filter(|(_, v)| *v as f64 / f64::from(hosts.max(1)) >= 0.005)
        .collect();
    d.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let total: u64 = d.iter().map(|(_, v)| v).sum();
    let per = |v: u64| v as f64 / f64::from(hosts.max(1));
    let each: Vec<String> = d.iter().map(|(m, v)| format!("{m} {:.2}", per(*v))).collect();
    format!("{:.2} in all: {}", per(total), each.join(", "))
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: a plain syscall on a child we spawned and have not reaped.
    unsafe { libc::kill(pid, sig) };
}

/// Checks the store against the hosts' beliefs: each live host's subnet is a live key carrying
/// its node ID; no node has two keys; no key belongs to a host that is gone.
fn check_store(
    rt: &tokio::runtime::Runtime,
    store: &EtcdStore,
    c: &Coord,
) -> (usize, usize, usize) {
    let listing = match rt.block_on(store.list()) {
        Ok(l) => l,
        Err(e) => {
            println!("store check failed: {e}");
            return (usize::MAX, usize::MAX, usize::MAX);
        }
    };
    let mut by_node: HashMap<String, Vec<String>> = HashMap::new();
    for l in &listing.leases {
        // weft's keys name their node; flannel's only their public IP, which is how flannel
        // knows its own (its hosts report their IP as their node).
        let node = l
            .attrs
            .node_id
            .as_ref()
            .map_or_else(|| l.attrs.public_ip.to_string(), |n| n.as_str().to_string());
        by_node.entry(node).or_default().push(l.subnet.to_string());
    }
    let two_keys = by_node.values().filter(|v| v.len() > 1).count();
    let mut mismatched = 0;
    for (_, st) in c.live_hosts() {
        let keys = by_node.get(&st.node).cloned().unwrap_or_default();
        if st.subnet.as_ref().is_none_or(|s| !keys.contains(s)) {
            mismatched += 1;
        }
    }
    let live_nodes: HashSet<&str> = c.live_hosts().map(|(_, st)| st.node.as_str()).collect();
    let orphans = listing.leases.len()
        - by_node
            .iter()
            .filter(|(n, _)| live_nodes.contains(n.as_str()))
            .map(|(_, v)| v.len())
            .sum::<usize>();
    (two_keys, mismatched, orphans)
}

struct PhaseRow {
    name: &'static str,
    settle_s: f64,
    dups: u64,
    counters: BTreeMap<&'static str, u64>,
    p50: f64,
    p99: f64,
    timed: usize,
    missing: usize,
    etcd_cpu: f64,
    wall: f64,
    store_check: (usize, usize, usize),
}

/// Where a phase started: the counters, etcd's CPU seconds and the clock.
struct PhaseStart {
    before: BTreeMap<&'static str, u64>,
    cpu0: f64,
    t0: u64,
}

/// A phase's row, measured now against `start` (propagation of `name`'s lease changes, the
/// counters' growth, etcd CPU, the store check), and how many re-creates of a known route
/// were not timed.
fn phase_row(
    c: &Coord,
    name: &'static str,
    settle_s: f64,
    start: &PhaseStart,
    pids: &[String],
    rt: &tokio::runtime::Runtime,
    store: &EtcdStore,
) -> (PhaseRow, usize) {
    let (lat, missing, repeats) = c.propagation(name);
    let after = c.counters();
    let row = PhaseRow {
        name,
        settle_s,
        dups: c.believed_dups(name),
        counters: after
            .iter()
            .map(|(k, v)| (*k, v.saturating_sub(start.before.get(k).copied().unwrap_or(0))))
            .collect(),
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
        timed: lat.len(),
        missing,
        etcd_cpu: etcd_cpu_s(pids) - start.cpu0,
        wall: (mono_ns() - start.t0) as f64 / 1e9,
        store_check: check_store(rt, store, c),
    };
    (row, repeats)
}

fn print_row(r: &PhaseRow, policy: Policy) {
    let c = &r.counters;
    let g = |k: &str| c.get(k).copied().unwrap_or(0);
    println!(
        "[{}] settled {:.2} s | believed duplicates {} | store: nodes with 2 keys {}, hosts without their key {}, orphan keys {}",
        r.name, r.settle_s, r.dups, r.store_check.0, r.store_check.1, r.store_check.2
    );
    println!(
        "[{}] acquisitions {} renewals {} recoveries {} losses {} subnet changes {} | lists {} creates {} create races lost {} renew conflicts {} releases {} | store errors {} call errors {} exhaustions {} clashes {} | route watchers: lists {} (re-lists {}) call errors {} watch errors {} tables published {}",
        r.name,
        g("acquisitions"),
        g("renewals"),
        g("recoveries"),
        g("losses"),
        g("subnet_changes"),
        g("lists"),
        g("creates"),
        g("creates_lost"),
        g("renew_conflicts"),
        g("releases"),
        g("store_errors"),
        g("call_errors"),
        g("exhaustions"),
        g("identity_clashes"),
        g("route_lists"),
        g("route_relists"),
        g("route_call_errors"),
        g("route_watch_errors"),
        g("route_publishes"),
    );
    println!(
        "[{}] propagation p50 {:.0} ms p99 {:.0} ms over {} changes ({} never reached every watcher) | etcd CPU {:.1} s in {:.1} s wall",
        r.name, r.p50, r.p99, r.timed, r.missing, r.etcd_cpu, r.wall
    );
    if policy == Policy::Flannel {
        println!(
            "[{}] flanneld exits {} (lost create race {}, own key deleted {}, out of subnets {}), each restarted {FLANNEL_RESTART:?} later | unconditional puts {} | lease TimeToLive reads {}",
            r.name,
            g("restarts"),
            g("exits_race"),
            g("exits_revoked"),
            g("exits_exhausted"),
            g("flannel_puts"),
            g("flannel_ttl_reads"),
        );
    }
}

/// etcd's floor for the join's work (see [`floor_worker`]): `n` hosts in `nworkers` worker
/// processes at the weft workers' priority, on the bench's etcd before the join. Returns the
/// seconds from "go" until every watcher has seen every key, etcd's CPU seconds in them and
/// the clients' (the worker processes', from their start).
/// The floor's keys are gone again (their store leases revoked, the history compacted) when
/// it returns.
fn measure_floor(
    exe: &Path,
    endpoints: &[String],
    n: u32,
    nworkers: u32,
    ttl: u64,
    pids: &[String],
    rt: &tokio::runtime::Runtime,
) -> Floor {
    let store_endpoints = endpoints;
    let endpoints = &endpoints.join(",");
    let nice = std::env::var("WEFT_BENCH_NICE").unwrap_or_else(|_| "10".into());
    let per = n.div_ceil(nworkers);
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut children = Vec::new();
    let mut first = 0;
    while first < n {
        let count = per.min(n - first);
        let mut child = Command::new("nice")
            .args(["-n", &nice])
            .arg(exe)
            .args(["--floor-worker", "--endpoints", endpoints])
            .args(["--first", &first.to_string(), "--count", &count.to_string()])
            .args(["--hosts", &n.to_string(), "--ttl", &ttl.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a floor worker");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let tx = tx.clone();
        let w = children.len();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((w, line)).is_err() {
                    break;
                }
            }
        });
        children.push((child, stdin));
        first += count;
    }
    drop(tx);
    let nw = children.len();
    let wait_for = |ev: &str, limit: Duration| -> Vec<Value> {
        let mut got: HashMap<usize, Value> = HashMap::new();
        let deadline = std::time::Instant::now() + limit;
        while got.len() < nw {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok((w, line)) => {
                    let v: Value = serde_json::from_str(&line).unwrap_or_default();
                    if v["ev"] == ev {
                        got.insert(w, v);
                    }
                }
                Err(_) => panic!("floor workers: {} of {nw} said {ev:?}", got.len()),
            }
        }
        got.into_values().collect()
    };
    let go = |children: &mut Vec<(Child, ChildStdin)>| {
        for (_, stdin) in children.iter_mut() {
            let _ = stdin.write_all(b"go\n");
            let _ = stdin.flush();
        }
    };
    wait_for("ready", Duration::from_secs(120));
    let requests0 = etcd_requests(store_endpoints);
    let cpu0 = etcd_cpu_s(pids);
    let t0 = mono_ns();
    go(&mut children);
    let done = wait_for("floor_done", Duration::from_secs(300));
    let requests = requests_per_host(&requests0, &etcd_requests(store_endpoints), n);
    let last = done.iter().filter_map(|v| v["t"].as_u64()).max().unwrap_or(t0);
    let secs = last.saturating_sub(t0) as f64 / 1e9;
    let cpu = etcd_cpu_s(pids) - cpu0;
    let clients_cpu: f64 = done.iter().filter_map(|v| v["cpu_s"].as_f64()).sum();
    go(&mut children);
    wait_for("exit", Duration::from_secs(120));
    for (mut child, _) in children {
        let _ = child.wait();
    }
    // Leave the join a store as fresh as the floor found it: no keys, no history to keep.
    rt.block_on(async {
        let mut c = etcd_client::Client::connect(store_endpoints, None).await.expect("etcd client");
        let dir = format!("{PREFIX}/subnets/");
        let opts = etcd_client::DeleteOptions::new().with_prefix();
        let del = c.delete(dir, Some(opts)).await.expect("delete the floor's keys");
        let rev = del.header().map_or(0, |h| h.revision());
        c.compact(rev, Some(etcd_client::CompactionOptions::new().with_physical()))
            .await
            .expect("compact");
    });
    Floor { secs, etcd_cpu: cpu, clients_cpu, requests }
}

/// What [`measure_floor`] measured.
struct Floor {
    secs: f64,
    etcd_cpu: f64,
    clients_cpu: f64,
    /// etcd's requests per host, by method ([`requests_per_host`]).
    requests: String,
}

fn coordinator(n: u32, nworkers: u32, ttl: u64, policy: Policy) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "leases bench: {n} hosts in {nworkers} workers (nice {}), TTL {ttl} s, network {NETWORK_JSON}; load before: {}",
        std::env::var("WEFT_BENCH_NICE").unwrap_or_else(|_| "10".into()),
        load.trim()
    );
    match policy {
        Policy::Weft => {
            println!("lease policy: weft's (LeaseDriver + Keeper); route watchers: weft's")
        }
        Policy::Flannel => println!(
            "lease policy: flannel's (v0.18+, as tests/sim/mod.rs models it; renew margin TTL/4, renew retry TTL/20, an exited flanneld restarted after {FLANNEL_RESTART:?}); route watchers: weft's, as in the weft runs: only the lease policy differs"
        ),
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    // etcd's default raft timing: with the fast test timing (50/500 ms) the members of a
    // starved 2-core machine lost their leader under the join's load and never got it back.
    let (heartbeat, election) = (100, 1000);
    let cluster = support::etcd::EtcdCluster::start_with_timing(Some((heartbeat, election)));
    let pids = etcd_pids();
    println!(
        "etcd: 3 members (raft heartbeat {heartbeat} ms, election {election} ms), pids {pids:?}"
    );
    let endpoints = cluster.endpoints();
    let store = rt
        .block_on(EtcdStore::connect(EtcdOptions {
            endpoints: endpoints.clone(),
            prefix: PREFIX.into(),
            ..EtcdOptions::default()
        }))
        .expect("etcd client");
    rt.block_on(store.set_config(NETWORK_JSON.as_bytes())).expect("set config");
    let exe = std::env::current_exe().expect("own path");
    let floor = measure_floor(&exe, &endpoints, n, nworkers, ttl, &pids, &rt);
    let (floor_s, floor_cpu, floor_clients_cpu) = (floor.secs, floor.etcd_cpu, floor.clients_cpu);
    println!(
        "[floor] etcd alone: {n} plain clients each create one key while {n} plain watchers watch: every watcher has every key after {floor_s:.2} s; CPU s: etcd {floor_cpu:.1}, clients {floor_clients_cpu:.1}"
    );
    println!("[floor] etcd requests per host: {}", floor.requests);

    let dir =
        tempfile::Builder::new().prefix("weft-bench-leases-").tempdir_in("/dev/shm").expect("dir");
    let (tx, rx) = mpsc::channel();
    let mut c = Coord {
        workers: Vec::new(),
        hosts: BTreeMap::new(),
        rx,
        tx,
        changes: Vec::new(),
        routed: HashSet::new(),
        props: HashMap::new(),
        reholds: HashMap::new(),
        phase: "join",
        dup_candidates: Vec::new(),
        exe,
        endpoints: endpoints.join(","),
        ttl,
        dir: dir.path().to_path_buf(),
        policy,
    };
    let per = n.div_ceil(nworkers);
    let mut first = 0;
    while first < n {
        let count = per.min(n - first);
        c.spawn_worker(first, count);
        first += count;
    }
    let nw = c.workers.len();
    let ok = c.pump(mono_ns() + 120_000_000_000, |c| {
        c.workers.iter().all(|w| w.rss_ready_kb > 0) && c.hosts.is_empty()
    });
    assert!(ok, "workers did not connect");
    let rss_idle: f64 =
        c.workers.iter().map(|w| w.rss_ready_kb as f64 / f64::from(w.count)).sum::<f64>()
            / nw as f64;
    let mut rows = Vec::new();

    // Phase 1: join.
    let requests0 = etcd_requests(&endpoints);
    let cpu0 = etcd_cpu_s(&pids);
    let t0 = mono_ns();
    for w in &mut c.workers {
        if let Some(stdin) = w.stdin.as_mut() {
            let _ = stdin.write_all(b"go\n");
            let _ = stdin.flush();
        }
    }
    let mut ok = false;
    for _ in 0..30 {
        ok = c.pump(mono_ns() + 10_000_000_000, |c| {
            c.hosts.len() == n as usize && c.all_hold_distinct()
        });
        if ok {
            break;
        }
        let held = c.live_hosts().filter(|(_, st)| st.held).count();
        let k = c.counters();
        println!(
            "[join] +{:.0} s: {held}/{n} hold; lists {} creates {} races lost {} store errors {}; etcd CPU {:.1} s",
            (mono_ns() - t0) as f64 / 1e9,
            k["lists"],
            k["creates"],
            k["creates_lost"],
            k["store_errors"],
            etcd_cpu_s(&pids) - cpu0
        );
    }
    let settle = c.live_hosts().map(|(_, st)| st.held_t).max().unwrap_or(t0).saturating_sub(t0);
    if !ok {
        let held = c.live_hosts().filter(|(_, st)| st.held).count();
        println!("[join] NOT SETTLED after 300 s: {held}/{n} hold");
    }
    // Let propagation of the last creates finish before measuring.
    c.pump(mono_ns() + 30_000_000_000, |c| c.propagation("join").1 == 0);
    let routed = c.all_routed();
    match routed.filter(|_| ok) {
        Some(t) => {
            let weft_s = t.max(t0 + settle).saturating_sub(t0) as f64 / 1e9;
            let hosts_cpu: f64 = c.workers.iter().filter_map(|w| w.stats["cpu_s"].as_f64()).sum();
            println!(
                "[join] every host holds a distinct lease that every watcher routes after {weft_s:.2} s; CPU s: etcd {:.1}, hosts {hosts_cpu:.1} (the floor's: {floor_cpu:.1}, {floor_clients_cpu:.1})",
                etcd_cpu_s(&pids) - cpu0
            );
            // Every watcher gets every host's lease: N x N deliveries, in both. The hosts' CPU
            // is their processes' since they started (connecting, the lease logic), as the
            // floor's clients' is: an upper bound on the cost of a delivered event.
            let deliveries = f64::from(n) * f64::from(n);
            println!(
                "[join] hosts' CPU per delivered lease (N x N): weft {:.1} µs, floor {:.1} µs, ratio {:.2}",
                hosts_cpu / deliveries * 1e6,
                floor_clients_cpu / deliveries * 1e6,
                hosts_cpu / floor_clients_cpu.max(1e-9)
            );
            println!(
                "RATIO N={n}: {} {weft_s:.2} s, etcd floor {floor_s:.2} s, ratio {:.2}",
                policy.name(),
                weft_s / floor_s
            );
        }
        None => println!(
            "RATIO N={n}: {} did not settle (not every host held a distinct lease routed by every watcher), etcd floor {floor_s:.2} s",
            policy.name()
        ),
    }
    // Counted before the sleep and the store check below (whose listing is the bench's).
    let requests = requests_per_host(&requests0, &etcd_requests(&endpoints), n);
    c.sleep(Duration::from_millis(1200));
    let start = PhaseStart { before: BTreeMap::new(), cpu0, t0 };
    let (row, _) = phase_row(&c, "join", settle as f64 / 1e9, &start, &pids, &rt, &store);
    print_row(&row, policy);
    println!("[join] etcd requests per host: {requests} (the floor's: {})", floor.requests);
    let (m50, mmax) = c.memory_per_host_kb();
    println!(
        "[join] memory per host: {:.0} KiB median over workers (max {:.0}); {:.0} KiB per host with clients connected, before starting",
        m50, mmax, rss_idle
    );
    rows.push(row);

    // Phase 2: renew for two TTLs.
    c.phase = "renew";
    let before = c.counters();
    let requests0 = etcd_requests(&endpoints);
    let cpu0 = etcd_cpu_s(&pids);
    let t0 = mono_ns();
    let mut dropped = BTreeSet::new();
    let until = t0 + 2 * ttl * 1_000_000_000 + 1_000_000_000;
    while mono_ns() < until {
        c.pump(mono_ns() + 100_000_000, |_| false);
        for (h, st) in c.live_hosts() {
            if !st.held {
                dropped.insert(*h);
            }
        }
    }
    let requests = requests_per_host(&requests0, &etcd_requests(&endpoints), n);
    c.sleep(Duration::from_millis(1200));
    let start = PhaseStart { before, cpu0, t0 };
    let (row, _) = phase_row(&c, "renew", 0.0, &start, &pids, &rt, &store);
    print_row(&row, policy);
    println!("[renew] etcd requests per host in {:.0} s: {requests}", (until - t0) as f64 / 1e9);
    println!("[renew] hosts that stopped holding at some point: {}", dropped.len());
    rows.push(row);

    // Phase 3: suspend one worker past the TTL.
    c.phase = "suspend";
    let sw = nw - 1;
    let before = c.counters();
    let cpu0 = etcd_cpu_s(&pids);
    let suspended: BTreeMap<u32, Option<String>> = c
        .live_hosts()
        .filter(|(_, st)| st.worker == sw)
        .map(|(h, st)| (*h, st.subnet.clone()))
        .collect();
    let t0 = mono_ns();
    signal(c.workers[sw].pid, libc::SIGSTOP);
    c.sleep(Duration::from_secs(ttl + 5));
    let t_cont = mono_ns();
    signal(c.workers[sw].pid, libc::SIGCONT);
    let ok = c.pump(t_cont + 120_000_000_000, |c| {
        suspended.keys().all(|h| c.reholds.get(h).is_some_and(|(_, t)| *t > t_cont))
            && c.all_hold_distinct()
    });
    let back = suspended
        .keys()
        .filter_map(|h| c.reholds.get(h).map(|(_, t)| *t))
        .max()
        .unwrap_or(t_cont)
        .saturating_sub(t_cont);
    let same =
        suspended.iter().filter(|(h, s)| c.reholds.get(h).is_some_and(|(r, _)| r == *s)).count();
    if !ok {
        println!("[suspend] NOT SETTLED after 120 s");
    }
    c.sleep(Duration::from_secs(2));
    c.sleep(Duration::from_millis(1200));
    let start = PhaseStart { before, cpu0, t0 };
    let (row, repeats) = phase_row(&c, "suspend", back as f64 / 1e9, &start, &pids, &rt, &store);
    print_row(&row, policy);
    println!(
        "[suspend] {} hosts stopped {} s (TTL {ttl} s); all hold again {:.2} s after SIGCONT; {}/{} on the same subnet; {repeats} re-creates of a known route not timed",
        suspended.len(),
        ttl + 5,
        back as f64 / 1e9,
        same,
        suspended.len()
    );
    rows.push(row);

    // Phase 4: churn: one worker leaves (SIGTERM, relinquishing), a new one joins.
    c.phase = "churn";
    let before = c.counters();
    let leaving = 0;
    let nw_new = c.spawn_worker(n, per);
    let ok = c.pump(mono_ns() + 120_000_000_000, |c| c.workers[nw_new].rss_ready_kb > 0);
    assert!(ok, "new worker did not connect");
    let cpu0 = etcd_cpu_s(&pids);
    let t0 = mono_ns();
    c.workers[leaving].terminated = true;
    signal(c.workers[leaving].pid, libc::SIGTERM);
    if let Some(stdin) = c.workers[nw_new].stdin.as_mut() {
        let _ = stdin.write_all(b"go\n");
        let _ = stdin.flush();
    }
    let total = n + per;
    let ok = c.pump(t0 + 120_000_000_000, |c| {
        c.hosts.len() == total as usize
            && c.workers[leaving].exit_t.is_some()
            && c.all_hold_distinct()
    });
    if !ok {
        println!("[churn] NOT SETTLED after 120 s");
    }
    let settled = c
        .live_hosts()
        .filter(|(_, st)| st.worker == nw_new)
        .map(|(_, st)| st.held_t)
        .chain(c.workers[leaving].exit_t)
        .max()
        .unwrap_or(t0)
        .saturating_sub(t0);
    c.pump(mono_ns() + 30_000_000_000, |c| c.propagation("churn").1 == 0);
    c.sleep(Duration::from_millis(1200));
    let start = PhaseStart { before, cpu0, t0 };
    let (row, _) = phase_row(&c, "churn", settled as f64 / 1e9, &start, &pids, &rt, &store);
    print_row(&row, policy);
    let (created, _, _) = c.propagation_of("churn", Some(false));
    let (gone, _, _) = c.propagation_of("churn", Some(true));
    match policy {
        Policy::Weft => println!(
            "[churn] {per} hosts left (relinquishing), {per} joined; propagation of creates p50 {:.0} p99 {:.0} ms, of relinquishes p50 {:.0} p99 {:.0} ms",
            pct(&created, 0.5),
            pct(&created, 0.99),
            pct(&gone, 0.5),
            pct(&gone, 0.99)
        ),
        Policy::Flannel => {
            println!(
                "[churn] {per} hosts left (flanneld releases nothing: their keys expire up to {ttl} s later, and weft's route watchers keep an expired key's route, marked stale: no relinquish to time), {per} joined; propagation of creates p50 {:.0} p99 {:.0} ms",
                pct(&created, 0.5),
                pct(&created, 0.99),
            );
            c.pump(t0 + (ttl + 2) * 1_000_000_000, |_| false);
            let (two, without, orphans) = check_store(&rt, &store, &c);
            println!(
                "[churn] {} s after the SIGTERM: orphan keys {orphans} (the leavers' keys expired), nodes with 2 keys {two}, hosts without their key {without}",
                ttl + 2
            );
        }
    }
    rows.push(row);

    let (all, missing_all, _) = {
        let mut all = Vec::new();
        let mut m = 0;
        for p in ["join", "suspend", "churn"] {
            let (l, mi, _) = c.propagation(p);
            all.extend(l);
            m += mi;
        }
        all.sort_by(f64::total_cmp);
        (all, m, 0)
    };
    let (m50, _) = c.memory_per_host_kb();
    let (label, exits) = match policy {
        Policy::Weft => ("", String::new()),
        Policy::Flannel => (
            " (flannel's policy)",
            format!(
                ", flanneld exits {}",
                rows.iter().map(|r| r.counters["restarts"]).sum::<u64>()
            ),
        ),
    };
    println!(
        "SUMMARY N={n}{label}: join {:.2} s, duplicates {}, create races lost {} , renew conflicts {}, store errors {}, propagation p50 {:.0} ms p99 {:.0} ms ({} changes, {} missing), memory/host {:.0} KiB, etcd CPU s join/renew/suspend/churn {:.1}/{:.1}/{:.1}/{:.1}{exits}",
        rows[0].settle_s,
        rows.iter().map(|r| r.dups).sum::<u64>()
            + rows.iter().map(|r| (r.store_check.0 + r.store_check.1) as u64).sum::<u64>(),
        rows.iter().map(|r| r.counters["creates_lost"]).sum::<u64>(),
        rows.iter().map(|r| r.counters["renew_conflicts"]).sum::<u64>(),
        rows.iter().map(|r| r.counters["store_errors"]).sum::<u64>(),
        pct(&all, 0.5),
        pct(&all, 0.99),
        all.len(),
        missing_all,
        m50,
        rows[0].etcd_cpu,
        rows[1].etcd_cpu,
        rows[2].etcd_cpu,
        rows[3].etcd_cpu,
    );
    println!("load after: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());

    for w in &mut c.workers {
        signal(w.pid, libc::SIGKILL);
        let _ = w.child.wait();
    }
    drop(cluster);
    if std::env::var_os("WEFT_BENCH_KEEP").is_some() {
        println!("worker logs kept in {}", dir.keep().display());
    }
}
