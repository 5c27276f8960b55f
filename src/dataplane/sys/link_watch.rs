//! Notice of changes to the kernel's links, addresses and routes, as they happen: a
//! `NETLINK_ROUTE` socket bound to the `RTNLGRP_LINK`, `RTNLGRP_IPV4_IFADDR` and
//! `RTNLGRP_IPV4_ROUTE` multicast groups (what `ip monitor link address route` listens to), and
//! for a link's own watch (the TUN device, which carries IPv6 on a dual-stack network) also
//! `RTNLGRP_IPV6_IFADDR` and `RTNLGRP_IPV6_ROUTE`, over the `rtnetlink` crate.
//!
//! Contract:
//! - A [`ChangeWatch`] runs its socket on a thread of its own (`weft-nl-watch`, a current-thread
//!   tokio runtime: a [`NetlinkThread`], as [`super::netlink::Netlink`] does), and publishes a generation number on a
//!   `tokio::sync::watch` channel: it goes up by one for each kernel notification its
//!   [`Interest`] keeps, and for each overrun of the socket's buffer (notifications were lost,
//!   so anything may have changed). A waiting task sees one wake-up for a burst of them.
//! - The watch says *that* something changed, never what it is now: the consumer reads the
//!   state again (drift repair reads the link back, the underlay follower lists the addresses).
//!   So a lost or merged notification costs nothing but that read.
//! - The channel closes when the socket fails or the thread ends; the consumer then falls back
//!   to polling. Dropping the watch ends the thread.
//! - Which notifications matter is decided by pure functions ([`concerns_link`]) that never
//!   panic on any message and are tested on built messages.
//! - Listening needs no privilege and sees the namespace the socket was opened in.

use futures::StreamExt;
use rtnetlink::MulticastGroup;
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::route::RouteAttribute;
use tokio::sync::watch;

use super::netlink::{NetlinkError, NetlinkThread};

/// Which notifications wake the consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Interest {
    /// Only those about the links with these indexes (one given twice: one link): each link
    /// itself, its addresses, and routes whose output interface it is (the TUN device's drift,
    /// and the underlay's for the kernel routes to peers).
    Links([u32; 2]),
    /// Any link, IPv4 address or IPv4 route (the underlay: its address may move to any
    /// interface the default route goes through).
    Any,
}

impl Interest {
    /// The multicast groups to join: the underlay's address is IPv4 (`Any`); the TUN device's
    /// state has an IPv6 half on a dual-stack network (`Link`).
    fn groups(self) -> &'static [MulticastGroup] {
        match self {
            Interest::Links(_) => &[
                MulticastGroup::Link,
                MulticastGroup::Ipv4Ifaddr,
                MulticastGroup::Ipv4Route,
                MulticastGroup::Ipv6Ifaddr,
                MulticastGroup::Ipv6Route,
            ],
            Interest::Any => {
                &[MulticastGroup::Link, MulticastGroup::Ipv4Ifaddr, MulticastGroup::Ipv4Route]
            }
        }
    }

    fn keeps(self, msg: &RouteNetlinkMessage) -> bool {
        match self {
            Interest::Links(indexes) => indexes.iter().any(|i| concerns_link(msg, *i)),
            Interest::Any => true,
        }
    }
}

/// Whether a notification is about the link with index `index`: a change to the link, to one
/// of its addresses, or to a route through it.
pub(crate) fn concerns_link(msg: &RouteNetlinkMessage, index: u32) -> bool {
    match msg {
        RouteNetlinkMessage::NewLink(l) | RouteNetlinkMessage::DelLink(l) => {
            l.header.index == index
        }
        RouteNetlinkMessage::NewAddress(a) | RouteNetlinkMessage::DelAddress(a) => {
            a.header.index == index
        }
        RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r) => {
            r.attributes.iter().any(|a| match a {
                RouteAttribute::Oif(i) => *i == index,
                RouteAttribute::MultiPath(hops) => hops.iter().any(|h| h.interface_index == index),
                _ => false,
            })
        }
        _ => false,
    }
}

/// A subscription to the kernel's link, address and route notifications (see the module docs).
#[derive(Debug)]
pub(crate) struct ChangeWatch {
    /// Ends the thread when dropped.
    _thread: NetlinkThread,
}

impl ChangeWatch {
    /// Opens the socket in the calling thread's network namespace, joins the groups and starts
    /// the thread. The receiver's value is the generation (0 at start).
    pub(crate) fn start(interest: Interest) -> Result<(Self, watch::Receiver<u64>), NetlinkError> {
        let (changes_tx, changes_rx) = watch::channel(0u64);
        let (thread, ()) = NetlinkThread::spawn("weft-nl-watch", move || {
            let (connection, _handle, mut messages) =
                rtnetlink::new_multicast_connection(interest.groups())?;
            let forward = async move {
                while let Some((message, _)) = messages.next().await {
                    let changed = match &message.payload {
                        NetlinkPayload::InnerMessage(m) => interest.keeps(m),
                        // The socket's buffer overflowed: notifications were lost.
                        NetlinkPayload::Overrun(_) => true,
                        _ => false,
                    };
                    if changed {
                        changes_tx.send_modify(|g| *g += 1);
                    }
                }
            };
            let run = async move {
                tokio::select! {
                    () = connection => {}
                    () = forward => {}
                }
            };
            Ok(((), run))
        })?;
        Ok((Self { _thread: thread }, changes_rx))
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::time::Duration;

    use rtnetlink::RouteMessageBuilder;
    use rtnetlink::packet_route::address::AddressMessage;
    use rtnetlink::packet_route::link::LinkMessage;
    use rtnetlink::packet_route::route::RouteNextHop;

    use rtnetlink::packet_route::route::RouteMessage;

    use super::*;

    fn route_via(index: u32) -> RouteMessage {
        RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::new(10, 244, 0, 0), 16)
            .output_interface(index)
            .build()
    }

    #[test]
    fn only_notifications_about_the_link_concern_it() {
        let mut link = LinkMessage::default();
        link.header.index = 7;
        let mut other_link = LinkMessage::default();
        other_link.header.index = 8;
        let mut addr = AddressMessage::default();
        addr.header.index = 7;
        let mut other_addr = AddressMessage::default();
        other_addr.header.index = 2;
        let mut multipath = RouteMessage::default();
        let mut hop = RouteNextHop::default();
        hop.interface_index = 7;
        multipath.attributes.push(RouteAttribute::MultiPath(vec![hop]));

        use RouteNetlinkMessage as M;
        assert!(concerns_link(&M::NewLink(link.clone()), 7));
        assert!(concerns_link(&M::DelLink(link), 7));
        assert!(!concerns_link(&M::NewLink(other_link), 7));
        assert!(concerns_link(&M::DelAddress(addr.clone()), 7));
        assert!(concerns_link(&M::NewAddress(addr), 7));
        assert!(!concerns_link(&M::NewAddress(other_addr), 7));
        assert!(concerns_link(&M::DelRoute(route_via(7)), 7));
        assert!(!concerns_link(&M::DelRoute(route_via(3)), 7));
        assert!(concerns_link(&M::NewRoute(multipath), 7));
        // A route without an output interface (e.g. a blackhole) concerns no link.
        assert!(!concerns_link(&M::NewRoute(RouteMessage::default()), 7));
    }

    /// Joining the groups needs no privilege; the thread and its channel end with the watch.
    /// (Notifications themselves are tested end to end, in namespaces, by
    /// `integration/e2e_drift.rs` and `e2e_underlay.rs`, with weft's periodic reads turned off.)
    #[test]
    fn a_watch_starts_without_privilege_and_ends_when_dropped() {
        let (watch, rx) = ChangeWatch::start(Interest::Any).expect("netlink watch");
        assert_eq!(*rx.borrow(), 0);
        drop(watch);
        // The thread has ended: the sender is gone.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut rx = rx;
        let closed =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), rx.changed()).await });
        assert!(matches!(closed, Ok(Err(_))), "the channel closes with the watch: {closed:?}");
    }
}
