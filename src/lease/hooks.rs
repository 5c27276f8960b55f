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
//! - The journal is bounded where it is written, so that a restart reads all of it back: it
//!   holds at most [`MAX_OWED`] runs, whose lines fit in [`MAX_JOURNAL_LEN`], the most read
//!   back. A run recorded while that many are owed (a hook that hangs until its timeout while
//!   the lease flaps) makes room: the oldest subnet-change run that a newer subnet-change run
//!   supersedes goes first (the newer one names this node's subnet as it is), else the oldest
//!   run; never the one running. A run dropped is dropped for good (not run now, not re-run
//!   after a restart: what runs is what a restart would run), logged at WARN with what it was
//!   and why, and counted (`weft_hook_runs_dropped_total`).
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
use tracing::{debug, info, warn};

use super::record::Subnet;
use super::status::{LeaseCounters, LeaseHealth};
use crate::atomic_file;

/// The journal's name in the state dir.
pub(crate) const PENDING_FILE: &str = "hook-pending";
/// How much of each of stdout and stderr is kept.
pub(crate) const OUTPUT_LIMIT: usize = 64 * 1024;
/// `PATH` for hooks when weft has none.
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long output is still read after the shell exited.
pub(crate) const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// The longest journal read back at start.
const MAX_JOURNAL_LEN: u64 = 64 * 1024;
/// The most hook runs owed at once (see the module docs).
pub(crate) const MAX_OWED: usize = 256;
/// A bound on one journal line: the tests check every line [`render`] can make against it.
const MAX_LINE: usize = 200;
// The journal written always fits in what is read back.
const _: () = assert!(MAX_OWED * MAX_LINE <= MAX_JOURNAL_LEN as usize);

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

/// A queued run: the journal entry it runs (whose run it reads when it starts, so that a
/// run dropped from the journal meanwhile does not run).
struct Job {
    id: u64,
    rerun: bool,
}

/// Runs hooks one at a time on a task of its own, keeping the journal.
pub(crate) struct HookRunner {
    cfg: Arc<HookConfig>,
    journal: Arc<Journal>,
    health: Arc<LeaseHealth>,
    tx: mpsc::UnboundedSender<Job>,
}

impl HookRunner {
    /// Starts the runner task, and queues again every hook the journal lists. Must be called
    /// inside a tokio runtime.
    pub(crate) fn start(cfg: HookConfig, health: Arc<LeaseHealth>) -> Self {
        let cfg = Arc::new(cfg);
        let (journal, dropped) = Journal::load(&cfg.journal);
        let journal = Arc::new(journal);
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_queue(rx, cfg.clone(), journal.clone(), health.clone()));
        let runner = Self { cfg, journal, health, tx };
        runner.tell_dropped(dropped);
        for (id, run) in runner.journal.queue_all() {
            if runner.cfg.command(run.kind).is_some() {
                info!(hook = run.kind.name(), old = ?run.old, new = ?run.new, reason = run.reason,
                    "re-running a hook that did not complete before weft stopped");
                let _ = runner.tx.send(Job { id, rerun: true });
            } else {
                info!(
                    hook = run.kind.name(),
                    "dropping a pending hook whose flag is no longer given"
                );
                runner.journal.done(id);
            }
        }
        runner
    }

    /// Logs and counts runs dropped from the journal to keep it bounded.
    fn tell_dropped(&self, dropped: Vec<Dropped>) {
        for Dropped { run, why } in dropped {
            LeaseCounters::inc(&self.health.counters.hook_runs_dropped);
            warn!(hook = run.kind.name(), old = ?run.old, new = ?run.new, reason = run.reason,
                owed = MAX_OWED, "dropped an owed hook run, which will not run: {why}");
        }
    }

    /// Whether a command is configured for `kind`.
    pub(crate) fn configured(&self, kind: HookKind) -> bool {
        self.cfg.command(kind).is_some()
    }

    /// Records `run` in the journal (before what it reports becomes visible); a no-op when no
    /// command is configured for it.
    pub(crate) fn record(&self, run: &HookRun) {
        if self.configured(run.kind) {
            let dropped = self.journal.record(run.clone());
            self.tell_dropped(dropped);
        }
    }

    /// Queues a [`HookRunner::record`]ed run: the oldest recorded run equal to it not queued
    /// yet. One that was dropped from the journal meanwhile (logged then) is not queued.
    pub(crate) fn start_run(&self, run: HookRun) {
        if self.configured(run.kind) {
            match self.journal.queue(&run) {
                Some(id) => {
                    let _ = self.tx.send(Job { id, rerun: false });
                }
                None => debug!(hook = run.kind.name(), old = ?run.old, new = ?run.new,
                    "not starting a hook run that is no longer owed"),
            }
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
    owed: Mutex<Owed>,
}

/// The runs owed, oldest first, at most [`MAX_OWED`].
#[derive(Default)]
struct Owed {
    entries: Vec<Entry>,
    next_id: u64,
}

/// One run owed.
struct Entry {
    /// Its own, for as long as this process runs (a restart numbers them afresh).
    id: u64,
    run: HookRun,
    /// Sent to the runner's queue.
    queued: bool,
    /// Started by the runner: never dropped to make room.
    running: bool,
}

/// A run dropped from the journal to keep it bounded, and why.
struct Dropped {
    run: HookRun,
    why: &'static str,
}

impl Owed {
    fn push(&mut self, run: HookRun) {
        let id = self.next_id;
        self.next_id += 1;
        self.entries.push(Entry { id, run, queued: false, running: false });
    }

    /// Drops runs until at most [`MAX_OWED`] are owed: the oldest subnet-change run that a
    /// newer one supersedes, else the oldest run; never the one running.
    fn make_room(&mut self) -> Vec<Dropped> {
        let mut dropped = Vec::new();
        while self.entries.len() > MAX_OWED {
            let is_change = |e: &Entry| e.run.kind == HookKind::SubnetChange;
            let newest_change = self.entries.iter().rposition(is_change);
            let superseded = self
                .entries
                .iter()
                .enumerate()
                .position(|(i, e)| !e.running && is_change(e) && newest_change > Some(i));
            let (i, why) = match superseded {
                Some(i) => (i, "a newer subnet change supersedes it, and the journal was full"),
                None => match self.entries.iter().position(|e| !e.running) {
                    Some(i) => (i, "the journal was full, and it was the oldest run owed"),
                    None => break,
                },
            };
            let entry = self.entries.remove(i);
            dropped.push(Dropped { run: entry.run, why });
        }
        dropped
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.entries.iter().position(|e| e.id == id)
    }
}

impl Journal {
    /// The journal in `path` (absent: none owed), and the runs dropped from it if it lists
    /// more than [`MAX_OWED`] (a file written by hand).
    fn load(path: &Path) -> (Self, Vec<Dropped>) {
        let runs: Vec<HookRun> = match atomic_file::read(path, MAX_JOURNAL_LEN) {
            Ok(None) => Vec::new(),
            Ok(Some(bytes)) => parse(&String::from_utf8_lossy(&bytes))
                .into_iter()
                .filter_map(|r| {
                    r.map_err(|e| warn!(path = %path.display(), error = %e, "skipping an unreadable pending-hook line"))
                        .ok()
                })
                .collect(),
            Err(e) => {
                warn!(error = %e, "ignoring the pending-hook file: the hooks it lists are not re-run");
                Vec::new()
            }
        };
        let mut owed = Owed::default();
        for run in runs {
            owed.push(run);
        }
        let dropped = owed.make_room();
        let journal = Self { path: path.to_owned(), owed: Mutex::new(owed) };
        if !dropped.is_empty() {
            journal.save(&journal.lock());
        }
        (journal, dropped)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Owed> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every run owed, oldest first.
    #[cfg(test)]
    fn runs(&self) -> Vec<HookRun> {
        self.lock().entries.iter().map(|e| e.run.clone()).collect()
    }

    /// Marks every run owed queued; their IDs and runs, oldest first.
    fn queue_all(&self) -> Vec<(u64, HookRun)> {
        let mut owed = self.lock();
        owed.entries
            .iter_mut()
            .map(|e| {
                e.queued = true;
                (e.id, e.run.clone())
            })
            .collect()
    }

    /// Records `run` as owed, making room if needed; the runs dropped for it.
    fn record(&self, run: HookRun) -> Vec<Dropped> {
        let mut owed = self.lock();
        owed.push(run);
        let dropped = owed.make_room();
        self.save(&owed);
        dropped
    }

    /// Marks the oldest run equal to `run` not queued yet queued; its ID.
    fn queue(&self, run: &HookRun) -> Option<u64> {
        let mut owed = self.lock();
        let entry = owed.entries.iter_mut().find(|e| !e.queued && e.run == *run)?;
        entry.queued = true;
        Some(entry.id)
    }

    /// Marks run `id` running and returns it, if it is still owed.
    fn begin(&self, id: u64) -> Option<HookRun> {
        let mut owed = self.lock();
        let i = owed.position(id)?;
        owed.entries[i].running = true;
        Some(owed.entries[i].run.clone())
    }

    /// Run `id` has finished, however it ended: no longer owed.
    fn done(&self, id: u64) {
        let mut owed = self.lock();
        if let Some(i) = owed.position(id) {
            owed.entries.remove(i);
        }
        self.save(&owed);
    }

    /// Best effort: a journal that cannot be written only loses the re-run after a crash.
    fn save(&self, owed: &Owed) {
        let result = if owed.entries.is_empty() {
            match std::fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
                _ => Ok(()),
            }
        } else {
            let runs: Vec<HookRun> = owed.entries.iter().map(|e| e.run.clone()).collect();
            atomic_file::write(&self.path, render(&runs).as_bytes(), atomic_file::PRIVATE_MODE)
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
    health: Arc<LeaseHealth>,
) {
    while let Some(job) = rx.recv().await {
        // Dropped from the journal since it was queued (logged and counted then).
        let Some(run) = journal.begin(job.id) else { continue };
        let Some(cmd) = cfg.command(run.kind) else {
            journal.done(job.id);
            continue;
        };
        let ok = run_one(cmd, &run, job.rerun, cfg.timeout).await;
        if !ok {
            LeaseCounters::inc(&health.counters.hook_failures);
        }
        journal.done(job.id);
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

    /// The longest line [`render`] can make: both subnets and the holder as long as their
    /// text gets, the longest hook name and reason.
    #[test]
    fn every_journal_line_fits_the_bound_the_journal_is_sized_by() {
        let v6: Subnet = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe/127".parse().unwrap();
        let holder: IpAddr = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap();
        for kind in [HookKind::SubnetChange, HookKind::LeaseLost] {
            for reason in REASONS {
                let run =
                    HookRun { kind, old: Some(v6), new: Some(v6), reason, holder: Some(holder) };
                let line = render(&[run]);
                assert!(line.len() <= MAX_LINE, "{} bytes: {line}", line.len());
            }
        }
    }

    fn lost(i: usize) -> HookRun {
        HookRun {
            kind: HookKind::LeaseLost,
            old: Some(format!("10.{}.{}.0/24", i / 256, i % 256).parse().unwrap()),
            new: None,
            reason: "taken-by-another-node",
            holder: Some("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap()),
        }
    }

    fn change(i: usize) -> HookRun {
        HookRun {
            kind: HookKind::SubnetChange,
            old: Some(format!("10.{}.{}.0/24", i / 256, i % 256).parse().unwrap()),
            new: Some(format!("10.{}.{}.0/24", (i + 1) / 256, (i + 1) % 256).parse().unwrap()),
            reason: "subnet-changed",
            holder: None,
        }
    }

    /// Appending far more runs than the journal holds never makes a file larger than a
    /// restart reads, and a restart reads back every run still owed. Room is made first by
    /// dropping subnet changes a newer one supersedes, then the oldest runs; each drop is
    /// reported with why.
    #[test]
    fn the_journal_never_outgrows_what_a_restart_reads_and_a_restart_reads_it_all_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PENDING_FILE);
        let (journal, dropped) = Journal::load(&path);
        assert!(dropped.is_empty());
        // Records each run, checking the file's size each time; what was dropped.
        let record = |runs: &mut dyn Iterator<Item = HookRun>| {
            let mut dropped = Vec::new();
            for run in runs {
                dropped.extend(journal.record(run));
                let len = std::fs::metadata(&path).unwrap().len();
                assert!(len <= MAX_JOURNAL_LEN, "{len} bytes");
            }
            dropped
        };
        // 200 lease losses, then 300 subnet changes: the older changes make room.
        let mut dropped = record(&mut (0..200).map(lost));
        dropped.extend(record(&mut (0..300).map(change)));
        let mut want: Vec<HookRun> = (0..200).map(lost).chain((244..300).map(change)).collect();
        assert_eq!(journal.runs(), want);
        assert!(dropped.iter().all(|d| d.why.contains("supersedes")));
        let runs = |d: &[Dropped]| d.iter().map(|d| d.run.clone()).collect::<Vec<_>>();
        assert_eq!(runs(&dropped), (0..244).map(change).collect::<Vec<_>>());
        // 100 more losses: the superseded changes go first, then the oldest losses; the
        // newest change stays.
        let dropped = record(&mut (200..300).map(lost));
        want = (45..300).map(lost).collect();
        want.insert(155, change(299));
        assert_eq!(journal.runs(), want);
        let (superseded, oldest): (Vec<Dropped>, Vec<Dropped>) =
            dropped.into_iter().partition(|d| d.why.contains("supersedes"));
        assert_eq!(runs(&superseded), (244..299).map(change).collect::<Vec<_>>());
        assert_eq!(runs(&oldest), (0..45).map(lost).collect::<Vec<_>>());
        // A restart reads back every run owed, in order.
        let (again, dropped) = Journal::load(&path);
        assert!(dropped.is_empty());
        assert_eq!(again.runs(), want);
        assert_eq!(again.runs().len(), MAX_OWED);
    }

    /// A journal listing more than [`MAX_OWED`] runs (written by hand) is cut to size at
    /// start, the dropped runs reported, and the file rewritten.
    #[test]
    fn an_oversized_journal_is_cut_to_size_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PENDING_FILE);
        let runs: Vec<HookRun> = (0..300).map(change).collect();
        let text = render(&runs);
        assert!(text.len() as u64 <= MAX_JOURNAL_LEN);
        std::fs::write(&path, text).unwrap();
        let (journal, dropped) = Journal::load(&path);
        assert_eq!(dropped.len(), 300 - MAX_OWED);
        assert_eq!(journal.runs(), runs[300 - MAX_OWED..]);
        assert_eq!(Journal::load(&path).0.runs(), runs[300 - MAX_OWED..]);
    }

    /// Through the runner: the run in progress is never dropped; 300 runs owed behind it
    /// keep 255, drop the 44 oldest, which never run, and count them; the rest run in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_dropped_to_keep_the_journal_bounded_never_run_and_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let cmd = format!(
            "echo \"$1\" >> {d}/started; while [ ! -e {d}/gate ]; do sleep 0.01; done; \
             echo \"$1\" >> {d}/ran"
        );
        let health = Arc::new(LeaseHealth::new(Arc::new(crate::time::ManualClock::new())));
        let cfg = HookConfig {
            on_subnet_change: None,
            on_lease_lost: Some(cmd),
            timeout: Duration::from_secs(60),
            journal: dir.path().join(PENDING_FILE),
        };
        let runner = HookRunner::start(cfg, health.clone());
        let lines = |name: &str| {
            std::fs::read_to_string(dir.path().join(name))
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let old = |i: usize| lost(i).old.unwrap().to_string();
        runner.run(lost(0));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while lines("started").is_empty() {
            assert!(std::time::Instant::now() < deadline, "the first hook did not start");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for i in 1..300 {
            runner.run(lost(i));
        }
        assert_eq!(
            health.counters.hook_runs_dropped.load(std::sync::atomic::Ordering::Relaxed),
            44
        );
        let (restarted, _) = Journal::load(&dir.path().join(PENDING_FILE));
        let owed: Vec<HookRun> = std::iter::once(0).chain(45..300).map(lost).collect();
        assert_eq!(restarted.runs(), owed, "a restart now would run these");
        std::fs::write(dir.path().join("gate"), "").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while dir.path().join(PENDING_FILE).exists() {
            assert!(std::time::Instant::now() < deadline, "{} ran", lines("ran").len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let want: Vec<String> = std::iter::once(0).chain(45..300).map(old).collect();
        assert_eq!(lines("ran"), want);
        assert_eq!(health.counters.hook_failures.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    proptest! {
        #[test]
        fn parse_never_panics(text in any::<String>()) {
            let _ = parse(&text);
        }
    }
}
