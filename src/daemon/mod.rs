//! `weft run`: wires the lease keeper, the route watcher, the data plane and the health server
//! together.
//!
//! Start-up order follows flanneld's: flags, store client, health server, the state dir's lock
//! (waited for while another weft holds it, see [`crate::instance`]), identity, network config
//! (retried every second until it is present and valid), public IP, the route watcher, the TUN
//! device and data plane (waited for while another process has the device attached; skipped
//! with `--dataplane none`), then the lease driver acquires the lease and runs until SIGTERM or
//! SIGINT. On shutdown the lease is kept for a restart unless `--relinquish-on-exit` is given.
//!
//! This file wires; the parts live beside it: [`underlay`] (which address to publish, found at
//! start and followed while running), [`tun`] (the data plane's start and the TUN device's
//! addresser), [`netlink_watch`] (the kernel's change notifications both tasks wait on) and
//! [`config_follow`] (the store's network config against the running one: weft keeps its own
//! until a restart, and says so).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::atomic_file;
use crate::config::{BackendKind, NetworkConfig, UnderlayAddr, endpoint_ipv4};
use crate::dataplane::offload::kernel_bugs::OffloadMode;
use crate::dataplane::{Dataplane, DataplaneError, HandedDataplane, Host};
use crate::health::{self, Health};
use crate::instance::{self, Attempt, StateDirLock};
use crate::lease::driver::{DriverConfig, LeaseDriver};
use crate::lease::keeper::{Keeper, KeeperConfig};
use crate::lease::record::{Incarnation, LeaseAttrs, LeaseName, NodeId, Subnet};
use crate::lease::status::LeaseHealth;
use crate::lease::store::{LeaseFeed, Store};
use crate::lease::subnet_env::{self, ReadOutcome};
use crate::logging::LogOnce;
use crate::route::backends::BackendMismatches;
use crate::route::watcher::RouteStats;
use crate::route::{RouteTable, Routes};
use crate::stop::Stop;
use crate::time::{BootClock, Clock};
use crate::vocab::{MacAddr, WgPublicKey, WgSecret};

mod config_follow;
mod handover;
pub mod kube;
mod masq;
mod netlink_watch;
mod systemd;
mod tun;
mod underlay;
mod upgrade;
mod wireguard_key;

use tun::{dataplane_config, offload_decisions, run_dataplane, start_dataplane};
use underlay::Underlay;
pub(crate) use underlay::UnderlayStatus;
use underlay::{
    UnderlayFollow, find_ipv6_only_underlay, find_underlay, find_underlay6, follow_underlay,
    underlay_addrs,
};
pub use upgrade::ExecSelf;

/// What `weft run --dataplane` selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataplaneMode {
    /// Forward traffic: the TUN device, its link, address and route, and the workers.
    Tun,
    /// The control plane only (leases, subnet.env, hooks, health): no TUN, no privilege.
    None,
}

/// Everything `weft run` needs, after flag parsing.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// `--etcd-endpoints`, which the Network must not contain.
    pub etcd_endpoints: Vec<String>,
    /// `--iface`: interface name or address for the underlay.
    pub iface: Option<String>,
    /// `--public-ip`.
    pub public_ip: Option<Ipv4Addr>,
    /// `--public-ipv6` (used on a dual-stack vxlan network).
    pub public_ipv6: Option<Ipv6Addr>,
    /// `--subnet-file`.
    pub subnet_file: PathBuf,
    /// `--state-dir`.
    pub state_dir: PathBuf,
    /// `--wireguard-key-file` (`WIREGUARD_KEY_FILE`); `None`: in the state dir.
    pub wireguard_key_file: Option<PathBuf>,
    /// `--subnet-lease-ttl`.
    pub lease_ttl: Duration,
    /// `--subnet-lease-renew-margin` (`None`: `min(60 min, ttl / 4)`).
    pub renew_margin: Option<Duration>,
    /// `--healthz-ip`.
    pub healthz_ip: IpAddr,
    /// `--healthz-port` (0: no health server).
    pub healthz_port: u16,
    /// `--healthz-idle-timeout`: the health server closes a connection that sends no request
    /// for this long.
    pub healthz_idle_timeout: Duration,
    /// `--on-subnet-change`.
    pub on_subnet_change: Option<String>,
    /// `--on-lease-lost`.
    pub on_lease_lost: Option<String>,
    /// `--hook-timeout`.
    pub hook_timeout: Duration,
    /// `--relinquish-on-exit`.
    pub relinquish_on_exit: bool,
    /// `--ip-masq`: written to subnet.env, and weft's masquerade rules installed
    /// ([`masq`]).
    pub ip_masq: bool,
    /// `--ip-masq-random-fully`: masquerade `fully-random` (flanneld's default).
    pub ip_masq_random_fully: bool,
    /// `--iptables-forward-rules`: with `--ip-masq`, accept the network's forwarded traffic.
    pub iptables_forward_rules: bool,
    /// `--iptables-resync`: how often the masquerade rules are checked for drift.
    pub iptables_resync: Duration,
    /// `--dataplane`.
    pub dataplane: DataplaneMode,
    /// `--tun-name`.
    pub tun_name: String,
    /// `--workers`.
    pub workers: usize,
    /// `--tun-offload` (`--no-tun-offload`: off).
    pub tun_offload: OffloadMode,
    /// `--udp-gso` (`--no-udp-gso`: off).
    pub udp_gso: OffloadMode,
    /// `--gso-retry-after`.
    pub gso_retry_after: Duration,
    /// `--gso-never-equal-tail`: the equal-tail workaround whatever the kernel (benchmarks).
    pub gso_never_equal_tail: bool,
    /// `--udp-gro` (`--no-udp-gro`: off).
    pub udp_gro: OffloadMode,
    /// Not `--no-batching`.
    pub batching: bool,
    /// `--worker-threads 1`.
    pub one_thread: bool,
    /// `--spin`: the longest a one-thread worker keeps looking after a small step.
    pub spin: Duration,
    /// `--worker-slice`: the scheduler slice each forwarding thread asks for (zero: the
    /// kernel's default).
    pub worker_slice: Duration,
    /// `--stale-route-ttl`: how long a peer's route is trusted after its key is gone.
    pub stale_route_ttl: Duration,
    /// `--netlink-resync`: how often the TUN device's link state is read for drift when no
    /// netlink notification said it changed.
    pub netlink_resync: Duration,
    /// `--takeover`: take everything over from the weft running on the state dir.
    pub takeover: bool,
    /// What `SIGHUP` re-executes (`None`: the binary's path could not be read at start).
    pub exec: Option<ExecSelf>,
}

/// The longest state file weft reads (a node ID or a MAC is a few dozen bytes).
const MAX_STATE_FILE_LEN: u64 = 4096;

/// The node's persistent identity, from `<state-dir>/node-id` (created on first start).
pub(crate) fn load_node_id(state_dir: &Path) -> anyhow::Result<NodeId> {
    let path = state_dir.join("node-id");
    match atomic_file::read(&path, MAX_STATE_FILE_LEN) {
        Ok(Some(bytes)) => {
            let text = String::from_utf8_lossy(&bytes);
            NodeId::parse(text.trim()).map_err(|e| {
                anyhow::anyhow!(
                    "{}: not a valid node ID ({e}). It is this node's identity, so weft will \
                     not guess: delete the file to give this node a new identity",
                    path.display()
                )
            })
        }
        Ok(None) => {
            let id = NodeId::generate();
            write_state_file(state_dir, "node-id", id.as_str())?;
            info!(node_id = %id, path = %path.display(), "generated a new node identity");
            Ok(id)
        }
        Err(e) => Err(e).context(
            "reading this node's identity; weft will not guess it: fix or delete the file",
        ),
    }
}

/// A stable, locally administered unicast MAC for the VTEP, kept in `<state-dir>/vtep-mac`.
pub(crate) fn load_vtep_mac(state_dir: &Path) -> anyhow::Result<MacAddr> {
    let path = state_dir.join("vtep-mac");
    match atomic_file::read(&path, MAX_STATE_FILE_LEN) {
        Ok(Some(bytes)) => {
            if let Some(mac) =
                std::str::from_utf8(&bytes).ok().and_then(|t| MacAddr::parse(t.trim()))
            {
                return Ok(mac);
            }
            warn!(path = %path.display(), "ignoring an unreadable VTEP MAC file; generating a new MAC");
        }
        Ok(None) => {}
        Err(e) => warn!(error = %e, "ignoring the VTEP MAC file; generating a new MAC"),
    }
    let mut mac: [u8; 6] = rand::random();
    mac[0] = (mac[0] & 0xfe) | 0x02;
    let mac = MacAddr(mac);
    write_state_file(state_dir, "vtep-mac", &mac.to_string())?;
    Ok(mac)
}

/// This node's WireGuard private key on a wireguard network ([`wireguard_key`]: made on the
/// first start), `None` on any other backend.
pub(crate) fn load_wireguard_key(
    opts: &RunOptions,
    network: &NetworkConfig,
) -> anyhow::Result<Option<WgSecret>> {
    if network.backend.kind != BackendKind::Wireguard {
        return Ok(None);
    }
    let path = wireguard_key::key_path(&opts.state_dir, opts.wireguard_key_file.as_deref());
    wireguard_key::load_or_create(&path).map(Some)
}

/// Writes `<dir>/<name>` (a line) with [`atomic_file::write`], mode 0600; creates the state dir
/// (0700) if missing.
fn write_state_file(dir: &Path, name: &str, contents: &str) -> anyhow::Result<()> {
    atomic_file::create_dir(dir, atomic_file::PRIVATE_DIR_MODE)
        .context("creating the state dir")?;
    atomic_file::write(
        &dir.join(name),
        format!("{contents}\n").as_bytes(),
        atomic_file::PRIVATE_MODE,
    )
    .context("writing a state file")?;
    Ok(())
}

/// The lease value this node publishes. On a dual-stack vxlan network (`public_ipv6` given)
/// it adds `PublicIPv6` and `BackendV6Data`, whose `VtepMAC` is the same MAC: weft's one TUN
/// device carries both halves (flannel's kernel peers program `flannel-v6.<VNI>` with it).
/// A wireguard lease carries `wireguard_key`, this node's public key, and its listen port, as
/// flannel's (`{"PublicKey":"<base64>","Port":51820}`); with IPv6 enabled, `BackendV6Data` the
/// same key and `ListenPortV6` (flannel's `newSubnetAttrs` writes both halves so, whatever the
/// `Mode`). An IPv6-only lease carries `BackendV6Data` alone, as flannel's.
pub fn lease_attrs(
    network: &NetworkConfig,
    public_ip: Ipv4Addr,
    public_ipv6: Option<Ipv6Addr>,
    vtep_mac: MacAddr,
    wireguard_key: Option<WgPublicKey>,
) -> LeaseAttrs {
    let vxlan_data =
        || serde_json::json!({ "VNI": network.backend.vni, "VtepMAC": vtep_mac.to_string() });
    let wireguard_data = |port: u16| {
        wireguard_key.map(|key| serde_json::json!({ "PublicKey": key.to_string(), "Port": port }))
    };
    let public_ipv6 =
        public_ipv6.filter(|_| network.ipv6.is_some() && network.backend.kind.carries_ipv6());
    let (backend_type, backend_data) = match network.backend.kind {
        BackendKind::Vxlan => (Some("vxlan".to_string()), network.leases_ipv4().then(vxlan_data)),
        // flannel's udp backend writes no BackendType; weft does the same so flannel peers
        // treat weft's udp leases as their own.
        BackendKind::Udp => (None, None),
        // flannel's host-gw: its type and no data.
        BackendKind::HostGw => (Some("host-gw".to_string()), None),
        // flannel's ipip: its type and no data (the peer is its PublicIP alone).
        BackendKind::Ipip => (Some("ipip".to_string()), None),
        // flannel's alloc backend writes neither (its value is PublicIP alone, like udp's).
        BackendKind::Alloc => (None, None),
        BackendKind::Wireguard => (
            Some("wireguard".to_string()),
            wireguard_data(network.backend.port).filter(|_| network.leases_ipv4()),
        ),
    };
    let backend_v6_data = public_ipv6.and_then(|_| match network.backend.kind {
        BackendKind::Wireguard => wireguard_data(network.backend.wireguard.listen_port_v6),
        _ => Some(vxlan_data()),
    });
    LeaseAttrs {
        // An IPv6-only node has no IPv4 underlay: `0.0.0.0`, as flannel writes it.
        public_ip: if network.leases_ipv4() { public_ip } else { Ipv4Addr::UNSPECIFIED },
        public_ipv6,
        backend_type,
        backend_data,
        backend_v6_data,
        node_id: None,
        incarnation: None,
    }
}

/// The etcd endpoints given as IPv4 addresses (host names are not resolved here).
pub fn etcd_endpoint_addrs(etcd_endpoints: &[String]) -> Vec<UnderlayAddr> {
    etcd_endpoints
        .iter()
        .filter_map(|e| {
            endpoint_ipv4(e)
                .map(|addr| UnderlayAddr { what: format!("the etcd endpoint {e}"), addr })
        })
        .collect()
}

/// What a dual-stack config means for the udp backend, said once at start: flannel's udp
/// backend leases an IPv6 half (and writes it to subnet.env) but carries IPv4 only.
pub fn udp_ipv6_notice(cfg: &NetworkConfig) -> Option<String> {
    let v6 = cfg.ipv6.as_ref().filter(|_| cfg.backend.kind == BackendKind::Udp)?;
    Some(format!(
        "the network config enables IPv6 (IPv6Network {}) but the udp backend carries IPv4 \
         only, as flannel's: each lease gets an IPv6 half (in its key and in subnet.env), and \
         IPv6 packets are not forwarded (docs/dual-stack.md)",
        v6.network
    ))
}

/// Reads the network config, retrying every second until it is present, valid and something
/// (flanneld does the same), or until `shutdown`.
pub(crate) async fn wait_for_config(
    store: &dyn Store,
    shutdown: &mut watch::Receiver<bool>,
) -> anyhow::Result<Option<NetworkConfig>> {
    let mut said = LogOnce::default();
    loop {
        let problem = match store.config().await {
            Ok(Some(raw)) => match NetworkConfig::parse(&raw) {
                Ok(cfg) => return Ok(Some(cfg)),
                Err(e) => format!("the network config in the store is invalid: {e}"),
            },
            Ok(None) => {
                "no network config in the store yet (set it with `weft network set`)".to_string()
            }
            Err(e) if e.is_transient() => {
                format!("store unavailable while reading the config: {e}")
            }
            Err(e) => return Err(e).context("reading the network config"),
        };
        if let Some(problem) = said.note(problem) {
            error!("{problem}; retrying every second");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.changed() => return Ok(None),
        }
    }
}

/// The previous subnet from `subnet.env`, if the file is valid and names a subnet of this
/// network. A corrupt file is ignored with a warning, never trusted.
pub(crate) fn previous_subnet(path: &Path, network: &NetworkConfig) -> Option<Subnet> {
    match subnet_env::read(path) {
        ReadOutcome::Missing => None,
        ReadOutcome::Corrupt(e) => {
            warn!(path = %path.display(), error = %e, "ignoring a corrupt subnet.env");
            None
        }
        ReadOutcome::Valid(env) if env.subnet().is_some_and(|s| network.fits(s)) => env.subnet(),
        ReadOutcome::Valid(env) => {
            warn!(path = %path.display(), subnet = ?env.subnet(), "subnet.env names a subnet outside the configured range; ignoring it");
            None
        }
    }
}

/// How the daemon gets its store client: connected once the daemon needs the store (after
/// the data plane forwards, when a handover starts it).
pub type StoreConnect =
    std::pin::Pin<Box<dyn Future<Output = anyhow::Result<Arc<dyn Store>>> + Send>>;

/// The lease `subnet.env` names (both halves), if it names a subnet of this network: what a
/// data plane taken from systemd's fd store forwards for until the keeper says otherwise.
fn previous_lease(path: &Path, network: &NetworkConfig) -> Option<LeaseName> {
    let subnet = previous_subnet(path, network)?;
    let ipv6 = match subnet_env::read(path) {
        ReadOutcome::Valid(env) => env.ipv6.map(|v6| v6.subnet),
        _ => None,
    };
    Some(LeaseName { subnet, ipv6: ipv6.filter(|_| network.ipv6.is_some()) })
}

/// Runs the daemon until `stop` is requested (SIGTERM/SIGINT, a panic, see [`crate::stop`]),
/// or until it has handed everything to the next process of this node ([`handover`]); on
/// `SIGHUP` it re-executes itself, handing everything over ([`upgrade`]).
pub async fn run(opts: RunOptions, connect: StoreConnect, stop: Arc<Stop>) -> anyhow::Result<()> {
    // What systemd's fd store gave back, taken at once: nothing inherits it meanwhile.
    let stored = systemd::stored_dataplane();
    // --takeover (and this process's own image after SIGHUP): everything is asked of the weft
    // running on the state dir, which goes on as before should that fail.
    let mut incoming = None;
    if opts.takeover {
        let dir = opts.state_dir.clone();
        incoming = tokio::task::spawn_blocking(move || handover::request(&dir))
            .await
            .context("the takeover task")?
            .context("taking over from the running weft (it goes on as before)")?;
        match &incoming {
            Some(i) => info!(from_pid = i.handover.pid, "taking over from the running weft"),
            None => info!("--takeover: no weft runs on the state dir; starting afresh"),
        }
    }
    match incoming {
        Some(mut incoming) => match start_handed(&opts, &mut incoming, connect, &stop).await {
            Ok(started) => {
                // The bridge of this PID's in-place upgrade is this image's child: reaped.
                upgrade::reap_if_child(incoming.handover.pid);
                serve(opts, started, stop).await
            }
            Err(e) => {
                incoming.failed(&format!("{e:#}"));
                Err(e)
            }
        },
        None => match start_fresh(&opts, connect, &stop, stored).await? {
            Some(started) => serve(opts, started, stop).await,
            None => {
                info!("weft stopped");
                Ok(())
            }
        },
    }
}

/// Everything a started daemon runs, however it started.
struct Started {
    clock: Arc<dyn Clock>,
    health: Arc<Health>,
    lease_health: Arc<LeaseHealth>,
    health_task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// A second descriptor of the health port's listener, to hand over.
    health_fd: Option<std::os::fd::OwnedFd>,
    store: Arc<dyn Store>,
    lock: StateDirLock,
    takeover: tokio::net::UnixListener,
    node: NodeId,
    network: NetworkConfig,
    underlay: Underlay,
    public_ipv6: Option<Ipv6Addr>,
    keeper: Keeper,
    routes: Arc<Routes>,
    route_watcher: tokio::task::JoinHandle<()>,
    subnet_tx: watch::Sender<Option<LeaseName>>,
    dataplane: Option<(Arc<Dataplane>, Vec<tokio::task::JoinHandle<()>>)>,
    /// How many descriptors the data plane was taken with from systemd's fd store.
    stored_fds: usize,
}

/// The health server and the lease plane's status, as every start makes them.
fn health_parts(clock: &Arc<dyn Clock>, stop: &Arc<Stop>) -> (Arc<Health>, Arc<LeaseHealth>) {
    let health = Arc::new(Health::new());
    // The lease plane's status first: its metrics at the top of /metrics, its say on /readyz
    // first.
    let lease_health = Arc::new(LeaseHealth::new(clock.clone()));
    health.add_collector(lease_health.clone());
    let lease = lease_health.clone();
    health.add_check(Box::new(move || lease.readiness().map(Some)));
    health.add_collector(stop.clone());
    health.add_collector(Arc::new(crate::logging::LogMetrics));
    (health, lease_health)
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until the stop.
fn serve_health(
    opts: &RunOptions,
    listener: tokio::net::TcpListener,
    health: &Arc<Health>,
    stop: &Arc<Stop>,
) -> (tokio::task::JoinHandle<std::io::Result<()>>, Option<std::os::fd::OwnedFd>) {
    use std::os::fd::AsFd as _;
    let fd = listener.as_fd().try_clone_to_owned().ok();
    let mut rx = stop.subscribe();
    let until_stop = async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let limits =
        health::ServerLimits { idle_timeout: opts.healthz_idle_timeout, ..Default::default() };
    (tokio::spawn(health::serve(listener, health.clone(), limits, until_stop)), fd)
}

/// The usual start: the health port, the store, the state dir's lock (waited for), identity,
/// the network config (waited for), the underlay, the routes, the data plane (waited for while
/// another process has the device). `None`: stopped while waiting.
async fn start_fresh(
    opts: &RunOptions,
    connect: StoreConnect,
    stop: &Arc<Stop>,
    mut stored: Option<HandedDataplane>,
) -> anyhow::Result<Option<Started>> {
    let clock: Arc<dyn Clock> = Arc::new(BootClock);
    let mut shutdown_rx = stop.subscribe();
    let (health, lease_health) = health_parts(&clock, stop);
    let (health_task, health_fd) = if opts.healthz_port > 0 {
        let addr = SocketAddr::new(opts.healthz_ip, opts.healthz_port);
        let listener = health::bind(addr)
            .await
            .with_context(|| format!("binding the health server on {addr}"))?;
        info!(%addr, "health server listening");
        let (task, fd) = serve_health(opts, listener, &health, stop);
        (Some(task), fd)
    } else {
        (None, None)
    };
    let store = tokio::select! {
        store = connect => store?,
        () = stop.wait() => return stopped(health_task).await.map(|()| None),
    };

    // One weft per state dir: before the identity in it is read or anything is leased.
    let mut lock = None;
    let free = instance::wait_while_busy(&lease_health, &mut shutdown_rx, || {
        Ok(match StateDirLock::try_acquire(&opts.state_dir)? {
            Attempt::Acquired(l) => {
                lock = Some(l);
                None
            }
            Attempt::Held { path, pid } => Some(instance::held_message(&path, pid)),
        })
    })
    .await?;
    let Some(lock) = lock.filter(|_| free) else {
        return stopped(health_task).await.map(|()| None);
    };
    let takeover = upgrade::listen(&opts.state_dir)?;
    let node = load_node_id(&opts.state_dir)?;
    let incarnation = Incarnation::generate();
    info!(node_id = %node, %incarnation, "weft starting");

    let Some(network) = wait_for_config(&*store, &mut shutdown_rx).await? else {
        return stopped(health_task).await.map(|()| None);
    };
    say_network(&network, opts)?;
    let (underlay, public_ipv6) = find_underlays(&network, opts, None)?;
    let vtep_mac = load_vtep_mac(&opts.state_dir)?;
    let wireguard_key = load_wireguard_key(opts, &network)?;
    let attrs = lease_attrs(
        &network,
        underlay.public_ip,
        public_ipv6,
        vtep_mac,
        wireguard_key.as_ref().map(wireguard_key::public_key),
    );
    let previous = previous_subnet(&opts.subnet_file, &network);
    let keeper = Keeper::new(
        keeper_config(opts, &network, attrs, &node, incarnation, previous),
        clock.now(),
    );
    // A data plane from systemd's fd store still forwards for the subnet subnet.env names (its
    // device has that address): so does this process, until the keeper says otherwise.
    if opts.dataplane != DataplaneMode::Tun {
        stored = None;
    }
    let provisional = stored.as_ref().and_then(|_| previous_lease(&opts.subnet_file, &network));
    let (subnet_tx, subnet_rx) = watch::channel(provisional);
    let routes = Arc::new(Routes::new({
        let (net, len) = network.leased_network();
        RouteTable::build_in(net, len, [])
    }));
    let route_watcher = start_route_watcher(
        &network,
        &(store.clone() as Arc<dyn LeaseFeed>),
        &health,
        &routes,
        subnet_rx.clone(),
        opts.stale_route_ttl,
        &shutdown_rx,
    );
    let offloads = offload_decisions(opts);
    let stored_fds = stored.as_ref().map_or(0, |s| s.fds.len());
    let adopted = match stored {
        Some(handed) => {
            health.add_collector(Arc::new(offloads.clone()));
            let bound_for = handed.layout.public_ip();
            let cfg = dataplane_config(
                opts,
                &network,
                &underlay,
                public_ipv6,
                vtep_mac,
                &offloads,
                wireguard_key.as_ref(),
            );
            match Dataplane::adopt(cfg, routes.clone(), handed, provisional) {
                Ok(dp) => {
                    // The process that held these descriptors is gone.
                    dp.predecessor_released();
                    if let Some(bound_for) = bound_for
                        && bound_for != underlay.public_ip
                        && let Err(e) = dp.set_public_ip(underlay.public_ip)
                    {
                        warn!(error = %e, "the data plane from systemd's fd store is bound for {bound_for}; re-binding on {} failed", underlay.public_ip);
                    }
                    Some(run_dataplane(
                        dp,
                        &health,
                        subnet_rx.clone(),
                        &shutdown_rx,
                        opts.netlink_resync,
                    ))
                }
                Err(e) => {
                    warn!(error = %e, "the data plane in systemd's fd store cannot be taken: starting afresh");
                    None
                }
            }
        }
        None => None,
    };
    let dataplane = if adopted.is_some() {
        adopted
    } else if runs_dataplane(opts, &network) {
        let uses_tun = network.backend.kind.uses_tun();
        if uses_tun {
            health.add_collector(Arc::new(offloads.clone()));
        }
        // One weft per TUN device: wait while another process has it attached. Should one
        // appear between the check and the start, the start refuses it and we wait again.
        let host = Host::open().context("asking the kernel about the TUN device")?;
        loop {
            let free = instance::wait_while_busy(&lease_health, &mut shutdown_rx, || {
                Ok(if uses_tun { host.device_in_use(&opts.tun_name)? } else { None })
            })
            .await?;
            if !free {
                return stopped(health_task).await.map(|()| None);
            }
            match start_dataplane(
                dataplane_config(
                    opts,
                    &network,
                    &underlay,
                    public_ipv6,
                    vtep_mac,
                    &offloads,
                    wireguard_key.as_ref(),
                ),
                routes.clone(),
                &health,
                subnet_rx.clone(),
                &shutdown_rx,
                opts.netlink_resync,
            ) {
                Err(e) if is_tun_in_use(&e) => {
                    warn!(error = %e, "the TUN device was taken while starting");
                }
                other => break Some(other?),
            }
        }
    } else {
        None
    };
    Ok(Some(Started {
        clock,
        health,
        lease_health,
        health_task,
        health_fd,
        store,
        lock,
        takeover,
        node,
        network,
        underlay,
        public_ipv6,
        keeper,
        routes,
        route_watcher,
        subnet_tx,
        dataplane,
        stored_fds,
    }))
}

/// The start of a process that takes over from the previous one of this node (see
/// [`handover`]): the handed data plane forwards first, on the handed routes, for the handed
/// lease; the previous process is told and stops; then the health port, the store, the route
/// watcher and the keeper (going on as the previous one's incarnation) start.
async fn start_handed(
    opts: &RunOptions,
    incoming: &mut handover::Incoming,
    connect: StoreConnect,
    stop: &Arc<Stop>,
) -> anyhow::Result<Started> {
    let clock: Arc<dyn Clock> = Arc::new(BootClock);
    let shutdown_rx = stop.subscribe();
    let (health, lease_health) = health_parts(&clock, stop);
    let handed = incoming.handover.clone();
    let lock = StateDirLock::adopt(incoming.take_lock()?, &opts.state_dir)?;
    let takeover = upgrade::adopt_listener(incoming.take_takeover()?)?;
    let node = load_node_id(&opts.state_dir)?;
    if node != handed.node {
        bail!(
            "the state dir's node ID is {node}, the running weft's is {}: not taking over",
            handed.node
        );
    }
    info!(node_id = %node, incarnation = %handed.keeper.incarnation, from_pid = handed.pid, "weft starting, taking over");
    let network =
        NetworkConfig::parse(handed.network.as_bytes()).context("the handed network config")?;
    say_network(&network, opts)?;
    let (underlay, public_ipv6) =
        find_underlays(&network, opts, Some((handed.public_ip, handed.public_ipv6)))?;
    let vtep_mac = load_vtep_mac(&opts.state_dir)?;
    let wireguard_key = load_wireguard_key(opts, &network)?;
    let attrs = lease_attrs(
        &network,
        underlay.public_ip,
        public_ipv6,
        vtep_mac,
        wireguard_key.as_ref().map(wireguard_key::public_key),
    );
    let previous = previous_subnet(&opts.subnet_file, &network);
    let cfg =
        keeper_config(opts, &network, attrs, &node, handed.keeper.incarnation.clone(), previous);
    let keeper = Keeper::take_over(cfg, &handed.keeper, clock.now()).map_err(|e| anyhow!(e))?;
    let lease = keeper.held().map(|h| h.name());
    let (subnet_tx, subnet_rx) = watch::channel(lease);
    let peers = handed.routes.iter().filter_map(handover::HandedRoute::peer);
    let routes = Arc::new(Routes::new({
        let (net, len) = network.leased_network();
        RouteTable::build_in(net, len, peers)
    }));
    let offloads = offload_decisions(opts);
    let dataplane = match (&handed.dataplane, runs_dataplane(opts, &network)) {
        (Some(layout), true) => {
            if network.backend.kind.uses_tun() {
                health.add_collector(Arc::new(offloads.clone()));
            }
            let fds = std::mem::take(&mut incoming.dataplane);
            let dp = Dataplane::adopt(
                dataplane_config(
                    opts,
                    &network,
                    &underlay,
                    public_ipv6,
                    vtep_mac,
                    &offloads,
                    wireguard_key.as_ref(),
                ),
                routes.clone(),
                HandedDataplane { layout: layout.clone(), fds },
                lease,
            )
            .context("taking over the data plane")?;
            Some(dp)
        }
        (None, false) => None,
        (handed_dp, _) => bail!(
            "the running weft has {} data plane, this one is started with --dataplane {:?} on \
             the {} backend: restart instead",
            if handed_dp.is_some() { "a" } else { "no" },
            opts.dataplane,
            network.backend.kind,
        ),
    };
    // Forwarding: the previous process may stop now, and answers once it has.
    let conn = incoming.from.take();
    tokio::task::spawn_blocking(move || handover::forwarding(conn))
        .await
        .context("the takeover task")?
        .context("the running weft did not release everything")?;
    // Released: everything is this process's now.
    if let Some(dp) = &dataplane {
        dp.predecessor_released();
    }
    let dataplane = dataplane
        .map(|dp| run_dataplane(dp, &health, subnet_rx.clone(), &shutdown_rx, opts.netlink_resync));
    let listener = match incoming.health.take() {
        Some(fd) => {
            let listener = std::net::TcpListener::from(fd);
            listener.set_nonblocking(true).context("the handed health port")?;
            Some(tokio::net::TcpListener::from_std(listener).context("the handed health port")?)
        }
        None if opts.healthz_port > 0 => {
            let addr = SocketAddr::new(opts.healthz_ip, opts.healthz_port);
            let bound = health::bind(addr).await;
            Some(bound.with_context(|| format!("binding the health server on {addr}"))?)
        }
        None => None,
    };
    let (health_task, health_fd) = match listener {
        Some(l) => {
            let (task, fd) = serve_health(opts, l, &health, stop);
            (Some(task), fd)
        }
        None => (None, None),
    };
    let store = connect.await?;
    let route_watcher = start_route_watcher(
        &network,
        &(store.clone() as Arc<dyn LeaseFeed>),
        &health,
        &routes,
        subnet_rx,
        opts.stale_route_ttl,
        &shutdown_rx,
    );
    Ok(Started {
        clock,
        health,
        lease_health,
        health_task,
        health_fd,
        store,
        lock,
        takeover,
        node,
        network,
        underlay,
        public_ipv6,
        keeper,
        routes,
        route_watcher,
        subnet_tx,
        dataplane,
        stored_fds: 0,
    })
}
/// Whether this node runs a data plane: `--dataplane tun` (the default) on a backend that has
/// one (alloc, as flannel's, leases a subnet and forwards nothing).
fn runs_dataplane(opts: &RunOptions, network: &NetworkConfig) -> bool {
    opts.dataplane == DataplaneMode::Tun && network.backend.kind != BackendKind::Alloc
}

/// Says at start what the network config is and what of it weft does not do.
fn say_network(network: &NetworkConfig, opts: &RunOptions) -> anyhow::Result<()> {
    info!(network = ?network.ipv4.as_ref().map(|v4| v4.network), subnet_len = ?network.ipv4.as_ref().map(|v4| v4.subnet_len), ipv6_network = ?network.ipv6.as_ref().map(|v6| v6.network), backend = ?network.backend.kind, "network config");
    if let Some(notice) = udp_ipv6_notice(network) {
        warn!("{notice}");
    }
    if network.backend.kind == BackendKind::Alloc {
        info!("the alloc backend: a lease and subnet.env, no data plane (as flannel's alloc)");
    }
    if opts.ip_masq && opts.dataplane == DataplaneMode::None {
        warn!(
            "--ip-masq with --dataplane none: written to subnet.env only, no masquerade rules are installed"
        );
    }
    Ok(())
}

/// Finds the underlay (and the IPv6 one where the network carries IPv6), and checks it
/// against the network. `published`: the addresses a previous process of this node publishes,
/// which a handover keeps.
fn find_underlays(
    network: &NetworkConfig,
    opts: &RunOptions,
    published: Option<(Ipv4Addr, Option<Ipv6Addr>)>,
) -> anyhow::Result<(Underlay, Option<Ipv6Addr>)> {
    let public_ip = published.map(|(ip, _)| ip).or(opts.public_ip);
    let public_ipv6 = published.map_or(opts.public_ipv6, |(_, ip6)| ip6.or(opts.public_ipv6));
    let (mut underlay, public_ipv6) = if network.leases_ipv4() {
        let underlay = find_underlay(opts.iface.as_deref(), public_ip)?;
        let public_ipv6 = match &network.ipv6 {
            Some(_) if network.backend.kind.carries_ipv6() => {
                Some(find_underlay6(underlay.iface.as_deref(), public_ipv6)?)
            }
            _ => None,
        };
        (underlay, public_ipv6)
    } else {
        if let Some(ip) = opts.public_ip {
            warn!(%ip, "--public-ip is ignored: the network is IPv6-only (PublicIP is 0.0.0.0, as flannel writes it)");
        }
        let (underlay, public_ipv6) = find_ipv6_only_underlay(opts.iface.as_deref(), public_ipv6)?;
        (underlay, Some(public_ipv6))
    };
    if let Some((ip, _)) = published {
        underlay.public_ip = ip;
    }
    info!(iface = underlay.iface.as_deref().unwrap_or("?"), public_ip = %underlay.public_ip, public_ipv6 = public_ipv6.map(|a| a.to_string()), mtu = underlay.mtu, "underlay");
    network.check_underlay(&underlay_addrs(underlay.public_ip, &opts.etcd_endpoints))?;
    if let (Some(v6), Some(ip)) = (&network.ipv6, public_ipv6)
        && v6.network.contains(&ip)
    {
        bail!(
            "the public IPv6 address {ip} lies inside IPv6Network {}: the overlay would route its own underlay",
            v6.network
        );
    }
    Ok((underlay, public_ipv6))
}

/// The keeper's configuration from the flags and the network.
fn keeper_config(
    opts: &RunOptions,
    network: &NetworkConfig,
    attrs: LeaseAttrs,
    node: &NodeId,
    incarnation: Incarnation,
    previous: Option<Subnet>,
) -> KeeperConfig {
    let ttl = opts.lease_ttl;
    let renew_margin = opts.renew_margin.unwrap_or((ttl / 4).min(Duration::from_secs(3600)));
    let (presence_ttl, retry_min, retry_max) = KeeperConfig::timings_for(ttl);
    KeeperConfig {
        network: network.clone(),
        attrs,
        node: node.clone(),
        incarnation,
        ttl,
        renew_margin,
        presence_ttl,
        previous,
        retry_min,
        retry_max,
        seed: rand::random(),
    }
}

/// Runs a started daemon: the underlay follower, the lease driver, the upgrade paths
/// (takeover requests, SIGHUP), until the stop or a handover to the next process.
async fn serve(opts: RunOptions, started: Started, stop: Arc<Stop>) -> anyhow::Result<()> {
    let Started {
        clock,
        health,
        lease_health,
        health_task,
        health_fd,
        store,
        lock,
        takeover,
        node,
        network,
        underlay,
        public_ipv6,
        keeper,
        routes,
        route_watcher,
        subnet_tx,
        dataplane,
        stored_fds,
    } = started;
    let shutdown_rx = stop.subscribe();
    // A worker thread that panicked too often: shut down like on SIGTERM (the lease is kept
    // unless --relinquish-on-exit), then exit non-zero so that the supervisor restarts weft.
    if let Some((dp, _)) = &dataplane {
        let given_up = dp.given_up();
        let stop = stop.clone();
        tokio::spawn(async move {
            given_up.await;
            error!("a data plane worker is down for good: shutting down to be restarted");
            stop.request();
        });
    }
    let (public_ip_tx, public_ip_rx) = watch::channel(underlay.public_ip);
    let underlay_status = Arc::new(UnderlayStatus::default());
    health.add_collector(underlay_status.clone());
    let status = underlay_status.clone();
    health.add_check(Box::new(move || status.problem().map_or(Ok(None), Err)));
    let follower = tokio::spawn(follow_underlay(
        UnderlayFollow {
            // An IPv6-only node publishes no IPv4 address: nothing to follow.
            iface: underlay
                .iface
                .clone()
                .filter(|_| opts.public_ip.is_none() && network.leases_ipv4()),
            explicit: opts.public_ip.filter(|_| network.leases_ipv4()),
            network: network.clone(),
            etcd_endpoints: opts.etcd_endpoints.clone(),
            resync: opts.netlink_resync,
        },
        underlay.public_ip,
        dataplane.as_ref().map(|(dp, _)| dp.clone()),
        store.clone(),
        public_ip_tx,
        underlay_status,
        shutdown_rx.clone(),
    ));
    let config_follower = follow_config(&store, &network, &health, &shutdown_rx);
    let backend_watch =
        dataplane.as_ref().map(|_| watch_backends(&routes, &network, &health, &shutdown_rx));
    let masq = (opts.dataplane == DataplaneMode::Tun)
        .then(|| {
            masq::start(&opts, &network, &node, &health, subnet_tx.subscribe(), shutdown_rx.clone())
        })
        .flatten();
    let mtu = network.backend.overlay_mtu(underlay.mtu);
    let mut driver = LeaseDriver::new(
        store,
        keeper,
        node.clone(),
        clock,
        lease_health.clone(),
        DriverConfig {
            network: network.clone(),
            subnet_file: opts.subnet_file.clone(),
            mtu,
            ip_masq: opts.ip_masq,
            on_subnet_change: opts.on_subnet_change.clone(),
            on_lease_lost: opts.on_lease_lost.clone(),
            hook_timeout: opts.hook_timeout,
            state_dir: opts.state_dir.clone(),
            relinquish_on_exit: opts.relinquish_on_exit,
        },
        subnet_tx,
    );
    driver.follow_public_ip(public_ip_rx.clone());
    let upgrades = upgrade::Upgrades {
        node,
        network,
        public_ip: public_ip_rx,
        public_ipv6,
        lock,
        health: health_fd,
        dataplane: dataplane.as_ref().map(|(dp, _)| dp.clone()),
        routes,
        driver: driver.handover_control(),
        exec: opts.exec.clone(),
        handed_to: Arc::default(),
    };
    let handed_over = upgrades.handed_over();
    let notifier = tokio::spawn(systemd::run(
        health.clone(),
        lease_health.clone(),
        dataplane.as_ref().map(|(dp, _)| dp.clone()),
        stored_fds,
        stop.clone(),
    ));
    let upgrader = tokio::spawn(upgrade::serve(upgrades, takeover, stop.clone()));
    // A task of its own: should the driver panic, the data plane is still stopped below (the
    // lease is then left to its TTL or to the next weft on this state dir).
    if let Err(e) = tokio::spawn(driver.run(shutdown_rx)).await {
        error!(error = %e, "the lease driver ended abnormally");
    }
    // The driver ends at the stop, or once it handed the lease over: stop everything else.
    stop.request();
    let upgrade_failed = match tokio::time::timeout(Duration::from_secs(3), upgrader).await {
        Ok(Ok(Err(why))) => Some(why),
        _ => None,
    };
    let _ = tokio::time::timeout(Duration::from_secs(3), follower).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), notifier).await;
    let _ = tokio::time::timeout(Duration::from_secs(3), route_watcher).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), config_follower).await;
    if let Some(task) = backend_watch {
        let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
    }
    let mut given_up = false;
    if let Some((dp, tasks)) = dataplane {
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
        given_up = dp.has_given_up();
        tokio::task::spawn_blocking(move || dp.stop()).await.ok();
    }
    masq::finish(masq, handed_over.get().is_some()).await;
    let result = stopped(health_task).await;
    if let Some(pid) = handed_over.get() {
        info!(to_pid = pid, "handed over: the next weft forwards and holds the lease");
    }
    if given_up {
        bail!("a data plane worker thread panicked too often (see the log above)");
    }
    if let Some(why) = upgrade_failed {
        bail!(why);
    }
    result
}

/// Starts following the store's network config against the running one
/// ([`config_follow`]), with its metrics and its note on `/readyz`.
fn follow_config(
    store: &Arc<dyn Store>,
    network: &NetworkConfig,
    health: &Arc<Health>,
    shutdown_rx: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let status = Arc::new(config_follow::ConfigStatus::default());
    health.add_collector(status.clone());
    let note = status.clone();
    health.add_check(Box::new(move || Ok(note.note())));
    tokio::spawn(config_follow::follow(store.clone(), network.clone(), status, shutdown_rx.clone()))
}

/// Starts telling about the peers this host cannot reach because their lease announces
/// another backend ([`crate::route::backends`]), with its gauge and its note on `/readyz`:
/// such peers leave this host ready (see there why).
fn watch_backends(
    routes: &Arc<Routes>,
    network: &NetworkConfig,
    health: &Arc<Health>,
    shutdown_rx: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let local = network.backend.kind;
    let status = Arc::new(BackendMismatches::new(local));
    health.add_collector(status.clone());
    let note = status.clone();
    health.add_check(Box::new(move || Ok(note.note())));
    tokio::spawn(crate::route::backends::watch(routes.clone(), local, status, shutdown_rx.clone()))
}

/// Waits (briefly) for the health server to stop, and says so.
async fn stopped(
    health_task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
) -> anyhow::Result<()> {
    if let Some(t) = health_task {
        let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
    }
    info!("weft stopped");
    Ok(())
}

/// Whether starting the data plane failed because the TUN device is another process's.
fn is_tun_in_use(e: &anyhow::Error) -> bool {
    e.downcast_ref::<DataplaneError>().is_some_and(DataplaneError::is_device_in_use)
}

/// Starts the route watcher, which publishes the routes the data plane forwards by into
/// `routes`. It runs in control-plane-only mode too: it is what watches every key under
/// `subnets/`, so it is what warns about keys that are not leases of this network
/// (`weft_route_ignored_keys`), and `/metrics` shows the routes a data plane would use.
fn start_route_watcher(
    network: &NetworkConfig,
    store: &Arc<dyn LeaseFeed>,
    health: &Arc<Health>,
    routes: &Arc<Routes>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    stale_ttl: Duration,
    shutdown_rx: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let stats = Arc::new(RouteStats::default());
    health.add_collector(stats.clone());
    tokio::spawn(crate::route::watcher::run(
        store.clone(),
        routes.clone(),
        network.clone(),
        subnet_rx,
        stats,
        stale_ttl,
        shutdown_rx.clone(),
    ))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// A dual-stack config is taken at once, on either backend; the udp backend's says at
    /// start that IPv6 is not carried.
    #[tokio::test(start_paused = true)]
    async fn a_dual_stack_config_is_served_on_both_backends() {
        use crate::lease::memory::MemoryStore;
        use crate::time::ManualClock;
        for (backend, carried) in [("vxlan", true), ("udp", false)] {
            let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
            let raw = format!(
                r#"{{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{{"Type":"{backend}"}}}}"#
            );
            store.client("admin").set_config(raw.as_bytes()).await.unwrap();
            let (_stop, mut stop_rx) = watch::channel(false);
            let reader = store.client("node");
            let got = tokio::time::timeout(
                Duration::from_secs(5),
                wait_for_config(&reader, &mut stop_rx),
            )
            .await
            .expect("taken at once")
            .unwrap()
            .expect("a config");
            assert_eq!(
                got.ipv6.map(|v6| v6.network.to_string()).as_deref(),
                Some("fd00:10:244::/56")
            );
            assert_eq!(udp_ipv6_notice(&got).is_none(), carried, "{backend}");
        }
    }

    /// A vxlan node on a dual-stack network publishes its IPv6 underlay address and the same
    /// VTEP MAC for the IPv6 half; a udp node (flannel's udp backend publishes none) and an
    /// IPv4-only network publish neither.
    #[test]
    fn the_lease_value_carries_the_ipv6_underlay_only_where_ipv6_is_carried() {
        let mac = MacAddr([2, 0, 0, 0, 0, 7]);
        let v4 = Ipv4Addr::new(192, 0, 2, 7);
        let v6: Ipv6Addr = "2001:db8::7".parse().unwrap();
        let config = |backend: &str, dual: bool| {
            let ipv6 =
                if dual { r#","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56""# } else { "" };
            let raw = format!(
                r#"{{"Network":"10.244.0.0/16"{ipv6},"Backend":{{"Type":"{backend}","VNI":4}}}}"#
            );
            NetworkConfig::parse(raw.as_bytes()).unwrap()
        };
        let attrs = lease_attrs(&config("vxlan", true), v4, Some(v6), mac, None);
        assert_eq!(attrs.public_ipv6, Some(v6));
        let want = serde_json::json!({ "VNI": 4, "VtepMAC": "02:00:00:00:00:07" });
        assert_eq!(attrs.backend_v6_data, Some(want.clone()));
        assert_eq!(attrs.backend_data, Some(want.clone()));
        for (backend, dual) in [("udp", true), ("vxlan", false)] {
            let attrs = lease_attrs(&config(backend, dual), v4, Some(v6), mac, None);
            assert_eq!((attrs.public_ipv6, attrs.backend_v6_data), (None, None), "{backend}");
        }
        // IPv6-only: flannel's shape, whatever IPv4 address the host has.
        let raw = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan","VNI":4}}"#;
        let attrs =
            lease_attrs(&NetworkConfig::parse(raw.as_bytes()).unwrap(), v4, Some(v6), mac, None);
        assert_eq!((attrs.public_ip, attrs.public_ipv6), (Ipv4Addr::UNSPECIFIED, Some(v6)));
        assert_eq!((&attrs.backend_data, &attrs.backend_v6_data), (&None, &Some(want)));
        assert_eq!(attrs.public_addr(), std::net::IpAddr::V6(v6));
        let text = String::from_utf8(attrs.to_json()).unwrap();
        assert!(text.starts_with(r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::7","BackendType":"vxlan","BackendV6Data""#), "{text}");
    }

    /// A wireguard lease is flannel's (`newSubnetAttrs`): its type, and the node's public key
    /// and listen port in BackendData; and weft's route watchers read it back as that peer.
    #[test]
    fn a_wireguard_lease_carries_the_key_and_port_as_flannel_writes_them() {
        const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
        let key = WgPublicKey::parse(KEY).unwrap();
        let raw =
            r#"{"Network":"10.244.0.0/16","Backend":{"Type":"wireguard","ListenPort":51000}}"#;
        let network = NetworkConfig::parse(raw.as_bytes()).unwrap();
        let mac = MacAddr([2, 0, 0, 0, 0, 7]);
        let attrs = lease_attrs(&network, Ipv4Addr::new(192, 0, 2, 7), None, mac, Some(key));
        let text = String::from_utf8(attrs.to_json()).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"PublicIP":"192.0.2.7","PublicIPv6":null,"BackendType":"wireguard","BackendData":{{"Port":51000,"PublicKey":"{KEY}"}}}}"#
            )
        );
        let stored = crate::lease::record::StoredLease {
            subnet: "10.244.7.0/24".parse().unwrap(),
            ipv6: None,
            attrs,
            create_revision: crate::lease::record::Revision(1),
            mod_revision: crate::lease::record::Revision(1),
            lease_id: crate::lease::record::StoreLeaseId(1),
        };
        let peer = crate::route::Peer::from_lease(&stored).unwrap();
        assert_eq!(peer.backend, crate::route::PeerBackend::Wireguard { key, port: Some(51000) });
        // And through a handover to a re-executed weft.
        let handed = handover::HandedRoute::of(&peer);
        assert_eq!(handed.peer(), Some(peer));
    }

    /// On a network with IPv6 enabled, a wireguard lease carries both halves as flannel's
    /// `newSubnetAttrs` writes them (one key; `ListenPort` in BackendData, `ListenPortV6` in
    /// BackendV6Data; an IPv6-only lease BackendV6Data alone, PublicIP 0.0.0.0), and weft reads
    /// both back into the peer's route, through a handover too.
    #[test]
    fn a_dual_stack_wireguard_lease_carries_both_halves_as_flannel_writes_them() {
        use crate::lease::record::{Revision, StoreLeaseId, StoredLease};
        use crate::route::{Peer, PeerBackend, Wireguard6};
        const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
        let key = WgPublicKey::parse(KEY).unwrap();
        let v6: Ipv6Addr = "2001:db8::7".parse().unwrap();
        let mac = MacAddr([2, 0, 0, 0, 0, 7]);
        let half: crate::vocab::Ipv6Subnet = "fd00:10:244:7::/64".parse().unwrap();
        let dual = r#"{"Network":"10.244.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"wireguard","ListenPort":51000,"ListenPortV6":51001}}"#;
        let network = NetworkConfig::parse(dual.as_bytes()).unwrap();
        let attrs = lease_attrs(&network, Ipv4Addr::new(192, 0, 2, 7), Some(v6), mac, Some(key));
        assert_eq!(
            String::from_utf8(attrs.to_json()).unwrap(),
            format!(
                r#"{{"PublicIP":"192.0.2.7","PublicIPv6":"2001:db8::7","BackendType":"wireguard","BackendData":{{"Port":51000,"PublicKey":"{KEY}"}},"BackendV6Data":{{"Port":51001,"PublicKey":"{KEY}"}}}}"#
            )
        );
        let stored = |subnet, attrs| StoredLease {
            subnet,
            ipv6: Some(half),
            attrs,
            create_revision: Revision(1),
            mod_revision: Revision(1),
            lease_id: StoreLeaseId(1),
        };
        let peer = Peer::from_lease(&stored("10.244.7.0/24".parse().unwrap(), attrs)).unwrap();
        assert_eq!(peer.backend, PeerBackend::Wireguard { key, port: Some(51000) });
        let p6 = peer.ipv6.unwrap();
        assert_eq!((p6.subnet, p6.public_ip), (half, v6));
        assert_eq!(p6.wireguard, Some(Wireguard6 { key, port: Some(51001) }));
        assert_eq!(handover::HandedRoute::of(&peer).peer(), Some(peer));

        let only = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"wireguard"}}"#;
        let network = NetworkConfig::parse(only.as_bytes()).unwrap();
        let attrs = lease_attrs(&network, Ipv4Addr::new(192, 0, 2, 7), Some(v6), mac, Some(key));
        assert_eq!(
            String::from_utf8(attrs.to_json()).unwrap(),
            format!(
                r#"{{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::7","BackendType":"wireguard","BackendV6Data":{{"Port":51821,"PublicKey":"{KEY}"}}}}"#
            )
        );
        let peer = Peer::from_lease(&stored(crate::vocab::Subnet::from(half), attrs)).unwrap();
        assert_eq!(peer.backend, PeerBackend::Wireguard { key, port: Some(51821) });
        assert_eq!(peer.ipv6.unwrap().wireguard, Some(Wireguard6 { key, port: Some(51821) }));
        assert_eq!(handover::HandedRoute::of(&peer).peer(), Some(peer));
    }

    #[test]
    fn node_id_is_generated_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_node_id(dir.path()).unwrap();
        let b = load_node_id(dir.path()).unwrap();
        assert_eq!(a, b);
        fs::write(dir.path().join("node-id"), "NOT AN ID!").unwrap();
        let e = load_node_id(dir.path()).unwrap_err().to_string();
        assert!(e.contains("node-id") && e.contains("delete the file"), "{e}");
    }

    #[test]
    fn state_files_are_private_and_symlinks_are_not_followed() {
        use std::os::unix::fs::{PermissionsExt as _, symlink};
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        load_vtep_mac(&state).unwrap();
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(&state.join("vtep-mac")), 0o600);
        load_node_id(&state).unwrap();
        assert_eq!(mode(&state.join("node-id")), 0o600);

        // A symlinked node-id is refused, naming it, not followed.
        let outside = tmp.path().join("outside");
        fs::write(&outside, b"precious").unwrap();
        fs::remove_file(state.join("node-id")).unwrap();
        symlink(&outside, state.join("node-id")).unwrap();
        let e = format!("{:#}", load_node_id(&state).unwrap_err());
        assert!(e.contains("node-id: is a symbolic link"), "{e}");
        // A symlinked vtep-mac is replaced by a file of a new MAC; the target is untouched.
        fs::remove_file(state.join("vtep-mac")).unwrap();
        symlink(&outside, state.join("vtep-mac")).unwrap();
        load_vtep_mac(&state).unwrap();
        assert!(fs::symlink_metadata(state.join("vtep-mac")).unwrap().is_file());
        assert_eq!(fs::read(&outside).unwrap(), b"precious");
    }
}
