//! The kernel's link, address and route tables over rtnetlink (the `rtnetlink` crate): the TUN
//! device's MTU, link state, address and Network route, read back for drift repair and put back;
//! whether a TUN device of a name exists and has queues attached; and the interface of the
//! default route and its MTU, for the underlay.
//!
//! Contract:
//! - A [`Netlink`] is one `NETLINK_ROUTE` socket, driven by a thread of its own (`weft-netlink`,
//!   a current-thread tokio runtime), so that its calls are plain blocking calls that work from
//!   any thread: a data plane thread, a `spawn_blocking` task, or a tokio worker at start-up
//!   (where a runtime of the caller's own could not be entered). Each call waits for the
//!   kernel's answer at most [`REPLY_TIMEOUT`]. Dropping it ends the thread.
//! - Every request runs in the caller's network namespace as the socket was opened in it (a
//!   socket keeps the namespace it was created in). Reading needs no privilege; changing needs
//!   `CAP_NET_ADMIN` only.
//! - Errors are [`NetlinkError`]s naming the request (`RTM_*`) and the interface; the kernel's
//!   errno stays readable ([`NetlinkError::raw_os_error`]).
//! - What the kernel answers is turned into weft's types by pure functions ([`tun_status_of`],
//!   [`device_routes`], [`ipv4_addresses`], [`default_route_oif`]), which never panic on any
//!   message and are tested on messages built here.
//! - The writes: [`Netlink::set_ipv4`] replaces the
//!   device's primary IPv4 address (the new one is added before the old one is removed, so the
//!   device never has none and keeps its routes); [`Netlink::add_route`] adds a gatewayless,
//!   link-scope route to the main table; a route to the Network that is there already and is
//!   not that one (a gateway, another device) is replaced, with a WARN naming it.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use futures::TryStreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use rtnetlink::packet_core::Nla;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressHeaderFlags, AddressMessage, AddressScope,
};
use rtnetlink::packet_route::link::{
    InfoData, InfoKind, InfoTun, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType,
};
use rtnetlink::{LinkUnspec, RouteMessageBuilder};

mod types;
pub(crate) use types::{ObservedLink, PeerRoute, ROUTE_PROTOCOL, SeenRoute};

/// How long a request waits for the kernel's answer.
pub(crate) const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a netlink request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NetlinkError {
    /// The interface name is empty, too long (15 bytes at most) or has a NUL.
    #[error("bad interface name {0:?}: 1 to 15 bytes, no NUL")]
    BadName(String),
    /// The netlink socket or its thread could not be set up.
    #[error("opening a NETLINK_ROUTE socket: {0}")]
    Open(#[source] io::Error),
    /// The kernel refused the request, or its answer could not be read.
    #[error("{op} {name}: {source}")]
    Request {
        /// The request, e.g. `RTM_NEWROUTE`.
        op: &'static str,
        /// The interface.
        name: String,
        /// The error (the kernel's errno where it gave one).
        #[source]
        source: io::Error,
    },
    /// No answer within [`REPLY_TIMEOUT`].
    #[error("{op} {name}: no answer from the kernel within {REPLY_TIMEOUT:?}")]
    TimedOut {
        /// The request.
        op: &'static str,
        /// The interface.
        name: String,
    },
    /// The socket's thread has ended (its socket failed).
    #[error("{op} {name}: the netlink connection has closed")]
    Closed {
        /// The request.
        op: &'static str,
        /// The interface.
        name: String,
    },
}

impl NetlinkError {
    /// The kernel's errno, when the kernel refused the request.
    pub(crate) fn raw_os_error(&self) -> Option<i32> {
        match self {
            Self::Request { source, .. } | Self::Open(source) => source.raw_os_error(),
            _ => None,
        }
    }
}

/// What the kernel says about the interface a TUN device would be opened as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TunStatus {
    /// No interface has the name.
    Absent,
    /// A TUN/TAP device with no queue attached (a persistent device nobody has open).
    Detached,
    /// A TUN/TAP device with queues attached: another process has it open. `None` when the
    /// kernel does not report queues (before Linux 4.15), then any existing device counts.
    Attached(Option<u32>),
    /// An interface of another kind.
    NotTun,
}

/// Checks an interface name as the kernel would (`IFNAMSIZ`), before any request.
pub(crate) fn check_name(name: &str) -> Result<(), NetlinkError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(NetlinkError::BadName(name.to_owned()));
    }
    Ok(())
}

fn io_error(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(msg) => msg.to_io(),
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

/// A thread of its own for one netlink connection: a current-thread tokio runtime on which
/// `start` opens the connection and returns what the caller keeps (a request handle, a
/// channel) and the future that drives it; the future then runs until it ends or the thread is
/// stopped. Dropping it stops the thread and waits for it. Shared by [`Netlink`] (requests) and
/// [`super::link_watch::ChangeWatch`] (notifications), which differ only in what they run.
#[derive(Debug)]
pub(crate) struct NetlinkThread {
    /// Dropped (or sent) to end the thread.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NetlinkThread {
    /// Starts the thread `name` and runs `start` on it; returns once `start` has returned (its
    /// error, if it failed).
    pub(crate) fn spawn<T, F, Fut>(name: &str, start: F) -> Result<(Self, T), NetlinkError>
    where
        T: Send + 'static,
        F: FnOnce() -> io::Result<(T, Fut)> + Send + 'static,
        Fut: Future<Output = ()>,
    {
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let runtime =
                    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                runtime.block_on(async move {
                    let (value, run) = match start() {
                        Ok(started) => started,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(value));
                    tokio::select! {
                        () = run => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(NetlinkError::Open)?;
        let this = Self { stop: Some(stop), thread: Some(thread) };
        match ready_rx.recv() {
            Ok(Ok(value)) => Ok((this, value)),
            // Dropping `this` joins the thread, which has ended.
            Ok(Err(e)) => Err(NetlinkError::Open(e)),
            Err(_) => {
                Err(NetlinkError::Open(io::Error::other("the netlink thread ended at start")))
            }
        }
    }
}

impl Drop for NetlinkThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One `NETLINK_ROUTE` socket on a thread of its own (see the module docs).
#[derive(Debug)]
pub(crate) struct Netlink {
    handle: rtnetlink::Handle,
    runtime: tokio::runtime::Handle,
    /// Ends the thread when dropped.
    _thread: NetlinkThread,
}

impl Netlink {
    /// Opens the socket in the calling thread's network namespace and starts its thread.
    pub(crate) fn open() -> Result<Self, NetlinkError> {
        let (thread, (handle, runtime)) = NetlinkThread::spawn("weft-netlink", || {
            let (connection, handle, _) = rtnetlink::new_connection()?;
            Ok(((handle, tokio::runtime::Handle::current()), connection))
        })?;
        Ok(Self { handle, runtime, _thread: thread })
    }

    /// Runs `request` on the socket's thread and waits for its result.
    fn run<T, F>(&self, op: &'static str, name: &str, request: F) -> Result<T, NetlinkError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, rtnetlink::Error>> + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        // A runtime that has shut down drops the task, and with it `tx`: `recv` then fails.
        self.runtime.spawn(async move {
            let _ = tx.send(tokio::time::timeout(REPLY_TIMEOUT, request).await);
        });
        match rx.recv() {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(e))) => {
                Err(NetlinkError::Request { op, name: name.to_owned(), source: io_error(e) })
            }
            Ok(Err(_elapsed)) => Err(NetlinkError::TimedOut { op, name: name.to_owned() }),
            Err(_) => Err(NetlinkError::Closed { op, name: name.to_owned() }),
        }
    }

    /// The link named `name` (`RTM_GETLINK`); `ENODEV` when there is none.
    fn link(&self, name: &str) -> Result<LinkMessage, NetlinkError> {
        check_name(name)?;
        let (handle, owned) = (self.handle.clone(), name.to_owned());
        let found = self.run("RTM_GETLINK", name, async move {
            handle.link().get().match_name(owned).execute().try_next().await
        })?;
        found.ok_or_else(|| NetlinkError::Request {
            op: "RTM_GETLINK",
            name: name.to_owned(),
            source: io::Error::from_raw_os_error(libc::ENODEV),
        })
    }

    /// The index of the interface named `name` (`RTM_GETLINK`); `ENODEV` when there is none.
    pub(crate) fn index_of(&self, name: &str) -> Result<u32, NetlinkError> {
        Ok(self.link(name)?.header.index)
    }

    /// The main table's IPv4 routes (`RTM_GETROUTE` dump).
    fn ipv4_routes(&self, name: &str) -> Result<Vec<RouteMessage>, NetlinkError> {
        let handle = self.handle.clone();
        self.run("RTM_GETROUTE", name, async move {
            let query = RouteMessageBuilder::<Ipv4Addr>::new().build();
            handle.route().get(query).execute().try_collect::<Vec<_>>().await
        })
    }

    /// The main table's IPv6 routes (`RTM_GETROUTE` dump).
    fn ipv6_routes(&self, name: &str) -> Result<Vec<RouteMessage>, NetlinkError> {
        let handle = self.handle.clone();
        self.run("RTM_GETROUTE", name, async move {
            let query = RouteMessageBuilder::<Ipv6Addr>::new().build();
            handle.route().get(query).execute().try_collect::<Vec<_>>().await
        })
    }

    /// Every address of either family of the link with index `index` (`RTM_GETADDR` dump).
    fn addresses(&self, name: &str, index: u32) -> Result<Vec<AddressMessage>, NetlinkError> {
        let handle = self.handle.clone();
        let all: Vec<AddressMessage> = self.run("RTM_GETADDR", name, async move {
            handle.address().get().set_link_index_filter(index).execute().try_collect().await
        })?;
        Ok(all.into_iter().filter(|a| a.header.index == index).collect())
    }

    /// Sets an interface's MTU (`RTM_SETLINK`).
    pub(crate) fn set_mtu(&self, name: &str, mtu: u32) -> Result<(), NetlinkError> {
        check_name(name)?;
        let handle = self.handle.clone();
        let message = LinkUnspec::new_with_name(name).mtu(mtu).build();
        self.run(
            "RTM_SETLINK (mtu)",
            name,
            async move { handle.link().set(message).execute().await },
        )
    }

    /// Brings an interface up (`RTM_SETLINK`, `IFF_UP`).
    pub(crate) fn set_up(&self, name: &str) -> Result<(), NetlinkError> {
        check_name(name)?;
        let handle = self.handle.clone();
        let message = LinkUnspec::new_with_name(name).up().build();
        self.run(
            "RTM_SETLINK (up)",
            name,
            async move { handle.link().set(message).execute().await },
        )
    }

    /// Gives the interface `addr` as its primary IPv4 address: adds it (`RTM_NEWADDR`), then
    /// removes the primary address it had before, if that was another (`RTM_DELADDR`).
    pub(crate) fn set_ipv4(&self, name: &str, addr: Ipv4Net) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        let before = self.addresses(name, index)?;
        if ipv4_addresses(&before, index).contains(&addr) {
            return Ok(());
        }
        self.add_address(name, index, IpNet::V4(addr))?;
        let old_primary = before.into_iter().find(|a| {
            a.header.family == AddressFamily::Inet
                && !a.header.flags.contains(AddressHeaderFlags::Secondary)
                && ipv4_addresses(std::slice::from_ref(a), index) != [addr]
        });
        if let Some(old) = old_primary {
            self.delete_address(name, old)?;
        }
        Ok(())
    }

    /// Gives the interface the IPv6 address `addr` (`RTM_NEWADDR`, without duplicate address
    /// detection: the address is the host's own subnet's, which no other node holds), and
    /// removes `old` (`RTM_DELADDR`) when it is another address the interface has: the address
    /// of the IPv6 half this host held before. Other IPv6 addresses (the link-local one) are
    /// left alone: IPv6 has no primary address to replace.
    pub(crate) fn set_ipv6(
        &self,
        name: &str,
        addr: Ipv6Net,
        old: Option<Ipv6Net>,
    ) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        let before = self.addresses(name, index)?;
        if !ipv6_addresses(&before, index).contains(&addr) {
            self.add_address(name, index, IpNet::V6(addr))?;
        }
        let stale = before.into_iter().find(|a| {
            let found = ipv6_addresses(std::slice::from_ref(a), index);
            old.is_some_and(|o| o != addr && found == [o])
        });
        if let Some(stale) = stale {
            self.delete_address(name, stale)?;
        }
        Ok(())
    }

    /// Removes the address `addr` from the interface (`RTM_DELADDR`); one it does not have is
    /// fine. Removing a device's last IPv4 address also removes the IPv4 routes through it.
    pub(crate) fn remove_address(&self, name: &str, addr: IpNet) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        let found = self.addresses(name, index)?.into_iter().find(|a| {
            let one = std::slice::from_ref(a);
            match addr {
                IpNet::V4(v4) => ipv4_addresses(one, index) == [v4],
                IpNet::V6(v6) => ipv6_addresses(one, index) == [v6],
            }
        });
        match found {
            Some(a) => self.delete_address(name, a),
            None => Ok(()),
        }
    }

    /// Removes the gatewayless route to `dst` through the interface (`RTM_DELROUTE`); one that
    /// is not there is fine.
    pub(crate) fn remove_route(&self, name: &str, dst: IpNet) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        let route = match dst {
            IpNet::V4(v4) => network_route(v4, index),
            IpNet::V6(v6) => {
                let mut r = network_route6(v6, index, 0);
                r.attributes.retain(|a| !matches!(a, RouteAttribute::Metrics(_)));
                r
            }
        };
        let handle = self.handle.clone();
        match self.run(
            "RTM_DELROUTE",
            name,
            async move { handle.route().del(route).execute().await },
        ) {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            other => other,
        }
    }

    /// Adds `addr` to the link `index` (`RTM_NEWADDR`, replacing one of the same address); an
    /// IPv6 address without duplicate address detection.
    fn add_address(&self, name: &str, index: u32, addr: IpNet) -> Result<(), NetlinkError> {
        let handle = self.handle.clone();
        self.run("RTM_NEWADDR", name, async move {
            let mut request = handle.address().add(index, addr.addr(), addr.prefix_len()).replace();
            if addr.addr().is_ipv6() {
                request.message_mut().header.flags |= AddressHeaderFlags::Nodad;
            }
            request.execute().await
        })
    }

    /// Removes the address `old` describes (`RTM_DELADDR`); one already gone is fine.
    fn delete_address(&self, name: &str, old: AddressMessage) -> Result<(), NetlinkError> {
        let handle = self.handle.clone();
        let deleted =
            self.run("RTM_DELADDR", name, async move { handle.address().del(old).execute().await });
        match deleted {
            // Gone already (someone else removed it meanwhile): as wanted.
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            other => other,
        }
    }

    /// Adds a route to `dst` through the interface, without a gateway, in the main table
    /// (`RTM_NEWROUTE`). An existing route is fine.
    pub(crate) fn add_route(&self, name: &str, dst: Ipv4Net) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        self.new_route(name, network_route(dst, index))
    }

    /// Adds a route to the IPv6 network `dst` through the interface, without a gateway, in the
    /// main table, with the path MTU `mtu` (`RTM_NEWROUTE`; see [`network_route6`]). An existing
    /// route is fine.
    pub(crate) fn add_route6(
        &self,
        name: &str,
        dst: Ipv6Net,
        mtu: u32,
    ) -> Result<(), NetlinkError> {
        let index = self.link(name)?.header.index;
        self.new_route(name, network_route6(dst, index, mtu))
    }

    /// Adds `route` (through `name`). A route to the same destination that exists already is
    /// read back: if it is the same route, nothing is done; if it is another (a gateway, another
    /// device: not weft's), it is replaced, with a WARN naming it. An existing route is never
    /// taken as success unread: a foreign route of the Network would swallow the overlay's
    /// traffic while weft counted it repaired.
    fn new_route(&self, name: &str, route: RouteMessage) -> Result<(), NetlinkError> {
        let handle = self.handle.clone();
        let wanted = route.clone();
        match self.run(
            "RTM_NEWROUTE",
            name,
            async move { handle.route().add(wanted).execute().await },
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            other => return other,
        }
        let Some(dst) = destination_of(&route) else { return Ok(()) };
        let existing = match dst {
            IpNet::V4(_) => self.ipv4_routes(name)?,
            IpNet::V6(_) => self.ipv6_routes(name)?,
        };
        let Some(index) = oif_of(&route) else { return Ok(()) };
        let foreign = foreign_routes_to(&existing, dst, index);
        if foreign.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            network = %dst,
            found = %foreign.join("; "),
            "a route of the Network that is not weft's was in the way: replacing it with the one through {name}"
        );
        let handle = self.handle.clone();
        self.run("RTM_NEWROUTE", name, async move {
            handle.route().add(route).replace().execute().await
        })
    }

    /// The interface's link state as the kernel reports it now, for drift repair
    /// ([`super::link`]): `IFF_UP`, the MTU, its addresses and the main table's gatewayless
    /// routes through it, of both families (IPv6 only when `ipv6`: a host without IPv6 need
    /// not answer for it).
    pub(crate) fn observe_link(
        &self,
        name: &str,
        ipv6: bool,
    ) -> Result<ObservedLink, NetlinkError> {
        let link = self.link(name)?;
        let index = link.header.index;
        let all = self.addresses(name, index)?;
        let (addresses6, routes6) = if ipv6 {
            (ipv6_addresses(&all, index), device_routes6(&self.ipv6_routes(name)?, index))
        } else {
            (Vec::new(), Vec::new())
        };
        Ok(ObservedLink {
            up: link.header.flags.contains(LinkFlags::Up),
            mtu: link_mtu(&link).unwrap_or(0),
            addresses: ipv4_addresses(&all, index),
            routes: device_routes(&self.ipv4_routes(name)?, index),
            addresses6,
            routes6,
        })
    }

    /// Whether the TUN device `name` exists and how many queues are attached to it. A
    /// non-persistent TUN device exists only while a process holds a queue; a persistent one
    /// may have none.
    pub(crate) fn tun_status(&self, name: &str) -> Result<TunStatus, NetlinkError> {
        match self.link(name) {
            Ok(link) => Ok(tun_status_of(&link)),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(TunStatus::Absent),
            Err(e) => Err(e),
        }
    }

    /// The MTU of the interface `name`.
    pub(crate) fn mtu(&self, name: &str) -> Result<Option<u32>, NetlinkError> {
        Ok(link_mtu(&self.link(name)?))
    }

    /// Every interface's IPv4 addresses, as `(interface name, address)` in the kernel's
    /// order (an interface's primary address first), from one `RTM_GETLINK` and one
    /// `RTM_GETADDR` dump: what `getifaddrs` reads, over weft's one netlink socket.
    pub(crate) fn ipv4_addresses_by_interface(
        &self,
    ) -> Result<Vec<(String, Ipv4Addr)>, NetlinkError> {
        let (links, addresses) = self.links_and_addresses()?;
        Ok(named_ipv4_addresses(&links, &addresses))
    }

    /// Every link and every address (one `RTM_GETLINK` and one `RTM_GETADDR` dump).
    fn links_and_addresses(&self) -> Result<(Vec<LinkMessage>, Vec<AddressMessage>), NetlinkError> {
        let handle = self.handle.clone();
        let links: Vec<LinkMessage> = self.run("RTM_GETLINK", "*", async move {
            handle.link().get().execute().try_collect().await
        })?;
        let handle = self.handle.clone();
        let addresses: Vec<AddressMessage> = self.run("RTM_GETADDR", "*", async move {
            handle.address().get().execute().try_collect().await
        })?;
        Ok((links, addresses))
    }

    /// The interface that has the IPv4 address `ip`: its index, its name and the prefixes of
    /// its IPv4 addresses (the kernel's order), from one `RTM_GETLINK` and one `RTM_GETADDR`
    /// dump. `None` when no interface has it.
    pub(crate) fn link_with_ipv4(
        &self,
        ip: Ipv4Addr,
    ) -> Result<Option<(u32, String, Vec<Ipv4Net>)>, NetlinkError> {
        let (links, addresses) = self.links_and_addresses()?;
        Ok(link_with_ipv4(&links, &addresses, ip))
    }

    /// The main table's unicast IPv4 routes, as route planning sees them ([`seen_routes`]).
    pub(crate) fn seen_routes(&self) -> Result<Vec<SeenRoute>, NetlinkError> {
        Ok(seen_routes(&self.ipv4_routes("peer routes")?))
    }

    /// Puts the route to a peer `route` through the interface `index` (`name`, for errors) into
    /// the main table: `RTM_NEWROUTE` with `NLM_F_CREATE | NLM_F_REPLACE` (flannel's
    /// `RouteReplace`), so a route to the same destination of metric 0 is replaced in place.
    pub(crate) fn put_peer_route(
        &self,
        name: &str,
        index: u32,
        route: PeerRoute,
    ) -> Result<(), NetlinkError> {
        let message = peer_route(route, index);
        let handle = self.handle.clone();
        self.run("RTM_NEWROUTE", name, async move {
            handle.route().add(message).replace().execute().await
        })
    }

    /// Removes one of weft's peer routes, `route` as the kernel reported it (`RTM_DELROUTE`);
    /// one already gone is fine.
    pub(crate) fn remove_peer_route(&self, route: &SeenRoute) -> Result<(), NetlinkError> {
        let mut builder = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(route.dst.network(), route.dst.prefix_len())
            .protocol(RouteProtocol::Other(ROUTE_PROTOCOL))
            .priority(route.metric);
        if let Some(gw) = route.gw {
            builder = builder.gateway(gw);
        }
        if let Some(oif) = route.oif {
            builder = builder.output_interface(oif);
        }
        let message = builder.build();
        let handle = self.handle.clone();
        let name = route.dst.to_string();
        match self.run(
            "RTM_DELROUTE",
            &name,
            async move { handle.route().del(message).execute().await },
        ) {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            other => other,
        }
    }

    /// Every interface's global IPv6 addresses ([`named_ipv6_addresses`]), as
    /// `(interface name, address)` in the kernel's order.
    pub(crate) fn ipv6_addresses_by_interface(
        &self,
    ) -> Result<Vec<(String, Ipv6Addr)>, NetlinkError> {
        let (links, addresses) = self.links_and_addresses()?;
        Ok(named_ipv6_addresses(&links, &addresses))
    }

    /// The name of the interface the main table's IPv4 default route leaves through (the one
    /// of lowest metric), if there is one.
    pub(crate) fn default_route_iface(&self) -> Result<Option<String>, NetlinkError> {
        self.iface_of(default_route_oif(&self.ipv4_routes("default")?))
    }

    /// The same for the IPv6 default route.
    pub(crate) fn default_route6_iface(&self) -> Result<Option<String>, NetlinkError> {
        self.iface_of(default_route_oif(&self.ipv6_routes("default")?))
    }

    /// The name of the interface with index `index`, if there is one.
    fn iface_of(&self, index: Option<u32>) -> Result<Option<String>, NetlinkError> {
        let Some(index) = index else {
            return Ok(None);
        };
        let handle = self.handle.clone();
        let link = self.run("RTM_GETLINK", &format!("#{index}"), async move {
            handle.link().get().match_index(index).execute().try_next().await
        })?;
        Ok(link.as_ref().and_then(link_name))
    }
}

fn link_mtu(link: &LinkMessage) -> Option<u32> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Mtu(mtu) => Some(*mtu),
        _ => None,
    })
}

fn link_name(link: &LinkMessage) -> Option<String> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(name) => Some(name.clone()),
        _ => None,
    })
}

// linux/if_link.h: the attributes of a TUN device's IFLA_INFO_DATA.
const IFLA_TUN_PERSIST: u16 = 6;
const IFLA_TUN_NUM_QUEUES: u16 = 8;
const IFLA_TUN_NUM_DISABLED_QUEUES: u16 = 9;
/// The nested and byte-order flags of an attribute type.
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The kind and payload of one of a TUN device's attributes (the crate keeps them raw).
fn tun_attribute(attr: &InfoTun) -> (u16, Vec<u8>) {
    let mut value = vec![0u8; attr.value_len()];
    attr.emit_value(&mut value);
    (attr.kind() & NLA_TYPE_MASK, value)
}

fn u32_of(value: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(value.get(..4)?.try_into().ok()?))
}

/// What a link is, as far as opening a TUN device of its name goes.
pub(crate) fn tun_status_of(link: &LinkMessage) -> TunStatus {
    let Some(info) = link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(info) => Some(info),
        _ => None,
    }) else {
        return TunStatus::NotTun;
    };
    // TAP devices are of kind "tun" too.
    if !info.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Tun))) {
        return TunStatus::NotTun;
    }
    let Some(data) = info.iter().find_map(|i| match i {
        LinkInfo::Data(InfoData::Tun(data)) => Some(data),
        _ => None,
    }) else {
        return TunStatus::Attached(None);
    };
    let (mut persist, mut queues, mut disabled) = (None, None, 0);
    for (kind, value) in data.iter().map(tun_attribute) {
        match kind {
            IFLA_TUN_PERSIST => persist = value.first().map(|b| *b != 0),
            IFLA_TUN_NUM_QUEUES => queues = u32_of(&value),
            IFLA_TUN_NUM_DISABLED_QUEUES => disabled = u32_of(&value).unwrap_or(0),
            _ => {}
        }
    }
    match (persist, queues) {
        (Some(true), Some(q)) if q.saturating_add(disabled) == 0 => TunStatus::Detached,
        (_, Some(q)) => TunStatus::Attached(Some(q.saturating_add(disabled))),
        (_, None) => TunStatus::Attached(None),
    }
}

/// The address, with its prefix length, that one address message gives its link, if it is of
/// the message's family (`IFA_LOCAL`, the interface's own address; `IFA_ADDRESS` when there is
/// no `IFA_LOCAL`).
fn address_net(a: &AddressMessage) -> Option<IpNet> {
    let of_family = |ip: &IpAddr| match a.header.family {
        AddressFamily::Inet => ip.is_ipv4(),
        AddressFamily::Inet6 => ip.is_ipv6(),
        _ => false,
    };
    let local = a.attributes.iter().find_map(|attr| match attr {
        AddressAttribute::Local(ip) if of_family(ip) => Some(*ip),
        _ => None,
    });
    let address = a.attributes.iter().find_map(|attr| match attr {
        AddressAttribute::Address(ip) if of_family(ip) => Some(*ip),
        _ => None,
    });
    IpNet::new(local.or(address)?, a.header.prefix_len).ok()
}

/// The IPv4 network, if `net` is one.
fn v4(net: IpNet) -> Option<Ipv4Net> {
    match net {
        IpNet::V4(net) => Some(net),
        IpNet::V6(_) => None,
    }
}

/// The IPv6 network, if `net` is one.
fn v6(net: IpNet) -> Option<Ipv6Net> {
    match net {
        IpNet::V6(net) => Some(net),
        IpNet::V4(_) => None,
    }
}

/// The addresses, with their prefix lengths, that `addresses` give the link `index`.
fn link_addresses(addresses: &[AddressMessage], index: u32) -> impl Iterator<Item = IpNet> + '_ {
    addresses.iter().filter(move |a| a.header.index == index).filter_map(address_net)
}

/// The IPv4 addresses, with their prefix lengths, that `addresses` give the link `index`.
pub(crate) fn ipv4_addresses(addresses: &[AddressMessage], index: u32) -> Vec<Ipv4Net> {
    link_addresses(addresses, index).filter_map(v4).collect()
}

/// The IPv6 addresses, with their prefix lengths, that `addresses` give the link `index`.
pub(crate) fn ipv6_addresses(addresses: &[AddressMessage], index: u32) -> Vec<Ipv6Net> {
    link_addresses(addresses, index).filter_map(v6).collect()
}

/// Every link's index and name.
fn link_names(links: &[LinkMessage]) -> Vec<(u32, String)> {
    links.iter().filter_map(|l| Some((l.header.index, link_name(l)?))).collect()
}

/// `(interface name, address)` for every global IPv6 address in `addresses` whose link is
/// among `links`, in the order of `addresses`: what an IPv6 underlay can be reached at. Left
/// out, as flanneld leaves them out: link-local and host-scope addresses, and addresses still
/// in duplicate address detection (`IFA_F_TENTATIVE`) or found duplicate (`IFA_F_DADFAILED`),
/// which the kernel does not let a socket bind.
pub(crate) fn named_ipv6_addresses(
    links: &[LinkMessage],
    addresses: &[AddressMessage],
) -> Vec<(String, Ipv6Addr)> {
    let names = link_names(links);
    let unusable = AddressHeaderFlags::Tentative | AddressHeaderFlags::Dadfailed;
    addresses
        .iter()
        .filter(|a| a.header.family == AddressFamily::Inet6)
        .filter(|a| a.header.scope == AddressScope::Universe)
        .filter(|a| !a.header.flags.intersects(unusable))
        .filter_map(|a| {
            let (_, name) = names.iter().find(|(i, _)| *i == a.header.index)?;
            let ip = v6(address_net(a)?)?.addr();
            // fe80::/10 carries link scope anyway; a kernel that says otherwise is not trusted.
            let link_local = ip.segments()[0] & 0xffc0 == 0xfe80;
            (!link_local && !ip.is_loopback() && !ip.is_multicast()).then(|| (name.clone(), ip))
        })
        .collect()
}

/// `(interface name, address)` for every IPv4 address in `addresses` whose link is among
/// `links`, in the order of `addresses`.
pub(crate) fn named_ipv4_addresses(
    links: &[LinkMessage],
    addresses: &[AddressMessage],
) -> Vec<(String, Ipv4Addr)> {
    let names = link_names(links);
    addresses
        .iter()
        .filter(|a| a.header.family == AddressFamily::Inet)
        .filter_map(|a| {
            let (_, name) = names.iter().find(|(i, _)| *i == a.header.index)?;
            Some((name.clone(), v4(address_net(a)?)?.addr()))
        })
        .collect()
}

/// The index, name and IPv4 prefixes of the link among `links` that has the address `ip`.
pub(crate) fn link_with_ipv4(
    links: &[LinkMessage],
    addresses: &[AddressMessage],
    ip: Ipv4Addr,
) -> Option<(u32, String, Vec<Ipv4Net>)> {
    let index = addresses
        .iter()
        .filter(|a| a.header.family == AddressFamily::Inet)
        .find(|a| address_net(a).and_then(v4).is_some_and(|n| n.addr() == ip))?
        .header
        .index;
    let link = links.iter().find(|l| l.header.index == index)?;
    Some((index, link_name(link)?, ipv4_addresses(addresses, index)))
}

/// The main table's unicast IPv4 routes in `routes`, as route planning sees them: whether each
/// is weft's ([`ROUTE_PROTOCOL`]), its gateway, device and metric.
pub(crate) fn seen_routes(routes: &[RouteMessage]) -> Vec<SeenRoute> {
    routes
        .iter()
        .filter(|r| r.header.address_family == AddressFamily::Inet && is_main_unicast(r))
        .filter_map(|r| {
            let dst = v4(destination_of(r)?)?;
            let gw = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Gateway(RouteAddress::Inet(gw)) => Some(*gw),
                _ => None,
            });
            let metric = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Priority(p) => Some(*p),
                    _ => None,
                })
                .unwrap_or(0);
            let ours = r.header.protocol == RouteProtocol::Other(ROUTE_PROTOCOL);
            Some(SeenRoute { dst, gw, oif: oif_of(r), metric, ours })
        })
        .collect()
}

/// The route [`Netlink::put_peer_route`] puts: `route.dst via route.gw dev <index>`, main
/// table, universe scope, metric 0, weft's protocol.
fn peer_route(route: PeerRoute, index: u32) -> RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(route.dst.network(), route.dst.prefix_len())
        .gateway(route.gw)
        .output_interface(index)
        .protocol(RouteProtocol::Other(ROUTE_PROTOCOL))
        .build()
}

/// The table a route is in (`RTA_TABLE` for ids above 255, else the header's).
fn table_of(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

/// A route's destination, of the route's family.
fn destination_of(route: &RouteMessage) -> Option<IpNet> {
    let family = route.header.address_family;
    let dst = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(ip)) if family == AddressFamily::Inet => {
            Some(IpAddr::V4(*ip))
        }
        RouteAttribute::Destination(RouteAddress::Inet6(ip)) if family == AddressFamily::Inet6 => {
            Some(IpAddr::V6(*ip))
        }
        _ => None,
    });
    // The default route has no destination attribute.
    let dst = match (dst, route.header.destination_prefix_length, family) {
        (Some(ip), len, _) => (ip, len),
        (None, 0, AddressFamily::Inet) => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        (None, 0, AddressFamily::Inet6) => (IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
        (None, _, _) => return None,
    };
    IpNet::new(dst.0, dst.1).ok()
}

/// Whether a route is a unicast route of the main table (either family).
fn is_main_unicast(route: &RouteMessage) -> bool {
    matches!(route.header.address_family, AddressFamily::Inet | AddressFamily::Inet6)
        && route.header.kind == RouteType::Unicast
        && table_of(route) == u32::from(RouteHeader::RT_TABLE_MAIN)
}

fn has_gateway(route: &RouteMessage) -> bool {
    route.attributes.iter().any(|a| matches!(a, RouteAttribute::Gateway(_)))
}

fn oif_of(route: &RouteMessage) -> Option<u32> {
    route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        // A multipath route: its first hop's.
        RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
        _ => None,
    })
}

/// The route [`Netlink::add_route`] adds: to `dst` through the link `index`, no gateway, link
/// scope, main table (what `SIOCADDRT` with `RTF_UP` and a device added).
fn network_route(dst: Ipv4Net, index: u32) -> RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(dst.network(), dst.prefix_len())
        .output_interface(index)
        .scope(RouteScope::Link)
        .protocol(RouteProtocol::Boot)
        .build()
}

/// The route [`Netlink::add_route6`] adds: to the IPv6 `dst` through the link `index`, no
/// gateway, main table, with the path MTU `mtu` (`RTAX_MTU`). The MTU is the underlay's minus
/// VXLAN's overhead over IPv6 (70 bytes, 20 more than over IPv4, the TUN device's MTU): the
/// kernel then tells senders the path MTU itself (ICMPv6 Packet Too Big), as it does for
/// flannel's `flannel-v6.<VNI>` device, whose own MTU is that.
fn network_route6(dst: Ipv6Net, index: u32, mtu: u32) -> RouteMessage {
    let mut route = RouteMessageBuilder::<Ipv6Addr>::new()
        .destination_prefix(dst.network(), dst.prefix_len())
        .output_interface(index)
        .protocol(RouteProtocol::Boot)
        .build();
    route.attributes.push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
    route
}

/// The destinations of the main table's gatewayless unicast routes through the link `index`,
/// both families.
fn device_nets(routes: &[RouteMessage], index: u32) -> impl Iterator<Item = IpNet> + '_ {
    routes
        .iter()
        .filter(|r| is_main_unicast(r) && !has_gateway(r))
        .filter(move |r| r.attributes.contains(&RouteAttribute::Oif(index)))
        .filter_map(destination_of)
}

/// The destinations of the main table's unicast IPv4 routes through the link `index` without a
/// gateway: the routes weft adds for the Network.
pub(crate) fn device_routes(routes: &[RouteMessage], index: u32) -> Vec<Ipv4Net> {
    device_nets(routes, index).filter_map(v4).collect()
}

/// The same for IPv6: the route weft adds for the IPv6 network.
pub(crate) fn device_routes6(routes: &[RouteMessage], index: u32) -> Vec<Ipv6Net> {
    device_nets(routes, index).filter_map(v6).collect()
}

/// The main table's unicast routes to exactly `dst` in `routes` that are not the gatewayless
/// route through the link `index` weft adds, each described as `ip route` would (`via <gw>`,
/// `dev #<index>`, `metric <m>`).
pub(crate) fn foreign_routes_to(routes: &[RouteMessage], dst: IpNet, index: u32) -> Vec<String> {
    routes
        .iter()
        .filter(|r| is_main_unicast(r) && destination_of(r) == Some(dst))
        .filter(|r| has_gateway(r) || oif_of(r) != Some(index))
        .map(|r| {
            let mut text = dst.to_string();
            for a in &r.attributes {
                match a {
                    RouteAttribute::Gateway(RouteAddress::Inet(gw)) => {
                        text += &format!(" via {gw}")
                    }
                    RouteAttribute::Gateway(RouteAddress::Inet6(gw)) => {
                        text += &format!(" via {gw}")
                    }
                    RouteAttribute::Priority(m) => text += &format!(" metric {m}"),
                    _ => {}
                }
            }
            if let Some(oif) = oif_of(r) {
                text += &format!(" dev #{oif}");
            }
            text
        })
        .collect()
}

/// The interface index of the main table's default route of lowest metric in `routes` (a dump
/// of one family).
pub(crate) fn default_route_oif(routes: &[RouteMessage]) -> Option<u32> {
    routes
        .iter()
        .filter(|r| is_main_unicast(r) && r.header.destination_prefix_length == 0)
        .filter_map(|r| {
            let metric = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Priority(p) => Some(*p),
                _ => None,
            });
            Some((metric.unwrap_or(0), oif_of(r)?))
        })
        .min_by_key(|(metric, _)| *metric)
        .map(|(_, oif)| oif)
}

#[cfg(test)]
mod tests {
    use rtnetlink::packet_core::DefaultNla;
    use rtnetlink::packet_route::route::RouteNextHop;

    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn tun_link(kind: InfoKind, data: Option<Vec<(u16, Vec<u8>)>>) -> LinkMessage {
        let mut info = vec![LinkInfo::Kind(kind)];
        if let Some(d) = data {
            let attrs = d.into_iter().map(|(k, v)| InfoTun::Other(DefaultNla::new(k, v)));
            info.push(LinkInfo::Data(InfoData::Tun(attrs.collect())));
        }
        let mut link = LinkMessage::default();
        link.attributes.push(LinkAttribute::IfName("weft0".into()));
        link.attributes.push(LinkAttribute::LinkInfo(info));
        link
    }

    fn tun_data(persist: u8, queues: u32, disabled: u32) -> Option<Vec<(u16, Vec<u8>)>> {
        Some(vec![
            (IFLA_TUN_PERSIST, vec![persist]),
            (IFLA_TUN_NUM_QUEUES, queues.to_ne_bytes().to_vec()),
            (IFLA_TUN_NUM_DISABLED_QUEUES, disabled.to_ne_bytes().to_vec()),
        ])
    }

    #[test]
    fn links_are_absent_detached_attached_or_not_tun() {
        let cases = [
            (tun_link(InfoKind::Tun, tun_data(0, 2, 0)), TunStatus::Attached(Some(2))),
            (tun_link(InfoKind::Tun, tun_data(1, 0, 0)), TunStatus::Detached),
            (tun_link(InfoKind::Tun, tun_data(1, 0, 1)), TunStatus::Attached(Some(1))),
            (tun_link(InfoKind::Tun, tun_data(1, 3, 0)), TunStatus::Attached(Some(3))),
            (tun_link(InfoKind::Tun, None), TunStatus::Attached(None)),
            (tun_link(InfoKind::Veth, None), TunStatus::NotTun),
            // No LINKINFO at all (a loopback, say).
            (LinkMessage::default(), TunStatus::NotTun),
        ];
        for (link, want) in cases {
            assert_eq!(tun_status_of(&link), want, "{link:?}");
        }
        // Short or odd payloads never panic.
        let odd = tun_link(InfoKind::Tun, Some(vec![(IFLA_TUN_NUM_QUEUES, vec![1]), (99, vec![])]));
        assert_eq!(tun_status_of(&odd), TunStatus::Attached(None));
    }

    /// `RTM_NEWLINK` as the kernel sends it for a TUN device, byte by byte (linux/if_link.h,
    /// linux/rtnetlink.h): the crate's parser must hand [`tun_status_of`] what it expects.
    fn kernel_newlink(kind: &[u8], data: &[(u16, Vec<u8>)]) -> Vec<u8> {
        fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
            let mut a = Vec::new();
            a.extend(u16::try_from(4 + payload.len()).unwrap().to_ne_bytes());
            a.extend(kind.to_ne_bytes());
            a.extend(payload);
            a.resize(a.len().div_ceil(4) * 4, 0);
            a
        }
        const NLA_F_NESTED: u16 = 0x8000;
        const IFLA_IFNAME: u16 = 3;
        const IFLA_LINKINFO: u16 = 18;
        const IFLA_INFO_KIND: u16 = 1;
        const IFLA_INFO_DATA: u16 = 2;
        let mut tun_data = Vec::new();
        for (k, v) in data {
            tun_data.extend(attr(*k, v));
        }
        let mut info = attr(IFLA_INFO_KIND, kind);
        if !data.is_empty() {
            info.extend(attr(IFLA_INFO_DATA | NLA_F_NESTED, &tun_data));
        }
        let mut body = vec![0u8; 16]; // ifinfomsg: AF_UNSPEC, index 0
        body.extend(attr(IFLA_IFNAME, b"weft0\0"));
        body.extend(attr(IFLA_LINKINFO | NLA_F_NESTED, &info));
        let mut m = Vec::new();
        m.extend(u32::try_from(16 + body.len()).unwrap().to_ne_bytes());
        m.extend(16u16.to_ne_bytes()); // RTM_NEWLINK
        m.extend([0u8; 10]); // flags, sequence, port id
        m.extend(body);
        m
    }

    fn parse_link(bytes: &[u8]) -> LinkMessage {
        use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
        use rtnetlink::packet_route::RouteNetlinkMessage;
        let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes).unwrap();
        match msg.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => link,
            other => panic!("not a link: {other:?}"),
        }
    }

    #[test]
    fn the_kernels_tun_attributes_are_read_through_the_crates_parser() {
        let data = tun_data(1, 0, 0).unwrap();
        assert_eq!(
            tun_status_of(&parse_link(&kernel_newlink(b"tun\0", &data))),
            TunStatus::Detached
        );
        let data = tun_data(0, 4, 0).unwrap();
        assert_eq!(
            tun_status_of(&parse_link(&kernel_newlink(b"tun\0", &data))),
            TunStatus::Attached(Some(4))
        );
        assert_eq!(tun_status_of(&parse_link(&kernel_newlink(b"veth\0", &[]))), TunStatus::NotTun);
    }

    fn route(dst: Option<(Ipv4Addr, u8)>, attrs: Vec<RouteAttribute>) -> RouteMessage {
        let mut r = RouteMessageBuilder::<Ipv4Addr>::new().build();
        if let Some((ip, len)) = dst {
            r.header.destination_prefix_length = len;
            r.attributes.push(RouteAttribute::Destination(RouteAddress::Inet(ip)));
        }
        r.attributes.extend(attrs);
        r
    }

    const WEFT0: u32 = 7;
    const ETH0: u32 = 2;

    #[test]
    fn routes_through_the_device_are_the_gatewayless_main_table_ones() {
        let gw = RouteAttribute::Gateway(RouteAddress::Inet(Ipv4Addr::new(192, 0, 2, 254)));
        let mut other_table = route(
            Some((Ipv4Addr::new(10, 96, 0, 0), 16)),
            vec![RouteAttribute::Oif(WEFT0), RouteAttribute::Table(1000)],
        );
        other_table.header.table = 252;
        let mut local =
            route(Some((Ipv4Addr::new(10, 244, 3, 0), 32)), vec![RouteAttribute::Oif(WEFT0)]);
        local.header.kind = RouteType::Local;
        local.header.table = 255;
        let routes = [
            route(None, vec![RouteAttribute::Oif(ETH0), gw.clone()]),
            route(Some((Ipv4Addr::new(192, 0, 2, 0), 24)), vec![RouteAttribute::Oif(ETH0)]),
            route(Some((Ipv4Addr::new(10, 244, 0, 0), 16)), vec![RouteAttribute::Oif(WEFT0)]),
            // Through a gateway on weft0: not the device route weft adds.
            route(Some((Ipv4Addr::new(10, 99, 0, 0), 16)), vec![RouteAttribute::Oif(WEFT0), gw]),
            other_table,
            local,
            route(Some((Ipv4Addr::new(10, 97, 0, 0), 16)), vec![RouteAttribute::Oif(WEFT0 + 1)]),
            route(Some((Ipv4Addr::new(10, 244, 3, 7), 32)), vec![RouteAttribute::Oif(WEFT0)]),
        ];
        assert_eq!(device_routes(&routes, WEFT0), vec![net("10.244.0.0/16"), net("10.244.3.7/32")]);
        assert_eq!(device_routes(&routes, ETH0), vec![net("192.0.2.0/24")]);
        assert_eq!(device_routes(&routes, 99), vec![]);
        assert_eq!(device_routes(&[], WEFT0), vec![]);
        // A destination the kernel would never send (a prefix without an address, a prefix
        // longer than 32) is skipped, not a panic.
        let mut bad = route(None, vec![RouteAttribute::Oif(WEFT0)]);
        bad.header.destination_prefix_length = 16;
        let mut long =
            route(Some((Ipv4Addr::new(10, 1, 0, 0), 40)), vec![RouteAttribute::Oif(WEFT0)]);
        long.header.destination_prefix_length = 40;
        assert_eq!(device_routes(&[bad, long], WEFT0), vec![]);
    }

    #[test]
    fn a_route_to_the_network_that_is_not_wefts_is_found_foreign() {
        let network = IpNet::V4(net("10.244.0.0/16"));
        let gw = RouteAttribute::Gateway(RouteAddress::Inet(Ipv4Addr::new(192, 0, 2, 254)));
        let ours = network_route(net("10.244.0.0/16"), WEFT0);
        let via =
            route(Some((Ipv4Addr::new(10, 244, 0, 0), 16)), vec![RouteAttribute::Oif(ETH0), gw]);
        let other_dev =
            route(Some((Ipv4Addr::new(10, 244, 0, 0), 16)), vec![RouteAttribute::Oif(ETH0)]);
        let elsewhere =
            route(Some((Ipv4Addr::new(10, 245, 0, 0), 16)), vec![RouteAttribute::Oif(ETH0)]);
        assert!(foreign_routes_to(&[ours.clone(), elsewhere], network, WEFT0).is_empty());
        assert_eq!(
            foreign_routes_to(&[ours.clone(), via], network, WEFT0),
            vec![format!("10.244.0.0/16 via 192.0.2.254 dev #{ETH0}")]
        );
        assert_eq!(
            foreign_routes_to(&[other_dev, ours], network, WEFT0),
            vec![format!("10.244.0.0/16 dev #{ETH0}")]
        );
    }

    #[test]
    fn the_route_weft_adds_is_one_it_then_finds() {
        // What add_route sends is what the observation must find, or it would "repair" forever.
        let added = network_route(net("10.244.0.0/16"), WEFT0);
        assert_eq!(device_routes(&[added], WEFT0), vec![net("10.244.0.0/16")]);
    }

    /// A peer route weft puts is one it then sees as its own, exactly as put (that the planner
    /// then wants nothing done is `kernel_routes::route_plan`'s test, not this driver's: a
    /// syscall module imports no planner); routes of other protocols, tables and kinds are
    /// told apart.
    #[test]
    fn the_peer_route_weft_puts_is_seen_as_its_own() {
        let want = PeerRoute { dst: net("10.244.2.0/24"), gw: Ipv4Addr::new(192, 0, 2, 2) };
        let mut foreign = peer_route(want, 3);
        foreign.header.protocol = RouteProtocol::Boot;
        foreign.attributes.push(RouteAttribute::Priority(7));
        let mut other_table = peer_route(want, 3);
        other_table.header.table = 100;
        let seen = seen_routes(&[peer_route(want, 3), foreign, other_table]);
        assert_eq!(
            seen,
            [
                SeenRoute { dst: want.dst, gw: Some(want.gw), oif: Some(3), metric: 0, ours: true },
                SeenRoute {
                    dst: want.dst,
                    gw: Some(want.gw),
                    oif: Some(3),
                    metric: 7,
                    ours: false
                },
            ]
        );
    }

    #[test]
    fn the_default_route_of_lowest_metric_names_the_underlay() {
        let gw = || RouteAttribute::Gateway(RouteAddress::Inet(Ipv4Addr::new(192, 0, 2, 254)));
        let routes = [
            route(Some((Ipv4Addr::new(192, 0, 2, 0), 24)), vec![RouteAttribute::Oif(4)]),
            route(None, vec![RouteAttribute::Oif(3), gw(), RouteAttribute::Priority(600)]),
            route(None, vec![RouteAttribute::Oif(ETH0), gw(), RouteAttribute::Priority(100)]),
        ];
        assert_eq!(default_route_oif(&routes), Some(ETH0));
        assert_eq!(default_route_oif(&routes[..1]), None);
        let mut hop = RouteNextHop::default();
        hop.interface_index = 5;
        let multipath = route(None, vec![RouteAttribute::MultiPath(vec![hop])]);
        assert_eq!(default_route_oif(&[multipath]), Some(5));
        // A default route in another table is not the host's.
        let mut vrf = route(None, vec![RouteAttribute::Oif(9), RouteAttribute::Table(10)]);
        vrf.header.table = 10;
        assert_eq!(default_route_oif(&[vrf]), None);
    }

    #[test]
    fn addresses_are_read_with_their_prefixes() {
        let address = |index: u32, ip: [u8; 4], len: u8, local: bool| {
            let mut a = AddressMessage::default();
            a.header.family = AddressFamily::Inet;
            a.header.index = index;
            a.header.prefix_len = len;
            let ip = IpAddr::V4(Ipv4Addr::from(ip));
            a.attributes.push(if local {
                AddressAttribute::Local(ip)
            } else {
                AddressAttribute::Address(ip)
            });
            a
        };
        let all = [
            address(WEFT0, [10, 244, 3, 0], 32, true),
            address(WEFT0, [10, 8, 0, 1], 24, false),
            address(ETH0, [192, 0, 2, 1], 24, true),
            address(WEFT0, [10, 9, 9, 9], 33, true),
        ];
        assert_eq!(ipv4_addresses(&all, WEFT0), vec![net("10.244.3.0/32"), net("10.8.0.1/24")]);
        assert_eq!(ipv4_addresses(&all, ETH0), vec![net("192.0.2.1/24")]);
    }

    #[test]
    fn addresses_are_named_by_their_links_in_the_kernels_order() {
        let link = |index: u32, name: &str| {
            let mut l = LinkMessage::default();
            l.header.index = index;
            l.attributes.push(LinkAttribute::IfName(name.into()));
            l
        };
        let address = |index: u32, ip: [u8; 4], family: AddressFamily| {
            let mut a = AddressMessage::default();
            a.header.family = family;
            a.header.index = index;
            a.header.prefix_len = 24;
            a.attributes.push(AddressAttribute::Local(IpAddr::V4(Ipv4Addr::from(ip))));
            a
        };
        let links = [link(1, "lo"), link(ETH0, "eth0")];
        let addresses = [
            address(1, [127, 0, 0, 1], AddressFamily::Inet),
            address(ETH0, [192, 0, 2, 11], AddressFamily::Inet),
            address(ETH0, [192, 0, 2, 1], AddressFamily::Inet),
            address(ETH0, [192, 0, 2, 9], AddressFamily::Inet6),
            address(77, [192, 0, 2, 7], AddressFamily::Inet),
        ];
        let ip = |d: [u8; 4]| Ipv4Addr::from(d);
        assert_eq!(
            named_ipv4_addresses(&links, &addresses),
            vec![
                ("lo".to_string(), ip([127, 0, 0, 1])),
                ("eth0".to_string(), ip([192, 0, 2, 11])),
                ("eth0".to_string(), ip([192, 0, 2, 1])),
            ],
            "an IPv6 message and an address of an unknown link are left out"
        );
    }

    fn route6(dst: Option<(&str, u8)>, attrs: Vec<RouteAttribute>) -> RouteMessage {
        let mut r = RouteMessageBuilder::<Ipv6Addr>::new().build();
        if let Some((ip, len)) = dst {
            r.header.destination_prefix_length = len;
            let ip: Ipv6Addr = ip.parse().unwrap();
            r.attributes.push(RouteAttribute::Destination(RouteAddress::Inet6(ip)));
        }
        r.attributes.extend(attrs);
        r
    }

    fn net6(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    #[test]
    fn ipv6_routes_through_the_device_and_the_ipv6_default_route_are_found() {
        let gw = RouteAttribute::Gateway(RouteAddress::Inet6("fe80::1".parse().unwrap()));
        let routes = [
            route6(None, vec![RouteAttribute::Oif(ETH0), gw.clone(), RouteAttribute::Priority(9)]),
            route6(Some(("2001:db8::", 64)), vec![RouteAttribute::Oif(ETH0)]),
            route6(Some(("fd00:10:244::", 56)), vec![RouteAttribute::Oif(WEFT0)]),
            route6(Some(("fd00:99::", 32)), vec![RouteAttribute::Oif(WEFT0), gw]),
            // An IPv4 destination in an IPv6 message is not read as either.
            route6(Some(("fe80::", 64)), vec![RouteAttribute::Oif(WEFT0)]),
        ];
        let mut odd = route6(None, vec![RouteAttribute::Oif(WEFT0)]);
        odd.attributes
            .push(RouteAttribute::Destination(RouteAddress::Inet(Ipv4Addr::new(10, 0, 0, 0))));
        odd.header.destination_prefix_length = 8;
        assert_eq!(
            device_routes6(&routes, WEFT0),
            vec![net6("fd00:10:244::/56"), net6("fe80::/64")]
        );
        assert_eq!(device_routes(&routes, WEFT0), vec![], "no IPv4 route among them");
        assert_eq!(device_routes6(&[odd], WEFT0), vec![]);
        assert_eq!(default_route_oif(&routes), Some(ETH0));
        // What add_route6 sends is what the observation finds (else drift repair loops).
        let added = network_route6(net6("fd00:10:244::/56"), WEFT0, 1430);
        assert_eq!(
            device_routes6(std::slice::from_ref(&added), WEFT0),
            vec![net6("fd00:10:244::/56")]
        );
        assert!(added.attributes.contains(&RouteAttribute::Metrics(vec![RouteMetric::Mtu(1430)])));
    }

    #[test]
    fn the_ipv6_underlay_addresses_are_the_global_usable_ones() {
        let link = |index: u32, name: &str| {
            let mut l = LinkMessage::default();
            l.header.index = index;
            l.attributes.push(LinkAttribute::IfName(name.into()));
            l
        };
        let address = |index: u32, ip: &str, scope: AddressScope, flags: AddressHeaderFlags| {
            let mut a = AddressMessage::default();
            a.header.family = AddressFamily::Inet6;
            a.header.index = index;
            a.header.prefix_len = 64;
            a.header.scope = scope;
            a.header.flags = flags;
            a.attributes.push(AddressAttribute::Address(IpAddr::V6(ip.parse().unwrap())));
            a
        };
        let none = AddressHeaderFlags::empty();
        let links = [link(1, "lo"), link(ETH0, "eth0")];
        let addresses = [
            address(1, "::1", AddressScope::Host, none),
            address(ETH0, "fe80::2", AddressScope::Link, none),
            // A kernel that calls a link-local address global is not believed.
            address(ETH0, "fe80::3", AddressScope::Universe, none),
            address(ETH0, "2001:db8::7", AddressScope::Universe, AddressHeaderFlags::Tentative),
            address(ETH0, "2001:db8::8", AddressScope::Universe, AddressHeaderFlags::Dadfailed),
            address(ETH0, "2001:db8::2", AddressScope::Universe, AddressHeaderFlags::Permanent),
            address(ETH0, "2001:db8::9", AddressScope::Universe, none),
            address(77, "2001:db8::77", AddressScope::Universe, none),
        ];
        let ip = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        assert_eq!(
            named_ipv6_addresses(&links, &addresses),
            vec![("eth0".to_string(), ip("2001:db8::2")), ("eth0".to_string(), ip("2001:db8::9"))]
        );
        assert_eq!(ipv6_addresses(&addresses, 1), vec![net6("::1/64")]);
        // An IPv4 message is never read as an IPv6 address, nor the other way round.
        let mut v4 = address(ETH0, "2001:db8::5", AddressScope::Universe, none);
        v4.header.family = AddressFamily::Inet;
        assert_eq!(named_ipv6_addresses(&links, &[v4.clone()]), vec![]);
        assert_eq!(ipv4_addresses(&[v4], ETH0), vec![]);
    }

    #[test]
    fn every_interfaces_addresses_are_listed_as_getifaddrs_lists_them() {
        let nl = Netlink::open().unwrap();
        let ours = nl.ipv4_addresses_by_interface().unwrap();
        let libc: Vec<(String, Ipv4Addr)> = nix::ifaddrs::getifaddrs()
            .unwrap()
            .filter_map(|i| Some((i.interface_name, i.address?.as_sockaddr_in()?.ip())))
            .collect();
        assert!(ours.iter().any(|(n, a)| n == "lo" && a.is_loopback()), "{ours:?}");
        assert_eq!(ours, libc);
    }

    #[test]
    fn interface_names_are_checked_before_any_request() {
        assert!(matches!(check_name(""), Err(NetlinkError::BadName(_))));
        assert!(matches!(check_name("a-name-far-too-long"), Err(NetlinkError::BadName(_))));
        assert!(matches!(check_name("we\0ft"), Err(NetlinkError::BadName(_))));
        assert!(check_name("weft0").is_ok());
    }

    /// An interface's MTU as sysfs says it: a second reading, independent of netlink.
    fn mtu_of(name: &str) -> Option<u32> {
        std::fs::read_to_string(format!("/sys/class/net/{name}/mtu")).ok()?.trim().parse().ok()
    }

    #[test]
    fn the_link_state_is_read_back_without_privilege() {
        let nl = Netlink::open().unwrap();
        let lo = nl.observe_link("lo", true).unwrap();
        assert_eq!(lo.mtu, mtu_of("lo").unwrap());
        assert_eq!(nl.mtu("lo").unwrap(), Some(lo.mtu));
        if lo.up {
            let loopback: Ipv4Net = "127.0.0.1/8".parse().unwrap();
            assert!(lo.addresses.contains(&loopback), "{lo:?}");
            // ::1 unless this namespace has IPv6 off.
            let v6_off = std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
                .map_or(true, |v| v.trim() == "1");
            let loopback6: Ipv6Net = "::1/128".parse().unwrap();
            assert!(v6_off || lo.addresses6.contains(&loopback6), "{lo:?}");
            assert!(lo.addresses6.iter().all(|a| a.addr().is_loopback()), "{lo:?}");
        }
        let v4_only = nl.observe_link("lo", false).unwrap();
        assert!(v4_only.addresses6.is_empty() && v4_only.routes6.is_empty(), "{v4_only:?}");
        let missing = nl.observe_link("weftnosuch0", false).unwrap_err();
        let NetlinkError::Request { op, ref name, .. } = missing else { panic!("{missing}") };
        assert_eq!((op, name.as_str()), ("RTM_GETLINK", "weftnosuch0"));
        assert_eq!(missing.raw_os_error(), Some(libc::ENODEV));
        assert!(matches!(nl.observe_link("", true), Err(NetlinkError::BadName(_))));
    }

    #[test]
    fn a_name_nobody_uses_is_absent() {
        let nl = Netlink::open().unwrap();
        assert_eq!(nl.tun_status("weftnosuch0").unwrap(), TunStatus::Absent);
        assert!(matches!(nl.tun_status("lo"), Ok(TunStatus::NotTun)));
    }
}
