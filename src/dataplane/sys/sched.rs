//! A forwarding thread's scheduling: a short EEVDF slice, so that a woken thread runs at once.
//!
//! # Why
//! A packet waits for the thread that forwards it to be woken and put on a CPU. On a host whose
//! CPUs are busy (pods, builds, the traffic's own applications) that second part dominates an
//! idle round trip: the woken thread queues behind whatever runs there until the scheduler
//! preempts it, up to a whole slice of the default 0.75 ms (times 1 + log2 of the CPUs). The
//! kernel's own data path (softirq) never waits so. Linux 6.12's EEVDF scheduler takes a
//! per-thread slice request (`sched_attr.sched_runtime` for a `SCHED_OTHER` thread) and lets a
//! waking thread with a shorter slice than the running one preempt it. The slice changes when a
//! thread runs, not how much: its weight (nice value) and so its share of a busy CPU stay the
//! same, and a thread that runs flat out (bulk traffic) is merely switched a little more often.
//!
//! # Contract
//! [`shorten_slice`] sets the calling thread's slice, keeping its policy and nice value; it is
//! called once by each forwarding thread as it starts. On kernels before 6.12 (which refuse a
//! `sched_runtime` for `SCHED_OTHER`, `EINVAL`) or under another policy it changes nothing and
//! says why; the caller logs that once. The one `unsafe` block here is the two syscalls.

use std::io;
use std::time::Duration;

/// `struct sched_attr` (include/uapi/linux/sched/types.h), its first version with the
/// utilization clamps: 56 bytes.
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

const SCHED_OTHER: u32 = 0;

/// Why [`shorten_slice`] changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SliceError {
    /// The thread runs under another policy (a real-time one set by the operator): left alone.
    #[error("the thread's scheduling policy is {0}, not SCHED_OTHER: left as it is")]
    NotFair(u32),
    /// The kernel refused (before Linux 6.12, `EINVAL`: no per-thread slices).
    #[error("sched_setattr: {0} (per-thread slices need Linux 6.12)")]
    Refused(io::Error),
    /// Reading the thread's attributes failed.
    #[error("sched_getattr: {0}")]
    Get(io::Error),
}

/// Asks the scheduler to run the calling thread in slices of `slice` (see the module docs),
/// keeping its policy, nice value and flags.
pub(crate) fn shorten_slice(slice: Duration) -> Result<(), SliceError> {
    let size = std::mem::size_of::<SchedAttr>() as u32;
    let mut attr = SchedAttr { size, ..SchedAttr::default() };
    // SAFETY: sched_getattr writes at most `size` bytes into `attr`, a live, writable
    // `repr(C)` struct of exactly that size; pid 0 is the calling thread.
    let got = unsafe {
        libc::syscall(libc::SYS_sched_getattr, 0, &raw mut attr, size as libc::c_uint, 0)
    };
    if got != 0 {
        return Err(SliceError::Get(io::Error::last_os_error()));
    }
    if attr.sched_policy != SCHED_OTHER {
        return Err(SliceError::NotFair(attr.sched_policy));
    }
    attr.size = size;
    attr.sched_runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: sched_setattr reads `size` bytes from `attr`, a live `repr(C)` struct of exactly
    // that size, filled by sched_getattr above; pid 0 is the calling thread.
    let set = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attr, 0) };
    if set != 0 {
        return Err(SliceError::Refused(io::Error::last_os_error()));
    }
    Ok(())
}

/// The calling thread's slice as the kernel keeps it (`sched_runtime` of `sched_getattr`), for
/// tests.
#[cfg(test)]
fn current_slice() -> io::Result<Duration> {
    let size = std::mem::size_of::<SchedAttr>() as u32;
    let mut attr = SchedAttr { size, ..SchedAttr::default() };
    // SAFETY: as in shorten_slice.
    let got = unsafe {
        libc::syscall(libc::SYS_sched_getattr, 0, &raw mut attr, size as libc::c_uint, 0)
    };
    if got != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Duration::from_nanos(attr.sched_runtime))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `weft run`'s default `--worker-slice`: the shortest the kernel takes (0.1–100 ms).
    const FORWARDING_SLICE: Duration = Duration::from_micros(100);

    #[test]
    fn the_attr_struct_is_the_kernels_first_version_with_clamps() {
        assert_eq!(std::mem::size_of::<SchedAttr>(), 56);
    }

    /// On a kernel with per-thread slices the thread keeps the one asked for, and its nice
    /// value is unchanged; on an older one the call says so and changes nothing.
    #[test]
    fn a_thread_gets_the_slice_it_asks_for_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // SAFETY: getpriority has no memory arguments.
            let nice = || unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            let before = nice();
            match shorten_slice(FORWARDING_SLICE) {
                Ok(()) => assert_eq!(current_slice().unwrap(), FORWARDING_SLICE),
                Err(SliceError::Refused(e)) => assert_eq!(e.raw_os_error(), Some(libc::EINVAL)),
                Err(e) => panic!("{e}"),
            }
            assert_eq!(nice(), before);
        })
        .join()
        .unwrap();
    }
}
