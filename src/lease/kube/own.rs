//! This node's lease on its Node: the Kubernetes subnet manager's counterpart of the etcd
//! keeper and its driver. Its subnet is the Node's podCIDR (assigned by the controller
//! manager, never chosen here); weft announces its lease in the Node's annotations.
//!
//! Contract:
//! - Until the Node exists and has a podCIDR that is a lease of the network, weft is not ready
//!   and says why once (the problem, or the API server's error) until it changes.
//! - Its podCIDR is shown as the subnet in use (`subnet.env`, the data plane; a `subnet.env`
//!   that already says so is left as it is); its lease is announced with a strategic-merge
//!   patch of `nodes/<name>/status` that sets only the annotations that differ (an operator's
//!   `public-ip-overwrite` honoured), and again whenever they drift or the public IP changes.
//!   Once announced, and when weft forwards, the Node's `NetworkUnavailable` condition is set
//!   `False` (reason `FlannelIsUp`), once per process.
//! - The Node is watched (its own watch, re-made after any end; every change re-reads it):
//!   a podCIDR that changes (the Node deleted and re-created) is a subnet change: WARN, counted,
//!   `subnet.env` rewritten, the subnet-change hook run. A Node deleted under a running weft is
//!   a lost lease: ERROR, counted, the lease-lost hook run, not ready until it is back; the
//!   data plane goes on forwarding for the last subnet (its pods are still there).
//! - An API server that cannot be reached, or that refuses the credentials (an expired or
//!   revoked token): not ready, naming the error, forwarding goes on; retried with backoff.
//! - Nothing is written when weft stops: the annotations stay, as flannel leaves them.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::annotations::{AnnotationNames, network_up_patch, own_patch, pod_lease_name};
use super::api::OwnNode;
use crate::config::NetworkConfig;
use crate::lease::driver::{DriverConfig, SubnetOutputs};
use crate::lease::hooks::{HookKind, HookRun};
use crate::lease::record::{LeaseAttrs, LeaseName};
use crate::lease::status::{ASSIGNED, LeaseCounters, LeaseHealth, LeaseStatus};
use crate::logging::LogOnce;
use crate::time::Clock;

/// How often the Node is read again when no watch says it changed.
pub const RESYNC: Duration = Duration::from_secs(30);
/// The first retry after a failed call; doubled up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// What the subnet manager's own-lease driver needs besides the shared outputs.
#[derive(Clone, Debug)]
pub struct KubeLeaseConfig {
    /// The annotation names.
    pub names: AnnotationNames,
    /// The lease this node announces (its `PublicIP` follows the underlay).
    pub attrs: LeaseAttrs,
    /// Whether to set `NetworkUnavailable=False` once announced (weft forwards).
    pub network_up: bool,
}

/// Runs this node's lease on its Node until shutdown (see the module docs).
pub struct KubeLeaseDriver {
    own: OwnNode,
    cfg: KubeLeaseConfig,
    clock: Arc<dyn Clock>,
    network: NetworkConfig,
    health: Arc<LeaseHealth>,
    out: SubnetOutputs,
    current: Option<LeaseName>,
    /// The Node was found deleted while a subnet was in use (said once).
    lost: bool,
    network_up_done: bool,
    said: LogOnce,
    public_ip_rx: Option<watch::Receiver<Ipv4Addr>>,
}

impl KubeLeaseDriver {
    /// A driver for the Node `own`. `subnet_tx` carries the subnet in use to the data plane.
    /// Must be called inside a tokio runtime (the hook runner starts).
    pub fn new(
        own: OwnNode,
        cfg: KubeLeaseConfig,
        clock: Arc<dyn Clock>,
        health: Arc<LeaseHealth>,
        driver_cfg: DriverConfig,
        subnet_tx: watch::Sender<Option<LeaseName>>,
    ) -> Self {
        let network = driver_cfg.network.clone();
        let current = *subnet_tx.borrow();
        let out = SubnetOutputs::new(driver_cfg, clock.clone(), health.clone(), subnet_tx);
        Self {
            own,
            cfg,
            clock,
            network,
            health,
            out,
            current,
            lost: false,
            network_up_done: false,
            said: LogOnce::default(),
            public_ip_rx: None,
        }
    }

    /// Announces every address `rx` carries as the lease's `PublicIP`.
    pub fn follow_public_ip(&mut self, rx: watch::Receiver<Ipv4Addr>) {
        self.public_ip_rx = Some(rx);
    }

    /// Runs until `shutdown` turns true.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut changes: Option<BoxStream<'static, ()>> = None;
        let mut backoff = BACKOFF_MIN;
        loop {
            self.health.beat();
            self.out.retry_subnet_env(self.clock.now());
            let ok = self.step().await;
            let wait = if ok {
                backoff = BACKOFF_MIN;
                if changes.is_none() {
                    changes = self.own.changes().await.ok();
                }
                RESYNC
            } else {
                let w = backoff;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                w
            };
            // A subnet.env write being retried is looked at every second.
            let wait =
                if self.out.retry_pending() { wait.min(Duration::from_secs(1)) } else { wait };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                item = next_change(&mut changes) => {
                    if item.is_none() {
                        changes = None;
                    }
                }
                Some(ip) = public_ip_changed(&mut self.public_ip_rx) => {
                    info!(public_ip = %ip, "announcing the new public IP on the Node");
                    self.cfg.attrs.public_ip = ip;
                }
                _ = shutdown.wait_for(|s| *s) => break,
            }
        }
        info!(node = %self.own.name, "the Kubernetes subnet manager stops; the Node's annotations stay");
    }

    /// One look at the Node: shows its subnet, announces the lease, marks the network up.
    /// Returns whether the API server answered and all is in place.
    async fn step(&mut self) -> bool {
        let c = &self.health.counters;
        let node = match self.own.get().await {
            Ok(n) => n,
            Err(e) => {
                LeaseCounters::inc(&c.store_errors);
                self.not_ready(
                    format!("cannot read the Node {}: {e}; retrying", self.own.name),
                    true,
                );
                return false;
            }
        };
        let Some(node) = node else {
            if self.current.is_some() && !self.lost {
                self.lost = true;
                LeaseCounters::inc(&c.losses);
                let subnet = self.current.map(|l| l.subnet);
                error!(node = %self.own.name, subnet = ?subnet, "LEASE LOST: the Node {} was deleted; forwarding goes on for the last subnet until it is back", self.own.name);
                self.out.hooks.run(HookRun {
                    kind: HookKind::LeaseLost,
                    old: subnet,
                    new: None,
                    reason: "node-deleted",
                    holder: None,
                });
            }
            self.not_ready(format!("the Node {} does not exist", self.own.name), true);
            return false;
        };
        let name = match pod_lease_name(&self.network, &node) {
            Ok(n) => n,
            Err(problem) => {
                self.not_ready(format!("the Node {}: {problem}", self.own.name), true);
                return false;
            }
        };
        if self.lost {
            info!(node = %self.own.name, "the Node is back");
            self.lost = false;
        }
        match self.current {
            Some(old) if old == name => {}
            Some(old) => {
                LeaseCounters::inc(&c.subnet_changes);
                warn!(old = %old.subnet, new = %name.subnet, "this node's podCIDR changed (the Node re-created?); pods on the old subnet need new addresses");
                self.out.record_change(old.subnet, name.subnet);
                self.out.show(name, false);
                self.out.start_change_hook(old.subnet, name.subnet);
            }
            None => {
                LeaseCounters::inc(&c.acquisitions);
                info!(subnet = %name.subnet, ipv6 = ?name.ipv6, node = %self.own.name, "acquired subnet lease: the Node's podCIDR");
                self.out.show(name, true);
            }
        }
        self.current = Some(name);
        let (patch, announced) = own_patch(
            &self.cfg.names,
            &self.cfg.attrs,
            &node.annotations,
            self.network.leases_ipv4(),
        );
        if let Some(patch) = patch {
            if let Err(e) = self.own.patch_status(&patch).await {
                LeaseCounters::inc(&c.store_errors);
                self.not_ready(
                    format!("cannot annotate the Node {}: {e}; retrying", self.own.name),
                    true,
                );
                return false;
            }
            info!(node = %self.own.name, public_ip = ?announced, "announced this node's lease on its Node");
        }
        if self.cfg.network_up && !self.network_up_done {
            let now = now_rfc3339();
            if let Err(e) = self.own.patch_status(&network_up_patch(&now)).await {
                LeaseCounters::inc(&c.store_errors);
                self.not_ready(
                    format!(
                        "cannot set the Node {}'s NetworkUnavailable condition: {e}; retrying",
                        self.own.name
                    ),
                    true,
                );
                return false;
            }
            self.network_up_done = true;
            info!(node = %self.own.name, "set NetworkUnavailable=False (FlannelIsUp) on the Node");
        }
        if self.said.clear() {
            info!(node = %self.own.name, "the Node reads and is announced again");
        }
        self.health.set_lease(LeaseStatus {
            state: ASSIGNED,
            subnet: Some(name.subnet),
            expires_at: None,
            identity_until: None,
            not_ready: None,
        });
        true
    }

    /// Not ready for `why`, said once (at ERROR when `loud`) until it changes.
    fn not_ready(&mut self, why: String, loud: bool) {
        if self.said.note(why.clone()).is_some() {
            if loud {
                error!("{why}");
            } else {
                warn!("{why}");
            }
        }
        self.health.set_lease(LeaseStatus {
            state: if self.current.is_some() { ASSIGNED } else { "waiting" },
            subnet: self.current.map(|l| l.subnet),
            expires_at: None,
            identity_until: None,
            not_ready: Some(why),
        });
    }
}

/// Now, as RFC 3339 in UTC (the condition's times).
fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

async fn next_change(s: &mut Option<BoxStream<'static, ()>>) -> Option<()> {
    match s {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn public_ip_changed(rx: &mut Option<watch::Receiver<Ipv4Addr>>) -> Option<Ipv4Addr> {
    let Some(r) = rx.as_mut() else { return std::future::pending().await };
    if r.changed().await.is_err() {
        *rx = None;
        return None;
    }
    Some(*r.borrow_and_update())
}
