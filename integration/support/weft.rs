//! Real `weft run` processes for tests, and a cuttable TCP proxy in front of etcd.
//!
//! Contract:
//! - [`WeftNode::spawn`] starts the binary cargo built for this test (`CARGO_BIN_EXE_weft`)
//!   with its own temp state dir and subnet file (or a given one, to model a cloned disk), a
//!   health server on a loopback address of its own (see [`own_loopback`]) and short TTLs. The process gets `PR_SET_PDEATHSIG`, and `Drop`
//!   SIGKILLs and reaps it, so no daemon outlives its test.
//! - [`Proxy`] forwards loopback TCP to etcd; [`Proxy::cut`] closes every connection through it
//!   and refuses new ones until healed — one node partitioned from a live etcd (S5, S6).
//! - Everything here runs in the root namespace on loopback and changes no links or routes:
//!   with `--dataplane none`, weft opens no TUN and needs no privilege.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::process::Daemon;

/// A TCP proxy on a loopback port that can be cut and healed.
pub struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Starts forwarding a fresh loopback port to `target`.
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (cut2, conns2) = (cut.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(target) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                if let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) {
                    let mut list = conns2.lock().expect("proxy list");
                    list.push(c2);
                    list.push(u2);
                }
                pipe(&client, &upstream);
                pipe(&upstream, &client);
            }
        });
        Self { port, cut, conns }
    }

    /// The endpoint to give weft (`http://127.0.0.1:<port>`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Cuts (`true`) or heals (`false`) the path.
    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            for s in self.conns.lock().expect("proxy list").drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// How to start a node.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// etcd endpoints (comma-separated).
    pub endpoints: String,
    /// Key prefix.
    pub prefix: String,
    /// Published address (192.0.2.0/24).
    pub public_ip: Ipv4Addr,
    /// Lease TTL (`4s`).
    pub ttl: String,
    /// State dir and subnet file; `None`: a fresh temp dir.
    pub dir: Option<PathBuf>,
    /// More flags.
    pub extra: Vec<String>,
    /// More environment variables.
    pub env: Vec<(String, String)>,
}

impl NodeOptions {
    /// Defaults for a test: TTL 4 s, a fresh dir.
    pub fn new(endpoints: impl Into<String>, prefix: &str, public_ip: Ipv4Addr) -> Self {
        Self {
            endpoints: endpoints.into(),
            prefix: prefix.to_owned(),
            public_ip,
            ttl: "4s".into(),
            dir: None,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// The flags every test's `weft run` gets, in the root namespace ([`WeftNode`]) or in a
/// namespace host ([`super::netns`]): one place that says how a test runs weft.
pub struct RunArgs<'a> {
    /// etcd's client URL(s).
    pub endpoints: &'a str,
    /// The key prefix.
    pub prefix: &'a str,
    /// `--state-dir`.
    pub state_dir: &'a Path,
    /// `--subnet-file`.
    pub subnet_file: &'a Path,
    /// `--subnet-lease-ttl`.
    pub ttl: &'a str,
    /// The health server's address.
    pub health: SocketAddr,
    /// `--dataplane` (`none` or `tun`).
    pub dataplane: &'a str,
}

impl RunArgs<'_> {
    /// `run` and its flags; a test adds its own after them. etcd calls time out after 1 s, so
    /// that a test's faults show in seconds.
    pub fn to_args(&self) -> Vec<String> {
        let path = |p: &Path| p.to_string_lossy().into_owned();
        [
            "run",
            "--etcd-endpoints",
            self.endpoints,
            "--etcd-prefix",
            self.prefix,
            "--etcd-timeout",
            "1s",
            "--state-dir",
            &path(self.state_dir),
            "--subnet-file",
            &path(self.subnet_file),
            "--subnet-lease-ttl",
            self.ttl,
            "--healthz-ip",
            &self.health.ip().to_string(),
            "--healthz-port",
            &self.health.port().to_string(),
            "--dataplane",
            self.dataplane,
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// One `weft run` process.
pub struct WeftNode {
    /// The options it was started with.
    pub opts: NodeOptions,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    process: Daemon,
    health: SocketAddr,
}

/// A loopback address no other node of this test process uses: `127.<p>.<y>.<z>`, with `<p>`
/// from the process ID and `<y>.<z>` counting nodes.
///
/// Why: a port picked by binding port 0 and closing is free only until someone else binds it.
/// With fifty nodes starting at once, one node's pick was taken by another node's health
/// server in CI: the node failed to bind, and its readiness poll was answered by the
/// other node. An address of its own cannot be answered by another node, whatever the port.
fn own_loopback() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let p = 64 + (std::process::id() % 128) as u8;
    Ipv4Addr::new(127, p, (n / 250 % 256) as u8, (n % 250 + 1) as u8)
}

/// A port on `ip` that was free a moment ago.
fn free_port_on(ip: Ipv4Addr) -> u16 {
    TcpListener::bind((ip, 0)).and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl WeftNode {
    /// Starts `weft run --dataplane none` with `opts`.
    pub fn spawn(opts: NodeOptions) -> Self {
        let (dir, tmp) = match &opts.dir {
            Some(d) => (d.clone(), None),
            None => {
                let t = tempfile::Builder::new().prefix("weft-node-").tempdir().expect("tempdir");
                (t.path().to_path_buf(), Some(t))
            }
        };
        let mut node = Self {
            opts,
            dir,
            _tmp: tmp,
            process: Daemon::default(),
            health: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        };
        node.start();
        node
    }

    /// Starts the process again (after [`WeftNode::kill`] or [`WeftNode::stop`]), with the same
    /// state dir and subnet file.
    pub fn start(&mut self) {
        let ip = own_loopback();
        self.health = SocketAddr::from((ip, free_port_on(ip)));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open node log");
        let run = RunArgs {
            endpoints: &self.opts.endpoints,
            prefix: &self.opts.prefix,
            state_dir: &self.dir.join("state"),
            subnet_file: &self.subnet_file(),
            ttl: &self.opts.ttl,
            health: self.health,
            dataplane: "none",
        };
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_weft"));
        cmd.args(run.to_args())
            .args(["--public-ip", &self.opts.public_ip.to_string()])
            .args(&self.opts.extra)
            .env("WEFT_LOG", "weft=debug,info")
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log);
        self.process.start(&mut cmd);
    }

    /// The directory holding `state/`, `subnet.env` and `weft.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The subnet file.
    pub fn subnet_file(&self) -> PathBuf {
        self.dir.join("subnet.env")
    }

    /// The log file (appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!("weft-{}.log", self.opts.public_ip))
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The process ID.
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// SIGSTOP: the host is suspended.
    pub fn suspend(&self) {
        self.process.suspend();
    }

    /// SIGCONT: the host resumes.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// SIGKILL: a crash; nothing is released.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM and wait (up to 10 s) for a clean exit; returns the exit code.
    pub fn stop(&mut self) -> Option<i32> {
        let log = self.log_path();
        self.process.stop(|| std::fs::read_to_string(log).unwrap_or_default())
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.process.running()
    }

    /// GET a health path: (status, body). Status 0 when nothing answers.
    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(self.health, path)
    }

    /// The subnet in subnet.env (the `FLANNEL_SUBNET` line), if any.
    pub fn subnet_env_subnet(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.subnet_file()).ok()?;
        let line = text.lines().find(|l| l.starts_with("FLANNEL_SUBNET="))?;
        let (ip, len) = line.trim_start_matches("FLANNEL_SUBNET=").split_once('/')?;
        let ip: Ipv4Addr = ip.parse().ok()?;
        Some(format!("{}/{len}", Ipv4Addr::from(u32::from(ip) - 1)))
    }

    /// The IPv6 subnet subnet.env names (`FLANNEL_IPV6_SUBNET` less one: `fd00:10:244:5::/64`),
    /// on a dual-stack network.
    pub fn subnet_env_ipv6(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.subnet_file()).ok()?;
        let line = text.lines().find_map(|l| l.strip_prefix("FLANNEL_IPV6_SUBNET="))?;
        let (ip, len) = line.split_once('/')?;
        let ip: std::net::Ipv6Addr = ip.parse().ok()?;
        Some(format!("{}/{len}", std::net::Ipv6Addr::from(u128::from(ip) - 1)))
    }

    /// Waits until `/readyz` says ready; returns the subnet from subnet.env (the IPv4 one, or
    /// on an IPv6-only network the IPv6 one).
    pub fn wait_ready(&self, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let (status, body) = self.get("/readyz");
            if status == 200
                && let Some(s) = self.subnet_env_subnet().or_else(|| self.subnet_env_ipv6())
            {
                return s;
            }
            if Instant::now() > deadline {
                panic!(
                    "node {} not ready in {within:?}: {status} {body}\n--- log ---\n{}",
                    self.opts.public_ip,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(needle) {
            if Instant::now() > deadline {
                panic!(
                    "node {}: {needle:?} not logged in {within:?}\n--- log ---\n{}",
                    self.opts.public_ip,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A metric's value from `/metrics` (first sample whose line starts with `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics");
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

/// A minimal HTTP/1.0 GET: (status, body); status 0 when nothing answers.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", addr.ip());
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// `weft lease list --json` against the etcd at `endpoint` under `prefix`, parsed; panics
/// (with weft's stderr) if it fails.
pub fn lease_list_json(endpoint: &str, prefix: &str) -> serde_json::Value {
    let args = ["lease", "list", "--json", "--etcd-endpoints", endpoint, "--etcd-prefix", prefix];
    let (code, out, err) = weft_cli(&args);
    assert_eq!(code, 0, "weft lease list: {err}");
    serde_json::from_str(&out).expect("weft lease list --json prints JSON")
}

/// Runs `weft` (a CLI subcommand) to completion: (exit code, stdout, stderr).
pub fn weft_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_weft")).args(args).output().expect("run weft");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
