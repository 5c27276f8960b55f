//! The underlay: which address this host publishes and on which interface, found at start as
//! flanneld finds it, then followed while weft runs (the interface renumbered).
//!
//! Contract: the `pick_*` functions and [`next_public_ip`] are pure; the `find_*` functions ask
//! the kernel over netlink once; [`follow_underlay`] is the task that re-binds the data plane,
//! remakes the store's connections and publishes a new address, and says on `/readyz`
//! ([`UnderlayStatus`]) while the data plane cannot receive on the underlay's address.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::watch;
use tracing::{error, warn};

use super::etcd_endpoint_addrs;
use super::netlink_watch::{LINK_SETTLE, next_netlink_change, start_watch};
use crate::config::{NetworkConfig, UnderlayAddr};
use crate::dataplane::{Dataplane, Host, KernelWatch};
use crate::lease::store::Store;
use crate::logging::LogOnce;

/// The underlay: which address to publish and the interface's MTU.
#[derive(Clone, Debug)]
pub(crate) struct Underlay {
    /// The interface name, when known.
    pub(crate) iface: Option<String>,
    /// The address published as `PublicIP`.
    pub(crate) public_ip: Ipv4Addr,
    /// The interface MTU (1500 when unknown).
    pub(crate) mtu: u32,
}

/// Finds the IPv6 underlay address to publish as `PublicIPv6`, as flanneld does on a
/// dual-stack network: `--public-ipv6` when given; else the first global IPv6 address of the
/// IPv4 underlay's interface `iface`; else (no interface known, or it has no global IPv6
/// address) that of the main table's IPv6 default route's interface. None found is an error
/// naming what to give: a dual-stack vxlan node cannot carry IPv6 without one.
pub(crate) fn find_underlay6(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
) -> anyhow::Result<Ipv6Addr> {
    if let Some(ip) = public_ipv6 {
        return Ok(ip);
    }
    let netlink = Host::open().context("finding the IPv6 underlay")?;
    let addrs = netlink.ipv6_addresses_by_interface().context("listing IPv6 addresses")?;
    let default6 =
        netlink.default_route6_iface().context("finding the IPv6 default route's interface")?;
    Ok(pick_underlay6(iface, &addrs, default6.as_deref())?)
}

/// Finds the underlay of an IPv6-only node, which has no IPv4 one: `--public-ipv6` when given,
/// else the first global IPv6 address of `--iface` (a name, or one of its IPv6 addresses),
/// else that of the IPv6 default route's interface. The published `PublicIP` is `0.0.0.0`, as
/// flannel writes it; the MTU is the chosen interface's.
pub(crate) fn find_ipv6_only_underlay(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
) -> anyhow::Result<(Underlay, Ipv6Addr)> {
    let netlink = Host::open().context("finding the IPv6 underlay")?;
    let addrs = netlink.ipv6_addresses_by_interface().context("listing IPv6 addresses")?;
    let default6 =
        netlink.default_route6_iface().context("finding the IPv6 default route's interface")?;
    let (name, addr) = pick_ipv6_only_underlay(iface, public_ipv6, &addrs, default6.as_deref())?;
    let mtu = match name.as_deref() {
        Some(n) => netlink.mtu(n).with_context(|| format!("reading the MTU of {n}"))?,
        None => None,
    }
    .unwrap_or(1500);
    Ok((Underlay { iface: name, public_ip: Ipv4Addr::UNSPECIFIED, mtu }, addr))
}

/// The interface and address of an IPv6-only node's underlay, pure (see
/// [`find_ipv6_only_underlay`]): `--iface` names an interface or one of its addresses;
/// `--public-ipv6` overrides the address (its interface is then the one holding it, if any).
pub(crate) fn pick_ipv6_only_underlay(
    iface: Option<&str>,
    public_ipv6: Option<Ipv6Addr>,
    addrs: &[(String, Ipv6Addr)],
    default6: Option<&str>,
) -> Result<(Option<String>, Ipv6Addr), NoUnderlay6> {
    let holder = |ip: Ipv6Addr| addrs.iter().find(|(_, a)| *a == ip).map(|(n, _)| n.clone());
    let first_on = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(_, a)| *a);
    let none_on = |spec: &str| NoUnderlay6 { iface: Some(spec.to_owned()), default6: None };
    match (iface.map(|spec| (spec, spec.parse::<Ipv6Addr>())), public_ipv6) {
        // `--iface` is strict: its interface, or an error (never another interface's address).
        (Some((spec, Ok(ip))), public) => {
            let name = holder(ip).ok_or_else(|| none_on(spec))?;
            Ok((Some(name), public.unwrap_or(ip)))
        }
        (Some((name, Err(_))), Some(ip)) => Ok((Some(name.to_owned()), ip)),
        (Some((name, Err(_))), None) => {
            let ip = first_on(name).ok_or_else(|| none_on(name))?;
            Ok((Some(name.to_owned()), ip))
        }
        (None, Some(ip)) => Ok((holder(ip), ip)),
        (None, None) => {
            let ip = pick_underlay6(None, addrs, default6)?;
            Ok((holder(ip), ip))
        }
    }
}

/// No IPv6 underlay address was found ([`pick_underlay6`]).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the network config enables IPv6 (vxlan) but {iface} has no global IPv6 address{also}: give \
     --public-ipv6, or an --iface with one",
    iface = iface.as_deref().unwrap_or("the underlay interface"),
    also = default6.as_deref().map(|d| format!(" (nor has {d}, the IPv6 default route's)")).unwrap_or_default()
)]
pub(crate) struct NoUnderlay6 {
    /// The IPv4 underlay's interface, if known.
    iface: Option<String>,
    /// The IPv6 default route's interface, if there is one.
    default6: Option<String>,
}

/// The IPv6 underlay address, pure: the first of `addrs` (global IPv6 addresses by interface,
/// in the kernel's order) on `iface` (the IPv4 underlay's interface), else the first on
/// `default6` (the IPv6 default route's interface).
pub(crate) fn pick_underlay6(
    iface: Option<&str>,
    addrs: &[(String, Ipv6Addr)],
    default6: Option<&str>,
) -> Result<Ipv6Addr, NoUnderlay6> {
    let first_of = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(_, a)| *a);
    iface.and_then(first_of).or_else(|| default6.and_then(first_of)).ok_or_else(|| NoUnderlay6 {
        iface: iface.map(str::to_owned),
        default6: default6.map(str::to_owned),
    })
}

/// Finds the underlay as flanneld does: `--iface` (name or address), else the interface of the
/// main table's IPv4 default route (of lowest metric, asked over netlink); `--public-ip`
/// overrides the published address. The MTU is the interface's, over netlink too.
pub(crate) fn find_underlay(
    iface: Option<&str>,
    public_ip: Option<Ipv4Addr>,
) -> anyhow::Result<Underlay> {
    let netlink = Host::open().context("finding the underlay")?;
    let addrs = netlink.ipv4_addresses_by_interface().context("listing interfaces")?;
    let by_name = |name: &str| addrs.iter().find(|(n, _)| n == name).map(|(n, a)| (n.clone(), *a));
    let chosen = match iface {
        Some(spec) => match spec.parse::<Ipv4Addr>() {
            Ok(ip) => addrs.iter().find(|(_, a)| *a == ip).map(|(n, a)| (n.clone(), *a)),
            Err(_) => by_name(spec),
        }
        .with_context(|| format!("--iface {spec}: no such interface with an IPv4 address"))
        .map(Some)?,
        None => match public_ip {
            Some(ip) => addrs.iter().find(|(_, a)| *a == ip).map(|(n, a)| (n.clone(), *a)),
            None => netlink
                .default_route_iface()
                .context("finding the default route's interface")?
                .and_then(|n| by_name(&n)),
        },
    };
    let (name, addr) = match (chosen, public_ip) {
        (Some((n, a)), _) => (Some(n), a),
        (None, Some(ip)) => (None, ip),
        (None, None) => bail!(
            "no default route to pick the underlay interface from: give --iface or --public-ip"
        ),
    };
    let mtu = match name.as_deref() {
        Some(n) => netlink.mtu(n).with_context(|| format!("reading the MTU of {n}"))?,
        None => None,
    }
    .unwrap_or(1500);
    Ok(Underlay { iface: name, public_ip: public_ip.unwrap_or(addr), mtu })
}

/// The addresses the overlay must not contain: this host's public IP and every etcd endpoint
/// given as an address.
pub(crate) fn underlay_addrs(public_ip: Ipv4Addr, etcd_endpoints: &[String]) -> Vec<UnderlayAddr> {
    let mut addrs = vec![UnderlayAddr { what: "this host's public IP".into(), addr: public_ip }];
    addrs.extend(etcd_endpoint_addrs(etcd_endpoints));
    addrs
}

/// How often the underlay's addresses are listed without a netlink watch (or after a listing
/// failed).
const UNDERLAY_CHECK: Duration = Duration::from_secs(1);

/// What [`follow_underlay`] watches.
#[derive(Clone, Debug)]
pub(super) struct UnderlayFollow {
    /// The underlay interface whose address is published (`None` when `--public-ip` is given:
    /// the published address is the operator's then, and is never changed).
    pub(super) iface: Option<String>,
    /// `--public-ip`, watched only to warn when it stops being a local address.
    pub(super) explicit: Option<Ipv4Addr>,
    pub(super) network: NetworkConfig,
    pub(super) etcd_endpoints: Vec<String>,
    /// How often the addresses are listed when no netlink notification said they changed.
    pub(super) resync: Duration,
}

/// The underlay follower's say on readiness (`/readyz` is 503 while the data plane cannot receive
/// on the underlay's address) and its counter, `weft_underlay_rebind_failures_total`.
#[derive(Debug, Default)]
pub(crate) struct UnderlayStatus {
    problem: std::sync::Mutex<Option<String>>,
    rebind_failures: std::sync::atomic::AtomicU64,
}

impl UnderlayStatus {
    fn set_problem(&self, problem: Option<String>) {
        *self.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
    }

    pub(crate) fn problem(&self) -> Option<String> {
        self.problem.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl prometheus_client::collector::Collector for UnderlayStatus {
    fn encode(
        &self,
        mut e: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        crate::metrics::counter(
            &mut e,
            "weft_underlay_rebind_failures_total",
            "Failed tries to re-bind the data plane's sockets on the underlay's new address.",
            self.rebind_failures.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// The address to publish instead of `current`, given the underlay interface's IPv4 addresses:
/// `None` while `current` is still one of them (an added address changes nothing), else the
/// interface's first address; `None` too while the interface has none (mid-renumbering).
pub(crate) fn next_public_ip(current: Ipv4Addr, on_iface: &[Ipv4Addr]) -> Option<Ipv4Addr> {
    if on_iface.contains(&current) {
        return None;
    }
    on_iface.first().copied()
}

/// Follows the underlay interface's address at run time (the address moves, the interface is
/// renumbered): once `current` is gone from it, re-binds the data plane's sockets on the new
/// address, drops the store's connections (they were made from the old address and die
/// silently), then publishes it (`public_ip_tx`, to the lease driver, which rewrites the lease),
/// so that peers send to it and every datagram leaves from the published `PublicIP`. An address
/// inside the Network is refused, loudly, as at start. Lists the addresses when the kernel says
/// an address, link or route changed (a netlink watch), and every `resync` besides; every
/// [`UNDERLAY_CHECK`] without a watch.
pub(super) async fn follow_underlay(
    follow: UnderlayFollow,
    mut current: Ipv4Addr,
    dataplane: Option<Arc<Dataplane>>,
    store: Arc<dyn Store>,
    public_ip_tx: watch::Sender<Ipv4Addr>,
    status: Arc<UnderlayStatus>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut reporter = LogOnce::default();
    let mut explicit_was_local = false;
    let mut reconnected_for: Option<Ipv4Addr> = None;
    let mut netlink: Option<Arc<Host>> = None;
    // The kernel's notice of address, link and route changes (kept for the task's life:
    // dropping it ends its thread).
    let (_watch, mut changes) =
        start_watch(KernelWatch::host, "the underlay's addresses", UNDERLAY_CHECK).await.unzip();
    loop {
        // Polled every UNDERLAY_CHECK without a watch, and after a failed listing.
        let period =
            if changes.is_some() && netlink.is_some() { follow.resync } else { UNDERLAY_CHECK };
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            changed = next_netlink_change(&mut changes) => {
                if changed.is_err() {
                    warn!(every = ?UNDERLAY_CHECK, "the netlink watch of the underlay ended: polling instead");
                    changes = None;
                }
            }
            _ = shutdown.wait_for(|v| *v) => return,
        }
        if changes.is_some() {
            // A burst of notifications (a renumbering is several) is answered by one listing.
            tokio::time::sleep(LINK_SETTLE).await;
        }
        if let Some(rx) = &mut changes {
            rx.borrow_and_update();
        }
        // One netlink socket for the whole watch, opened again only after it failed.
        let nl = match &netlink {
            Some(nl) => nl.clone(),
            None => match Host::open() {
                Ok(nl) => netlink.insert(Arc::new(nl)).clone(),
                Err(e) => {
                    if let Some(p) = reporter.note(format!("listing the underlay's addresses: {e}"))
                    {
                        error!("{p}");
                    }
                    continue;
                }
            },
        };
        // The netlink calls block (their socket has a thread of its own).
        let listed = tokio::task::spawn_blocking(move || nl.ipv4_addresses_by_interface())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let addrs = match listed {
            Ok(a) => a,
            Err(e) => {
                netlink = None;
                if let Some(p) = reporter.note(format!("listing the underlay's addresses: {e}")) {
                    error!("{p}");
                }
                continue;
            }
        };
        let Some(iface) = &follow.iface else {
            // A --public-ip that never was local is NAT, and fine; one that was and went is
            // worth an error: peers keep sending to it.
            if let Some(ip) = follow.explicit {
                if addrs.iter().any(|(_, a)| *a == ip) {
                    explicit_was_local = true;
                    reporter.clear();
                } else if explicit_was_local
                    && let Some(p) = reporter.note(format!(
                        "--public-ip {ip} is no longer a local address: peers' datagrams to it \
                         no longer reach this host (weft keeps publishing the address it was given)"
                    ))
                {
                    error!("{p}");
                }
            }
            continue;
        };
        let on_iface: Vec<Ipv4Addr> =
            addrs.iter().filter(|(n, _)| n == iface).map(|(_, a)| *a).collect();
        let Some(next) = next_public_ip(current, &on_iface) else {
            status.set_problem((!on_iface.contains(&current)).then(|| {
                format!(
                    "the published address {current} is no longer on {iface}: nothing is received"
                )
            }));
            continue;
        };
        if let Err(e) = follow.network.check_underlay(&underlay_addrs(next, &follow.etcd_endpoints))
        {
            if let Some(p) =
                reporter.note(format!("{iface} now has {next}, which cannot be published: {e:#}"))
            {
                error!("{p}");
            }
            continue;
        }
        warn!(iface = %iface, old = %current, new = %next, "the underlay address changed: re-binding the sockets and publishing the new public IP");
        // The store's connections left from the old address: make them again at once, once
        // per new address, whether or not the data plane can bind there (the lease and the
        // identity must be kept meanwhile).
        if reconnected_for != Some(next) {
            store.reconnect();
            reconnected_for = Some(next);
        }
        if let Some(dp) = &dataplane {
            let dp = dp.clone();
            let rebound = match tokio::task::spawn_blocking(move || dp.set_public_ip(next)).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = rebound {
                // Every failed try is told and counted: a squatter on the new address's port
                // keeps this host deaf until it goes. The old address stays published: the
                // lease never names an address weft cannot receive on.
                status.rebind_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                warn!(iface = %iface, address = %next, error = %e, retry_in = ?period, "could not re-bind the data plane on the underlay's new address; not ready, retrying");
                status.set_problem(Some(format!(
                    "the data plane is not bound on {next}, {iface}'s address now ({e}); {current}, \
                     still published, is no longer on {iface}: nothing is received; retrying"
                )));
                continue;
            }
        }
        reporter.clear();
        status.set_problem(None);
        current = next;
        let _ = public_ip_tx.send(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv6-only node's underlay: the interface and the address, from `--iface` (a name or
    /// one of its addresses), `--public-ipv6`, or the IPv6 default route's interface.
    #[test]
    fn an_ipv6_only_underlay_is_the_iface_or_the_default_routes_with_its_interface() {
        let a = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        let addrs =
            vec![("eth0".to_string(), a("2001:db8::5")), ("eth1".to_string(), a("2001:db8:1::7"))];
        let pick = |iface, public| pick_ipv6_only_underlay(iface, public, &addrs, Some("eth1"));
        let got = |name: &str, ip: &str| Ok((Some(name.to_string()), a(ip)));
        assert_eq!(pick(None, None), got("eth1", "2001:db8:1::7"));
        assert_eq!(pick(Some("eth0"), None), got("eth0", "2001:db8::5"));
        assert_eq!(pick(Some("2001:db8::5"), None), got("eth0", "2001:db8::5"));
        // --public-ipv6 is published as given (NAT), on --iface or its holder's interface.
        assert_eq!(pick(Some("eth0"), Some(a("2001:db8:9::1"))), got("eth0", "2001:db8:9::1"));
        assert_eq!(pick(None, Some(a("2001:db8::5"))), got("eth0", "2001:db8::5"));
        assert_eq!(pick(None, Some(a("2001:db8:9::1"))), Ok((None, a("2001:db8:9::1"))));
        // An --iface address no interface has, or an interface without IPv6: errors.
        let e = pick(Some("2001:db8:9::1"), None).unwrap_err().to_string();
        assert!(e.contains("2001:db8:9::1 has no global IPv6 address"), "{e}");
        let e = pick(Some("eth9"), None).unwrap_err().to_string();
        assert!(e.contains("eth9 has no global IPv6 address"), "{e}");
    }

    #[test]
    fn the_ipv6_underlay_is_the_ifaces_first_address_else_the_default_routes() {
        let a = |s: &str| -> Ipv6Addr { s.parse().unwrap() };
        let addrs = vec![
            ("eth0".to_owned(), a("2001:db8::5")),
            ("eth0".to_owned(), a("2001:db8::6")),
            ("eth1".to_owned(), a("2001:db8:1::7")),
        ];
        assert_eq!(pick_underlay6(Some("eth0"), &addrs, Some("eth1")), Ok(a("2001:db8::5")));
        // The IPv4 underlay has no IPv6 address: the IPv6 default route's interface has one.
        assert_eq!(pick_underlay6(Some("lo"), &addrs, Some("eth1")), Ok(a("2001:db8:1::7")));
        assert_eq!(pick_underlay6(None, &addrs, Some("eth1")), Ok(a("2001:db8:1::7")));
        // Neither: the error names both, and the flags that fix it.
        let e = pick_underlay6(Some("eth2"), &addrs, Some("eth3")).unwrap_err().to_string();
        assert_eq!(
            e,
            "the network config enables IPv6 (vxlan) but eth2 has no global IPv6 address (nor \
             has eth3, the IPv6 default route's): give --public-ipv6, or an --iface with one"
        );
        let e = pick_underlay6(None, &[], None).unwrap_err().to_string();
        assert!(e.starts_with("the network config enables IPv6 (vxlan) but the underlay interface has no global IPv6 address: give --public-ipv6"), "{e}");
    }

    #[test]
    fn the_published_address_moves_only_when_it_left_the_interface() {
        let ip = |d| Ipv4Addr::new(192, 0, 2, d);
        // Still there, even with others added before it: kept.
        assert_eq!(next_public_ip(ip(1), &[ip(1)]), None);
        assert_eq!(next_public_ip(ip(1), &[ip(9), ip(1)]), None);
        // Gone: the interface's first address.
        assert_eq!(next_public_ip(ip(1), &[ip(11), ip(12)]), Some(ip(11)));
        // Gone and nothing yet (mid-renumbering): wait.
        assert_eq!(next_public_ip(ip(1), &[]), None);
    }
}
