//! The lease lifecycle as a pure state machine: it decides, a driver does the I/O.
//!
//! # Call protocol
//! The keeper holds no store client, no clock and no task. A driver loops:
//! 1. drain [`Keeper::poll_event`] and act on each event (logs, `subnet.env`, hooks, metrics);
//! 2. take [`Keeper::poll_action`]; if there is one, run it against the store and feed the
//!    result back with [`Keeper::handle_result`], stamped with the `now` at which the action was
//!    *issued* (the lease's local expiry counts from the request, never from the reply);
//! 3. otherwise wait until [`Keeper::poll_timeout`] or until the own-key watch delivers a change
//!    ([`Keeper::handle_own_key`]), then go to 1.
//!
//! At most one action is in flight: `poll_action` returns `None` until its result is handled.
//! The driver gives up on a call after [`Keeper::call_budget`] and feeds back
//! [`Action::timed_out`]: while a lease is held, no call may keep the one slot so long that the
//! renewal can no longer be retried before the local expiry.
//! `now` must never go backwards; drivers pass a boot-time clock so that suspend counts.
//!
//! # What it guarantees
//! - Every write it asks for is compare-guarded (see [`super::store`]): it never asks to write a
//!   key it does not hold by mod revision, so it never writes to another node's key.
//! - A key that vanished (expiry during suspend or partition, an operator's revoke) is reclaimed
//!   with create-if-absent: [`KeeperEvent::Recovered`], same subnet.
//! - A key another node now holds is never fought over: [`KeeperEvent::Lost`], then a new
//!   subnet by [`super::policy`], then [`KeeperEvent::SubnetChanged`].
//! - A key rewritten by this node's identity but another incarnation, or a presence key kept
//!   alive by one, is a clone or a second daemon: [`KeeperEvent::IdentityClash`]; the keeper
//!   writes no lease and stays not ready, but the clash is not terminal: it keeps trying to
//!   claim presence with backoff, and once the other process is gone it acquires again
//!   ([`KeeperEvent::IdentityClashOver`]).
//! - "Kept alive" means the presence key *beats*: a live process rewrites it every presence
//!   TTL, so its mod revision moves. A dead process's key can outlive its TTL (etcd raises a
//!   short TTL to its minimum, and every leader change extends every lease), but it never
//!   beats: a fast restart waits for it to go and is never a clash.
//! - The lease is renewed at half the TTL and never later than `expiry − margin`; a failed
//!   renewal is retried with backoff until the local expiry, and after it (then reclaimed).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::policy::{self, Candidate, Choice, CreateReason};
use super::record::{
    Incarnation, Ipv6Subnet, LeaseAttrs, LeaseName, NodeId, Revision, StoreLeaseId, StoredLease,
    Subnet,
};
use super::store::{
    CreateOutcome, HeldLease, HistoryPrune, Listing, PresenceOutcome, PresenceRecord,
    ReleaseOutcome, RenewOutcome, StoreError,
};
use crate::config::NetworkConfig;
use crate::time::Instant;

/// How long another incarnation's presence key may stand without beating before it counts as
/// live anyway (a process that keeps the lease alive but never beats, such as an older weft),
/// in presence TTLs, and at least [`CLASH_AFTER_MIN`]. A beat is proof at once.
pub(crate) const CLASH_AFTER_TTLS: u32 = 10;

/// The least time a renewal is given ([`Keeper::renew_budget`]), however little is left on
/// the lease: a retry needs a round trip too.
pub const MIN_RENEW_BUDGET: Duration = Duration::from_millis(250);

/// The most a stop's store call (relinquishing the lease, dropping presence) may take: etcd
/// answers in milliseconds when it answers at all, and a process told to stop must not wait on
/// a store that does not (the lease then runs out at its TTL, presence at its own).
pub const STOP_CALL_BUDGET: Duration = Duration::from_millis(1500);

/// How long before the local expiry the last retry of a failing renewal goes in: a renewal
/// issued before the expiry renews a lease etcd still has (etcd counts its TTL from later,
/// when the previous renewal reached it), so a store that comes back just before the expiry
/// still saves the lease.
pub const LAST_RENEWAL_LEAD: Duration = Duration::from_millis(1);

/// The least wait before a presence key that never beats counts as live: long enough for etcd's
/// minimum lease TTL and a few leader changes, each of which extends every lease.
pub(crate) const CLASH_AFTER_MIN: Duration = Duration::from_secs(60);

/// What the keeper needs to know, fixed for its lifetime.
#[derive(Clone, Debug)]
pub struct KeeperConfig {
    /// The validated network config.
    pub network: NetworkConfig,
    /// The value to publish (node ID and incarnation are filled in by the keeper).
    pub attrs: LeaseAttrs,
    /// This node's identity.
    pub node: NodeId,
    /// This process.
    pub incarnation: Incarnation,
    /// The subnet lease TTL.
    pub ttl: Duration,
    /// Renew no later than `expiry − renew_margin` (and at half the TTL by default).
    pub renew_margin: Duration,
    /// The TTL of the presence key.
    pub presence_ttl: Duration,
    /// The subnet this node held before, from `subnet.env` (a hint, never trusted over etcd).
    pub previous: Option<Subnet>,
    /// First retry delay after a failed store call.
    pub retry_min: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// Seeds the random spread of fresh picks and retry jitter (deterministic in tests).
    pub seed: u64,
}

impl KeeperConfig {
    /// Sensible retry and presence timings for a TTL: presence lives `min(ttl/2, 10 s)`,
    /// retries start at `min(ttl/20, 1 s)` and back off to `min(ttl/8, 30 s)`.
    pub fn timings_for(ttl: Duration) -> (Duration, Duration, Duration) {
        let presence = (ttl / 2).min(Duration::from_secs(10)).max(Duration::from_millis(500));
        let retry_min = (ttl / 20).min(Duration::from_secs(1)).max(Duration::from_millis(50));
        let retry_max = (ttl / 8).min(Duration::from_secs(30)).max(retry_min);
        (presence, retry_min, retry_max)
    }
}

/// What a keeper that holds its lease steadily hands to the next process of this node (an
/// upgrade, [`Keeper::hand_over`]): the lease and this process's presence as they stand, so
/// that the next keeper ([`Keeper::take_over`]) goes on renewing both as the same incarnation,
/// with no write: no create, no clash, no subnet change. Times are on the boot-time clock,
/// which every process of the host shares.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeeperHandover {
    /// The incarnation whose presence and lease these are: the next process goes on as it.
    pub incarnation: Incarnation,
    /// The lease key's name (both halves, in the store's key form).
    pub key: String,
    /// The key's mod revision after the last write.
    pub mod_revision: i64,
    /// The store lease the key is attached to.
    pub lease_id: i64,
    /// The presence key's store lease.
    pub presence_lease: i64,
    /// Until when the presence is known to stand, since the clock's epoch.
    pub presence_until: Duration,
    /// When the lease is renewed next.
    pub renew_at: Duration,
    /// The lease's local expiry.
    pub expires_at: Duration,
}

/// Why a keeper cannot hand its lease over now ([`Keeper::hand_over`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the lease keeper is {state} ({why}): nothing to hand over yet, try again")]
pub struct NotHandable {
    /// The keeper's state ([`Keeper::state_name`]).
    pub state: &'static str,
    /// What is missing.
    pub why: &'static str,
}

/// A store call the keeper wants made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// [`super::store::Store::claim_presence`].
    ClaimPresence {
        /// Our presence record.
        record: PresenceRecord,
        /// Its TTL.
        ttl: Duration,
    },
    /// [`super::store::Store::keep_presence`].
    KeepPresence {
        /// The presence lease.
        lease: StoreLeaseId,
        /// Also rewrite the key, so that a process waiting on it sees it beat.
        beat: bool,
    },
    /// [`super::store::Store::list_with_presence`].
    List,
    /// [`super::store::Store::create_pruning`].
    Create {
        /// The key to create: the subnet, and its IPv6 half on a dual-stack network.
        name: LeaseName,
        /// Our value.
        attrs: LeaseAttrs,
        /// The lease TTL.
        ttl: Duration,
        /// History records this create supersedes (this node's, of other subnets).
        prune: Vec<HistoryPrune>,
    },
    /// [`super::store::Store::renew`]: renewal, adoption after a restart, or a probe after an
    /// own-key change.
    Renew {
        /// What we hold (or found and adopt).
        held: HeldLease,
        /// Our value.
        attrs: LeaseAttrs,
        /// The lease TTL.
        ttl: Duration,
    },
    /// [`super::store::Store::refresh`]: a renewal (or a probe after an own-key change) that
    /// keeps the key and its store lease as they are.
    Refresh {
        /// What we hold.
        held: HeldLease,
        /// Our value (for the history record).
        attrs: LeaseAttrs,
    },
    /// [`super::store::Store::release`].
    Release {
        /// What we hold.
        held: HeldLease,
    },
    /// [`super::store::Store::drop_presence`].
    DropPresence {
        /// The presence lease.
        lease: StoreLeaseId,
    },
}

impl Action {
    /// This action's result when the driver gave up on it after `after`
    /// ([`Keeper::call_budget`]): a [`StoreError::Timeout`], its outcome unknown, as for a call
    /// the store itself timed out.
    pub fn timed_out(&self, after: Duration) -> ActionResult {
        let e = StoreError::Timeout(after);
        match self {
            Action::ClaimPresence { .. } => ActionResult::ClaimPresence(Err(e)),
            Action::KeepPresence { .. } => ActionResult::KeepPresence(Err(e)),
            Action::List => ActionResult::List(Err(e)),
            Action::Create { .. } => ActionResult::Create(Err(e)),
            Action::Renew { .. } | Action::Refresh { .. } => ActionResult::Renew(Err(e)),
            Action::Release { .. } => ActionResult::Release(Err(e)),
            Action::DropPresence { .. } => ActionResult::DropPresence(Err(e)),
        }
    }
}

/// The result of an [`Action`], fed back with [`Keeper::handle_result`].
#[derive(Debug)]
pub enum ActionResult {
    /// Of [`Action::ClaimPresence`].
    ClaimPresence(Result<PresenceOutcome, StoreError>),
    /// Of [`Action::KeepPresence`].
    KeepPresence(Result<bool, StoreError>),
    /// Of [`Action::List`].
    List(Result<Listing, StoreError>),
    /// Of [`Action::Create`].
    Create(Result<CreateOutcome, StoreError>),
    /// Of [`Action::Renew`] and [`Action::Refresh`].
    Renew(Result<RenewOutcome, StoreError>),
    /// Of [`Action::Release`].
    Release(Result<ReleaseOutcome, StoreError>),
    /// Of [`Action::DropPresence`].
    DropPresence(Result<(), StoreError>),
}

/// How a subnet was acquired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireKind {
    /// A live lease of this node's, adopted after a restart.
    Adopted,
    /// Handed over by the previous process of this node (an upgrade): held as it was.
    HandedOver,
    /// Created by a policy rule.
    Created(CreateReason),
}

/// Why a lease was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReason {
    /// Another node holds the subnet now.
    TakenByAnotherNode,
    /// The key holds a value that does not parse: not ours, and not safe to touch.
    UnreadableValue,
}

/// What happened, for the driver to act on (log, `subnet.env`, hooks, metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeeperEvent {
    /// A subnet is held: write `subnet.env`, configure the data plane.
    Acquired {
        /// The subnet.
        subnet: Subnet,
        /// How.
        kind: AcquireKind,
    },
    /// The subnet changed from `old` (held before in this run, or named by `subnet.env`).
    /// Run `--on-subnet-change OLD NEW`.
    SubnetChanged {
        /// The subnet before.
        old: Subnet,
        /// The subnet now.
        new: Subnet,
    },
    /// The lease was renewed.
    Renewed {
        /// The subnet.
        subnet: Subnet,
    },
    /// The key had vanished (expiry, revoke) and was reclaimed: same subnet, no disruption.
    Recovered {
        /// The subnet.
        subnet: Subnet,
    },
    /// The subnet is held by someone else now. Be loud; run `--on-lease-lost`.
    Lost {
        /// The lost subnet.
        subnet: Subnet,
        /// Why.
        reason: LossReason,
        /// The new holder's public IP (its IPv6 one on an IPv6-only network), when known.
        holder: Option<IpAddr>,
        /// The new holder's node ID, when it is a weft node.
        holder_node: Option<NodeId>,
    },
    /// The previous subnet (from `subnet.env` or history) is held by another node; not taken.
    PreviousTaken {
        /// The subnet.
        subnet: Subnet,
        /// Its holder's public IP (its IPv6 one on an IPv6-only network).
        holder: IpAddr,
    },
    /// No subnet is free. Not ready; retrying.
    Exhausted,
    /// Another live process carries this node's identity: a cloned machine or a second daemon.
    IdentityClash {
        /// The other process's incarnation.
        other: Option<Incarnation>,
        /// Its public IP.
        other_ip: Option<IpAddr>,
    },
    /// The other process of an identity clash is gone (its presence key expired or was
    /// dropped): this process claimed presence and acquires a lease again.
    IdentityClashOver,
    /// A previous process of this node still has its presence key; waiting for it to expire.
    WaitingForPreviousProcess {
        /// Its incarnation.
        other: Incarnation,
        /// How long at most.
        wait: Duration,
    },
    /// A store call failed; the keeper retries.
    StoreTrouble {
        /// Which call.
        action: &'static str,
        /// The error, for the log.
        error: String,
        /// Whether the lease is still within its local TTL.
        lease_valid: bool,
    },
    /// The local expiry passed without a renewal (etcd unreachable): the lease may be gone.
    ExpiredLocally {
        /// The subnet.
        subnet: Subnet,
    },
    /// The lease was released on shutdown (`--relinquish-on-exit`).
    Released {
        /// The subnet.
        subnet: Subnet,
    },
}

/// Readiness, for `/readyz`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// A fresh lease is held.
    Ready,
    /// Not ready, with the reason.
    NotReady(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Presence {
    Unclaimed,
    Claimed {
        lease: StoreLeaseId,
        keep_at: Instant,
        beat_at: Instant,
    },
    /// Another incarnation's presence key stands; `seen` is its mod revision when first seen:
    /// if it moves, that process is alive.
    WaitingFor {
        other: Incarnation,
        since: Instant,
        seen: Revision,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Need a listing to choose a subnet.
    Acquire,
    /// Policy chose to create this subnet; the create prunes this node's superseded history
    /// (`own_history`: this node's records of subnets not live at the listing, less the one
    /// created). Should the key be taken meanwhile, the next of `fallbacks` is created instead,
    /// without listing again.
    Creating {
        name: LeaseName,
        reason: CreateReason,
        own_history: Vec<HistoryPrune>,
        fallbacks: VecDeque<Candidate>,
    },
    /// Policy found our live lease; rewrite it on our own revision.
    Adopting { lease: StoredLease },
    /// A lease is held.
    Held,
    /// Our key vanished; create it again, with both halves.
    Reclaim { name: LeaseName },
    /// Another process carries our identity. We write no lease; we retry claiming presence.
    Clash { reason: String },
    /// No free subnet.
    Exhausted,
    /// Shutting down or done.
    Stopping,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InFlight {
    ClaimPresence,
    KeepPresence { beat: bool },
    List,
    Create,
    Renew,
    Release,
    DropPresence,
}

/// The lease lifecycle of one node. See the module docs for the call protocol.
#[derive(Debug)]
pub struct Keeper {
    cfg: KeeperConfig,
    attrs: LeaseAttrs,
    phase: Phase,
    presence: Presence,
    /// Until when this process's presence (its claim on the node identity) is known to stand:
    /// the issue time of the last claim or keep that succeeded, plus the presence TTL. Past it,
    /// a clone may hold the identity and the lease: not ready.
    presence_until: Option<Instant>,
    held: Option<HeldLease>,
    /// The subnet held last (or named by `subnet.env` at start): the "old" of a subnet change.
    last_subnet: Option<Subnet>,
    renew_at: Instant,
    expires_at: Instant,
    expiry_reported: bool,
    /// An own-key change that may not be ours: probe with a renew as soon as possible.
    probe: bool,
    /// The published value changed (a new public IP): write it with a renew at once.
    republish: bool,
    retry_at: Instant,
    retry_delay: Duration,
    in_flight: Option<(InFlight, Instant)>,
    shutdown: Option<bool>,
    reported_previous_taken: bool,
    events: VecDeque<KeeperEvent>,
    rng: StdRng,
}

impl Keeper {
    /// A keeper for a process starting at `now`.
    pub fn new(cfg: KeeperConfig, now: Instant) -> Self {
        let mut attrs = cfg.attrs.clone();
        attrs.node_id = Some(cfg.node.clone());
        attrs.incarnation = Some(cfg.incarnation.clone());
        Self {
            rng: StdRng::seed_from_u64(cfg.seed),
            attrs,
            phase: Phase::Acquire,
            presence: Presence::Unclaimed,
            presence_until: None,
            held: None,
            last_subnet: cfg.previous,
            renew_at: now,
            expires_at: now,
            expiry_reported: false,
            probe: false,
            republish: false,
            retry_at: now,
            retry_delay: cfg.retry_min,
            in_flight: None,
            shutdown: None,
            reported_previous_taken: false,
            events: VecDeque::new(),
            cfg,
        }
    }

    /// A keeper that goes on where another process of this node handed over (`handed`, see
    /// [`KeeperHandover`]), at `now`: it holds the lease, its presence claimed, and reports
    /// [`KeeperEvent::Acquired`] with [`AcquireKind::HandedOver`]. `cfg.incarnation` is
    /// replaced by the handed one.
    ///
    /// # Errors
    /// The handed key does not name a lease of this network.
    pub fn take_over(
        mut cfg: KeeperConfig,
        handed: &KeeperHandover,
        now: Instant,
    ) -> Result<Self, String> {
        let name = LeaseName::parse(&handed.key)
            .map_err(|e| format!("the handed lease key {:?}: {e}", handed.key))?;
        if !cfg.network.fits_lease(name) {
            return Err(format!("the handed lease {} is no lease of this network", handed.key));
        }
        cfg.incarnation = handed.incarnation.clone();
        cfg.previous = Some(name.subnet);
        let mut keeper = Self::new(cfg, now);
        let at = Instant::from_epoch;
        keeper.held = Some(HeldLease {
            subnet: name.subnet,
            ipv6: name.ipv6,
            mod_revision: Revision(handed.mod_revision),
            lease_id: StoreLeaseId(handed.lease_id),
        });
        keeper.phase = Phase::Held;
        keeper.presence = Presence::Claimed {
            lease: StoreLeaseId(handed.presence_lease),
            keep_at: now,
            beat_at: now,
        };
        keeper.presence_until = Some(at(handed.presence_until));
        keeper.renew_at = at(handed.renew_at);
        keeper.expires_at = at(handed.expires_at);
        keeper.events.push_back(KeeperEvent::Acquired {
            subnet: name.subnet,
            kind: AcquireKind::HandedOver,
        });
        Ok(keeper)
    }

    /// What the next process of this node needs to go on holding the lease
    /// ([`Keeper::take_over`]): only while the lease is held steadily (no call in flight, no
    /// probe or rewrite due, presence claimed and standing at `now`, not expired). After a
    /// handover this keeper must make no store call at all: the driver stops it without
    /// [`Keeper::handle_shutdown`].
    ///
    /// # Errors
    /// [`NotHandable`], naming the state and what is missing.
    pub fn hand_over(&self, now: Instant) -> Result<KeeperHandover, NotHandable> {
        let not = |why| NotHandable { state: self.state_name(), why };
        let Some(held) = self.held.filter(|_| self.phase == Phase::Held) else {
            return Err(not("no lease is held"));
        };
        if self.in_flight.is_some() {
            return Err(not("a store call is in flight"));
        }
        if self.probe || self.republish || self.expiry_reported || now >= self.expires_at {
            return Err(not("the lease is being checked or rewritten"));
        }
        let Presence::Claimed { lease: presence, .. } = self.presence else {
            return Err(not("this process's presence is not claimed"));
        };
        let Some(presence_until) = self.presence_until.filter(|u| now < *u) else {
            return Err(not("this process's presence is not confirmed"));
        };
        Ok(KeeperHandover {
            incarnation: self.cfg.incarnation.clone(),
            key: held.name().key_name(),
            mod_revision: held.mod_revision.0,
            lease_id: held.lease_id.0,
            presence_lease: presence.0,
            presence_until: presence_until.since_epoch(),
            renew_at: self.renew_at.since_epoch(),
            expires_at: self.expires_at.since_epoch(),
        })
    }

    // ---- getters -------------------------------------------------------------------------

    /// The configuration this keeper was made with.
    pub fn config(&self) -> &KeeperConfig {
        &self.cfg
    }

    /// The lease held now, if any.
    pub fn held(&self) -> Option<HeldLease> {
        self.held
    }

    /// The subnet this node uses now: the held one, or the last held while it is being
    /// reclaimed (the data plane keeps using it meanwhile).
    pub fn subnet(&self) -> Option<Subnet> {
        self.held.map(|h| h.subnet).or(match self.phase {
            Phase::Reclaim { name } => Some(name.subnet),
            _ => None,
        })
    }

    /// The IPv6 half of the subnet this node uses now ([`Keeper::subnet`]), on a dual-stack
    /// network.
    pub fn ipv6(&self) -> Option<Ipv6Subnet> {
        match (self.held, &self.phase) {
            (Some(h), _) => h.ipv6,
            (None, Phase::Reclaim { name }) => name.ipv6,
            _ => None,
        }
    }

    /// Until when this process's presence is known to stand, while it is claimed.
    pub fn presence_until(&self) -> Option<Instant> {
        self.presence_until.filter(|_| matches!(self.presence, Presence::Claimed { .. }))
    }

    /// The local expiry of the held lease (counted from the request that wrote it).
    pub fn expires_at(&self) -> Option<Instant> {
        self.held.map(|_| self.expires_at)
    }

    /// How long a renewal issued at `now` may take before the driver gives up on it and the
    /// keeper retries: three quarters of the time left on the lease, at least
    /// [`MIN_RENEW_BUDGET`]. A renewal stuck on an etcd member that just died would otherwise
    /// wait out the whole call timeout while the lease runs out; the last quarter leaves time
    /// for a retry, which goes to a member that answers. Not less: under load a slow renewal
    /// that succeeds is worth more than a retry that adds to the load (half the time left cut
    /// renewals that would have succeeded when 1,000 hosts joined at once). `None` when no
    /// lease is held, or once it has expired locally: then the store's own call timeout
    /// applies, since a loaded etcd may need all of it and nothing is left to save.
    pub fn renew_budget(&self, now: Instant) -> Option<Duration> {
        self.held?;
        let left = self.expires_at.saturating_since(now);
        (!left.is_zero()).then(|| (left * 3 / 4).max(MIN_RENEW_BUDGET))
    }

    /// How long the call in flight (issued at `now` by [`Keeper::poll_action`]) may take before
    /// the driver gives up on it and feeds back [`Action::timed_out`]; `None`: the store's own
    /// call timeout applies.
    ///
    /// - A renewal gets [`Keeper::renew_budget`].
    /// - A presence call while the lease is held shares the one call slot with the renewal, so
    ///   it must give the slot back by the time the renewal is due (and is given at least
    ///   [`MIN_RENEW_BUDGET`], within the renewal's own budget). Otherwise one presence
    ///   keep-alive stuck on an etcd member that just died waits out the whole call timeout
    ///   (5 s by default, longer than a short TTL) while the lease runs out behind it.
    /// - A stop's calls (relinquish, drop presence) get [`STOP_CALL_BUDGET`] each: a stop
    ///   does not wait on a store that does not answer.
    /// - Anything else (acquiring): `None`.
    pub fn call_budget(&self, now: Instant) -> Option<Duration> {
        let (kind, _) = self.in_flight?;
        match kind {
            InFlight::Release | InFlight::DropPresence => Some(STOP_CALL_BUDGET),
            InFlight::Renew => self.renew_budget(now),
            InFlight::ClaimPresence | InFlight::KeepPresence { .. }
                if self.phase == Phase::Held =>
            {
                let until_renewal = self.renew_at.saturating_since(now).max(MIN_RENEW_BUDGET);
                self.renew_budget(now).map(|b| b.min(until_renewal))
            }
            _ => None,
        }
    }

    /// Whether shutdown has finished: nothing more to do.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopping
            && self.in_flight.is_none()
            && self.next_stop_action().is_none()
    }

    /// Readiness at `now`.
    pub fn readiness(&self, now: Instant) -> Readiness {
        let not = |s: String| Readiness::NotReady(s);
        match &self.phase {
            Phase::Held if now < self.expires_at && self.presence_stands(now) => Readiness::Ready,
            Phase::Held if now < self.expires_at => not(format!(
                "this node's identity is not confirmed in the store (its presence key was not kept within \
                 its TTL, {} s: store unreachable?), so another process with node ID {} (a clone) \
                 may hold lease {} by now",
                self.cfg.presence_ttl.as_secs_f64(),
                self.cfg.node,
                self.held.map(|h| h.subnet.to_string()).unwrap_or_default()
            )),
            Phase::Held => not(format!(
                "lease on {} expired locally without a renewal (store unreachable?)",
                self.held.map(|h| h.subnet.to_string()).unwrap_or_default()
            )),
            Phase::Clash { reason } => not(reason.clone()),
            Phase::Exhausted => not("network exhausted: no free subnet".into()),
            Phase::Reclaim { name } => not(format!("reclaiming {}", name.subnet)),
            Phase::Stopping => not("shutting down".into()),
            Phase::Acquire | Phase::Creating { .. } | Phase::Adopting { .. } => {
                match &self.presence {
                    Presence::WaitingFor { other, .. } => {
                        not(format!("waiting for previous process {other} of this node to go"))
                    }
                    _ => not("acquiring a subnet lease".into()),
                }
            }
        }
    }

    /// Whether this process's presence is known to stand at `now` (see `presence_until`).
    fn presence_stands(&self, now: Instant) -> bool {
        matches!(self.presence, Presence::Claimed { .. })
            && self.presence_until.is_some_and(|until| now < until)
    }

    /// A short name of the current state, for metrics and logs.
    pub fn state_name(&self) -> &'static str {
        match self.phase {
            Phase::Acquire | Phase::Creating { .. } | Phase::Adopting { .. } => "acquiring",
            Phase::Held if self.expiry_reported => "expired",
            Phase::Held => "held",
            Phase::Reclaim { .. } => "reclaiming",
            Phase::Clash { .. } => "clash",
            Phase::Exhausted => "exhausted",
            Phase::Stopping => "stopping",
        }
    }

    // ---- inputs --------------------------------------------------------------------------

    /// This host's underlay address changed to `public_ip`: the lease value says so from the
    /// next write on, and a held lease is rewritten at once (a renew, with its usual compare on
    /// the key's revision), so that peers send to the new address.
    pub fn handle_public_ip(&mut self, public_ip: Ipv4Addr) {
        if self.attrs.public_ip != public_ip {
            self.attrs.public_ip = public_ip;
            self.republish = true;
        }
    }

    /// Begins shutdown: release the lease if `relinquish`, then drop presence.
    pub fn handle_shutdown(&mut self, relinquish: bool) {
        self.shutdown = Some(relinquish);
        self.phase = Phase::Stopping;
    }

    /// The own-key watch saw the key written (`Some`) or deleted (`None`).
    pub fn handle_own_key(&mut self, now: Instant, change: Option<&StoredLease>) {
        let _ = now;
        let Some(held) = self.held else { return };
        let ours = change.is_some_and(|l| {
            l.mod_revision <= held.mod_revision
                || l.attrs.is_incarnation(&self.cfg.node, &self.cfg.incarnation)
        });
        if !ours && self.phase == Phase::Held {
            // Not our write: renew now, whose compare tells absent from taken from clone.
            self.probe = true;
        }
    }

    /// Feeds back the result of the action issued at `issued` (see the module docs).
    pub fn handle_result(&mut self, issued: Instant, now: Instant, result: ActionResult) {
        let kind = self.in_flight.take().map(|(k, _)| k);
        match result {
            ActionResult::ClaimPresence(r) => {
                if matches!(r, Ok(PresenceOutcome::Claimed(_))) {
                    self.presence_until = Some(issued + self.cfg.presence_ttl);
                }
                self.on_claim_presence(now, r)
            }
            ActionResult::KeepPresence(r) => {
                let beat = matches!(kind, Some(InFlight::KeepPresence { beat: true }));
                if matches!(r, Ok(true)) {
                    self.presence_until = Some(issued + self.cfg.presence_ttl);
                }
                self.on_keep_presence(now, r, beat)
            }
            ActionResult::List(r) => self.on_list(now, r),
            ActionResult::Create(r) => self.on_create(issued, now, r),
            ActionResult::Renew(r) => self.on_renew(issued, now, r),
            ActionResult::Release(r) => {
                if let (Ok(ReleaseOutcome::Released), Some(h)) = (&r, self.held) {
                    self.events.push_back(KeeperEvent::Released { subnet: h.subnet });
                }
                if let Err(e) = &r {
                    self.trouble("release", e, now);
                }
                // One attempt only: a shutdown does not wait on a blind store.
                self.held = None;
            }
            ActionResult::DropPresence(r) => {
                if let Err(e) = &r {
                    self.trouble("drop presence", e, now);
                }
                self.presence = Presence::Unclaimed;
                self.shutdown = self.shutdown.map(|_| false);
            }
        }
        debug_assert!(kind.is_some(), "a result arrived with no action in flight");
    }

    // ---- outputs -------------------------------------------------------------------------

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<KeeperEvent> {
        self.events.pop_front()
    }

    /// The next store call to make at `now`, if any. Marks it in flight.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        if self.in_flight.is_some() {
            return None;
        }
        self.check_expiry(now);
        let (kind, action) = self.next_action(now)?;
        self.in_flight = Some((kind, now));
        Some(action)
    }

    /// When the keeper next wants to run (`None`: only on an input).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.in_flight.is_some() || self.phase == Phase::Stopping {
            return None;
        }
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        match (&self.phase, &self.presence) {
            (Phase::Clash { .. }, _) => at(self.retry_at),
            (_, Presence::Unclaimed | Presence::WaitingFor { .. }) => at(self.retry_at),
            (_, Presence::Claimed { keep_at, .. }) => at(*keep_at),
        }
        match self.phase {
            Phase::Held => {
                at(self.renew_at.max(self.retry_at));
                if !self.expiry_reported {
                    at(self.expires_at);
                }
            }
            Phase::Acquire
            | Phase::Exhausted
            | Phase::Creating { .. }
            | Phase::Adopting { .. }
            | Phase::Reclaim { .. } => at(self.retry_at),
            Phase::Clash { .. } | Phase::Stopping => {}
        }
        t
    }

    // ---- internals -----------------------------------------------------------------------

    fn next_stop_action(&self) -> Option<(InFlight, Action)> {
        let relinquish = self.shutdown?;
        if relinquish && let Some(held) = self.held {
            return Some((InFlight::Release, Action::Release { held }));
        }
        if let Presence::Claimed { lease, .. } = self.presence {
            return Some((InFlight::DropPresence, Action::DropPresence { lease }));
        }
        None
    }

    fn claim_presence(&self) -> (InFlight, Action) {
        let record = PresenceRecord {
            incarnation: self.cfg.incarnation.clone(),
            public_ip: self.attrs.public_ip,
            public_ipv6: self.attrs.public_ipv6,
        };
        (InFlight::ClaimPresence, Action::ClaimPresence { record, ttl: self.cfg.presence_ttl })
    }

    fn next_action(&mut self, now: Instant) -> Option<(InFlight, Action)> {
        if self.phase == Phase::Stopping {
            return self.next_stop_action();
        }
        if matches!(self.phase, Phase::Clash { .. }) {
            // Only presence, create-if-absent: it succeeds once the other process is gone.
            return (now >= self.retry_at).then(|| self.claim_presence());
        }
        // A due renewal of a held lease goes first, before keeping presence and even while
        // presence is to be claimed again: the renewal compares the revision this process
        // wrote, so a clone's write fails it, and it writes no subnet key. Behind a presence
        // call that an overloaded etcd times out, it would let the lease expire, and the
        // expiry make more load still.
        if self.phase == Phase::Held
            && matches!(self.presence, Presence::Unclaimed | Presence::Claimed { .. })
            && (self.probe || now >= self.renew_at)
            && now >= self.retry_at
            && !self.republish
        {
            let held = self.held?;
            self.probe = false;
            return Some((InFlight::Renew, Action::Refresh { held, attrs: self.attrs.clone() }));
        }
        match self.presence {
            Presence::Unclaimed | Presence::WaitingFor { .. } => {
                return (now >= self.retry_at).then(|| self.claim_presence());
            }
            Presence::Claimed { lease, keep_at, beat_at } if now >= keep_at => {
                let beat = now >= beat_at;
                return Some((
                    InFlight::KeepPresence { beat },
                    Action::KeepPresence { lease, beat },
                ));
            }
            Presence::Claimed { .. } => {}
        }
        if now < self.retry_at {
            return None;
        }
        let attrs = self.attrs.clone();
        let ttl = self.cfg.ttl;
        match &self.phase {
            Phase::Acquire | Phase::Exhausted => Some((InFlight::List, Action::List)),
            Phase::Creating { name, own_history, .. } => {
                let prune =
                    own_history.iter().filter(|h| h.subnet != name.subnet).copied().collect();
                Some((InFlight::Create, Action::Create { name: *name, attrs, ttl, prune }))
            }
            Phase::Reclaim { name } => Some((
                InFlight::Create,
                Action::Create { name: *name, attrs, ttl, prune: Vec::new() },
            )),
            Phase::Adopting { lease } => {
                let held = HeldLease {
                    subnet: lease.subnet,
                    ipv6: lease.ipv6,
                    mod_revision: lease.mod_revision,
                    lease_id: lease.lease_id,
                };
                Some((InFlight::Renew, Action::Renew { held, attrs, ttl }))
            }
            Phase::Held if self.republish => {
                let held = self.held?;
                self.probe = false;
                self.republish = false;
                Some((InFlight::Renew, Action::Renew { held, attrs, ttl }))
            }
            // The value is unchanged: keep the key's store lease alive rather than rewrite the
            // key, which would wake every route watcher in the cluster for nothing.
            Phase::Held if self.probe || now >= self.renew_at => {
                let held = self.held?;
                self.probe = false;
                Some((InFlight::Renew, Action::Refresh { held, attrs }))
            }
            Phase::Held | Phase::Clash { .. } | Phase::Stopping => None,
        }
    }

    fn check_expiry(&mut self, now: Instant) {
        if self.phase == Phase::Held && !self.expiry_reported && now >= self.expires_at {
            self.expiry_reported = true;
            if let Some(h) = self.held {
                self.events.push_back(KeeperEvent::ExpiredLocally { subnet: h.subnet });
            }
        }
    }

    fn backoff(&mut self, now: Instant) {
        let jitter = self.rng.random_range(0.8..1.2);
        self.retry_at = now + self.retry_delay.mul_f64(jitter);
        self.retry_delay = (self.retry_delay * 2).min(self.cfg.retry_max);
    }

    fn clear_backoff(&mut self, now: Instant) {
        self.retry_at = now;
        self.retry_delay = self.cfg.retry_min;
    }

    fn trouble(&mut self, action: &'static str, e: &StoreError, now: Instant) {
        let lease_valid = self.held.is_some() && now < self.expires_at;
        self.events.push_back(KeeperEvent::StoreTrouble {
            action,
            error: e.to_string(),
            lease_valid,
        });
    }

    fn hold(&mut self, issued: Instant, now: Instant, held: HeldLease) {
        self.held = Some(held);
        self.phase = Phase::Held;
        self.expires_at = issued + self.cfg.ttl;
        let margin = self.cfg.renew_margin.min(self.cfg.ttl / 2);
        let renew_after = (self.cfg.ttl / 2).min(self.cfg.ttl - margin);
        self.renew_at = issued + renew_after;
        self.expiry_reported = false;
        self.probe = false;
        self.clear_backoff(now);
    }

    fn acquired(&mut self, issued: Instant, now: Instant, held: HeldLease, kind: AcquireKind) {
        self.hold(issued, now, held);
        self.events.push_back(KeeperEvent::Acquired { subnet: held.subnet, kind });
        if let Some(old) = self.last_subnet
            && old != held.subnet
        {
            self.events.push_back(KeeperEvent::SubnetChanged { old, new: held.subnet });
        }
        self.last_subnet = Some(held.subnet);
    }

    fn clash(&mut self, now: Instant, other: Option<Incarnation>, other_ip: Option<IpAddr>) {
        let reason = format!(
            "identity clash: another live process ({}, {}) carries node ID {}; this host looks \
             like a clone of it or runs a second weft with the same --state-dir. This process \
             writes no lease and takes over only once the other is gone. Give one of them a \
             fresh identity: stop it, delete <state-dir>/node-id, start it again",
            other
                .as_ref()
                .map_or("unknown incarnation".to_string(), |i| format!("incarnation {i}")),
            other_ip.map_or("unknown address".to_string(), |ip| ip.to_string()),
            self.cfg.node
        );
        self.events.push_back(KeeperEvent::IdentityClash { other, other_ip });
        self.held = None;
        self.phase = Phase::Clash { reason };
        // Our presence, if any, lapses: the other process may keep or take it. Retry claiming
        // it after one presence TTL, then with backoff.
        self.presence = Presence::Unclaimed;
        self.retry_delay = self.cfg.presence_ttl.max(self.cfg.retry_min);
        self.backoff(now);
    }

    /// The key carries this node's identity but another incarnation: a clone's write, or a
    /// write of our own previous process that an etcd restore from a snapshot brought back.
    /// Presence tells which, so claim it again before anything else: a live clone holds it and
    /// beats (then it is a clash); if it is ours, the writer is gone and the listing adopts
    /// the key. Nothing is written meanwhile.
    fn written_by_our_identity(&mut self, now: Instant) {
        self.held = None;
        self.phase = Phase::Acquire;
        self.presence = Presence::Unclaimed;
        self.retry_at = now;
    }

    fn lost(&mut self, subnet: Subnet, current: Option<&StoredLease>, reason: LossReason) {
        self.events.push_back(KeeperEvent::Lost {
            subnet,
            reason,
            holder: current.map(|l| l.attrs.public_addr()),
            holder_node: current.and_then(|l| l.attrs.node_id.clone()),
        });
        self.held = None;
        self.phase = Phase::Acquire;
    }

    fn on_claim_presence(&mut self, now: Instant, r: Result<PresenceOutcome, StoreError>) {
        match r {
            Ok(PresenceOutcome::Claimed(lease)) => {
                self.presence = Presence::Claimed {
                    lease,
                    keep_at: now + self.cfg.presence_ttl / 3,
                    beat_at: now + self.cfg.presence_ttl,
                };
                self.clear_backoff(now);
                if matches!(self.phase, Phase::Clash { .. }) {
                    self.events.push_back(KeeperEvent::IdentityClashOver);
                    self.phase = Phase::Acquire;
                }
            }
            // Still clashing: the other process is there. Retry with backoff.
            Ok(PresenceOutcome::HeldBy { .. }) if matches!(self.phase, Phase::Clash { .. }) => {
                self.backoff(now);
            }
            Ok(PresenceOutcome::HeldBy { record: other, mod_revision }) => match &self.presence {
                // The key beat since we first saw it: its process is alive.
                Presence::WaitingFor { other: o, seen, .. }
                    if *o == other.incarnation && *seen != mod_revision =>
                {
                    let ip = other.public_addr();
                    self.clash(now, Some(other.incarnation), Some(ip));
                }
                // It never beat, but stood far longer than etcd keeps a dead process's key.
                Presence::WaitingFor { other: o, since, .. }
                    if *o == other.incarnation
                        && now.saturating_since(*since) >= self.clash_after() =>
                {
                    let ip = other.public_addr();
                    self.clash(now, Some(other.incarnation), Some(ip));
                }
                Presence::WaitingFor { other: o, .. } if *o == other.incarnation => {
                    self.retry_at = now + self.cfg.presence_ttl / 4;
                }
                _ => {
                    self.events.push_back(KeeperEvent::WaitingForPreviousProcess {
                        other: other.incarnation.clone(),
                        wait: self.clash_after(),
                    });
                    if self.phase == Phase::Held {
                        // We hold a lease and lost presence to another process of our identity:
                        // a clone that started while we were away, or our own previous process
                        // brought back by an etcd restore. Write nothing until its key either
                        // beats (a clone: clash) or goes (then adopt our lease again).
                        self.held = None;
                        self.phase = Phase::Acquire;
                    }
                    self.presence = Presence::WaitingFor {
                        other: other.incarnation,
                        since: now,
                        seen: mod_revision,
                    };
                    self.retry_at = now + self.cfg.presence_ttl / 4;
                }
            },
            Err(e) => {
                self.trouble("claim presence", &e, now);
                self.backoff(now);
            }
        }
    }

    /// How long a presence key that never beats may stand before it counts as live.
    fn clash_after(&self) -> Duration {
        (self.cfg.presence_ttl * CLASH_AFTER_TTLS).max(CLASH_AFTER_MIN)
    }

    fn on_keep_presence(&mut self, now: Instant, r: Result<bool, StoreError>, beat: bool) {
        match r {
            Ok(true) => {
                if let Presence::Claimed { lease, beat_at, .. } = self.presence {
                    let beat_at = if beat { now + self.cfg.presence_ttl } else { beat_at };
                    self.presence = Presence::Claimed {
                        lease,
                        keep_at: now + self.cfg.presence_ttl / 3,
                        beat_at,
                    };
                }
            }
            // Expired (suspend, partition): claim it again; a clone may have it by now.
            Ok(false) => {
                self.presence = Presence::Unclaimed;
                self.retry_at = now;
            }
            Err(e) => {
                self.trouble("keep presence", &e, now);
                if let Presence::Claimed { lease, beat_at, .. } = self.presence {
                    let delay = self.cfg.retry_min.max(self.cfg.presence_ttl / 6);
                    self.presence = Presence::Claimed { lease, keep_at: now + delay, beat_at };
                }
            }
        }
    }

    fn on_list(&mut self, now: Instant, r: Result<Listing, StoreError>) {
        let listing = match r {
            Ok(l) => l,
            Err(e) => {
                self.trouble("list", &e, now);
                self.backoff(now);
                return;
            }
        };
        if !matches!(self.phase, Phase::Acquire | Phase::Exhausted) {
            return;
        }
        let d = policy::choose(
            &self.cfg.network,
            &listing,
            &self.cfg.node,
            self.last_subnet,
            &mut self.rng,
        );
        if let Some((subnet, holder)) = d.previous_taken_by
            && !self.reported_previous_taken
        {
            self.reported_previous_taken = true;
            self.events.push_back(KeeperEvent::PreviousTaken { subnet, holder });
        }
        match d.choice {
            // Presence is ours (listing waits for it), so the process that wrote this lease is
            // gone: this is a restart, not a clone.
            Choice::Adopt(lease) => {
                self.phase = Phase::Adopting { lease };
                self.clear_backoff(now);
            }
            Choice::Create { subnet, ipv6, reason } => {
                let own_history = policy::own_history(&listing, &self.cfg.node);
                self.phase = Phase::Creating {
                    name: LeaseName { subnet, ipv6 },
                    reason,
                    own_history,
                    fallbacks: d.fallbacks.into(),
                };
                self.clear_backoff(now);
            }
            Choice::Exhausted => {
                if self.phase != Phase::Exhausted {
                    self.events.push_back(KeeperEvent::Exhausted);
                }
                self.phase = Phase::Exhausted;
                self.backoff(now);
            }
        }
    }

    fn on_create(&mut self, issued: Instant, now: Instant, r: Result<CreateOutcome, StoreError>) {
        let (name, reclaim, reason) = match &self.phase {
            Phase::Creating { name, reason, .. } => (*name, false, Some(*reason)),
            Phase::Reclaim { name } => (*name, true, None),
            _ => return,
        };
        let subnet = name.subnet;
        match r {
            Ok(CreateOutcome::Created(held)) if reclaim => {
                self.hold(issued, now, held);
                self.last_subnet = Some(subnet);
                self.events.push_back(KeeperEvent::Recovered { subnet });
            }
            Ok(CreateOutcome::Created(held)) => {
                let kind = AcquireKind::Created(reason.unwrap_or(CreateReason::Fresh));
                self.acquired(issued, now, held, kind);
            }
            Ok(CreateOutcome::Exists(Some(current)))
                if current.attrs.is_incarnation(&self.cfg.node, &self.cfg.incarnation) =>
            {
                // Our own earlier create went through but its reply was lost.
                let held = HeldLease {
                    subnet,
                    ipv6: current.ipv6,
                    mod_revision: current.mod_revision,
                    lease_id: current.lease_id,
                };
                if reclaim {
                    self.hold(issued, now, held);
                    self.events.push_back(KeeperEvent::Recovered { subnet });
                } else {
                    let kind = AcquireKind::Created(reason.unwrap_or(CreateReason::Fresh));
                    self.acquired(issued, now, held, kind);
                }
            }
            Ok(CreateOutcome::Exists(Some(current))) if current.attrs.is_node(&self.cfg.node) => {
                self.written_by_our_identity(now);
            }
            Ok(CreateOutcome::Exists(current)) => {
                if reclaim {
                    let reason = if current.is_some() {
                        LossReason::TakenByAnotherNode
                    } else {
                        LossReason::UnreadableValue
                    };
                    self.lost(subnet, current.as_ref(), reason);
                } else {
                    // Lost a race for a fresh subnet: create the next candidate of the same
                    // listing at once, and list again only when none is left (flannel exits).
                    self.phase = match std::mem::replace(&mut self.phase, Phase::Acquire) {
                        Phase::Creating { own_history, mut fallbacks, .. } => {
                            match fallbacks.pop_front() {
                                Some(next) => Phase::Creating {
                                    name: LeaseName { subnet: next.subnet, ipv6: next.ipv6 },
                                    reason: next.reason,
                                    own_history,
                                    fallbacks,
                                },
                                None => Phase::Acquire,
                            }
                        }
                        _ => Phase::Acquire,
                    };
                }
                self.clear_backoff(now);
            }
            Err(e) => {
                self.trouble("create", &e, now);
                // The outcome is unknown. A reclaim retries the same create (which tells its
                // own lost write by the incarnation); a fresh pick lists again.
                if !reclaim {
                    self.phase = Phase::Acquire;
                }
                self.backoff(now);
            }
        }
    }

    fn on_renew(&mut self, issued: Instant, now: Instant, r: Result<RenewOutcome, StoreError>) {
        let adopting = match &self.phase {
            Phase::Adopting { .. } => true,
            Phase::Held => false,
            _ => return,
        };
        let name = match (&self.phase, self.held) {
            (Phase::Adopting { lease }, _) => lease.name(),
            (_, Some(h)) => h.name(),
            _ => return,
        };
        let subnet = name.subnet;
        match r {
            Ok(RenewOutcome::Renewed(held)) if adopting => {
                self.acquired(issued, now, held, AcquireKind::Adopted);
            }
            Ok(RenewOutcome::Renewed(held)) => {
                let was_expired = self.expiry_reported;
                self.hold(issued, now, held);
                if was_expired {
                    self.events.push_back(KeeperEvent::Recovered { subnet });
                } else {
                    self.events.push_back(KeeperEvent::Renewed { subnet });
                }
            }
            Ok(RenewOutcome::Changed(Some(current)))
                if current.attrs.is_incarnation(&self.cfg.node, &self.cfg.incarnation) =>
            {
                // Our own earlier write (a lost reply): continue from its revision.
                let held = HeldLease {
                    subnet,
                    ipv6: current.ipv6,
                    mod_revision: current.mod_revision,
                    lease_id: current.lease_id,
                };
                if adopting {
                    self.acquired(issued, now, held, AcquireKind::Adopted);
                } else {
                    self.held = Some(held);
                    self.probe = true;
                }
            }
            Ok(RenewOutcome::Changed(Some(current))) if current.attrs.is_node(&self.cfg.node) => {
                self.written_by_our_identity(now);
            }
            Ok(RenewOutcome::Changed(_)) if adopting => {
                // It changed between our listing and our adopt; look again.
                self.phase = Phase::Acquire;
            }
            Ok(RenewOutcome::Changed(None)) => {
                // Expired or revoked: reclaim with create-if-absent. Keep `held` cleared so no
                // renew runs; the data plane keeps the subnet meanwhile.
                self.held = None;
                self.phase = Phase::Reclaim { name };
                self.clear_backoff(now);
            }
            Ok(RenewOutcome::Changed(Some(current))) => {
                self.lost(subnet, Some(&current), LossReason::TakenByAnotherNode);
                self.clear_backoff(now);
            }
            Ok(RenewOutcome::Unreadable) => {
                if adopting {
                    self.phase = Phase::Acquire;
                } else {
                    self.lost(subnet, None, LossReason::UnreadableValue);
                }
                self.clear_backoff(now);
            }
            Err(e) => {
                self.trouble(if adopting { "adopt" } else { "renew" }, &e, now);
                if adopting {
                    self.phase = Phase::Acquire;
                }
                // Retry soon, and never let the backoff run past the expiry: the last try
                // goes in just before it, while the lease is still ours to renew.
                self.backoff(now);
                let last_try = self.expires_at - LAST_RENEWAL_LEAD;
                if !adopting && self.retry_at > last_try && now < last_try {
                    self.retry_at = last_try;
                }
                // The retry goes before the next presence keep-alive: one that hangs must not
                // take the time the retry needs (see `call_budget`).
                if !adopting && let Presence::Claimed { keep_at, .. } = &mut self.presence {
                    *keep_at = (*keep_at).max(self.retry_at);
                }
            }
        }
    }
}
