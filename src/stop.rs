//! How `weft run` is told to stop, and what makes sure it does.
//!
//! # Contract
//! - [`Stop`] is the one stop request of the process: a signal, a panic, a data plane that gave
//!   up, or the end of start-up [`Stop::request`] it; every task that must wind down
//!   [`Stop::subscribe`]s. A request is final.
//! - Signals are taken on a thread of their own ([`Stop::spawn_signal_thread`]), never on a
//!   task of the runtime: a task that panics, a runtime whose threads are all busy, or a log
//!   reader that went away cannot make weft deaf to `SIGTERM`. The first `SIGTERM` or `SIGINT`
//!   asks for a clean stop (the lease kept or relinquished as `--relinquish-on-exit` says);
//!   should the process still run after the deadline, or a second signal come, it exits at
//!   once with status 1.
//! - `SIGHUP` (systemd's `ExecReload=`) is taken on the same thread and ignored with a WARN:
//!   this build has no in-place upgrade, and a reload must not kill the daemon (the default
//!   action of `SIGHUP`).
//! - A panic anywhere but inside [`crate::panics::catch`] (where the data plane's supervisor
//!   restarts the thread) is logged, counted (`weft_panics_total`) and requests a stop; the
//!   process then stops as on `SIGTERM` and exits non-zero ([`Stop::panicked`]).
//! - Nothing here writes to stderr directly: everything goes through the log queue
//!   ([`crate::logging`]), which never panics or blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

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

    /// Takes `SIGTERM`, `SIGINT` and `SIGHUP` on a thread of its own (`weft-signals`). The
    /// first `SIGTERM` or `SIGINT` asks for a clean stop; if the process still runs `deadline`
    /// later, or a second one comes, it exits with status 1. A `SIGHUP` asks for an in-place
    /// upgrade ([`Stop::upgrade_requests`]), never a stop.
    pub fn spawn_signal_thread(self: &Arc<Self>, deadline: Duration) -> std::io::Result<()> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
        let stop = self.clone();
        std::thread::Builder::new().name("weft-signals".into()).spawn(move || {
            let mut seen = 0u32;
            for signal in signals.forever() {
                if signal == SIGHUP {
                    info!(
                        signal = "SIGHUP",
                        "an in-place upgrade is asked for (once weft forwards and holds its \
                         lease; before, it is ignored)"
                    );
                    stop.upgrades.send_modify(|n| *n += 1);
                    continue;
                }
                let name = if signal == SIGTERM { "SIGTERM" } else { "SIGINT" };
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
