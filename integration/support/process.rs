//! How every child process of the harness (etcd, `weft run`, helpers in namespaces) is started:
//! one place for the parent-death signal.

use std::os::unix::process::CommandExt;
use std::process::Command;

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
