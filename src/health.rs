//! Health and metrics: what the lease driver reports, plus the metrics collectors others add
//! (the route watcher's and the data plane's counters), and the HTTP server on `--healthz-port`
//! that serves them.
//!
//! - `GET /healthz`: 200 while the process runs.
//! - `GET /readyz`: 200 only while a lease is held, not past its local expiry, this process's
//!   claim on the node identity (its presence key) confirmed in the store within its TTL, the
//!   lease written to `subnet.env`, and every registered check passes (every data plane worker runs); else 503
//!   with the reason in the body (lost to whom, exhausted, clash, store unreachable,
//!   subnet.env not writable, which worker is down, ...).
//! - `GET /metrics`: Prometheus text format (0.0.4), rendered by [`crate::metrics`]: the lease
//!   metrics here, then every collector added with [`Health::add_collector`].
//!
//! The port is open to anyone who can reach it (`0.0.0.0` by default, as flannel's), so the
//! server is bounded whatever its clients do ([`serve`], [`ServerLimits`]): at most 64
//! connections held, each closed when it sends no request for 10 s, takes over 5 s to send a
//! request head, or is 30 s old; over the cap, the connection that has waited longest for a
//! request makes room. All of it is counted in `weft_health_connections*`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::routing::get;
use hyper::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::Service as HyperService;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant as TokioInstant;
use tracing::{debug, warn};

use crate::metrics;
use crate::time::{Clock, Instant};
use crate::vocab::Subnet;

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

    /// `Ok(text)` when ready, `Err(reasons)` when not, judged at the current time: every reason
    /// that holds, the other parts' checks (a worker down, the underlay unbound: usually the
    /// cause) first, then `subnet.env`, then the lease, joined by `"; "`.
    pub fn readiness(&self) -> Result<String, String> {
        let l = self.lease();
        let mut reasons: Vec<String> = {
            let checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
            checks.iter().filter_map(|check| check()).collect()
        };
        if let Some(problem) =
            self.subnet_file_problem.lock().unwrap_or_else(PoisonError::into_inner).clone()
        {
            reasons.push(problem);
        }
        let lease = match (l.not_ready, l.subnet, l.expires_at) {
            (Some(reason), _, _) => Err(reason),
            (None, Some(s), Some(_)) if l.identity_until.is_some_and(|u| self.clock.now() >= u) => {
                Err(format!(
                    "this node's identity is not confirmed in the store (store unreachable?): a \
                     clone of this host may hold lease {s} by now"
                ))
            }
            (None, Some(s), Some(exp)) if self.clock.now() < exp => Ok(s),
            (None, Some(s), Some(_)) => Err(format!("lease {s} is past its local expiry")),
            (None, _, _) => Err(format!("no lease held ({})", l.state)),
        };
        match lease {
            Ok(s) if reasons.is_empty() => Ok(format!("weft is ready: lease {s} held")),
            Ok(_) => Err(reasons.join("; ")),
            Err(reason) => {
                reasons.push(reason);
                Err(reasons.join("; "))
            }
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

/// The health server's limits: how many connections it holds at once and how long each may
/// take. [`Default`] is what `weft run` uses, but for `idle_timeout` (`--healthz-idle-timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections held at once. A new one beyond it takes the place of the held connection
    /// that has waited longest for a request; when every held one is handling a request, the
    /// new one is closed at once (refused).
    pub max_connections: usize,
    /// How long a connection may send nothing of a request: after it was accepted, or after
    /// the response to its last request.
    pub idle_timeout: Duration,
    /// How long a request's head may take from its first byte to its last.
    pub header_timeout: Duration,
    /// The longest any connection is held, whatever it does: a slow handler, a client that
    /// does not read its response or trickles a body.
    pub max_lifetime: Duration,
    /// TCP keepalive on accepted connections: the first probe after this long without traffic,
    /// then one this often; [`KEEPALIVE_PROBES`] unanswered probes end the connection.
    pub tcp_keepalive: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            idle_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(5),
            max_lifetime: Duration::from_secs(30),
            tcp_keepalive: Duration::from_secs(5),
        }
    }
}

/// Unanswered TCP keepalive probes after which the kernel ends a health connection.
pub const KEEPALIVE_PROBES: u32 = 3;
/// How long a stopping server lets its connections finish their responses.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long the accept loop waits after an accept failed (for want of a file descriptor or
/// memory, say; the connection waits in the listen queue meanwhile).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// The longest the accept loop waits for an evicted connection's socket to be closed (its task
/// does that at once).
const EVICT_WAIT: Duration = Duration::from_secs(1);
/// At most one WARN this often about the cap and about failed accepts.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Where a held connection is in its request cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing of a request has come since `since` (the accept, or the last response).
    Idle { since: TokioInstant },
    /// A request's first bytes came at `since`; its head is not complete yet.
    Head { since: TokioInstant },
    /// A request is being handled.
    Busy,
}

/// One held connection, as its task and the accept loop share it.
#[derive(Debug)]
struct Conn {
    phase: watch::Sender<Phase>,
    /// Told when the accept loop closes it to make room for a new one.
    evict: Notify,
    /// `true` once its socket is closed and its task gone.
    gone: watch::Sender<bool>,
}

impl Conn {
    fn new() -> Self {
        let (phase, _) = watch::channel(Phase::Idle { since: TokioInstant::now() });
        Self { phase, evict: Notify::new(), gone: watch::channel(false).0 }
    }

    /// Bytes came from the client: a request has begun unless one was already under way.
    fn bytes_came(&self) {
        self.phase.send_if_modified(|p| match *p {
            Phase::Idle { .. } => {
                *p = Phase::Head { since: TokioInstant::now() };
                true
            }
            Phase::Head { .. } | Phase::Busy => false,
        });
    }

    /// Since when it has been waiting for (the rest of) a request; `None` while it is handling
    /// one.
    fn waiting_since(&self) -> Option<TokioInstant> {
        match *self.phase.borrow() {
            Phase::Idle { since } | Phase::Head { since } => Some(since),
            Phase::Busy => None,
        }
    }
}

/// What [`Connections::admit`] decided about a new connection.
#[derive(Debug)]
enum Admission {
    /// Under the cap.
    Room(Arc<Conn>),
    /// At the cap: the connection that had waited longest for a request (the second) is told
    /// to close for it.
    MadeRoom(Arc<Conn>, Arc<Conn>),
    /// At the cap, every held connection handling a request: closed at once.
    Full,
}

/// The health server's connections and what happened to them (`weft_health_connections*`).
#[derive(Debug, Default)]
struct Connections {
    held: Mutex<HashMap<u64, Arc<Conn>>>,
    refused: AtomicU64,
    evicted: AtomicU64,
    timed_out: AtomicU64,
}

impl Connections {
    /// Admits connection `id` under a cap of `cap` held connections.
    fn admit(&self, id: u64, cap: usize) -> Admission {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let mut made_room = None;
        if held.len() >= cap.max(1) {
            let longest_waiting =
                held.iter().filter_map(|(id, c)| Some((c.waiting_since()?, *id))).min();
            let Some((_, victim)) = longest_waiting else {
                Counters::inc(&self.refused);
                return Admission::Full;
            };
            made_room = held.remove(&victim);
            if let Some(victim) = &made_room {
                victim.evict.notify_one();
            }
            Counters::inc(&self.evicted);
        }
        let conn = Arc::new(Conn::new());
        held.insert(id, conn.clone());
        match made_room {
            Some(victim) => Admission::MadeRoom(conn, victim),
            None => Admission::Room(conn),
        }
    }

    fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl Collector for Connections {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        metrics::gauge(
            &mut e,
            "weft_health_connections",
            "Connections the health server holds now.",
            self.held() as u64,
        )?;
        metrics::counter(
            &mut e,
            "weft_health_connections_refused_total",
            "Connections closed at once: the cap was reached and every held one had a request.",
            count(&self.refused),
        )?;
        metrics::counter(
            &mut e,
            "weft_health_connections_evicted_total",
            "Held connections closed for a new one (the one waiting longest for a request).",
            count(&self.evicted),
        )?;
        metrics::counter(
            &mut e,
            "weft_health_connections_timed_out_total",
            "Connections closed when idle, slow to send a request head, or held too long.",
            count(&self.timed_out),
        )
    }
}

/// Takes a connection out of [`Connections`] when its task ends (or is aborted), after its
/// socket was closed, and says it is gone.
struct Held {
    conns: Arc<Connections>,
    id: u64,
    conn: Arc<Conn>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.conns.held.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
        self.conn.gone.send_replace(true);
    }
}

/// At most one log line per [`WARN_EVERY`].
#[derive(Debug, Default)]
struct Throttle(Option<TokioInstant>);

impl Throttle {
    fn ready(&mut self) -> bool {
        let now = TokioInstant::now();
        if self.0.is_some_and(|last| now.duration_since(last) < WARN_EVERY) {
            return false;
        }
        self.0 = Some(now);
        true
    }
}

/// A connection's socket, noting when a request's first bytes come.
struct TrackedIo {
    stream: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.conn.bytes_came();
        }
        polled
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The router as hyper's service, noting when a request is handled and when its response is
/// ready.
#[derive(Clone)]
struct TrackedService {
    inner: TowerToHyperService<Router>,
    conn: Arc<Conn>,
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<axum::response::Response, Infallible>> + Send>>;

impl HyperService<Request<Incoming>> for TrackedService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.conn.phase.send_replace(Phase::Busy);
        let response = self.inner.call(request);
        let conn = self.conn.clone();
        Box::pin(async move {
            let response = response.await;
            conn.phase.send_replace(Phase::Idle { since: TokioInstant::now() });
            response
        })
    }
}

/// `/healthz`, `/readyz` and `/metrics` on `health`.
fn routes(health: Arc<Health>) -> Router {
    Router::new()
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
        .with_state(health)
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown` resolves, within
/// `limits`, and adds the server's metrics to `health`.
///
/// However many clients connect and whatever they send, the server holds the sockets of at most
/// `limits.max_connections` connections, and for an instant one more (a new connection while
/// the one it replaces closes, or one being refused), so a side channel never takes the file
/// descriptors that keep the lease honest (`subnet.env`, the state files, the hook journal,
/// re-binds):
/// - Every connection is accepted at once, so the listen queue (whose connections are the
///   kernel's, not weft's descriptors) drains and a probe never waits behind a flood. Over the
///   cap, the held connection that has waited longest for a request is closed to make room
///   (`weft_health_connections_evicted_total`): idle clients cannot keep a probe out, which
///   refusing the newcomer would let them. Only when every held connection is handling a
///   request is the new one closed at once (`weft_health_connections_refused_total`).
/// - A connection that sends nothing of a request for `idle_timeout` (after its accept or its
///   last response), whose request head takes longer than `header_timeout` from its first byte,
///   or that is still open after `max_lifetime`, is closed
///   (`weft_health_connections_timed_out_total`).
/// - TCP keepalive probes find a client host that vanished without a FIN.
/// - An accept that fails (for want of descriptors or memory, say) is retried after a pause,
///   with a WARN at most once a minute; it never ends the server.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let conns = Arc::new(Connections::default());
    health.add_collector(conns.clone());
    serve_router(listener, routes(health), limits, conns, shutdown).await;
    Ok(())
}

/// [`serve`] for any router (the tests' slow handlers).
async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ServerLimits,
    conns: Arc<Connections>,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = http1::Builder::new();
    // The timeouts are the connection tasks' own (see `drive`): hyper's header timer would also
    // run while a connection is idle, so it is left off.
    http.header_read_timeout(None);
    let http = Arc::new(http);
    let service = TowerToHyperService::new(app);
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let (mut cap_warning, mut accept_warning) = (Throttle::default(), Throttle::default());
    let mut next_id = 0u64;
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            // The client gave up before the accept: nothing to wait for.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(e) => {
                if accept_warning.ready() {
                    warn!(error = %e, "the health server cannot accept a connection; retrying");
                }
                // Out of descriptors or memory, the connection waits in the listen queue: a
                // pause, not a spin.
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        next_id += 1;
        let conn = match conns.admit(next_id, limits.max_connections) {
            Admission::Room(conn) => conn,
            Admission::MadeRoom(conn, victim) => {
                if cap_warning.ready() {
                    warn!(cap = limits.max_connections, %peer, "the health server holds as many connections as it may: closing the one that waited longest for a request to make room (counted in weft_health_connections_evicted_total)");
                }
                // Its socket closed before the next accept: the cap holds for descriptors too,
                // not only for connections being served.
                let mut gone = victim.gone.subscribe();
                let _ = tokio::time::timeout(EVICT_WAIT, gone.wait_for(|g| *g)).await;
                conn
            }
            Admission::Full => {
                if cap_warning.ready() {
                    warn!(cap = limits.max_connections, %peer, "the health server holds as many connections as it may, each with a request: closing the new one (counted in weft_health_connections_refused_total)");
                }
                continue;
            }
        };
        let keepalive = TcpKeepalive::new()
            .with_time(limits.tcp_keepalive)
            .with_interval(limits.tcp_keepalive)
            .with_retries(KEEPALIVE_PROBES);
        if let Err(e) = SockRef::from(&stream).set_tcp_keepalive(&keepalive) {
            debug!(%peer, error = %e, "could not set TCP keepalive on a health connection");
        }
        let held = Held { conns: conns.clone(), id: next_id, conn: conn.clone() };
        let io = TokioIo::new(TrackedIo { stream, conn: conn.clone() });
        let service = TrackedService { inner: service.clone(), conn: conn.clone() };
        let connection = Connection { http: http.clone(), io, service, peer, conn };
        tasks.spawn(drive(connection, held, limits, closing_rx.clone()));
    }
    // New connections are refused by the kernel from here; held ones finish their responses.
    drop(listener);
    closing_tx.send_replace(true);
    let _ =
        tokio::time::timeout(SHUTDOWN_GRACE, async { while tasks.join_next().await.is_some() {} })
            .await;
}

/// One accepted connection, for [`drive`].
struct Connection {
    http: Arc<http1::Builder>,
    io: TokioIo<TrackedIo>,
    service: TrackedService,
    peer: SocketAddr,
    conn: Arc<Conn>,
}

/// When the connection in `phase` is to be closed, and why; never after `end`.
fn deadline(
    phase: Phase,
    end: TokioInstant,
    limits: &ServerLimits,
) -> (TokioInstant, &'static str) {
    let (at, why) = match phase {
        Phase::Idle { since } => (since + limits.idle_timeout, "no request came"),
        Phase::Head { since } => {
            (since + limits.header_timeout, "the request head came too slowly")
        }
        Phase::Busy => (end, "held too long"),
    };
    if at < end { (at, why) } else { (end, "held too long") }
}

/// Serves one connection until it ends, times out, is evicted, or the server stops (then its
/// response in progress is finished first, within the same deadlines); then closes its socket,
/// and only then lets `held` go.
async fn drive(c: Connection, held: Held, limits: ServerLimits, closing: watch::Receiver<bool>) {
    if serve_within_limits(c, limits, closing).await == Ended::TimedOut {
        Counters::inc(&held.conns.timed_out);
    }
    drop(held);
}

/// How [`serve_within_limits`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    /// The client closed it, or it ended after a response or an error.
    Done,
    /// It was evicted.
    Evicted,
    /// A limit of [`ServerLimits`] ran out.
    TimedOut,
}

/// [`drive`]'s connection, served until it ends; its socket is closed on return.
async fn serve_within_limits(
    c: Connection,
    limits: ServerLimits,
    mut closing: watch::Receiver<bool>,
) -> Ended {
    let Connection { http, io, service, peer, conn } = c;
    let end = TokioInstant::now() + limits.max_lifetime;
    let mut connection = std::pin::pin!(http.serve_connection(io, service));
    let mut phase = conn.phase.subscribe();
    let mut stopping = false;
    loop {
        let (at, _) = deadline(*phase.borrow_and_update(), end, &limits);
        tokio::select! {
            biased;
            ended = connection.as_mut() => {
                if let Err(e) = ended {
                    debug!(%peer, error = %e, "health connection ended with an error");
                }
                return Ended::Done;
            }
            () = conn.evict.notified() => {
                debug!(%peer, "health connection closed to make room for a new one");
                return Ended::Evicted;
            }
            Ok(()) = closing.changed(), if !stopping => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
            Ok(()) = phase.changed() => {}
            () = tokio::time::sleep_until(at) => {
                let (at, why) = deadline(*phase.borrow(), end, &limits);
                if TokioInstant::now() >= at {
                    debug!(%peer, why, "health connection timed out; closing it");
                    return Ended::TimedOut;
                }
            }
        }
    }
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
            identity_until: None,
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
            identity_until: None,
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
        let server = tokio::spawn(serve(listener, h, ServerLimits::default(), async move {
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

    // --- the server's limits --------------------------------------------------------------

    use std::sync::atomic::AtomicUsize;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A server on 127.0.0.1 for `app` within `limits`: its address, its connections, and the
    /// sender that stops it with the task that serves.
    async fn start(
        app: Router,
        limits: ServerLimits,
    ) -> (SocketAddr, Arc<Connections>, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)
    {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(Connections::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_router(listener, app, limits, conns.clone(), async move {
            let _ = stopped.await;
        }));
        (addr, conns, stop, server)
    }

    /// The real routes on a health state without a lease.
    fn health_routes() -> Router {
        routes(Arc::new(Health::new(Arc::new(ManualClock::new()))))
    }

    /// Reads (and drops) what `conn` receives until the server closes it (EOF or reset): how
    /// long that took, or `None` while it is still open after `within`.
    async fn closed_within(conn: &mut tokio::net::TcpStream, within: Duration) -> Option<Duration> {
        let t0 = std::time::Instant::now();
        let mut buf = [0u8; 4096];
        let closed = async {
            while let Ok(n) = conn.read(&mut buf).await
                && n > 0
            {}
        };
        tokio::time::timeout(within, closed).await.ok().map(|()| t0.elapsed())
    }

    /// `GET path` with `Connection: close`: the whole reply.
    async fn get_once(addr: SocketAddr, path: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        conn.write_all(req.as_bytes()).await.unwrap();
        let mut reply = String::new();
        let _ = conn.read_to_string(&mut reply).await;
        reply
    }

    async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "{what}: not within 5 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn limits(idle_ms: u64, header_ms: u64) -> ServerLimits {
        ServerLimits {
            idle_timeout: Duration::from_millis(idle_ms),
            header_timeout: Duration::from_millis(header_ms),
            ..ServerLimits::default()
        }
    }

    /// A connection that never sends a byte is closed after the idle timeout, and so is a kept
    /// alive one after its response; both counted.
    #[tokio::test]
    async fn an_idle_connection_is_closed_after_the_idle_timeout() {
        let idle = Duration::from_millis(300);
        let (addr, conns, stop, server) = start(health_routes(), limits(300, 5_000)).await;
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let took = closed_within(&mut silent, Duration::from_secs(3)).await;
        assert!(
            took.is_some_and(|t| t >= idle && t < Duration::from_secs(2)),
            "a silent connection, idle timeout {idle:?}: closed after {took:?} (None: open after 3 s)"
        );

        let mut kept = tokio::net::TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut reply = Vec::new();
        while !reply.ends_with(b"weft is running\n") {
            let mut buf = [0u8; 1024];
            let n = kept.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the response: {}", String::from_utf8_lossy(&reply));
            reply.extend_from_slice(&buf[..n]);
        }
        assert!(reply.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&reply));
        let took = closed_within(&mut kept, Duration::from_secs(3)).await;
        assert!(
            took.is_some_and(|t| t >= idle / 2 && t < Duration::from_secs(2)),
            "a kept-alive connection after its response, idle timeout {idle:?}: closed after \
             {took:?} (None: open after 3 s)"
        );
        assert_eq!(conns.timed_out.load(Ordering::Relaxed), 2);
        assert_eq!(conns.held(), 0);
        let _ = stop.send(());
        server.await.unwrap();
    }

    /// Half a request head, or one trickled a byte at a time (each byte well inside any
    /// per-read timeout), is closed once the head has taken the header timeout, long before
    /// the idle timeout; never answered; counted.
    #[tokio::test]
    async fn a_request_head_not_complete_within_the_header_timeout_is_closed() {
        let header = Duration::from_millis(400);
        let (addr, conns, stop, server) = start(health_routes(), limits(5_000, 400)).await;
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        let took = closed_within(&mut half, Duration::from_secs(3)).await;
        assert!(
            took.is_some_and(|t| t >= header && t < Duration::from_secs(2)),
            "half a request head, header timeout {header:?}: closed after {took:?} (None: open \
             after 3 s)"
        );

        let mut trickle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let t0 = std::time::Instant::now();
        let mut got = Vec::new();
        let mut closed_after = None;
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nUser-Agent: slow\r\n\r\n" {
            if trickle.write_all(&[*byte]).await.is_err() {
                closed_after = Some(t0.elapsed());
                break;
            }
            let mut buf = [0u8; 1024];
            match tokio::time::timeout(Duration::from_millis(50), trickle.read(&mut buf)).await {
                Err(_) => {}
                Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                Ok(_) => {
                    closed_after = Some(t0.elapsed());
                    break;
                }
            }
        }
        assert!(
            closed_after.is_some_and(|t| t >= header && t < Duration::from_secs(2)),
            "a head trickled a byte per 50 ms, header timeout {header:?}: closed after \
             {closed_after:?} (None: the whole head was sent)"
        );
        assert!(!got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
        assert_eq!(conns.timed_out.load(Ordering::Relaxed), 2);
        let _ = stop.send(());
        server.await.unwrap();
    }

    /// At the cap, each new connection takes the place of the held one that has waited
    /// longest for a request: however many idle clients come, no more than the cap are held,
    /// a probe is answered at once, and the rest are closed and counted. Stopping closes the
    /// held ones.
    #[tokio::test]
    async fn over_the_cap_the_connection_waiting_longest_makes_room() {
        let cap = 4;
        let lim = ServerLimits { max_connections: cap, ..ServerLimits::default() };
        let health = Arc::new(Health::new(Arc::new(ManualClock::new())));
        let (addr, conns, stop, server) = start(routes(health.clone()), lim).await;
        health.add_collector(conns.clone());
        let mut idle = Vec::new();
        for _ in 0..100 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Accepted in the order they connected, the probe last.
        let reply = get_once(addr, "/healthz").await;
        assert!(reply.starts_with("HTTP/1.1 200"), "a probe at the cap: {reply:?}");
        // The probe took the place of the oldest of the last four.
        for (i, conn) in idle.iter_mut().enumerate() {
            let within = Duration::from_millis(if i < 97 { 1000 } else { 100 });
            let closed = closed_within(conn, within).await.is_some();
            assert_eq!(closed, i < 97, "connection {i} of 100 closed: {closed}");
        }
        let m = health.render_metrics().unwrap();
        assert!(m.contains("\nweft_health_connections_evicted_total 97\n"), "{m}");
        assert!(m.contains("\nweft_health_connections_refused_total 0\n"), "{m}");
        assert!(m.contains("\nweft_health_connections 3\n"), "{m}");
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(3), server).await.unwrap().unwrap();
        for conn in &mut idle[97..] {
            assert!(closed_within(conn, Duration::from_secs(1)).await.is_some());
        }
    }

    /// When every held connection is handling a request, a new one is closed at once and
    /// counted as refused; a handler that never ends holds its connection no longer than the
    /// lifetime bound.
    #[tokio::test]
    async fn at_the_cap_with_every_connection_busy_a_new_one_is_refused_and_slow_ones_end() {
        let entered = Arc::new(AtomicUsize::new(0));
        let e = entered.clone();
        let app = Router::new().route(
            "/slow",
            get(move || {
                let e = e.clone();
                async move {
                    e.fetch_add(1, Ordering::Relaxed);
                    std::future::pending::<()>().await;
                    "never"
                }
            }),
        );
        let lifetime = Duration::from_secs(1);
        let lim =
            ServerLimits { max_connections: 2, max_lifetime: lifetime, ..limits(10_000, 5_000) };
        let (addr, conns, stop, server) = start(app, lim).await;
        let t0 = std::time::Instant::now();
        let mut slow = Vec::new();
        for _ in 0..2 {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
            slow.push(c);
        }
        wait_until("both handlers entered", || entered.load(Ordering::Relaxed) == 2).await;
        let mut late = tokio::net::TcpStream::connect(addr).await.unwrap();
        let took = closed_within(&mut late, Duration::from_millis(500)).await;
        assert!(took.is_some(), "a connection over the cap of busy ones was held");
        assert_eq!(conns.refused.load(Ordering::Relaxed), 1);
        assert_eq!(conns.evicted.load(Ordering::Relaxed), 0);
        for c in &mut slow {
            assert!(closed_within(c, Duration::from_secs(3)).await.is_some());
        }
        let took = t0.elapsed();
        assert!(took >= lifetime && took < Duration::from_secs(3), "{took:?}");
        assert_eq!(conns.timed_out.load(Ordering::Relaxed), 2);
        assert_eq!(conns.held(), 0);
        let _ = stop.send(());
        server.await.unwrap();
    }
}
