//! Routes: which peer each overlay destination goes to, published to the data plane as an
//! immutable snapshot behind an atomic pointer.
//!
//! - [`table`]: [`RouteTable`], the immutable longest-prefix-match snapshot, and [`Peer`]
//!   parsing from lease values (pure).
//! - [`set`]: [`RouteSet`], the lease → route state machine: listings and watch batches in,
//!   tables out (pure).
//! - [`watcher`]: the driver that lists and watches the store, feeds a [`RouteSet`] and
//!   publishes its tables into [`Routes`] (the only I/O here).
//! - [`backends`]: which peers this host cannot reach because their lease announces another
//!   backend, and telling about them (pure, and a driver that follows the published tables).
//!
//! # Contract
//! - Readers (the data plane's workers) call [`Routes::load`] once per batch of packets and do
//!   every lookup of that batch against that snapshot. A load takes no lock: arc-swap's load
//!   is lock-free and, in practice, wait-free (it falls back to a slower, still lock-free
//!   path only when one thread holds many guards at once — hold one guard per worker). Lookups
//!   are wait-free and allocate nothing.
//! - The writer (the watcher) builds a whole new table off the hot path and swaps it in with
//!   [`Routes::store`]. A reader never sees a half-built table, and a writer never waits for
//!   a reader: an old table is freed when the last reader drops its guard.
//! - Staleness: a snapshot is at most one batch old on top of how far the published table lags
//!   the store. The watcher publishes a change as soon as the watch delivers it (normally
//!   milliseconds after the write), a relinquished route in the same batch as its delete
//!   (the departure marker rides with it); it
//!   re-lists at most once per [`watcher::RELIST_DEBOUNCE`], and while the store is
//!   unreachable it keeps the last published table indefinitely (the data plane never tears
//!   down because the control plane is blind).
//! - Published routes follow docs/lease-rules.md ("Loss and reclaim"): see [`set`].
//! - Change notice: every [`Routes::store`] bumps a generation that [`Routes::subscribe`]
//!   watches (a `tokio::sync::watch`, which only the writer and the watchers touch: loads stay
//!   lock-free). A data plane that programs the kernel from the table (kernel routes) waits on
//!   it; generation 0 is the table the daemon started with, before the watcher's first listing.

pub mod backends;
pub(crate) mod set;
pub(crate) mod table;
pub mod watcher;

use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use tokio::sync::watch;

pub use set::RouteSet;
pub use table::{Peer, Peer6, Peer6Error, PeerBackend, PeerError, RouteTable, Wireguard6};
pub use watcher::{RouteStats, run};

/// The published route table: one writer swaps whole snapshots in, many readers load them
/// without locks. See the module docs for the contract.
pub struct Routes {
    table: ArcSwap<RouteTable>,
    /// How many tables were stored since [`Routes::new`].
    generation: watch::Sender<u64>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes").field("table", &**self.table.load()).finish()
    }
}

impl Routes {
    /// Routes that start out as `table`.
    pub fn new(table: RouteTable) -> Self {
        Self { table: ArcSwap::from_pointee(table), generation: watch::Sender::new(0) }
    }

    /// The current snapshot. Lock-free; load once per batch and drop the guard when the batch
    /// is done.
    #[inline]
    pub fn load(&self) -> Guard<Arc<RouteTable>> {
        self.table.load()
    }

    /// Publishes `table`: every later [`Routes::load`] sees it. Readers holding an older
    /// snapshot keep it until they drop it.
    pub(crate) fn store(&self, table: RouteTable) {
        self.table.store(Arc::new(table));
        self.generation.send_modify(|g| *g += 1);
    }

    /// A watch of the table's generation: it goes up with every [`Routes::store`] (a waiting
    /// task sees one wake-up for a burst of them, then loads the table). 0 until the first.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn readers_keep_their_snapshot_across_a_store() {
        let net = "10.244.0.0/16".parse().unwrap();
        let routes = Routes::new(RouteTable::build(net, 24, []));
        let before = routes.load();
        let peer = Peer {
            subnet: "10.244.1.0/24".parse().unwrap(),
            public_ip: Ipv4Addr::new(192, 0, 2, 1),
            backend: PeerBackend::Udp,
            vtep_mac: None,
            vni: None,
            node: None,
            stale: false,
            incarnation: None,
            ipv6: None,
        };
        routes.store(RouteTable::build(net, 24, [peer]));
        assert!(before.is_empty());
        assert_eq!(routes.load().len(), 1);
        assert!(routes.load().lookup(Ipv4Addr::new(10, 244, 1, 1)).is_some());
    }

    /// A store is announced to every subscriber, and the generation counts the stores.
    #[test]
    fn a_store_bumps_the_generation_subscribers_see() {
        let net = "10.244.0.0/16".parse().unwrap();
        let routes = Routes::new(RouteTable::build(net, 24, []));
        let mut rx = routes.subscribe();
        assert_eq!(*rx.borrow_and_update(), 0);
        assert!(!rx.has_changed().unwrap());
        routes.store(RouteTable::build(net, 24, []));
        routes.store(RouteTable::build(net, 24, []));
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), 2);
    }
}
