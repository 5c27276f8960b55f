//! The wireguard backend's timer thread: keeps the sessions' peers those of the route table
//! and ticks their timers (gotatun's: handshake retries, rekeys, keepalives, the handshake rate
//! limiter's reset) every [`TICK`], sending what they ask for from the listen port's socket.

use std::sync::Arc;
use std::time::Duration;

use super::io::UdpIo;
use super::wait::StopSignal;
use crate::dataplane::sys::udp::Transmit;
use crate::dataplane::transport::wireguard::{self, Sessions};
use crate::dataplane::worker::counters::PacketCounters;
use crate::route::{RouteTable, Routes};
use crate::time::Clock;

/// How often the timers are ticked (as gotatun's own device and wireguard-go do).
pub const TICK: Duration = Duration::from_millis(250);

/// How often the thread looks at the route table and the stop signal between ticks: a new
/// peer is known to the sessions within this of its route.
const LOOK: Duration = Duration::from_millis(25);

/// Runs until `stop`: peers from `routes` (those without a port in their lease at `port`),
/// timers ticked every [`TICK`], their datagrams sent on `sock`. `initiate`: start a handshake
/// with every peer first ([`Sessions::initiate_all`]: this process took over from another).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_wireguard_timers<U: UdpIo>(
    wg: &Sessions,
    routes: &Arc<Routes>,
    port: u16,
    sock: &mut U,
    clock: &dyn Clock,
    stop: &StopSignal,
    counters: &PacketCounters,
    initiate: bool,
) {
    if initiate {
        wg.set_peers(wireguard::peers_of(&routes.load(), port));
        let now = clock.now();
        wg.initiate_all(|to, datagram| {
            let tx = Transmit { dst: to, contents: datagram, segment_size: None };
            super::tx::send_skipping(sock, &[tx], now, counters);
        });
    }
    let mut seen: Option<Arc<RouteTable>> = None;
    let mut since_tick = Duration::ZERO;
    while !stop.is_stopped() {
        let table = Arc::clone(&routes.load());
        if !seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &table)) {
            wg.set_peers(wireguard::peers_of(&table, port));
            seen = Some(table);
        }
        if since_tick >= TICK {
            since_tick = Duration::ZERO;
            let now = clock.now();
            wg.tick(|to, datagram| {
                let tx = Transmit { dst: to, contents: datagram, segment_size: None };
                super::tx::send_skipping(sock, &[tx], now, counters);
            });
        }
        std::thread::sleep(LOOK);
        since_tick += LOOK;
    }
}
