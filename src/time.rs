//! Time for the control plane.
//!
//! The lease keeper never reads a clock: drivers pass `now` in. Drivers read [`BootClock`],
//! which counts time spent suspended (`CLOCK_BOOTTIME`), because etcd's lease TTLs keep running
//! while a host sleeps and `std::time::Instant` (`CLOCK_MONOTONIC`) does not. Tests and the
//! simulation use [`ManualClock`].

use std::ops::{Add, Sub};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A point in time on a monotonic clock that counts suspend, as time since the clock's epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(Duration);

impl Instant {
    /// The clock's epoch (boot, for [`BootClock`]; zero, for [`ManualClock`]).
    pub const ZERO: Self = Self(Duration::ZERO);

    /// An instant `d` after the epoch.
    pub fn from_epoch(d: Duration) -> Self {
        Self(d)
    }

    /// Time since the epoch.
    pub fn since_epoch(self) -> Duration {
        self.0
    }

    /// `self - earlier`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Self) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Instant {
    type Output = Self;
    fn add(self, d: Duration) -> Self {
        Self(self.0.saturating_add(d))
    }
}

impl Sub<Duration> for Instant {
    type Output = Self;
    fn sub(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(d))
    }
}

/// A source of `now`.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// `CLOCK_BOOTTIME`: monotonic, and counts suspend.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootClock;

impl Clock for BootClock {
    fn now(&self) -> Instant {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists on every Linux
        // since 2.6.39, and clock_gettime cannot fail with valid arguments.
        unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        Instant(Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32))
    }
}

/// A clock that moves only when told to. Clones share one time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock at the epoch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_add(nanos, Ordering::SeqCst);
    }

    /// Sets time to `t` (never backwards).
    pub fn set(&self, t: Instant) {
        let nanos = u64::try_from(t.0.as_nanos()).unwrap_or(u64::MAX);
        self.0.fetch_max(nanos, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant(Duration::from_nanos(self.0.load(Ordering::SeqCst)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_clock_moves_forward() {
        let a = BootClock.now();
        let b = BootClock.now();
        assert!(b >= a);
        assert!(a.since_epoch() > Duration::ZERO);
    }

    #[test]
    fn manual_clock_is_shared_and_never_goes_back() {
        let c = ManualClock::new();
        let d = c.clone();
        c.advance(Duration::from_secs(3));
        assert_eq!(d.now(), Instant::from_epoch(Duration::from_secs(3)));
        d.set(Instant::from_epoch(Duration::from_secs(1)));
        assert_eq!(c.now(), Instant::from_epoch(Duration::from_secs(3)));
    }
}
