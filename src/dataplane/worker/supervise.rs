//! Worker supervision: a data plane thread that panics is never a silent black hole.
//!
//! Contract:
//! - [`RestartPolicy`] is pure: given the panic times of one thread and `now`, it says whether to
//!   restart the thread and after how long, or to give up. Restarts back off (100 ms, doubling,
//!   at most 5 s) so that a thread that panics on every packet does not spin; more than
//!   [`RestartPolicy::max_panics`] panics within [`RestartPolicy::window`] means the fault is
//!   not transient, and weft gives up.
//! - [`WorkerStates`] is what every thread and the daemon share: which thread is down and why
//!   (for `/readyz`), how often each panicked (`weft_dataplane_worker_panics_total`), and whether
//!   the data plane has given up ([`WorkerStates::wait_given_up`]); the daemon then exits
//!   non-zero, keeping its lease, so that its supervisor (systemd, the kubelet) restarts it and
//!   the new process adopts the same subnet.
//! - [`supervise`] is the thread body wrapper the driver uses: it runs the loop under
//!   [`crate::panics::catch`] (so the process-wide panic hook leaves it to the supervisor) and
//!   applies the policy. A loop that returns ends the thread: the loops
//!   return only when told to stop.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing::{error, info};

use crate::time::{Clock, Instant};
use crate::{metrics, panics};

/// When a panicked thread is restarted, and when weft gives up instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RestartPolicy {
    /// The first restart's delay; each further panic within the window doubles it.
    pub(crate) first_delay: Duration,
    /// The longest delay.
    pub(crate) max_delay: Duration,
    /// Panics of one thread within `window` beyond which weft gives up.
    pub(crate) max_panics: usize,
    /// The window over which panics are counted.
    pub(crate) window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            first_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            max_panics: 5,
            window: Duration::from_secs(60),
        }
    }
}

/// What to do after a panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterPanic {
    /// Restart the thread once this much time has passed.
    RestartAfter(Duration),
    /// Too many panics in the window: stop restarting, let the process exit.
    GiveUp,
}

impl RestartPolicy {
    /// The decision after a panic at `now`, given the earlier panics' times (`recent`, oldest
    /// first, as kept by the caller; entries older than the window are ignored). Pure.
    pub(crate) fn after_panic(&self, recent: &[Instant], now: Instant) -> AfterPanic {
        let in_window =
            recent.iter().filter(|t| now.saturating_since(**t) < self.window).count() + 1;
        if in_window > self.max_panics {
            return AfterPanic::GiveUp;
        }
        let doublings = u32::try_from(in_window - 1).unwrap_or(u32::MAX).min(16);
        AfterPanic::RestartAfter(
            self.first_delay.saturating_mul(1 << doublings).min(self.max_delay),
        )
    }
}

/// One supervised thread's state.
#[derive(Debug)]
struct ThreadState {
    name: String,
    up: AtomicBool,
    panics: AtomicU64,
    /// Loop turns of the thread ([`beat`]): a thread that makes no progress stops counting.
    beats: AtomicU64,
    /// The last panic's message, while the thread is down.
    last_panic: Mutex<Option<String>>,
}

/// The shared state of every supervised data plane thread.
#[derive(Debug, Default)]
pub struct WorkerStates {
    threads: Mutex<Vec<Arc<ThreadState>>>,
    given_up: AtomicBool,
    given_up_notify: tokio::sync::Notify,
}

impl WorkerStates {
    /// The state of thread `name`: the same one again when a thread of that name was
    /// registered before (the workers are restarted on new sockets), marked up.
    fn register(&self, name: &str) -> Arc<ThreadState> {
        let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = threads.iter().find(|t| t.name == name) {
            state.up.store(true, Ordering::Relaxed);
            *state.last_panic.lock().unwrap_or_else(PoisonError::into_inner) = None;
            return state.clone();
        }
        let state = Arc::new(ThreadState {
            name: name.to_owned(),
            up: AtomicBool::new(true),
            panics: AtomicU64::new(0),
            beats: AtomicU64::new(0),
            last_panic: Mutex::new(None),
        });
        threads.push(state.clone());
        state
    }

    /// `None` while every thread runs; else which are down and why (for `/readyz`).
    pub(crate) fn problem(&self) -> Option<String> {
        let threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        let down: Vec<String> = threads
            .iter()
            .filter(|t| !t.up.load(Ordering::Relaxed))
            .map(|t| {
                let why = t.last_panic.lock().unwrap_or_else(PoisonError::into_inner).clone();
                format!("{} (panicked: {})", t.name, why.unwrap_or_default())
            })
            .collect();
        if down.is_empty() {
            return None;
        }
        let what = if self.has_given_up() { "down for good, exiting" } else { "restarting" };
        Some(format!("data plane worker down: {}; {what}", down.join(", ")))
    }

    /// Every thread's loop turns so far ([`beat`]), by name: a thread whose count stops moving
    /// makes no progress (a service manager's watchdog is told only while every count moves).
    pub(crate) fn progress(&self) -> Vec<(String, u64)> {
        let threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        threads.iter().map(|t| (t.name.clone(), t.beats.load(Ordering::Relaxed))).collect()
    }

    /// Whether a thread panicked too often and weft should exit.
    pub(crate) fn has_given_up(&self) -> bool {
        self.given_up.load(Ordering::SeqCst)
    }

    /// Resolves once a thread panicked too often.
    pub(crate) async fn wait_given_up(&self) {
        loop {
            let notified = self.given_up_notify.notified();
            if self.has_given_up() {
                return;
            }
            notified.await;
        }
    }

    fn give_up(&self) {
        self.given_up.store(true, Ordering::SeqCst);
        self.given_up_notify.notify_waiters();
    }
}

impl Collector for WorkerStates {
    /// Panics and up/down per thread.
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        metrics::counter_family(
            &mut e,
            "weft_dataplane_worker_panics_total",
            "Data plane thread panics, by thread.",
            threads
                .iter()
                .map(|t| ([("thread", t.name.as_str())], t.panics.load(Ordering::Relaxed))),
        )?;
        metrics::gauge_family(
            &mut e,
            "weft_dataplane_worker_up",
            "Whether a data plane thread runs (1) or is down (0).",
            threads
                .iter()
                .map(|t| ([("thread", t.name.as_str())], u64::from(t.up.load(Ordering::Relaxed)))),
        )
    }
}

/// Runs `body` (a worker loop) on the current thread, named `name` in `states`, until it returns
/// or weft gives up: a panic is caught, logged and counted, the thread is marked down, and
/// after the policy's delay `body` runs again; while waiting, `stop` is honoured.
pub(crate) fn supervise(
    name: &str,
    states: &WorkerStates,
    policy: RestartPolicy,
    clock: &dyn Clock,
    stop: &AtomicBool,
    mut body: impl FnMut(),
) {
    let state = states.register(name);
    BEATS.with(|b| *b.borrow_mut() = Some(state.clone()));
    let mut recent: Vec<Instant> = Vec::new();
    loop {
        let Err(payload) = panics::catch(&mut body) else { return };
        let now = clock.now();
        let message = panics::message(&*payload);
        state.up.store(false, Ordering::Relaxed);
        state.panics.fetch_add(1, Ordering::Relaxed);
        *state.last_panic.lock().unwrap_or_else(PoisonError::into_inner) = Some(message.clone());
        let decision = policy.after_panic(&recent, now);
        recent.retain(|t| now.saturating_since(*t) < policy.window);
        recent.push(now);
        let delay = match decision {
            AfterPanic::RestartAfter(d) => d,
            AfterPanic::GiveUp => {
                error!(
                    thread = name,
                    panic = %message,
                    panics = recent.len(),
                    window_secs = policy.window.as_secs(),
                    "data plane thread panicked too often: giving up, weft exits"
                );
                states.give_up();
                return;
            }
        };
        error!(thread = name, panic = %message, restart_in_ms = delay.as_millis() as u64, "data plane thread panicked: restarting it");
        let until = now + delay;
        while clock.now() < until {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20).min(until.saturating_since(clock.now())));
        }
        state.up.store(true, Ordering::Relaxed);
        *state.last_panic.lock().unwrap_or_else(PoisonError::into_inner) = None;
        info!(thread = name, "data plane thread restarted");
    }
}

thread_local! {
    /// The supervised thread's state, for [`beat`].
    static BEATS: std::cell::RefCell<Option<Arc<ThreadState>>> = const { std::cell::RefCell::new(None) };
}

/// A worker loop's turn: counted for the thread [`supervise`] runs on this thread (nothing on
/// another thread). Called once per turn, asleep or not: a loop sleeps at most its wake ceiling.
#[inline]
pub(crate) fn beat() {
    BEATS.with(|b| {
        if let Some(state) = &*b.borrow() {
            state.beats.fetch_add(1, Ordering::Relaxed);
        }
    });
    injected_hang();
}

/// With the `fault-injection` feature: a thread whose name starts with `WEFT_FAULT_HANG_THREAD`
/// stops making progress once it has forwarded anything (it sleeps for good), as a thread stuck
/// in a syscall or a loop would; the watchdog test drives it.
#[cfg(feature = "fault-injection")]
fn injected_hang() {
    use std::sync::OnceLock;
    static HANG: OnceLock<Option<String>> = OnceLock::new();
    let Some(prefix) = HANG.get_or_init(|| std::env::var("WEFT_FAULT_HANG_THREAD").ok()) else {
        return;
    };
    let me = std::thread::current();
    if me.name().is_some_and(|n| n.starts_with(prefix.as_str()))
        && BEATS.with(|b| b.borrow().as_ref().is_some_and(|s| s.beats.load(Ordering::Relaxed) > 50))
    {
        tracing::warn!(
            thread = me.name(),
            "injected hang (WEFT_FAULT_HANG_THREAD): this thread stops"
        );
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
fn injected_hang() {}

/// Fault injection for the end-to-end tests, compiled only with the `fault-injection` feature
/// (never into a release build): a worker loop calls this after each batch it forwarded, and
/// a thread whose name starts with `WEFT_FAULT_PANIC_THREAD` panics there, as many times in
/// total as `WEFT_FAULT_PANIC_TIMES` says (default 1).
#[cfg(feature = "fault-injection")]
pub(crate) fn injected_fault() {
    use std::sync::OnceLock;
    use std::sync::atomic::AtomicI64;
    static PLAN: OnceLock<Option<(String, AtomicI64)>> = OnceLock::new();
    let plan = PLAN.get_or_init(|| {
        let prefix = std::env::var("WEFT_FAULT_PANIC_THREAD").ok()?;
        let times =
            std::env::var("WEFT_FAULT_PANIC_TIMES").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
        Some((prefix, AtomicI64::new(times)))
    });
    let Some((prefix, left)) = plan else { return };
    let me = std::thread::current();
    if me.name().is_some_and(|n| n.starts_with(prefix.as_str()))
        && left.fetch_sub(1, Ordering::SeqCst) > 0
    {
        panic!("injected fault (WEFT_FAULT_PANIC_THREAD={prefix})");
    }
}

/// Without the `fault-injection` feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn injected_fault() {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::ManualClock;

    fn at(ms: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(ms))
    }

    #[test]
    fn restarts_back_off_then_give_up_within_the_window() {
        let p = RestartPolicy::default();
        let mut recent = Vec::new();
        let mut delays = Vec::new();
        for i in 0..6 {
            let now = at(1000 * i);
            delays.push(p.after_panic(&recent, now));
            recent.push(now);
        }
        let ms = |m| AfterPanic::RestartAfter(Duration::from_millis(m));
        assert_eq!(delays, vec![ms(100), ms(200), ms(400), ms(800), ms(1600), AfterPanic::GiveUp]);
    }

    #[test]
    fn old_panics_fall_out_of_the_window() {
        let p = RestartPolicy::default();
        let recent: Vec<Instant> = (0..5).map(|i| at(i * 1000)).collect();
        assert_eq!(p.after_panic(&recent, at(10_000)), AfterPanic::GiveUp);
        // A minute after the first four, only the fifth still counts.
        assert_eq!(
            p.after_panic(&recent, at(63_500)),
            AfterPanic::RestartAfter(Duration::from_millis(200))
        );
        assert_eq!(
            p.after_panic(&recent, at(200_000)),
            AfterPanic::RestartAfter(Duration::from_millis(100))
        );
    }

    #[test]
    fn delays_are_capped() {
        let p = RestartPolicy { max_panics: 100, ..RestartPolicy::default() };
        let recent: Vec<Instant> = (0..50).map(at).collect();
        assert_eq!(p.after_panic(&recent, at(60)), AfterPanic::RestartAfter(p.max_delay));
    }

    fn quiet_policy() -> RestartPolicy {
        RestartPolicy {
            first_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            ..Default::default()
        }
    }

    #[test]
    fn a_panicking_body_is_restarted_counted_and_then_runs_on() {
        let states = Arc::new(WorkerStates::default());
        let clock = ManualClock::default();
        let stop = AtomicBool::new(false);
        let mut runs = 0;
        supervise("weft-q0", &states, quiet_policy(), &clock, &stop, || {
            runs += 1;
            if runs <= 2 {
                panic!("boom {runs}");
            }
        });
        assert_eq!(runs, 3, "the body did not run again after its panics");
        assert!(states.problem().is_none(), "{:?}", states.problem());
        assert!(!states.has_given_up());
        let out = metrics::render_collector(states.clone()).unwrap();
        assert!(
            out.contains("weft_dataplane_worker_panics_total{thread=\"weft-q0\"} 2\n"),
            "{out}"
        );
        assert!(out.contains("weft_dataplane_worker_up{thread=\"weft-q0\"} 1\n"), "{out}");
    }

    #[test]
    fn a_body_that_always_panics_is_given_up_on_and_named() {
        let states = Arc::new(WorkerStates::default());
        let clock = ManualClock::default();
        let stop = AtomicBool::new(false);
        let mut runs = 0;
        supervise("weft-q1-tx", &states, quiet_policy(), &clock, &stop, || {
            runs += 1;
            panic!("always");
        });
        assert_eq!(runs, 6);
        assert!(states.has_given_up());
        let problem = states.problem().expect("a problem");
        assert!(problem.contains("weft-q1-tx (panicked: always)"), "{problem}");
        assert!(problem.contains("exiting"), "{problem}");
        let out = metrics::render_collector(states.clone()).unwrap();
        assert!(out.contains("weft_dataplane_worker_up{thread=\"weft-q1-tx\"} 0\n"), "{out}");
    }

    /// The worker metrics byte for byte as weft's hand-written renderer wrote them before
    /// prometheus-client (`tests/golden/metrics_workers.prom` is its output for this state).
    #[test]
    fn worker_metrics_render_exactly_as_before() {
        let states = Arc::new(WorkerStates::default());
        let (clock, stop) = (ManualClock::default(), AtomicBool::new(false));
        let mut runs = 0;
        supervise("weft-q0", &states, quiet_policy(), &clock, &stop, || {
            runs += 1;
            if runs <= 2 {
                panic!("boom");
            }
        });
        supervise("weft-q1", &states, quiet_policy(), &clock, &stop, || {});
        assert_eq!(
            metrics::render_collector(states).unwrap(),
            include_str!("../../../tests/golden/metrics_workers.prom")
        );
    }

    #[test]
    fn waiting_for_a_restart_honours_stop() {
        let states = WorkerStates::default();
        let clock = ManualClock::default();
        let stop = AtomicBool::new(true);
        let mut runs = 0;
        let policy = RestartPolicy { first_delay: Duration::from_secs(3600), ..Default::default() };
        supervise("weft-q0", &states, policy, &clock, &stop, || {
            runs += 1;
            panic!("once");
        });
        assert_eq!(runs, 1);
        assert!(states.problem().is_some());
    }
}
