//! The `--on-subnet-change` and `--on-lease-lost` hooks: how they run, and the journal that
//! makes sure a hook weft owed is run even if weft dies first.
//!
//! Contract:
//! - A hook is `/bin/sh -c CMD <hook-name> <old> <new>` with a scrubbed environment: only
//!   `WEFT_OLD_SUBNET`, `WEFT_NEW_SUBNET`, `WEFT_REASON`, `WEFT_HOLDER`, and weft's own `PATH`
//!   (or [`DEFAULT_PATH`]) and `HOME` (if set). Nothing else of weft's environment reaches it,
//!   in particular not `WEFT_ETCD_PASSWORD`.
//! - Hooks run one at a time, in the order weft asked for them, on their own task: a slow hook
//!   never blocks the keeper, and two hooks never race.
//! - Each hook is its own process group. If it has not exited within `--hook-timeout`, the
//!   whole group is SIGKILLed, a WARN is logged and it counts as a failure
//!   (`weft_hook_failures_total`), as do a non-zero exit and a failure to start.
//! - Output: the first [`OUTPUT_LIMIT`] bytes of stdout and of stderr are kept for the log; the
//!   rest is read and discarded, and the truncation is logged. The pipes are drained rather than
//!   closed: closing them would kill a chatty hook with SIGPIPE (a spurious failure) and reading
//!   to the end cannot deadlock, since the hook never waits on weft. Once the shell has exited,
//!   what is left in the pipes is read for at most [`DRAIN_AFTER_EXIT`], so a background child
//!   that keeps them open does not hold the queue.
//! - The journal ([`PENDING_FILE`] in the state dir) lists the hooks owed and not yet
//!   completed. A hook is recorded before anything it reports becomes visible (for a subnet
//!   change: before `subnet.env` is rewritten) and removed once it has finished, whatever its
//!   outcome. On start every recorded hook is run again, logged as a re-run. So a hook runs at
//!   least once: a hook that weft was killed during counts as not run, and runs again (the
//!   earlier, interrupted run may even still be going: it is not weft's child any more). Hooks
//!   must be idempotent. A recorded hook whose flag is no longer given is dropped, with a log.
//! - The journal's format ([`render`], [`parse`]) is one line per hook, `<hook-name>` then
//!   `old=`, `new=`, `reason=`, `holder=` (empty: none). Parsing never panics; a bad line is
//!   reported and skipped.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt as _};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::record::Subnet;
use crate::atomic_file;
use crate::health::{Counters, Health};

/// The journal's name in the state dir.
pub(crate) const PENDING_FILE: &str = "hook-pending";
/// How much of each of stdout and stderr is kept.
pub(crate) const OUTPUT_LIMIT: usize = 64 * 1024;
/// `PATH` for hooks when weft has none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long output is still read after the shell exited.
pub(crate) const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// The longest journal read (a line is under 200 bytes).
const MAX_JOURNAL_LEN: u64 = 64 * 1024;

/// Which hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HookKind {
    /// `--on-subnet-change`.
    SubnetChange,
    /// `--on-lease-lost`.
    LeaseLost,
}

impl HookKind {
    /// The flag's name without dashes, also `$0` of the hook.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::SubnetChange => "on-subnet-change",
            Self::LeaseLost => "on-lease-lost",
        }
    }
}

/// The values of `WEFT_REASON`.
pub(crate) const REASONS: [&str; 4] =
    ["subnet-changed", "taken-by-another-node", "unreadable-value", "identity-clash"];

/// One hook invocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HookRun {
    /// Which hook.
    pub(crate) kind: HookKind,
    /// `$1`, `WEFT_OLD_SUBNET`.
    pub(crate) old: Option<Subnet>,
    /// `$2`, `WEFT_NEW_SUBNET`.
    pub(crate) new: Option<Subnet>,
    /// `WEFT_REASON`, one of [`REASONS`].
    pub(crate) reason: &'static str,
    /// `WEFT_HOLDER`.
    pub(crate) holder: Option<IpAddr>,
}

/// A journal line that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {problem}")]
pub(crate) struct JournalLineError {
    /// The line number, from 1.
    pub(crate) line: usize,
    /// What is wrong with it.
    pub(crate) problem: String,
}

/// The journal's text for `runs`.
pub(crate) fn render(runs: &[HookRun]) -> String {
    let opt = |v: Option<String>| v.unwrap_or_default();
    runs.iter()
        .map(|r| {
            format!(
                "{} old={} new={} reason={} holder={}\n",
                r.kind.name(),
                opt(r.old.map(|s| s.to_string())),
                opt(r.new.map(|s| s.to_string())),
                r.reason,
                opt(r.holder.map(|h| h.to_string())),
            )
        })
        .collect()
}

/// Reads the journal's text: each line's hook, or why it could not be read. Blank lines are
/// skipped. Never panics.
pub(crate) fn parse(text: &str) -> Vec<Result<HookRun, JournalLineError>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| parse_line(l).map_err(|problem| JournalLineError { line: i + 1, problem }))
        .collect()
}

fn parse_line(line: &str) -> Result<HookRun, String> {
    let mut words = line.split_whitespace();
    let kind = match words.next() {
        Some("on-subnet-change") => HookKind::SubnetChange,
        Some("on-lease-lost") => HookKind::LeaseLost,
        _ => return Err("not a hook name".into()),
    };
    let (mut old, mut new, mut reason, mut holder) = (None, None, None, None);
    for word in words {
        let (key, value) = word.split_once('=').ok_or("not key=value")?;
        let subnet = |v: &str| match v {
            "" => Ok(None),
            v => v.parse::<Subnet>().map(Some).map_err(|_| format!("{key}: not a subnet")),
        };
        match key {
            "old" => old = Some(subnet(value)?),
            "new" => new = Some(subnet(value)?),
            "reason" => {
                let known = REASONS.iter().find(|r| **r == value).ok_or("unknown reason")?;
                reason = Some(*known);
            }
            "holder" => {
                holder = Some(match value {
                    "" => None,
                    v => Some(v.parse::<IpAddr>().map_err(|_| "holder: not an address")?),
                });
            }
            _ => return Err(format!("unknown key {:?}", key.chars().take(20).collect::<String>())),
        }
    }
    Ok(HookRun {
        kind,
        old: old.ok_or("old: missing")?,
        new: new.ok_or("new: missing")?,
        reason: reason.ok_or("reason: missing")?,
        holder: holder.ok_or("holder: missing")?,
    })
}

/// The hooks' settings.
#[derive(Clone, Debug)]
pub(crate) struct HookConfig {
    /// `--on-subnet-change`.
    pub(crate) on_subnet_change: Option<String>,
    /// `--on-lease-lost`.
    pub(crate) on_lease_lost: Option<String>,
    /// `--hook-timeout`.
    pub(crate) timeout: Duration,
    /// The journal ([`PENDING_FILE`] in the state dir).
    pub(crate) journal: PathBuf,
}

impl HookConfig {
    fn command(&self, kind: HookKind) -> Option<&str> {
        match kind {
            HookKind::SubnetChange => self.on_subnet_change.as_deref(),
            HookKind::LeaseLost => self.on_lease_lost.as_deref(),
        }
    }
}

struct Job {
    run: HookRun,
    rerun: bool,
}

/// Runs hooks one at a time on a task of its own, keeping the journal.
pub(crate) struct HookRunner {
    cfg: Arc<HookConfig>,
    journal: Arc<Journal>,
    tx: mpsc::UnboundedSender<Job>,
}

impl HookRunner {
    /// Starts the runner task, and queues again every hook the journal lists. Must be called
    /// inside a tokio runtime.
    pub(crate) fn start(cfg: HookConfig, health: Arc<Health>) -> Self {
        let cfg = Arc::new(cfg);
        let journal = Arc::new(Journal::load(&cfg.journal));
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_queue(rx, cfg.clone(), journal.clone(), health));
        let runner = Self { cfg, journal, tx };
        for run in runner.journal.runs() {
            if runner.cfg.command(run.kind).is_some() {
                info!(hook = run.kind.name(), old = ?run.old, new = ?run.new, reason = run.reason,
                    "re-running a hook that did not complete before weft stopped");
                let _ = runner.tx.send(Job { run, rerun: true });
            } else {
                info!(
                    hook = run.kind.name(),
                    "dropping a pending hook whose flag is no longer given"
                );
                runner.journal.done(&run);
            }
        }
        runner
    }

    /// Whether a command is configured for `kind`.
    pub(crate) fn configured(&self, kind: HookKind) -> bool {
        self.cfg.command(kind).is_some()
    }

    /// Records `run` in the journal (before what it reports becomes visible); a no-op when no
    /// command is configured for it.
    pub(crate) fn record(&self, run: &HookRun) {
        if self.configured(run.kind) {
            self.journal.record(run.clone());
        }
    }

    /// Queues a [`HookRunner::record`]ed run.
    pub(crate) fn start_run(&self, run: HookRun) {
        if self.configured(run.kind) {
            let _ = self.tx.send(Job { run, rerun: false });
        }
    }

    /// Records and queues `run`.
    pub fn run(&self, run: HookRun) {
        self.record(&run);
        self.start_run(run);
    }
}

/// The hooks owed, in memory and in the journal file.
struct Journal {
    path: PathBuf,
    runs: Mutex<Vec<HookRun>>,
}

impl Journal {
    fn load(path: &Path) -> Self {
        let runs = match atomic_file::read(path, MAX_JOURNAL_LEN) {
            Ok(None) => Vec::new(),
            Ok(Some(bytes)) => parse(&String::from_utf8_lossy(&bytes))
                .into_iter()
                .filter_map(|r| {
                    r.map_err(|e| warn!(path = %path.display(), error = %e, "skipping an unreadable pending-hook line"))
                        .ok()
                })
                .collect(),
            Err(e) => {
                warn!(error = %e, "ignoring the pending-hook file");
                Vec::new()
            }
        };
        Self { path: path.to_owned(), runs: Mutex::new(runs) }
    }

    fn runs(&self) -> Vec<HookRun> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn record(&self, run: HookRun) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.push(run);
        self.save(&runs);
    }

    fn done(&self, run: &HookRun) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = runs.iter().position(|r| r == run) {
            runs.remove(i);
        }
        self.save(&runs);
    }

    /// Best effort: a journal that cannot be written only loses the re-run after a crash.
    fn save(&self, runs: &[HookRun]) {
        let result = if runs.is_empty() {
            match std::fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
                _ => Ok(()),
            }
        } else {
            atomic_file::write(&self.path, render(runs).as_bytes(), atomic_file::PRIVATE_MODE)
                .map_err(|e| e.to_string())
        };
        if let Err(e) = result {
            warn!(path = %self.path.display(), error = %e, "could not update the pending-hook file; a hook cut short by a crash will not be re-run");
        }
    }
}

async fn run_queue(
    mut rx: mpsc::UnboundedReceiver<Job>,
    cfg: Arc<HookConfig>,
    journal: Arc<Journal>,
    health: Arc<Health>,
) {
    while let Some(job) = rx.recv().await {
        let Some(cmd) = cfg.command(job.run.kind) else { continue };
        let ok = run_one(cmd, &job.run, job.rerun, cfg.timeout).await;
        if !ok {
            Counters::inc(&health.counters.hook_failures);
        }
        journal.done(&job.run);
    }
}

/// Runs one hook to its end (or its timeout); whether it succeeded.
async fn run_one(cmd: &str, run: &HookRun, rerun: bool, timeout: Duration) -> bool {
    let name = run.kind.name();
    let old = run.old.map(|s| s.to_string()).unwrap_or_default();
    let new = run.new.map(|s| s.to_string()).unwrap_or_default();
    let mut command = tokio::process::Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(cmd)
        .arg(name)
        .arg(&old)
        .arg(&new)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()))
        .env("WEFT_OLD_SUBNET", &old)
        .env("WEFT_NEW_SUBNET", &new)
        .env("WEFT_REASON", run.reason)
        .env("WEFT_HOLDER", run.holder.map(|h| h.to_string()).unwrap_or_default())
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(home) = std::env::var_os("HOME") {
        command.env("HOME", home);
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            warn!(hook = name, %cmd, rerun, error = %e, "hook could not start");
            return false;
        }
    };
    let stdout = tokio::spawn(read_bounded(child.stdout.take()));
    let stderr = tokio::spawn(read_bounded(child.stderr.take()));
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            // Not reaped yet, so the group ID is still ours to signal.
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.wait().await;
            warn!(hook = name, %cmd, rerun, ?timeout, "hook timed out; killed its process group");
            stdout.abort();
            stderr.abort();
            return false;
        }
    };
    let output = |task: tokio::task::JoinHandle<Output>| async move {
        match tokio::time::timeout(DRAIN_AFTER_EXIT, task).await {
            Ok(Ok(out)) => out,
            // Still open (a background child holds it) or the task failed: what was read is
            // lost with the task; say so rather than wait.
            _ => Output { kept: b"(output still open after the hook exited)".to_vec(), total: 0 },
        }
    };
    let (out, err) = (output(stdout).await, output(stderr).await);
    for (stream, o) in [("stdout", &out), ("stderr", &err)] {
        if o.total > OUTPUT_LIMIT as u64 {
            warn!(
                hook = name,
                stream,
                bytes = o.total,
                kept = OUTPUT_LIMIT,
                "hook output truncated"
            );
        }
    }
    let (out, err) = (String::from_utf8_lossy(&out.kept), String::from_utf8_lossy(&err.kept));
    match status {
        Ok(s) if s.success() => {
            info!(hook = name, %cmd, rerun, stdout = %out.trim(), stderr = %err.trim(), "hook ran");
            true
        }
        Ok(s) => {
            warn!(hook = name, %cmd, rerun, status = %s, stdout = %out.trim(), stderr = %err.trim(), "hook failed");
            false
        }
        Err(e) => {
            warn!(hook = name, %cmd, rerun, error = %e, "waiting for the hook failed");
            false
        }
    }
}

/// What was read from one output pipe.
struct Output {
    /// The first [`OUTPUT_LIMIT`] bytes.
    kept: Vec<u8>,
    /// Every byte read.
    total: u64,
}

/// Reads `pipe` to its end, keeping the first [`OUTPUT_LIMIT`] bytes and discarding the rest.
async fn read_bounded(pipe: Option<impl AsyncRead + Unpin>) -> Output {
    let mut out = Output { kept: Vec::new(), total: 0 };
    let Some(mut pipe) = pipe else { return out };
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return out,
            Ok(n) => {
                let room = OUTPUT_LIMIT.saturating_sub(out.kept.len()).min(n);
                out.kept.extend_from_slice(&buf[..room]);
                out.total += n as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn runs() -> Vec<HookRun> {
        vec![
            HookRun {
                kind: HookKind::SubnetChange,
                old: Some("10.244.1.0/24".parse().unwrap()),
                new: Some("10.244.2.0/24".parse().unwrap()),
                reason: "subnet-changed",
                holder: None,
            },
            HookRun {
                kind: HookKind::LeaseLost,
                old: Some("10.244.2.0/24".parse().unwrap()),
                new: None,
                reason: "taken-by-another-node",
                holder: Some(IpAddr::from([192, 0, 2, 2])),
            },
        ]
    }

    #[test]
    fn journal_round_trips() {
        let text = render(&runs());
        assert_eq!(
            text,
            "on-subnet-change old=10.244.1.0/24 new=10.244.2.0/24 reason=subnet-changed holder=\n\
             on-lease-lost old=10.244.2.0/24 new= reason=taken-by-another-node holder=192.0.2.2\n"
        );
        let back: Vec<HookRun> = parse(&text).into_iter().map(Result::unwrap).collect();
        assert_eq!(back, runs());
    }

    #[test]
    fn bad_journal_lines_are_named_and_skipped() {
        let text = "on-subnet-change old=10.244.1.0/24 new=10.244.2.0/24 reason=subnet-changed holder=\n\
                    \n\
                    rm -rf / old= new= reason=subnet-changed holder=\n\
                    on-lease-lost old=10.244.2.0/24 new= reason=whatever holder=\n\
                    on-lease-lost old=10.244.2.0/24 new= reason=identity-clash\n\
                    on-lease-lost old=nope new= reason=identity-clash holder=\n";
        let got = parse(text);
        assert_eq!(got.len(), 5);
        assert!(got[0].is_ok());
        let errs: Vec<String> =
            got[1..].iter().map(|r| r.clone().unwrap_err().to_string()).collect();
        assert_eq!(
            errs,
            [
                "line 3: not a hook name",
                "line 4: unknown reason",
                "line 5: holder: missing",
                "line 6: old: not a subnet",
            ]
        );
    }

    #[tokio::test]
    async fn output_is_kept_up_to_the_limit_and_drained() {
        let data = vec![b'x'; 3 * OUTPUT_LIMIT + 7];
        let out = read_bounded(Some(&data[..])).await;
        assert_eq!(out.kept.len(), OUTPUT_LIMIT);
        assert_eq!(out.total, data.len() as u64);
        let out = read_bounded(Some(&b"short"[..])).await;
        assert_eq!((out.kept.as_slice(), out.total), (&b"short"[..], 5));
    }

    proptest! {
        #[test]
        fn parse_never_panics(text in any::<String>()) {
            let _ = parse(&text);
        }
    }
}
