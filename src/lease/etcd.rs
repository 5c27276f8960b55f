//! [`EtcdStore`]: the [`Store`] on etcd v3, in flannel's key layout.
//!
//! # Contract
//! The contract is the one in [`crate::lease::store`]; this module only says how each operation
//! maps to etcd calls. Every write of a subnet key is one etcd transaction whose compare is the
//! whole safety argument: create compares `version == 0`, renew and release compare the key's
//! mod revision with the one the caller holds. There is no blind put of a subnet key, so a node
//! can never overwrite a key another node wrote since it last looked, whatever its local state
//! (`subnet.env`, a stale listing, a clock that jumped) says. The history record rides in the
//! same transaction, so its mod revision is exactly the revision of the holder's last write.
//!
//! | operation | etcd calls |
//! |---|---|
//! | [`Store::config`] / [`Store::set_config`] | `Range` / `Put` of `<prefix>/config` |
//! | [`Store::watch_config`] | `Range` of `<prefix>/config`, then `Watch` of it from the next revision |
//! | [`Store::list`] | paged `Range`s of the subnets, then the history prefix, every page after the first pinned to the first one's revision: one consistent view of any size |
//! | [`Store::get`] | `Range` of one key |
//! | [`Store::create`] | `LeaseGrant`; `Txn(version == 0 ? put key + history, delete departure marker, + a nested `Txn(mod_revision == listed ? delete record + its marker)` per superseded history record : get key)`; on a failed compare `LeaseRevoke` of the new lease |
//! | [`Store::renew`] | `LeaseGrant`; `Txn(mod_revision == held ? put key + history : get key)`; then `LeaseRevoke` of the old lease (success) or of the new one (failed compare) |
//! | [`Store::release`] | `Range` (for the holder's public IP); `Txn(mod_revision == held ? delete key + put history + put departure marker : -)`; `LeaseRevoke` of the old lease |
//! | [`Store::revoke`] | `Range`; `Txn(mod_revision == read ? delete key (+ put history + departure marker, for a weft lease) : -)` (operator action) |
//! | [`Store::claim_presence`] | `LeaseGrant`; `Txn(version == 0 ? put : get)`; if the record is ours (or unreadable), `Txn(mod_revision == seen ? put : get)`; `LeaseRevoke` of whichever lease ends up unused |
//! | [`Store::keep_presence`] | with `beat`, `Txn(lease == ours ? put key, value and lease kept : -)`; one `LeaseKeepAlive` round trip |
//! | [`Store::drop_presence`] | `Txn(lease == ours ? delete : -)`; `LeaseRevoke` |
//! | [`Store::watch`] | `Watch` from a start revision: the route watchers' range ([`KeyLayout::route_watch_range`]), or one key |
//!
//! # Failures
//! Every call carries its own deadline ([`EtcdOptions::call_timeout`]) on top of gRPC's: a
//! stopped or partitioned etcd makes calls return [`StoreError::Timeout`] or
//! [`StoreError::Unavailable`], never hang. The client connects lazily: an etcd that is down
//! when the daemon starts is an `Unavailable` from the first calls, not a failed start.
//!
//! When a transaction's answer is lost (timeout, broken connection) its outcome is unknown, and
//! the freshly granted lease is deliberately *not* revoked: if the write did land, revoking would
//! delete the key we just wrote. An unused lease expires by itself after its TTL.

use std::fmt;
use std::future::Future;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, GetResponse,
    Identity, KeyValue, LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, Txn, TxnOp,
    TxnOpResponse, TxnResponse, WatchOptions,
};

use super::keys::{KeyLayout, KeyRevisions};
use super::record::{
    HistoryEntry, HistoryRecord, HistoryState, LeaseAttrs, LeaseName, NodeId, Revision,
    StoreLeaseId, StoredLease, Subnet,
};
use super::store::{
    BadEntry, BoxError, ConfigWatchStream, CreateOutcome, HeldLease, HistoryPrune, LeaseFeed,
    Listing, PresenceOutcome, PresenceRecord, ReleaseOutcome, RenewOutcome, Store, StoreError,
    WatchBatch, WatchEvent, WatchStream,
};

/// How to reach etcd and where weft's keys live.
#[derive(Clone)]
pub struct EtcdOptions {
    /// Client URLs: `http://127.0.0.1:2379`, `https://etcd-0:2379` (a bare `host:port` is
    /// taken as `http`, or `https` when TLS files are given).
    pub endpoints: Vec<String>,
    /// The key prefix (flannel's `--etcd-prefix`); a trailing `/` is ignored.
    pub prefix: String,
    /// CA bundle (PEM) that signs the server certificates. With `https` endpoints and no CA,
    /// no server is trusted: this build carries no system roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM); needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client private key (PEM); needs `cert_file`.
    pub key_file: Option<PathBuf>,
    /// etcd v3 user name; needs `password`.
    pub username: Option<String>,
    /// etcd v3 password.
    pub password: Option<String>,
    /// The deadline of every single etcd call (one grant, one transaction, ...).
    pub call_timeout: Duration,
}

impl Default for EtcdOptions {
    /// flannel's defaults: local etcd over http, prefix `/coreos.com/network`; 5 s per call.
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            prefix: "/coreos.com/network".to_owned(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            username: None,
            password: None,
            call_timeout: Duration::from_secs(5),
        }
    }
}

impl fmt::Debug for EtcdOptions {
    // By hand so that the password never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("call_timeout", &self.call_timeout)
            .finish()
    }
}

/// The [`Store`] on etcd v3. Cheap to clone: clones share one connection.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: Vec<String>,
    connect: ConnectOptions,
    /// The same options without credentials, for an etcd that has auth disabled (the Go
    /// client, and so flannel, accepts credentials there; etcd-client refuses to connect).
    connect_anonymous: ConnectOptions,
    has_user: bool,
    client: tokio::sync::Mutex<Option<Client>>,
    /// Set by [`Store::reconnect`]: the next call drops the cached client and connects anew.
    stale: std::sync::atomic::AtomicBool,
    keys: KeyLayout,
    call_timeout: Duration,
    /// Open keep-alive streams, by etcd lease: see [`EtcdStore::keep_alive_once`].
    keep_alives: tokio::sync::Mutex<KeepAlives>,
}

/// Keep-alive streams kept open between renewals, by etcd lease ID. A host keeps two leases
/// alive (its subnet key's and its presence key's), so a few entries at most; an entry whose
/// lease was replaced is dropped when the map would grow past [`KeepAlives::MAX`].
#[derive(Default)]
struct KeepAlives {
    open: Vec<(i64, LeaseKeeper, LeaseKeepAliveStream)>,
}

impl KeepAlives {
    const MAX: usize = 4;

    /// Takes the stream for `lease` out (a call that is dropped half-way then drops it too,
    /// with whatever answer it still had coming).
    fn take(&mut self, lease: i64) -> Option<(LeaseKeeper, LeaseKeepAliveStream)> {
        let i = self.open.iter().position(|(id, _, _)| *id == lease)?;
        let (_, keeper, stream) = self.open.swap_remove(i);
        Some((keeper, stream))
    }

    fn put(&mut self, lease: i64, keeper: LeaseKeeper, stream: LeaseKeepAliveStream) {
        if self.open.len() >= Self::MAX {
            self.open.remove(0);
        }
        self.open.push((lease, keeper, stream));
    }
}

/// Why etcd could not be reached, in one line: the gRPC status's message (or the client's
/// error) and the innermost cause, as "tcp connect error: Connection refused (os error 111)".
/// The client's own rendering repeats its whole chain in debug form.
fn unreachable_text(e: &etcd_client::Error) -> String {
    // The client's error gives no source; a status does (the transport's error, down to the
    // socket's).
    let (head, mut innermost): (String, &dyn std::error::Error) = match e {
        etcd_client::Error::GRpcStatus(status) => (status.message().to_string(), status),
        other => (other.to_string(), other),
    };
    let mut deeper = false;
    while let Some(next) = innermost.source() {
        innermost = next;
        deeper = true;
    }
    let cause = innermost.to_string();
    if !deeper {
        if head.is_empty() { e.to_string() } else { head }
    } else if head.contains(&cause) {
        head
    } else if head.is_empty() {
        cause
    } else {
        format!("{head}: {cause}")
    }
}

/// A plain-text error, boxed as the source of a [`StoreError`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Message(String);

fn boxed(text: impl Into<String>) -> BoxError {
    Box::new(Message(text.into()))
}

/// A file that could not be read, naming the path.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {path}: {source}")]
struct FileError {
    path: PathBuf,
    source: std::io::Error,
}

fn read_file(path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path)
        .map_err(|source| StoreError::Setup(Box::new(FileError { path: path.to_owned(), source })))
}

/// etcd lease TTLs are whole seconds: round up, so a lease never lives shorter than asked.
fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs().saturating_add(u64::from(ttl.subsec_nanos() > 0));
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

/// Whether an etcd error text is about credentials. etcd 3.4 reports a bad password and a
/// missing user as `InvalidArgument`, so the code alone does not tell.
fn is_auth_text(text: &str) -> bool {
    const AUTH_TEXTS: [&str; 5] = [
        "authentication failed",
        "user name is empty",
        "invalid auth token",
        "permission denied",
        "user name not found",
    ];
    AUTH_TEXTS.iter().any(|t| text.contains(t))
}

/// gRPC status codes (tonic's `Code`, which etcd-client does not re-export), by number.
mod code {
    pub(super) const CANCELLED: i32 = 1;
    pub(super) const UNKNOWN: i32 = 2;
    pub(super) const DEADLINE_EXCEEDED: i32 = 4;
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const RESOURCE_EXHAUSTED: i32 = 8;
    pub(super) const ABORTED: i32 = 10;
    pub(super) const OUT_OF_RANGE: i32 = 11;
    pub(super) const UNAVAILABLE: i32 = 14;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// Maps a client error onto the store's error kinds.
fn map_err(e: etcd_client::Error, timeout: Duration) -> StoreError {
    use etcd_client::Error as E;
    match &e {
        E::GRpcStatus(status) => match status.code() as i32 {
            code::DEADLINE_EXCEEDED => StoreError::Timeout(timeout),
            code::UNAUTHENTICATED | code::PERMISSION_DENIED => StoreError::Auth(Box::new(e)),
            _ if is_auth_text(status.message()) => StoreError::Auth(Box::new(e)),
            code::OUT_OF_RANGE if status.message().contains("compacted") => {
                StoreError::Compacted { requested: Revision(0), compact_revision: Revision(0) }
            }
            // Unavailable covers "no leader", "request timed out" and refused connections;
            // the others are what a connection dying mid-call looks like.
            code::UNAVAILABLE
            | code::UNKNOWN
            | code::CANCELLED
            | code::ABORTED
            | code::RESOURCE_EXHAUSTED => StoreError::Unavailable(boxed(unreachable_text(&e))),
            _ => StoreError::Protocol(Box::new(e)),
        },
        E::TransportError(_)
        | E::IoError(_)
        | E::WatchError(_)
        | E::LeaseKeepAliveError(_)
        | E::Internal(_) => StoreError::Unavailable(boxed(unreachable_text(&e))),
        E::InvalidArgs(_)
        | E::InvalidUri(_)
        | E::EndpointError(_)
        | E::InvalidMetadataValue(_)
        | E::EndpointsNotManaged => StoreError::Setup(Box::new(e)),
        _ => StoreError::Protocol(Box::new(e)),
    }
}

fn header_revision(resp: &TxnResponse) -> Result<Revision, StoreError> {
    resp.header()
        .map(|h| Revision(h.revision()))
        .ok_or_else(|| StoreError::Protocol(boxed("transaction response without a header")))
}

/// The `n`th response of a transaction branch, which must be a range.
fn nth_get(resp: &TxnResponse, n: usize) -> Result<GetResponse, StoreError> {
    match resp.op_responses().into_iter().nth(n) {
        Some(TxnOpResponse::Get(get)) => Ok(get),
        _ => {
            Err(StoreError::Protocol(boxed("transaction response lacks the expected range result")))
        }
    }
}

fn key_text(kv: &KeyValue) -> String {
    String::from_utf8_lossy(kv.key()).into_owned()
}

impl EtcdStore {
    /// Builds the client. Fails only on set-up problems ([`StoreError::Setup`]: bad endpoint,
    /// unreadable or incomplete TLS files) and refused credentials ([`StoreError::Auth`]); an
    /// etcd that cannot be reached yet is connected to lazily by the first calls.
    pub async fn connect(opts: EtcdOptions) -> Result<Self, StoreError> {
        if opts.endpoints.is_empty() {
            return Err(StoreError::Setup(boxed("no etcd endpoints given")));
        }
        if opts.call_timeout.is_zero() {
            return Err(StoreError::Setup(boxed("the etcd call timeout must be positive")));
        }
        let mut connect = ConnectOptions::new()
            // Bounded dials, so the balancer marks a dead member down quickly.
            .with_connect_timeout(opts.call_timeout.min(Duration::from_secs(5)))
            // HTTP/2 pings find a dead connection under a long-lived watch. 10 s stays above
            // etcd's keepalive enforcement minimum (5 s), which would answer GOAWAY.
            .with_keep_alive(Duration::from_secs(10), opts.call_timeout)
            .with_keep_alive_while_idle(true)
            .with_tcp_keepalive(Duration::from_secs(30))
            // As flannel's watches: a member cut off from the leader fails calls instead of
            // serving stale reads or a watch that never fires.
            .with_require_leader(true)
            .with_auto_token_refresh(true);
        // No `with_timeout`: gRPC's per-request timeout would also cut long-lived watches.

        match (&opts.cert_file, &opts.key_file) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(StoreError::Setup(boxed(
                    "a client certificate and its key must be given together",
                )));
            }
            _ => {}
        }
        if opts.ca_file.is_some() || opts.cert_file.is_some() {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &opts.ca_file {
                tls = tls.ca_certificate(Certificate::from_pem(read_file(ca)?));
            }
            if let (Some(cert), Some(key)) = (&opts.cert_file, &opts.key_file) {
                tls = tls.identity(Identity::from_pem(read_file(cert)?, read_file(key)?));
            }
            connect = connect.with_tls(tls);
        }
        let connect_anonymous = connect.clone();
        let has_user = match (&opts.username, &opts.password) {
            (Some(user), Some(password)) => {
                connect = connect.with_user(user.clone(), password.clone());
                true
            }
            (None, None) => false,
            _ => {
                return Err(StoreError::Setup(boxed(
                    "an etcd user name and password must be given together",
                )));
            }
        };

        let store = Self {
            inner: Arc::new(Inner {
                endpoints: opts.endpoints,
                connect,
                connect_anonymous,
                has_user,
                client: tokio::sync::Mutex::new(None),
                stale: std::sync::atomic::AtomicBool::new(false),
                keys: KeyLayout::new(&opts.prefix),
                call_timeout: opts.call_timeout,
                keep_alives: tokio::sync::Mutex::default(),
            }),
        };
        // Try once now so that set-up mistakes and bad credentials fail the start; an
        // unreachable etcd does not (the daemon retries, and keeps forwarding meanwhile).
        match store.client().await {
            Ok(_) | Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) => Ok(store),
            Err(e) => Err(e),
        }
    }

    /// The key prefix, without a trailing `/`.
    pub fn prefix(&self) -> &str {
        self.inner.keys.prefix()
    }

    /// Time left on a store lease (for `weft lease list`): `None` for no lease (a reservation)
    /// or one that has expired.
    pub async fn lease_ttl(&self, lease: StoreLeaseId) -> Result<Option<Duration>, StoreError> {
        if lease.0 == 0 {
            return Ok(None);
        }
        let mut client = self.client().await?;
        let resp = self.call(client.lease_time_to_live(lease.0, None)).await?;
        Ok(u64::try_from(resp.ttl()).ok().map(Duration::from_secs))
    }

    async fn client(&self) -> Result<Client, StoreError> {
        let inner = &self.inner;
        // Held while connecting, so concurrent first calls share one connection.
        let mut cached = inner.client.lock().await;
        if inner.stale.swap(false, std::sync::atomic::Ordering::SeqCst) && cached.take().is_some() {
            tracing::info!("reconnecting to etcd (this host's address changed)");
            // The open keep-alive streams ride on the old connection.
            inner.keep_alives.lock().await.open.clear();
        }
        if let Some(client) = &*cached {
            return Ok(client.clone());
        }
        let first = self.call(Client::connect(&inner.endpoints, Some(inner.connect.clone()))).await;
        let client = match first {
            Err(StoreError::Protocol(e))
                if inner.has_user && e.to_string().contains("authentication is not enabled") =>
            {
                tracing::warn!("etcd has authentication disabled; connecting without credentials");
                self.call(Client::connect(&inner.endpoints, Some(inner.connect_anonymous.clone())))
                    .await
            }
            other => other,
        }?;
        *cached = Some(client.clone());
        Ok(client)
    }

    /// Runs one etcd call under the call deadline.
    async fn call<T>(
        &self,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        let timeout = self.inner.call_timeout;
        match tokio::time::timeout(timeout, fut).await {
            Ok(result) => result.map_err(|e| map_err(e, timeout)),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    /// The store's revision now, as a linearizable read sees it (the leader's, whichever member
    /// answers).
    async fn linearizable_revision(&self) -> Result<i64, StoreError> {
        let mut c = self.client().await?;
        let options = GetOptions::new().with_count_only();
        let resp = self.call(c.get(self.keys().config(), Some(options))).await?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    fn keys(&self) -> &KeyLayout {
        &self.inner.keys
    }

    async fn grant(&self, client: &mut Client, ttl: Duration) -> Result<StoreLeaseId, StoreError> {
        let resp = self.call(client.lease_grant(ttl_secs(ttl), None)).await?;
        if !resp.error().is_empty() {
            return Err(StoreError::Protocol(boxed(format!(
                "lease grant refused: {}",
                resp.error()
            ))));
        }
        Ok(StoreLeaseId(resp.id()))
    }

    /// Revokes a lease whose keys we no longer want, best effort: a lease that is not revoked
    /// expires by itself after its TTL, so a failure here costs nothing but that wait.
    /// One keep-alive of `lease`: `Ok(false)` if it is gone (expired or revoked).
    /// One keep-alive of `lease`: `Ok(false)` if etcd no longer has it.
    ///
    /// The stream it goes on is kept open for the next one: opening a `LeaseKeepAlive` stream
    /// per renewal (what `lease_keep_alive` does) costs etcd a stream set-up and tear-down each
    /// time, for each of a cluster's hosts, twice per TTL (subnet and presence). A kept stream
    /// that fails (its member died, its connection broke) is dropped and one new stream opened
    /// within the same call and deadline; a call given up on mid-way drops its stream, so no
    /// stray answer is read by the next.
    async fn keep_alive_once(
        &self,
        client: &mut Client,
        lease: StoreLeaseId,
    ) -> Result<bool, StoreError> {
        let timeout = self.inner.call_timeout;
        let round = async {
            let mut open = self.inner.keep_alives.lock().await;
            // A kept stream that broke is dropped here, and a new one opened below.
            if let Some((mut keeper, mut stream)) = open.take(lease.0)
                && keeper.keep_alive().await.is_ok()
                && let Ok(Some(answer)) = stream.message().await
            {
                if answer.ttl() <= 0 {
                    return Ok(false);
                }
                open.put(lease.0, keeper, stream);
                return Ok(true);
            }
            // etcd-client sends one keep-alive on a new stream and reads the first answer; a
            // TTL <= 0 in it (the lease is gone) comes back as `LeaseKeepAliveError`.
            match client.lease_keep_alive(lease.0).await {
                Ok((keeper, stream)) => {
                    open.put(lease.0, keeper, stream);
                    Ok(true)
                }
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
                Err(e) => Err(map_err(e, timeout)),
            }
        };
        match tokio::time::timeout(timeout, round).await {
            Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(result) => result,
        }
    }

    async fn revoke_lease(&self, client: &mut Client, lease: StoreLeaseId) {
        if lease.0 == 0 {
            return;
        }
        if let Err(e) = self.call(client.lease_revoke(lease.0)).await {
            tracing::debug!(lease = lease.0, error = %e, "lease revoke failed; it will expire");
        }
    }

    /// Reads a key under `<prefix>/subnets/` as a lease.
    fn parse_subnet_kv(&self, kv: &KeyValue) -> Result<StoredLease, BadEntry> {
        self.keys().parse_lease(
            &key_text(kv),
            kv.value(),
            KeyRevisions {
                create_revision: Revision(kv.create_revision()),
                mod_revision: Revision(kv.mod_revision()),
            },
            StoreLeaseId(kv.lease()),
        )
    }

    /// A listing of `subnets` and `history`, read by `pages`.
    fn listing(&self, pages: PagedRange, subnets: &[KeyValue], history: &[KeyValue]) -> Listing {
        let mut listing =
            Listing { revision: Revision(pages.revision.unwrap_or(0)), ..Listing::default() };
        listing.skipped = pages.unreadable;
        for kv in subnets {
            match self.parse_subnet_kv(kv) {
                Ok(lease) => listing.leases.push(lease),
                Err(bad) => listing.skipped.push(bad),
            }
        }
        for kv in history {
            match self.parse_history_kv(kv) {
                Ok(entry) => listing.history.push(entry),
                Err(bad) => listing.skipped.push(bad),
            }
        }
        listing
    }

    /// Reads a key under `<prefix>/weft/history/` as a history record.
    fn parse_history_kv(&self, kv: &KeyValue) -> Result<HistoryEntry, BadEntry> {
        self.keys().parse_history(&key_text(kv), kv.value(), Revision(kv.mod_revision()))
    }

    /// The `put key + put history` operations of a create or renew.
    fn write_ops(&self, name: LeaseName, attrs: &LeaseAttrs, lease: StoreLeaseId) -> Vec<TxnOp> {
        let mut ops = vec![TxnOp::put(
            self.keys().lease(name),
            attrs.to_json(),
            Some(PutOptions::new().with_lease(lease.0)),
        )];
        if let Some(record) = HistoryRecord::held(attrs, name.ipv6) {
            ops.push(TxnOp::put(self.keys().history(name.subnet), record.to_json(), None));
        }
        ops
    }

    /// `subnet`'s key, in whichever form it exists (`X` or `X&…`).
    async fn key_of(&self, c: &mut Client, subnet: Subnet) -> Result<Option<KeyValue>, StoreError> {
        let (start, end) = self.keys().keys_of_range(subnet);
        let resp = self.call(c.get(start, Some(GetOptions::new().with_range(end)))).await?;
        Ok(resp.kvs().iter().find(|kv| self.keys().is_key_of(&key_text(kv), subnet)).cloned())
    }

    /// The value of the key read in a failed transaction's `else` branch.
    fn current_of(
        &self,
        resp: &TxnResponse,
    ) -> Result<Option<Result<StoredLease, BadEntry>>, StoreError> {
        let get = nth_get(resp, 0)?;
        Ok(get.kvs().first().map(|kv| self.parse_subnet_kv(kv)))
    }
}

/// How many keys one page of a listing asks for. A page's reply must fit the client's 4 MiB
/// message limit: 256 keys of flannel's ~200-byte values is about 50 KiB, and a page that is too
/// large anyway (someone stored big values) is asked for again with half the limit.
const PAGE_KEYS: i64 = 256;

/// A listing read in pages: one prefix after another, all at the revision of the first page,
/// so that however many round trips it takes, the listing is one consistent view (a page read
/// after the store compacted past that revision fails as [`StoreError::Compacted`]: list again).
#[derive(Default)]
struct PagedRange {
    /// The revision every page is read at, fixed by the first page.
    revision: Option<i64>,
    /// Keys whose value alone is larger than the client accepts: skipped, not fatal.
    unreadable: Vec<BadEntry>,
}

impl PagedRange {
    /// Every key under `dir` (which ends in `/`), in key order.
    async fn read(
        &mut self,
        store: &EtcdStore,
        c: &mut Client,
        dir: &str,
    ) -> Result<Vec<KeyValue>, StoreError> {
        self.read_range(store, c, dir, prefix_end(dir.as_bytes())).await
    }

    /// Every key in `[start, end)`, in key order.
    async fn read_range(
        &mut self,
        store: &EtcdStore,
        c: &mut Client,
        start: &str,
        end: Vec<u8>,
    ) -> Result<Vec<KeyValue>, StoreError> {
        let mut from = start.as_bytes().to_vec();
        let mut limit = PAGE_KEYS;
        let mut kvs = Vec::new();
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if let Some(rev) = self.revision {
                opts = opts.with_revision(rev);
            }
            let mut resp = match store.call(c.get(from.clone(), Some(opts))).await {
                Ok(resp) => resp,
                Err(e) if is_too_large(&e) && limit > 1 => {
                    limit /= 2;
                    continue;
                }
                Err(e) if is_too_large(&e) => {
                    // One value alone is over the limit: name it, skip it, go on after it.
                    let key = self.next_key(store, c, &from, &end).await?;
                    let Some(key) = key else { return Ok(kvs) };
                    self.unreadable.push(BadEntry {
                        key: String::from_utf8_lossy(&key).into_owned(),
                        problem: "value too large to read (over the 4 MiB message limit)".into(),
                    });
                    from = key_after(&key);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if self.revision.is_none() {
                let rev = resp.header().map(|h| h.revision()).ok_or_else(|| {
                    StoreError::Protocol(boxed("range response without a header"))
                })?;
                self.revision = Some(rev);
            }
            let more = resp.more();
            let page = resp.take_kvs();
            let Some(last) = page.last() else { return Ok(kvs) };
            from = key_after(last.key());
            kvs.extend(page);
            if !more {
                return Ok(kvs);
            }
            limit = (limit * 2).min(PAGE_KEYS);
        }
    }

    /// The first key in `[from, end)`, keys only (at the pinned revision).
    async fn next_key(
        &self,
        store: &EtcdStore,
        c: &mut Client,
        from: &[u8],
        end: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut opts = GetOptions::new().with_range(end.to_vec()).with_limit(1).with_keys_only();
        if let Some(rev) = self.revision {
            opts = opts.with_revision(rev);
        }
        let resp = store.call(c.get(from.to_vec(), Some(opts))).await?;
        Ok(resp.kvs().first().map(|kv| kv.key().to_vec()))
    }
}

/// The end of the range of every key that starts with `prefix`: the prefix with its last byte
/// that is not 0xff incremented (etcd's rule; `\0` means "to the end of the keyspace").
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The smallest key after `key`.
fn key_after(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

/// Whether a reply was refused for being over the client's message size limit (tonic's
/// "decoded message length too large").
fn is_too_large(e: &StoreError) -> bool {
    matches!(e, StoreError::Protocol(source) | StoreError::Unavailable(source)
        if source.to_string().contains("message length too large"))
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn list_with_presence(&self) -> Result<Listing, StoreError> {
        let mut c = self.client().await?;
        let mut pages = PagedRange::default();
        let subnets = pages.read(self, &mut c, self.keys().subnets_dir()).await?;
        // History and presence in one range, at the same revision: as many requests as
        // `list`, and the presence keys are small.
        let (start, end) = self.keys().history_and_nodes_range();
        let weft = pages.read_range(self, &mut c, &start, end.into_bytes()).await?;
        let dir = self.keys().history_dir().as_bytes();
        let (history, rest): (Vec<KeyValue>, Vec<KeyValue>) =
            weft.into_iter().partition(|kv| kv.key().starts_with(dir));
        let mut listing = self.listing(pages, &subnets, &history);
        listing.presence = rest
            .iter()
            .filter_map(|kv| {
                self.keys().parse_presence(&key_text(kv), Revision(kv.create_revision()))
            })
            .collect();
        Ok(listing)
    }

    async fn config(&self) -> Result<Option<Vec<u8>>, StoreError> {
        let mut c = self.client().await?;
        let resp = self.call(c.get(self.keys().config(), None)).await?;
        Ok(resp.kvs().first().map(|kv| kv.value().to_vec()))
    }

    async fn set_config(&self, value: &[u8]) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        // The config is the operator's to overwrite; only subnet keys need a compare.
        self.call(c.put(self.keys().config(), value.to_vec(), None)).await?;
        Ok(())
    }

    async fn watch_config(&self) -> Result<ConfigWatchStream, StoreError> {
        let mut c = self.client().await?;
        let key = self.keys().config();
        let resp = self.call(c.get(key.clone(), None)).await?;
        let now = resp.kvs().first().map(|kv| kv.value().to_vec());
        let read_at = resp.header().map_or(0, |h| h.revision());
        let options = WatchOptions::new().with_start_revision(read_at.saturating_add(1));
        let stream = self.call(c.watch(key, Some(options))).await?;
        let state = ConfigWatch { stream: Some(stream), timeout: self.inner.call_timeout };
        let first = futures::stream::once(std::future::ready(Ok(now)));
        let rest = futures::stream::unfold(state, ConfigWatch::next);
        Ok(Box::pin(futures::StreamExt::chain(first, rest)))
    }

    async fn get(
        &self,
        subnet: Subnet,
    ) -> Result<Option<Result<StoredLease, BadEntry>>, StoreError> {
        let mut c = self.client().await?;
        Ok(self.key_of(&mut c, subnet).await?.map(|kv| self.parse_subnet_kv(&kv)))
    }

    async fn create_pruning(
        &self,
        name: LeaseName,
        attrs: &LeaseAttrs,
        ttl: Duration,
        prune: &[HistoryPrune],
    ) -> Result<CreateOutcome, StoreError> {
        let subnet = name.subnet;
        let mut c = self.client().await?;
        let lease = self.grant(&mut c, ttl).await?;
        let mut ops = self.write_ops(name, attrs, lease);
        // Each prune is a nested transaction with its own compare: one that fails (the record
        // was rewritten since) deletes nothing and fails nothing else.
        // A departure marker of this subnet is news of an earlier holder: gone with the create
        // (deleting an absent key writes nothing and sends no event).
        ops.push(TxnOp::delete(self.keys().departure(subnet), None));
        ops.extend(prune.iter().filter(|p| p.subnet != subnet).map(|p| {
            let history = self.keys().history(p.subnet);
            TxnOp::txn(
                Txn::new()
                    .when([Compare::mod_revision(
                        history.clone(),
                        CompareOp::Equal,
                        p.mod_revision.0,
                    )])
                    .and_then([
                        TxnOp::delete(history, None),
                        TxnOp::delete(self.keys().departure(p.subnet), None),
                    ]),
            )
        }));
        // Neither form of the subnet's key may exist: not `X`, not any `X&…` (flannel's
        // dual-stack nodes write those), whichever form this create writes.
        let (dual_start, dual_end) = self.keys().dual_stack_range(subnet);
        let (any_start, any_end) = self.keys().keys_of_range(subnet);
        let txn = Txn::new()
            .when([
                Compare::version(self.keys().subnet(subnet), CompareOp::Equal, 0),
                Compare::version(dual_start, CompareOp::Equal, 0).with_range(dual_end),
            ])
            .and_then(ops)
            .or_else([TxnOp::get(any_start, Some(GetOptions::new().with_range(any_end)))]);
        // On an error the outcome is unknown: keep the lease (see the module docs).
        let resp = self.call(c.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(CreateOutcome::Created(HeldLease {
                subnet,
                ipv6: name.ipv6,
                mod_revision: header_revision(&resp)?,
                lease_id: lease,
            }));
        }
        self.revoke_lease(&mut c, lease).await;
        let get = nth_get(&resp, 0)?;
        let current = get.kvs().iter().find(|kv| self.keys().is_key_of(&key_text(kv), subnet));
        Ok(CreateOutcome::Exists(current.and_then(|kv| self.parse_subnet_kv(kv).ok())))
    }

    async fn renew(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
        ttl: Duration,
    ) -> Result<RenewOutcome, StoreError> {
        let mut c = self.client().await?;
        let lease = self.grant(&mut c, ttl).await?;
        let key = self.keys().lease(held.name());
        let txn = Txn::new()
            .when([Compare::mod_revision(key.clone(), CompareOp::Equal, held.mod_revision.0)])
            .and_then(self.write_ops(held.name(), attrs, lease))
            .or_else([TxnOp::get(key, None)]);
        let resp = self.call(c.txn(txn)).await?;
        if resp.succeeded() {
            let renewed = HeldLease {
                subnet: held.subnet,
                ipv6: held.ipv6,
                mod_revision: header_revision(&resp)?,
                lease_id: lease,
            };
            // The key has moved to the new lease; the old one holds nothing of ours now.
            if held.lease_id != lease {
                self.revoke_lease(&mut c, held.lease_id).await;
            }
            return Ok(RenewOutcome::Renewed(renewed));
        }
        self.revoke_lease(&mut c, lease).await;
        Ok(match self.current_of(&resp)? {
            None => RenewOutcome::Changed(None),
            Some(Ok(current)) => RenewOutcome::Changed(Some(current)),
            Some(Err(_)) => RenewOutcome::Unreadable,
        })
    }

    async fn refresh(
        &self,
        held: &HeldLease,
        attrs: &LeaseAttrs,
    ) -> Result<RenewOutcome, StoreError> {
        let mut c = self.client().await?;
        let alive = self.keep_alive_once(&mut c, held.lease_id).await?;
        let key = self.keys().lease(held.name());
        let mut ours =
            vec![Compare::mod_revision(key.clone(), CompareOp::Equal, held.mod_revision.0)];
        // The compare alone would do: a key still at our revision is on our store lease. With
        // the lease gone the key is too, so this only makes a racing answer fail safe.
        ours.push(Compare::lease(key.clone(), CompareOp::Equal, held.lease_id.0));
        let then = match HistoryRecord::held(attrs, held.ipv6) {
            Some(record) if alive => {
                vec![TxnOp::put(self.keys().history(held.subnet), record.to_json(), None)]
            }
            _ => Vec::new(),
        };
        let txn = Txn::new().when(ours).and_then(then).or_else([TxnOp::get(key.clone(), None)]);
        let resp = self.call(c.txn(txn)).await?;
        if resp.succeeded() {
            if alive {
                return Ok(RenewOutcome::Renewed(*held));
            }
            // The keep-alive said the lease is gone, the compare that it still carries the key:
            // an answer from before the expiry. Either way, this is no renewal; look again.
            return Err(StoreError::Protocol(boxed(format!(
                "store lease {:x} of {key} is gone but the key is still on it",
                held.lease_id.0
            ))));
        }
        Ok(match self.current_of(&resp)? {
            None => RenewOutcome::Changed(None),
            Some(Ok(current)) => RenewOutcome::Changed(Some(current)),
            Some(Err(_)) => RenewOutcome::Unreadable,
        })
    }

    async fn release(&self, held: &HeldLease, node: &NodeId) -> Result<ReleaseOutcome, StoreError> {
        let mut c = self.client().await?;
        let key = self.keys().lease(held.name());
        // The history wants the holder's public IP, which only the key's value has. Reading it
        // first is safe: the transaction below compares the same mod revision, so the value
        // it deletes is the value read here.
        let resp = self.call(c.get(key.clone(), None)).await?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(ReleaseOutcome::NotOurs);
        };
        if kv.mod_revision() != held.mod_revision.0 {
            return Ok(ReleaseOutcome::NotOurs);
        }
        let public_ip: Ipv4Addr = match LeaseAttrs::from_json(kv.value()) {
            Ok(attrs) => attrs.public_ip,
            Err(e) => {
                // We wrote this very revision, so it parsed when we wrote it.
                return Err(StoreError::Protocol(boxed(format!(
                    "our own lease {key} does not parse: {e}"
                ))));
            }
        };
        let record = HistoryRecord {
            state: HistoryState::Relinquished,
            node: node.clone(),
            public_ip,
            ipv6: held.ipv6,
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(key.clone(), CompareOp::Equal, held.mod_revision.0)])
            .and_then([
                TxnOp::delete(key, None),
                TxnOp::put(self.keys().history(held.subnet), record.to_json(), None),
                // The marker tells every route watcher, in the delete's own watch batch, that
                // this was a leave, not an expiry.
                TxnOp::put(self.keys().departure(held.subnet), record.to_json(), None),
            ]);
        let resp = self.call(c.txn(txn)).await?;
        if !resp.succeeded() {
            return Ok(ReleaseOutcome::NotOurs);
        }
        self.revoke_lease(&mut c, held.lease_id).await;
        Ok(ReleaseOutcome::Released)
    }

    async fn revoke(&self, subnet: Subnet) -> Result<bool, StoreError> {
        let mut c = self.client().await?;
        let Some(kv) = self.key_of(&mut c, subnet).await? else {
            return Ok(false);
        };
        let key = key_text(&kv);
        let ipv6 = self.keys().parse_deleted_name(&key).ok().and_then(|n| n.ipv6);
        // A weft lease names its holder: record the revoke in history and in a departure marker
        // in the same transaction, so peers unroute the subnet (an expiry writes nothing, and
        // its route is kept). The compare makes sure the value read is the value deleted.
        let mut ops = vec![TxnOp::delete(key.clone(), None)];
        if let Ok(attrs) = LeaseAttrs::from_json(kv.value())
            && let Some(node) = attrs.node_id
        {
            let record = HistoryRecord {
                state: HistoryState::Revoked,
                node,
                public_ip: attrs.public_ip,
                ipv6,
            };
            ops.push(TxnOp::put(self.keys().history(subnet), record.to_json(), None));
            ops.push(TxnOp::put(self.keys().departure(subnet), record.to_json(), None));
        }
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, kv.mod_revision())])
            .and_then(ops);
        let resp = self.call(c.txn(txn)).await?;
        // Lost a race with a renewal: the key is still there and was not deleted; say so.
        Ok(resp.succeeded())
    }

    async fn claim_presence(
        &self,
        node: &NodeId,
        record: &PresenceRecord,
        ttl: Duration,
    ) -> Result<PresenceOutcome, StoreError> {
        // Only this node's processes write this key, so contention is between a restart and
        // its predecessor at most; a few rounds settle it.
        const ROUNDS: usize = 4;
        let mut c = self.client().await?;
        let lease = self.grant(&mut c, ttl).await?;
        let key = self.keys().node(node);
        let value = record.to_json();
        // `None`: expect the key absent; `Some(rev)`: expect it at that mod revision.
        let mut expect: Option<i64> = None;
        for _ in 0..ROUNDS {
            let compare = match expect {
                None => Compare::version(key.clone(), CompareOp::Equal, 0),
                Some(rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
            };
            let txn = Txn::new()
                .when([compare])
                .and_then([TxnOp::put(
                    key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease.0)),
                )])
                .or_else([TxnOp::get(key.clone(), None)]);
            let resp = self.call(c.txn(txn)).await?;
            if resp.succeeded() {
                return Ok(PresenceOutcome::Claimed(lease));
            }
            let get = nth_get(&resp, 0)?;
            let Some(kv) = get.kvs().first() else {
                expect = None;
                continue;
            };
            match PresenceRecord::from_json(kv.value()).ok() {
                Some(seen) if seen.incarnation != record.incarnation => {
                    self.revoke_lease(&mut c, lease).await;
                    return Ok(PresenceOutcome::HeldBy {
                        record: seen,
                        mod_revision: Revision(kv.mod_revision()),
                    });
                }
                Some(_) => {
                    // Our own earlier claim (a retry after a lost answer): move it to the new
                    // lease; the old one is revoked once the key has left it.
                    expect = Some(kv.mod_revision());
                    let old = StoreLeaseId(kv.lease());
                    let txn = Txn::new()
                        .when([Compare::mod_revision(
                            key.clone(),
                            CompareOp::Equal,
                            kv.mod_revision(),
                        )])
                        .and_then([TxnOp::put(
                            key.clone(),
                            value.clone(),
                            Some(PutOptions::new().with_lease(lease.0)),
                        )]);
                    let resp = self.call(c.txn(txn)).await?;
                    if resp.succeeded() {
                        if old != lease {
                            self.revoke_lease(&mut c, old).await;
                        }
                        return Ok(PresenceOutcome::Claimed(lease));
                    }
                }
                None => {
                    // Not a presence record: it names no live process, so it cannot stand in
                    // the way. Overwrite it (on the next round, compared on its revision).
                    tracing::warn!(key = %key, "presence key holds an unreadable value; replacing it");
                    expect = Some(kv.mod_revision());
                }
            }
        }
        self.revoke_lease(&mut c, lease).await;
        Err(StoreError::Unavailable(boxed(format!(
            "presence key {key} kept changing while being claimed"
        ))))
    }

    async fn keep_presence(
        &self,
        node: &NodeId,
        lease: StoreLeaseId,
        beat: bool,
    ) -> Result<bool, StoreError> {
        let mut c = self.client().await?;
        if beat {
            // Rewrite the key in place (value and lease kept) only while it is on our lease.
            let key = self.keys().node(node);
            let txn = Txn::new()
                .when([Compare::lease(key.clone(), CompareOp::Equal, lease.0)])
                .and_then([TxnOp::put(
                    key,
                    Vec::new(),
                    Some(PutOptions::new().with_ignore_value().with_ignore_lease()),
                )]);
            if !self.call(c.txn(txn)).await?.succeeded() {
                return Ok(false);
            }
        }
        self.keep_alive_once(&mut c, lease).await
    }

    async fn drop_presence(&self, node: &NodeId, lease: StoreLeaseId) -> Result<(), StoreError> {
        let mut c = self.client().await?;
        let key = self.keys().node(node);
        // Only if the key is still on our lease: a successor's claim is not ours to delete.
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease.0)])
            .and_then([TxnOp::delete(key, None)]);
        self.call(c.txn(txn)).await?;
        self.revoke_lease(&mut c, lease).await;
        Ok(())
    }

    fn reconnect(&self) {
        self.inner.stale.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl LeaseFeed for EtcdStore {
    async fn list(&self) -> Result<Listing, StoreError> {
        let mut c = self.client().await?;
        // Both prefixes at one revision: no torn view between a subnet key and its history.
        let mut pages = PagedRange::default();
        let subnets = pages.read(self, &mut c, self.keys().subnets_dir()).await?;
        let history = pages.read(self, &mut c, self.keys().history_dir()).await?;
        Ok(self.listing(pages, &subnets, &history))
    }

    async fn watch(
        &self,
        from: Revision,
        only: Option<LeaseName>,
    ) -> Result<WatchStream, StoreError> {
        let mut c = self.client().await?;
        let mut options = WatchOptions::new().with_start_revision(from.0);
        let key = match only {
            Some(name) => self.keys().lease(name),
            None => {
                let (start, end) = self.keys().route_watch_range();
                options = options.with_range(end);
                start
            }
        };
        let stream = self.call(c.watch(key, Some(options))).await?;
        let state = WatchState { stream: Some(stream), store: self.clone(), requested: from };
        Ok(Box::pin(futures::stream::unfold(state, WatchState::next)))
    }
}

/// A running watch. It owns the etcd-client stream (both halves: dropping the request half
/// would end the watch), and `None` once the watch has failed.
struct WatchState {
    stream: Option<etcd_client::WatchStream>,
    store: EtcdStore,
    requested: Revision,
}

impl WatchState {
    async fn next(mut self) -> Option<(Result<WatchBatch, StoreError>, Self)> {
        let stream = self.stream.as_mut()?;
        loop {
            let item = match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.compact_revision() > 0 {
                        Err(StoreError::Compacted {
                            requested: self.requested,
                            compact_revision: Revision(resp.compact_revision()),
                        })
                    } else if resp.canceled() {
                        let reason = resp.cancel_reason().to_owned();
                        if is_auth_text(&reason) {
                            Err(StoreError::Auth(boxed(format!("watch canceled: {reason}"))))
                        } else {
                            Err(StoreError::Unavailable(boxed(format!("watch canceled: {reason}"))))
                        }
                    } else if resp.created() && resp.events().is_empty() {
                        // The creation answer's header is the store's current revision, not how
                        // far this watch has caught up: it carries no progress. But a current
                        // revision below the one we resume from means the store went back in
                        // time (a snapshot restore): etcd would wait for the revision to come
                        // round again and deliver nothing meanwhile.
                        let current = resp.header().map_or(0, |h| h.revision());
                        if current > 0 && current.saturating_add(1) < self.requested.0 {
                            // The member that answered may only lag (a follower that has not
                            // applied our own latest write yet): ask the cluster. A linearizable
                            // read waits for its member to catch up with the leader, so its
                            // revision is below ours only if the store really went back.
                            match self.store.linearizable_revision().await {
                                Ok(now) if now.saturating_add(1) >= self.requested.0 => continue,
                                Ok(now) => Err(StoreError::Rewound {
                                    requested: self.requested,
                                    current: Revision(now),
                                }),
                                Err(e) => Err(e),
                            }
                        } else {
                            continue;
                        }
                    } else {
                        Ok(self.store.batch_of(&resp))
                    }
                }
                Ok(None) => Err(StoreError::Unavailable(boxed("watch stream closed by etcd"))),
                Err(e) => Err(map_err(e, self.store.inner.call_timeout)),
            };
            if let Ok(batch) = &item {
                self.requested = Revision(batch.revision.0.saturating_add(1));
            } else {
                // One error, then the end: the caller re-lists or re-watches.
                self.stream = None;
            }
            return Some((item, self));
        }
    }
}

/// A running watch of the network config key; `None` once it has failed.
struct ConfigWatch {
    stream: Option<etcd_client::WatchStream>,
    timeout: Duration,
}

impl ConfigWatch {
    async fn next(mut self) -> Option<(Result<Option<Vec<u8>>, StoreError>, Self)> {
        let stream = self.stream.as_mut()?;
        loop {
            let item = match stream.message().await {
                Ok(Some(resp)) if resp.compact_revision() > 0 => Err(StoreError::Unavailable(
                    boxed("the config watch is behind the compaction horizon"),
                )),
                Ok(Some(resp)) if resp.canceled() => {
                    let reason = resp.cancel_reason().to_owned();
                    let text = boxed(format!("config watch canceled: {reason}"));
                    if is_auth_text(&reason) {
                        Err(StoreError::Auth(text))
                    } else {
                        Err(StoreError::Unavailable(text))
                    }
                }
                // The latest write of the batch is the value now.
                Ok(Some(resp)) => match resp.events().iter().rev().find(|e| e.kv().is_some()) {
                    Some(event) => Ok(match event.event_type() {
                        EventType::Put => event.kv().map(|kv| kv.value().to_vec()),
                        EventType::Delete => None,
                    }),
                    // The creation answer, or progress: nothing written.
                    None => continue,
                },
                Ok(None) => Err(StoreError::Unavailable(boxed("config watch closed by etcd"))),
                Err(e) => Err(map_err(e, self.timeout)),
            };
            if item.is_err() {
                self.stream = None;
            }
            return Some((item, self));
        }
    }
}

impl EtcdStore {
    fn batch_of(&self, resp: &etcd_client::WatchResponse) -> WatchBatch {
        let mut events = Vec::with_capacity(resp.events().len());
        let mut last = 0;
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            last = last.max(kv.mod_revision());
            let key = key_text(kv);
            if !self.keys().is_subnet_key(&key) {
                // A departure marker, or another tool's key inside the watched range. A marker's
                // delete (by the next create) and one that does not parse tell nothing.
                if event.event_type() == EventType::Put
                    && let Some(Ok(departed)) =
                        self.keys().parse_departure(&key, kv.value(), Revision(kv.mod_revision()))
                {
                    events.push(WatchEvent::Departed(departed));
                }
                continue;
            }
            match event.event_type() {
                EventType::Put => events.push(match self.parse_subnet_kv(kv) {
                    Ok(lease) => WatchEvent::Put(lease),
                    Err(bad) => WatchEvent::Bad(bad),
                }),
                EventType::Delete => {
                    events.push(match self.keys().parse_deleted(&key) {
                        Ok(subnet) => WatchEvent::Delete {
                            subnet,
                            // A delete event's kv carries the revision of the delete.
                            revision: Revision(kv.mod_revision()),
                        },
                        // Nothing unreadable is left: the key is gone, and its watchers forget it.
                        Err(_) => WatchEvent::DeleteUnparsed {
                            key,
                            revision: Revision(kv.mod_revision()),
                        },
                    })
                }
            }
        }
        // With events, the batch is complete up to its last event's revision. The header may
        // be further on: when etcd replays a long backlog it stamps every chunk with the
        // current revision, and resuming from there would skip the rest of the backlog.
        let revision =
            if events.is_empty() { resp.header().map_or(0, |h| h.revision()) } else { last };
        WatchBatch { revision: Revision(revision), events }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_end_after_the_last_key_with_the_prefix() {
        assert_eq!(prefix_end(b"/p/subnets/"), b"/p/subnets0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
        assert_eq!(key_after(b"/p/subnets/10.0.1.0-24"), b"/p/subnets/10.0.1.0-24\0");
    }

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::ZERO), 1);
        assert_eq!(ttl_secs(Duration::from_secs(2)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn auth_texts_of_etcd_are_recognised() {
        assert!(is_auth_text("etcdserver: authentication failed, invalid user ID or password"));
        assert!(is_auth_text("etcdserver: user name is empty"));
        assert!(!is_auth_text("etcdserver: no leader"));
    }

    #[test]
    fn debug_redacts_the_password() {
        let opts = EtcdOptions { password: Some("hunter2".into()), ..EtcdOptions::default() };
        assert!(!format!("{opts:?}").contains("hunter2"));
    }
}
