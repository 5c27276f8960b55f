//! One weft per state dir and per TUN device.
//!
//! A second `weft run` with the same `--state-dir` (the same node identity) or the same
//! `--tun-name` must not start beside a running one: it would attach queues of the same
//! multi-queue TUN device, share the backend port and write the same lease. So `weft run`
//! first takes [`StateDirLock`], an exclusive `flock(2)` on `<state-dir>/lock` (which names
//! the holder's PID), and, before it opens the TUN device, makes sure no process has that
//! device attached ([`crate::dataplane::Host::device_in_use`]). While either is taken
//! it waits, not ready, and retries every second ([`wait_while_busy`]).
//!
//! Why these two checks and not a lock keyed on the TUN name: a file under `/run/weft` needs a
//! directory a non-root weft (only `CAP_NET_ADMIN`) may not be able to create, and an abstract
//! unix socket `@weft-tun-<name>` can be bound first by any local user, who would then keep
//! weft waiting forever. The state dir is weft's own, and whether the TUN device has queues
//! attached is asked of the kernel (`RTM_GETLINK`, which needs no privilege), so neither can
//! be squatted by a user who could not already run weft. Both locks die with their process:
//! the kernel releases a `flock` and detaches a TUN queue when the file is closed, however the
//! process ends.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::lease::status::{LeaseHealth, LeaseStatus};

/// The lock file's name in the state dir.
pub(crate) const LOCK_FILE: &str = "lock";

/// How often a waiting weft tries again.
pub(crate) const RETRY: Duration = Duration::from_secs(1);

/// Why the state dir could not be locked (other than another weft holding it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    /// The state dir or the lock file could not be created or opened.
    #[error("opening {path}: {source}")]
    Open {
        /// The lock file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `flock` failed other than with `EWOULDBLOCK`.
    #[error("locking {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The error.
        #[source]
        source: Errno,
    },
}

/// An exclusive lock on `<state-dir>/lock`, held until dropped (or the process ends).
#[derive(Debug)]
pub(crate) struct StateDirLock {
    _file: Flock<File>,
}

/// The outcome of [`StateDirLock::try_acquire`].
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Ours now; the file holds our PID.
    Acquired(StateDirLock),
    /// Another process holds it; the PID it wrote, if it could be read.
    Held {
        /// The lock file.
        path: PathBuf,
        /// The holder's PID.
        pid: Option<u32>,
    },
}

impl StateDirLock {
    /// Tries once, without blocking, to lock `<state_dir>/lock` (creating the dir and the
    /// file as needed); on success writes this process's PID into it.
    ///
    /// # Errors
    /// [`LockError`] when the file cannot be opened or `flock` fails for another reason than
    /// the lock being held.
    pub(crate) fn try_acquire(state_dir: &Path) -> Result<Attempt, LockError> {
        let path = state_dir.join(LOCK_FILE);
        let open_err = |source| LockError::Open { path: path.clone(), source };
        crate::atomic_file::create_dir(state_dir, crate::atomic_file::PRIVATE_DIR_MODE)
            .map_err(|e| open_err(e.source))?;
        // O_NOFOLLOW: the PID is written into it, never into a file a symlink points at.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(open_err)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut locked) => {
                // Best effort: the PID only makes the other process's message better.
                let pid = std::process::id();
                let _ = locked
                    .set_len(0)
                    .and_then(|()| locked.seek(SeekFrom::Start(0)))
                    .and_then(|_| writeln!(locked, "{pid}"));
                Ok(Attempt::Acquired(Self { _file: locked }))
            }
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let pid =
                    file.read_to_string(&mut text).ok().and_then(|_| text.trim().parse().ok());
                Ok(Attempt::Held { path, pid })
            }
            Err((_, source)) => Err(LockError::Lock { path, source }),
        }
    }
}

impl StateDirLock {
    /// A second descriptor of the lock (the same open file, so the same lock), for the next
    /// process of this node (an upgrade).
    pub(crate) fn duplicate(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd as _;
        self._file.as_fd().try_clone_to_owned()
    }

    /// Holds the lock a previous process of this node handed over (a descriptor of the same
    /// open file: `flock` on it is the same lock, so it never lapses), and writes this
    /// process's PID into it.
    pub(crate) fn adopt(fd: std::os::fd::OwnedFd, state_dir: &Path) -> Result<Self, LockError> {
        let path = state_dir.join(LOCK_FILE);
        match Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock) {
            Ok(mut locked) => {
                let pid = std::process::id();
                let _ = locked
                    .set_len(0)
                    .and_then(|()| locked.seek(SeekFrom::Start(0)))
                    .and_then(|_| writeln!(locked, "{pid}"));
                Ok(Self { _file: locked })
            }
            Err((_, source)) => Err(LockError::Lock { path, source }),
        }
    }

    /// Lets the lock go to the next process without releasing it: dropping it would unlock
    /// the open file, which the next process shares. The descriptor closes when this process
    /// ends.
    pub(crate) fn leave_to_successor(self) {
        std::mem::forget(self);
    }
}

/// The message for a state dir held by another weft.
pub(crate) fn held_message(path: &Path, pid: Option<u32>) -> String {
    let pid = pid.map_or_else(|| "pid unknown".to_owned(), |p| format!("pid {p}"));
    format!("another weft holds {} ({pid}); waiting for it to exit", path.display())
}

/// Calls `check` every [`RETRY`] until it returns `Ok(None)` (free: returns `Ok(true)`) or
/// `shutdown` fires (returns `Ok(false)`). While `check` returns `Ok(Some(reason))`, `/readyz`
/// answers 503 with `reason`, and each new reason is logged once at WARN. Errors from `check`
/// end the wait.
pub(crate) async fn wait_while_busy(
    health: &LeaseHealth,
    shutdown: &mut watch::Receiver<bool>,
    mut check: impl FnMut() -> anyhow::Result<Option<String>>,
) -> anyhow::Result<bool> {
    let mut last: Option<String> = None;
    loop {
        if *shutdown.borrow() {
            return Ok(false);
        }
        match check()? {
            None => {
                if let Some(reason) = last {
                    info!(was = %reason, "no longer waiting");
                    health.set_lease(LeaseStatus { state: "starting", ..Default::default() });
                }
                return Ok(true);
            }
            Some(reason) => {
                if last.as_deref() != Some(reason.as_str()) {
                    warn!("{reason}");
                    health.set_lease(LeaseStatus {
                        state: "starting",
                        not_ready: Some(reason.clone()),
                        ..Default::default()
                    });
                    last = Some(reason);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = shutdown.changed() => return Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// `flock` locks belong to an open file description: a second open of the same file, in
    /// this very process, is refused as another process would be.
    #[test]
    fn a_second_lock_on_the_state_dir_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let Attempt::Acquired(first) = StateDirLock::try_acquire(&state).unwrap() else {
            panic!("a fresh state dir is free");
        };
        assert!(state.join(LOCK_FILE).is_file());
        let text = fs::read_to_string(state.join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        match StateDirLock::try_acquire(&state).unwrap() {
            Attempt::Held { path, pid } => {
                assert_eq!(pid, Some(std::process::id()));
                let msg = held_message(&path, pid);
                assert!(msg.starts_with("another weft holds "), "{msg}");
                assert!(
                    msg.ends_with(&format!(
                        "/state/lock (pid {}); waiting for it to exit",
                        std::process::id()
                    )),
                    "{msg}"
                );
            }
            Attempt::Acquired(_) => panic!("locked twice"),
        }
        drop(first);
        assert!(matches!(StateDirLock::try_acquire(&state).unwrap(), Attempt::Acquired(_)));
    }

    #[test]
    fn a_stale_lock_file_from_a_dead_process_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(LOCK_FILE), "999999999\nrubbish that is longer\n").unwrap();
        let Attempt::Acquired(_lock) = StateDirLock::try_acquire(dir.path()).unwrap() else {
            panic!("nobody holds the lock");
        };
        let text = fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
    }

    #[test]
    fn held_message_without_a_pid() {
        let msg = held_message(Path::new("/var/lib/weft/lock"), None);
        assert_eq!(
            msg,
            "another weft holds /var/lib/weft/lock (pid unknown); waiting for it to exit"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_is_not_ready_with_the_reason_until_free() {
        use crate::time::ManualClock;
        let health = LeaseHealth::new(std::sync::Arc::new(ManualClock::new()));
        let (_tx, mut rx) = watch::channel(false);
        let mut calls = 0;
        let mut seen = Vec::new();
        let free = wait_while_busy(&health, &mut rx, || {
            calls += 1;
            seen.push(health.readiness());
            Ok((calls < 4).then(|| "busy".to_owned()))
        })
        .await
        .unwrap();
        assert!(free);
        assert_eq!(calls, 4);
        assert_eq!(seen[1], Err("busy".to_owned()));
        assert_eq!(seen[3], Err("busy".to_owned()));
        assert_eq!(health.readiness(), Err("no lease held (starting)".to_owned()));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_ends_on_shutdown() {
        use crate::time::ManualClock;
        let health = LeaseHealth::new(std::sync::Arc::new(ManualClock::new()));
        let (tx, mut rx) = watch::channel(false);
        let stopper = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let _ = tx.send(true);
        });
        let free = wait_while_busy(&health, &mut rx, || Ok(Some("busy".to_owned()))).await.unwrap();
        assert!(!free);
        stopper.await.unwrap();
    }
}
