//! Runs the [`Keeper`] for real: store calls, the clock, the own-key watch, `subnet.env`,
//! hooks, logs and health. This is the only lease code that does I/O besides the stores.
//!
//! The loop follows the keeper's call protocol (see [`super::keeper`]). Sleeps are capped at one
//! second and deadlines are read from the boot-time clock, so a host that was suspended acts on
//! its lease as soon as it wakes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use super::keeper::{
    AcquireKind, Action, ActionResult, Keeper, KeeperEvent, LossReason, Readiness,
};
use super::record::{NodeId, Revision, Subnet};
use super::store::{Store, WatchEvent, WatchStream};
use super::subnet_env::{self, SubnetEnv};
use crate::config::NetworkConfig;
use crate::health::{Counters, Health, LeaseStatus};
use crate::time::{Clock, Instant};

/// Runs one keeper action against a store, for `node`. Shared by the daemon and the
/// simulation, so both exercise the same mapping from actions to store calls.
pub async fn execute(store: &dyn Store, node: &NodeId, action: Action) -> ActionResult {
    match action {
        Action::ClaimPresence { record, ttl } => {
            ActionResult::ClaimPresence(store.claim_presence(node, &record, ttl).await)
        }
        Action::KeepPresence { lease, beat } => {
            ActionResult::KeepPresence(store.keep_presence(node, lease, beat).await)
        }
        Action::List => ActionResult::List(store.list().await),
        Action::Create { subnet, attrs, ttl } => {
            ActionResult::Create(store.create(subnet, &attrs, ttl).await)
        }
        Action::Renew { held, attrs, ttl } => {
            ActionResult::Renew(store.renew(&held, &attrs, ttl).await)
        }
        Action::Release { held } => ActionResult::Release(store.release(&held, node).await),
        Action::DropPresence { lease } => {
            ActionResult::DropPresence(store.drop_presence(node, lease).await)
        }
    }
}

/// What the driver does around the keeper.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The network config (for `subnet.env`).
    pub network: NetworkConfig,
    /// Where `subnet.env` goes.
    pub subnet_file: PathBuf,
    /// `FLANNEL_MTU`.
    pub mtu: u32,
    /// `FLANNEL_IPMASQ`.
    pub ip_masq: bool,
    /// `--on-subnet-change`.
    pub on_subnet_change: Option<String>,
    /// `--on-lease-lost`.
    pub on_lease_lost: Option<String>,
    /// `--relinquish-on-exit`.
    pub relinquish_on_exit: bool,
}

/// Runs a keeper until shutdown.
pub struct LeaseDriver {
    store: Arc<dyn Store>,
    keeper: Keeper,
    node: NodeId,
    clock: Arc<dyn Clock>,
    health: Arc<Health>,
    cfg: DriverConfig,
    subnet_tx: watch::Sender<Option<Subnet>>,
    own_watch: Option<(Subnet, WatchStream)>,
    watch_retry_at: Instant,
}

impl LeaseDriver {
    /// A driver for `keeper`. `subnet_tx` carries the subnet in use to the data plane.
    pub fn new(
        store: Arc<dyn Store>,
        keeper: Keeper,
        node: NodeId,
        clock: Arc<dyn Clock>,
        health: Arc<Health>,
        cfg: DriverConfig,
        subnet_tx: watch::Sender<Option<Subnet>>,
    ) -> Self {
        let now = clock.now();
        Self {
            store,
            keeper,
            node,
            clock,
            health,
            cfg,
            subnet_tx,
            own_watch: None,
            watch_retry_at: now,
        }
    }

    /// Runs until `shutdown` turns true and the keeper has finished its shutdown actions.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut shutting_down = false;
        loop {
            self.drain_events();
            if shutting_down && self.keeper.is_stopped() {
                break;
            }
            let now = self.clock.now();
            if let Some(action) = self.keeper.poll_action(now) {
                debug!(?action, "store call");
                let result = execute(&*self.store, &self.node, action).await;
                let done = self.clock.now();
                self.keeper.handle_result(now, done, result);
                continue;
            }
            self.publish_status(now);
            self.ensure_own_watch(now).await;
            let sleep = self
                .keeper
                .poll_timeout()
                .map_or(Duration::from_secs(1), |t| t.saturating_since(now))
                .min(Duration::from_secs(1));
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                item = next_batch(&mut self.own_watch) => self.on_own_watch(item),
                changed = shutdown.changed(), if !shutting_down => {
                    if changed.is_err() || *shutdown.borrow() {
                        shutting_down = true;
                        info!(relinquish = self.cfg.relinquish_on_exit, "shutting down the lease keeper");
                        self.keeper.handle_shutdown(self.cfg.relinquish_on_exit);
                    }
                }
            }
        }
        self.publish_status(self.clock.now());
    }

    fn publish_status(&self, now: Instant) {
        let not_ready = match self.keeper.readiness(now) {
            Readiness::Ready => None,
            Readiness::NotReady(r) => Some(r),
        };
        self.health.set_lease(LeaseStatus {
            state: self.keeper.state_name(),
            subnet: self.keeper.subnet(),
            expires_at: self.keeper.expires_at(),
            not_ready,
        });
    }

    async fn ensure_own_watch(&mut self, now: Instant) {
        let want = self.keeper.held();
        match (&self.own_watch, want) {
            (Some((s, _)), Some(h)) if *s == h.subnet => return,
            (None, None) => return,
            _ => {}
        }
        self.own_watch = None;
        let Some(held) = want else { return };
        if now < self.watch_retry_at {
            return;
        }
        match self.store.watch(Revision(held.mod_revision.0 + 1), Some(held.subnet)).await {
            Ok(w) => self.own_watch = Some((held.subnet, w)),
            Err(e) => {
                debug!(error = %e, "own-key watch could not start; retrying");
                self.watch_retry_at = now + Duration::from_secs(1);
            }
        }
    }

    fn on_own_watch(
        &mut self,
        item: Option<Result<super::store::WatchBatch, super::store::StoreError>>,
    ) {
        let now = self.clock.now();
        match item {
            Some(Ok(batch)) => {
                for ev in batch.events {
                    match ev {
                        WatchEvent::Put(l) => self.keeper.handle_own_key(now, Some(&l)),
                        WatchEvent::Delete { .. } | WatchEvent::Bad(_) => {
                            self.keeper.handle_own_key(now, None)
                        }
                    }
                }
            }
            Some(Err(e)) => {
                debug!(error = %e, "own-key watch ended; probing the key and watching again");
                self.own_watch = None;
                self.watch_retry_at = now + Duration::from_secs(1);
                self.keeper.handle_own_key(now, None);
            }
            None => {
                self.own_watch = None;
                self.watch_retry_at = now + Duration::from_secs(1);
            }
        }
    }

    fn drain_events(&mut self) {
        while let Some(ev) = self.keeper.poll_event() {
            self.on_event(ev);
        }
    }

    fn on_event(&mut self, ev: KeeperEvent) {
        let c = &self.health.counters;
        match ev {
            KeeperEvent::Acquired { subnet, kind } => {
                Counters::inc(&c.acquisitions);
                match kind {
                    AcquireKind::Adopted => info!(%subnet, "adopted this node's live lease"),
                    AcquireKind::Created(reason) => {
                        info!(%subnet, ?reason, "acquired subnet lease")
                    }
                }
                self.write_subnet_env(subnet);
                self.subnet_tx.send_replace(Some(subnet));
            }
            KeeperEvent::SubnetChanged { old, new } => {
                Counters::inc(&c.subnet_changes);
                warn!(%old, %new, "this node's subnet changed; pods on the old subnet need new addresses");
                if let Some(cmd) = self.cfg.on_subnet_change.clone() {
                    self.run_hook(
                        "on-subnet-change",
                        cmd,
                        Some(old),
                        Some(new),
                        "subnet-changed",
                        None,
                    );
                }
            }
            KeeperEvent::Renewed { subnet } => {
                Counters::inc(&c.renewals);
                debug!(%subnet, "lease renewed");
            }
            KeeperEvent::Recovered { subnet } => {
                Counters::inc(&c.recoveries);
                info!(%subnet, "recovered: the lease had vanished and was reclaimed; same subnet");
                self.write_subnet_env(subnet);
                self.subnet_tx.send_replace(Some(subnet));
            }
            KeeperEvent::Lost { subnet, reason, holder, holder_node } => {
                Counters::inc(&c.losses);
                let holder_text = holder.map_or("unknown".to_string(), |h| h.to_string());
                error!(
                    %subnet,
                    holder = %holder_text,
                    holder_node = holder_node.as_ref().map(|n| n.as_str()).unwrap_or("not a weft node"),
                    ?reason,
                    "LEASE LOST: subnet {subnet} is now held by {holder_text}; not touching it, acquiring another"
                );
                let why = match reason {
                    LossReason::TakenByAnotherNode => "taken-by-another-node",
                    LossReason::UnreadableValue => "unreadable-value",
                };
                if let Some(cmd) = self.cfg.on_lease_lost.clone() {
                    self.run_hook(
                        "on-lease-lost",
                        cmd,
                        Some(subnet),
                        None,
                        why,
                        holder.map(|h| h.to_string()),
                    );
                }
            }
            KeeperEvent::PreviousTaken { subnet, holder } => {
                warn!(%subnet, %holder, "the previous subnet (subnet.env or history) is held by another node; not taking it");
            }
            KeeperEvent::Exhausted => {
                Counters::inc(&c.exhaustions);
                error!("network exhausted: no free subnet in the configured range; retrying");
            }
            KeeperEvent::IdentityClash { other, other_ip } => {
                Counters::inc(&c.identity_clashes);
                let reason = match self.keeper.readiness(self.clock.now()) {
                    Readiness::NotReady(r) => r,
                    Readiness::Ready => String::new(),
                };
                error!(
                    other = other.as_ref().map(|i| i.as_str()).unwrap_or("unknown"),
                    other_ip = other_ip.map(|i| i.to_string()).unwrap_or_default(),
                    "IDENTITY CLASH: {reason}"
                );
                if let Some(cmd) = self.cfg.on_lease_lost.clone() {
                    let old = self.subnet_tx.borrow().to_owned();
                    self.run_hook(
                        "on-lease-lost",
                        cmd,
                        old,
                        None,
                        "identity-clash",
                        other_ip.map(|i| i.to_string()),
                    );
                }
            }
            KeeperEvent::IdentityClashOver => {
                warn!(
                    "identity clash over: the other process of this node is gone; acquiring a lease"
                );
            }
            KeeperEvent::WaitingForPreviousProcess { other, wait } => {
                info!(%other, ?wait, "a previous process of this node may still be alive; waiting for its presence to expire");
            }
            KeeperEvent::StoreTrouble { action, error, lease_valid } => {
                Counters::inc(&c.store_errors);
                if lease_valid || self.keeper.held().is_none() {
                    warn!(action, %error, "store call failed; retrying");
                } else {
                    error!(action, %error, "store call failed and the lease is past its local expiry; retrying");
                }
            }
            KeeperEvent::ExpiredLocally { subnet } => {
                error!(%subnet, "lease expired locally without a renewal; forwarding continues with the last routes while retrying");
            }
            KeeperEvent::Released { subnet } => {
                info!(%subnet, "lease released (relinquished)");
            }
        }
    }

    fn write_subnet_env(&self, subnet: Subnet) {
        let env = SubnetEnv {
            network: self.cfg.network.network,
            subnet,
            mtu: self.cfg.mtu,
            ipmasq: self.cfg.ip_masq,
        };
        if let Err(e) = subnet_env::write_atomic(&self.cfg.subnet_file, &env) {
            error!(path = %self.cfg.subnet_file.display(), error = %e, "could not write subnet.env");
        }
    }

    fn run_hook(
        &self,
        name: &'static str,
        cmd: String,
        old: Option<Subnet>,
        new: Option<Subnet>,
        reason: &'static str,
        holder: Option<String>,
    ) {
        let health = self.health.clone();
        let old = old.map(|s| s.to_string()).unwrap_or_default();
        let new = new.map(|s| s.to_string()).unwrap_or_default();
        // A slow hook must never block the keeper: it runs on its own task.
        tokio::spawn(async move {
            let out = tokio::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(&cmd)
                .arg(name)
                .arg(&old)
                .arg(&new)
                .env("WEFT_OLD_SUBNET", &old)
                .env("WEFT_NEW_SUBNET", &new)
                .env("WEFT_REASON", reason)
                .env("WEFT_HOLDER", holder.unwrap_or_default())
                .stdin(std::process::Stdio::null())
                .output()
                .await;
            match out {
                Ok(o) if o.status.success() => {
                    info!(hook = name, %cmd, stdout = %String::from_utf8_lossy(&o.stdout).trim(), "hook ran");
                }
                Ok(o) => {
                    Counters::inc(&health.counters.hook_failures);
                    warn!(hook = name, %cmd, status = %o.status, stderr = %String::from_utf8_lossy(&o.stderr).trim(), "hook failed");
                }
                Err(e) => {
                    Counters::inc(&health.counters.hook_failures);
                    warn!(hook = name, %cmd, error = %e, "hook could not start");
                }
            }
        });
    }
}

async fn next_batch(
    w: &mut Option<(Subnet, WatchStream)>,
) -> Option<Result<super::store::WatchBatch, super::store::StoreError>> {
    match w {
        Some((_, s)) => s.next().await,
        None => std::future::pending().await,
    }
}
