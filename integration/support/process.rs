//! How every child process of the harness (etcd, `weft run`, helpers in namespaces) is started:
//! one place for the parent-death signal, and the door to the scripts' shell libraries.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::prctl;
use nix::sys::signal::Signal;

/// Sets `PR_SET_PDEATHSIG` (SIGKILL) in the child before exec, so that it dies with the thread
/// that spawned it even if the test never reaches its `Drop` (a panic in another thread, a
/// killed test binary). Death signals follow the *thread*: spawn from the test's own thread.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs between fork and exec; it makes one prctl(2) call, which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
            Ok(())
        })
    }
}

/// The scripts' shell libraries: the lab's topology (`netns.sh`), etcd's command line
/// (`etcd.sh`), a kernel flannel node (`flannel.sh`) and pods (`cni.sh`). The demo, the bench
/// and the chaos soak source them; the harness runs their functions ([`lib_command`]), so each
/// is written once.
pub const SCRIPT_LIB: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/lib");

/// `FUNCTION ARGS...` from `scripts/lib/<lib>`, run by bash with errexit, nounset and pipefail
/// on, as the scripts run them (so a function stops at its first failing command). Not
/// started; spawn it with [`die_with_parent`] ([`Daemon::start`] and [`run_command`] do).
pub fn lib_command<S: AsRef<OsStr>>(lib: &str, function: &str, args: &[S]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.args(["-c", "set -euo pipefail; . \"$0\"; \"$@\""])
        .arg(Path::new(SCRIPT_LIB).join(lib))
        .arg(function)
        .args(args);
    cmd
}

/// Runs `FUNCTION ARGS...` from `scripts/lib/<lib>` ([`lib_command`]); must succeed; its stdout.
pub fn lib_run<S: AsRef<OsStr>>(lib: &str, function: &str, args: &[S]) -> String {
    run_command(&mut lib_command(lib, function, args))
}

/// Runs `cmd` to completion (stdin null, [`die_with_parent`]); must succeed; its stdout.
///
/// # Panics
/// If it cannot be run or fails: with its stdout and stderr in the message.
pub fn run_command(cmd: &mut Command) -> String {
    cmd.stdin(Stdio::null());
    let out = die_with_parent(cmd).output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A daemon a test starts, signals and stops (`weft run`, in the root namespace or a namespace
/// host): one place for how a test controls a process. Not running until [`Daemon::start`];
/// dropping it kills and reaps the process.
#[derive(Debug, Default)]
pub struct Daemon(Option<std::process::Child>);

impl Daemon {
    /// Spawns `cmd` with [`die_with_parent`].
    ///
    /// # Panics
    /// If it is running already, or cannot be spawned.
    pub fn start(&mut self, cmd: &mut Command) {
        assert!(self.0.is_none(), "{cmd:?}: already running");
        let child = die_with_parent(cmd).spawn();
        self.0 = Some(child.unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}")));
    }

    /// The child's stderr, when it was spawned with `Stdio::piped()` (taken once).
    pub fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.0.as_mut().and_then(|c| c.stderr.take())
    }

    /// Whether it was started and not killed or stopped since (it may have exited).
    pub fn started(&self) -> bool {
        self.0.is_some()
    }

    /// The process ID. Panics if it is not started.
    pub fn pid(&self) -> i32 {
        self.0.as_ref().map(|c| c.id() as i32).expect("daemon running")
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: Signal) {
        // An exited child that is not reaped yet still has its PID: the signal goes nowhere.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), signal);
    }

    /// SIGSTOP: the host is suspended.
    pub fn suspend(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// SIGCONT: the host resumes.
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// SIGKILL and reap (a crash: nothing is released). A suspended process is continued
    /// first, so that it dies at once.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), Signal::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait up to 10 s for the exit; its exit code (`None`: not started, or killed
    /// by a signal).
    ///
    /// # Panics
    /// If it does not exit in time: with `log()` (what it wrote) in the message.
    pub fn stop(&mut self, log: impl FnOnce() -> String) -> Option<i32> {
        let mut c = self.0.take()?;
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("{c:?} did not exit within 10 s of SIGTERM:\n{}", log());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.0.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}
