//! The malformed-peers watch and log (`malformed_peers`), fed any sequence of suspect
//! datagrams from any peers at any times: an alarm names the peer that sent the datagram,
//! comes only once THRESHOLD of its datagrams fell within one WINDOW, and never twice in one
//! window; the log admits an alarm about a peer at most once per QUIET.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use weft::dataplane::transport::malformed_peers::{
    MalformedLog, MalformedWatch, QUIET, THRESHOLD, WINDOW,
};
use weft::time::Instant;

#[derive(Arbitrary, Debug)]
struct Event {
    peer: u8,
    /// Milliseconds since the last event.
    gap: u16,
    bad_flags: bool,
}

fuzz_target!(|events: Vec<Event>| {
    let mut watch = MalformedWatch::new();
    let log = MalformedLog::default();
    let mut t = 0u64;
    let mut windows = HashSet::new();
    let mut logged: HashMap<IpAddr, u64> = HashMap::new();
    for e in events {
        t += u64::from(e.gap);
        let now = Instant::from_epoch(Duration::from_millis(t));
        let peer = IpAddr::V4(Ipv4Addr::new(192, 0, 2, e.peer % 48));
        let reason = if e.bad_flags { "bad_vxlan_flags" } else { "malformed" };
        let Some(a) = watch.record(peer, reason, now) else { continue };
        assert_eq!((a.peer, a.reason), (peer, reason));
        assert!(a.count >= THRESHOLD && a.over < WINDOW, "{a:?}");
        let start = t - a.over.as_millis() as u64;
        assert!(windows.insert((peer, start)), "two alarms in one window: {a:?}");
        if log.admit(peer, now) {
            if let Some(&last) = logged.get(&peer) {
                assert!(t - last >= QUIET.as_millis() as u64, "logged {peer} twice in QUIET");
            }
            logged.insert(peer, t);
        }
    }
});
