//! The data plane's side of `weft run`: its start with what the run options and the network
//! say, and the addresser task that addresses the TUN device for this host's subnet and
//! repairs its link state when someone else changes it.

use std::net::Ipv6Addr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{error, warn};

use super::RunOptions;
use super::netlink_watch::{LINK_SETTLE, next_netlink_change, start_watch};
use super::underlay::Underlay;
use crate::config::NetworkConfig;
use crate::dataplane::offload::kernel_bugs::{Offload, OffloadDecisions};
use crate::dataplane::{
    Dataplane, DataplaneConfig, Ipv6Dataplane, UdpGsoConfig, WireguardDataplane,
};
use crate::health::Health;
use crate::lease::record::LeaseName;
use crate::route::Routes;
use crate::vocab::{MacAddr, WgSecret};

/// How often the TUN device's link state is read for drift when no netlink watch could be
/// started (or it ended).
const LINK_CHECK: Duration = Duration::from_secs(1);

/// The running kernel's release (`/proc/sys/kernel/osrelease`, as `uname -r` prints it).
/// With the `fault-injection` feature, `WEFT_FAULT_KERNEL_RELEASE` stands in for it (tests make
/// weft believe it runs on an affected kernel).
fn kernel_release() -> Option<String> {
    #[cfg(feature = "fault-injection")]
    if let Ok(release) = std::env::var("WEFT_FAULT_KERNEL_RELEASE") {
        return Some(release);
    }
    std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|r| r.trim().to_owned())
}

/// Decides each offload for the running kernel and the flags ([`crate::dataplane::offload::kernel_bugs`])
/// and says so: one WARN per offload a known bug touches, naming the kernel, the bug, its
/// sources, what weft did (turned the offload off, or kept it on with the bug's workaround)
/// and the flags that override; one per offload kept on by `on` despite a known bug.
pub(super) fn offload_decisions(opts: &RunOptions) -> OffloadDecisions {
    let release = kernel_release();
    let decisions =
        OffloadDecisions::new(release.as_deref(), [opts.udp_gso, opts.udp_gro, opts.tun_offload]);
    let kernel = release.as_deref().unwrap_or("unknown");
    for d in &decisions.decisions {
        let Some(bug) = d.bug else { continue };
        let flag = d.offload.label().replace('_', "-");
        if d.workaround {
            warn!(
                kernel,
                bug = bug.id,
                sources = bug.sources,
                "kernel {kernel} has a known bug: {}; kept {} on with a workaround: {} (--{flag} off turns it off; --{flag} on drops the workaround, for a kernel with the fix backported)",
                bug.what,
                d.offload.label(),
                bug.workaround.unwrap_or("?"),
            );
        } else if d.enabled {
            warn!(
                kernel,
                bug = bug.id,
                sources = bug.sources,
                "kernel {kernel} is in the range of a known bug ({}), but --{flag} on keeps {} on",
                bug.what,
                d.offload.label()
            );
        } else if d.reason == bug.id {
            warn!(
                kernel,
                bug = bug.id,
                sources = bug.sources,
                "kernel {kernel} has a known bug: {}; turned {} off (--{flag} on overrides, for a kernel with the fix backported)",
                bug.what,
                d.offload.label()
            );
        }
    }
    decisions
}

/// What the data plane is started with: the run options, the network config, the underlay
/// (and its IPv6 address on a dual-stack vxlan network) and this host's VTEP MAC.
pub(super) fn dataplane_config(
    opts: &RunOptions,
    network: &NetworkConfig,
    underlay: &Underlay,
    public_ipv6: Option<Ipv6Addr>,
    vtep_mac: MacAddr,
    offloads: &OffloadDecisions,
    wireguard_key: Option<&WgSecret>,
) -> DataplaneConfig {
    DataplaneConfig {
        tun_name: opts.tun_name.clone(),
        backend: network.backend.kind,
        direct_routing: network.backend.direct_routing,
        vni: network.backend.vni,
        port: network.backend.port,
        our_mac: vtep_mac,
        // wireguard's Backend.MTU stands for the underlay's, as in flannel.
        underlay_mtu: network.backend.mtu_base(underlay.mtu),
        overhead: u32::from(network.backend.encap_overhead()),
        network: network.ipv4.as_ref().map(|v4| v4.network),
        public_ip: underlay.public_ip,
        ipv6: network
            .ipv6
            .as_ref()
            .zip(public_ipv6)
            .map(|(v6, public_ip)| Ipv6Dataplane { network: v6.network, public_ip }),
        workers: opts.workers,
        tun_offload: offloads.enabled(Offload::TunOffload),
        udp_gso: UdpGsoConfig {
            on: offloads.enabled(Offload::UdpGso),
            retry_after: opts.gso_retry_after,
            never_equal_tail: offloads.workaround(Offload::UdpGso) || opts.gso_never_equal_tail,
        },
        udp_gro: offloads.enabled(Offload::UdpGro),
        batching: opts.batching,
        one_thread: opts.one_thread,
        spin: opts.spin,
        worker_slice: opts.worker_slice,
        wireguard: wireguard_key.map(|key| WireguardDataplane {
            private_key: *key,
            psk: network.backend.wireguard.psk,
            keepalive: Some(network.backend.wireguard.keepalive_secs).filter(|s| *s > 0),
            port6: network.backend.wireguard.listen_port_v6,
        }),
    }
}

/// Starts the data plane, puts its metrics and worker check on `health`, and spawns its
/// addresser ([`spawn_addresser`]), which reads the link again at least every `resync`.
pub(super) fn start_dataplane(
    cfg: DataplaneConfig,
    routes: Arc<Routes>,
    health: &Arc<Health>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    shutdown_rx: &watch::Receiver<bool>,
    resync: Duration,
) -> anyhow::Result<(Arc<Dataplane>, Vec<tokio::task::JoinHandle<()>>)> {
    let dp = Dataplane::start(cfg, routes).context("starting the data plane")?;
    Ok(run_dataplane(dp, health, subnet_rx, shutdown_rx, resync))
}

/// Puts a started (or adopted) data plane's metrics and worker check on `health`, and spawns
/// its addresser ([`spawn_addresser`]).
pub(super) fn run_dataplane(
    dp: Dataplane,
    health: &Arc<Health>,
    subnet_rx: watch::Receiver<Option<LeaseName>>,
    shutdown_rx: &watch::Receiver<bool>,
    resync: Duration,
) -> (Arc<Dataplane>, Vec<tokio::task::JoinHandle<()>>) {
    let dp = Arc::new(dp);
    dp.register(health);
    let addresser = spawn_addresser(dp.clone(), subnet_rx, shutdown_rx.clone(), resync);
    (dp, vec![addresser])
}

/// The addresser: addresses the TUN device when the subnet changes, and repairs its link state
/// (drift: a deleted route, the link set down, the address gone, the MTU changed) right after
/// that, when the kernel says the device changed (a netlink watch, [`Dataplane::watch_link`]),
/// and every `resync` in case a notification was missed, until shutdown. Without a watch it
/// reads the link every [`LINK_CHECK`] instead. A data plane that programs kernel routes from
/// the route table (host-gw, direct routing) is repaired also each time the table changes
/// ([`Dataplane::route_changes`]): that is how a peer's route follows its lease.
fn spawn_addresser(
    dataplane: Arc<Dataplane>,
    mut subnet_rx: watch::Receiver<Option<LeaseName>>,
    mut stop: watch::Receiver<bool>,
    resync: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let dp = dataplane.clone();
        // The watch is kept for the task's life: dropping it ends its thread.
        let (_watch, mut changes) =
            start_watch(move || dp.watch_link(), "the TUN device", LINK_CHECK).await.unzip();
        let mut table_changes = dataplane.route_changes();
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
            if let Some(rx) = &mut table_changes {
                rx.borrow_and_update();
            }
            let dp = dataplane.clone();
            let failing = match tokio::task::spawn_blocking(move || dp.repair_link()).await {
                Ok(failing) => failing,
                Err(e) => {
                    error!(error = %e, "TUN drift repair task failed");
                    true
                }
            };
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
                changed = next_netlink_change(&mut table_changes) => {
                    if changed.is_err() {
                        table_changes = None;
                    }
                }
                _ = check.tick() => {}
                // A repair (or the read) that failed is retried every second: nothing need
                // change in the kernel for it to succeed next time (a netlink timeout).
                _ = tokio::time::sleep(LINK_CHECK), if failing => {}
                _ = stop.wait_for(|v| *v) => return,
            }
            if std::mem::take(&mut settle) {
                tokio::time::sleep(LINK_SETTLE).await;
            }
        }
    })
}
