//! When a UDP socket that had to turn GSO off tries it again: a pure policy over `now`.
//!
//! A GSO send can fail although the kernel supports `UDP_SEGMENT`, because of the path the
//! message takes: a segment larger than the path MTU (`EMSGSIZE`; `EINVAL` on kernels without
//! the 2025 fix "udp: gso: do not drop small packets when PMTU reduces"), an IPsec policy on
//! the route (`EIO`) or, before Linux 6.11, an egress device without checksum offload (`EIO`).
//! Such conditions come and go (a learned path MTU expires, an operator puts the MTU or the
//! offload back), so a failure turns GSO off *for now*: the socket sends single datagrams
//! (which the kernel fragments or checksums as needed) until a retry time, then tries GSO
//! again.
//!
//! # Contract
//! - **Pure.** Every method that depends on time takes `now`; nothing reads a clock, does I/O,
//!   allocates or logs. The socket ([`super::BatchSocket`]) asks and reports; its owner
//!   logs and counts the transitions.
//! - **States.** [`GsoState::On`]: GSO is used. [`GsoState::Off`]: a GSO send failed; single
//!   datagrams until `until`. [`GsoState::Retrying`]: the retry time came ([`GsoRetry::poll`]);
//!   GSO is used again, unconfirmed, until a GSO send succeeds ([`GsoRetry::succeeded`]: back
//!   to `On`) or fails ([`GsoRetry::failed`]: `Off` again).
//! - **Backoff.** A failure while `On` turns GSO off for [`GsoRetryConfig::initial`]; each failed
//!   retry doubles the previous wait, up to [`GsoRetryConfig::max`]; a retry that succeeds
//!   resets the wait, so the next failure waits `initial` again.
//! - **Time.** `until` is `now + wait`, saturating; a `now` earlier than the last one (which a
//!   boot-time clock never gives) only delays the retry, it never brings it forward.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::time::Instant;

/// How long GSO stays off after the first failure, by default.
pub(crate) const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);
/// The longest GSO stays off between retries, by default.
pub(crate) const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// The shortest wait: a zero wait would double to zero and retry on every send.
pub(crate) const MIN_RETRY_AFTER: Duration = Duration::from_millis(1);

/// The backoff: the first wait and the cap that doubling stops at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GsoRetryConfig {
    /// How long GSO stays off after a failure while it was on.
    pub(crate) initial: Duration,
    /// The longest wait; at least `initial` (see [`GsoRetryConfig::new`]).
    pub(crate) max: Duration,
}

impl GsoRetryConfig {
    /// A first wait of `initial` (at least [`MIN_RETRY_AFTER`]), doubling up to
    /// [`DEFAULT_MAX_RETRY_AFTER`], or up to `initial` if that is longer.
    pub(crate) fn new(initial: Duration) -> Self {
        let initial = initial.max(MIN_RETRY_AFTER);
        Self { initial, max: DEFAULT_MAX_RETRY_AFTER.max(initial) }
    }

    /// The same first wait, doubling up to `max` (or `initial`, if that is longer).
    pub(crate) fn with_max(self, max: Duration) -> Self {
        Self { max: max.max(self.initial), ..self }
    }
}

impl Default for GsoRetryConfig {
    fn default() -> Self {
        Self::new(DEFAULT_RETRY_AFTER)
    }
}

/// Where a socket's GSO stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GsoState {
    /// GSO is used, and the last GSO send (if any) went through.
    On,
    /// A GSO send failed: single datagrams until `until`.
    Off {
        /// When GSO is tried again.
        until: Instant,
    },
    /// The retry time came: GSO is used again, not yet confirmed by a successful send.
    Retrying,
}

/// One socket's GSO retry state (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GsoRetry {
    cfg: GsoRetryConfig,
    state: GsoState,
    /// The wait GSO was last turned off for; what a failed retry doubles.
    wait: Duration,
}

impl GsoRetry {
    /// GSO on, nothing failed yet.
    pub(crate) fn new(cfg: GsoRetryConfig) -> Self {
        let cfg = GsoRetryConfig::new(cfg.initial).with_max(cfg.max);
        Self { cfg, state: GsoState::On, wait: cfg.initial }
    }

    /// The backoff it was made with (normalized as [`GsoRetryConfig::new`] does).
    #[cfg(test)]
    pub(crate) fn config(&self) -> GsoRetryConfig {
        self.cfg
    }

    /// The current state.
    pub(crate) fn state(&self) -> GsoState {
        self.state
    }

    /// Whether sends should use GSO now: on, or retrying.
    pub(crate) fn uses_gso(&self) -> bool {
        !matches!(self.state, GsoState::Off { .. })
    }

    /// Whether GSO is on and confirmed (not off, not an unconfirmed retry).
    #[cfg(test)]
    pub(crate) fn is_on(&self) -> bool {
        self.state == GsoState::On
    }

    /// Call before a send at `now`: once the retry time has come, GSO is tried again. Returns
    /// true when this call started a retry (for the caller to count).
    pub(crate) fn poll(&mut self, now: Instant) -> bool {
        match self.state {
            GsoState::Off { until } if now >= until => {
                self.state = GsoState::Retrying;
                true
            }
            _ => false,
        }
    }

    /// A GSO send failed at `now` in a way single datagrams avoid: GSO is off until the
    /// returned instant. From `On` the wait is [`GsoRetryConfig::initial`]; from `Retrying`, twice
    /// the previous wait, capped. A failure reported while already off changes nothing (no GSO
    /// send should have been made).
    pub(crate) fn failed(&mut self, now: Instant) -> Instant {
        let wait = match self.state {
            GsoState::Off { until } => return until,
            GsoState::On => self.cfg.initial,
            GsoState::Retrying => self.wait.saturating_mul(2).min(self.cfg.max),
        };
        self.wait = wait;
        let until = now + wait;
        self.state = GsoState::Off { until };
        until
    }

    /// A GSO send went through. Returns true when that confirmed a retry (GSO works again):
    /// the state is `On` and the next failure waits [`GsoRetryConfig::initial`] again.
    pub(crate) fn succeeded(&mut self) -> bool {
        if self.state != GsoState::Retrying {
            return false;
        }
        self.state = GsoState::On;
        self.wait = self.cfg.initial;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn at(secs: u64) -> Instant {
        Instant::from_epoch(Duration::from_secs(secs))
    }

    fn off_until(secs: u64) -> GsoState {
        GsoState::Off { until: at(secs) }
    }

    #[test]
    fn a_new_socket_uses_gso_and_polling_changes_nothing() {
        let mut r = GsoRetry::new(GsoRetryConfig::default());
        assert_eq!(r.state(), GsoState::On);
        assert!(r.uses_gso() && r.is_on());
        assert!(!r.poll(at(1_000_000)));
        assert!(!r.succeeded(), "a success while on confirms nothing");
        assert_eq!(r.state(), GsoState::On);
    }

    #[test]
    fn a_failure_turns_gso_off_until_the_retry_time_then_a_retry_starts_once() {
        let mut r = GsoRetry::new(GsoRetryConfig::new(30 * S));
        assert_eq!(r.failed(at(100)), at(130));
        assert_eq!(r.state(), off_until(130));
        assert!(!r.uses_gso() && !r.is_on());
        assert!(!r.poll(at(100)));
        assert!(!r.poll(at(129)), "one second early");
        assert!(!r.uses_gso());
        assert!(r.poll(at(130)), "on time");
        assert_eq!(r.state(), GsoState::Retrying);
        assert!(r.uses_gso() && !r.is_on(), "used again, not yet confirmed");
        assert!(!r.poll(at(131)), "a retry starts once");
    }

    #[test]
    fn each_failed_retry_doubles_the_wait_up_to_the_cap() {
        let mut r = GsoRetry::new(GsoRetryConfig::new(30 * S));
        let mut now = at(0);
        let mut waits = Vec::new();
        let mut until = r.failed(now);
        for _ in 0..12 {
            waits.push(until.saturating_since(now).as_secs());
            now = until;
            assert!(r.poll(now));
            until = r.failed(now);
        }
        assert_eq!(waits, [30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600, 3600, 3600]);
    }

    #[test]
    fn a_successful_retry_turns_gso_on_and_resets_the_wait() {
        let mut r = GsoRetry::new(GsoRetryConfig::new(30 * S));
        r.failed(at(0));
        assert!(r.poll(at(30)));
        assert_eq!(r.failed(at(30)), at(90), "60 s after a failed retry");
        assert!(r.poll(at(90)));
        assert!(r.succeeded(), "the retry worked: GSO works again");
        assert_eq!(r.state(), GsoState::On);
        assert!(!r.succeeded(), "confirmed once");
        assert_eq!(r.failed(at(1000)), at(1030), "the next failure waits the first wait again");
    }

    #[test]
    fn a_failure_reported_while_off_changes_nothing() {
        let mut r = GsoRetry::new(GsoRetryConfig::new(30 * S));
        r.failed(at(0));
        assert_eq!(r.failed(at(10)), at(30));
        assert!(!r.succeeded());
        assert_eq!(r.state(), off_until(30));
        assert!(r.poll(at(30)));
        assert_eq!(r.failed(at(30)), at(90), "the failed retry doubles 30, not 0 or 20");
    }

    #[test]
    fn the_cap_and_the_first_wait_are_sane_whatever_is_asked() {
        // A first wait longer than the default cap is the cap.
        let c = GsoRetryConfig::new(2 * 3600 * S);
        assert_eq!((c.initial, c.max), (2 * 3600 * S, 2 * 3600 * S));
        // Zero is raised to the minimum, so doubling moves...
        let mut r = GsoRetry::new(GsoRetryConfig { initial: Duration::ZERO, max: 3600 * S });
        let t0 = at(5);
        assert_eq!(r.failed(t0), t0 + MIN_RETRY_AFTER);
        assert!(r.poll(t0 + MIN_RETRY_AFTER));
        assert_eq!(r.failed(t0 + MIN_RETRY_AFTER), t0 + 3 * MIN_RETRY_AFTER, "1 ms, then 2 ms");
        // ... and a zero cap is the first wait: every retry a millisecond after the last.
        let mut r = GsoRetry::new(GsoRetryConfig { initial: Duration::ZERO, max: Duration::ZERO });
        assert_eq!(r.failed(t0), t0 + MIN_RETRY_AFTER);
        assert!(r.poll(t0 + MIN_RETRY_AFTER));
        assert_eq!(r.failed(t0 + MIN_RETRY_AFTER), t0 + 2 * MIN_RETRY_AFTER);
        // A cap below the first wait is raised to it.
        assert_eq!(GsoRetryConfig::new(10 * S).with_max(S).max, 10 * S);
        assert_eq!(GsoRetryConfig::default(), GsoRetryConfig::new(30 * S));
        assert_eq!(GsoRetryConfig::default().max, 3600 * S);
    }

    #[test]
    fn the_ends_of_time_saturate() {
        let end = Instant::from_epoch(Duration::MAX);
        let mut r = GsoRetry::new(GsoRetryConfig::new(Duration::MAX));
        assert_eq!(r.failed(end), end);
        assert!(r.poll(end));
        assert_eq!(r.failed(end), end, "Duration::MAX doubled saturates");
    }

    #[test]
    fn time_going_backwards_never_brings_a_retry_forward() {
        let mut r = GsoRetry::new(GsoRetryConfig::new(30 * S));
        r.failed(at(100));
        assert!(!r.poll(at(50)));
        assert!(!r.poll(at(129)));
        assert!(r.poll(at(130)));
    }
}
