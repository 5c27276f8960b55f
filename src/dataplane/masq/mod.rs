//! Masquerading (`--ip-masq`): keeps weft's nftables tables as [`plan`] wants them for
//! this host's lease. The driver: the only module that talks nf_tables to the kernel (over a
//! `NETLINK_NETFILTER` socket, [`nft`] encodes the messages), with `CAP_NET_ADMIN` alone, no
//! `nft` binary.
//!
//! Contract:
//! - [`Masquerade::sync`] reads weft's tables (`table ip weft`, `table ip6 weft`; no other
//!   table is read for more than its name, none is ever written), plans, and writes the whole
//!   ruleset in one transaction when it differs: a first install, a new lease (the old rules
//!   stay until the new ones replace them in the same commit), or drift (a table, chain or rule
//!   someone deleted or changed). The daemon runs it when the lease changes and every
//!   `--iptables-resync`.
//! - Said once: a first install and a rewrite for a new lease at INFO; a repair at WARN, each
//!   time (each ends a drift), counted in `weft_masq_repairs_total`; a failure (no nf_tables
//!   in the kernel, no `CAP_NET_ADMIN`, a refused transaction) at ERROR once until it works
//!   again, each failed attempt counted in `weft_masq_failures_total`, and named by
//!   [`MasqStats::problem`] (the daemon's `/readyz` reason) until it works. Forwarding never
//!   depends on it.
//! - Ownership: a table carries the comment `weft node <node-id>`. The same node (a restart,
//!   a takeover, an in-place upgrade) adopts its table as it is; a table of another node's (a
//!   second weft beside this one, on another state dir) is left alone, said once at ERROR; a
//!   table without the comment (made by hand) is replaced. [`Masquerade::remove`] (a clean
//!   exit that hands nothing over) deletes this node's tables and any without the comment (a
//!   kernel before 5.13 keeps no table comment), never another node's.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use netlink_sys::Socket;
use netlink_sys::constants::NETLINK_NETFILTER;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing::{error, info, warn};

use nft::Dump;
use plan::{Family, Inputs, Plan, Table};

use crate::lease::record::LeaseName;
use crate::metrics;

mod nft;
pub(crate) mod plan;

/// What masquerading needs to start.
#[derive(Clone, Debug)]
pub(crate) struct MasqConfig {
    /// The networks and flags ([`Inputs`] without the lease).
    pub(crate) inputs: Inputs,
    /// This node's ID: the owner comment of its tables.
    pub(crate) node: String,
}

/// Masquerading's metrics and readiness.
#[derive(Debug, Default)]
pub(crate) struct MasqStats {
    rules: AtomicU64,
    repairs: AtomicU64,
    failures: AtomicU64,
    installed: AtomicBool,
    problem: Mutex<Option<String>>,
}

impl MasqStats {
    /// Why the rules are not in place, while they are not (for `/readyz`).
    pub(crate) fn problem(&self) -> Option<String> {
        self.problem.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn set_problem(&self, p: Option<String>) {
        *self.problem.lock().unwrap_or_else(PoisonError::into_inner) = p;
    }
}

impl Collector for MasqStats {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::gauge(
            &mut e,
            "weft_masq_installed",
            "1 while weft's masquerade tables are in place as wanted (--ip-masq).",
            u64::from(self.installed.load(Ordering::Relaxed)),
        )?;
        metrics::gauge(
            &mut e,
            "weft_masq_rules",
            "Rules in weft's masquerade and forward-accept tables.",
            self.rules.load(Ordering::Relaxed),
        )?;
        metrics::counter(
            &mut e,
            "weft_masq_repairs_total",
            "Times weft's nftables tables were put back after someone deleted or changed them.",
            self.repairs.load(Ordering::Relaxed),
        )?;
        metrics::counter(
            &mut e,
            "weft_masq_failures_total",
            "Attempts to read or write weft's nftables tables that failed.",
            self.failures.load(Ordering::Relaxed),
        )
    }
}

/// Why talking to nf_tables failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NftError {
    /// A socket call failed.
    #[error("{what}: {source}{}", hint(source.raw_os_error()))]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
    /// The kernel refused a request.
    #[error("{what}: the kernel refused it: {}{}", io::Error::from_raw_os_error(*errno), hint(Some(*errno)))]
    Refused {
        /// What was being done.
        what: &'static str,
        /// The errno.
        errno: i32,
    },
    /// A reply could not be read.
    #[error("{what}: {detail}")]
    Reply {
        /// What was being done.
        what: &'static str,
        /// What was wrong.
        detail: String,
    },
}

/// What an errno most likely means here.
fn hint(errno: Option<i32>) -> &'static str {
    match errno {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            " (weft needs CAP_NET_ADMIN for its nftables tables)"
        }
        Some(libc::EPROTONOSUPPORT) | Some(libc::EAFNOSUPPORT) => {
            " (the kernel has no nf_tables: CONFIG_NF_TABLES, module nf_tables)"
        }
        Some(libc::ENOENT) | Some(libc::EOPNOTSUPP) => {
            " (the kernel lacks part of nf_tables: the nat chain or masquerade, modules nft_chain_nat and nft_masq)"
        }
        _ => "",
    }
}

/// What [`Masquerade::sync`] remembers between runs.
#[derive(Debug, Default)]
struct State {
    lease: Option<LeaseName>,
    /// What this process last found in place or wrote.
    last: Option<Vec<Table>>,
    /// A failure already said at ERROR (its text).
    failing: Option<String>,
}

/// weft's masquerade tables (see the module docs).
#[derive(Debug)]
pub(crate) struct Masquerade {
    cfg: MasqConfig,
    seq: AtomicU32,
    state: Mutex<State>,
    /// Metrics and readiness, for the health server.
    pub(crate) stats: std::sync::Arc<MasqStats>,
}

const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

impl Masquerade {
    /// Starts on `lease` (none yet: nothing is installed until one comes).
    pub(crate) fn new(cfg: MasqConfig, lease: Option<LeaseName>) -> Self {
        Self {
            cfg,
            seq: AtomicU32::new(1),
            state: Mutex::new(State { lease, ..State::default() }),
            stats: std::sync::Arc::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This host's lease: the rules name its subnets.
    pub(crate) fn set_lease(&self, lease: Option<LeaseName>) {
        self.state().lease = lease;
    }

    fn wanted(&self, lease: Option<LeaseName>) -> Vec<Table> {
        let inputs = Inputs {
            subnet: lease.and_then(|l| l.subnet.v4()),
            subnet6: lease.and_then(|l| l.ipv6).map(|s| s.net()),
            ..self.cfg.inputs
        };
        plan::wanted(&inputs)
    }

    /// Puts weft's tables as wanted (see the module docs); returns whether it is failing.
    /// Blocking.
    pub(crate) fn sync(&self) -> bool {
        let mut st = self.state();
        if st.lease.is_none() {
            // Before the first lease (or while it is being replaced) the tables stay as they
            // are: a restart's old rules go on masquerading until the lease is known.
            return false;
        }
        let wanted = self.wanted(st.lease);
        let result = self.read().and_then(|seen| {
            let plan = plan::plan(&wanted, &seen, &self.cfg.node);
            if let Plan::Install { .. } = plan {
                let remove: Vec<Family> = seen
                    .iter()
                    .map(|t| t.family)
                    .filter(|f| !wanted.iter().any(|w| w.family == *f))
                    .collect();
                let seq = self.next_seq(64);
                self.transact(
                    nft::install(&wanted, &remove, &self.cfg.node, seq),
                    "writing weft's nftables tables",
                )?;
            }
            Ok(plan)
        });
        match result {
            Ok(Plan::Foreign { owners }) => {
                let owners: Vec<String> = owners
                    .iter()
                    .map(|(f, node)| format!("table {} {} of node {node}", f.name(), plan::TABLE))
                    .collect();
                let why = format!(
                    "another weft's masquerade table is in place ({}): left alone, this host's rules are not installed (delete it if that weft is gone: nft delete table ip {})",
                    owners.join(", "),
                    plan::TABLE
                );
                self.failed(&mut st, why);
                true
            }
            Ok(plan) => {
                self.succeeded(&mut st, plan, wanted);
                false
            }
            Err(e) => {
                self.failed(&mut st, format!("masquerading (--ip-masq) is not in place: {e}"));
                true
            }
        }
    }

    fn failed(&self, st: &mut State, why: String) {
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        self.stats.installed.store(false, Ordering::Relaxed);
        if st.failing.as_deref() != Some(why.as_str()) {
            error!("{why}; forwarding goes on without it, retried every resync");
            st.failing = Some(why.clone());
        }
        self.stats.set_problem(Some(why));
    }

    fn succeeded(&self, st: &mut State, plan: Plan, wanted: Vec<Table>) {
        let after_failing = st.failing.take().is_some();
        let rules: usize = wanted.iter().map(Table::rule_count).sum();
        let families: Vec<&str> = wanted.iter().map(|t| t.family.name()).collect();
        let subnet = st.lease.map(|l| l.subnet.to_string()).unwrap_or_default();
        match plan {
            Plan::Install { drift } => {
                let changed = st.last.as_ref() != Some(&wanted);
                if wanted.is_empty() {
                    info!("weft's masquerade tables removed: no lease to masquerade for");
                } else if changed && (drift.is_empty() || st.last.is_some()) {
                    info!(rules, families = %families.join(", "), %subnet, after_failing, "masquerade rules for {subnet} installed in table {} {} (one transaction)", families.join("/"), plan::TABLE);
                } else if changed {
                    warn!(drift = %drift.join("; "), after_failing, "weft's masquerade table was not as wanted: rewrote it for {subnet}");
                } else {
                    self.stats.repairs.fetch_add(1, Ordering::Relaxed);
                    let what =
                        if drift.is_empty() { "was gone".to_owned() } else { drift.join("; ") };
                    warn!(what = %what, "weft's masquerade rules were changed by someone else ({what}): put them back");
                }
            }
            Plan::Nothing if st.last.is_none() && !wanted.is_empty() => {
                info!(rules, %subnet, after_failing, "masquerade rules for {subnet} already in place (table {} {}): adopted", families.join("/"), plan::TABLE);
            }
            Plan::Nothing | Plan::Foreign { .. } => {
                if after_failing {
                    info!("masquerade rules in place again");
                }
            }
        }
        self.stats.rules.store(rules as u64, Ordering::Relaxed);
        self.stats.installed.store(!wanted.is_empty(), Ordering::Relaxed);
        self.stats.set_problem(None);
        st.last = Some(wanted);
    }

    /// Deletes this node's tables (a clean exit that hands nothing over). Blocking.
    pub(crate) fn remove(&self) {
        let result = self.read().and_then(|seen| {
            let mine: Vec<Family> = seen
                .iter()
                .filter(|t| t.owner.as_deref().is_none_or(|o| o == self.cfg.node))
                .map(|t| t.family)
                .collect();
            if !mine.is_empty() {
                let seq = self.next_seq(8);
                self.transact(nft::remove(&mine, seq), "deleting weft's nftables tables")?;
            }
            Ok(mine)
        });
        match result {
            Ok(mine) if !mine.is_empty() => info!("removed weft's masquerade tables"),
            Ok(_) => {}
            Err(e) => warn!(error = %e, "could not remove weft's masquerade tables"),
        }
        self.stats.installed.store(false, Ordering::Relaxed);
    }

    fn next_seq(&self, n: u32) -> u32 {
        self.seq.fetch_add(n, Ordering::Relaxed)
    }

    fn open(what: &'static str) -> Result<Socket, NftError> {
        let io = |source| NftError::Io { what, source };
        // A kernel without nf_tables, for the end-to-end tests (the `fault-injection` feature).
        #[cfg(feature = "fault-injection")]
        if std::env::var_os("WEFT_FAULT_NO_NFTABLES").is_some() {
            return Err(io(io::Error::from_raw_os_error(libc::EPROTONOSUPPORT)));
        }
        let mut s = Socket::new(NETLINK_NETFILTER).map_err(io)?;
        s.bind_auto().map_err(io)?;
        socket2::SockRef::from(&s).set_read_timeout(Some(REPLY_TIMEOUT)).map_err(io)?;
        Ok(s)
    }

    fn recv(s: &Socket, what: &'static str) -> Result<Vec<u8>, NftError> {
        let mut buf = Vec::with_capacity(1 << 16);
        let n = s.recv(&mut buf, 0).map_err(|source| NftError::Io { what, source })?;
        if n >= buf.capacity() {
            return Err(NftError::Reply { what, detail: "a reply too large to read".into() });
        }
        buf.truncate(n);
        Ok(buf)
    }

    /// Sends a batch and waits for every ack; the first error the kernel gives.
    fn transact(&self, req: nft::Request, what: &'static str) -> Result<(), NftError> {
        let s = Self::open(what)?;
        s.send(&req.bytes, 0).map_err(|source| NftError::Io { what, source })?;
        let mut pending: Vec<u32> = req.acks;
        let mut first_error = None;
        while !pending.is_empty() {
            let buf = match Self::recv(&s, what) {
                Ok(b) => b,
                // The kernel answered the failing message; what it leaves unanswered after
                // an abort is no news.
                Err(_) if first_error.is_some() => break,
                Err(e) => return Err(e),
            };
            let msgs =
                nft::messages(&buf).map_err(|e| NftError::Reply { what, detail: e.to_string() })?;
            for m in msgs {
                if let Some(errno) = m.error() {
                    pending.retain(|&s| s != m.seq);
                    if errno != 0 && first_error.is_none() {
                        first_error = Some(-errno);
                    }
                }
            }
        }
        match first_error {
            Some(errno) => Err(NftError::Refused { what, errno }),
            None => Ok(()),
        }
    }

    /// One dump's messages (their bytes, one datagram each).
    fn dump(&self, s: &Socket, what: Dump, family: Family) -> Result<Vec<Vec<u8>>, NftError> {
        let label = "reading weft's nftables tables";
        let seq = self.next_seq(1);
        s.send(&nft::dump(what, family, seq), 0)
            .map_err(|source| NftError::Io { what: label, source })?;
        let mut out = Vec::new();
        loop {
            let buf = Self::recv(s, label)?;
            let msgs = nft::messages(&buf)
                .map_err(|e| NftError::Reply { what: label, detail: e.to_string() })?;
            let mut done = false;
            for m in msgs.iter().filter(|m| m.seq == seq) {
                if m.ty == nft::NLMSG_DONE {
                    done = true;
                } else if let Some(errno) = m.error().filter(|&e| e != 0) {
                    return Err(NftError::Refused { what: label, errno: -errno });
                }
            }
            out.push(buf);
            if done {
                return Ok(out);
            }
        }
    }

    /// weft's tables as the kernel has them.
    fn read(&self) -> Result<Vec<plan::SeenTable>, NftError> {
        let s = Self::open("reading weft's nftables tables")?;
        let (mut tables, mut chains, mut rules) = (Vec::new(), Vec::new(), Vec::new());
        for family in [Family::Ip, Family::Ip6] {
            let before = tables.len();
            for buf in self.dump(&s, Dump::Tables, family)? {
                let msgs = nft::messages(&buf).unwrap_or_default();
                tables.extend(
                    msgs.iter().filter_map(nft::decode_table).filter(|t| t.1 == plan::TABLE),
                );
            }
            if tables.len() == before {
                continue;
            }
            for buf in self.dump(&s, Dump::Chains, family)? {
                let msgs = nft::messages(&buf).unwrap_or_default();
                chains.extend(
                    msgs.iter().filter_map(nft::decode_chain).filter(|c| c.1 == plan::TABLE),
                );
            }
            for buf in self.dump(&s, Dump::Rules, family)? {
                let msgs = nft::messages(&buf).unwrap_or_default();
                rules.extend(
                    msgs.iter().filter_map(nft::decode_rule).filter(|r| r.1 == plan::TABLE),
                );
            }
        }
        Ok(nft::seen_tables(&tables, &chains, &rules))
    }
}
