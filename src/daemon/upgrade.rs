//! The running side of an upgrade without loss ([`super::handover`]): the takeover socket's
//! listener, each takeover request on it, and `SIGHUP`, which re-executes weft's own binary in
//! place (the binary now at the path it was started from, so a package upgrade that replaced
//! the file runs the new version) with a bridge process holding everything meanwhile.
//!
//! Contract: a request is served only for a peer of this process's own user (`SO_PEERCRED`);
//! anyone else is refused, logged at WARN, and nothing changes. Whatever fails before the next
//! process has everything leaves this one forwarding and holding the lease (its data plane
//! resumed, its keeper thawed), and is logged at WARN with why. After a handover this process
//! makes no store call: it stops, and exits 0.

use std::ffi::OsString;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, OwnedFd};
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

/// What `SIGHUP` re-executes: the binary this process was started from (its path, so that a
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

    /// Serves one takeover request on `conn` (see [`super::handover`]); returns the new
    /// process's PID once it has everything.
    async fn takeover(
        &self,
        conn: std::os::unix::net::UnixStream,
        takeover: &UnixListener,
    ) -> Result<u32, String> {
        let conn = Arc::new(conn);
        let peer = fds::peer(&conn).map_err(|e| format!("asking who connected: {e}"))?;
        let me = nix::unistd::geteuid().as_raw();
        let refuse = |why: String| {
            let c = conn.clone();
            async move {
                let m = Message::Refused { why: why.clone() };
                let _ = tokio::task::spawn_blocking(move || handover::send(&c, &m, &[])).await;
                why
            }
        };
        if peer.uid != me {
            let why = format!(
                "pid {} of uid {} asked to take over; only this process's user ({me}) may",
                peer.pid, peer.uid
            );
            return Err(refuse(why).await);
        }
        let c = conn.clone();
        let request = blocking(move || handover::receive(&c)).await;
        match request {
            Ok((Message::Request { version }, _)) if version == handover::VERSION => {}
            Ok((Message::Request { version }, _)) => {
                let why = format!(
                    "pid {} reads handover format {version}, this process writes {}",
                    peer.pid,
                    handover::VERSION
                );
                return Err(refuse(why).await);
            }
            Ok((other, _)) => {
                return Err(format!("pid {} sent {other:?}, not a request", peer.pid));
            }
            Err(e) => return Err(format!("reading pid {}'s request: {e:#}", peer.pid)),
        }
        let outgoing = match self.prepare(takeover).await {
            Ok(o) => o,
            Err(why) => return Err(refuse(why).await),
        };
        info!(to_pid = peer.pid, "handing over to a new weft");
        let c = conn.clone();
        let answer = blocking(move || {
            let fds: Vec<_> = outgoing.fds.iter().map(AsFd::as_fd).collect();
            handover::send(&c, &Message::Handover(Box::new(outgoing.handover.clone())), &fds)?;
            handover::receive(&c)
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

    /// The in-place upgrade (`SIGHUP`): a bridge (the binary now at this process's path,
    /// started as a second process with `--takeover`) takes everything over, so that nothing
    /// goes unread while this process re-executes; the re-executed image (same PID, same
    /// arguments, `--takeover`) then takes everything over from the bridge, which exits.
    /// Returns only if it did not happen: [`InPlace::KeptHere`] when this process still holds
    /// everything (the bridge did not start or take over: the new binary is not run in place),
    /// [`InPlace::LeftWithBridge`] when `execve` failed after the bridge took over.
    async fn upgrade_in_place(&self, takeover: &UnixListener) -> InPlace {
        let Some(exec) = self.exec.clone() else {
            return InPlace::KeptHere("the path of weft's binary is unknown".into());
        };
        info!(exe = %exec.exe.display(), "SIGHUP: upgrading in place; a bridge process takes over meanwhile");
        super::systemd::reloading();
        let kept = |why: String| {
            super::systemd::ready_again();
            InPlace::KeptHere(why)
        };
        if let Err(e) = spawn_bridge(&exec) {
            return kept(format!("starting the bridge: {e:#}"));
        }
        let conn = match tokio::time::timeout(handover::STEP_TIMEOUT, takeover.accept()).await {
            Ok(Ok((c, _))) => c.into_std(),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                return kept(format!(
                    "the bridge did not ask within {:?} (see its log lines above)",
                    handover::STEP_TIMEOUT
                ));
            }
        };
        let conn = match conn.and_then(|c| c.set_nonblocking(false).map(|()| c)) {
            Ok(c) => c,
            Err(e) => return kept(format!("accepting the bridge: {e}")),
        };
        let bridge = match self.takeover(conn, takeover).await {
            Ok(pid) => pid,
            Err(why) => return kept(format!("the bridge did not take over: {why}")),
        };
        let _ = self.driver.send(HandoverControl::Finish).await;
        info!(bridge_pid = bridge, exe = %exec.exe.display(), "the bridge forwards; re-executing");
        crate::logging::flush(std::time::Duration::from_millis(500));
        let failed = tokio::task::spawn_blocking(move || exec_taking_over(&exec).to_string())
            .await
            .unwrap_or_else(|e| e.to_string());
        let _ = self.handed_to.set(bridge);
        InPlace::LeftWithBridge(failed)
    }
}

/// How an in-place upgrade that returned ended ([`Upgrades::upgrade_in_place`]).
enum InPlace {
    /// Nothing was handed over: this process goes on.
    KeptHere(String),
    /// The bridge holds everything, but this process could not re-execute itself.
    LeftWithBridge(String),
}

/// Starts the bridge of an in-place upgrade: `exec`'s binary and arguments with `--takeover`,
/// in the background of a `/bin/sh` that exits at once, so that the bridge is no child of this
/// process (nothing here would reap it once it exits).
fn spawn_bridge(exec: &ExecSelf) -> anyhow::Result<()> {
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("\"$0\" \"$@\" </dev/null &")
        .arg(&exec.exe)
        .args(exec.args.iter().skip(1))
        .env(TAKEOVER_ENV, "true");
    // The service manager talks to this process, not to the bridge.
    for var in super::systemd::MANAGER_ENV {
        cmd.env_remove(var);
    }
    let status = cmd.status().context("running /bin/sh")?;
    anyhow::ensure!(status.success(), "/bin/sh exited with {status}");
    Ok(())
}

/// Re-executes this process as `exec` with `--takeover` (`execve`, no fork: the same PID);
/// returns only on failure.
fn exec_taking_over(exec: &ExecSelf) -> anyhow::Error {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = std::process::Command::new(&exec.exe);
    cmd.args(exec.args.iter().skip(1)).env(TAKEOVER_ENV, "true");
    // The descriptors systemd passed at the start are not this image's any more.
    for var in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
        cmd.env_remove(var);
    }
    if let Some(arg0) = exec.args.first() {
        cmd.arg0(arg0);
    }
    anyhow::Error::from(cmd.exec()).context(format!("re-executing {}", exec.exe.display()))
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
/// (then the driver has ended, and the daemon stops). An error: everything went to the bridge
/// of an in-place upgrade that could not re-execute this process, which then stops non-zero.
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
            Event::Conn(accepted) => {
                let conn = match accepted.and_then(|c| c.into_std()) {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(error = %e, "accepting on the takeover socket");
                        continue;
                    }
                };
                let _ = conn.set_nonblocking(false);
                match upgrades.takeover(conn, &takeover).await {
                    Ok(pid) => {
                        super::systemd::main_pid(pid);
                        let _ = upgrades.handed_to.set(pid);
                        let _ = upgrades.driver.send(HandoverControl::Finish).await;
                        upgrades.lock.leave_to_successor();
                        return Ok(());
                    }
                    Err(why) => warn!("a takeover did not happen: {why}; this weft goes on"),
                }
            }
            Event::Hup => match upgrades.upgrade_in_place(&takeover).await {
                InPlace::KeptHere(why) => {
                    error!("SIGHUP: no in-place upgrade: {why}; this weft goes on as it is");
                }
                InPlace::LeftWithBridge(why) => {
                    upgrades.lock.leave_to_successor();
                    return Err(format!(
                        "SIGHUP: {why}; the bridge process forwards and holds the lease, this one stops"
                    ));
                }
            },
            Event::Stop => return Ok(()),
        }
    }
}
