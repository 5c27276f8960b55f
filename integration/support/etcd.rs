//! Real etcd for tests: single servers and 3-member clusters on loopback, on free ports, with
//! temporary data dirs.
//!
//! Every member is started by `etcd_member` (`scripts/lib/etcd.sh`), the one spelling of etcd's
//! command line that the demo, the bench, the chaos soak and the namespace lab's hub also use;
//! a snapshot is restored by its `etcd_restore`.
//!
//! Contract:
//! - etcd must be installed (`scripts/setup.sh`); a missing binary is a loud panic, never a
//!   silently skipped test.
//! - Start-up returns only once the server reports healthy (`/health` on the client port), or
//!   panics with the tail of etcd's log.
//! - Dropping a server or cluster SIGKILLs and reaps its processes. As a second line of defence
//!   each etcd gets `PR_SET_PDEATHSIG`, so it dies with the test process even if `Drop` never
//!   runs. Death signals follow the *thread* that spawned the child: start and restart servers
//!   from the test's own thread (a `#[tokio::test]` body runs there), not from `spawn_blocking`.
//! - Ports come from binding port 0; between closing that socket and etcd binding it another
//!   process may take the port, so start-up retries with fresh ports when etcd exits early.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{die_with_parent, lib_command, lib_run};

/// How long a server may take to become healthy before the test fails.
const START_DEADLINE: Duration = Duration::from_secs(20);

/// The etcd binary, or a panic telling how to install it.
pub fn etcd_binary() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|p| p.join("etcd")).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/bin/etcd")])
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("etcd not found: run scripts/setup.sh"))
}

/// A fresh key prefix (`/weft-test/<random>`), so tests can share one etcd without seeing each
/// other's keys.
pub fn unique_prefix() -> String {
    format!("/weft-test/{:016x}", rand::random::<u64>())
}

/// A loopback port that nothing listens on (bound, then closed): connections are refused.
pub fn closed_port() -> u16 {
    free_port()
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local address of a bound socket").port()
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

fn tls_url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

/// Certificates for a TLS test: one CA signing a server certificate (for `127.0.0.1`) and a
/// client certificate (CN `root`), all PEM files in one directory.
pub struct TlsFiles {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server certificate (SAN `IP:127.0.0.1`).
    pub server_cert: PathBuf,
    /// The server key.
    pub server_key: PathBuf,
    /// The client certificate.
    pub client_cert: PathBuf,
    /// The client key.
    pub client_key: PathBuf,
    /// A second CA that signed nothing here, for "wrong CA" tests.
    pub other_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("openssl not runnable: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TlsFiles {
    /// Makes a fresh CA and certificates in `dir` with the `openssl` command (P-256 keys, one
    /// day of validity).
    ///
    /// # Panics
    /// If `openssl` is missing or fails.
    pub fn generate(dir: &Path) -> Self {
        let key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "other-ca"] {
            let (keyout, out, subj) =
                (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN=weft-test-{ca}"));
            let mut args = vec!["req", "-x509", "-days", "1", "-subj", subj.as_str()];
            args.extend(key);
            args.extend(["-keyout", keyout.as_str(), "-out", out.as_str()]);
            openssl(dir, &args);
        }
        for (name, cn, ext) in [
            (
                "server",
                "127.0.0.1",
                "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
            ),
            ("client", "root", "extendedKeyUsage=clientAuth\n"),
        ] {
            let (keyout, csr, out, extfile, subj) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
                format!("{name}.ext"),
                format!("/CN={cn}"),
            );
            std::fs::write(dir.join(&extfile), ext).expect("write ext file");
            let mut args = vec!["req", "-new", "-subj", subj.as_str()];
            args.extend(key);
            args.extend(["-keyout", keyout.as_str(), "-out", csr.as_str()]);
            openssl(dir, &args);
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-days",
                    "1",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-extfile",
                    &extfile,
                    "-out",
                    &out,
                ],
            );
        }
        Self {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.pem"),
        }
    }
}

/// Server-side TLS for the client port (peers stay plain: tests run on loopback).
#[derive(Clone)]
struct ServerTls {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
    /// `--client-cert-auth`: clients must show a certificate signed by `ca`.
    client_auth: bool,
}

/// One etcd process and everything needed to start it again the same way.
struct Member {
    name: String,
    client_port: u16,
    /// Plain-http `/health` for a TLS member (`--listen-metrics-urls`); else the client port.
    health_port: u16,
    tls: Option<ServerTls>,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    initial_cluster: String,
    /// Raft timing (heartbeat, election) in ms; `None` keeps etcd's defaults (100, 1000).
    timing: Option<(u32, u32)>,
    /// More flags, e.g. `--auth-token-ttl`.
    extra: Vec<String>,
    child: Option<Child>,
}

impl Member {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the etcd log file");
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        let (client, peer) = (self.client_url(), url(self.peer_port));
        let args = [&self.name, &data_dir, &client, &peer, &self.initial_cluster];
        // The flags below come after etcd_member's own (TLS, timing, a test's extras).
        let mut cmd = lib_command("etcd.sh", "etcd_member", &args);
        cmd.env("ETCD_BIN", etcd_binary()).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key)
                .arg("--listen-metrics-urls")
                .arg(url(self.health_port));
            if tls.client_auth {
                cmd.arg("--trusted-ca-file").arg(&tls.ca).arg("--client-cert-auth");
            }
        }
        cmd.args(&self.extra);
        if let Some((heartbeat, election)) = self.timing {
            cmd.arg("--heartbeat-interval")
                .arg(heartbeat.to_string())
                .arg("--election-timeout")
                .arg(election.to_string());
        }
        let child = die_with_parent(&mut cmd).spawn();
        self.child = Some(child.unwrap_or_else(|e| panic!("cannot start etcd: {e}")));
    }

    fn client_url(&self) -> String {
        if self.tls.is_some() { tls_url(self.client_port) } else { url(self.client_port) }
    }

    /// Whether the process has exited (reaping it if so).
    fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => true,
        }
    }

    fn pid(&self) -> libc::pid_t {
        let child = self.child.as_ref().expect("etcd is not running");
        libc::pid_t::try_from(child.id()).expect("pid fits pid_t")
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: plain syscall on a pid we spawned and have not reaped.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill({}, {signal}) failed", self.pid());
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGKILL works on a stopped process too; wait reaps it.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or(&text).to_owned()
    }
}

/// Whether etcd's `/health` on this client port says healthy (it needs a leader).
fn healthy(client_port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, client_port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    if stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

/// Waits until every member is healthy. `Err` if a member exited (a port clash, usually).
fn wait_healthy(members: &mut [Member]) -> Result<(), String> {
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        for m in members.iter_mut() {
            if m.exited() {
                return Err(format!("etcd {} exited during start-up:\n{}", m.name, m.log_tail()));
            }
        }
        if members.iter().all(|m| healthy(m.health_port)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = members.iter().map(|m| m.log_tail()).collect();
            panic!("etcd not healthy after {START_DEADLINE:?}:\n{}", logs.join("\n---\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `healthy` on one member until the deadline; panics with its log if it never is.
fn wait_member_healthy(m: &mut Member) {
    let deadline = Instant::now() + START_DEADLINE;
    while !healthy(m.health_port) {
        assert!(!m.exited(), "etcd {} exited on restart:\n{}", m.name, m.log_tail());
        assert!(
            Instant::now() < deadline,
            "etcd {} not healthy after restart:\n{}",
            m.name,
            m.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One etcd server on loopback. Killed on drop.
pub struct EtcdServer {
    member: Member,
    // Dropped after `member` (fields drop in order): the process dies before its data dir goes.
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts a single-member etcd on free loopback ports and waits until it is healthy.
    ///
    /// # Panics
    /// If etcd is not installed, or does not become healthy in time.
    pub fn start() -> Self {
        Self::start_with(None, &[])
    }

    /// Starts a single-member etcd with more flags (e.g. `--auth-token-ttl 2`).
    ///
    /// # Panics
    /// As [`EtcdServer::start`].
    pub fn start_with_flags(flags: &[&str]) -> Self {
        Self::start_with(None, flags)
    }

    /// Starts a single-member etcd whose client port speaks TLS only, with the server's
    /// certificate, and takes any client (no client certificates): a client needs only the CA
    /// file to trust it.
    ///
    /// # Panics
    /// As [`EtcdServer::start`].
    pub fn start_tls_server_only(files: &TlsFiles) -> Self {
        Self::start_with(
            Some(ServerTls {
                cert: files.server_cert.clone(),
                key: files.server_key.clone(),
                ca: files.ca.clone(),
                client_auth: false,
            }),
            &[],
        )
    }

    /// Starts a single-member etcd whose client port speaks TLS only and requires a client
    /// certificate signed by `files.ca` (`--client-cert-auth`).
    ///
    /// # Panics
    /// As [`EtcdServer::start`].
    pub fn start_tls(files: &TlsFiles) -> Self {
        Self::start_with(
            Some(ServerTls {
                cert: files.server_cert.clone(),
                key: files.server_key.clone(),
                ca: files.ca.clone(),
                client_auth: true,
            }),
            &[],
        )
    }

    fn start_with(tls: Option<ServerTls>, flags: &[&str]) -> Self {
        let dir =
            tempfile::Builder::new().prefix("weft-etcd-").tempdir().expect("create a temp dir");
        let mut last_error = String::new();
        for _attempt in 0..3 {
            let (client_port, peer_port) = (free_port(), free_port());
            let health_port = if tls.is_some() { free_port() } else { client_port };
            // A fresh data dir per attempt: a half-started member leaves one behind.
            let data_dir = dir.path().join(format!("n0-{client_port}"));
            let mut member = Member {
                name: "n0".to_owned(),
                client_port,
                health_port,
                tls: tls.clone(),
                peer_port,
                data_dir,
                log: dir.path().join("etcd.log"),
                initial_cluster: format!("n0={}", url(peer_port)),
                timing: None,
                extra: flags.iter().map(|f| f.to_string()).collect(),
                child: None,
            };
            member.spawn();
            match wait_healthy(std::slice::from_mut(&mut member)) {
                Ok(()) => return Self { member, _dir: dir },
                Err(e) => {
                    member.kill();
                    last_error = e;
                }
            }
        }
        panic!("etcd did not start in 3 attempts: {last_error}");
    }

    /// The client URL (`http://127.0.0.1:<port>`, or `https://` for a TLS server).
    pub fn endpoint(&self) -> String {
        self.member.client_url()
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.member.client_port
    }

    /// The etcd process ID.
    pub fn pid(&self) -> i32 {
        self.member.pid()
    }

    /// SIGSTOPs etcd: its sockets stay open but nothing answers (an outage without resets).
    pub fn pause(&self) {
        self.member.signal(libc::SIGSTOP);
    }

    /// SIGCONTs a paused etcd.
    pub fn resume(&self) {
        self.member.signal(libc::SIGCONT);
    }

    /// SIGKILLs etcd (connections are reset; the data dir stays).
    pub fn kill(&mut self) {
        self.member.kill();
    }

    /// Starts etcd again on the same ports and data dir (killing it first if it runs) and
    /// waits until it is healthy.
    pub fn restart(&mut self) {
        self.member.kill();
        self.member.spawn();
        wait_member_healthy(&mut self.member);
    }

    /// Saves a snapshot of the store to `file` (`etcdctl snapshot save`).
    pub fn snapshot(&self, file: &Path) {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoint(), "snapshot", "save"])
            .arg(file)
            .output()
            .expect("run etcdctl");
        assert!(out.status.success(), "snapshot save: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Replaces the store with `file`, as an operator restoring a backup does: stops etcd,
    /// `etcdctl snapshot restore` into a fresh data dir, starts etcd on it, same ports. The
    /// store's revision goes back to the snapshot's (etcd 3.4 has no `--bump-revision`).
    pub fn restore(&mut self, file: &Path) {
        self.member.kill();
        let data_dir =
            self.member.data_dir.with_extension(format!("restored-{}", rand::random::<u32>()));
        let (snapshot, dir) = (file.to_string_lossy(), data_dir.to_string_lossy());
        let (m, peer) = (&self.member, url(self.member.peer_port));
        let args = [&*snapshot, &*dir, m.name.as_str(), peer.as_str(), m.initial_cluster.as_str()];
        lib_run("etcd.sh", "etcd_restore", &args);
        self.member.data_dir = data_dir;
        self.member.spawn();
        wait_member_healthy(&mut self.member);
    }

    /// A raw etcd-client connection (plain servers only), for a test to write what weft never
    /// would.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .expect("connect to the test etcd")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.member.kill();
    }
}

/// A 3-member etcd cluster on loopback. Killed on drop.
pub struct EtcdCluster {
    members: Vec<Member>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Number of members.
    pub const SIZE: usize = 3;

    /// Starts three members and waits until all are healthy (a leader is elected).
    ///
    /// # Panics
    /// If etcd is not installed, or the cluster does not become healthy in time.
    pub fn start() -> Self {
        // Faster elections than the default 1 s keep failover tests short.
        Self::start_with_timing(Some((50, 500)))
    }

    /// As [`EtcdCluster::start`], with this raft heartbeat and election timeout in ms (`None`:
    /// etcd's defaults, 100 and 1000).
    pub fn start_with_timing(timing: Option<(u32, u32)>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("weft-etcd-cluster-")
            .tempdir()
            .expect("create a temp dir");
        let mut last_error = String::new();
        for attempt in 0..3 {
            let ports: Vec<(u16, u16)> =
                (0..Self::SIZE).map(|_| (free_port(), free_port())).collect();
            let initial_cluster = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer))| format!("n{i}={}", url(*peer)))
                .collect::<Vec<_>>()
                .join(",");
            let mut members: Vec<Member> = ports
                .iter()
                .enumerate()
                .map(|(i, &(client_port, peer_port))| Member {
                    name: format!("n{i}"),
                    client_port,
                    health_port: client_port,
                    tls: None,
                    peer_port,
                    data_dir: dir.path().join(format!("a{attempt}-n{i}")),
                    log: dir.path().join(format!("n{i}.log")),
                    initial_cluster: initial_cluster.clone(),
                    timing,
                    extra: Vec::new(),
                    child: None,
                })
                .collect();
            for m in &mut members {
                m.spawn();
            }
            match wait_healthy(&mut members) {
                Ok(()) => return Self { members, _dir: dir },
                Err(e) => {
                    for m in &mut members {
                        m.kill();
                    }
                    last_error = e;
                }
            }
        }
        panic!("etcd cluster did not start in 3 attempts: {last_error}");
    }

    /// The client URLs of all members, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| url(m.client_port)).collect()
    }

    /// The client URL of one member.
    pub fn endpoint(&self, i: usize) -> String {
        url(self.members[i].client_port)
    }

    /// Which member leads now, as seen by the running members (`None` if none knows).
    pub async fn leader_index(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            let Ok(Ok(mut client)) = tokio::time::timeout(
                Duration::from_secs(2),
                etcd_client::Client::connect([url(m.client_port)], None),
            )
            .await
            else {
                continue;
            };
            let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(2), client.status()).await
            else {
                continue;
            };
            let Some(member_id) = status.header().map(|h| h.member_id()) else {
                continue;
            };
            let leader = status.leader();
            if leader == 0 {
                continue;
            }
            // A follower knows the leader's ID but not its index; the leader itself answers.
            if leader == member_id {
                return Some(i);
            }
        }
        None
    }

    /// SIGKILLs member `i`.
    pub fn kill_member(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// SIGSTOPs member `i`.
    pub fn pause_member(&self, i: usize) {
        self.members[i].signal(libc::SIGSTOP);
    }

    /// SIGCONTs member `i`.
    pub fn resume_member(&self, i: usize) {
        self.members[i].signal(libc::SIGCONT);
    }

    /// Starts member `i` again with its data dir and ports, and waits until it is healthy.
    pub fn restart_member(&mut self, i: usize) {
        let m = &mut self.members[i];
        m.kill();
        m.spawn();
        wait_member_healthy(m);
    }

    /// The data dir of member `i` (for tests that inspect or corrupt it).
    pub fn data_dir(&self, i: usize) -> &Path {
        &self.members[i].data_dir
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }
}
