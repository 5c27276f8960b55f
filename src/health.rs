//! Health and metrics: the HTTP server on `--healthz-port` and what it serves. It knows no
//! plane: the lease plane ([`crate::lease::status`]), the route watcher, the data plane and
//! the daemon's tasks each register their metrics ([`Health::add_collector`]) and their say on
//! readiness ([`Health::add_check`]).
//!
//! - `GET /healthz`: 200 while the process runs.
//! - `GET /readyz`: 200 only while every check passes; else 503 with every reason that holds
//!   in the body (no lease held, lost to whom, exhausted, clash, identity not confirmed,
//!   subnet.env not writable, a worker down, the underlay unbound, ...).
//! - `GET /metrics`: Prometheus text format (0.0.4), rendered by [`crate::metrics`]: every
//!   added collector's metrics, in the order they were added.
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

/// A part of the daemon's say on readiness: `Ok(note)` while ready (a note, if any, for the
/// 200 body: `lease 10.244.3.0/24 held`), `Err(reason)` while not (a data plane worker down,
/// the underlay unbound, no lease held).
pub type ReadinessCheck = Box<dyn Fn() -> Result<Option<String>, String> + Send + Sync>;

/// What the health server serves: every part's metrics and readiness, as each part registered
/// them. It knows no plane: each owns its state and registers a [`Collector`] and a check.
#[derive(Default)]
pub struct Health {
    collectors: Mutex<Vec<Arc<dyn Collector>>>,
    checks: Mutex<Vec<ReadinessCheck>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").finish_non_exhaustive()
    }
}

impl Health {
    /// Nothing registered yet: ready, no metrics.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a part's metrics, rendered after those added before it.
    pub fn add_collector(&self, collector: Arc<dyn Collector>) {
        self.collectors.lock().unwrap_or_else(PoisonError::into_inner).push(collector);
    }

    /// Adds a part's readiness check.
    pub fn add_check(&self, check: ReadinessCheck) {
        self.checks.lock().unwrap_or_else(PoisonError::into_inner).push(check);
    }

    /// `Ok(text)` when every check passes (`weft is ready: <notes>`), `Err(reasons)` when not:
    /// every reason that holds, in the order the checks were added, joined by `"; "`.
    pub fn readiness(&self) -> Result<String, String> {
        let checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
        let mut notes = Vec::new();
        let mut reasons = Vec::new();
        for check in checks.iter() {
            match check() {
                Ok(note) => notes.extend(note),
                Err(reason) => reasons.push(reason),
            }
        }
        if !reasons.is_empty() {
            return Err(reasons.join("; "));
        }
        if notes.is_empty() {
            Ok("weft is ready".to_owned())
        } else {
            Ok(format!("weft is ready: {}", notes.join("; ")))
        }
    }

    /// The Prometheus text exposition of every added collector.
    pub(crate) fn render_metrics(&self) -> Result<String, metrics::RenderError> {
        let all = self.collectors.lock().unwrap_or_else(PoisonError::into_inner).clone();
        metrics::render(&all)
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
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Admission::Full;
            };
            made_room = held.remove(&victim);
            if let Some(victim) = &made_room {
                victim.evict.notify_one();
            }
            self.evicted.fetch_add(1, Ordering::Relaxed);
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
        held.conns.timed_out.fetch_add(1, Ordering::Relaxed);
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

    /// Every check's reason, in the order the checks were added; ready with every note when
    /// none has one.
    #[test]
    fn readiness_is_every_checks_say() {
        let h = Health::new();
        assert_eq!(h.readiness(), Ok("weft is ready".to_owned()));
        let lease = Arc::new(std::sync::Mutex::new(Err::<String, String>("no lease held".into())));
        let l = lease.clone();
        h.add_check(Box::new(move || l.lock().unwrap().clone().map(Some)));
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let d = down.clone();
        h.add_check(Box::new(move || match d.load(Ordering::Relaxed) {
            true => Err("worker q0 down".into()),
            false => Ok(None),
        }));
        assert_eq!(h.readiness(), Err("no lease held; worker q0 down".to_owned()));
        *lease.lock().unwrap() = Ok("lease 10.244.1.0/24 held".into());
        assert_eq!(h.readiness(), Err("worker q0 down".to_owned()));
        down.store(false, Ordering::Relaxed);
        assert_eq!(h.readiness(), Ok("weft is ready: lease 10.244.1.0/24 held".to_owned()));
    }

    /// Collectors are rendered in the order they were added.
    #[test]
    fn added_collectors_are_rendered_in_order() {
        #[derive(Debug)]
        struct One(&'static str);
        impl Collector for One {
            fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
                metrics::gauge(&mut e, self.0, "One.", 1u64)
            }
        }
        let h = Health::new();
        h.add_collector(Arc::new(One("weft_z")));
        h.add_collector(Arc::new(One("weft_a")));
        let m = h.render_metrics().unwrap();
        let samples: Vec<&str> = m.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples, ["weft_z 1", "weft_a 1"]);
    }

    /// `/metrics` over HTTP: the text, with the Content-Type of the format it is in.
    #[tokio::test]
    async fn metrics_are_served_as_prometheus_text_0_0_4() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        #[derive(Debug)]
        struct Ready;
        impl Collector for Ready {
            fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
                metrics::gauge(&mut e, "weft_lease_ready", "A plane's gauge.", 0u64)
            }
        }
        let h = Arc::new(Health::new());
        h.add_collector(Arc::new(Ready));
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
        routes(Arc::new(Health::new()))
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
        let health = Arc::new(Health::new());
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
