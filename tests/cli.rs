//! The `weft` binary as a user or a service manager runs it, needing no root and no etcd:
//! `weft run` against an etcd that is not there keeps retrying, which is all a test of its
//! signals needs.

use std::io::Read as _;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

fn weft() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weft"))
}

/// A `weft run` child whose stderr (its log) is collected; killed and reaped on drop.
struct Running {
    child: Child,
    log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Running {
    /// `weft run --dataplane none` against a loopback port nothing listens on.
    fn start() -> Self {
        let closed = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a port");
        let port = closed.local_addr().expect("port").port();
        drop(closed);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = weft()
            .args(["run", "--dataplane", "none", "--etcd-endpoints"])
            .arg(format!("http://127.0.0.1:{port}"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--subnet-file")
            .arg(dir.path().join("subnet.env"))
            .env_remove("WEFT_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn weft run");
        let log = Arc::new(Mutex::new(String::new()));
        let (mut pipe, sink) = (child.stderr.take().expect("stderr"), log.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().expect("log").push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self { child, log, _dir: dir }
    }

    fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    fn wait_log(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "{needle:?} not logged in {within:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).expect("kill(2)");
    }

    /// The exit status, if it exits within `within`.
    fn exit_within(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// systemd's `ExecReload=/bin/kill -HUP $MAINPID` must not kill weft (SIGHUP's default action):
/// before weft holds a lease there is nothing to upgrade, so it says so and goes on; SIGTERM
/// then still stops it cleanly. (The upgrade itself: `integration/e2e_upgrade.rs`.)
#[test]
fn sighup_before_a_lease_is_logged_and_ignored_and_sigterm_still_stops_cleanly() {
    let mut weft = Running::start();
    // The signal thread is up before the store client is made, so before this line.
    weft.wait_log("store unavailable", Duration::from_secs(10));
    for _ in 0..2 {
        weft.signal(Signal::SIGHUP);
    }
    weft.wait_log("ignored: weft is starting or taking over", Duration::from_secs(5));
    assert_eq!(
        weft.exit_within(Duration::from_millis(500)),
        None,
        "SIGHUP ended weft:\n{}",
        weft.log()
    );
    let hups = weft.log().matches("SIGHUP").count();
    assert!(hups >= 1, "{}", weft.log());
    weft.signal(Signal::SIGTERM);
    let status = weft.exit_within(Duration::from_secs(10)).expect("no exit 10 s after SIGTERM");
    assert_eq!(status.code(), Some(0), "{status:?}\n{}", weft.log());
}

/// `weft lease list` against a port nothing listens on fails with one line that names the
/// endpoint and the cause once (not the client's debug chain, twice).
#[test]
fn an_admin_command_against_no_etcd_says_where_and_why_once() {
    let closed = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a port");
    let endpoint = format!("http://{}", closed.local_addr().expect("port"));
    drop(closed);
    let out = weft()
        .args(["lease", "list", "--etcd-endpoints", &endpoint])
        .output()
        .expect("run weft lease list");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&endpoint), "the endpoint is not named: {stderr}");
    assert_eq!(stderr.matches("Connection refused").count(), 1, "{stderr}");
    assert!(!stderr.contains("tonic::"), "the client's debug form leaks: {stderr}");
}
