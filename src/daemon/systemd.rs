//! systemd's service protocol, when weft runs under a service manager that set `NOTIFY_SOCKET`
//! (`Type=notify`): readiness, status, the watchdog and the file descriptor store. Outside one
//! (`NOTIFY_SOCKET` unset) nothing here does anything.
//!
//! # Contract
//! - `READY=1` once `/readyz` says ready (a lease held and written, the data plane forwarding on
//!   the underlay's address, every worker up); `STATUS=` whenever what weft does changes
//!   (holding `<subnet>`, or the first reason it is not ready: waiting for etcd, lease lost…);
//!   `RELOADING=1` at the start of an in-place upgrade (`SIGHUP`, whose new image says `READY=1`
//!   again); `STOPPING=1` at the stop; `MAINPID=` naming the process a takeover handed
//!   everything to.
//! - `WATCHDOG=1` every half of `WATCHDOG_USEC`, only while every forwarding thread turned its
//!   loop since the last ping and the lease driver turned its loop within the last whole
//!   interval ([`Liveness`], pure): a stuck worker or keeper stops the pings, and systemd
//!   restarts weft. Which part is stuck is said at ERROR, once.
//! - With `FileDescriptorStoreMax=` set, the data plane's descriptors (TUN queues, sockets) are
//!   kept in systemd's fd store, named `weft-dp-<n>`, with a memfd `weft-dp-layout` that says what
//!   they are; they are stored again whenever the data plane re-binds. At start, descriptors of
//!   those names in `LISTEN_FDS`/`LISTEN_FDNAMES` are taken ([`stored_dataplane`]): a restart, even
//!   after a crash, keeps the TUN device and its queues, so only what overflows the kernel's
//!   queues in the gap is lost.
//! - Nothing here blocks the daemon: a notification that cannot be sent is logged once and
//!   dropped.

use std::io::{Read as _, Seek as _, Write as _};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tracing::{debug, error, info, warn};

use crate::dataplane::{Dataplane, DataplaneLayout, HandedDataplane};
use crate::fds;
use crate::health::Health;
use crate::lease::status::LeaseHealth;
use crate::logging::LogOnce;
use crate::stop::Stop;

/// The fd store name of the memfd that says what the data plane's descriptors are.
const LAYOUT_NAME: &str = "weft-dp-layout";
/// The fd store name prefix of the data plane's descriptors (`weft-dp-0`, `weft-dp-1`, …).
const FD_PREFIX: &str = "weft-dp-";
/// How often readiness and status are looked at.
const TICK: Duration = Duration::from_millis(200);

/// Whether a service manager listens (`NOTIFY_SOCKET` is set).
pub(super) fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Sends `states`; a failure is logged (once per kind of failure) and dropped.
fn notify(states: &[NotifyState<'_>], said: &mut LogOnce) {
    if let Err(e) = sd_notify::notify(states) {
        if let Some(p) = said.note(format!("telling the service manager: {e}")) {
            warn!("{p}");
        }
    } else {
        said.clear();
    }
}

/// `RELOADING=1` (an in-place upgrade begins).
pub(super) fn reloading() {
    let _ = sd_notify::notify(&[NotifyState::Reloading, NotifyState::Status("upgrading in place")]);
}

/// `READY=1` again: an in-place upgrade that did not happen ends the reload.
pub(super) fn ready_again() {
    let _ = sd_notify::notify(&[NotifyState::Ready]);
}

/// The variables by which a service manager talks to its main process: a process weft starts
/// beside itself (an upgrade's bridge) must not inherit them.
pub(super) const MANAGER_ENV: [&str; 6] = [
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
];

/// `MAINPID=<pid>`: the process a takeover handed everything to is the service's now.
pub(super) fn main_pid(pid: u32) {
    let _ = sd_notify::notify(&[NotifyState::MainPid(pid)]);
}

/// How the forwarding threads and the lease driver progressed, and whether the watchdog may be
/// told all is well (see the module docs). Pure: fed what the counters say at each ping time.
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    workers: Vec<(String, u64)>,
    keeper: Option<u64>,
    /// Ping times since the keeper's count last moved.
    keeper_still: u32,
}

impl Liveness {
    /// Takes the counts at a ping time: `Ok` when everything moved as it must, else what is
    /// stuck.
    pub(crate) fn observe(
        &mut self,
        workers: Vec<(String, u64)>,
        keeper: u64,
    ) -> Result<(), String> {
        let mut stuck: Vec<String> = workers
            .iter()
            .filter(|(name, beats)| {
                self.workers.iter().any(|(n, before)| n == name && before == beats)
            })
            .map(|(name, _)| format!("data plane thread {name}"))
            .collect();
        self.keeper_still = if self.keeper == Some(keeper) { self.keeper_still + 1 } else { 0 };
        // The driver may wait out one store call (bounded by its budget) between two turns:
        // it is stuck only when it did not turn for a whole watchdog interval (two pings).
        if self.keeper_still >= 2 {
            stuck.push("the lease driver".to_owned());
        }
        self.workers = workers;
        self.keeper = Some(keeper);
        if stuck.is_empty() { Ok(()) } else { Err(stuck.join(", ")) }
    }
}

/// What the service manager is told, while the daemon runs: readiness and status every
/// [`TICK`], the watchdog at half its interval, the fd store whenever the data plane re-binds.
/// Ends at the stop, saying `STOPPING=1`.
pub(super) async fn run(
    health: Arc<Health>,
    lease: Arc<LeaseHealth>,
    dataplane: Option<Arc<Dataplane>>,
    stored_at_start: usize,
    stop: Arc<Stop>,
) {
    if !enabled() {
        return;
    }
    let mut shutdown = stop.subscribe();
    let mut said = LogOnce::default();
    let mut ready = false;
    let mut status = String::new();
    let watchdog = sd_notify::watchdog_enabled().map(|every| (every, every / 2));
    let mut liveness = Liveness::default();
    let mut stuck = LogOnce::default();
    let mut next_ping = tokio::time::Instant::now();
    let mut stored_generation = None;
    let mut stored = stored_at_start;
    if let Some((every, _)) = watchdog {
        info!(
            ?every,
            "systemd's watchdog is on: pinged at half its interval while every part makes progress"
        );
    }
    loop {
        let (now_ready, text) = match health.readiness() {
            Ok(_) => (true, holding(&lease)),
            Err(reasons) => (false, first_reason(&reasons)),
        };
        if now_ready && !ready {
            notify(&[NotifyState::Ready, NotifyState::Status(&text)], &mut said);
            status = text;
        } else if text != status {
            notify(&[NotifyState::Status(&text)], &mut said);
            status = text;
        }
        ready = now_ready;
        if let Some(dp) = &dataplane {
            let generation = dp.generation();
            if stored_generation != Some(generation) {
                stored = store_fds(dp, stored, &mut said);
                stored_generation = Some(generation);
            }
        }
        if let Some((_, half)) = watchdog
            && tokio::time::Instant::now() >= next_ping
        {
            next_ping += half;
            let workers = dataplane.as_ref().map(|dp| dp.progress()).unwrap_or_default();
            match liveness.observe(workers, lease.beats()) {
                Ok(()) => {
                    stuck.clear();
                    notify(&[NotifyState::Watchdog], &mut said);
                }
                Err(what) => {
                    if let Some(p) = stuck.note(format!(
                        "{what} made no progress: not telling systemd's watchdog, which restarts weft"
                    )) {
                        error!("{p}");
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            _ = shutdown.wait_for(|v| *v) => break,
        }
    }
    notify(&[NotifyState::Stopping, NotifyState::Status("stopping")], &mut said);
}

/// The status line while ready.
fn holding(lease: &LeaseHealth) -> String {
    match lease.lease().subnet {
        Some(subnet) => format!("holding {subnet}, forwarding"),
        None => "ready".to_owned(),
    }
}

/// The first reason `/readyz` gives, short enough for a status line.
fn first_reason(reasons: &str) -> String {
    let first = reasons.split("; ").next().unwrap_or(reasons);
    let mut text: String = first.chars().take(200).collect();
    if text.len() < first.len() {
        text.push('…');
    }
    format!("not ready: {text}")
}

/// Puts the data plane's descriptors into the fd store, after removing the `previous` ones
/// stored before (and the layout); returns how many it stored.
fn store_fds(dp: &Dataplane, previous: usize, said: &mut LogOnce) -> usize {
    let handed = match dp.hand_over() {
        Ok(h) => h,
        Err(e) => {
            warn!(error = %e, "could not duplicate the data plane's descriptors for systemd's fd store");
            return previous;
        }
    };
    let layout = match layout_memfd(&handed.layout) {
        Ok(fd) => fd,
        Err(e) => {
            warn!(error = %e, "could not write the data plane's layout for systemd's fd store");
            return previous;
        }
    };
    // The layout first: a store without it is never taken, whatever else it holds.
    let _ = sd_notify::notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(LAYOUT_NAME)]);
    // Names are positions: whatever an earlier process of this service stored under them goes.
    for i in 0..previous.max(handed.fds.len()) {
        let name = format!("{FD_PREFIX}{i}");
        let _ = sd_notify::notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(&name)]);
    }
    let mut sent = 0;
    for (i, fd) in handed.fds.iter().enumerate() {
        let name = format!("{FD_PREFIX}{i}");
        match sd_notify::notify_with_fds(
            &[NotifyState::FdStore, NotifyState::FdName(&name)],
            &[fd.as_fd()],
        ) {
            Ok(()) => sent += 1,
            Err(e) => {
                if let Some(p) =
                    said.note(format!("storing descriptors in systemd's fd store: {e}"))
                {
                    warn!("{p}");
                }
                return sent.max(previous);
            }
        }
    }
    // The layout last: a store that holds it holds every descriptor it names.
    if sd_notify::notify_with_fds(
        &[NotifyState::FdStore, NotifyState::FdName(LAYOUT_NAME)],
        &[layout.as_fd()],
    )
    .is_ok()
    {
        debug!(descriptors = sent, "the data plane's descriptors are in systemd's fd store");
    }
    sent
}

/// A memfd holding `layout` as JSON.
fn layout_memfd(layout: &DataplaneLayout) -> std::io::Result<OwnedFd> {
    let bytes = serde_json::to_vec(layout).map_err(std::io::Error::other)?;
    let fd =
        nix::sys::memfd::memfd_create(c"weft-dp-layout", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(std::io::Error::from)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&bytes)?;
    Ok(OwnedFd::from(file))
}

/// The data plane systemd's fd store gave back at start (`LISTEN_FDS`, `LISTEN_FDNAMES`), if it
/// holds one: its layout and every descriptor it names. Descriptors of other names are closed.
pub(super) fn stored_dataplane() -> Option<HandedDataplane> {
    let listed = match sd_notify::listen_fds_with_names() {
        Ok(l) => l.collect::<Vec<_>>(),
        Err(e) => {
            warn!(error = %e, "LISTEN_FDS does not parse: starting without systemd's fd store");
            return None;
        }
    };
    if listed.is_empty() {
        return None;
    }
    let mut layout = None;
    let mut numbered: Vec<(usize, OwnedFd)> = Vec::new();
    for (raw, name) in listed {
        let Ok(fd) = fds::inherit(raw) else { continue };
        if name == LAYOUT_NAME {
            layout = read_layout(fd);
        } else if let Some(i) = name.strip_prefix(FD_PREFIX).and_then(|n| n.parse().ok()) {
            numbered.push((i, fd));
        }
    }
    let layout = layout?;
    numbered.sort_by_key(|(i, _)| *i);
    if numbered.iter().enumerate().any(|(k, (i, _))| k != *i) {
        warn!("systemd's fd store holds an incomplete data plane: starting afresh");
        return None;
    }
    info!(descriptors = numbered.len(), "taking the data plane from systemd's fd store");
    Some(HandedDataplane { layout, fds: numbered.into_iter().map(|(_, fd)| fd).collect() })
}

fn read_layout(fd: OwnedFd) -> Option<DataplaneLayout> {
    let mut file = std::fs::File::from(fd);
    file.rewind().ok()?;
    let mut bytes = Vec::new();
    file.take(fds::MAX_MESSAGE as u64).read_to_end(&mut bytes).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "the data plane layout in systemd's fd store does not parse");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(counts: &[u64]) -> Vec<(String, u64)> {
        counts.iter().enumerate().map(|(i, c)| (format!("weft-q{i}"), *c)).collect()
    }

    /// The watchdog is told all is well only while every thread moved since the last ping and
    /// the driver moved within two pings; which part is stuck is named.
    #[test]
    fn the_watchdog_is_pinged_only_while_every_part_makes_progress() {
        let mut l = Liveness::default();
        assert_eq!(l.observe(w(&[1, 1]), 1), Ok(()), "the first look has nothing to compare");
        assert_eq!(l.observe(w(&[5, 9]), 2), Ok(()));
        let e = l.observe(w(&[6, 9]), 3).unwrap_err();
        assert_eq!(e, "data plane thread weft-q1");
        assert_eq!(l.observe(w(&[7, 10]), 3), Ok(()), "one ping without a driver turn is fine");
        let e = l.observe(w(&[8, 11]), 3).unwrap_err();
        assert_eq!(e, "the lease driver");
        assert_eq!(l.observe(w(&[9, 12]), 4), Ok(()), "moving again");
        // A thread that appears (restarted under a new name) is not stuck at its first look.
        let mut more = w(&[10, 13]);
        more.push(("weft-q2".to_owned(), 0));
        assert_eq!(l.observe(more, 5), Ok(()));
    }

    #[test]
    fn a_long_reason_is_cut_for_the_status_line() {
        let long = "x".repeat(500);
        let s = first_reason(&format!("{long}; another"));
        assert!(s.starts_with("not ready: xxx") && s.ends_with('…') && s.chars().count() < 220);
        assert_eq!(first_reason("store unreachable; b"), "not ready: store unreachable");
    }
}
