//! Whether a forwarding thread that just found its queues empty keeps looking a little longer
//! instead of going to sleep: an adaptive, bounded busy-poll for request/response traffic.
//!
//! # Why
//! An idle round trip through weft costs about three wake-ups of a sleeping thread, about
//! 100 µs each on a VM (README, "Where an idle round trip goes"). When a small request has
//! just gone out, its reply often comes back within tens of microseconds; a thread that keeps
//! looking for that long picks the reply up without sleeping and without being woken. A fixed
//! spin after every batch was measured and not landed: it took the CPU that bulk traffic and
//! the peer needed. This policy spins only where spinning pays, and never for long:
//!
//! - **Only after small steps.** A step that moved at most [`SMALL_STEP_BYTES`] (a request, a
//!   reply, a few ACKs) arms a spin; a bulk step (a TSO super-packet, a full batch) does not,
//!   since more bulk traffic wakes the thread anyway, and a bulk host's CPU is better left to
//!   the kernel and the applications.
//! - **At most `max` a spin.**
//! - **Backing off on misses.** A spin that ends with nothing found (the traffic was not
//!   request/response, or the other side is slow) makes the next `1, 2, 4, …,`
//!   [`MAX_BACKOFF`] small steps go to sleep without spinning; a spin that finds work ends
//!   the back-off. A thread that sees a ping every 50 ms thus spins once in 64 pings.
//! - **A CPU budget.** Spinning spends at most [`SPIN_SHARE_PERCENT`] of the thread's time,
//!   counted in a bucket of at most [`CREDIT_CAP`]: whatever the traffic, the thread leaves
//!   the rest of its core to the host. A spin cut short by the budget is not a miss.
//!
//! # Contract
//! Pure: the caller passes `now` and what each step moved; no clock, no I/O. The loop calls
//! [`SpinPolicy::worked`] after every step that moved something and
//! [`SpinPolicy::keep_looking`] after every step that moved nothing; [`Next::Sleep`] from the
//! latter means "sleep now" (the caller then waits in its [`super::Idle`]). Both say how a
//! spin ended ([`SpinEnd`]) when one did, for the caller to count.

use std::time::Duration;

use crate::dataplane::worker::counters::SpinEnd;
use crate::time::Instant;

/// A step that moved at most this many bytes (both directions together) looks like
/// request/response traffic and arms a spin: a few small messages or ACKs, or one full-size
/// packet. A TSO super-packet or a batch of full-size packets is bulk.
pub(crate) const SMALL_STEP_BYTES: usize = 4096;

/// The longest back-off, in small steps let go to sleep without a spin.
pub(crate) const MAX_BACKOFF: u32 = 64;

/// The share of the thread's time that spinning may take, in percent.
pub(crate) const SPIN_SHARE_PERCENT: u32 = 50;

/// The most spin time a thread can save up while it does not spin.
pub(crate) const CREDIT_CAP: Duration = Duration::from_millis(2);

/// What a loop that found nothing to do does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Look at the queues again without sleeping.
    Spin,
    /// Sleep; `ended` says how the spin under way ended, if one was.
    Sleep {
        /// The outcome of the spin that just ended.
        ended: Option<SpinEnd>,
    },
}

/// One forwarding thread's spin state; see the module docs.
#[derive(Clone, Debug)]
pub(crate) struct SpinPolicy {
    /// The longest spin; zero turns spinning off.
    max: Duration,
    /// The last step that moved something was small.
    armed: bool,
    /// When the current spin began.
    spinning_since: Option<Instant>,
    /// Small steps still to let go to sleep without a spin.
    skip: u32,
    /// The length of the current back-off (0 after a spin that found work).
    backoff: u32,
    /// Spin time the thread may still spend.
    credit: Duration,
    /// When `credit` was last topped up.
    refilled: Instant,
}

impl SpinPolicy {
    /// A policy that spins for at most `max` at a time (zero: never), starting at `now` with a
    /// full budget.
    pub(crate) fn new(max: Duration, now: Instant) -> Self {
        Self {
            max,
            armed: false,
            spinning_since: None,
            skip: 0,
            backoff: 0,
            credit: CREDIT_CAP,
            refilled: now,
        }
    }

    /// A step moved `bytes` (more than zero) at `now`. [`SpinEnd::Caught`] if a spin was
    /// under way.
    pub(crate) fn worked(&mut self, bytes: usize, now: Instant) -> Option<SpinEnd> {
        self.refill(now);
        let ended = self.spinning_since.take().map(|since| {
            // Found work while spinning: the spin paid.
            self.charge(now.saturating_since(since));
            self.backoff = 0;
            self.skip = 0;
            SpinEnd::Caught
        });
        self.armed = bytes <= SMALL_STEP_BYTES;
        if self.armed && self.skip > 0 {
            self.skip -= 1;
            self.armed = false;
        }
        ended
    }

    /// A step moved nothing at `now`: keep looking, or sleep.
    pub(crate) fn keep_looking(&mut self, now: Instant) -> Next {
        if self.max.is_zero() {
            return Next::Sleep { ended: None };
        }
        self.refill(now);
        match self.spinning_since {
            Some(since) => {
                let spent = now.saturating_since(since);
                if spent < self.max && spent < self.credit {
                    return Next::Spin;
                }
                self.spinning_since = None;
                self.charge(spent);
                if spent < self.max {
                    return Next::Sleep { ended: Some(SpinEnd::Cut) };
                }
                // A miss: nothing came within the whole spin.
                self.backoff = (self.backoff * 2).clamp(1, MAX_BACKOFF);
                self.skip = self.backoff;
                Next::Sleep { ended: Some(SpinEnd::Missed) }
            }
            None if self.armed && !self.credit.is_zero() => {
                self.armed = false;
                self.spinning_since = Some(now);
                Next::Spin
            }
            None => Next::Sleep { ended: None },
        }
    }

    /// Whether a spin is under way.
    #[cfg(test)]
    fn is_spinning(&self) -> bool {
        self.spinning_since.is_some()
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_since(self.refilled);
        self.refilled = now;
        let earned = elapsed * SPIN_SHARE_PERCENT / 100;
        self.credit = (self.credit + earned).min(CREDIT_CAP);
    }

    fn charge(&mut self, spent: Duration) {
        self.credit = self.credit.saturating_sub(spent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    fn at(us: u64) -> Instant {
        Instant::from_epoch(Duration::from_micros(us))
    }

    /// Whether the policy keeps looking at `us`.
    fn looks(p: &mut SpinPolicy, us: u64) -> bool {
        p.keep_looking(at(us)) == Next::Spin
    }

    /// Spins from `start` until the policy says sleep, in 1 µs polls; the time it stopped.
    fn spin_until_sleep(p: &mut SpinPolicy, start: u64) -> u64 {
        let mut t = start;
        while looks(p, t) {
            t += 1;
            assert!(t < start + 10_000, "spun forever");
        }
        t
    }

    #[test]
    fn a_small_step_arms_a_spin_that_ends_after_max() {
        let mut p = SpinPolicy::new(MAX, at(0));
        p.worked(100, at(10));
        assert!(looks(&mut p, 11), "a small step arms a spin");
        assert!(p.is_spinning());
        assert_eq!(p.keep_looking(at(60)), Next::Spin);
        assert_eq!(p.keep_looking(at(61)), Next::Sleep { ended: Some(SpinEnd::Missed) });
        assert_eq!(p.keep_looking(at(62)), Next::Sleep { ended: None }, "one spin a small step");
    }

    #[test]
    fn a_bulk_step_sleeps_at_once() {
        let mut p = SpinPolicy::new(MAX, at(0));
        p.worked(SMALL_STEP_BYTES + 1, at(10));
        assert!(!looks(&mut p, 11));
        p.worked(SMALL_STEP_BYTES, at(20));
        assert!(looks(&mut p, 21), "the limit itself is small");
    }

    #[test]
    fn zero_turns_spinning_off() {
        let mut p = SpinPolicy::new(Duration::ZERO, at(0));
        p.worked(64, at(10));
        assert!(!looks(&mut p, 11));
    }

    #[test]
    fn request_response_keeps_spinning_while_replies_come_back() {
        let mut p = SpinPolicy::new(MAX, at(0));
        let mut t = 0;
        for _ in 0..1000 {
            // A request goes out, the reply comes back 20 µs later, caught by the spin.
            p.worked(100, at(t));
            assert!(looks(&mut p, t + 1));
            assert!(looks(&mut p, t + 19));
            t += 20;
            assert_eq!(p.worked(100, at(t)), Some(SpinEnd::Caught));
            // Idle between round trips, long enough to earn back what the spin took.
            t += 40;
        }
        assert_eq!(p.backoff, 0, "every spin found work");
    }

    #[test]
    fn misses_back_off_exponentially_and_a_catch_ends_the_back_off() {
        let mut p = SpinPolicy::new(MAX, at(0));
        let mut t = 0;
        let mut spins = Vec::new();
        // A ping every 50 ms: every spin misses.
        for i in 0..200u64 {
            p.worked(100, at(t));
            if looks(&mut p, t + 1) {
                spins.push(i);
                spin_until_sleep(&mut p, t + 2);
            }
            t += 50_000;
        }
        // Spins at 0, then after skipping 1, 2, 4, ... small steps, up to 64.
        assert_eq!(spins, [0, 2, 5, 10, 19, 36, 69, 134, 199]);
        // A spin that finds work ends the back-off: the next small step spins again.
        while !looks(&mut p, t + 1) {
            p.worked(100, at(t));
            t += 50_000;
        }
        p.worked(100, at(t + 10));
        assert!(looks(&mut p, t + 11), "after a catch the next small step spins");
    }

    #[test]
    fn spinning_never_takes_more_than_its_share_of_the_time() {
        let mut p = SpinPolicy::new(Duration::from_millis(1), at(0));
        // Replies that come just before a 1 ms spin would end, back to back: without the
        // budget the thread would spin all the time.
        let (mut t, mut spun) = (0u64, 0u64);
        for _ in 0..10_000 {
            p.worked(100, at(t));
            let start = t + 1;
            let mut now = start;
            while now < start + 900 && looks(&mut p, now) {
                now += 1;
            }
            spun += now - start;
            t = start + 900;
        }
        let share = spun * 100 / t;
        assert!(
            share <= u64::from(SPIN_SHARE_PERCENT) + 1,
            "spun {share}% of the time (budget {SPIN_SHARE_PERCENT}%)"
        );
        assert!(share >= 30, "the budget is used, not wasted: {share}%");
    }

    #[test]
    fn a_spin_cut_short_by_the_budget_is_not_a_miss() {
        let mut p = SpinPolicy::new(Duration::from_millis(10), at(0));
        p.worked(100, at(0));
        assert!(looks(&mut p, 0));
        // The budget (2 ms) runs out before the 10 ms spin would end.
        assert!(looks(&mut p, 1_999));
        assert_eq!(p.keep_looking(at(2_000)), Next::Sleep { ended: Some(SpinEnd::Cut) });
        assert_eq!(p.backoff, 0);
    }
}
