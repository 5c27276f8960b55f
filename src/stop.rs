//! How `weft run` is told to stop, and what makes sure it does.
//!
//! # Contract
//! - [`Stop`] is the one stop request of the process: a signal, a panic, a data plane that gave
//!   up, or the end of start-up [`Stop::request`] it; every task that must wind down
//!   [`Stop::subscribe`]s. A request is final.
//! - Signals are taken on a thread of their own ([`Stop::spawn_signal_thread`]), never on a
//!   task of the runtime: a task that panics, a runtime whose threads are all busy, or a log
//!   reader that went away cannot make weft deaf to `SIGTERM`. `SIGTERM`, `SIGINT` and `SIGHUP`
//!   are blocked in every thread ([`block_signals`], before the first thread starts) and only
//!   that thread takes them (`sigwait`): no handler runs anywhere else, and a signal nobody
//!   takes yet stays pending instead of killing the process by its default action.
//! - The first `SIGTERM` or `SIGINT` asks for a clean stop (the lease kept or relinquished as
//!   `--relinquish-on-exit` says); should the process still run after the deadline, or a
//!   second signal come, it exits at once with status 1.
//! - `SIGHUP` (systemd's `ExecReload=`) asks for an in-place upgrade
//!   ([`Stop::upgrade_requests`]) once weft forwards and holds its lease; before that (while
//!   it starts, or takes over) nobody listens for it, and it is ignored with a WARN. It never
//!   stops the process.
//! - Across the in-place upgrade's `execve` ([`exec_keeping_signals`]) no signal is lost and
//!   none kills: the signal thread is parked first, a stop it took meanwhile is raised again
//!   for the new image, and whatever comes later stays pending (the mask and pending signals
//!   survive `execve`) until the new image's signal thread takes it.
//! - A panic anywhere but inside [`crate::panics::catch`] (where the data plane's supervisor
//!   restarts the thread) is logged, counted (`weft_panics_total`) and requests a stop; the
//!   process then stops as on `SIGTERM` and exits non-zero ([`Stop::panicked`]).
//! - Nothing here writes to stderr directly: everything goes through the log queue
//!   ([`crate::logging`]), which never panics or blocks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use nix::sys::signal::{SigSet, Signal};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::{logging, metrics, panics};

/// The process's stop request.
#[derive(Debug)]
pub struct Stop {
    tx: watch::Sender<bool>,
    panicked: AtomicBool,
    panics: AtomicU64,
    /// Counts the `SIGHUP`s: each asks for an in-place upgrade.
    upgrades: watch::Sender<u64>,
}

impl Stop {
    /// No stop requested yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            tx: watch::channel(false).0,
            panicked: AtomicBool::new(false),
            panics: AtomicU64::new(0),
            upgrades: watch::channel(0).0,
        })
    }

    /// A receiver that changes at each `SIGHUP` (an in-place upgrade, see
    /// [`crate::daemon`]).
    pub fn upgrade_requests(&self) -> watch::Receiver<u64> {
        self.upgrades.subscribe()
    }

    /// Asks every subscriber to stop.
    pub fn request(&self) {
        self.tx.send_replace(true);
    }

    /// Whether a stop was requested.
    pub fn requested(&self) -> bool {
        *self.tx.borrow()
    }

    /// A receiver that turns `true` once a stop is requested.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// Resolves once a stop is requested.
    pub async fn wait(&self) {
        let mut rx = self.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Whether a panic (outside a supervised thread) requested the stop.
    pub fn panicked(&self) -> bool {
        self.panicked.load(Ordering::SeqCst)
    }

    /// What the panic hook does with a panic the process must act on.
    fn on_panic(&self, what: &str) {
        self.panics.fetch_add(1, Ordering::Relaxed);
        self.panicked.store(true, Ordering::SeqCst);
        error!(panic = what, "a task panicked: weft stops and exits non-zero");
        self.request();
    }

    /// Replaces the process's panic hook: every panic is logged through the log queue (never
    /// written to stderr directly); one outside [`panics::catch`] also requests the stop.
    pub fn install_panic_hook(self: &Arc<Self>) {
        let stop = self.clone();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let what = format!(
                "{} at {} (thread {})",
                panics::message(info.payload()),
                info.location().map_or_else(|| "?".to_owned(), ToString::to_string),
                thread.name().unwrap_or("unnamed"),
            );
            if panics::caught_here() {
                // Its catcher logs what it does about it (the data plane's supervisor).
                tracing::debug!(panic = %what, "panic caught where it happened");
            } else {
                stop.on_panic(&what);
            }
        }));
    }

    /// Takes `SIGTERM`, `SIGINT` and `SIGHUP` on a thread of its own (`weft-signals`), which
    /// [`block_signals`] must have blocked in every thread first. The first `SIGTERM` or
    /// `SIGINT` asks for a clean stop; if the process still runs `deadline` later, or a second
    /// one comes, it exits with status 1. A `SIGHUP` asks for an in-place upgrade
    /// ([`Stop::upgrade_requests`]), never a stop.
    pub fn spawn_signal_thread(self: &Arc<Self>, deadline: Duration) -> std::io::Result<()> {
        let stop = self.clone();
        std::thread::Builder::new().name("weft-signals".into()).spawn(move || {
            let _ = SIGNAL_THREAD.set(nix::sys::pthread::pthread_self());
            let mut seen = 0u32;
            loop {
                let Ok(signal) = taken().wait() else { continue };
                if !gate_passed(signal) {
                    continue;
                }
                if signal == Signal::SIGHUP {
                    if stop.upgrades.receiver_count() == 0 {
                        warn!(
                            signal = "SIGHUP",
                            "ignored: weft is starting or taking over, and upgrades in place                              only once it forwards and holds its lease; send it again then"
                        );
                    } else {
                        info!(signal = "SIGHUP", "an in-place upgrade is asked for");
                        stop.upgrades.send_modify(|n| *n += 1);
                    }
                    continue;
                }
                let name = if signal == Signal::SIGTERM { "SIGTERM" } else { "SIGINT" };
                seen += 1;
                if seen > 1 {
                    warn!(signal = name, "a second stop signal: exiting now, without a clean stop");
                    exit_now(1);
                }
                info!(signal = name, "stopping");
                stop.request();
                let _ = std::thread::Builder::new().name("weft-stop-deadline".into()).spawn(
                    move || {
                        std::thread::sleep(deadline);
                        error!(
                            deadline_secs = deadline.as_secs(),
                            "still running this long after the stop signal: exiting now"
                        );
                        exit_now(1);
                    },
                );
            }
        })?;
        Ok(())
    }
}

/// The signals the signal thread takes.
fn taken() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Blocks `SIGTERM`, `SIGINT` and `SIGHUP` in the calling thread, and so in every thread it
/// starts later: call it first thing, before any thread exists, so that only the signal thread
/// ([`Stop::spawn_signal_thread`]) ever takes them. Child processes start with an empty mask
/// (the standard library resets it between fork and exec).
pub fn block_signals() -> std::io::Result<()> {
    taken().thread_block().map_err(std::io::Error::from)
}

/// The signal thread's side of [`exec_keeping_signals`].
#[derive(Debug, Default)]
struct Gate {
    /// An exec asks the signal thread to park.
    exec: bool,
    /// The signal thread is parked: it takes no signal until the exec failed.
    parked: bool,
    /// A `SIGTERM` or `SIGINT` was taken by this image (its stop goes to the next one).
    stop_seen: bool,
    /// The wake-up `SIGHUP` sent to the signal thread and not taken yet.
    wake_pending: bool,
    /// `SIGTERM`s raised again for an exec that failed: this image took them already.
    raised: u32,
}

static GATE: Mutex<Gate> = Mutex::new(Gate {
    exec: false,
    parked: false,
    stop_seen: false,
    wake_pending: false,
    raised: 0,
});
static GATE_CHANGED: Condvar = Condvar::new();
/// The signal thread, once it runs.
static SIGNAL_THREAD: OnceLock<nix::sys::pthread::Pthread> = OnceLock::new();

fn gate() -> std::sync::MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the signal thread does with `signal` before acting on it: notes a stop, parks while an
/// exec is under way. `false`: nothing more to do with it (the wake-up, or a stop this image
/// raised again for an exec that failed).
fn gate_passed(signal: Signal) -> bool {
    let mut g = gate();
    let stop = matches!(signal, Signal::SIGTERM | Signal::SIGINT);
    if stop && g.raised > 0 {
        g.raised -= 1;
        return false;
    }
    if stop {
        g.stop_seen = true;
    }
    let wake = signal == Signal::SIGHUP && g.wake_pending;
    if wake {
        g.wake_pending = false;
    }
    if g.exec {
        g.parked = true;
        GATE_CHANGED.notify_all();
        while g.exec {
            g = GATE_CHANGED.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        g.parked = false;
    }
    !wake
}

/// Runs `exec` (an `execve` of this process, returning only its error) so that no stop signal
/// is lost and no signal kills the process across it: the signal thread is parked first (it
/// takes no signal from then on), a `SIGTERM` or `SIGINT` this image took is raised again so
/// that the new image stops too, and any signal that comes meanwhile stays pending: every
/// thread blocks them, and the mask and pending signals survive `execve`. Should `exec` fail,
/// the signal thread takes signals again.
pub fn exec_keeping_signals(exec: impl FnOnce() -> std::io::Error) -> std::io::Error {
    let Some(thread) = SIGNAL_THREAD.get().copied() else { return exec() };
    let mut g = gate();
    g.exec = true;
    g.wake_pending = true;
    drop(g);
    // Woken from its sigwait: the signal thread parks before it takes another signal.
    if let Err(e) = nix::sys::pthread::pthread_kill(thread, Signal::SIGHUP) {
        gate().exec = false;
        return std::io::Error::from(e);
    }
    let mut g = gate();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !g.parked {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            g.exec = false;
            GATE_CHANGED.notify_all();
            return std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the signal thread did not stop taking signals within 2 s",
            );
        }
        g = GATE_CHANGED.wait_timeout(g, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
    }
    let stop_seen = g.stop_seen;
    drop(g);
    // Pending, as no thread takes it now: the new image's signal thread will.
    if stop_seen {
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), Signal::SIGTERM);
    }
    let error = exec();
    let mut g = gate();
    g.exec = false;
    if stop_seen {
        g.raised += 1;
    }
    GATE_CHANGED.notify_all();
    error
}

/// Exits the process at once with `code`, after giving the log queue a moment to drain.
pub fn exit_now(code: i32) -> ! {
    logging::flush(Duration::from_millis(500));
    std::process::exit(code)
}

impl Collector for Stop {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::counter(
            &mut e,
            "weft_panics_total",
            "Panics outside a supervised data plane thread (each stops weft, non-zero).",
            self.panics.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panicking task requests the stop, counts, and says so; a supervised one does not.
    /// (The hook is process-wide: this is the only test in the library that installs it.)
    #[tokio::test]
    async fn a_panicking_task_requests_the_stop_and_a_caught_one_does_not() {
        let stop = Stop::new();
        let previous = std::panic::take_hook();
        stop.install_panic_hook();
        let caught = panics::catch(|| panic!("supervised"));
        assert!(caught.is_err());
        assert!(!stop.requested(), "a caught panic stopped the process");
        let task = tokio::spawn(async { panic!("in a task") });
        assert!(task.await.unwrap_err().is_panic());
        tokio::time::timeout(Duration::from_secs(5), stop.wait())
            .await
            .expect("the stop was not requested within 5 s of the panic");
        std::panic::set_hook(previous);
        assert!(stop.panicked());
        let text = metrics::render_collector(stop.clone()).unwrap();
        // Other tests of this binary may panic meanwhile (on purpose): at least this one.
        assert!(text.contains("\nweft_panics_total ") && !text.contains("weft_panics_total 0"));
    }
}
