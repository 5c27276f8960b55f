//! Peers whose datagrams arrive malformed at a rate: the trace a sender's broken offload (a
//! kernel GSO bug no table in [`crate::dataplane::offload::kernel_bugs`] knows) can leave at a receiver, noticed
//! without a log line per packet.
//!
//! # What a receiver can see
//! The kernel checks a datagram's UDP length and checksum before user space sees it: a
//! datagram whose UDP length is longer than the packet is dropped on arrival, and one whose
//! checksum is wrong is dropped when it is read (with UDP GRO too: GRO merges only datagrams
//! whose checksums were verified). Either way only the namespace-wide `Udp: InErrors` and
//! `InCsumErrors` of `/proc/net/snmp` count them, for every socket and sender at once: weft
//! cannot tell from whom they came, or that they were meant for it. So the mangled
//! datagrams of the 7.0 GSO bug (a UDP length too long) never reach weft at all. What does
//! reach it is a datagram the kernel had no checksum to refuse, or whose checksum was
//! computed over already-mangled bytes (a kernel VXLAN sender sends no UDP checksum by
//! default; a NIC checksums what it was given): a VXLAN header cut short or full of garbage,
//! an inner frame or packet cut short. The RX path counts those by reason (the suspect ones:
//! `malformed`, `bad_vxlan_flags`; see `transport::DropReason::is_suspect`); this module says
//! when one peer sends them at a rate.
//!
//! # Contract
//! Pure: each call takes `now`; nothing is allocated after construction (fixed tables).
//! - [`MalformedWatch`], one per RX thread: [`MalformedWatch::record`] counts one suspect
//!   datagram from a peer. When a peer's count within one [`WINDOW`] reaches [`THRESHOLD`],
//!   it returns an [`Alarm`], once per window. It follows up to [`PEERS`] peers; a new one
//!   takes the place of the one heard from least recently.
//! - [`MalformedLog`], one per data plane, shared by the RX threads: [`MalformedLog::admit`]
//!   says whether an alarm is to be logged: at most once per peer per [`QUIET`], whichever
//!   thread raised it, and for at most [`PEERS`] peers per [`QUIET`] (the rest are counted,
//!   not logged): so never more than [`PEERS`] lines per [`QUIET`]. It takes its lock only for
//!   an alarm, never per packet.

#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::time::Instant;

/// How long a window a peer's suspect datagrams are counted in.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Suspect datagrams from one peer within one [`WINDOW`] that raise an [`Alarm`]: a few stray
/// ones (a scanner, one corrupted frame) do not.
pub const THRESHOLD: u32 = 20;
/// The least time between two logged alarms about one peer.
pub const QUIET: Duration = Duration::from_secs(600);
/// Peers each table follows at once.
pub const PEERS: usize = 16;

/// A peer found sending suspect datagrams at a rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alarm {
    /// The peer (the datagrams' outer source address).
    pub peer: IpAddr,
    /// Suspect datagrams from it in the window so far.
    pub count: u32,
    /// Since the window began.
    pub over: Duration,
    /// The drop reason (its metric label) of the datagram that raised it.
    pub reason: &'static str,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    peer: Option<IpAddr>,
    /// When its window began.
    since: Instant,
    /// Suspect datagrams in the window.
    count: u32,
    /// When it was last heard from.
    last: Instant,
    /// Whether this window has raised its alarm.
    alarmed: bool,
}

const EMPTY: Slot =
    Slot { peer: None, since: Instant::ZERO, count: 0, last: Instant::ZERO, alarmed: false };

/// One RX thread's count of suspect datagrams by peer; see the module docs.
#[derive(Clone, Debug)]
pub struct MalformedWatch {
    slots: [Slot; PEERS],
}

impl Default for MalformedWatch {
    fn default() -> Self {
        Self { slots: [EMPTY; PEERS] }
    }
}

/// The slot of `peer` in `slots`, or the one to give it: an empty one, else the one whose
/// `age` is the oldest.
fn slot_for<T>(
    slots: &mut [T],
    peer: IpAddr,
    key: impl Fn(&T) -> Option<IpAddr>,
    age: impl Fn(&T) -> Instant,
) -> (&mut T, bool) {
    let at = slots
        .iter()
        .position(|s| key(s) == Some(peer))
        .map(|i| (i, true))
        .or_else(|| slots.iter().position(|s| key(s).is_none()).map(|i| (i, false)))
        .unwrap_or_else(|| {
            let oldest = (0..slots.len()).min_by_key(|&i| age(&slots[i])).unwrap_or(0);
            (oldest, false)
        });
    (&mut slots[at.0], at.1)
}

impl MalformedWatch {
    /// A watch that has heard from nobody.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one suspect datagram (dropped for `reason`, a drop reason's label) from `peer` at
    /// `now`; the alarm, if this one makes the peer's window reach [`THRESHOLD`].
    pub fn record(&mut self, peer: IpAddr, reason: &'static str, now: Instant) -> Option<Alarm> {
        let (slot, known) = slot_for(&mut self.slots, peer, |s| s.peer, |s| s.last);
        if !known || now.saturating_since(slot.since) >= WINDOW {
            *slot = Slot { peer: Some(peer), since: now, count: 0, last: now, alarmed: false };
        }
        slot.count = slot.count.saturating_add(1);
        slot.last = now;
        if slot.count < THRESHOLD || slot.alarmed {
            return None;
        }
        slot.alarmed = true;
        Some(Alarm { peer, count: slot.count, over: now.saturating_since(slot.since), reason })
    }
}

/// Which peers' alarms were logged when, shared by a data plane's RX threads; see the module
/// docs.
#[derive(Debug)]
pub struct MalformedLog {
    logged: Mutex<[(Option<IpAddr>, Instant); PEERS]>,
}

impl Default for MalformedLog {
    fn default() -> Self {
        Self { logged: Mutex::new([(None, Instant::ZERO); PEERS]) }
    }
}

impl MalformedLog {
    /// Whether an alarm about `peer` at `now` is to be logged: not if one about it was within
    /// the last [`QUIET`], nor if [`PEERS`] other peers' were.
    pub fn admit(&self, peer: IpAddr, now: Instant) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(PoisonError::into_inner);
        let (slot, _) = slot_for(&mut *logged, peer, |s| s.0, |s| s.1);
        let recent = slot.0.is_some() && now.saturating_since(slot.1) < QUIET;
        // A recent slot is the peer's own (logged lately) or, the table being full, the
        // oldest of PEERS recent others': either way, not now.
        if recent {
            return false;
        }
        *slot = (Some(peer), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;

    fn peer(d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, d))
    }

    fn ms(n: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(n))
    }

    /// Records `n` suspect datagrams from `p`, `every` ms apart from `start`; the alarms.
    fn burst(w: &mut MalformedWatch, p: IpAddr, n: u64, start: u64, every: u64) -> Vec<Alarm> {
        (0..n).filter_map(|i| w.record(p, "malformed", ms(start + i * every))).collect()
    }

    #[test]
    fn a_rate_of_suspect_datagrams_raises_one_alarm_per_window() {
        let mut w = MalformedWatch::new();
        let alarms = burst(&mut w, peer(7), 100, 0, 10);
        assert_eq!(alarms.len(), 1, "{alarms:?}");
        let a = alarms[0];
        assert_eq!((a.peer, a.count, a.reason), (peer(7), THRESHOLD, "malformed"));
        assert_eq!(a.over, Duration::from_millis(10 * u64::from(THRESHOLD - 1)));
        // The next window raises the next one.
        assert_eq!(burst(&mut w, peer(7), 100, 10_000, 10).len(), 1);
    }

    #[test]
    fn a_trickle_never_raises_one() {
        let mut w = MalformedWatch::new();
        // THRESHOLD - 1 per window, window after window.
        let every = WINDOW.as_millis() as u64 / u64::from(THRESHOLD - 1) + 1;
        assert_eq!(burst(&mut w, peer(7), 1000, 0, every), []);
    }

    #[test]
    fn peers_are_counted_apart_and_a_crowd_only_evicts_the_quietest() {
        let mut w = MalformedWatch::new();
        // Peer 1 is halfway to an alarm; peers 2..=16 fill the table, each once, later.
        assert_eq!(burst(&mut w, peer(1), u64::from(THRESHOLD / 2), 0, 1), []);
        for d in 2..=PEERS as u8 {
            assert_eq!(w.record(peer(d), "bad_vxlan_flags", ms(100 + u64::from(d))), None);
        }
        // One more peer takes the place of the one heard from least recently: peer 1.
        assert_eq!(w.record(peer(99), "bad_vxlan_flags", ms(200)), None);
        let rest = u64::from(THRESHOLD / 2);
        assert_eq!(burst(&mut w, peer(1), rest, 300, 1), [], "peer 1 starts again from 0");
        // Peer 2 is still counted: it alarms at its own THRESHOLD.
        let alarms = burst(&mut w, peer(2), u64::from(THRESHOLD), 400, 1);
        assert_eq!(alarms.len(), 1);
        assert_eq!(alarms[0].count, THRESHOLD);
    }

    #[test]
    fn the_log_admits_one_alarm_per_peer_per_quiet_time() {
        let log = MalformedLog::default();
        assert!(log.admit(peer(7), ms(0)));
        assert!(!log.admit(peer(7), ms(1000)), "another thread's alarm about the same peer");
        assert!(log.admit(peer(8), ms(1000)), "another peer");
        assert!(!log.admit(peer(7), ms(QUIET.as_millis() as u64 - 1)));
        assert!(log.admit(peer(7), ms(QUIET.as_millis() as u64)));
        // PEERS peers logged within QUIET fill it: a new one is not logged until the oldest of
        // them is QUIET old.
        let log = MalformedLog::default();
        for d in 0..PEERS as u8 {
            assert!(log.admit(peer(d), ms(u64::from(d))));
        }
        assert!(!log.admit(peer(99), ms(1000)), "a seventeenth peer within QUIET");
        assert!(log.admit(peer(99), ms(QUIET.as_millis() as u64)), "peer 0's slot is QUIET old");
        assert!(!log.admit(peer(0), ms(QUIET.as_millis() as u64)), "and it is taken");
    }

    proptest! {
        /// Whatever the senders and times: an alarm names the peer that sent the datagram,
        /// comes after THRESHOLD datagrams of it within one window, and only once per window.
        #[test]
        fn at_most_one_alarm_per_peer_per_window(
            events in proptest::collection::vec((0u8..40, 0u64..2000), 0..400),
        ) {
            let mut w = MalformedWatch::new();
            let mut t = 0;
            let mut windows = std::collections::HashSet::new();
            for (d, gap) in events {
                t += gap;
                if let Some(a) = w.record(peer(d), "malformed", ms(t)) {
                    prop_assert_eq!(a.peer, peer(d));
                    prop_assert!(a.count >= THRESHOLD && a.over < WINDOW);
                    let start = t - a.over.as_millis() as u64;
                    prop_assert!(windows.insert((a.peer, start)), "two alarms in one window");
                }
            }
        }

        /// A peer that sends THRESHOLD suspect datagrams within one window raises its alarm
        /// however many datagrams fewer than PEERS - 1 other peers send in between.
        #[test]
        fn a_rate_among_few_others_always_alarms(
            others in proptest::collection::vec(0u8..(PEERS as u8 - 1), 0..300),
        ) {
            let mut w = MalformedWatch::new();
            let (ours, mut alarms) = (peer(200), 0);
            let n = others.len().max(THRESHOLD as usize);
            for i in 0..n {
                let t = ms(i as u64);
                if i < THRESHOLD as usize && w.record(ours, "bad_vxlan_flags", t).is_some() {
                    alarms += 1;
                }
                if let Some(&d) = others.get(i) {
                    prop_assert!(w.record(peer(d), "malformed", t).is_none_or(|a| a.peer == peer(d)));
                }
            }
            prop_assert_eq!(alarms, 1);
        }
    }
}
