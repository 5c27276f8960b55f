//! Health and metrics: what the lease driver reports, plus the metrics collectors others add
//! (the route watcher's and the data plane's counters), and the HTTP server on `--healthz-port`
//! that serves them.
//!
//! - `GET /healthz`: 200 while the process runs.
//! - `GET /readyz`: 200 only while a lease is held, not past its local expiry, and written to
//!   `subnet.env`, and every registered check passes (every data plane worker runs); else 503
//!   with the reason in the body (lost to whom, exhausted, clash, store unreachable,
//!   subnet.env not writable, which worker is down, ...).
//! - `GET /metrics`: Prometheus text format (0.0.4), rendered by [`crate::metrics`]: the lease
//!   metrics here, then every collector added with [`Health::add_collector`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::routing::get;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::lease::record::Subnet;
use crate::metrics;
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
    pub(crate) hook_failures: AtomicU64,
    /// Hook runs owed and dropped to keep the journal bounded.
    pub(crate) hook_runs_dropped: AtomicU64,
    /// Failed attempts to write `subnet.env`.
    pub(crate) subnet_file_write_failures: AtomicU64,
}

impl Counters {
    /// Adds one.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Another part of the daemon's say on readiness: `Some(reason)` while it is not ready (a data
/// plane worker is down).
pub(crate) type ReadinessCheck = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// Shared health state.
pub struct Health {
    clock: Arc<dyn Clock>,
    lease: Mutex<LeaseStatus>,
    subnet_file_problem: Mutex<Option<String>>,
    /// Counters; the driver bumps them.
    pub counters: Counters,
    collectors: Mutex<Vec<Arc<dyn Collector>>>,
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
            collectors: Mutex::new(Vec::new()),
            checks: Mutex::new(Vec::new()),
        }
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

    /// Adds another part of the daemon's metrics (the route watcher's, the data plane's),
    /// rendered after the lease metrics and those added before it.
    pub(crate) fn add_collector(&self, collector: Arc<dyn Collector>) {
        self.collectors.lock().unwrap_or_else(PoisonError::into_inner).push(collector);
    }

    /// Adds a readiness check.
    pub(crate) fn add_check(&self, check: ReadinessCheck) {
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

    /// The lease metrics as of now, for [`Health::render_metrics`].
    fn lease_metrics(&self) -> LeaseMetrics {
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

    /// The Prometheus text exposition: the lease metrics, then every added collector's.
    pub(crate) fn render_metrics(&self) -> Result<String, metrics::RenderError> {
        let mut all: Vec<Arc<dyn Collector>> = vec![Arc::new(self.lease_metrics())];
        all.extend(self.collectors.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned());
        metrics::render(&all)
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
    /// The [`Counters`], in the order of [`LEASE_COUNTERS`].
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

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown` resolves.
pub(crate) async fn serve(
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
        .route(
            "/metrics",
            get(|State(h): State<Arc<Health>>| async move {
                match h.render_metrics() {
                    Ok(text) => {
                        (StatusCode::OK, [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text)
                    }
                    Err(e) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        format!("{e}\n"),
                    ),
                }
            }),
        )
        .with_state(health);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// Binds the health listener (`--healthz-ip`, `--healthz-port`).
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
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
        let m = h.render_metrics().unwrap();
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
        let h = Health::new(Arc::new(clock.clone()));
        h.set_lease(LeaseStatus {
            state: "held",
            subnet: Some("10.244.1.0/24".parse().unwrap()),
            expires_at: Some(Instant::from_epoch(Duration::from_millis(12_345))),
            not_ready: None,
        });
        h.counters.renewals.fetch_add(2, Ordering::Relaxed);
        h.counters.store_errors.fetch_add(1, Ordering::Relaxed);
        assert_eq!(h.render_metrics().unwrap(), include_str!("../tests/golden/metrics_lease.prom"));
        // Past the expiry the gauge goes negative; without a subnet there is no info sample.
        clock.advance(Duration::from_secs(20));
        h.set_lease(LeaseStatus { subnet: None, ..h.lease() });
        let m = h.render_metrics().unwrap();
        assert!(m.contains("\nweft_lease_seconds_to_expiry -7.655\n"), "{m}");
        assert!(!m.contains("weft_lease_info"), "{m}");
    }

    /// Collectors added by other parts of the daemon follow the lease metrics, in the order
    /// they were added.
    #[test]
    fn added_collectors_follow_the_lease_metrics_in_order() {
        #[derive(Debug)]
        struct One(&'static str);
        impl Collector for One {
            fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
                metrics::gauge(&mut e, self.0, "One.", 1u64)
            }
        }
        let h = Health::new(Arc::new(ManualClock::new()));
        h.add_collector(Arc::new(One("weft_z")));
        h.add_collector(Arc::new(One("weft_a")));
        let m = h.render_metrics().unwrap();
        let samples: Vec<&str> = m.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.first(), Some(&"weft_lease_state{state=\"starting\"} 1"));
        assert_eq!(samples[samples.len() - 2..], ["weft_z 1", "weft_a 1"]);
    }

    /// `/metrics` over HTTP: the text, with the Content-Type of the format it is in.
    #[tokio::test]
    async fn metrics_are_served_as_prometheus_text_0_0_4() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let h = Arc::new(Health::new(Arc::new(ManualClock::new())));
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, h, async move {
            let _ = stopped.await;
        }));
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        conn.read_to_string(&mut reply).await.unwrap();
        let _ = stop.send(());
        server.await.unwrap().unwrap();
        let (head, body) = reply.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let head = head.to_ascii_lowercase();
        assert!(
            head.contains("\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            "{head}"
        );
        assert!(body.contains("\nweft_lease_ready 0\n"), "{body}");
    }
}
