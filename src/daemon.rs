//! `weft run`: wires the lease keeper, the route watcher, the data plane and the health server
//! together.
//!
//! Start-up order follows flanneld's: flags, store client, health server, the state dir's lock
//! (waited for while another weft holds it, see [`crate::instance`]), identity, network config
//! (retried every second until it is present and valid), public IP, the route watcher, the TUN
//! device and data plane (waited for while another process has the device attached; skipped
//! with `--dataplane none`), then the lease driver acquires the lease and runs until SIGTERM or
//! SIGINT. On shutdown the lease is kept for a restart unless `--relinquish-on-exit` is given.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{error, info, warn};

use crate::atomic_file;
use crate::config::{BackendKind, NetworkConfig, UnderlayAddr, endpoint_ipv4};
use crate::dataplane::drift::DriftLog;
use crate::dataplane::driver::{Dataplane, DataplaneConfig, DataplaneError, Ipv6Dataplane};
use crate::dataplane::link_watch::{ChangeWatch, Interest};
use crate::dataplane::netlink::{Netlink, NetlinkError, TunStatus};
use crate::dataplane::tun::TunError;
use crate::dataplane::wire::ethernet::MacAddr;
use crate::health::{self, Health};
use crate::instance::{self, Attempt, StateDirLock};
use crate::lease::driver::{DriverConfig, LeaseDriver};
use crate::lease::keeper::{Keeper, KeeperConfig};
use crate::lease::record::{Incarnation, LeaseAttrs, LeaseName, NodeId, Subnet};
use crate::lease::store::Store;
use crate::lease::subnet_env::{self, ReadOutcome};
use crate::logging::LogOnce;
use crate::route::watcher::RouteStats;
use crate::route::{RouteTable, Routes};
use crate::stop::Stop;
use crate::time::{BootClock, Clock};

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
    /// `--ip-masq` (only written to subnet.env; weft installs no iptables rules).
    pub ip_masq: bool,
    /// `--dataplane`.
    pub dataplane: DataplaneMode,
    /// `--tun-name`.
    pub tun_name: String,
    /// `--workers`.
    pub workers: usize,
    /// Not `--no-tun-offload`.
    pub tun_offload: bool,
    /// Not `--no-udp-gso`, and `--gso-retry-after`.
    pub udp_gso: crate::dataplane::driver::UdpGsoConfig,
    /// Not `--no-udp-gro`.
    pub udp_gro: bool,
    /// Not `--no-batching`.
    pub batching: bool,
    /// `--worker-threads 1`.
    pub one_thread: bool,
    /// `--spin`: the longest a one-thread worker keeps looking after a small step.
    pub spin: Duration,
    /// `--stale-route-ttl`: how long a peer's route is trusted after its key is gone.
    pub stale_route_ttl: Duration,
    /// `--netlink-resync`: how often the TUN device's link state is read for drift when no
    /// netlink notification said it changed.
    pub netlink_resync: Duration,
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

/// The underlay: which address to publish and the interface's MTU.
#[derive(Clone, Debug)]
pub(crate) struct Underlay {
    /// The interface name, when known.
    pub(crate) iface: Option<String>,
    /// The address published as `PublicIP`.
    pub(crate) public_ip: Ipv4Addr,
    /// The interface MTU (1500 when unknown).
    pub(crate) mtu: u32,
}

/// Finds the IPv6 underlay address to publish as `PublicIPv6`, as flanneld does on a
/// dual-stack network: `--public-ipv6` when given; else the first global IPv6 address of the
/// IPv4 underlay's interface `iface`; else (no interface known, or it has no global IPv6
/// address) that of the main table's IPv6 default route's interface. None found is an error
/// naming what to give: a dual-stack vxlan node cannot carry IPv6 without one.
pub(crate) fn find_underlay6(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
) -> anyhow::Result<Ipv6Addr> {
    if let Some(ip) = public_ipv6 {
        return Ok(ip);
    }
    let netlink = Netlink::open().context("finding the IPv6 underlay")?;
    let addrs = netlink.ipv6_addresses_by_interface().context("listing IPv6 addresses")?;
    let default6 =
        netlink.default_route6_iface().context("finding the IPv6 default route's interface")?;
    Ok(pick_underlay6(iface, &addrs, default6.as_deref())?)
}

/// Finds the underlay of an IPv6-only node, which has no IPv4 one: `--public-ipv6` when given,
/// else the first global IPv6 address of `--iface` (a name, or one of its IPv6 addresses),
/// else that of the IPv6 default route's interface. The published `PublicIP` is `0.0.0.0`, as
/// flannel writes it; the MTU is the chosen interface's.
pub(crate) fn find_ipv6_only_underlay(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
) -> anyhow::Result<(Underlay, Ipv6Addr)> {
    let netlink = Netlink::open().context("finding the IPv6 underlay")?;
    let addrs = netlink.ipv6_addresses_by_interface().context("listing IPv6 addresses")?;
    let default6 =
        netlink.default_route6_iface().context("finding the IPv6 default route's interface")?;
    let (name, addr) = pick_ipv6_only_underlay(iface, public_ipv6, &addrs, default6.as_deref())?;
    let mtu = match name.as_deref() {
        Some(n) => netlink.mtu(n).with_context(|| format!("reading the MTU of {n}"))?,
        None => None,
    }
    .unwrap_or(1500);
    Ok((Underlay { iface: name, public_ip: Ipv4Addr::UNSPECIFIED, mtu }, addr))
}

/// The interface and address of an IPv6-only node's underlay, pure (see
/// [`find_ipv6_only_underlay`]): `--iface` names an interface or one of its addresses;
/// `--public-ipv6` overrides the address (its interface is then the one holding it, if any).
pub(crate) fn pick_ipv6_only_underlay(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
    addrs: &[(String, Ipv6Addr)],
    default6: Option<&str>,
) -> Result<(Option<String>, Ipv6Addr), NoUnderlay6> {
    let holder = |ip: Ipv6Addr| addrs.iter().find(|(_, a)| *a == ip).map(|(n, _)| n.clone());
    let first_on = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(_, a)| *a);
    let none_on = |spec: &str| NoUnderlay6 { iface: Some(spec.to_owned()), default6: None };
    match (iface.map(|spec| (spec, spec.parse::<Ipv6Addr>())), public_ipv6) {
        // `--iface` is strict: its interface, or an error (never another interface's address).
        (Some((spec, Ok(ip))), public) => {
            let name = holder(ip).ok_or_else(|| none_on(spec))?;
            Ok((Some(name), public.unwrap_or(ip)))
        }
        (Some((name, Err(_))), Some(ip)) => Ok((Some(name.to_owned()), ip)),
        (Some((name, Err(_))), None) => {
            let ip = first_on(name).ok_or_else(|| none_on(name))?;
            Ok((Some(name.to_owned()), ip))
        }
        (None, Some(ip)) => Ok((holder(ip), ip)),
        (None, None) => {
            let ip = pick_underlay6(None, addrs, default6)?;
            Ok((holder(ip), ip))
        }
    }
}

/// No IPv6 underlay address was found ([`pick_underlay6`]).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the network config enables IPv6 (vxlan) but {iface} has no global IPv6 address{also}: give \
     --public-ipv6, or an --iface with one",
    iface = iface.as_deref().unwrap_or("the underlay interface"),
    also = default6.as_deref().map(|d| format!(" (nor has {d}, the IPv6 default route's)")).unwrap_or_default()
)]
pub(crate) struct NoUnderlay6 {
    /// The IPv4 underlay's interface, if known.
    iface: Option<String>,
    /// The IPv6 default route's interface, if there is one.
    default6: Option<String>,
}

/// The IPv6 underlay address, pure: the first of `addrs` (global IPv6 addresses by interface,
/// in the kernel's order) on `iface` (the IPv4 underlay's interface), else the first on
/// `default6` (the IPv6 default route's interface).
pub(crate) fn pick_underlay6(
    iface: Option<&str>,
    addrs: &[(String, Ipv6Addr)],
    default6: Option<&str>,
) -> Result<Ipv6Addr, NoUnderlay6> {
    let first_of = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(_, a)| *a);
    iface.and_then(first_of).or_else(|| default6.and_then(first_of)).ok_or_else(|| NoUnderlay6 {
        iface: iface.map(str::to_owned),
        default6: default6.map(str::to_owned),
    })
}

/// Finds the underlay as flanneld does: `--iface` (name or address), else the interface of the
/// main table's IPv4 default route (of lowest metric, asked over netlink); `--public-ip`
/// overrides the published address. The MTU is the interface's, over netlink too.
pub(crate) fn find_underlay(
    iface: Option<&str>,
    public_ip: Option<Ipv4Addr>,
) -> anyhow::Result<Underlay> {
    let netlink = Netlink::open().context("finding the underlay")?;
    let addrs = netlink.ipv4_addresses_by_interface().context("listing interfaces")?;
    let by_name = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(n, a)| (n.clone(), *a));
    let chosen = match iface {
        Some(spec) => match spec.parse::<Ipv4Addr>() {
            Ok(ip) => addrs.iter().find(|(_, a)| *a == ip).map(|(n, a)| (n.clone(), *a)),
            Err(_) => by_name(spec),
        }
        .with_context(|| format!("--iface {spec}: no such interface with an IPv4 address"))
        .map(Some)?,
        None => match public_ip {
            Some(ip) => addrs.iter().find(|(_, a)| *a == ip).map(|(n, a)| (n.clone(), *a)),
            None => netlink
                .default_route_iface()
                .context("finding the default route's interface")?
                .and_then(|n| by_name(&n)),
        },
    };
    let (name, addr) = match (chosen, public_ip) {
        (Some((n, a)), _) => (Some(n), a),
        (None, Some(ip)) => (None, ip),
        (None, None) => bail!(
            "no default route to pick the underlay interface from: give --iface or --public-ip"
        ),
    };
    let mtu = match name.as_deref() {
        Some(n) => netlink.mtu(n).with_context(|| format!("reading the MTU of {n}"))?,
        None => None,
    }
    .unwrap_or(1500);
    Ok(Underlay { iface: name, public_ip: public_ip.unwrap_or(addr), mtu })
}

/// The lease value this node publishes. On a dual-stack vxlan network (`public_ipv6` given)
/// it adds `PublicIPv6` and `BackendV6Data`, whose `VtepMAC` is the same MAC: weft's one TUN
/// device carries both halves (flannel's kernel peers program `flannel-v6.<VNI>` with it).
pub fn lease_attrs(
    network: &NetworkConfig,
    public_ip: Ipv4Addr,
    public_ipv6: Option<Ipv6Addr>,
    vtep_mac: MacAddr,
) -> LeaseAttrs {
    let vxlan_data =
        || serde_json::json!({ "VNI": network.backend.vni, "VtepMAC": vtep_mac.to_string() });
    let public_ipv6 = public_ipv6
        .filter(|_| network.ipv6.is_some() && network.backend.kind == BackendKind::Vxlan);
    let (backend_type, backend_data) = match network.backend.kind {
        // An IPv6-only lease carries BackendV6Data alone, as flannel's.
        BackendKind::Vxlan => (Some("vxlan".to_string()), network.leases_ipv4().then(vxlan_data)),
        // flannel's udp backend writes no BackendType; weft does the same so flannel peers
        // treat weft's udp leases as their own.
        BackendKind::Udp => (None, None),
    };
    LeaseAttrs {
        // An IPv6-only node has no IPv4 underlay: `0.0.0.0`, as flannel writes it.
        public_ip: if network.leases_ipv4() { public_ip } else { Ipv4Addr::UNSPECIFIED },
        public_ipv6,
        backend_type,
        backend_data,
        backend_v6_data: public_ipv6.map(|_| vxlan_data()),
        node_id: None,
        incarnation: None,
    }
}

/// The addresses the overlay must not contain: this host's public IP and every etcd endpoint
/// given as an address.
pub(crate) fn underlay_addrs(public_ip: Ipv4Addr, etcd_endpoints: &[String]) -> Vec<UnderlayAddr> {
    let mut addrs = vec![UnderlayAddr { what: "this host's public IP".into(), addr: public_ip }];
    addrs.extend(etcd_endpoint_addrs(etcd_endpoints));
    addrs
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

/// Runs the daemon until `stop` is requested (SIGTERM/SIGINT, a panic, see [`crate::stop`]).
pub async fn run(opts: RunOptions, store: Arc<dyn Store>, stop: Arc<Stop>) -> anyhow::Result<()> {
    let clock: Arc<dyn Clock> = Arc::new(BootClock);
    let mut shutdown_rx = stop.subscribe();

    let health = Arc::new(Health::new(clock.clone()));
    health.add_collector(stop.clone());
    health.add_collector(Arc::new(crate::logging::LogMetrics));
    let health_task = if opts.healthz_port > 0 {
        let addr = SocketAddr::new(opts.healthz_ip, opts.healthz_port);
        let listener = health::bind(addr)
            .await
            .with_context(|| format!("binding the health server on {addr}"))?;
        info!(%addr, "health server listening");
        let mut rx = shutdown_rx.clone();
        let stop = async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        let limits =
            health::ServerLimits { idle_timeout: opts.healthz_idle_timeout, ..Default::default() };
        Some(tokio::spawn(health::serve(listener, health.clone(), limits, stop)))
    } else {
        None
    };

    // One weft per state dir: before the identity in it is read or anything is leased.
    let mut lock = None;
    let free = instance::wait_while_busy(&health, &mut shutdown_rx, || {
        Ok(match StateDirLock::try_acquire(&opts.state_dir)? {
            Attempt::Acquired(l) => {
                lock = Some(l);
                None
            }
            Attempt::Held { path, pid } => Some(instance::held_message(&path, pid)),
        })
    })
    .await?;
    let Some(_lock) = lock.filter(|_| free) else {
        return stopped(health_task).await;
    };
    let node = load_node_id(&opts.state_dir)?;
    let incarnation = Incarnation::generate();
    info!(node_id = %node, %incarnation, "weft starting");

    let Some(network) = wait_for_config(&*store, &mut shutdown_rx).await? else {
        return stopped(health_task).await;
    };
    info!(network = ?network.ipv4.as_ref().map(|v4| v4.network), subnet_len = ?network.ipv4.as_ref().map(|v4| v4.subnet_len), ipv6_network = ?network.ipv6.as_ref().map(|v6| v6.network), backend = ?network.backend.kind, "network config");
    if let Some(notice) = udp_ipv6_notice(&network) {
        warn!("{notice}");
    }
    let (underlay, public_ipv6) = if network.leases_ipv4() {
        let underlay = find_underlay(opts.iface.as_deref(), opts.public_ip)?;
        let public_ipv6 = match &network.ipv6 {
            Some(_) if network.backend.kind == BackendKind::Vxlan => {
                Some(find_underlay6(underlay.iface.as_deref(), opts.public_ipv6)?)
            }
            _ => None,
        };
        (underlay, public_ipv6)
    } else {
        if let Some(ip) = opts.public_ip {
            warn!(%ip, "--public-ip is ignored: the network is IPv6-only (PublicIP is 0.0.0.0, as flannel writes it)");
        }
        let (underlay, public_ipv6) =
            find_ipv6_only_underlay(opts.iface.as_deref(), opts.public_ipv6)?;
        (underlay, Some(public_ipv6))
    };
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
    if opts.ip_masq {
        warn!("--ip-masq is written to subnet.env only: weft installs no iptables rules");
    }
    let vtep_mac = load_vtep_mac(&opts.state_dir)?;
    let attrs = lease_attrs(&network, underlay.public_ip, public_ipv6, vtep_mac);
    let previous = previous_subnet(&opts.subnet_file, &network);

    let ttl = opts.lease_ttl;
    let renew_margin = opts.renew_margin.unwrap_or((ttl / 4).min(Duration::from_secs(3600)));
    let (presence_ttl, retry_min, retry_max) = KeeperConfig::timings_for(ttl);
    let keeper = Keeper::new(
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
        },
        clock.now(),
    );
    let mtu = underlay.mtu.saturating_sub(u32::from(network.backend.encap_overhead()));
    let (subnet_tx, subnet_rx) = watch::channel(None);
    let (routes, route_watcher) = start_route_watcher(
        &network,
        &store,
        &health,
        subnet_rx.clone(),
        opts.stale_route_ttl,
        &shutdown_rx,
    );
    let dataplane = if opts.dataplane == DataplaneMode::Tun {
        // One weft per TUN device: wait while another process has it attached. Should one
        // appear between the check and the start, the start refuses it and we wait again.
        let netlink = Netlink::open().context("asking the kernel about the TUN device")?;
        loop {
            let free = instance::wait_while_busy(&health, &mut shutdown_rx, || {
                Ok(match netlink.tun_status(&opts.tun_name)? {
                    TunStatus::Attached(queues) => Some(format!(
                        "{}; waiting for it to be released",
                        TunError::InUse { name: opts.tun_name.clone(), queues }
                    )),
                    _ => None,
                })
            })
            .await?;
            if !free {
                return stopped(health_task).await;
            }
            match start_dataplane(
                dataplane_config(&opts, &network, &underlay, public_ipv6, vtep_mac),
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
    // A worker thread that panicked too often: shut down like on SIGTERM (the lease is kept
    // unless --relinquish-on-exit), then exit non-zero so that the supervisor restarts weft.
    let workers = dataplane.as_ref().map(|(dp, _)| dp.workers.clone());
    if let Some(w) = workers.clone() {
        let stop = stop.clone();
        tokio::spawn(async move {
            w.wait_given_up().await;
            error!("a data plane worker is down for good: shutting down to be restarted");
            stop.request();
        });
    }
    let (public_ip_tx, public_ip_rx) = watch::channel(underlay.public_ip);
    let underlay_status = Arc::new(UnderlayStatus::default());
    health.add_collector(underlay_status.clone());
    let status = underlay_status.clone();
    health.add_check(Box::new(move || status.problem()));
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
    let mut driver = LeaseDriver::new(
        store,
        keeper,
        node,
        clock,
        health,
        DriverConfig {
            network,
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
    driver.follow_public_ip(public_ip_rx);
    // A task of its own: should the driver panic, the data plane is still stopped below (the
    // lease is then left to its TTL or to the next weft on this state dir).
    if let Err(e) = tokio::spawn(driver.run(shutdown_rx)).await {
        error!(error = %e, "the lease driver ended abnormally");
        stop.request();
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), follower).await;
    let _ = tokio::time::timeout(Duration::from_secs(3), route_watcher).await;
    if let Some((dp, tasks)) = dataplane {
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
        tokio::task::spawn_blocking(move || dp.stop()).await.ok();
    }
    let result = stopped(health_task).await;
    if workers.is_some_and(|w| w.has_given_up()) {
        bail!("a data plane worker thread panicked too often (see the log above)");
    }
    result
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
    matches!(e.downcast_ref::<DataplaneError>(), Some(DataplaneError::Tun(TunError::InUse { .. })))
}

/// How often the underlay's addresses are listed without a netlink watch (or after a listing
/// failed).
const UNDERLAY_CHECK: Duration = Duration::from_secs(1);

/// What [`follow_underlay`] watches.
#[derive(Clone, Debug)]
struct UnderlayFollow {
    /// The underlay interface whose address is published (`None` when `--public-ip` is given:
    /// the published address is the operator's then, and is never changed).
    iface: Option<String>,
    /// `--public-ip`, watched only to warn when it stops being a local address.
    explicit: Option<Ipv4Addr>,
    network: NetworkConfig,
    etcd_endpoints: Vec<String>,
    /// How often the addresses are listed when no netlink notification said they changed.
    resync: Duration,
}

/// The underlay follower's say on readiness (`/readyz` is 503 while the data plane cannot receive
/// on the underlay's address) and its counter, `weft_underlay_rebind_failures_total`.
#[derive(Debug, Default)]
pub(crate) struct UnderlayStatus {
    problem: std::sync::Mutex<Option<String>>,
    rebind_failures: std::sync::atomic::AtomicU64,
}

impl UnderlayStatus {
    fn set_problem(&self, problem: Option<String>) {
        *self.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
    }

    fn problem(&self) -> Option<String> {
        self.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl prometheus_client::collector::Collector for UnderlayStatus {
    fn encode(
        &self,
        mut e: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        crate::metrics::counter(
            &mut e,
            "weft_underlay_rebind_failures_total",
            "Failed tries to re-bind the data plane's sockets on the underlay's new address.",
            self.rebind_failures.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// The address to publish instead of `current`, given the underlay interface's IPv4 addresses:
/// `None` while `current` is still one of them (an added address changes nothing), else the
/// interface's first address; `None` too while the interface has none (mid-renumbering).
pub(crate) fn next_public_ip(current: Ipv4Addr, on_iface: &[Ipv4Addr]) -> Option<Ipv4Addr> {
    if on_iface.contains(&current) {
        return None;
    }
    on_iface.first().copied()
}

/// Follows the underlay interface's address at run time (the address moves, the interface is
/// renumbered): once `current` is gone from it, re-binds the data plane's sockets on the new
/// address, drops the store's connections (they were made from the old address and die
/// silently), then publishes it (`public_ip_tx`, to the lease driver, which rewrites the lease),
/// so that peers send to it and every datagram leaves from the published `PublicIP`. An address
/// inside the Network is refused, loudly, as at start. Lists the addresses when the kernel says
/// an address, link or route changed (a netlink watch), and every `resync` besides; every
/// [`UNDERLAY_CHECK`] without a watch.
async fn follow_underlay(
    follow: UnderlayFollow,
    mut current: Ipv4Addr,
    dataplane: Option<Arc<Dataplane>>,
    store: Arc<dyn Store>,
    public_ip_tx: watch::Sender<Ipv4Addr>,
    status: Arc<UnderlayStatus>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut reporter = LogOnce::default();
    let mut explicit_was_local = false;
    let mut reconnected_for: Option<Ipv4Addr> = None;
    let mut netlink: Option<Arc<Netlink>> = None;
    // The kernel's notice of address, link and route changes (kept for the task's life:
    // dropping it ends its thread).
    let (_watch, mut changes) = start_watch(
        || ChangeWatch::start(Interest::Any),
        "the underlay's addresses",
        UNDERLAY_CHECK,
    )
    .await
    .unzip();
    loop {
        // Polled every UNDERLAY_CHECK without a watch, and after a failed listing.
        let period =
            if changes.is_some() && netlink.is_some() { follow.resync } else { UNDERLAY_CHECK };
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            changed = next_netlink_change(&mut changes) => {
                if changed.is_err() {
                    warn!(every = ?UNDERLAY_CHECK, "the netlink watch of the underlay ended: polling instead");
                    changes = None;
                }
            }
            _ = shutdown.wait_for(|v| *v) => return,
        }
        if changes.is_some() {
            // A burst of notifications (a renumbering is several) is answered by one listing.
            tokio::time::sleep(LINK_SETTLE).await;
        }
        if let Some(rx) = &mut changes {
            rx.borrow_and_update();
        }
        // One netlink socket for the whole watch, opened again only after it failed.
        let nl = match &netlink {
            Some(nl) => nl.clone(),
            None => match Netlink::open() {
                Ok(nl) => netlink.insert(Arc::new(nl)).clone(),
                Err(e) => {
                    if let Some(p) = reporter.note(format!("listing the underlay's addresses: {e}"))
                    {
                        error!("{p}");
                    }
                    continue;
                }
            },
        };
        // The netlink calls block (their socket has a thread of its own).
        let listed = tokio::task::spawn_blocking(move || nl.ipv4_addresses_by_interface())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let addrs = match listed {
            Ok(a) => a,
            Err(e) => {
                netlink = None;
                if let Some(p) = reporter.note(format!("listing the underlay's addresses: {e}")) {
                    error!("{p}");
                }
                continue;
            }
        };
        let Some(iface) = &follow.iface else {
            // A --public-ip that never was local is NAT, and fine; one that was and went is
            // worth an error: peers keep sending to it.
            if let Some(ip) = follow.explicit {
                if addrs.iter().any(|(_, a)| *a == ip) {
                    explicit_was_local = true;
                    reporter.clear();
                } else if explicit_was_local
                    && let Some(p) = reporter.note(format!(
                        "--public-ip {ip} is no longer a local address: peers' datagrams to it \
                         no longer reach this host (weft keeps publishing the address it was given)"
                    ))
                {
                    error!("{p}");
                }
            }
            continue;
        };
        let on_iface: Vec<Ipv4Addr> =
            addrs.iter().filter(|(n, _)| n == iface).map(|(_, a)| *a).collect();
        let Some(next) = next_public_ip(current, &on_iface) else {
            status.set_problem((!on_iface.contains(&current)).then(|| {
                format!(
                    "the published address {current} is no longer on {iface}: nothing is received"
                )
            }));
            continue;
        };
        if let Err(e) = follow.network.check_underlay(&underlay_addrs(next, &follow.etcd_endpoints))
        {
            if let Some(p) =
                reporter.note(format!("{iface} now has {next}, which cannot be published: {e:#}"))
            {
                error!("{p}");
            }
            continue;
        }
        warn!(iface = %iface, old = %current, new = %next, "the underlay address changed: re-binding the sockets and publishing the new public IP");
        // The store's connections left from the old address: make them again at once, once
        // per new address, whether or not the data plane can bind there (the lease and the
        // identity must be kept meanwhile).
        if reconnected_for != Some(next) {
            store.reconnect();
            reconnected_for = Some(next);
        }
        if let Some(dp) = &dataplane {
            let dp = dp.clone();
            let rebound = match tokio::task::spawn_blocking(move || dp.set_public_ip(next)).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = rebound {
                // Every failed try is told and counted: a squatter on the new address's port
                // keeps this host deaf until it goes. The old address stays published: the
                // lease never names an address weft cannot receive on.
                status.rebind_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                warn!(iface = %iface, address = %next, error = %e, retry_in = ?period, "could not re-bind the data plane on the underlay's new address; not ready, retrying");
                status.set_problem(Some(format!(
                    "the data plane is not bound on {next}, {iface}'s address now ({e}); {current}, \
                     still published, is no longer on {iface}: nothing is received; retrying"
                )));
                continue;
            }
        }
        reporter.clear();
        status.set_problem(None);
        current = next;
        let _ = public_ip_tx.send(next);
    }
}

/// Starts the route watcher, which publishes the routes the data plane forwards by. It runs in
/// control-plane-only mode too: it is what watches every key under `subnets/`, so it is what
/// warns about keys that are not leases of this network (`weft_route_ignored_keys`), and
/// `/metrics` shows the routes a data plane would use.
fn start_route_watcher(
    network: &NetworkConfig,
    store: &Arc<dyn Store>,
    health: &Arc<Health>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    stale_ttl: Duration,
    shutdown_rx: &watch::Receiver<bool>,
) -> (Arc<Routes>, tokio::task::JoinHandle<()>) {
    let routes = Arc::new(Routes::new({
        let (net, len) = network.leased_network();
        RouteTable::build_in(net, len, [])
    }));
    let stats = Arc::new(RouteStats::default());
    health.add_collector(stats.clone());
    let watcher = tokio::spawn(crate::route::watcher::run(
        store.clone(),
        routes.clone(),
        network.clone(),
        subnet_rx,
        stats,
        stale_ttl,
        shutdown_rx.clone(),
    ));
    (routes, watcher)
}

/// How often the TUN device's link state is read for drift when no netlink watch could be
/// started (or it ended).
const LINK_CHECK: Duration = Duration::from_secs(1);

/// How long a burst of netlink notifications is let settle before the link is read: `ip link
/// set down` alone sends one for the link and one per route it takes away.
const LINK_SETTLE: Duration = Duration::from_millis(20);

/// Starts the data plane on `routes` and the task that re-addresses the TUN device when this
/// node's subnet changes and repairs its link state when someone else changes it.
/// What the data plane is started with: the run options, the network config, the underlay
/// (and its IPv6 address on a dual-stack vxlan network) and this host's VTEP MAC.
fn dataplane_config(
    opts: &RunOptions,
    network: &NetworkConfig,
    underlay: &Underlay,
    public_ipv6: Option<Ipv6Addr>,
    vtep_mac: MacAddr,
) -> DataplaneConfig {
    DataplaneConfig {
        tun_name: opts.tun_name.clone(),
        backend: network.backend.kind,
        vni: network.backend.vni,
        port: network.backend.port,
        our_mac: vtep_mac,
        underlay_mtu: underlay.mtu,
        overhead: u32::from(network.backend.encap_overhead()),
        network: network.ipv4.as_ref().map(|v4| v4.network),
        public_ip: underlay.public_ip,
        ipv6: network
            .ipv6
            .as_ref()
            .zip(public_ipv6)
            .map(|(v6, public_ip)| Ipv6Dataplane { network: v6.network, public_ip }),
        workers: opts.workers,
        tun_offload: opts.tun_offload,
        udp_gso: opts.udp_gso,
        udp_gro: opts.udp_gro,
        batching: opts.batching,
        one_thread: opts.one_thread,
        spin: opts.spin,
    }
}

/// Starts the data plane, puts its metrics and worker check on `health`, and spawns its
/// addresser ([`spawn_addresser`]), which reads the link again at least every `resync`.
fn start_dataplane(
    cfg: DataplaneConfig,
    routes: Arc<Routes>,
    health: &Arc<Health>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    shutdown_rx: &watch::Receiver<bool>,
    resync: Duration,
) -> anyhow::Result<(Arc<Dataplane>, Vec<tokio::task::JoinHandle<()>>)> {
    let dp = Arc::new(Dataplane::start(cfg, routes).context("starting the data plane")?);
    health.add_collector(dp.counters.clone());
    health.add_collector(dp.workers.clone());
    let w = dp.workers.clone();
    health.add_check(Box::new(move || w.problem()));
    let addresser = spawn_addresser(dp.clone(), subnet_rx, shutdown_rx.clone(), resync);
    Ok((dp, vec![addresser]))
}

/// Starts a netlink watch (its start makes a netlink request, so on a blocking thread). When it
/// cannot be started, says so at WARN: the caller then polls `what` every `every`.
async fn start_watch<F>(
    start: F,
    what: &'static str,
    every: Duration,
) -> Option<(ChangeWatch, watch::Receiver<u64>)>
where
    F: FnOnce() -> Result<(ChangeWatch, watch::Receiver<u64>), NetlinkError> + Send + 'static,
{
    let started = tokio::task::spawn_blocking(start)
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    match started {
        Ok(watch) => Some(watch),
        Err(e) => {
            warn!(error = %e, ?every, "cannot watch {what} over netlink: polling instead");
            None
        }
    }
}

/// The next netlink notification a watch keeps; never, without a watch.
async fn next_netlink_change(
    changes: &mut Option<watch::Receiver<u64>>,
) -> Result<(), watch::error::RecvError> {
    match changes {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}

/// The addresser: addresses the TUN device when the subnet changes, and repairs its link state
/// (drift: a deleted route, the link set down, the address gone, the MTU changed) right after
/// that, when the kernel says the device changed (a netlink watch, [`Dataplane::watch_link`]),
/// and every `resync` in case a notification was missed, until shutdown. Without a watch it
/// reads the link every [`LINK_CHECK`] instead.
fn spawn_addresser(
    dataplane: Arc<Dataplane>,
    mut subnet_rx: watch::Receiver<Option<LeaseName>>,
    mut stop: watch::Receiver<bool>,
    resync: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut drift = DriftLog::default();
        let dp = dataplane.clone();
        // The watch is kept for the task's life: dropping it ends its thread.
        let (_watch, mut changes) =
            start_watch(move || dp.watch_link(), "the TUN device", LINK_CHECK).await.unzip();
        let period = if changes.is_some() { resync } else { LINK_CHECK };
        let mut check = tokio::time::interval_at(Instant::now() + period, period);
        check.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut subnet_changed = true;
        let mut settle = false;
        loop {
            if subnet_changed {
                let subnet = *subnet_rx.borrow_and_update();
                let dp = dataplane.clone();
                match tokio::task::spawn_blocking(move || dp.set_subnet(subnet)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        error!(error = %e, "could not configure the TUN device for the subnet")
                    }
                    Err(e) => error!(error = %e, "TUN configuration task failed"),
                }
            }
            // Notifications up to here (our own changes among them) are answered by this read.
            if let Some(rx) = &mut changes {
                rx.borrow_and_update();
            }
            let dp = dataplane.clone();
            match tokio::task::spawn_blocking(move || {
                dp.repair_link(&mut drift);
                drift
            })
            .await
            {
                Ok(d) => drift = d,
                Err(e) => {
                    error!(error = %e, "TUN drift repair task failed");
                    drift = DriftLog::default();
                }
            }
            subnet_changed = false;
            tokio::select! {
                changed = subnet_rx.changed() => {
                    if changed.is_err() { return }
                    subnet_changed = true;
                }
                changed = next_netlink_change(&mut changes) => {
                    if changed.is_err() {
                        warn!(every = ?LINK_CHECK, "the netlink watch of the TUN device ended: polling instead");
                        changes = None;
                        check = tokio::time::interval_at(Instant::now() + LINK_CHECK, LINK_CHECK);
                        check.set_missed_tick_behavior(MissedTickBehavior::Delay);
                    } else {
                        settle = true;
                    }
                }
                _ = check.tick() => {}
                // A repair (or the read) that failed is retried every second: nothing need
                // change in the kernel for it to succeed next time (a netlink timeout).
                _ = tokio::time::sleep(LINK_CHECK), if drift.failing() => {}
                _ = stop.wait_for(|v| *v) => return,
            }
            if std::mem::take(&mut settle) {
                tokio::time::sleep(LINK_SETTLE).await;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    /// An IPv6-only node's underlay: the interface and the address, from `--iface` (a name or
    /// one of its addresses), `--public-ipv6`, or the IPv6 default route's interface.
    #[test]
    fn an_ipv6_only_underlay_is_the_iface_or_the_default_routes_with_its_interface() {
        let a = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        let addrs =
            vec![("eth0".to_string(), a("2001:db8::5")), ("eth1".to_string(), a("2001:db8:1::7"))];
        let pick = |iface, public| pick_ipv6_only_underlay(iface, public, &addrs, Some("eth1"));
        let got = |name: &str, ip: &str| Ok((Some(name.to_string()), a(ip)));
        assert_eq!(pick(None, None), got("eth1", "2001:db8:1::7"));
        assert_eq!(pick(Some("eth0"), None), got("eth0", "2001:db8::5"));
        assert_eq!(pick(Some("2001:db8::5"), None), got("eth0", "2001:db8::5"));
        // --public-ipv6 is published as given (NAT), on --iface or its holder's interface.
        assert_eq!(pick(Some("eth0"), Some(a("2001:db8:9::1"))), got("eth0", "2001:db8:9::1"));
        assert_eq!(pick(None, Some(a("2001:db8::5"))), got("eth0", "2001:db8::5"));
        assert_eq!(pick(None, Some(a("2001:db8:9::1"))), Ok((None, a("2001:db8:9::1"))));
        // An --iface address no interface has, or an interface without IPv6: errors.
        let e = pick(Some("2001:db8:9::1"), None).unwrap_err().to_string();
        assert!(e.contains("2001:db8:9::1 has no global IPv6 address"), "{e}");
        let e = pick(Some("eth9"), None).unwrap_err().to_string();
        assert!(e.contains("eth9 has no global IPv6 address"), "{e}");
    }

    #[test]
    fn the_ipv6_underlay_is_the_ifaces_first_address_else_the_default_routes() {
        let a = |s: &str| -> Ipv6Addr { s.parse().unwrap() };
        let addrs = vec![
            ("eth0".to_owned(), a("2001:db8::5")),
            ("eth0".to_owned(), a("2001:db8::6")),
            ("eth1".to_owned(), a("2001:db8:1::7")),
        ];
        assert_eq!(pick_underlay6(Some("eth0"), &addrs, Some("eth1")), Ok(a("2001:db8::5")));
        // The IPv4 underlay has no IPv6 address: the IPv6 default route's interface has one.
        assert_eq!(pick_underlay6(Some("lo"), &addrs, Some("eth1")), Ok(a("2001:db8:1::7")));
        assert_eq!(pick_underlay6(None, &addrs, Some("eth1")), Ok(a("2001:db8:1::7")));
        // Neither: the error names both, and the flags that fix it.
        let e = pick_underlay6(Some("eth2"), &addrs, Some("eth3")).unwrap_err().to_string();
        assert_eq!(
            e,
            "the network config enables IPv6 (vxlan) but eth2 has no global IPv6 address (nor \
             has eth3, the IPv6 default route's): give --public-ipv6, or an --iface with one"
        );
        let e = pick_underlay6(None, &[], None).unwrap_err().to_string();
        assert!(e.starts_with("the network config enables IPv6 (vxlan) but the underlay interface has no global IPv6 address: give --public-ipv6"), "{e}");
    }

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
        let attrs = lease_attrs(&config("vxlan", true), v4, Some(v6), mac);
        assert_eq!(attrs.public_ipv6, Some(v6));
        let want = serde_json::json!({ "VNI": 4, "VtepMAC": "02:00:00:00:00:07" });
        assert_eq!(attrs.backend_v6_data, Some(want.clone()));
        assert_eq!(attrs.backend_data, Some(want.clone()));
        for (backend, dual) in [("udp", true), ("vxlan", false)] {
            let attrs = lease_attrs(&config(backend, dual), v4, Some(v6), mac);
            assert_eq!((attrs.public_ipv6, attrs.backend_v6_data), (None, None), "{backend}");
        }
        // IPv6-only: flannel's shape, whatever IPv4 address the host has.
        let raw = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan","VNI":4}}"#;
        let attrs = lease_attrs(&NetworkConfig::parse(raw.as_bytes()).unwrap(), v4, Some(v6), mac);
        assert_eq!((attrs.public_ip, attrs.public_ipv6), (Ipv4Addr::UNSPECIFIED, Some(v6)));
        assert_eq!((&attrs.backend_data, &attrs.backend_v6_data), (&None, &Some(want)));
        assert_eq!(attrs.public_addr(), std::net::IpAddr::V6(v6));
        let text = String::from_utf8(attrs.to_json()).unwrap();
        assert!(text.starts_with(r#"{"PublicIP":"0.0.0.0","PublicIPv6":"2001:db8::7","BackendType":"vxlan","BackendV6Data""#), "{text}");
    }

    #[test]
    fn the_published_address_moves_only_when_it_left_the_interface() {
        let ip = |d| Ipv4Addr::new(192, 0, 2, d);
        // Still there, even with others added before it: kept.
        assert_eq!(next_public_ip(ip(1), &[ip(1)]), None);
        assert_eq!(next_public_ip(ip(1), &[ip(9), ip(1)]), None);
        // Gone: the interface's first address.
        assert_eq!(next_public_ip(ip(1), &[ip(11), ip(12)]), Some(ip(11)));
        // Gone and nothing yet (mid-renumbering): wait.
        assert_eq!(next_public_ip(ip(1), &[]), None);
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
