//! The running side of an upgrade without loss ([`super::handover`]): the takeover socket's
//! listener, each takeover request on it, and `SIGHUP`, which re-executes weft's own binary in
//! place with a bridge process holding everything meanwhile.
//!
//! Contract: a request is served only for a peer of this process's own user (`SO_PEERCRED`);
//! anyone else is refused, logged at WARN, and nothing changes. A request must arrive whole
//! within [`handover::REQUEST_TIMEOUT`] of its connection, and while it arrives the stop and
//! `SIGHUP` are still served (the request is then dropped). Whatever fails before the next
//! process has everything leaves this one forwarding and holding the lease (its data plane
//! resumed, its keeper thawed), and is logged at WARN with why. After a handover this process
//! makes no store call: it stops, and exits 0.
//!
//! `SIGHUP` runs the binary now at the path weft was started by ([`start_path`]: `argv[0]`, as
//! the shell or the service manager found it, links not resolved), so that a package upgrade
//! that replaced the file, or a `current` link moved to a new version, runs the new version.
//! The bridge is a child of this process: should it exit before it takes over, the upgrade
//! gives up at once and logs its exit status. No signal during the re-exec kills weft or is
//! lost ([`crate::stop::exec_keeping_signals`]).

use std::ffi::{CString, OsStr, OsString};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, warn};

use super::handover::{self, HandedRoute, Handover, Message, Outgoing};
use crate::config::NetworkConfig;
use crate::dataplane::Dataplane;
use crate::fds;
use crate::instance::StateDirLock;
use crate::lease::driver::HandoverControl;
use crate::lease::record::NodeId;
use crate::route::Routes;
use crate::stop::Stop;

/// What `SIGHUP` re-executes: the binary at the path this process was started by (so that a
/// package upgrade that replaced the file runs the new version) and the same arguments.
#[derive(Clone, Debug)]
pub struct ExecSelf {
    /// The binary's path, as read at start.
    pub exe: PathBuf,
    /// The arguments, `argv[0]` first.
    pub args: Vec<OsString>,
}

/// How long a handover waits for the lease keeper to hold its lease steadily.
const FREEZE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Binds the takeover socket in `state_dir` (mode 0600; the state dir is 0700 too). A socket
/// file left by a weft that died is replaced: this process holds the state dir's lock.
pub(super) fn listen(state_dir: &Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = handover::socket_path(state_dir);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing the stale {}", path.display())),
    }
    let listener = std::os::unix::net::UnixListener::bind(&path)
        .with_context(|| format!("binding the takeover socket {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private", path.display()))?;
    listener.set_nonblocking(true).context("the takeover socket")?;
    UnixListener::from_std(listener).context("the takeover socket")
}

/// The takeover socket a previous process of this node handed over.
pub(super) fn adopt_listener(fd: OwnedFd) -> anyhow::Result<UnixListener> {
    let listener = std::os::unix::net::UnixListener::from(fd);
    listener.set_nonblocking(true).context("the handed takeover socket")?;
    UnixListener::from_std(listener).context("the handed takeover socket")
}

/// Everything a handover takes from the running daemon.
pub(super) struct Upgrades {
    pub(super) node: NodeId,
    pub(super) network: NetworkConfig,
    /// The address published as `PublicIP` (the underlay follower moves it).
    pub(super) public_ip: watch::Receiver<Ipv4Addr>,
    pub(super) public_ipv6: Option<Ipv6Addr>,
    pub(super) lock: StateDirLock,
    /// A second descriptor of the health port's listener, when there is one.
    pub(super) health: Option<OwnedFd>,
    pub(super) dataplane: Option<Arc<Dataplane>>,
    pub(super) routes: Arc<Routes>,
    pub(super) driver: mpsc::Sender<HandoverControl>,
    pub(super) exec: Option<ExecSelf>,
    /// The PID everything was handed to, once it was.
    pub(super) handed_to: Arc<OnceLock<u32>>,
}

impl Upgrades {
    /// Where the PID of the next process is set once everything is handed over.
    pub(super) fn handed_over(&self) -> Arc<OnceLock<u32>> {
        self.handed_to.clone()
    }

    /// Freezes the keeper and gathers the message and the descriptors. On an error the keeper
    /// is thawed again.
    async fn prepare(&self, takeover: &UnixListener) -> Result<Outgoing, String> {
        // A keeper between two store calls hands over at once; one checking or rewriting its
        // lease does so a moment later.
        let deadline = tokio::time::Instant::now() + FREEZE_WAIT;
        let keeper = loop {
            let (tx, rx) = oneshot::channel();
            if self.driver.send(HandoverControl::Freeze(tx)).await.is_err() {
                return Err("the lease keeper is stopping".into());
            }
            match rx.await.map_err(|_| "the lease keeper is stopping".to_owned())? {
                Ok(k) => break k,
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.to_string()),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        };
        let gathered = (|| -> std::io::Result<Outgoing> {
            let mut fds = vec![self.lock.duplicate()?, takeover.as_fd().try_clone_to_owned()?];
            if let Some(h) = &self.health {
                fds.push(h.try_clone()?);
            }
            let dataplane = match &self.dataplane {
                Some(dp) => {
                    let handed = dp.hand_over()?;
                    fds.extend(handed.fds);
                    Some(handed.layout)
                }
                None => None,
            };
            let routes = self.routes.load().peers().iter().map(HandedRoute::of).collect();
            Ok(Outgoing {
                handover: Handover {
                    version: handover::VERSION,
                    pid: std::process::id(),
                    node: self.node.clone(),
                    network: self.network.to_json(),
                    keeper,
                    public_ip: *self.public_ip.borrow(),
                    public_ipv6: self.public_ipv6,
                    health: self.health.is_some(),
                    dataplane,
                    routes,
                },
                fds,
            })
        })();
        match gathered {
            Ok(o) => Ok(o),
            Err(e) => {
                self.thaw().await;
                Err(format!("gathering the descriptors: {e}"))
            }
        }
    }

    /// Forwards and renews again (a handover failed).
    async fn thaw(&self) {
        if let Some(dp) = self.dataplane.clone() {
            match tokio::task::spawn_blocking(move || dp.resume()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    error!(error = %e, "could not start forwarding again after a failed handover")
                }
                Err(e) => {
                    error!(error = %e, "could not start forwarding again after a failed handover")
                }
            }
        }
        let _ = self.driver.send(HandoverControl::Resume).await;
    }

    /// Stops reading (what is queued in the kernel is the next process's).
    async fn quiesce(&self) {
        if let Some(dp) = self.dataplane.clone() {
            let _ = tokio::task::spawn_blocking(move || dp.quiesce()).await;
        }
    }

    /// Checks who is on `conn` and reads its request, the whole of it within
    /// [`handover::REQUEST_TIMEOUT`]; refuses (and says why) anyone but this process's user or
    /// a request of another format.
    async fn admit(&self, conn: &Arc<UnixStream>) -> Result<fds::Peer, String> {
        let peer = fds::peer(conn).map_err(|e| format!("asking who connected: {e}"))?;
        let me = nix::unistd::geteuid().as_raw();
        if peer.uid != me {
            let why = format!(
                "pid {} of uid {} asked to take over; only this process's user ({me}) may",
                peer.pid, peer.uid
            );
            return Err(refuse(conn, why).await);
        }
        let c = conn.clone();
        let request = blocking(move || handover::receive(&c, handover::REQUEST_TIMEOUT)).await;
        match request {
            Ok((Message::Request { version }, _)) if version == handover::VERSION => Ok(peer),
            Ok((Message::Request { version }, _)) => {
                let why = format!(
                    "pid {} reads handover format {version}, this process writes {}",
                    peer.pid,
                    handover::VERSION
                );
                Err(refuse(conn, why).await)
            }
            Ok((other, _)) => Err(format!("pid {} sent {other:?}, not a request", peer.pid)),
            Err(e) => Err(format!("reading pid {}'s request: {e:#}", peer.pid)),
        }
    }

    /// Hands everything over to `peer` on `conn` (its request admitted, see
    /// [`super::handover`]); returns its PID once it has everything.
    async fn hand_over(
        &self,
        conn: Arc<UnixStream>,
        peer: fds::Peer,
        takeover: &UnixListener,
    ) -> Result<u32, String> {
        let outgoing = match self.prepare(takeover).await {
            Ok(o) => o,
            Err(why) => return Err(refuse(&conn, why).await),
        };
        info!(to_pid = peer.pid, "handing over to a new weft");
        let c = conn.clone();
        let answer = blocking(move || {
            let fds: Vec<_> = outgoing.fds.iter().map(AsFd::as_fd).collect();
            handover::send(&c, &Message::Handover(Box::new(outgoing.handover.clone())), &fds)?;
            handover::receive(&c, handover::STEP_TIMEOUT)
        })
        .await;
        match answer {
            Ok((Message::Forwarding, _)) => {}
            Ok((Message::Failed { why }, _)) => {
                self.thaw().await;
                return Err(format!("pid {} could not take over: {why}", peer.pid));
            }
            Ok((other, _)) => {
                self.thaw().await;
                return Err(format!("pid {} answered {other:?}", peer.pid));
            }
            Err(e) => {
                self.thaw().await;
                return Err(format!("pid {}: {e:#}", peer.pid));
            }
        }
        self.quiesce().await;
        let c = conn.clone();
        if let Err(e) = blocking(move || handover::send(&c, &Message::Released, &[])).await {
            self.thaw().await;
            return Err(format!("telling pid {} it has everything: {e:#}", peer.pid));
        }
        Ok(peer.pid as u32)
    }

    /// The in-place upgrade (`SIGHUP`): a bridge (the binary now at this process's start
    /// path, started as a child with `--takeover`) takes everything over, so that nothing
    /// goes unread while this process re-executes; the re-executed image (same PID, same
    /// arguments, `--takeover`) then takes everything over from the bridge, which exits, and
    /// reaps it ([`reap_if_child`]). Returns only if it did not happen: [`InPlace::KeptHere`]
    /// when this process still holds everything (the bridge did not start, exited, or did not
    /// take over: the new binary is not run in place), [`InPlace::LeftWithBridge`] when
    /// `execve` failed after the bridge took over.
    async fn upgrade_in_place(&self, takeover: &UnixListener) -> InPlace {
        let Some(exec) = self.exec.clone() else {
            return InPlace::KeptHere("the path of weft's binary is unknown".into());
        };
        info!(exe = %exec.exe.display(), "SIGHUP: upgrading in place from weft's start path; a bridge process takes over meanwhile");
        super::systemd::reloading();
        let kept = |why: String| {
            super::systemd::ready_again();
            InPlace::KeptHere(why)
        };
        let mut bridge = match spawn_bridge(&exec) {
            Ok(child) => child,
            Err(e) => return kept(format!("starting the bridge: {e:#}")),
        };
        let bridge_pid = bridge.id();
        let conn = match accept_bridge(takeover, &mut bridge).await {
            Ok(c) => c,
            Err(why) => {
                reap_in_background(bridge);
                return kept(why);
            }
        };
        let conn = Arc::new(conn);
        let handed = match self.admit(&conn).await {
            Ok(peer) => self.hand_over(conn, peer, takeover).await,
            Err(why) => Err(why),
        };
        if let Err(why) = handed {
            reap_in_background(bridge);
            return kept(format!("the bridge did not take over: {why}"));
        }
        // Its exit is reaped by the re-executed image, this PID still (or, should the exec
        // fail, by the process that inherits it).
        drop(bridge);
        let _ = self.driver.send(HandoverControl::Finish).await;
        info!(bridge_pid, exe = %exec.exe.display(), "the bridge forwards; re-executing");
        crate::logging::flush(std::time::Duration::from_millis(500));
        let failed = tokio::task::spawn_blocking(move || format!("{:#}", exec_taking_over(&exec)))
            .await
            .unwrap_or_else(|e| e.to_string());
        let _ = self.handed_to.set(bridge_pid);
        InPlace::LeftWithBridge(failed)
    }
}

/// Refuses the takeover asked on `conn` (telling it why, and this process's PID); `why`.
async fn refuse(conn: &Arc<UnixStream>, why: String) -> String {
    let c = conn.clone();
    let m = Message::Refused { why: why.clone(), pid: Some(std::process::id()) };
    let _ = tokio::task::spawn_blocking(move || handover::send(&c, &m, &[])).await;
    why
}

/// Waits (at most [`handover::STEP_TIMEOUT`]) for `bridge` to connect to the takeover socket;
/// anyone else who connects meanwhile is refused. An error, at once, when the bridge exits.
async fn accept_bridge(
    takeover: &UnixListener,
    bridge: &mut std::process::Child,
) -> Result<UnixStream, String> {
    let deadline = tokio::time::Instant::now() + handover::STEP_TIMEOUT;
    let mut poll = tokio::time::interval(std::time::Duration::from_millis(20));
    loop {
        tokio::select! {
            accepted = takeover.accept() => {
                let conn = accepted
                    .and_then(|(c, _)| c.into_std())
                    .and_then(|c| c.set_nonblocking(false).map(|()| c))
                    .map_err(|e| format!("accepting the bridge: {e}"))?;
                match fds::peer(&conn) {
                    Ok(p) if p.pid as u32 == bridge.id() => return Ok(conn),
                    Ok(p) => {
                        warn!(pid = p.pid, "refusing a takeover request: an in-place upgrade is under way");
                        let conn = Arc::new(conn);
                        tokio::spawn(async move {
                            refuse(&conn, "an in-place upgrade is under way".into()).await
                        });
                    }
                    Err(e) => warn!(error = %e, "asking who connected to the takeover socket"),
                }
            }
            _ = poll.tick() => {
                match bridge.try_wait() {
                    Ok(Some(status)) => {
                        error!(bridge_pid = bridge.id(), %status, "the bridge exited before taking over");
                        return Err(format!(
                            "the bridge (pid {}) exited ({status}) before taking over (see its \
                             log lines above)",
                            bridge.id()
                        ));
                    }
                    Ok(None) => {}
                    Err(e) => warn!(error = %e, "asking whether the bridge runs"),
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "the bridge did not ask within {:?} (see its log lines above)",
                        handover::STEP_TIMEOUT
                    ));
                }
            }
        }
    }
}

/// Waits for a bridge that did not take over to exit, and logs how it did.
fn reap_in_background(mut bridge: std::process::Child) {
    let pid = bridge.id();
    let _ =
        std::thread::Builder::new().name("weft-bridge-reaper".into()).spawn(move || {
            match bridge.wait() {
                Ok(status) => info!(bridge_pid = pid, %status, "the bridge exited"),
                Err(e) => warn!(bridge_pid = pid, error = %e, "waiting for the bridge"),
            }
        });
}

/// Reaps `pid` once it exits, and logs how, if it is a child of this process: the bridge of
/// an in-place upgrade, started by this PID's previous image. Anything else (a process that
/// handed over by `--takeover`) is no child: nothing to do.
pub(super) fn reap_if_child(pid: u32) {
    let Ok(raw) = i32::try_from(pid) else { return };
    let _ = std::thread::Builder::new().name("weft-bridge-reaper".into()).spawn(move || {
        use nix::sys::wait::{WaitStatus, waitpid};
        match waitpid(nix::unistd::Pid::from_raw(raw), None) {
            Ok(WaitStatus::Exited(_, code)) => {
                info!(bridge_pid = pid, code, "the bridge of the in-place upgrade exited")
            }
            Ok(status) => {
                warn!(bridge_pid = pid, ?status, "the bridge of the in-place upgrade ended")
            }
            Err(nix::errno::Errno::ECHILD) => {}
            Err(e) => warn!(bridge_pid = pid, error = %e, "waiting for the bridge"),
        }
    });
}

/// How an in-place upgrade that returned ended ([`Upgrades::upgrade_in_place`]).
enum InPlace {
    /// Nothing was handed over: this process goes on.
    KeptHere(String),
    /// The bridge holds everything, but this process could not re-execute itself.
    LeftWithBridge(String),
}

/// Starts the bridge of an in-place upgrade: `exec`'s binary and arguments with `--takeover`,
/// as a child of this process, so that an exit before it takes over is seen at once.
fn spawn_bridge(exec: &ExecSelf) -> anyhow::Result<std::process::Child> {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = std::process::Command::new(&exec.exe);
    if let Some(arg0) = exec.args.first() {
        cmd.arg0(arg0);
    }
    cmd.args(exec.args.iter().skip(1)).env(TAKEOVER_ENV, "true").stdin(std::process::Stdio::null());
    // The service manager talks to this process, not to the bridge.
    for var in super::systemd::MANAGER_ENV {
        cmd.env_remove(var);
    }
    cmd.spawn().with_context(|| format!("running {}", exec.exe.display()))
}

/// Re-executes this process as `exec` with `--takeover` (`execve`, no fork: the same PID), its
/// signal mask and pending signals kept ([`crate::stop::exec_keeping_signals`]); returns only
/// on failure.
fn exec_taking_over(exec: &ExecSelf) -> anyhow::Error {
    use std::os::unix::ffi::OsStrExt as _;
    let c = |bytes: &[u8]| CString::new(bytes).context("a NUL byte in an argument or variable");
    let built = (|| -> anyhow::Result<(CString, Vec<CString>, Vec<CString>)> {
        let path = c(exec.exe.as_os_str().as_bytes())?;
        let arg0 = exec.args.first().map_or(exec.exe.as_os_str(), OsString::as_os_str);
        let mut args = vec![c(arg0.as_bytes())?];
        for a in exec.args.iter().skip(1) {
            args.push(c(a.as_bytes())?);
        }
        // The descriptors systemd passed at the start are not this image's any more.
        let dropped = [TAKEOVER_ENV, "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"];
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os() {
            if dropped.iter().any(|d| k == *d) {
                continue;
            }
            env.push(c(&[k.as_bytes(), b"=", v.as_bytes()].concat())?);
        }
        env.push(c(format!("{TAKEOVER_ENV}=true").as_bytes())?);
        Ok((path, args, env))
    })();
    let (path, args, env) = match built {
        Ok(b) => b,
        Err(e) => return e.context(format!("re-executing {}", exec.exe.display())),
    };
    let error =
        crate::stop::exec_keeping_signals(|| match nix::unistd::execve(&path, &args, &env) {
            Ok(never) => match never {},
            Err(e) => std::io::Error::from(e),
        });
    anyhow::Error::from(error).context(format!("re-executing {}", exec.exe.display()))
}

/// `--takeover`'s environment variable.
const TAKEOVER_ENV: &str = "WEFT_TAKEOVER";

/// Runs a blocking step of the protocol off the runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(anyhow::Error::from)?
}

/// Serves takeover requests and `SIGHUP` until the stop, or until everything is handed over
/// (then the driver has ended, and the daemon stops). A request is read while the stop and
/// `SIGHUP` are watched: a slow one is dropped for either. An error: everything went to the
/// bridge of an in-place upgrade that could not re-execute this process, which then stops
/// non-zero.
pub(super) async fn serve(
    upgrades: Upgrades,
    takeover: UnixListener,
    stop: Arc<Stop>,
) -> Result<(), String> {
    let mut shutdown = stop.subscribe();
    let mut hups = stop.upgrade_requests();
    loop {
        enum Event {
            Conn(std::io::Result<tokio::net::UnixStream>),
            Hup,
            Stop,
        }
        let event = tokio::select! {
            accepted = takeover.accept() => Event::Conn(accepted.map(|(c, _)| c)),
            changed = hups.changed() => if changed.is_ok() { Event::Hup } else { Event::Stop },
            _ = shutdown.wait_for(|v| *v) => Event::Stop,
        };
        match event {
            Event::Stop => return Ok(()),
            Event::Hup => {}
            Event::Conn(accepted) => {
                let conn = match accepted
                    .and_then(|c| c.into_std())
                    .and_then(|c| c.set_nonblocking(false).map(|()| c))
                {
                    Ok(c) => Arc::new(c),
                    Err(e) => {
                        warn!(error = %e, "accepting on the takeover socket");
                        continue;
                    }
                };
                enum During {
                    Admitted(Result<fds::Peer, String>),
                    Hup,
                    Stop,
                }
                let during = tokio::select! {
                    admitted = upgrades.admit(&conn) => During::Admitted(admitted),
                    changed = hups.changed() => if changed.is_ok() { During::Hup } else { During::Stop },
                    _ = shutdown.wait_for(|v| *v) => During::Stop,
                };
                match during {
                    During::Admitted(Ok(peer)) => {
                        match upgrades.hand_over(conn, peer, &takeover).await {
                            Ok(pid) => {
                                super::systemd::main_pid(pid);
                                let _ = upgrades.handed_to.set(pid);
                                let _ = upgrades.driver.send(HandoverControl::Finish).await;
                                upgrades.lock.leave_to_successor();
                                return Ok(());
                            }
                            Err(why) => {
                                warn!("a takeover did not happen: {why}; this weft goes on");
                            }
                        }
                        continue;
                    }
                    During::Admitted(Err(why)) => {
                        warn!("a takeover did not happen: {why}; this weft goes on");
                        continue;
                    }
                    During::Hup | During::Stop => {
                        // Ends the read still waiting on it.
                        let _ = conn.shutdown(std::net::Shutdown::Both);
                        warn!(
                            "a takeover request still arriving was dropped for {}",
                            if matches!(during, During::Hup) { "SIGHUP" } else { "the stop" }
                        );
                        if matches!(during, During::Stop) {
                            return Ok(());
                        }
                    }
                }
            }
        }
        match upgrades.upgrade_in_place(&takeover).await {
            InPlace::KeptHere(why) => {
                error!("SIGHUP: no in-place upgrade: {why}; this weft goes on as it is");
            }
            InPlace::LeftWithBridge(why) => {
                upgrades.lock.leave_to_successor();
                return Err(format!(
                    "SIGHUP: {why}; the bridge process forwards and holds the lease, this one stops"
                ));
            }
        }
    }
}

impl ExecSelf {
    /// This process's: the path it was started by ([`start_path`]; where that is not a file,
    /// the binary's own path from `/proc/self/exe`, links resolved) and its arguments. Read at
    /// start, while the working directory is the start's.
    pub fn of_this_process() -> Option<Self> {
        let args: Vec<OsString> = std::env::args_os().collect();
        let cwd = std::env::current_dir().ok();
        let path_var = std::env::var_os("PATH");
        let exe = args
            .first()
            .and_then(|arg0| start_path(arg0, cwd.as_deref(), path_var.as_deref()))
            .or_else(|| std::env::current_exe().ok())?;
        Some(Self { exe, args })
    }
}

/// The path a process started with `arg0` was started by, links left as they are (a
/// `current -> v1/weft` link names whatever it points at when it is next run): `arg0` made
/// absolute against `cwd` when it has a '/'; else found in `path_var`'s directories as
/// `execvp` finds it (an empty entry is `cwd`; without `PATH`, `/bin:/usr/bin`). `None` when no
/// executable file is there.
pub fn start_path(arg0: &OsStr, cwd: Option<&Path>, path_var: Option<&OsStr>) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    let absolute = |p: PathBuf| if p.is_absolute() { Some(p) } else { cwd.map(|c| c.join(p)) };
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if arg0.is_empty() {
        return None;
    }
    if arg0.as_bytes().contains(&b'/') {
        return absolute(PathBuf::from(arg0)).filter(|p| executable(p));
    }
    let dirs = path_var.unwrap_or(OsStr::new("/bin:/usr/bin"));
    dirs.as_bytes()
        .split(|&b| b == b':')
        .filter_map(|dir| absolute(Path::new(OsStr::from_bytes(dir)).join(arg0)))
        .find(|p| executable(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The start path: a path with a '/' made absolute (never resolved), a bare name found on
    /// PATH as execvp would (the first executable one), nothing for what is not there.
    #[test]
    fn the_start_path_is_the_path_given_or_found_on_path_with_links_kept() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["a", "b", "v1", "bin"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let make = |p: &Path, mode: u32| {
            std::fs::write(p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        make(&d.join("v1/weft"), 0o755);
        std::os::unix::fs::symlink(d.join("v1/weft"), d.join("bin/current")).unwrap();
        make(&d.join("a/weft"), 0o644);
        make(&d.join("b/weft"), 0o755);
        let os = OsStr::new;
        assert_eq!(start_path(os("bin/current"), Some(d), None), Some(d.join("bin/current")));
        let abs = d.join("bin/current");
        assert_eq!(start_path(abs.as_os_str(), None, None), Some(abs.clone()));
        assert_eq!(start_path(os("bin/nothing"), Some(d), None), None);
        let path = format!("{}:{}:{}", d.join("a").display(), d.join("b").display(), "/bin");
        assert_eq!(start_path(os("weft"), Some(d), Some(os(&path))), Some(d.join("b/weft")));
        // A relative entry and an empty one are the working directory's.
        assert_eq!(start_path(os("current"), Some(d), Some(os("v1:bin"))), Some(abs));
        assert_eq!(
            start_path(os("weft"), Some(&d.join("b")), Some(os(":/nowhere"))),
            Some(d.join("b/weft"))
        );
        assert_eq!(start_path(os("weft"), Some(d), Some(os("/nowhere"))), None);
        assert_eq!(start_path(os(""), Some(d), None), None);
    }
}
