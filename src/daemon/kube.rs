//! `weft run --kube-subnet-mgr`: the daemon on the Kubernetes subnet manager. The network
//! config comes from `--net-config-path` (kube-flannel's ConfigMap), this node's subnet from
//! its Node's podCIDR ([`crate::lease::kube::own`]), every other node's from their Nodes
//! ([`crate::lease::kube::api::NodeFeed`], which the route watcher reads as it reads etcd).
//! The health server, the state dir's lock, the underlay, the route watcher, the data plane and
//! `subnet.env` are the etcd mode's.
//!
//! Not (yet) in this mode: the in-place upgrade on `SIGHUP` and `--takeover` (a DaemonSet
//! replaces the pod; `SIGHUP` is logged and ignored), following a renumbered underlay, the
//! network config's changes (the ConfigMap is read at start, as flanneld reads it).
//! `--ip-masq` installs the masquerade rules as in etcd mode ([`super::masq`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tracing::{error, info};

use super::tun::{dataplane_config, offload_decisions, start_dataplane};
use super::{
    DataplaneMode, RunOptions, find_underlays, health_parts, lease_attrs, load_vtep_mac,
    load_wireguard_key, runs_dataplane, say_network, serve_health, start_route_watcher, stopped,
};
use crate::config::NetworkConfig;
use crate::health;
use crate::instance::{self, Attempt, StateDirLock};
use crate::lease::driver::DriverConfig;
use crate::lease::kube::annotations::AnnotationNames;
use crate::lease::kube::api::{self, KubeSettings, NodeFeed, OwnNode};
use crate::lease::kube::own::{KubeLeaseConfig, KubeLeaseDriver};
use crate::lease::store::LeaseFeed;
use crate::route::{RouteTable, Routes};
use crate::stop::Stop;
use crate::time::{BootClock, Clock};

/// The Kubernetes subnet manager's settings (flanneld's flags).
#[derive(Clone, Debug)]
pub struct KubeMode {
    /// How to reach the API server.
    pub api: KubeSettings,
    /// `--kube-annotation-prefix`.
    pub annotation_prefix: String,
    /// `--net-config-path`.
    pub net_config_path: PathBuf,
}

/// The longest network config file read.
const MAX_NET_CONF: u64 = 64 * 1024;

/// Reads and checks the network config file. Links are followed: a ConfigMap's file in a pod
/// is a link into the volume's current data.
fn read_net_conf(path: &std::path::Path) -> anyhow::Result<NetworkConfig> {
    use std::io::Read as _;
    let mut raw = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_NET_CONF + 1).read_to_end(&mut raw))
        .with_context(|| format!("reading the network config {}", path.display()))?;
    if raw.len() as u64 > MAX_NET_CONF {
        bail!("the network config {} is longer than {MAX_NET_CONF} bytes", path.display());
    }
    NetworkConfig::parse(&raw).with_context(|| format!("the network config {}", path.display()))
}

/// Runs weft on the Kubernetes subnet manager until the stop.
pub async fn run(opts: RunOptions, kube: KubeMode, stop: Arc<Stop>) -> anyhow::Result<()> {
    if opts.takeover {
        bail!("--takeover is not available with --kube-subnet-mgr (a DaemonSet replaces the pod)");
    }
    let names =
        AnnotationNames::new(&kube.annotation_prefix).context("--kube-annotation-prefix")?;
    let network = read_net_conf(&kube.net_config_path)?;
    let clock: Arc<dyn Clock> = Arc::new(BootClock);
    let mut shutdown_rx = stop.subscribe();
    let (health, lease_health) = health_parts(&clock, &stop);
    let health_task = if opts.healthz_port > 0 {
        let addr = SocketAddr::new(opts.healthz_ip, opts.healthz_port);
        let listener = health::bind(addr)
            .await
            .with_context(|| format!("binding the health server on {addr}"))?;
        info!(%addr, "health server listening");
        Some(serve_health(&opts, listener, &health, &stop).0)
    } else {
        None
    };
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
    let Some(_lock) = lock.filter(|_| free) else {
        return stopped(health_task).await;
    };
    let client = api::connect(&kube.api).await.context("the Kubernetes API")?;
    let node_name = api::node_name(&client).await.context("this node's name")?;
    info!(node = %node_name, network_config = %kube.net_config_path.display(), "weft starting on the Kubernetes subnet manager");
    say_network(&network, &opts)?;
    let (underlay, public_ipv6) = find_underlays(&network, &opts, None)?;
    let vtep_mac = load_vtep_mac(&opts.state_dir)?;
    let wireguard_key = load_wireguard_key(&opts, &network)?;
    let attrs = lease_attrs(
        &network,
        underlay.public_ip,
        public_ipv6,
        vtep_mac,
        wireguard_key.as_ref().map(super::wireguard_key::public_key),
    );

    let (subnet_tx, subnet_rx) = tokio::sync::watch::channel(None);
    let routes = Arc::new(Routes::new({
        let (net, len) = network.leased_network();
        RouteTable::build_in(net, len, [])
    }));
    let feed = NodeFeed::new(client.clone(), names.clone(), network.clone());
    health.add_collector(feed.stats());
    let feed: Arc<dyn LeaseFeed> = Arc::new(feed);
    let route_watcher = start_route_watcher(
        &network,
        &feed,
        &health,
        &routes,
        subnet_rx.clone(),
        opts.stale_route_ttl,
        &shutdown_rx,
    );
    let dataplane = if runs_dataplane(&opts, &network) {
        let offloads = offload_decisions(&opts);
        if network.backend.kind.uses_tun() {
            health.add_collector(Arc::new(offloads.clone()));
        }
        Some(start_dataplane(
            dataplane_config(
                &opts,
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
        )?)
    } else {
        None
    };
    // --ip-masq: kube-flannel's DaemonSet runs with it.
    let node_id = super::load_node_id(&opts.state_dir)?;
    let masq = (opts.dataplane == DataplaneMode::Tun)
        .then(|| {
            super::masq::start(
                &opts,
                &network,
                &node_id,
                &health,
                subnet_tx.subscribe(),
                shutdown_rx.clone(),
            )
        })
        .flatten();
    let mtu = network.backend.overlay_mtu(underlay.mtu);
    let driver = KubeLeaseDriver::new(
        OwnNode::new(client, node_name),
        KubeLeaseConfig { names, attrs, network_up: opts.dataplane == DataplaneMode::Tun },
        clock,
        lease_health,
        DriverConfig {
            network: network.clone(),
            subnet_file: opts.subnet_file.clone(),
            mtu,
            ip_masq: opts.ip_masq,
            on_subnet_change: opts.on_subnet_change.clone(),
            on_lease_lost: opts.on_lease_lost.clone(),
            hook_timeout: opts.hook_timeout,
            state_dir: opts.state_dir.clone(),
            relinquish_on_exit: false,
        },
        subnet_tx,
    );
    if let Err(e) = tokio::spawn(driver.run(shutdown_rx.clone())).await {
        error!(error = %e, "the Kubernetes subnet manager ended abnormally");
    }
    stop.request();
    super::masq::finish(masq, false).await;
    let _ = tokio::time::timeout(Duration::from_secs(3), route_watcher).await;
    if let Some((dp, tasks)) = dataplane {
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
        tokio::task::spawn_blocking(move || dp.stop()).await.ok();
    }
    stopped(health_task).await
}
