//! The host's network as the daemon reads it: which interfaces have which addresses, where the
//! default routes go, an interface's MTU, whether a device name is another process's TUN
//! device, and notice when any of it changes. The underlay is found and followed with these
//! ([`crate::daemon`]); the data plane's own device is configured behind [`crate::dataplane::Dataplane`].
//!
//! Contract: a thin driver over [`super::netlink`] and [`super::link_watch`], which stay private
//! to the data plane. Every call blocks on one netlink request (answered within
//! [`super::netlink::REPLY_TIMEOUT`]): call it from a blocking thread. A [`KernelWatch`] says
//! *that* something changed, never what: the caller reads again.

use std::net::{Ipv4Addr, Ipv6Addr};

use tokio::sync::watch;

use super::link_watch::{ChangeWatch, Interest};
use super::netlink::{Netlink, NetlinkError, TunStatus};
use super::tun::TunError;

/// One netlink connection to the host's links, addresses and routes.
#[derive(Debug)]
pub(crate) struct Host {
    netlink: Netlink,
}

impl Host {
    /// Opens the connection, in the calling thread's network namespace.
    pub(crate) fn open() -> Result<Self, NetlinkError> {
        Ok(Self { netlink: Netlink::open()? })
    }

    /// Every interface's IPv4 addresses, in the kernel's order, as (interface, address).
    pub(crate) fn ipv4_addresses_by_interface(
        &self,
    ) -> Result<Vec<(String, Ipv4Addr)>, NetlinkError> {
        self.netlink.ipv4_addresses_by_interface()
    }

    /// Every interface's global IPv6 addresses, in the kernel's order.
    pub(crate) fn ipv6_addresses_by_interface(
        &self,
    ) -> Result<Vec<(String, Ipv6Addr)>, NetlinkError> {
        self.netlink.ipv6_addresses_by_interface()
    }

    /// The interface of the main table's IPv4 default route of lowest metric, if any.
    pub(crate) fn default_route_iface(&self) -> Result<Option<String>, NetlinkError> {
        self.netlink.default_route_iface()
    }

    /// The interface of the main table's IPv6 default route of lowest metric, if any.
    pub(crate) fn default_route6_iface(&self) -> Result<Option<String>, NetlinkError> {
        self.netlink.default_route6_iface()
    }

    /// An interface's MTU (`None`: no such interface).
    pub(crate) fn mtu(&self, name: &str) -> Result<Option<u32>, NetlinkError> {
        self.netlink.mtu(name)
    }

    /// Why the data plane cannot have the device `name` now, when another process has it
    /// attached (a second weft): the message to wait with. `None` when it is free (absent, or
    /// a persistent device nobody holds) or is no TUN device at all (the start says so).
    pub(crate) fn device_in_use(&self, name: &str) -> Result<Option<String>, NetlinkError> {
        Ok(match self.netlink.tun_status(name)? {
            TunStatus::Attached(queues) => Some(format!(
                "{}; waiting for it to be released",
                TunError::InUse { name: name.to_owned(), queues }
            )),
            TunStatus::Absent | TunStatus::Detached | TunStatus::NotTun => None,
        })
    }
}

/// A watch of the kernel's notifications (see [`super::link_watch`]): its receiver's value goes
/// up when the kernel says something it watches changed. Dropping it ends the watch.
#[derive(Debug)]
pub(crate) struct KernelWatch {
    _watch: ChangeWatch,
}

impl KernelWatch {
    /// Watches every link, IPv4 address and IPv4 route of the host (the underlay, whose address
    /// may move to any interface). One netlink request: call it from a blocking thread.
    pub(crate) fn host() -> Result<(Self, watch::Receiver<u64>), NetlinkError> {
        Self::start(Interest::Any)
    }

    /// Watches one link or two: each itself, its addresses and the routes through it.
    pub(in crate::dataplane) fn links(
        indexes: &[u32],
    ) -> Result<(Self, watch::Receiver<u64>), NetlinkError> {
        let (Some(&first), last) = (indexes.first(), indexes.last()) else {
            return Self::host();
        };
        Self::start(Interest::Links([first, last.copied().unwrap_or(first)]))
    }

    fn start(interest: Interest) -> Result<(Self, watch::Receiver<u64>), NetlinkError> {
        let (watch, rx) = ChangeWatch::start(interest)?;
        Ok((Self { _watch: watch }, rx))
    }
}
