//! The wireguard backend's timer thread: keeps the sessions' peers those of the route table
//! and ticks their timers (gotatun's: handshake retries, rekeys, keepalives, the handshake rate
//! limiter's reset) every [`TICK`], sending what they ask for from the listen port's socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::io::UdpIo;
use super::wait::StopSignal;
use crate::dataplane::sys::udp::Transmit;
use crate::dataplane::transport::wireguard::Devices;
use crate::dataplane::worker::counters::PacketCounters;
use crate::route::{RouteTable, Routes};
use crate::time::Clock;

/// How often the timers are ticked (as gotatun's own device and wireguard-go do).
pub const TICK: Duration = Duration::from_millis(250);

/// How often the thread looks at the route table and the stop signal between ticks: a new
/// peer is known to the sessions within this of its route.
const LOOK: Duration = Duration::from_millis(25);

/// How often the thread looks whether the process it took over from has stopped reading the
/// sockets: the handshakes of a takeover start within this of it.
const RELEASE_LOOK: Duration = Duration::from_millis(1);

/// Runs until `stop`: each device's peers from `routes` ([`Devices::set_peers_of`]), timers
/// ticked every [`TICK`], their datagrams sent on `sock` (the listen ports' sockets, one per
/// underlay family). `initiate`: this process took over from another; once the flag it points
/// at is set (the predecessor has stopped reading the sockets, so every handshake response
/// reaches us), start a handshake with every peer ([`Devices::initiate_all`]). Before that the
/// predecessor forwards with its sessions; starting earlier, a response read by the
/// predecessor is lost, and the peer seals for a session nobody has until gotatun retries,
/// 5 s later.
pub(crate) fn run_wireguard_timers<U: UdpIo>(
    wg: &Devices,
    routes: &Arc<Routes>,
    sock: &mut U,
    clock: &dyn Clock,
    stop: &StopSignal,
    counters: &PacketCounters,
    initiate: Option<&AtomicBool>,
) {
    let mut initiate = initiate;
    let mut seen: Option<Arc<RouteTable>> = None;
    let mut since_tick = Duration::ZERO;
    while !stop.is_stopped() {
        let table = Arc::clone(&routes.load());
        if !seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &table)) {
            wg.set_peers_of(&table);
            seen = Some(table);
        }
        if initiate.is_some_and(|released| released.load(Ordering::Acquire)) {
            initiate = None;
            let now = clock.now();
            wg.initiate_all(|to, datagram| {
                let tx = Transmit { dst: to, contents: datagram, segment_size: None };
                super::tx::send_skipping(sock, &[tx], now, counters);
            });
        }
        if since_tick >= TICK {
            since_tick = Duration::ZERO;
            let now = clock.now();
            wg.tick(|to, datagram| {
                let tx = Transmit { dst: to, contents: datagram, segment_size: None };
                super::tx::send_skipping(sock, &[tx], now, counters);
            });
        }
        let look = if initiate.is_some() { RELEASE_LOOK } else { LOOK };
        // Woken at once by the stop: a handover's quiesce joins this thread, and until it
        // returns nobody forwards (the predecessor's workers have stopped, the successor
        // waits for Released).
        stop.sleep(look);
        since_tick += look;
    }
}
