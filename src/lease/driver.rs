//! Runs the [`Keeper`] for real: store calls, the clock, the own-key watch, `subnet.env`,
//! hooks, logs and health. This is the only lease code that does I/O besides the stores.
//!
//! `subnet.env` that cannot be written (read-only or full disk, a path that is not a directory)
//! makes weft not ready, naming the file and the error, counts in
//! `weft_subnet_file_write_failures_total`, and is retried after 1 s, doubling up to
//! [`ENV_RETRY_MAX`], until it succeeds; readiness then recovers.
//!
//! A subnet change's hook is recorded in the hook journal ([`super::hooks`]) before
//! `subnet.env` is rewritten and started after it was: a crash in between re-runs it on the next
//! start, and the hook always finds the new `subnet.env`. While `subnet.env` cannot be written
//! the hook waits for it.
//!
//! The loop follows the keeper's call protocol (see [`super::keeper`]). Sleeps are capped at one
//! second and deadlines are read from the boot-time clock, so a host that was suspended acts on
//! its lease as soon as it wakes.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use super::hooks::{HookConfig, HookKind, HookRun, HookRunner};
use super::keeper::{
    AcquireKind, Action, ActionResult, Keeper, KeeperEvent, KeeperHandover, LossReason,
    NotHandable, Readiness,
};
use super::record::{Ipv6Subnet, LeaseName, NodeId, Revision, Subnet};
use super::status::{LeaseCounters, LeaseHealth, LeaseStatus};
use super::store::{Store, WatchEvent, WatchStream};
use super::subnet_env::{self, SubnetEnv, SubnetEnv4, SubnetEnv6};
use crate::config::NetworkConfig;
use crate::logging::LogOnce;
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
        Action::List => ActionResult::List(store.list_with_presence().await),
        Action::Create { name, attrs, ttl, prune } => {
            ActionResult::Create(store.create_pruning(name, &attrs, ttl, &prune).await)
        }
        Action::Renew { held, attrs, ttl } => {
            ActionResult::Renew(store.renew(&held, &attrs, ttl).await)
        }
        Action::Refresh { held, attrs } => ActionResult::Renew(store.refresh(&held, &attrs).await),
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
    /// `--hook-timeout`.
    pub hook_timeout: Duration,
    /// `--state-dir` (for the hook journal).
    pub state_dir: PathBuf,
    /// `--relinquish-on-exit`.
    pub relinquish_on_exit: bool,
}

/// The first retry of a failed `subnet.env` write comes after this; each next one after twice
/// the previous delay, up to [`ENV_RETRY_MAX`].
pub(crate) const ENV_RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait between two attempts to write `subnet.env`.
pub(crate) const ENV_RETRY_MAX: Duration = Duration::from_secs(10);

/// The delay before the retry after one of `delay`.
pub(crate) fn next_env_retry(delay: Duration) -> Duration {
    (delay * 2).clamp(ENV_RETRY_MIN, ENV_RETRY_MAX)
}

/// A `subnet.env` write that failed and is being retried.
#[derive(Debug)]
struct EnvRetry {
    env: SubnetEnv,
    at: Instant,
    delay: Duration,
    /// The write's error, said once until it changes or the write succeeds.
    said: LogOnce,
}

/// What the daemon asks of a running driver for an upgrade without loss
/// ([`LeaseDriver::handover_control`]).
#[derive(Debug)]
pub enum HandoverControl {
    /// Stop making store calls and answer with what the next process needs to go on holding
    /// the lease ([`Keeper::hand_over`]); then wait for [`HandoverControl::Resume`] or
    /// [`HandoverControl::Finish`]. Refused (answered with why) unless the lease is held
    /// steadily; the driver then goes on as before.
    Freeze(tokio::sync::oneshot::Sender<Result<KeeperHandover, NotHandable>>),
    /// The handover failed: go on holding the lease.
    Resume,
    /// The next process holds the lease now: end without a store call (no relinquish, the
    /// presence left to it).
    Finish,
}

/// Runs a keeper until shutdown.
pub struct LeaseDriver {
    store: Arc<dyn Store>,
    keeper: Keeper,
    node: NodeId,
    clock: Arc<dyn Clock>,
    health: Arc<LeaseHealth>,
    /// `subnet.env`, the data plane's subnet and the hooks.
    out: SubnetOutputs,
    own_watch: Option<(Subnet, WatchStream)>,
    watch_retry_at: Instant,
    /// This host's underlay address, as the daemon's underlay follower sees it.
    public_ip_rx: Option<watch::Receiver<Ipv4Addr>>,
    /// Handover requests ([`HandoverControl`]).
    control: Option<tokio::sync::mpsc::Receiver<HandoverControl>>,
}

impl LeaseDriver {
    /// A driver for `keeper`. `subnet_tx` carries the subnet in use to the data plane. Starts
    /// the hook runner, which re-runs the hooks the journal lists, so it must be called inside
    /// a tokio runtime.
    pub fn new(
        store: Arc<dyn Store>,
        keeper: Keeper,
        node: NodeId,
        clock: Arc<dyn Clock>,
        health: Arc<LeaseHealth>,
        cfg: DriverConfig,
        subnet_tx: watch::Sender<Option<LeaseName>>,
    ) -> Self {
        let now = clock.now();
        let out = SubnetOutputs::new(cfg, clock.clone(), health.clone(), subnet_tx);
        Self {
            store,
            keeper,
            node,
            clock,
            health,
            out,
            own_watch: None,
            watch_retry_at: now,
            public_ip_rx: None,
            control: None,
        }
    }

    /// Where the daemon sends [`HandoverControl`] requests.
    pub(crate) fn handover_control(&mut self) -> tokio::sync::mpsc::Sender<HandoverControl> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        self.control = Some(rx);
        tx
    }

    /// Publishes every address `rx` carries as the lease's `PublicIP` (see
    /// [`Keeper::handle_public_ip`]).
    pub(crate) fn follow_public_ip(&mut self, rx: watch::Receiver<Ipv4Addr>) {
        self.public_ip_rx = Some(rx);
    }

    /// Runs until `shutdown` turns true and the keeper has finished its shutdown actions.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut shutting_down = false;
        loop {
            self.health.beat();
            self.drain_events();
            if shutting_down && self.keeper.is_stopped() {
                break;
            }
            let now = self.clock.now();
            self.out.retry_subnet_env(now);
            if let Some(action) = self.keeper.poll_action(now) {
                debug!(?action, "store call");
                let budget = self.keeper.call_budget(now);
                let gave_up = action.timed_out(budget.unwrap_or_default());
                let call = execute(&*self.store, &self.node, action);
                // Dropped mid-call (out of budget, or a stop while the store does not answer),
                // the outcome is unknown: the keeper retries, and tells its own lost write by
                // the incarnation.
                let bounded = async {
                    match budget {
                        Some(budget) => tokio::time::timeout(budget, call).await.ok(),
                        None => Some(call.await),
                    }
                };
                let mut stop_now = false;
                let result = tokio::select! {
                    result = bounded => result,
                    () = stop_requested(&mut shutdown), if !shutting_down => {
                        stop_now = true;
                        None
                    }
                };
                let done = self.clock.now();
                self.keeper.handle_result(now, done, result.unwrap_or(gave_up));
                if stop_now {
                    shutting_down = true;
                    self.begin_shutdown();
                }
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
                Some(ip) = public_ip_changed(&mut self.public_ip_rx) => {
                    info!(public_ip = %ip, "publishing the new public IP in the lease");
                    self.keeper.handle_public_ip(ip);
                }
                () = stop_requested(&mut shutdown), if !shutting_down => {
                    shutting_down = true;
                    self.begin_shutdown();
                }
                Some(control) = next_control(&mut self.control), if !shutting_down => {
                    if self.frozen(control, &mut shutdown).await {
                        info!("the lease is held by the next process of this node now");
                        return;
                    }
                }
            }
        }
        self.publish_status(self.clock.now());
    }

    /// Answers a handover request; after a [`HandoverControl::Freeze`] that could be met,
    /// makes no store call until told to resume (false) or finish (true). A stop while frozen
    /// resumes, so that the stop goes as usual.
    async fn frozen(
        &mut self,
        control: HandoverControl,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        let HandoverControl::Freeze(answer) = control else { return false };
        let handover = self.keeper.hand_over(self.clock.now());
        let frozen = handover.is_ok();
        if answer.send(handover).is_err() || !frozen {
            return false;
        }
        // The own-key watch would only queue up what the next process's watch sees too.
        self.own_watch = None;
        loop {
            tokio::select! {
                control = next_control(&mut self.control) => match control {
                    Some(HandoverControl::Finish) => return true,
                    Some(HandoverControl::Resume) | None => return false,
                    Some(HandoverControl::Freeze(again)) => {
                        let _ = again.send(self.keeper.hand_over(self.clock.now()));
                    }
                },
                () = stop_requested(shutdown) => return false,
            }
        }
    }

    fn begin_shutdown(&mut self) {
        info!(relinquish = self.out.cfg.relinquish_on_exit, "shutting down the lease keeper");
        self.keeper.handle_shutdown(self.out.cfg.relinquish_on_exit);
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
            identity_until: self.keeper.presence_until(),
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
        match self.store.watch(Revision(held.mod_revision.0 + 1), Some(held.name())).await {
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
                        WatchEvent::Delete { .. }
                        | WatchEvent::Bad(_)
                        | WatchEvent::DeleteUnparsed { .. } => {
                            self.keeper.handle_own_key(now, None)
                        }
                        // A one-key watch sees no markers.
                        WatchEvent::Departed(_) => {}
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
        let mut events = Vec::new();
        while let Some(ev) = self.keeper.poll_event() {
            events.push(ev);
        }
        // The keeper reports `Acquired` (which rewrites subnet.env) before `SubnetChanged`: the
        // hook is recorded first, so that no crash leaves a new subnet.env without it.
        for ev in &events {
            if let KeeperEvent::SubnetChanged { old, new } = ev {
                self.out.record_change(*old, *new);
            }
        }
        for ev in events {
            self.on_event(ev);
        }
    }

    fn on_event(&mut self, ev: KeeperEvent) {
        let c = &self.health.counters;
        match ev {
            KeeperEvent::Acquired { subnet, kind } => {
                LeaseCounters::inc(&c.acquisitions);
                match kind {
                    AcquireKind::Adopted => {
                        info!(%subnet, ipv6 = ?self.keeper.ipv6(), "adopted this node's live lease")
                    }
                    AcquireKind::Created(reason) => {
                        info!(%subnet, ipv6 = ?self.keeper.ipv6(), ?reason, "acquired subnet lease")
                    }
                    AcquireKind::HandedOver => {
                        info!(%subnet, ipv6 = ?self.keeper.ipv6(), "holding the lease the previous process of this node handed over")
                    }
                }
                // A handover changes nothing a reader of subnet.env sees: the file is left as
                // it is when it already says what this process would write.
                let name = LeaseName { subnet, ipv6: self.keeper.ipv6() };
                self.out.show(name, kind == AcquireKind::HandedOver);
            }
            KeeperEvent::SubnetChanged { old, new } => {
                LeaseCounters::inc(&c.subnet_changes);
                warn!(%old, %new, "this node's subnet changed; pods on the old subnet need new addresses");
                // Recorded in drain_events; started once subnet.env names the new subnet.
                self.out.start_change_hook(old, new);
            }
            KeeperEvent::Renewed { subnet } => {
                LeaseCounters::inc(&c.renewals);
                debug!(%subnet, "lease renewed");
            }
            KeeperEvent::Recovered { subnet } => {
                LeaseCounters::inc(&c.recoveries);
                info!(%subnet, "recovered: the lease had vanished and was reclaimed; same subnet");
                self.out.show(LeaseName { subnet, ipv6: self.keeper.ipv6() }, false);
            }
            KeeperEvent::Lost { subnet, reason, holder, holder_node } => {
                LeaseCounters::inc(&c.losses);
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
                self.out.hooks.run(HookRun {
                    kind: HookKind::LeaseLost,
                    old: Some(subnet),
                    new: None,
                    reason: why,
                    holder,
                });
            }
            KeeperEvent::PreviousTaken { subnet, holder } => {
                warn!(%subnet, %holder, "the previous subnet (subnet.env or history) is held by another node; not taking it");
            }
            KeeperEvent::Exhausted => {
                LeaseCounters::inc(&c.exhaustions);
                error!("network exhausted: no free subnet in the configured range; retrying");
            }
            KeeperEvent::IdentityClash { other, other_ip } => {
                LeaseCounters::inc(&c.identity_clashes);
                let reason = match self.keeper.readiness(self.clock.now()) {
                    Readiness::NotReady(r) => r,
                    Readiness::Ready => String::new(),
                };
                error!(
                    other = other.as_ref().map(|i| i.as_str()).unwrap_or("unknown"),
                    other_ip = other_ip.map(|i| i.to_string()).unwrap_or_default(),
                    "IDENTITY CLASH: {reason}"
                );
                let old = self.out.subnet_tx.borrow().map(|l| l.subnet);
                self.out.withdraw("identity clash: another live process carries this node ID");
                self.out.hooks.run(HookRun {
                    kind: HookKind::LeaseLost,
                    old,
                    new: None,
                    reason: "identity-clash",
                    holder: other_ip,
                });
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
                LeaseCounters::inc(&c.store_errors);
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
}

/// What holding a subnet shows the rest of the host: `subnet.env` (written atomically,
/// retried until it can be), the subnet the data plane forwards for, the hooks, and the lease
/// plane's readiness about them. Both lease drivers (etcd's keeper and the Kubernetes subnet
/// manager) show a subnet through it.
pub(crate) struct SubnetOutputs {
    pub(crate) cfg: DriverConfig,
    clock: Arc<dyn Clock>,
    health: Arc<LeaseHealth>,
    pub(crate) subnet_tx: watch::Sender<Option<LeaseName>>,
    pub(crate) hooks: HookRunner,
    env_retry: Option<EnvRetry>,
    /// Subnet-change hooks waiting for `subnet.env` to be written.
    hooks_after_env: Vec<HookRun>,
}

impl SubnetOutputs {
    /// Outputs for `cfg`. Starts the hook runner, which re-runs the hooks the journal lists,
    /// so it must be called inside a tokio runtime.
    pub(crate) fn new(
        cfg: DriverConfig,
        clock: Arc<dyn Clock>,
        health: Arc<LeaseHealth>,
        subnet_tx: watch::Sender<Option<LeaseName>>,
    ) -> Self {
        let hooks = HookRunner::start(
            HookConfig {
                on_subnet_change: cfg.on_subnet_change.clone(),
                on_lease_lost: cfg.on_lease_lost.clone(),
                timeout: cfg.hook_timeout,
                journal: cfg.state_dir.join(super::hooks::PENDING_FILE),
            },
            health.clone(),
        );
        Self { cfg, clock, health, subnet_tx, hooks, env_retry: None, hooks_after_env: Vec::new() }
    }

    /// Shows `name` as the subnet in use: `subnet.env` (unless `keep_file` and the file
    /// already says so) and the data plane.
    pub(crate) fn show(&mut self, name: LeaseName, keep_file: bool) {
        let unchanged = keep_file
            && matches!(subnet_env::read(&self.cfg.subnet_file), subnet_env::ReadOutcome::Valid(env) if env == self.subnet_env(name.subnet, name.ipv6));
        if !unchanged {
            self.write_subnet_env(name.subnet, name.ipv6);
        }
        self.subnet_tx.send_replace(Some(name));
    }

    /// Whether a `subnet.env` write waits for its retry.
    pub(crate) fn retry_pending(&self) -> bool {
        self.env_retry.is_some()
    }

    /// Records the subnet-change hook in the journal (before `subnet.env` is rewritten).
    pub(crate) fn record_change(&self, old: Subnet, new: Subnet) {
        self.hooks.record(&subnet_change(old, new));
    }

    /// Starts the subnet-change hook, once `subnet.env` names the new subnet.
    pub(crate) fn start_change_hook(&mut self, old: Subnet, new: Subnet) {
        let run = subnet_change(old, new);
        if self.env_retry.is_some() {
            self.hooks_after_env.push(run);
        } else {
            self.hooks.start_run(run);
        }
    }

    /// This process holds no subnet any more and another holds its identity: the data plane
    /// withdraws weft0's address and route, and `subnet.env` is removed (a pending write of it
    /// dropped), so that neither the kernel nor the CNI plugin goes on using a subnet this
    /// process does not hold. The next subnet acquired puts both back.
    pub(crate) fn withdraw(&mut self, why: &str) {
        let Some(lease) = self.subnet_tx.send_replace(None) else { return };
        self.env_retry = None;
        self.health.set_subnet_file_problem(None);
        let path = &self.cfg.subnet_file;
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                error!(path = %path.display(), error = %e, "could not remove subnet.env while withdrawing");
            }
        }
        error!(
            subnet = %lease.subnet,
            path = %path.display(),
            "WITHDREW subnet {}: {why}; removed subnet.env and weft0's address and route",
            lease.subnet
        );
    }

    pub(crate) fn write_subnet_env(&mut self, subnet: Subnet, ipv6: Option<Ipv6Subnet>) {
        let env = self.subnet_env(subnet, ipv6);
        let retry = self.env_retry.take();
        let delay = retry.as_ref().map_or(ENV_RETRY_MIN, |r| r.delay);
        self.try_write_subnet_env(env, delay, retry.map(|r| r.said).unwrap_or_default());
    }

    /// What `subnet.env` says while `subnet` is held.
    pub(crate) fn subnet_env(&self, subnet: Subnet, ipv6: Option<Ipv6Subnet>) -> SubnetEnv {
        // The IPv6 half moves with the subnet: one lease holds both.
        let ipv6 = match (&self.cfg.network.ipv6, ipv6) {
            (Some(v6), Some(half)) => Some(SubnetEnv6 { network: v6.network, subnet: half }),
            _ => None,
        };
        // On an IPv6-only network the subnet is the IPv6 one and there is no IPv4 pair.
        let ipv4 = match (&self.cfg.network.ipv4, subnet.v4()) {
            (Some(v4), Some(_)) => Some(SubnetEnv4 { network: v4.network, subnet }),
            _ => None,
        };
        SubnetEnv { ipv4, mtu: self.cfg.mtu, ipmasq: self.cfg.ip_masq, ipv6 }
    }

    /// Retries a failed `subnet.env` write when it is due.
    pub(crate) fn retry_subnet_env(&mut self, now: Instant) {
        if self.env_retry.as_ref().is_some_and(|r| now >= r.at)
            && let Some(r) = self.env_retry.take()
        {
            self.try_write_subnet_env(r.env, next_env_retry(r.delay), r.said);
        }
    }

    /// Writes `env`; on failure schedules a retry after `delay`. `said` holds the previous
    /// attempt's error, if it failed: only a new error is logged at ERROR.
    fn try_write_subnet_env(&mut self, env: SubnetEnv, delay: Duration, mut said: LogOnce) {
        let path = &self.cfg.subnet_file;
        match subnet_env::write_atomic(path, &env) {
            Ok(()) => {
                if said.clear() {
                    info!(path = %path.display(), subnet = ?env.subnet(), "subnet.env written after all");
                }
                self.health.set_subnet_file_problem(None);
                for run in std::mem::take(&mut self.hooks_after_env) {
                    self.hooks.start_run(run);
                }
            }
            Err(e) => {
                LeaseCounters::inc(&self.health.counters.subnet_file_write_failures);
                let error = e.to_string();
                if said.note(error.clone()).is_some() {
                    error!(path = %path.display(), %error, ?delay, "could not write subnet.env; retrying");
                } else {
                    debug!(path = %path.display(), %error, ?delay, "subnet.env still cannot be written");
                }
                self.health.set_subnet_file_problem(Some(format!(
                    "cannot write the subnet file {}: {error}; retrying",
                    path.display()
                )));
                let at = self.clock.now() + delay;
                self.env_retry = Some(EnvRetry { env, at, delay, said });
            }
        }
    }
}

fn subnet_change(old: Subnet, new: Subnet) -> HookRun {
    HookRun {
        kind: HookKind::SubnetChange,
        old: Some(old),
        new: Some(new),
        reason: "subnet-changed",
        holder: None,
    }
}

/// The next address from the underlay follower; never resolves without one (or once it is gone).
async fn public_ip_changed(rx: &mut Option<watch::Receiver<Ipv4Addr>>) -> Option<Ipv4Addr> {
    let Some(r) = rx.as_mut() else { return std::future::pending().await };
    if r.changed().await.is_err() {
        *rx = None;
        return None;
    }
    Some(*r.borrow_and_update())
}

async fn next_control(
    rx: &mut Option<tokio::sync::mpsc::Receiver<HandoverControl>>,
) -> Option<HandoverControl> {
    match rx {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// Resolves once a stop is requested (or whoever could request one is gone).
async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

async fn next_batch(
    w: &mut Option<(Subnet, WatchStream)>,
) -> Option<Result<super::store::WatchBatch, super::store::StoreError>> {
    match w {
        Some((_, s)) => s.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_retries_back_off_from_one_to_ten_seconds() {
        let mut d = ENV_RETRY_MIN;
        let mut seen = vec![d];
        for _ in 0..6 {
            d = next_env_retry(d);
            seen.push(d);
        }
        let secs: Vec<u64> = seen.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [1, 2, 4, 8, 10, 10, 10]);
    }
}
