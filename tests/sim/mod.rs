//! A deterministic world for the lease simulation (docs/scenarios.md, "Test levels", 1).
//!
//! One [`ManualClock`], one [`MemoryStore`] (an etcd model), and named simulated hosts. The
//! shape follows quinn's `Pair` harness: the world owns the clock and every party, [`World::step`]
//! lets each party act once, and [`World::advance`] moves time from deadline to deadline and
//! steps until everyone is quiet. Faults — suspend, partition, store outage, lost replies,
//! compaction, an operator's revoke — are plain operations on the world.
//!
//! A host has a persistent part (node ID, `subnet.env`, public IP: what survives a restart or is
//! copied by a clone) and a process part (a running weft [`Keeper`] driven the way
//! [`weft::lease::driver::LeaseDriver`] drives it, or a [`FlannelProc`] modelling flanneld's etcd
//! v3 subnet manager for the baseline comparison).
//!
//! After every step the world checks the invariant of docs/scenarios.md — no subnet with two
//! live holders, no write to a key carrying another node's identity — and records each
//! violation with the seed and the time; [`World::report`] adds a readable trace of the schedule.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use futures::executor::block_on;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use weft::config::NetworkConfig;
use weft::daemon::lease_attrs;
use weft::lease::driver::execute;
use weft::lease::keeper::{Action, Keeper, KeeperConfig, KeeperEvent};
use weft::lease::memory::{
    EXPIRY_CLIENT, MemoryClient, MemoryStore, RAW_CLIENT, WriteKind, WriteRecord, drain_ready,
};
use weft::lease::record::{
    Incarnation, LeaseAttrs, LeaseName, NodeId, Revision, StoredLease, Subnet,
};
use weft::lease::store::{
    CreateOutcome, LeaseFeed, Store, StoreError, WatchBatch, WatchEvent, WatchStream,
};
use weft::time::{Clock, Instant, ManualClock};

/// The etcd prefix every simulated host uses.
pub const PREFIX: &str = "/coreos.com/network";
/// The subnet lease TTL of the simulation (tests use seconds, not hours).
pub const TTL: Duration = Duration::from_secs(4);
/// The default granularity of [`World::advance`].
pub const TICK: Duration = Duration::from_millis(50);
/// The longest the real driver sleeps between looks at its keeper.
const DRIVER_MAX_SLEEP: Duration = Duration::from_secs(1);
/// How long the real driver waits before re-opening a failed own-key watch.
const WATCH_RETRY: Duration = Duration::from_secs(1);
/// Steps at one instant before the world calls it a livelock.
const MAX_STEPS_PER_INSTANT: usize = 2_000;

/// A network of `n` leasable /24 subnets, `10.244.1.0/24` to `10.244.n.0/24`, in a /16.
pub fn network_of(n: u32) -> NetworkConfig {
    assert!((1..=255).contains(&n));
    let json = format!(
        r#"{{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.{n}.0","Backend":{{"Type":"vxlan"}}}}"#
    );
    NetworkConfig::parse(json.as_bytes()).expect("a valid test network")
}

/// [`network_of`], dual-stack: `EnableIPv6` with `fd00:10:244::/56` in /64s (flannel's
/// defaults for the IPv6 range: 255 leasable halves).
pub fn dual_network_of(n: u32) -> NetworkConfig {
    assert!((1..=255).contains(&n));
    let json = format!(
        r#"{{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.{n}.0","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{{"Type":"vxlan"}}}}"#
    );
    NetworkConfig::parse(json.as_bytes()).expect("a valid test network")
}

/// An IPv6-only network (`"EnableIPv4": false`) of `n` leasable /64s, `fd00:10:244:1::/64` to
/// `fd00:10:244:<n>::/64` (hex), in `fd00:10:244::/56`: each lease's subnet is IPv6.
pub fn ipv6_only_network_of(n: u32) -> NetworkConfig {
    assert!((1..=255).contains(&n));
    let json = format!(
        r#"{{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","IPv6SubnetMin":"fd00:10:244:1::","IPv6SubnetMax":"fd00:10:244:{n:x}::","Backend":{{"Type":"vxlan"}}}}"#
    );
    NetworkConfig::parse(json.as_bytes()).expect("a valid test network")
}

/// `10.244.i.0/24`.
pub fn subnet(i: u8) -> Subnet {
    Subnet::from_parts(Ipv4Addr::new(10, 244, i, 0), 24).expect("aligned")
}

/// The public IP the world gives the `i`-th host it creates: `192.0.2.(i+1)`.
pub fn public_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, u8::try_from(i + 1).expect("at most 254 hosts"))
}

/// The full store key of a subnet.
pub fn subnet_key(s: Subnet) -> String {
    format!("{PREFIX}/subnets/{}", s.key_name())
}

/// The full history key of a subnet.
pub fn history_key(s: Subnet) -> String {
    format!("{PREFIX}/weft/history/{}", s.key_name())
}

/// Which daemon a host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Impl {
    /// weft's keeper, driven like `LeaseDriver`.
    Weft,
    /// flanneld's etcd v3 subnet manager (docs/lease-rules.md, "flannel's lease logic"), bugs
    /// included.
    Flannel(FlannelVersion),
}

/// Which flannel lease logic a [`FlannelProc`] models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlannelVersion {
    /// v0.8.0–v0.17 (docs/lease-rules.md, "flannel's lease logic"): a live lease found *by the
    /// previous subnet* is reused with an unconditional put whoever holds it (PR #761; the
    /// #1289 hijack, docs/scenarios.md S3).
    V0_17,
    /// v0.18 and later (PR #1505): `subnet.env` is only used through create-if-absent.
    V0_18,
}

/// One keeper event, when and in which run of its host it happened.
#[derive(Clone, Debug)]
pub struct Logged {
    /// When.
    pub at: Instant,
    /// The host's run (1 for its first start).
    pub run: u32,
    /// The event.
    pub event: KeeperEvent,
}

/// A simulated host: the persistent part (identity, `subnet.env`, public IP) and the process
/// part (at most one running daemon).
pub struct Host {
    /// The host's name (also its store client's name, which faults and the write log use).
    pub name: String,
    /// Which daemon it runs.
    pub imp: Impl,
    /// Its node ID (weft's `--state-dir/node-id`); copied by a clone.
    pub node: NodeId,
    /// Its public IP; a change takes effect at the next start.
    pub public_ip: Ipv4Addr,
    /// Its VTEP MAC.
    pub mac: weft::dataplane::wire::ethernet::MacAddr,
    /// What its `subnet.env` names, rewritten on `Acquired` and `Recovered` as the driver does.
    pub subnet_env: Option<Subnet>,
    /// The running process, if any.
    pub proc: Option<Proc>,
    /// Whether the process is stopped (SIGSTOP): it exists but does not act; time passes.
    pub suspended: bool,
    /// How many times a process was started.
    pub runs: u32,
    /// Processes that ended by themselves (flanneld exits; weft never should).
    pub exits: u32,
    /// Why each exit happened.
    pub exit_reasons: Vec<String>,
    /// `subnet.env` rewrites that named a different subnet than before.
    pub subnet_changes: u32,
    /// Listings its weft processes asked for.
    pub lists: u32,
    /// Writes to a key whose current value another host wrote (see [`World::foreign_writes`]).
    pub foreign_writes: u32,
    /// Every keeper event of every run.
    pub events: Vec<Logged>,
    /// When a supervisor restarts an exited process (`Restart=always`).
    restart_at: Option<Instant>,
}

/// A running daemon.
pub enum Proc {
    /// weft.
    Weft(Box<WeftProc>),
    /// flanneld.
    Flannel(Box<FlannelProc>),
}

/// A weft process: its keeper and what `LeaseDriver` keeps around it (client, own-key watch).
pub struct WeftProc {
    /// The keeper.
    pub keeper: Keeper,
    client: MemoryClient,
    watch: Option<(Subnet, WatchStream)>,
    /// Watch items drained from the stream, delivered one per step as the driver's select does.
    pending: VecDeque<Result<WatchBatch, StoreError>>,
    watch_ended: bool,
    watch_retry_at: Instant,
}

/// flanneld's lease logic against the store, as docs/lease-rules.md ("flannel's lease logic")
/// describes it, with its constants scaled to the simulation's TTL (renew margin TTL/4, renew
/// retry 200 ms).
pub struct FlannelProc {
    client: MemoryClient,
    version: FlannelVersion,
    /// The subnet this process believes it holds (from acquiring until it exits).
    pub lease: Option<Subnet>,
    renew_at: Instant,
    retry_at: Instant,
    watch: Option<WatchStream>,
    pending: VecDeque<Result<WatchBatch, StoreError>>,
    watch_from: Revision,
    watch_retry_at: Instant,
    watch_backoff: Duration,
    /// What the last listing decided, carried out on the next step (so joiners can race).
    chosen: Option<FlannelChoice>,
    rng: StdRng,
}

/// What flannel's `tryAcquireLease` decided from its listing.
#[derive(Clone, Copy)]
enum FlannelChoice {
    /// `updateSubnet`: an unconditional put on a fresh lease.
    Put(Subnet),
    /// `createSubnet`: `Version == 0` then put.
    Create(Subnet),
}

/// What a flannel step decided about the process.
enum FlannelOutcome {
    Idle,
    Acted,
    Exit(String),
}

/// The world: clock, store, hosts, and the invariant bookkeeping.
pub struct World {
    /// The seed of this world (printed with every violation).
    pub seed: u64,
    /// The shared clock.
    pub clock: ManualClock,
    /// The etcd model.
    pub store: MemoryStore,
    /// The network config every host uses.
    pub network: NetworkConfig,
    /// The subnet lease TTL.
    pub ttl: Duration,
    /// Hosts, in the fixed order they act in.
    pub hosts: Vec<Host>,
    /// The longest single jump of [`World::advance`] (deadlines are always hit exactly).
    pub max_jump: Duration,
    /// Restart exited processes after this long (flannel's `Restart=always`); `None`: never.
    pub restart_after: Option<Duration>,
    /// Print trace lines as they happen (for re-running a failing seed).
    pub echo: bool,
    /// Invariant violations seen, each with seed and time.
    pub violations: Vec<String>,
    /// Rising edges of "two hosts believe they hold one subnet" (any identities).
    pub duplicates: u32,
    /// Of those, the ones between processes of the same node ID (a clone and its original).
    pub same_node_overlaps: u32,
    trace: Vec<String>,
    log_pos: usize,
    writers: BTreeMap<String, String>,
    raw_actors: BTreeMap<i64, (String, bool)>,
    partitioned: BTreeSet<String>,
    down: bool,
    operator_touched: BTreeMap<Subnet, Instant>,
    overlaps: BTreeSet<(Subnet, String, String)>,
}

impl World {
    /// An empty world at time zero.
    pub fn new(seed: u64, network: NetworkConfig) -> Self {
        let clock = ManualClock::new();
        let store = MemoryStore::new(Arc::new(clock.clone()), PREFIX);
        Self {
            seed,
            clock,
            store,
            network,
            ttl: TTL,
            hosts: Vec::new(),
            max_jump: TICK,
            restart_after: None,
            echo: false,
            violations: Vec::new(),
            duplicates: 0,
            same_node_overlaps: 0,
            trace: Vec::new(),
            log_pos: 0,
            writers: BTreeMap::new(),
            raw_actors: BTreeMap::new(),
            partitioned: BTreeSet::new(),
            down: false,
            operator_touched: BTreeMap::new(),
            overlaps: BTreeSet::new(),
        }
    }

    // ---- hosts ---------------------------------------------------------------------------

    /// Adds a host (not started) with the next public IP and node ID `node-<name>0000`.
    pub fn add_host(&mut self, name: &str, imp: Impl) {
        let ip = public_ip(self.hosts.len());
        self.add_host_with(name, imp, node_id(name), ip);
    }

    fn add_host_with(&mut self, name: &str, imp: Impl, node: NodeId, ip: Ipv4Addr) {
        assert!(self.find(name).is_none(), "host {name} exists");
        let n = u8::try_from(self.hosts.len() % 250).unwrap_or(0);
        self.hosts.push(Host {
            name: name.to_owned(),
            imp,
            node,
            public_ip: ip,
            mac: weft::dataplane::wire::ethernet::MacAddr([0x02, 0, 0, 0, 0, n + 1]),
            subnet_env: None,
            proc: None,
            suspended: false,
            runs: 0,
            exits: 0,
            exit_reasons: Vec::new(),
            subnet_changes: 0,
            lists: 0,
            foreign_writes: 0,
            events: Vec::new(),
            restart_at: None,
        });
    }

    /// Adds and starts a weft host.
    pub fn join(&mut self, name: &str) {
        self.add_host(name, Impl::Weft);
        self.start(name);
    }

    /// A copy of `src`'s disk on a new machine: same node ID and `subnet.env`, its own public
    /// IP. Not started.
    pub fn clone_host(&mut self, src: &str, new: &str, ip: Ipv4Addr) {
        let h = self.host(src);
        let (imp, node, env) = (h.imp, h.node.clone(), h.subnet_env);
        self.add_host_with(new, imp, node, ip);
        self.idx_mut(new).subnet_env = env;
        self.note(format!("clone {src} -> {new} ({ip})"));
    }

    /// The host called `name`.
    pub fn host(&self, name: &str) -> &Host {
        &self.hosts[self.idx(name)]
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.hosts.iter().position(|h| h.name == name)
    }

    fn idx(&self, name: &str) -> usize {
        self.find(name).unwrap_or_else(|| panic!("no host {name}"))
    }

    fn idx_mut(&mut self, name: &str) -> &mut Host {
        let i = self.idx(name);
        &mut self.hosts[i]
    }

    /// The running weft keeper of `name`.
    pub fn keeper(&self, name: &str) -> &Keeper {
        match &self.host(name).proc {
            Some(Proc::Weft(p)) => &p.keeper,
            _ => panic!("{name} runs no weft process"),
        }
    }

    /// Whether `name` has a running (possibly suspended) process.
    pub fn running(&self, name: &str) -> bool {
        self.host(name).proc.is_some()
    }

    /// Every keeper event of `name`, all runs.
    pub fn events(&self, name: &str) -> Vec<KeeperEvent> {
        self.host(name).events.iter().map(|l| l.event.clone()).collect()
    }

    /// The keeper events of `name` at or after `t`.
    pub fn events_since(&self, name: &str, t: Instant) -> Vec<KeeperEvent> {
        let h = self.host(name);
        h.events.iter().filter(|l| l.at >= t).map(|l| l.event.clone()).collect()
    }

    /// When `name` last logged an event matching `pred`.
    pub fn last_event_at(
        &self,
        name: &str,
        pred: impl Fn(&KeeperEvent) -> bool,
    ) -> Option<Instant> {
        self.host(name).events.iter().rev().find(|l| pred(&l.event)).map(|l| l.at)
    }

    /// The subnet `name`'s process believes it holds right now: weft's held lease while it is
    /// locally valid; flannel's lease until it exits.
    pub fn believed(&self, name: &str) -> Option<Subnet> {
        believed(self.host(name), self.now())
    }

    // ---- process operations --------------------------------------------------------------

    /// Starts a new process on `name` (a fresh incarnation; `previous` = its `subnet.env`).
    pub fn start(&mut self, name: &str) {
        self.start_unsettled(name);
        self.settle();
    }

    /// Starts processes on all of `names` in the same instant, then steps until quiet: they
    /// race (one store call each per step, in host order).
    pub fn start_all(&mut self, names: &[&str]) {
        for name in names {
            self.start_unsettled(name);
        }
        self.settle();
    }

    /// Starts a process without stepping, so a test can interleave faults with single steps.
    pub fn start_unsettled(&mut self, name: &str) {
        let i = self.idx(name);
        assert!(self.hosts[i].proc.is_none(), "{name} is already running");
        self.spawn(i);
        let h = &self.hosts[i];
        let env = h.subnet_env.map_or("-".to_string(), |s| s.to_string());
        let line = format!("start {name} (run {}, ip {}, subnet.env {env})", h.runs, h.public_ip);
        self.note(line);
    }

    /// Builds a new process for host `i` (no settling).
    fn spawn(&mut self, i: usize) {
        let now = self.now();
        let network = self.network.clone();
        let ttl = self.ttl;
        let h = &mut self.hosts[i];
        h.runs += 1;
        h.suspended = false;
        h.restart_at = None;
        let run_seed = self
            .seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add((i as u64) << 20)
            .wrapping_add(u64::from(h.runs));
        let client = self.store.client(&h.name);
        h.proc = Some(match h.imp {
            Impl::Weft => {
                let (presence_ttl, retry_min, retry_max) = KeeperConfig::timings_for(ttl);
                let incarnation = Incarnation::parse(&format!("inc-{}-{:04}", h.name, h.runs))
                    .expect("a valid incarnation");
                let cfg = KeeperConfig {
                    attrs: lease_attrs(&network, h.public_ip, None, h.mac, None),
                    node: h.node.clone(),
                    incarnation,
                    ttl,
                    renew_margin: (ttl / 4).min(Duration::from_secs(3600)),
                    presence_ttl,
                    previous: h.subnet_env.filter(|s| network.fits(*s)),
                    retry_min,
                    retry_max,
                    seed: run_seed,
                    network,
                };
                Proc::Weft(Box::new(WeftProc {
                    keeper: Keeper::new(cfg, now),
                    client,
                    watch: None,
                    pending: VecDeque::new(),
                    watch_ended: false,
                    watch_retry_at: now,
                }))
            }
            Impl::Flannel(version) => Proc::Flannel(Box::new(FlannelProc {
                client,
                version,
                lease: None,
                renew_at: now,
                retry_at: now,
                watch: None,
                pending: VecDeque::new(),
                watch_from: Revision(0),
                watch_retry_at: now,
                watch_backoff: Duration::from_millis(100),
                chosen: None,
                rng: StdRng::seed_from_u64(run_seed),
            })),
        });
    }

    /// SIGKILL: the process is gone at once, nothing released.
    pub fn kill(&mut self, name: &str) {
        self.note(format!("kill {name}"));
        let h = self.idx_mut(name);
        h.proc = None;
        h.suspended = false;
        h.restart_at = None;
        self.settle();
    }

    /// A clean stop (SIGTERM): weft runs its shutdown (release if `relinquish`, drop presence)
    /// until it is stopped; flanneld just exits (it never releases).
    pub fn stop(&mut self, name: &str, relinquish: bool) {
        self.note(format!("stop {name} (relinquish {relinquish})"));
        let now = self.now();
        let i = self.idx(name);
        let node = self.hosts[i].node.clone();
        if let Some(Proc::Weft(p)) = &mut self.hosts[i].proc {
            p.keeper.handle_shutdown(relinquish);
            let mut rounds = 0;
            while !p.keeper.is_stopped() {
                rounds += 1;
                if rounds > 20 {
                    let msg = format!("{name}: shutdown did not finish");
                    self.violation(msg);
                    break;
                }
                let Some(action) = p.keeper.poll_action(now) else { continue };
                let result = block_on(execute(&p.client, &node, action));
                p.keeper.handle_result(now, self.clock.now(), result);
            }
        }
        drain_weft_events(&mut self.hosts[i], now);
        let h = &mut self.hosts[i];
        h.proc = None;
        h.suspended = false;
        self.settle();
    }

    /// An upgrade without loss: the running weft hands its lease to a new process of the host
    /// ([`Keeper::hand_over`], [`Keeper::take_over`]), which replaces it at once. Returns why
    /// the keeper refused, if it did (the old process then goes on).
    pub fn hand_over(&mut self, name: &str) -> Result<(), String> {
        let now = self.now();
        let i = self.idx(name);
        drain_weft_events(&mut self.hosts[i], now);
        let Some(Proc::Weft(p)) = &self.hosts[i].proc else { return Err("no weft runs".into()) };
        let handed = p.keeper.hand_over(now).map_err(|e| e.to_string())?;
        self.note(format!("hand over {name} (incarnation {})", handed.incarnation));
        self.spawn(i);
        let h = &mut self.hosts[i];
        let Some(Proc::Weft(p)) = &mut h.proc else { unreachable!("spawned a weft") };
        let cfg = p.keeper.config().clone();
        p.keeper = Keeper::take_over(cfg, &handed, now)?;
        self.settle();
        Ok(())
    }

    /// SIGSTOP: the process stays but does not act; its clock keeps running.
    pub fn suspend(&mut self, name: &str) {
        self.note(format!("suspend {name}"));
        self.idx_mut(name).suspended = true;
    }

    /// SIGCONT.
    pub fn resume(&mut self, name: &str) {
        self.note(format!("resume {name}"));
        self.idx_mut(name).suspended = false;
        self.settle();
    }

    /// Cuts `name` off the store (`true`) or heals it. The cut outlives restarts: it is the
    /// host's network, not its process.
    pub fn partition(&mut self, name: &str, cut: bool) {
        self.note(format!("{} {name}", if cut { "partition" } else { "heal" }));
        self.store.partition(name, cut);
        if cut {
            self.partitioned.insert(name.to_owned());
        } else {
            self.partitioned.remove(name);
        }
        self.settle();
    }

    /// Whether `name` is cut off the store.
    pub fn is_partitioned(&self, name: &str) -> bool {
        self.partitioned.contains(name)
    }

    /// Whether the store is down.
    pub fn is_down(&self) -> bool {
        self.down
    }

    /// The whole store goes down (`true`) or comes back; its leases keep running meanwhile.
    pub fn store_down(&mut self, down: bool) {
        self.note(format!("store {}", if down { "down" } else { "up" }));
        self.store.set_down(down);
        self.down = down;
        self.settle();
    }

    /// The next write `name` commits loses its reply (applied, but the caller sees a timeout).
    pub fn lose_next_reply(&mut self, name: &str) {
        self.note(format!("lose next reply of {name}"));
        self.store.fail_next_after_commit(name);
    }

    /// Compacts the store's watch history up to its current revision.
    pub fn compact(&mut self) {
        let rev = self.store.revision();
        self.note(format!("compact at {rev:?}"));
        self.store.compact(rev);
        self.settle();
    }

    /// An operator deletes a subnet key (`weft lease revoke`, `etcdctl del`).
    pub fn revoke(&mut self, s: Subnet) -> bool {
        self.note(format!("revoke {s}"));
        let deleted = self.store.delete_raw(&subnet_key(s));
        if deleted {
            self.raw_actors.insert(self.store.revision().0, ("<operator>".into(), false));
            self.operator_touched.insert(s, self.now());
        }
        self.settle();
        deleted
    }

    /// An operator (or another tool) writes `value` under `key` with no compare.
    pub fn put_raw(&mut self, key: &str, value: &[u8], ttl: Option<Duration>) -> Revision {
        self.note(format!("put_raw {key} = {}", String::from_utf8_lossy(value)));
        let rev = self.store.put_raw(key, value, ttl);
        self.raw_actors.insert(rev.0, ("<operator>".into(), true));
        if let Some(s) = key.rsplit('/').next().and_then(|n| Subnet::parse_key_name(n).ok()) {
            self.operator_touched.insert(s, self.now());
        }
        self.settle();
        rev
    }

    /// `name` gets a new public IP; it takes effect at its next start.
    pub fn set_public_ip(&mut self, name: &str, ip: Ipv4Addr) {
        self.note(format!("public ip of {name} -> {ip}"));
        self.idx_mut(name).public_ip = ip;
    }

    /// `name`'s address changes while its weft runs, which notices (as the daemon's underlay
    /// follower does) and tells its keeper.
    pub fn renumber_running(&mut self, name: &str, ip: Ipv4Addr) {
        self.set_public_ip(name, ip);
        match &mut self.idx_mut(name).proc {
            Some(Proc::Weft(p)) => p.keeper.handle_public_ip(ip),
            _ => panic!("{name} runs no weft process"),
        }
        self.settle();
    }

    // ---- time ----------------------------------------------------------------------------

    /// The current time.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Seconds since the epoch, for traces and messages.
    pub fn secs(&self) -> f64 {
        self.now().since_epoch().as_secs_f64()
    }

    /// Moves time forward by `d`, from deadline to deadline (keeper timeouts, store lease
    /// expiries, the driver's one-second cap) in jumps of at most [`World::max_jump`], running
    /// store expiry and stepping every host until quiet at each stop.
    pub fn advance(&mut self, d: Duration) {
        let target = self.now() + d;
        loop {
            let now = self.now();
            if now >= target {
                break;
            }
            let next = self
                .next_deadline(now)
                .map_or(target, |t| t.min(target))
                .min(now + self.max_jump)
                .max(now + Duration::from_millis(1));
            self.clock.set(next);
            self.store.tick();
            self.settle();
        }
    }

    /// Advances in `step` increments until `pred` holds or `limit` has passed; returns whether
    /// it held.
    pub fn advance_until(&mut self, limit: Duration, mut pred: impl FnMut(&World) -> bool) -> bool {
        let end = self.now() + limit;
        loop {
            if pred(self) {
                return true;
            }
            if self.now() >= end {
                return false;
            }
            self.advance(TICK);
        }
    }

    fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| {
            if x > now {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for h in &self.hosts {
            if let Some(r) = h.restart_at {
                at(r);
            }
            if h.suspended {
                continue;
            }
            match &h.proc {
                Some(Proc::Weft(p)) => {
                    at(now + DRIVER_MAX_SLEEP);
                    if let Some(x) = p.keeper.poll_timeout() {
                        at(x);
                    }
                    if p.watch.is_none() {
                        at(p.watch_retry_at);
                    }
                }
                Some(Proc::Flannel(p)) => {
                    at(p.retry_at);
                    if p.lease.is_some() {
                        at(p.renew_at.max(p.retry_at));
                        at(p.watch_retry_at);
                    }
                }
                None => {}
            }
        }
        for (_, exp) in self.store.live_leases() {
            at(exp);
        }
        t
    }

    /// Steps until no host acts any more at this instant, checking invariants after each step.
    pub fn settle(&mut self) {
        for _ in 0..MAX_STEPS_PER_INSTANT {
            if !self.step() {
                return;
            }
        }
        let msg = format!("no quiet after {MAX_STEPS_PER_INSTANT} steps at one instant");
        self.violation(msg);
    }

    /// One round: every running, non-suspended host (in the fixed order) drains its events and
    /// makes at most one store call or takes one own-key watch delivery. Then the invariants
    /// are checked. Returns whether anyone did anything.
    pub fn step(&mut self) -> bool {
        let now = self.now();
        let mut did = false;
        for i in 0..self.hosts.len() {
            if self.hosts[i].proc.is_none() {
                if self.hosts[i].restart_at.is_some_and(|r| r <= now) {
                    let name = self.hosts[i].name.clone();
                    self.note(format!("supervisor restarts {name}"));
                    self.spawn(i);
                    did = true;
                }
                continue;
            }
            if self.hosts[i].suspended {
                continue;
            }
            let is_weft = matches!(self.hosts[i].proc, Some(Proc::Weft(_)));
            if is_weft {
                did |= step_weft(&mut self.hosts[i], &self.clock, now);
            } else {
                let reachable = !self.down && !self.partitioned.contains(&self.hosts[i].name);
                let ctx = FlannelCtx {
                    store: &self.store,
                    network: &self.network,
                    ttl: self.ttl,
                    now,
                    reachable,
                    raw_actors: &mut self.raw_actors,
                };
                match step_flannel(&mut self.hosts[i], ctx) {
                    FlannelOutcome::Idle => {}
                    FlannelOutcome::Acted => did = true,
                    FlannelOutcome::Exit(reason) => {
                        let h = &mut self.hosts[i];
                        h.proc = None;
                        h.exits += 1;
                        h.exit_reasons.push(reason.clone());
                        h.restart_at = self.restart_after.map(|d| now + d);
                        let name = h.name.clone();
                        self.note(format!("{name} exits: {reason}"));
                        did = true;
                    }
                }
            }
        }
        self.check();
        did
    }

    // ---- invariants ----------------------------------------------------------------------

    fn check(&mut self) {
        let now = self.now();
        // Who believes they hold what.
        let believers: Vec<(usize, Subnet)> = self
            .hosts
            .iter()
            .enumerate()
            .filter_map(|(i, h)| believed(h, now).map(|s| (i, s)))
            .collect();
        let mut current = BTreeSet::new();
        for (x, (a, sa)) in believers.iter().enumerate() {
            for (b, sb) in &believers[x + 1..] {
                if sa == sb {
                    current.insert((*sa, self.hosts[*a].name.clone(), self.hosts[*b].name.clone()));
                }
            }
        }
        let mut problems = Vec::new();
        for k in &current {
            if self.overlaps.contains(k) {
                continue;
            }
            self.duplicates += 1;
            let (s, a, b) = k;
            let (ha, hb) = (&self.hosts[self.idx(a)], &self.hosts[self.idx(b)]);
            if ha.node == hb.node {
                self.same_node_overlaps += 1;
            } else if ha.imp == Impl::Weft && hb.imp == Impl::Weft && !self.touched(*s, now) {
                problems.push(format!(
                    "two live holders of {s}: {a} ({}) and {b} ({})",
                    ha.node, hb.node
                ));
            }
        }
        self.overlaps = current;

        // A weft process that believes it holds S must not see S's key carry another identity.
        let keys = self.store.subnet_keys();
        for (i, s) in &believers {
            let h = &self.hosts[*i];
            if h.imp != Impl::Weft || self.touched(*s, now) {
                continue;
            }
            if let Some(k) = keys.iter().find(|k| k.subnet == *s)
                && k.attrs.node_id.as_ref() != Some(&h.node)
            {
                problems.push(format!(
                    "{} believes it holds {s} but its key carries {:?} ({})",
                    h.name, k.attrs.node_id, k.attrs.public_ip
                ));
            }
        }

        // Each subnet has at most one key, and each IPv6 half at most one: the halves of a
        // dual-stack lease are exclusive as the IPv4 subnet is.
        let mut v4_seen = BTreeSet::new();
        let mut v6_seen = BTreeSet::new();
        for k in &keys {
            if !v4_seen.insert(k.subnet) {
                problems.push(format!("two keys for {}", k.subnet));
            }
            if let Some(half) = k.ipv6
                && !v6_seen.insert(half)
            {
                problems.push(format!("two keys with the IPv6 half {half}"));
            }
        }

        // The history stays bounded: a create prunes its node's other records, so a node is
        // named by at most one record per host carrying its identity (a clone is a second).
        let mut per_node: BTreeMap<&NodeId, usize> = BTreeMap::new();
        let history = self.store.history();
        for h in &history {
            *per_node.entry(&h.record.node).or_default() += 1;
        }
        for (node, n) in per_node {
            let hosts = self.hosts.iter().filter(|h| h.node == *node).count().max(1);
            if n > hosts {
                problems.push(format!("{n} history records name node {node} ({hosts} hosts)"));
            }
        }

        // The write log: nobody writes a key that carries another node's identity.
        let log = self.store.write_log_since(self.log_pos);
        self.log_pos += log.len();
        for rec in log {
            problems.extend(self.account(&rec));
        }
        for p in problems {
            self.violation(p);
        }
    }

    /// Books one write: who wrote the key's current value, foreign writes, invariant (2).
    fn account(&mut self, rec: &WriteRecord) -> Option<String> {
        let (actor, put) = match rec.kind {
            WriteKind::Create | WriteKind::Renew => (rec.client.clone(), true),
            WriteKind::Release | WriteKind::Revoke | WriteKind::Expire => {
                (rec.client.clone(), false)
            }
            WriteKind::Raw => self
                .raw_actors
                .get(&rec.revision.0)
                .cloned()
                .unwrap_or_else(|| (RAW_CLIENT.to_string(), self.store.raw(&rec.key).is_some())),
        };
        let previous = if put {
            self.writers.insert(rec.key.clone(), actor.clone())
        } else {
            self.writers.remove(&rec.key)
        };
        let host = self.find(&actor)?;
        if previous.as_ref().is_some_and(|p| *p != actor) {
            self.hosts[host].foreign_writes += 1;
        }
        let h = &self.hosts[host];
        if h.imp != Impl::Weft || rec.client == EXPIRY_CLIENT {
            return None;
        }
        match &rec.previous_node {
            Some(n) if *n != h.node => Some(format!(
                "{} wrote {} ({:?} at {:?}) which carried node {n}",
                h.name, rec.key, rec.kind, rec.revision
            )),
            _ => None,
        }
    }

    fn touched(&self, s: Subnet, now: Instant) -> bool {
        self.operator_touched
            .get(&s)
            .is_some_and(|t| now.saturating_since(*t) <= self.ttl + self.ttl)
    }

    fn violation(&mut self, msg: String) {
        let line = format!("seed {}: t={:.3}s: {msg}", self.seed, self.secs());
        self.note(format!("VIOLATION {msg}"));
        self.violations.push(line);
    }

    /// Adds a line to the schedule trace.
    pub fn note(&mut self, line: String) {
        let line = format!("{:>9.3}s  {line}", self.secs());
        if self.echo {
            println!("{line}");
        }
        self.trace.push(line);
    }

    /// The violations with the schedule that led to them.
    pub fn report(&self) -> String {
        format!(
            "seed {}: {} violation(s):\n  {}\ntrace:\n{}",
            self.seed,
            self.violations.len(),
            self.violations.join("\n  "),
            self.trace.join("\n")
        )
    }

    /// Panics with [`World::report`] if any invariant was violated.
    pub fn assert_clean(&self) {
        assert!(self.violations.is_empty(), "{}", self.report());
    }

    // ---- store inspection ----------------------------------------------------------------

    /// The parsed subnet key of `s`, if present and readable.
    pub fn key(&self, s: Subnet) -> Option<StoredLease> {
        self.store.subnet_keys().into_iter().find(|k| k.subnet == s)
    }

    /// Writes to `s`'s key, in either form (`X` or a dual-stack `X&…`), at or after
    /// write-log position `from`.
    pub fn writes_to(&self, s: Subnet, from: usize) -> Vec<WriteRecord> {
        let is_key_of_s = |key: &str| {
            let name = key.strip_prefix(&format!("{PREFIX}/subnets/")).unwrap_or_default();
            LeaseName::parse(name).is_ok_and(|n| n.subnet == s)
        };
        self.store.write_log_since(from).into_iter().filter(|w| is_key_of_s(&w.key)).collect()
    }

    /// The exact store key of `s`'s live lease, in whichever form it is.
    pub fn live_key(&self, s: Subnet) -> Option<String> {
        self.key(s).map(|k| format!("{PREFIX}/subnets/{}", k.name().key_name()))
    }

    /// Writes by client `name` at or after write-log position `from`.
    pub fn writes_by(&self, name: &str, from: usize) -> Vec<WriteRecord> {
        self.store.write_log_since(from).into_iter().filter(|w| w.client == name).collect()
    }

    /// The current length of the store's write log.
    pub fn log_len(&self) -> usize {
        self.store.write_log().len()
    }

    /// Sum of [`Host::foreign_writes`]: writes to a key whose current value another host
    /// wrote (host-level: a clone writing its original's key counts).
    pub fn foreign_writes(&self) -> u32 {
        self.hosts.iter().map(|h| h.foreign_writes).sum()
    }

    /// Sum of [`Host::exits`].
    pub fn exits(&self) -> u32 {
        self.hosts.iter().map(|h| h.exits).sum()
    }

    /// Sum of [`Host::subnet_changes`].
    pub fn subnet_changes(&self) -> u32 {
        self.hosts.iter().map(|h| h.subnet_changes).sum()
    }
}

/// `node-<name>` padded to a valid node ID (`node-a0000`).
pub fn node_id(name: &str) -> NodeId {
    NodeId::parse(&format!("node-{name:0<5}")).expect("a valid node ID")
}

fn believed(h: &Host, now: Instant) -> Option<Subnet> {
    match &h.proc {
        Some(Proc::Weft(p)) => {
            let held = p.keeper.held()?;
            (now < p.keeper.expires_at()?).then_some(held.subnet)
        }
        Some(Proc::Flannel(p)) => p.lease,
        None => None,
    }
}

/// Records a subnet written to `subnet.env`.
fn write_subnet_env(h: &mut Host, s: Subnet) {
    if h.subnet_env != Some(s) {
        if h.subnet_env.is_some() {
            h.subnet_changes += 1;
        }
        h.subnet_env = Some(s);
    }
}

/// Drains the keeper's events as `LeaseDriver::on_event` does: log them, and rewrite
/// `subnet.env` on `Acquired` and `Recovered`. Returns whether there were any.
fn drain_weft_events(h: &mut Host, now: Instant) -> bool {
    let Some(Proc::Weft(p)) = &mut h.proc else { return false };
    let mut evs = Vec::new();
    while let Some(ev) = p.keeper.poll_event() {
        evs.push(ev);
    }
    let any = !evs.is_empty();
    for ev in evs {
        if let KeeperEvent::Acquired { subnet, .. } | KeeperEvent::Recovered { subnet } = &ev {
            write_subnet_env(h, *subnet);
        }
        h.events.push(Logged { at: now, run: h.runs, event: ev });
    }
    any
}

/// One turn of a weft process, following `LeaseDriver::run`: drain events; run one action if
/// the keeper has one; otherwise keep the own-key watch open and deliver one watch item.
fn step_weft(h: &mut Host, clock: &ManualClock, now: Instant) -> bool {
    let mut did = drain_weft_events(h, now);
    let node = h.node.clone();
    let Some(Proc::Weft(p)) = &mut h.proc else { return did };
    if let Some(action) = p.keeper.poll_action(now) {
        if action == Action::List {
            h.lists += 1;
        }
        let result = block_on(execute(&p.client, &node, action));
        p.keeper.handle_result(now, clock.now(), result);
        drain_weft_events(h, now);
        return true;
    }
    did |= ensure_own_watch(p, now);
    if let Some((_, w)) = &mut p.watch
        && !p.watch_ended
    {
        let (items, ended) = drain_ready(w);
        p.pending.extend(items);
        p.watch_ended = ended;
    }
    if let Some(item) = p.pending.pop_front() {
        did = true;
        match item {
            Ok(batch) => {
                for ev in batch.events {
                    match ev {
                        WatchEvent::Put(l) => p.keeper.handle_own_key(now, Some(&l)),
                        WatchEvent::Delete { .. }
                        | WatchEvent::Bad(_)
                        | WatchEvent::DeleteUnparsed { .. } => p.keeper.handle_own_key(now, None),
                        // A one-key watch sees no departure markers.
                        WatchEvent::Departed(_) => {}
                    }
                }
            }
            Err(_) => {
                p.watch = None;
                p.pending.clear();
                p.watch_ended = false;
                p.watch_retry_at = now + WATCH_RETRY;
                p.keeper.handle_own_key(now, None);
            }
        }
    } else if p.watch_ended && p.watch.is_some() {
        did = true;
        p.watch = None;
        p.watch_ended = false;
        p.watch_retry_at = now + WATCH_RETRY;
    }
    did |= drain_weft_events(h, now);
    did
}

/// `LeaseDriver::ensure_own_watch`: a watch on the held subnet's key from the held revision + 1.
fn ensure_own_watch(p: &mut WeftProc, now: Instant) -> bool {
    let want = p.keeper.held();
    match (&p.watch, want) {
        (Some((s, _)), Some(h)) if *s == h.subnet => return false,
        (None, None) => return false,
        _ => {}
    }
    let had = p.watch.take().is_some();
    p.pending.clear();
    p.watch_ended = false;
    let Some(held) = want else { return had };
    if now < p.watch_retry_at {
        return had;
    }
    match block_on(p.client.watch(Revision(held.mod_revision.0 + 1), Some(held.name()))) {
        Ok(w) => p.watch = Some((held.subnet, w)),
        Err(_) => p.watch_retry_at = now + WATCH_RETRY,
    }
    true
}

// ---- flannel ---------------------------------------------------------------------------------

struct FlannelCtx<'a> {
    store: &'a MemoryStore,
    network: &'a NetworkConfig,
    ttl: Duration,
    now: Instant,
    reachable: bool,
    raw_actors: &'a mut BTreeMap<i64, (String, bool)>,
}

/// flanneld's value: `LeaseAttrs` without weft's fields.
fn flannel_attrs(network: &NetworkConfig, h: &Host) -> LeaseAttrs {
    lease_attrs(network, h.public_ip, None, h.mac, None)
}

/// flannel's `updateSubnet`: a fresh lease and an unconditional put (no compare).
fn flannel_put(ctx: &mut FlannelCtx<'_>, h: &Host, s: Subnet) -> Option<Revision> {
    if !ctx.reachable {
        return None;
    }
    let value = flannel_attrs(ctx.network, h).to_json();
    let rev = ctx.store.put_raw(&subnet_key(s), &value, Some(ctx.ttl));
    ctx.raw_actors.insert(rev.0, (h.name.clone(), true));
    Some(rev)
}

/// The renew margin, scaled: flannel renews 1 h before a 24 h expiry; weft's daemon default
/// margin for short TTLs is TTL/4, used here so both renew at comparable points.
fn flannel_margin(ttl: Duration) -> Duration {
    ttl / 4
}

/// flannel's renew retry ("trying again in 1 min"), scaled to the simulation.
const FLANNEL_RETRY: Duration = Duration::from_millis(200);

fn step_flannel(h: &mut Host, mut ctx: FlannelCtx<'_>) -> FlannelOutcome {
    let now = ctx.now;
    let ttl = ctx.ttl;
    let Some(Proc::Flannel(p)) = &h.proc else { return FlannelOutcome::Idle };
    if p.lease.is_none() {
        if now < p.retry_at {
            return FlannelOutcome::Idle;
        }
        return flannel_acquire(h, &mut ctx);
    }
    let Some(Proc::Flannel(p)) = &mut h.proc else { return FlannelOutcome::Idle };
    // Keep the own-key watch open (reconnect with backoff, resume from the cursor).
    if p.watch.is_none() && now >= p.watch_retry_at {
        match block_on(p.client.watch(p.watch_from, p.lease.map(LeaseName::single))) {
            Ok(w) => {
                p.watch = Some(w);
                p.watch_backoff = Duration::from_millis(100);
            }
            Err(_) => {
                p.watch_retry_at = now + p.watch_backoff;
                p.watch_backoff = (p.watch_backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    if let Some(w) = &mut p.watch {
        let (items, ended) = drain_ready(w);
        p.pending.extend(items);
        if ended {
            p.watch = None;
            p.watch_retry_at = now + p.watch_backoff;
        }
    }
    let timer_due = now >= p.renew_at && now >= p.retry_at;
    let watch_ready = !p.pending.is_empty();
    // Go's select picks at random among ready cases.
    let take_timer = match (timer_due, watch_ready) {
        (true, true) => p.rng.random_bool(0.5),
        (t, _) => t,
    };
    if take_timer {
        let s = p.lease.unwrap_or_else(|| unreachable!());
        match flannel_put(&mut ctx, h, s) {
            Some(_) => {
                let Some(Proc::Flannel(p)) = &mut h.proc else { unreachable!() };
                p.renew_at = now + ttl - flannel_margin(ttl);
            }
            None => {
                let Some(Proc::Flannel(p)) = &mut h.proc else { unreachable!() };
                p.retry_at = now + FLANNEL_RETRY;
            }
        }
        return FlannelOutcome::Acted;
    }
    let Some(item) = p.pending.pop_front() else { return FlannelOutcome::Idle };
    match item {
        Ok(batch) => {
            p.watch_from = Revision(batch.revision.0 + 1);
            for ev in batch.events {
                match ev {
                    // EventAdded: take the new expiration (via TimeToLive) and re-arm the timer.
                    WatchEvent::Put(l) => {
                        let exp = ctx
                            .store
                            .live_leases()
                            .into_iter()
                            .find(|(id, _)| *id == l.lease_id)
                            .map_or(now + ttl, |(_, e)| e);
                        p.renew_at = exp - flannel_margin(ttl);
                    }
                    WatchEvent::Delete { .. } => {
                        return FlannelOutcome::Exit(
                            "Lease has been revoked. Shutting down daemon. (exit 0)".into(),
                        );
                    }
                    WatchEvent::Bad(_)
                    | WatchEvent::DeleteUnparsed { .. }
                    | WatchEvent::Departed(_) => {}
                }
            }
        }
        Err(StoreError::Compacted { .. }) => {
            // v0.28.9: re-read the key; gone means an EventRemoved.
            let s = p.lease.unwrap_or_else(|| unreachable!());
            if ctx.store.raw(&subnet_key(s)).is_none() {
                return FlannelOutcome::Exit("Lease has been revoked (after compaction)".into());
            }
            p.watch = None;
            p.pending.clear();
            p.watch_from = Revision(ctx.store.revision().0 + 1);
        }
        Err(_) => {
            p.watch = None;
            p.pending.clear();
            p.watch_retry_at = now + p.watch_backoff;
            p.watch_backoff = (p.watch_backoff * 2).min(Duration::from_secs(5));
        }
    }
    FlannelOutcome::Acted
}

/// flannel's `tryAcquireLease`, in two steps (list and decide; then write) so that hosts
/// starting together race. One attempt only: its retry loop retries `ErrDuplicateKey`, never
/// its own `errSubnetAlreadyexists`, so a lost race ends the process.
fn flannel_acquire(h: &mut Host, ctx: &mut FlannelCtx<'_>) -> FlannelOutcome {
    let now = ctx.now;
    let Some(Proc::Flannel(p)) = &mut h.proc else { return FlannelOutcome::Idle };
    if let Some(choice) = p.chosen.take() {
        return match choice {
            FlannelChoice::Put(s) => match flannel_put(ctx, h, s) {
                Some(rev) => {
                    flannel_hold(h, s, rev, ctx);
                    FlannelOutcome::Acted
                }
                None => {
                    let Some(Proc::Flannel(p)) = &mut h.proc else { unreachable!() };
                    p.retry_at = now + Duration::from_secs(1);
                    FlannelOutcome::Acted
                }
            },
            FlannelChoice::Create(s) => {
                let attrs = flannel_attrs(ctx.network, h);
                let Some(Proc::Flannel(p)) = &mut h.proc else { unreachable!() };
                match block_on(p.client.create(s, &attrs, ctx.ttl)) {
                    Ok(CreateOutcome::Created(held)) => {
                        flannel_hold(h, s, held.mod_revision, ctx);
                        FlannelOutcome::Acted
                    }
                    Ok(CreateOutcome::Exists(_)) => {
                        FlannelOutcome::Exit(format!("{s}: errSubnetAlreadyexists (exit 1)"))
                    }
                    Err(_) => {
                        p.retry_at = now + Duration::from_secs(1);
                        FlannelOutcome::Acted
                    }
                }
            }
        };
    }
    let listing = match block_on(p.client.list()) {
        Ok(l) => l,
        Err(_) => {
            // The etcd client blocks and retries; flanneld does not exit here.
            p.retry_at = now + Duration::from_secs(1);
            return FlannelOutcome::Acted;
        }
    };
    let fits = |s: Subnet| ctx.network.fits(s);
    // 1. Reuse the first lease whose PublicIP is ours: unconditional put.
    let by_ip = listing
        .leases
        .iter()
        .find(|l| l.attrs.public_ip == h.public_ip && fits(l.subnet))
        .map(|l| l.subnet);
    // 2 (v0.17 only). A live lease found by the previous subnet: reused whoever holds it.
    let by_prev = match (p.version, h.subnet_env) {
        (FlannelVersion::V0_17, Some(prev)) if fits(prev) => {
            listing.leases.iter().find(|l| l.subnet == prev).map(|l| l.subnet)
        }
        _ => None,
    };
    if let Some(s) = by_ip.or(by_prev) {
        p.chosen = Some(FlannelChoice::Put(s));
        return FlannelOutcome::Acted;
    }
    let taken: BTreeSet<Subnet> = listing.leases.iter().map(|l| l.subnet).collect();
    // 3. The subnet.env subnet if no lease exists for it; else 4. random among the lowest 100.
    let candidate = match h.subnet_env {
        Some(prev) if fits(prev) && !taken.contains(&prev) => Some(prev),
        _ => {
            let free: Vec<Subnet> =
                ctx.network.subnets().filter(|s| !taken.contains(s)).take(100).collect();
            (!free.is_empty()).then(|| free[p.rng.random_range(0..free.len())])
        }
    };
    match candidate {
        Some(s) => {
            p.chosen = Some(FlannelChoice::Create(s));
            FlannelOutcome::Acted
        }
        None => FlannelOutcome::Exit("out of subnets (exit 1)".into()),
    }
}

fn flannel_hold(h: &mut Host, s: Subnet, rev: Revision, ctx: &FlannelCtx<'_>) {
    write_subnet_env(h, s);
    let Some(Proc::Flannel(p)) = &mut h.proc else { return };
    p.lease = Some(s);
    p.renew_at = ctx.now + ctx.ttl - flannel_margin(ctx.ttl);
    p.retry_at = ctx.now;
    p.watch = None;
    p.pending.clear();
    p.watch_from = Revision(rev.0 + 1);
    p.watch_retry_at = ctx.now;
}
