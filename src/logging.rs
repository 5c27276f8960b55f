//! The daemon's log sink: lines go to stderr through a bounded queue and a writer thread of
//! their own, so that nobody reading the log can stop, stall or kill weft.
//!
//! # Contract
//! - A log line is handed to the queue with `try_send`: the caller (the lease keeper, the
//!   route watcher, a data plane thread) never waits on stderr. A full queue (the reader is
//!   slow or stalled) drops the line.
//! - The writer thread writes each line to stderr once. A failed write (`EPIPE` when the reader
//!   is gone, `ENOSPC`, `EAGAIN` on a non-blocking pipe) drops the line. Nothing here ever
//!   reports its own failure on the stream that failed, and nothing here panics.
//! - Every dropped line is counted: [`dropped_lines`], `weft_log_lines_dropped_total`.
//! - [`flush`] waits, for at most a given time, until what was queued before it is written:
//!   the last lines before an exit are not lost to a reader that is still there.
//!
//! Why not `tracing-appender`'s non-blocking writer: its worker thread and its guard print to
//! stdout and stderr about their own failures (`println!` when a shutdown finds the queue full,
//! `eprintln!` when a flush fails), and both macros panic when that stream is closed too —
//! the failure this module exists to survive. What remains is a queue and a thread.
//!
//! [`LogOnce`] is the one rule for a condition that is checked again and again (a retry loop,
//! a periodic listing): say it when it appears or changes, not on every check.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing_subscriber::fmt::MakeWriter;

use crate::metrics;

/// Lines queued for stderr at most; beyond that, lines are dropped (and counted).
const QUEUE_LINES: usize = 4096;

/// What the writer thread is handed.
enum Msg {
    /// One formatted log line (or event: a multi-line event is one write).
    Line(Vec<u8>),
    /// Acknowledge once everything queued before this is written.
    Flush(SyncSender<()>),
}

/// Counts shared by the writers and the writer thread.
#[derive(Debug, Default)]
struct Stats {
    dropped: AtomicU64,
}

/// The process's sink, once [`init`] made it.
static SINK: OnceLock<(SyncSender<Msg>, Arc<Stats>)> = OnceLock::new();

/// A `MakeWriter` whose writers queue each write as one line.
#[derive(Clone, Debug)]
pub struct QueueWriter {
    tx: SyncSender<Msg>,
    stats: Arc<Stats>,
}

impl Write for QueueWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.tx.try_send(Msg::Line(buf.to_vec())) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Always "written": the formatter must never see an error to report.
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for QueueWriter {
    type Writer = QueueWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// A queue writing to `out` on a thread of its own (named `weft-log`): the writer half, the
/// stats, and the thread's handle.
fn start(
    out: impl Write + Send + 'static,
) -> std::io::Result<(QueueWriter, std::thread::JoinHandle<()>)> {
    let (tx, rx) = sync_channel(QUEUE_LINES);
    let stats = Arc::new(Stats::default());
    let thread_stats = stats.clone();
    let handle = std::thread::Builder::new()
        .name("weft-log".into())
        .spawn(move || write_lines(rx, out, &thread_stats))?;
    Ok((QueueWriter { tx, stats }, handle))
}

/// The writer thread's body: until every sender is gone.
fn write_lines(rx: Receiver<Msg>, mut out: impl Write, stats: &Stats) {
    for msg in rx {
        match msg {
            Msg::Line(line) => {
                if out.write_all(&line).is_err() {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            Msg::Flush(ack) => {
                let _ = out.flush();
                let _ = ack.try_send(());
            }
        }
    }
}

/// Installs the process's tracing subscriber: `WEFT_LOG` (default `info`) as the filter, text or
/// JSON lines on stderr through the queue. Only the first call in a process installs anything.
pub fn init(json: bool) {
    init_with_default(json, "info");
}

/// [`init`] with `default` as the filter when `WEFT_LOG` is not set.
pub fn init_with_default(json: bool, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEFT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let Ok((writer, _thread)) = start(std::io::stderr()) else {
        // No thread for the log (the process is out of threads): run without one.
        return;
    };
    if SINK.set((writer.tx.clone(), writer.stats.clone())).is_err() {
        return;
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        // Its own write errors would go to stderr with `eprintln!`: there are none to report,
        // as the queue writer never fails, but say so explicitly.
        .log_internal_errors(false);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

/// Lines dropped since [`init`]: the queue was full, or stderr refused them.
pub fn dropped_lines() -> u64 {
    SINK.get().map_or(0, |(_, stats)| stats.dropped.load(Ordering::Relaxed))
}

/// Waits until every line queued before this call is written, or `within` has passed.
pub fn flush(within: Duration) {
    let Some((tx, _)) = SINK.get() else { return };
    let (ack_tx, ack_rx) = sync_channel(1);
    if tx.try_send(Msg::Flush(ack_tx)).is_ok() {
        let _ = ack_rx.recv_timeout(within);
    }
}

/// `weft_log_lines_dropped_total`, for `/metrics`.
#[derive(Debug, Default)]
pub struct LogMetrics;

impl Collector for LogMetrics {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::counter(
            &mut e,
            "weft_log_lines_dropped_total",
            "Log lines dropped: the log queue was full (the reader is slow) or stderr refused them \
             (the reader is gone).",
            dropped_lines(),
        )
    }
}

/// A condition that is logged once when it appears or changes, not on every check: remembers
/// the last one said. Pure: the caller logs what [`LogOnce::note`] returns, at its own level.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOnce {
    said: Option<String>,
}

impl LogOnce {
    /// `now` is the condition as this check found it. Returns it when it is new (none was
    /// said, or a different one was): the line to log. The same condition again returns `None`.
    pub fn note(&mut self, now: String) -> Option<&str> {
        if self.said.as_deref() == Some(now.as_str()) {
            return None;
        }
        Some(self.said.insert(now).as_str())
    }

    /// The condition is over: forgets it, so the next one is said even if it is the same.
    /// Returns whether one had been said (to log the recovery).
    pub fn clear(&mut self) -> bool {
        self.said.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn log_once_says_a_condition_when_it_appears_or_changes_and_again_after_it_clears() {
        let mut once = LogOnce::default();
        assert_eq!(once.note("down".into()), Some("down"));
        assert_eq!(once.note("down".into()), None, "the same condition is said once");
        assert_eq!(once.note("gone".into()), Some("gone"), "a changed one is said");
        assert_eq!(once.note("gone".into()), None);
        assert!(once.clear(), "one had been said");
        assert!(!once.clear(), "nothing to clear twice");
        assert_eq!(once.note("gone".into()), Some("gone"), "said again after it cleared");
    }

    /// A sink that fails every write, as stderr does once its reader is gone.
    struct Broken;
    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
    }

    /// A sink that blocks until released, as a pipe whose reader stopped reading.
    struct Stalled(Arc<Mutex<()>>, Arc<Mutex<Vec<u8>>>);
    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _held = self.0.lock().unwrap();
            self.1.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_broken_stream_drops_and_counts_lines_and_never_fails_the_caller() {
        let (mut w, thread) = start(Broken).unwrap();
        for _ in 0..10 {
            assert_eq!(w.write(b"a line\n").unwrap(), 7);
        }
        let stats = w.stats.clone();
        drop(w);
        thread.join().expect("the writer thread did not panic");
        assert_eq!(stats.dropped.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn a_stalled_reader_never_blocks_the_caller_and_full_queue_drops_are_counted() {
        let gate = Arc::new(Mutex::new(()));
        let out = Arc::new(Mutex::new(Vec::new()));
        let held = gate.lock().unwrap();
        let (mut w, thread) = start(Stalled(gate.clone(), out.clone())).unwrap();
        let lines = QUEUE_LINES + 100;
        let t0 = std::time::Instant::now();
        for _ in 0..lines {
            w.write_all(b"x\n").unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "writing blocked on a stalled reader");
        let dropped = w.stats.dropped.load(Ordering::Relaxed);
        // The thread holds one line in its stalled write; the queue holds QUEUE_LINES more.
        assert!((99..=100).contains(&dropped), "dropped {dropped}");
        drop(held);
        let stats = w.stats.clone();
        drop(w);
        thread.join().unwrap();
        let written = out.lock().unwrap().len() / 2;
        assert_eq!(written as u64 + stats.dropped.load(Ordering::Relaxed), lines as u64);
    }
}
