//! Health and metrics: what the lease driver reports, plus the metrics sources others register
//! (the route watcher's and the data plane's counters), and the HTTP server on `--healthz-port`
//! that serves them.
//!
//! - `GET /healthz`: 200 while the process runs.
//! - `GET /readyz`: 200 only while a lease is held, not past its local expiry, and written to
//!   `subnet.env`, and every registered check passes (every data plane worker runs); else 503
//!   with the reason in the body (lost to whom, exhausted, clash, store unreachable,
//!   subnet.env not writable, which worker is down, ...).
//! - `GET /metrics`: Prometheus text format.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::lease::record::Subnet;
use crate::time::{Clock, Instant};

/// The lease as the driver last saw it.
#[derive(Clone, Debug, Default)]
pub struct LeaseStatus {
    /// Keeper state name (`held`, `acquiring`, `reclaiming`, `exhausted`, `clash`, ...).
    pub state: &'static str,
    /// The subnet in use.
    pub subnet: Option<Subnet>,
    /// Local expiry of the held lease.
    pub expires_at: Option<Instant>,
    /// Why not ready, when the keeper says so.
    pub not_ready: Option<String>,
}

/// Monotonic counters exported on `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
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
    pub hook_failures: AtomicU64,
    /// Failed attempts to write `subnet.env`.
    pub subnet_file_write_failures: AtomicU64,
}

impl Counters {
    /// Adds one.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Extra metrics text from another part of the daemon (the data plane).
pub type MetricsSource = Box<dyn Fn(&mut String) + Send + Sync>;

/// Another part of the daemon's say on readiness: `Some(reason)` while it is not ready (a data
/// plane worker is down).
pub type ReadinessCheck = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// Shared health state.
pub struct Health {
    clock: Arc<dyn Clock>,
    lease: Mutex<LeaseStatus>,
    subnet_file_problem: Mutex<Option<String>>,
    /// Counters; the driver bumps them.
    pub counters: Counters,
    sources: Mutex<Vec<MetricsSource>>,
    checks: Mutex<Vec<ReadinessCheck>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").field("lease", &self.lease).finish_non_exhaustive()
    }
}

impl Health {
    /// Health state read against `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            lease: Mutex::new(LeaseStatus { state: "starting", ..Default::default() }),
            subnet_file_problem: Mutex::new(None),
            counters: Counters::default(),
            sources: Mutex::new(Vec::new()),
            checks: Mutex::new(Vec::new()),
        }
    }

    /// Records the lease status.
    pub fn set_lease(&self, status: LeaseStatus) {
        *self.lease.lock().unwrap_or_else(PoisonError::into_inner) = status;
    }

    /// The lease status.
    pub fn lease(&self) -> LeaseStatus {
        self.lease.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Records why `subnet.env` could not be written (`None`: it is up to date). While set,
    /// weft is not ready: the CNI plugin would read a stale or missing file.
    pub fn set_subnet_file_problem(&self, problem: Option<String>) {
        *self.subnet_file_problem.lock().unwrap_or_else(PoisonError::into_inner) = problem;
    }

    /// Adds a metrics source.
    pub fn add_source(&self, source: MetricsSource) {
        self.sources.lock().unwrap_or_else(PoisonError::into_inner).push(source);
    }

    /// Adds a readiness check.
    pub fn add_check(&self, check: ReadinessCheck) {
        self.checks.lock().unwrap_or_else(PoisonError::into_inner).push(check);
    }

    /// `Ok(text)` when ready, `Err(reason)` when not, judged at the current time.
    pub fn readiness(&self) -> Result<String, String> {
        let l = self.lease();
        if let Some(reason) = l.not_ready {
            return Err(reason);
        }
        let checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(problem) = checks.iter().find_map(|check| check()) {
            return Err(problem);
        }
        drop(checks);
        if let Some(problem) =
            self.subnet_file_problem.lock().unwrap_or_else(PoisonError::into_inner).clone()
        {
            return Err(problem);
        }
        match (l.subnet, l.expires_at) {
            (Some(s), Some(exp)) if self.clock.now() < exp => {
                Ok(format!("weft is ready: lease {s} held"))
            }
            (Some(s), Some(_)) => Err(format!("lease {s} is past its local expiry")),
            _ => Err(format!("no lease held ({})", l.state)),
        }
    }

    /// The Prometheus text exposition.
    pub fn render_metrics(&self) -> String {
        let l = self.lease();
        let now = self.clock.now();
        let mut out = String::new();
        let c = &self.counters;
        let _ = writeln!(
            out,
            "# HELP weft_lease_state The lease keeper's state (1 for the current one)."
        );
        let _ = writeln!(out, "# TYPE weft_lease_state gauge");
        for s in [
            "starting",
            "acquiring",
            "held",
            "expired",
            "reclaiming",
            "exhausted",
            "clash",
            "stopping",
        ] {
            let _ = writeln!(out, "weft_lease_state{{state=\"{s}\"}} {}", u8::from(l.state == s));
        }
        let _ = writeln!(out, "# HELP weft_lease_ready 1 when a fresh lease is held.");
        let _ = writeln!(out, "# TYPE weft_lease_ready gauge");
        let _ = writeln!(out, "weft_lease_ready {}", u8::from(self.readiness().is_ok()));
        let _ = writeln!(
            out,
            "# HELP weft_lease_seconds_to_expiry Seconds until the held lease expires locally."
        );
        let _ = writeln!(out, "# TYPE weft_lease_seconds_to_expiry gauge");
        let secs = l.expires_at.map_or(0.0, |e| {
            if e > now {
                e.saturating_since(now).as_secs_f64()
            } else {
                -now.saturating_since(e).as_secs_f64()
            }
        });
        let _ = writeln!(out, "weft_lease_seconds_to_expiry {secs:.3}");
        if let Some(s) = l.subnet {
            let _ = writeln!(out, "# HELP weft_lease_info The subnet in use.");
            let _ = writeln!(out, "# TYPE weft_lease_info gauge");
            let _ = writeln!(out, "weft_lease_info{{subnet=\"{s}\"}} 1");
        }
        let counters: [(&str, &str, &AtomicU64); 10] = [
            ("weft_lease_acquisitions_total", "Subnets acquired or adopted.", &c.acquisitions),
            ("weft_lease_renewals_total", "Successful lease renewals.", &c.renewals),
            ("weft_lease_losses_total", "Leases found taken by another node.", &c.losses),
            ("weft_lease_recoveries_total", "Leases reclaimed after they vanished.", &c.recoveries),
            (
                "weft_lease_subnet_changes_total",
                "Changes of this node's subnet.",
                &c.subnet_changes,
            ),
            ("weft_store_errors_total", "Failed store calls.", &c.store_errors),
            (
                "weft_identity_clashes_total",
                "Other live processes found with this node's identity.",
                &c.identity_clashes,
            ),
            ("weft_lease_exhaustions_total", "Times no free subnet was found.", &c.exhaustions),
            (
                "weft_hook_failures_total",
                "Hooks that failed to run, timed out or exited non-zero.",
                &c.hook_failures,
            ),
            (
                "weft_subnet_file_write_failures_total",
                "Failed attempts to write subnet.env.",
                &c.subnet_file_write_failures,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        }
        for source in self.sources.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            source(&mut out);
        }
        out
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "weft is running\n" }))
        .route(
            "/readyz",
            get(|State(h): State<Arc<Health>>| async move {
                match h.readiness() {
                    Ok(text) => (StatusCode::OK, text + "\n"),
                    Err(reason) => {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("weft is not ready: {reason}\n"))
                    }
                }
            }),
        )
        .route("/metrics", get(|State(h): State<Arc<Health>>| async move { h.render_metrics() }))
        .with_state(health);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// Binds the health listener (`--healthz-ip`, `--healthz-port`).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::time::ManualClock;

    #[test]
    fn readiness_follows_local_expiry() {
        let clock = ManualClock::new();
        let h = Health::new(Arc::new(clock.clone()));
        assert!(h.readiness().is_err());
        h.set_lease(LeaseStatus {
            state: "held",
            subnet: Some("10.244.1.0/24".parse().unwrap()),
            expires_at: Some(Instant::from_epoch(Duration::from_secs(10))),
            not_ready: None,
        });
        h.set_subnet_file_problem(Some("cannot write /x/subnet.env: EROFS".into()));
        assert!(h.readiness().unwrap_err().contains("/x/subnet.env"));
        h.set_subnet_file_problem(None);
        assert!(h.readiness().is_ok());
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let d = down.clone();
        h.add_check(Box::new(move || d.load(Ordering::Relaxed).then(|| "worker q0 down".into())));
        assert_eq!(h.readiness().unwrap_err(), "worker q0 down");
        down.store(false, Ordering::Relaxed);
        assert!(h.readiness().is_ok());
        clock.advance(Duration::from_secs(11));
        assert!(h.readiness().unwrap_err().contains("past its local expiry"));
        let m = h.render_metrics();
        assert!(m.contains("weft_lease_state{state=\"held\"} 1"));
        assert!(m.contains("weft_lease_ready 0"));
        assert!(m.contains("weft_lease_info{subnet=\"10.244.1.0/24\"} 1"));
    }
}
