//! The lease plane's status, as `/readyz` and `/metrics` show it: what the driver last saw of
//! the lease ([`LeaseStatus`]), whether `subnet.env` could be written, and the lease counters.
//! [`LeaseHealth`] is registered with the health server as a collector and a readiness check.
//!
//! Ready means: a lease is held, not past its local expiry, this process's claim on the node
//! identity (its presence key) confirmed in the store within its TTL, and the lease written to
//! `subnet.env`. The times are judged when asked, not when the driver last reported.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::metrics;
use crate::time::{Clock, Instant};
use crate::vocab::Subnet;

/// The state of a subnet the Kubernetes subnet manager holds: assigned to the Node (its
/// podCIDR) and announced on it; it never expires.
pub const ASSIGNED: &str = "assigned";

/// The lease as the driver last saw it.
#[derive(Clone, Debug, Default)]
pub struct LeaseStatus {
    /// Keeper state name (`held`, `acquiring`, `reclaiming`, `exhausted`, `clash`, ...).
    pub state: &'static str,
    /// The subnet in use.
    pub subnet: Option<Subnet>,
    /// Local expiry of the held lease.
    pub expires_at: Option<Instant>,
    /// Until when this process's identity (its presence) is known to stand in the store; past
    /// it, not ready (judged at the time of asking, like the expiry).
    pub identity_until: Option<Instant>,
    /// Why not ready, when the keeper says so.
    pub not_ready: Option<String>,
}

/// The lease plane's monotonic counters, exported on `/metrics`.
#[derive(Debug, Default)]
pub struct LeaseCounters {
    /// Subnets acquired (including adoptions after restart).
    pub acquisitions: AtomicU64,
    /// Successful renewals.
    pub renewals: AtomicU64,
    /// Leases found taken by another node.
    pub losses: AtomicU64,
    /// Leases reclaimed after they vanished.
    pub recoveries: AtomicU64,
    /// Subnet changes (the hook's trigger).
    pub subnet_changes: AtomicU64,
    /// Failed store calls.
    pub store_errors: AtomicU64,
    /// Identity clashes (clone or second daemon).
    pub identity_clashes: AtomicU64,
    /// Times the network was found exhausted.
    pub exhaustions: AtomicU64,
    /// Hooks that failed, timed out or exited non-zero.
    pub(crate) hook_failures: AtomicU64,
    /// Hook runs owed and dropped to keep the journal bounded.
    pub(crate) hook_runs_dropped: AtomicU64,
    /// Failed attempts to write `subnet.env`.
    pub(crate) subnet_file_write_failures: AtomicU64,
}

impl LeaseCounters {
    /// Adds one.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The lease plane's status: set by the driver (and by the daemon while it waits to start),
/// read by the health server.
pub struct LeaseHealth {
    clock: Arc<dyn Clock>,
    lease: Mutex<LeaseStatus>,
    subnet_file_problem: Mutex<Option<String>>,
    /// Counters; the driver and the hook runner bump them.
    pub counters: LeaseCounters,
    /// The lease driver's loop turns ([`LeaseHealth::beat`]).
    beats: AtomicU64,
}

impl std::fmt::Debug for LeaseHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseHealth").field("lease", &self.lease).finish_non_exhaustive()
    }
}

impl LeaseHealth {
    /// No lease yet (`starting`), judged against `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            lease: Mutex::new(LeaseStatus { state: "starting", ..Default::default() }),
            subnet_file_problem: Mutex::new(None),
            counters: LeaseCounters::default(),
            beats: AtomicU64::new(0),
        }
    }

    /// The lease driver turned its loop once more (it makes progress).
    pub fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// The lease driver's loop turns so far: a driver stuck somewhere stops counting (a
    /// service manager's watchdog is told only while it moves).
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::Relaxed)
    }

    /// Records the lease status.
    pub fn set_lease(&self, status: LeaseStatus) {
        *self.lease.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }

    /// The lease status.
    pub(crate) fn lease(&self) -> LeaseStatus {
        self.lease.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Records why `subnet.env` could not be written (`None`: it is up to date). While set,
    /// weft is not ready: the CNI plugin would read a stale or missing file.
    pub(crate) fn set_subnet_file_problem(&self, problem: Option<String>) {
        *self.subnet_file_problem.lock().unwrap_or_else(PoisonError::into_inner) = problem;
    }

    /// `Ok("lease <subnet> held")` when ready, `Err(reasons)` when not (`subnet.env`'s problem,
    /// then the lease's), judged now.
    pub fn readiness(&self) -> Result<String, String> {
        let l = self.lease();
        let now = self.clock.now();
        let mut reasons = Vec::new();
        if let Some(problem) =
            self.subnet_file_problem.lock().unwrap_or_else(PoisonError::into_inner).clone()
        {
            reasons.push(problem);
        }
        let lease = match (l.not_ready, l.subnet, l.expires_at) {
            (Some(reason), _, _) => Err(reason),
            (None, Some(s), Some(_)) if l.identity_until.is_some_and(|u| now >= u) => Err(format!(
                "this node's identity is not confirmed in the store (store unreachable?): a clone \
                 of this host may hold lease {s} by now"
            )),
            (None, Some(s), Some(exp)) if now < exp => Ok(s),
            // The Kubernetes subnet manager's subnet is assigned, not leased: no expiry.
            (None, Some(s), None) if l.state == ASSIGNED => Ok(s),
            (None, Some(s), Some(_)) => Err(format!("lease {s} is past its local expiry")),
            (None, _, _) => Err(format!("no lease held ({})", l.state)),
        };
        match lease {
            Ok(s) if reasons.is_empty() => Ok(format!("lease {s} held")),
            Ok(_) => Err(reasons.join("; ")),
            Err(reason) => {
                reasons.push(reason);
                Err(reasons.join("; "))
            }
        }
    }

    /// The lease metrics as of now.
    fn metrics(&self) -> LeaseMetrics {
        let l = self.lease();
        let now = self.clock.now();
        // Whole milliseconds, so that the value shows as the short decimal it is.
        let millis = |d: std::time::Duration| d.as_millis().min(u128::from(u64::MAX)) as f64;
        let seconds_to_expiry = l.expires_at.map_or(0.0, |e| {
            if e > now {
                millis(e.saturating_since(now)) / 1000.0
            } else {
                -millis(now.saturating_since(e)) / 1000.0
            }
        });
        let c = &self.counters;
        let counters = [
            &c.acquisitions,
            &c.renewals,
            &c.losses,
            &c.recoveries,
            &c.subnet_changes,
            &c.store_errors,
            &c.identity_clashes,
            &c.exhaustions,
            &c.hook_failures,
            &c.hook_runs_dropped,
            &c.subnet_file_write_failures,
        ]
        .map(|v| v.load(Ordering::Relaxed));
        LeaseMetrics {
            state: l.state,
            ready: self.readiness().is_ok(),
            seconds_to_expiry,
            subnet: l.subnet,
            counters,
        }
    }
}

impl Collector for LeaseHealth {
    /// The lease metrics, read once per scrape (so that one scrape is consistent).
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        self.metrics().encode(encoder)
    }
}

/// The keeper states `weft_lease_state` has a sample for, in order.
const LEASE_STATES: [&str; 8] =
    ["starting", "acquiring", "held", "expired", "reclaiming", "exhausted", "clash", "stopping"];

/// The lease counters' names and help, in the order of [`LeaseMetrics::counters`].
const LEASE_COUNTERS: [(&str, &str); 11] = [
    ("weft_lease_acquisitions_total", "Subnets acquired or adopted."),
    ("weft_lease_renewals_total", "Successful lease renewals."),
    ("weft_lease_losses_total", "Leases found taken by another node."),
    ("weft_lease_recoveries_total", "Leases reclaimed after they vanished."),
    ("weft_lease_subnet_changes_total", "Changes of this node's subnet."),
    ("weft_store_errors_total", "Failed store calls."),
    ("weft_identity_clashes_total", "Other live processes found with this node's identity."),
    ("weft_lease_exhaustions_total", "Times no free subnet was found."),
    ("weft_hook_failures_total", "Hooks that failed to run, timed out or exited non-zero."),
    (
        "weft_hook_runs_dropped_total",
        "Hook runs owed and dropped, not run: the journal of owed runs was full.",
    ),
    ("weft_subnet_file_write_failures_total", "Failed attempts to write subnet.env."),
];

/// What the lease metrics show, read once per scrape (so that one scrape is consistent).
#[derive(Debug)]
struct LeaseMetrics {
    state: &'static str,
    ready: bool,
    seconds_to_expiry: f64,
    subnet: Option<Subnet>,
    /// The [`LeaseCounters`], in the order of [`LEASE_COUNTERS`].
    counters: [u64; LEASE_COUNTERS.len()],
}

impl Collector for LeaseMetrics {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::gauge_family(
            &mut e,
            "weft_lease_state",
            "The lease keeper's state (1 for the current one).",
            LEASE_STATES.map(|s| ([("state", s)], u64::from(self.state == s))),
        )?;
        metrics::gauge(
            &mut e,
            "weft_lease_ready",
            "1 when a fresh lease is held.",
            u64::from(self.ready),
        )?;
        metrics::gauge(
            &mut e,
            "weft_lease_seconds_to_expiry",
            "Seconds until the held lease expires locally.",
            self.seconds_to_expiry,
        )?;
        if let Some(s) = self.subnet {
            metrics::gauge_family(
                &mut e,
                "weft_lease_info",
                "The subnet in use.",
                [([("subnet", s.to_string())], 1u64)],
            )?;
        }
        for ((name, help), value) in LEASE_COUNTERS.iter().zip(self.counters) {
            metrics::counter(&mut e, name, help, value)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::time::ManualClock;

    #[test]
    fn readiness_follows_local_expiry() {
        let clock = ManualClock::new();
        let h = Arc::new(LeaseHealth::new(Arc::new(clock.clone())));
        assert!(h.readiness().is_err());
        h.set_lease(LeaseStatus {
            state: "held",
            subnet: Some("10.244.1.0/24".parse().unwrap()),
            expires_at: Some(Instant::from_epoch(Duration::from_secs(10))),
            identity_until: None,
            not_ready: None,
        });
        h.set_subnet_file_problem(Some("cannot write /x/subnet.env: EROFS".into()));
        assert!(h.readiness().unwrap_err().contains("/x/subnet.env"));
        h.set_subnet_file_problem(None);
        assert!(h.readiness().is_ok());
        assert_eq!(h.readiness(), Ok("lease 10.244.1.0/24 held".to_owned()));
        clock.advance(Duration::from_secs(11));
        assert!(h.readiness().unwrap_err().contains("past its local expiry"));
        let m = metrics::render_collector(h.clone()).unwrap();
        assert!(m.contains("weft_lease_state{state=\"held\"} 1"));
        assert!(m.contains("weft_lease_ready 0"));
        assert!(m.contains("weft_lease_info{subnet=\"10.244.1.0/24\"} 1"));
    }

    /// The lease metrics byte for byte as weft's hand-written renderer wrote them before
    /// prometheus-client: `tests/golden/metrics_lease.prom` is that renderer's output for
    /// this state.
    #[test]
    fn lease_metrics_render_exactly_as_before() {
        let clock = ManualClock::new();
        let h = Arc::new(LeaseHealth::new(Arc::new(clock.clone())));
        h.set_lease(LeaseStatus {
            state: "held",
            subnet: Some("10.244.1.0/24".parse().unwrap()),
            expires_at: Some(Instant::from_epoch(Duration::from_millis(12_345))),
            identity_until: None,
            not_ready: None,
        });
        h.counters.renewals.fetch_add(2, Ordering::Relaxed);
        h.counters.store_errors.fetch_add(1, Ordering::Relaxed);
        assert_eq!(
            metrics::render_collector(h.clone()).unwrap(),
            include_str!("../../tests/golden/metrics_lease.prom")
        );
        // Past the expiry the gauge goes negative; without a subnet there is no info sample.
        clock.advance(Duration::from_secs(20));
        h.set_lease(LeaseStatus { subnet: None, ..h.lease() });
        let m = metrics::render_collector(h.clone()).unwrap();
        assert!(m.contains("\nweft_lease_seconds_to_expiry -7.655\n"), "{m}");
        assert!(!m.contains("weft_lease_info"), "{m}");
    }
}
