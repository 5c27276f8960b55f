//! The process's limit on open file descriptors (`RLIMIT_NOFILE`).
//!
//! `weft run` raises its soft limit to the hard limit once at start ([`raise_nofile_limit`]),
//! as Go's runtime does for flanneld. The soft limit (often 1,024) is kept low for programs
//! that use `select(2)`, which weft does not (tokio, mio and the workers use epoll); left there,
//! a burst of sockets (etcd reconnections, health connections, re-binds) could make a write that
//! keeps the lease honest (`subnet.env`, a state file, the hook journal) fail with `EMFILE`. The
//! hard limit is the operator's and is never changed; a failure to raise is logged, never fatal.
//!
//! Hooks inherit the raised soft limit, as every child of weft does.

#![forbid(unsafe_code)]

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tracing::{info, warn};

/// The soft `RLIMIT_NOFILE` before and after [`raise_nofile_to_hard`], and the hard limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NofileRaise {
    /// The soft limit found.
    pub old_soft: u64,
    /// The soft limit now (the hard limit, unless it was there already).
    pub new_soft: u64,
    /// The hard limit (unchanged).
    pub hard: u64,
}

/// Sets the soft `RLIMIT_NOFILE` to the hard limit (if it is lower); what it was and is (read
/// back from the kernel).
pub fn raise_nofile_to_hard() -> nix::Result<NofileRaise> {
    let (old_soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if old_soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (new_soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    Ok(NofileRaise { old_soft, new_soft, hard })
}

/// [`raise_nofile_to_hard`] for `weft run`'s start: logs the old and new soft limit at INFO, or
/// a WARN when the limit cannot be read or set (weft then runs with the limit it has).
pub fn raise_nofile_limit() {
    match raise_nofile_to_hard() {
        Ok(r) if r.new_soft > r.old_soft => info!(
            old_soft = r.old_soft,
            new_soft = r.new_soft,
            hard = r.hard,
            "open file limit (RLIMIT_NOFILE): soft limit raised to the hard limit"
        ),
        Ok(r) => info!(
            old_soft = r.old_soft,
            new_soft = r.new_soft,
            hard = r.hard,
            "open file limit (RLIMIT_NOFILE): the soft limit is already the hard limit"
        ),
        Err(e) => warn!(
            error = %e,
            "could not raise the soft open file limit (RLIMIT_NOFILE); keeping it"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;
    use std::process::Command;

    use nix::fcntl::{FcntlArg, fcntl};

    use super::*;

    /// Set in the child process that [`the_soft_limit_is_raised_to_the_hard_limit`] starts.
    const CHILD: &str = "WEFT_RLIMIT_TEST_CHILD";

    /// In a child process (this test binary again, running this test alone), so that the test
    /// process's own limit is left as it was: with the soft limit lowered, a descriptor numbered
    /// at the old soft limit cannot be had; after the raise the soft limit is the hard one (the
    /// hard one unchanged) and it can.
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_limit() {
        if std::env::var_os(CHILD).is_some() {
            let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
            assert!(hard >= 128, "a hard limit of {hard} is too low for this test");
            // Far below the hard limit, but not so high that a descriptor numbered there costs
            // a large table.
            let low = (hard / 2).min(4096);
            setrlimit(Resource::RLIMIT_NOFILE, low, hard).unwrap();
            let fd_number = i32::try_from(low).unwrap();
            let stdin = std::io::stdin();
            assert!(fcntl(stdin.as_fd(), FcntlArg::F_DUPFD(fd_number)).is_err());

            let r = raise_nofile_to_hard().unwrap();
            assert_eq!(r, NofileRaise { old_soft: low, new_soft: hard, hard });
            assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
            let dup = fcntl(stdin.as_fd(), FcntlArg::F_DUPFD(fd_number)).unwrap();
            assert!(dup >= fd_number);
            nix::unistd::close(dup).unwrap();
            // Already at the hard limit: nothing changes.
            assert_eq!(raise_nofile_to_hard().unwrap(), NofileRaise { old_soft: hard, ..r });
            return;
        }
        let name = "rlimit::tests::the_soft_limit_is_raised_to_the_hard_limit";
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads", "1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "the child failed:\n{text}");
        assert!(text.contains("1 passed"), "the child did not run the test:\n{text}");
    }
}
