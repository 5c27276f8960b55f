//! Many nodes joining at once: how many create races they lose (issue 42, item 1; the draw
//! is `policy::Seats`, docs/lease-rules.md, "Order of choice").
//!
//! Real keepers, driven through [`super::driver::execute`] as the daemon drives them, against
//! one in-memory store on a frozen clock, on the benchmark's network (10.244.0.0/16 in /28s:
//! 4,094 subnets, as `scripts/bench-leases.sh` sets it up). Two schedules:
//! - **lockstep**: every keeper makes one store call per round, in a shuffled order. All claim
//!   presence, then all list the same snapshot, then all create at once; a keeper that lost
//!   creates its next candidate in the next round.
//! - **interleaved**: one call at a time, by a keeper picked at random: listings see the other
//!   joiners part way (presence claimed or not, subnet created or not).
//!
//! A keeper can be made an older weft (it lists without presence keys, so it draws at random
//! among the lowest free subnets, as weft did before seats) or a process that dies after
//! claiming presence. Deterministic: seeded shuffles and keeper seeds.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use futures::executor::block_on;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::driver::execute;
use super::keeper::{Action, ActionResult, Keeper, KeeperConfig};
use super::memory::{MemoryClient, MemoryStore};
use super::record::{Incarnation, LeaseAttrs, NodeId, Subnet};
use super::store::{CreateOutcome, LeaseFeed, Store};
use crate::config::NetworkConfig;
use crate::time::{Clock, Instant, ManualClock};

/// The issue's target: lost create races per joining host.
const TARGET: f64 = 0.1;

const NETWORK: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":28,"Backend":{"Type":"vxlan"}}"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    Lockstep,
    Interleaved,
}

struct Joiner {
    keeper: Keeper,
    client: MemoryClient,
    node: NodeId,
    /// Lists without presence: draws at random, as weft did before seats.
    old: bool,
    /// Claims presence, then dies: its presence key stands, it never creates.
    ghost: bool,
}

/// Who joins: `n` keepers, every `old_every`-th of them an old weft, and `ghosts` more that
/// die after claiming presence.
#[derive(Clone, Copy, Debug)]
struct Mix {
    n: usize,
    old_every: Option<usize>,
    ghosts: usize,
}

#[derive(Debug)]
struct Outcome {
    /// Creates that found their key taken.
    lost: usize,
    /// Listings.
    lists: usize,
    /// Of `lost`, those of old wefts.
    lost_old: usize,
    /// The subnets held, one per joiner that holds one.
    held: Vec<Subnet>,
}

impl Outcome {
    fn lost_per_host(&self, n: usize) -> f64 {
        self.lost as f64 / n as f64
    }
}

fn network() -> NetworkConfig {
    NetworkConfig::parse(NETWORK.as_bytes()).expect("a valid network")
}

fn joiners(
    store: &MemoryStore,
    network: &NetworkConfig,
    n: usize,
    now: Instant,
    seed: u64,
) -> Vec<Joiner> {
    let ttl = Duration::from_secs(60);
    let (presence_ttl, retry_min, retry_max) = KeeperConfig::timings_for(ttl);
    (0..n)
        .map(|i| {
            let node = NodeId::parse(&format!("node-{i:06}")).expect("a node ID");
            let attrs = LeaseAttrs {
                public_ip: Ipv4Addr::from(0xc000_0000 + u32::try_from(i).expect("small")),
                public_ipv6: None,
                backend_type: Some("vxlan".into()),
                backend_data: None,
                backend_v6_data: None,
                node_id: None,
                incarnation: None,
            };
            let cfg = KeeperConfig {
                network: network.clone(),
                attrs,
                node: node.clone(),
                incarnation: Incarnation::parse(&format!("inc-{i:06}")).expect("an incarnation"),
                ttl,
                renew_margin: ttl / 4,
                presence_ttl,
                previous: None,
                retry_min,
                retry_max,
                seed: seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            };
            Joiner {
                keeper: Keeper::new(cfg, now),
                client: store.client(node.as_str()),
                node,
                old: false,
                ghost: false,
            }
        })
        .collect()
}

/// Runs one store call of `j`'s; `true` if it was a create that lost.
fn step(j: &mut Joiner, now: Instant, action: Action, lists: &mut usize) -> bool {
    if j.ghost && action == Action::List {
        // Dead: the call never returns, the keeper never acts again.
        return false;
    }
    if action == Action::List {
        *lists += 1;
    }
    let result = match action {
        Action::List if j.old => ActionResult::List(block_on(j.client.list())),
        action => block_on(execute(&j.client, &j.node, action)),
    };
    let lost = matches!(result, ActionResult::Create(Ok(CreateOutcome::Exists(_))));
    j.keeper.handle_result(now, now, result);
    while j.keeper.poll_event().is_some() {}
    lost
}

/// `mix` joins the network of `store` at once; the clock never moves, so a keeper that holds
/// its lease has nothing more to do.
fn join_mix(store: &MemoryStore, mix: Mix, schedule: Schedule, seed: u64) -> Outcome {
    let n = mix.n + mix.ghosts;
    let now = ManualClock::new().now();
    let mut js = joiners(store, &network(), n, now, seed);
    for (i, j) in js.iter_mut().enumerate() {
        j.old = mix.old_every.is_some_and(|k| i % k == 0);
        j.ghost = i >= mix.n;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut o = Outcome { lost: 0, lost_old: 0, lists: 0, held: Vec::new() };
    let run = |j: &mut Joiner, action: Action, o: &mut Outcome| {
        let lost = usize::from(step(j, now, action, &mut o.lists));
        o.lost += lost;
        if j.old {
            o.lost_old += lost;
        }
    };
    match schedule {
        Schedule::Lockstep => loop {
            let mut round: Vec<(usize, Action)> = js
                .iter_mut()
                .enumerate()
                .filter_map(|(i, j)| j.keeper.poll_action(now).map(|a| (i, a)))
                .collect();
            if round.is_empty() {
                break;
            }
            round.shuffle(&mut rng);
            for (i, action) in round {
                run(&mut js[i], action, &mut o);
            }
        },
        Schedule::Interleaved => {
            let mut active: Vec<usize> = (0..n).collect();
            while !active.is_empty() {
                let k = rng.random_range(0..active.len());
                let j = &mut js[active[k]];
                match j.keeper.poll_action(now) {
                    Some(action) => run(j, action, &mut o),
                    None => {
                        active.swap_remove(k);
                    }
                }
            }
        }
    }
    o.held =
        js.iter().filter(|j| !j.ghost).filter_map(|j| j.keeper.held().map(|h| h.subnet)).collect();
    o
}

/// `n` weft keepers join an empty network at once; `old`: all list without presence (the
/// random draw).
fn join(n: usize, schedule: Schedule, old: bool, seed: u64) -> Outcome {
    let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
    join_mix(&store, Mix { n, old_every: old.then_some(1), ghosts: 0 }, schedule, seed)
}

fn check(n: usize, o: &Outcome, what: &str) {
    assert_eq!(o.held.len(), n, "{what}: every joiner holds a subnet");
    let mut distinct = o.held.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), n, "{what}: distinct subnets");
}

/// The position of `s` in the network's range (0: the lowest).
fn position(s: Subnet) -> usize {
    network().subnets().position(|x| x == s).expect("in the network")
}

/// The figure of issue 42: at most 0.1 lost create races per host with 1,000 hosts joining at
/// once, whether all read one snapshot or each sees the others part way; and the lowest
/// subnets are the ones taken. The random draw (presence hidden, as before seats) loses about
/// three races per host, as the benchmark measured (2.95).
#[test]
fn a_thousand_joiners_at_once_rarely_lose_a_create_race() {
    let n = 1000;
    for schedule in [Schedule::Lockstep, Schedule::Interleaved] {
        let o = join(n, schedule, false, 42);
        check(n, &o, &format!("{schedule:?}"));
        let highest = o.held.iter().map(|s| position(*s)).max().unwrap_or(0);
        println!(
            "{n} joiners, {schedule:?}: {} races lost ({:.3} per host), {} listings, highest \
             subnet #{highest}",
            o.lost,
            o.lost_per_host(n),
            o.lists,
        );
        assert!(o.lost_per_host(n) <= TARGET, "{schedule:?}: {} races lost", o.lost);
        assert!(highest < n + n / 10, "{schedule:?}: a joiner went up to subnet #{highest}");
    }
    let old = join(n, Schedule::Lockstep, true, 42);
    check(n, &old, "the random draw");
    println!(
        "{n} joiners, Lockstep, the random draw: {} races lost ({:.3} per host), {} listings",
        old.lost,
        old.lost_per_host(n),
        old.lists
    );
    assert!(old.lost_per_host(n) > 1.0, "the random draw lost {}", old.lost);
}

/// Joiners that all read one snapshot take the lowest free subnets, one each, without a race:
/// around the leases already there.
#[test]
fn joiners_reading_one_snapshot_take_the_lowest_free_subnets_without_a_race() {
    let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
    let network = network();
    let earlier = store.client("earlier");
    let attrs = LeaseAttrs::from_json(br#"{"PublicIP":"192.0.2.1"}"#).expect("attrs");
    let taken: Vec<Subnet> = network.subnets().take(400).step_by(3).collect();
    for s in &taken {
        block_on(earlier.create(*s, &attrs, Duration::from_secs(60))).expect("created");
    }
    let n = 300;
    let o = join_mix(&store, Mix { n, old_every: None, ghosts: 0 }, Schedule::Lockstep, 7);
    check(n, &o, "lockstep");
    assert_eq!(o.lost, 0);
    let mut held = o.held;
    held.sort();
    let lowest: Vec<Subnet> = network.subnets().filter(|s| !taken.contains(s)).take(n).collect();
    assert_eq!(held, lowest);
}

/// A process that claimed presence and died before it created its lease keeps a seat until
/// its presence key goes: a hole in the low end, never a lost race.
#[test]
fn joiners_that_die_leave_holes_not_races() {
    let (n, ghosts) = (300, 30);
    let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
    let o = join_mix(&store, Mix { n, old_every: None, ghosts }, Schedule::Interleaved, 11);
    check(n, &o, "with ghosts");
    assert_eq!(o.lost, 0);
    let highest = o.held.iter().map(|s| position(*s)).max().unwrap_or(0);
    assert!(highest < n + ghosts, "a joiner went up to subnet #{highest}");
}

/// Older wefts (they list no presence and draw at random among the lowest 100 free subnets)
/// joining among new ones take seats of new ones: both lose races, and a seat taken by a host
/// that has none moves the seats above it for the joiners that list after, so one in ten costs
/// the new ones too (about 0.3 races per host here) — yet far fewer than when all draw at
/// random. Every host still gets a subnet of its own.
#[test]
fn old_wefts_among_the_joiners_cost_races_but_fewer_than_the_random_draw() {
    let n = 500;
    for schedule in [Schedule::Lockstep, Schedule::Interleaved] {
        let store = MemoryStore::new(Arc::new(ManualClock::new()), "/coreos.com/network");
        let mix = Mix { n, old_every: Some(10), ghosts: 0 };
        let o = join_mix(&store, mix, schedule, 5);
        check(n, &o, &format!("{schedule:?}, mixed"));
        let all_old = join(n, schedule, true, 5);
        println!(
            "{n} joiners, {schedule:?}, one in ten an older weft: {} races lost ({} by older \
             wefts, {:.3} per host); all older: {} ({:.3} per host)",
            o.lost,
            o.lost_old,
            o.lost_per_host(n),
            all_old.lost,
            all_old.lost_per_host(n),
        );
        assert!(o.lost * 2 < all_old.lost, "{schedule:?}: {} against {}", o.lost, all_old.lost);
    }
}
