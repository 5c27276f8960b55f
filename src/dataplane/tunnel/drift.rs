//! The TUN device's link state as weft set it, and the repairs that put it back when someone
//! else changes it ("drift": a deleted route, the link set down, the address flushed, the MTU
//! changed). Pure: the driver ([`super::Tunnel::repair_link`]) observes the device
//! over netlink ([`crate::dataplane::sys::netlink`]), asks [`plan`] what to do, applies it and logs as
//! [`DriftLog`] says.
//!
//! Contract:
//! - weft owns its TUN device. It wants it up, with the MTU it set at start (underlay MTU minus
//!   the encapsulation overhead), and, while this host holds a subnet, with `<subnet>.0/32`
//!   among its addresses and a route for the whole Network through it (no gateway). On a
//!   dual-stack network it wants the same for the IPv6 half: `<v6 subnet>::/128` and a route
//!   for `IPv6Network`. Other addresses and routes are left alone. With no subnet held neither
//!   address nor route is wanted (they appear when the first subnet does, as before drift
//!   repair).
//! - [`plan`] is deterministic and returns the repairs in the order they must be applied: the
//!   MTU, the link up, the address, the route, then the IPv6 address and route (the kernel
//!   refuses a route through a device that is down, and removes the device's routes when it
//!   goes down or loses its last address, so a down link or a flushed address comes back as two
//!   repairs).
//! - [`DriftLog`] makes every repair one log line per drift event: a repair that succeeds is
//!   reported each time (each success ends an event); a repair that fails is reported the
//!   first time only and then retried quietly until it succeeds or is no longer needed.

#![forbid(unsafe_code)]

use ipnet::{Ipv4Net, Ipv6Net};

use crate::dataplane::sys::netlink::ObservedLink;
use crate::dataplane::worker::counters::RepairKind;

/// The link state weft wants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedLink {
    /// The MTU set at start.
    pub(crate) mtu: u32,
    /// `<subnet>.0/32`, while a subnet is held.
    pub(crate) address: Option<Ipv4Net>,
    /// The Network, routed through the device while a subnet is held.
    pub(crate) route: Option<Ipv4Net>,
    /// `<v6 subnet>::/128`, while a dual-stack lease is held.
    pub(crate) address6: Option<Ipv6Net>,
    /// The IPv6 network, routed through the device while a dual-stack lease is held, and the
    /// route's path MTU.
    pub(crate) route6: Option<(Ipv6Net, u32)>,
}

/// One change that puts the link back as weft wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repair {
    /// Set the MTU back.
    SetMtu {
        /// The MTU found.
        found: u32,
        /// The MTU weft set.
        want: u32,
    },
    /// Set the link up.
    SetUp,
    /// Give the device its address (replacing the primary address, as the subnet change does).
    SetAddress {
        /// `<subnet>.0/32`.
        want: Ipv4Net,
        /// The addresses found instead.
        found: Vec<Ipv4Net>,
    },
    /// Add the route for the Network through the device.
    AddRoute {
        /// The Network.
        network: Ipv4Net,
    },
    /// Give the device its IPv6 address back.
    AddAddress6 {
        /// `<v6 subnet>::/128`.
        want: Ipv6Net,
    },
    /// Add the route for the IPv6 network through the device.
    AddRoute6 {
        /// The IPv6 network.
        network: Ipv6Net,
        /// Its path MTU.
        mtu: u32,
    },
}

impl Repair {
    /// What it repairs.
    pub(crate) fn kind(&self) -> RepairKind {
        match self {
            Self::SetMtu { .. } => RepairKind::Mtu,
            Self::SetUp => RepairKind::Up,
            Self::SetAddress { .. } => RepairKind::Address,
            Self::AddRoute { .. } => RepairKind::Route,
            Self::AddAddress6 { .. } => RepairKind::Address6,
            Self::AddRoute6 { .. } => RepairKind::Route6,
        }
    }

    /// The log line of a repair done on device `dev`: what had drifted and what was done,
    /// e.g. `weft0 was down: set it up`.
    pub(crate) fn repaired_line(&self, dev: &str) -> String {
        let done = match self {
            Self::SetMtu { want, .. } => format!("set it back to {want}"),
            Self::SetUp => "set it up".to_owned(),
            Self::SetAddress { want, .. } => format!("set {want}"),
            Self::AddAddress6 { want } => format!("set {want}"),
            Self::AddRoute { .. } | Self::AddRoute6 { .. } => "added it back".to_owned(),
        };
        format!("{}: {done}", self.drift(dev))
    }

    /// The log line of a repair that failed, e.g. `weft0 was down: could not set it up`.
    pub(crate) fn failed_line(&self, dev: &str) -> String {
        let to_do = match self {
            Self::SetMtu { want, .. } => format!("set it back to {want}"),
            Self::SetUp => "set it up".to_owned(),
            Self::SetAddress { want, .. } => format!("set {want}"),
            Self::AddAddress6 { want } => format!("set {want}"),
            Self::AddRoute { .. } | Self::AddRoute6 { .. } => "add it back".to_owned(),
        };
        format!("{}: could not {to_do}", self.drift(dev))
    }

    /// What had drifted on device `dev`, e.g. `weft0 was down`.
    fn drift(&self, dev: &str) -> String {
        match self {
            Self::SetMtu { found, want } => format!("{dev}'s MTU was {found}, not {want}"),
            Self::SetUp => format!("{dev} was down"),
            Self::SetAddress { want, found } if found.is_empty() => {
                format!("{dev} had lost its address {want} (it had no IPv4 address)")
            }
            Self::SetAddress { want, found } => {
                let found: Vec<String> = found.iter().map(Ipv4Net::to_string).collect();
                format!("{dev} had lost its address {want} (it had {})", found.join(", "))
            }
            Self::AddRoute { network } => format!("the route for {network} via {dev} was gone"),
            Self::AddAddress6 { want } => format!("{dev} had lost its IPv6 address {want}"),
            Self::AddRoute6 { network, .. } => {
                format!("the route for {network} via {dev} was gone")
            }
        }
    }
}

/// The repairs that take `seen` to `wanted`, in the order to apply them (see the module docs);
/// empty when nothing drifted.
pub fn plan(wanted: &WantedLink, seen: &ObservedLink) -> Vec<Repair> {
    let mut repairs = Vec::new();
    if seen.mtu != wanted.mtu {
        repairs.push(Repair::SetMtu { found: seen.mtu, want: wanted.mtu });
    }
    if !seen.up {
        repairs.push(Repair::SetUp);
    }
    if let Some(want) = wanted.address
        && !seen.addresses.contains(&want)
    {
        repairs.push(Repair::SetAddress { want, found: seen.addresses.clone() });
    }
    if let Some(network) = wanted.route
        && !seen.routes.iter().any(|r| r.trunc() == network.trunc())
    {
        repairs.push(Repair::AddRoute { network: network.trunc() });
    }
    if let Some(want) = wanted.address6
        && !seen.addresses6.contains(&want)
    {
        repairs.push(Repair::AddAddress6 { want });
    }
    if let Some((network, mtu)) = wanted.route6
        && !seen.routes6.iter().any(|r| r.trunc() == network.trunc())
    {
        repairs.push(Repair::AddRoute6 { network: network.trunc(), mtu });
    }
    repairs
}

/// Which drift the driver has already reported as failing to repair, so that each drift event
/// is logged once however long it takes to put right (see the module docs).
#[derive(Clone, Debug, Default)]
pub(crate) struct DriftLog {
    failing: [bool; RepairKind::ALL.len()],
    observe_failing: bool,
}

impl DriftLog {
    /// A repair of `kind` failed: whether to log it (its first failure in this drift event).
    pub(crate) fn failed(&mut self, kind: RepairKind) -> bool {
        !std::mem::replace(&mut self.failing[kind as usize], true)
    }

    /// A repair of `kind` succeeded (always logged): the drift event is over. Returns whether
    /// it had failed before.
    pub(crate) fn repaired(&mut self, kind: RepairKind) -> bool {
        std::mem::replace(&mut self.failing[kind as usize], false)
    }

    /// This round's `plan`: any kind that was failing and needs no repair now was put right by
    /// someone else; those kinds are returned (to be logged) and forgotten.
    pub(crate) fn settle(&mut self, planned: &[Repair]) -> Vec<RepairKind> {
        let settled: Vec<RepairKind> = RepairKind::ALL
            .into_iter()
            .filter(|k| self.failing[*k as usize] && !planned.iter().any(|r| r.kind() == *k))
            .collect();
        for k in &settled {
            self.failing[*k as usize] = false;
        }
        settled
    }

    /// Whether a repair or the read of the link is failing: the driver retries every second
    /// then, without waiting for the kernel to report a change.
    pub(crate) fn failing(&self) -> bool {
        self.observe_failing || self.failing.iter().any(|f| *f)
    }

    /// Observing the link failed: whether to log it (the first failure in a row).
    pub(crate) fn observe_failed(&mut self) -> bool {
        !std::mem::replace(&mut self.observe_failing, true)
    }

    /// Observing the link worked: whether it had failed before (to log the recovery).
    pub(crate) fn observed(&mut self) -> bool {
        std::mem::replace(&mut self.observe_failing, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn net6(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    fn wanted() -> WantedLink {
        WantedLink {
            mtu: 1450,
            address: Some(net("10.244.3.0/32")),
            route: Some(net("10.244.0.0/16")),
            address6: None,
            route6: None,
        }
    }

    fn healthy() -> ObservedLink {
        ObservedLink {
            up: true,
            mtu: 1450,
            addresses: vec![net("10.244.3.0/32")],
            routes: vec![net("10.244.0.0/16")],
            addresses6: vec![],
            routes6: vec![],
        }
    }

    fn wanted_dual() -> WantedLink {
        WantedLink {
            address6: Some(net6("fd00:10:244:3::/128")),
            route6: Some((net6("fd00:10:244::/56"), 1430)),
            ..wanted()
        }
    }

    fn healthy_dual() -> ObservedLink {
        ObservedLink {
            addresses6: vec![net6("fe80::1/64"), net6("fd00:10:244:3::/128")],
            routes6: vec![net6("fe80::/64"), net6("fd00:10:244::/56")],
            ..healthy()
        }
    }

    #[test]
    fn the_ipv6_half_is_kept_like_the_ipv4_one() {
        assert_eq!(plan(&wanted_dual(), &healthy_dual()), vec![]);
        // A flush of the IPv6 addresses takes the route with it: two repairs, address first.
        let seen = ObservedLink { addresses6: vec![], routes6: vec![], ..healthy_dual() };
        assert_eq!(
            plan(&wanted_dual(), &seen),
            vec![
                Repair::AddAddress6 { want: net6("fd00:10:244:3::/128") },
                Repair::AddRoute6 { network: net6("fd00:10:244::/56"), mtu: 1430 },
            ]
        );
        // Another half's /128 left behind is not ours to judge; ours missing is.
        let seen = ObservedLink { addresses6: vec![net6("fd00:10:244:9::/128")], ..healthy_dual() };
        assert_eq!(plan(&wanted_dual(), &seen)[0].kind(), RepairKind::Address6);
        // An IPv4-only network never asks for IPv6.
        assert_eq!(plan(&wanted(), &ObservedLink { addresses6: vec![], ..healthy() }), vec![]);
        let r = Repair::AddRoute6 { network: net6("fd00:10:244::/56"), mtu: 1430 };
        assert_eq!(
            r.repaired_line("weft0"),
            "the route for fd00:10:244::/56 via weft0 was gone: added it back"
        );
        let a = Repair::AddAddress6 { want: net6("fd00:10:244:3::/128") };
        assert_eq!(
            a.failed_line("weft0"),
            "weft0 had lost its IPv6 address fd00:10:244:3::/128: could not set \
             fd00:10:244:3::/128"
        );
    }

    #[test]
    fn a_link_as_weft_set_it_needs_nothing() {
        assert_eq!(plan(&wanted(), &healthy()), vec![]);
        // Other addresses and routes through the device are not weft's business.
        let mut more = healthy();
        more.addresses.push(net("192.168.7.7/24"));
        more.routes.insert(0, net("172.16.0.0/12"));
        assert_eq!(plan(&wanted(), &more), vec![]);
    }

    #[test]
    fn each_drift_is_one_repair() {
        let mut seen = healthy();
        seen.routes.clear();
        assert_eq!(
            plan(&wanted(), &seen),
            vec![Repair::AddRoute { network: net("10.244.0.0/16") }]
        );

        let mut seen = healthy();
        seen.up = false;
        assert_eq!(plan(&wanted(), &seen), vec![Repair::SetUp]);

        let mut seen = healthy();
        seen.addresses = vec![net("10.9.9.9/32")];
        assert_eq!(
            plan(&wanted(), &seen),
            vec![Repair::SetAddress {
                want: net("10.244.3.0/32"),
                found: vec![net("10.9.9.9/32")]
            }]
        );

        // The right address with the wrong prefix would route the whole /24 into the device.
        let mut seen = healthy();
        seen.addresses = vec![net("10.244.3.0/24")];
        assert_eq!(plan(&wanted(), &seen)[0].kind(), RepairKind::Address);

        let mut seen = healthy();
        seen.mtu = 1000;
        assert_eq!(plan(&wanted(), &seen), vec![Repair::SetMtu { found: 1000, want: 1450 }]);
    }

    #[test]
    fn repairs_come_in_the_order_the_kernel_needs() {
        // What `ip link set weft0 down` plus an MTU change leaves: the kernel drops the routes
        // of a device that goes down, and refuses a route through a device that is down.
        let seen = ObservedLink {
            up: false,
            mtu: 9000,
            addresses: vec![],
            routes: vec![],
            addresses6: vec![],
            routes6: vec![],
        };
        let kinds: Vec<RepairKind> = plan(&wanted_dual(), &seen).iter().map(Repair::kind).collect();
        assert_eq!(
            kinds,
            vec![
                RepairKind::Mtu,
                RepairKind::Up,
                RepairKind::Address,
                RepairKind::Route,
                RepairKind::Address6,
                RepairKind::Route6
            ]
        );
    }

    #[test]
    fn without_a_subnet_only_the_mtu_and_the_link_are_kept() {
        let w = WantedLink { mtu: 1450, address: None, route: None, address6: None, route6: None };
        let seen = ObservedLink {
            up: true,
            mtu: 1450,
            addresses: vec![],
            routes: vec![],
            addresses6: vec![],
            routes6: vec![],
        };
        assert_eq!(plan(&w, &seen), vec![]);
        let seen = ObservedLink { up: false, mtu: 1400, ..seen };
        assert_eq!(
            plan(&w, &seen),
            vec![Repair::SetMtu { found: 1400, want: 1450 }, Repair::SetUp]
        );
    }

    #[test]
    fn log_lines_say_what_drifted_and_what_was_done() {
        let lines = |r: Repair| (r.repaired_line("weft0"), r.failed_line("weft0"));
        assert_eq!(
            lines(Repair::SetUp),
            ("weft0 was down: set it up".into(), "weft0 was down: could not set it up".into())
        );
        assert_eq!(
            lines(Repair::SetMtu { found: 1000, want: 1450 }),
            (
                "weft0's MTU was 1000, not 1450: set it back to 1450".into(),
                "weft0's MTU was 1000, not 1450: could not set it back to 1450".into()
            )
        );
        assert_eq!(
            lines(Repair::AddRoute { network: net("10.244.0.0/16") }),
            (
                "the route for 10.244.0.0/16 via weft0 was gone: added it back".into(),
                "the route for 10.244.0.0/16 via weft0 was gone: could not add it back".into()
            )
        );
        assert_eq!(
            lines(Repair::SetAddress { want: net("10.244.3.0/32"), found: vec![] }).0,
            "weft0 had lost its address 10.244.3.0/32 (it had no IPv4 address): set 10.244.3.0/32"
        );
        assert_eq!(
            lines(Repair::SetAddress {
                want: net("10.244.3.0/32"),
                found: vec![net("10.9.9.9/32"), net("10.8.0.1/24")]
            })
            .1,
            "weft0 had lost its address 10.244.3.0/32 (it had 10.9.9.9/32, 10.8.0.1/24): could \
             not set 10.244.3.0/32"
        );
    }

    #[test]
    fn a_drift_event_is_logged_once_however_long_its_repair_fails() {
        let mut log = DriftLog::default();
        // Repaired at once: logged (by the caller) on success, nothing remembered.
        assert!(!log.repaired(RepairKind::Up));
        // Failing: the first failure is logged, the retries are not.
        assert!(log.failed(RepairKind::Route));
        assert!(!log.failed(RepairKind::Route));
        assert!(!log.failed(RepairKind::Route));
        // Another kind fails independently.
        assert!(log.failed(RepairKind::Mtu));
        // Still planned: nothing settles.
        let planned = [Repair::AddRoute { network: net("10.244.0.0/16") }, Repair::SetUp];
        assert_eq!(log.settle(&planned), vec![RepairKind::Mtu]);
        // The route is repaired at last: it had failed before; the next drift is a new event.
        assert!(log.repaired(RepairKind::Route));
        assert!(log.failed(RepairKind::Route));
        assert!(log.failing(), "a failing repair is retried");
        // Nothing planned any more: the failing route was put right by someone else.
        assert_eq!(log.settle(&[]), vec![RepairKind::Route]);
        assert_eq!(log.settle(&[]), vec![]);
        assert!(!log.failing(), "nothing left to retry");
    }

    #[test]
    fn an_observation_failure_is_logged_once_and_its_end_once() {
        let mut log = DriftLog::default();
        assert!(!log.observed());
        assert!(log.observe_failed());
        assert!(log.failing(), "a failed read is retried");
        assert!(!log.observe_failed());
        assert!(log.observed());
        assert!(!log.failing());
        assert!(!log.observed());
        assert!(log.observe_failed());
    }
}
