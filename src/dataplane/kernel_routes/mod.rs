//! The kernel-routes data plane: each peer's subnet a kernel route `via <PublicIP> dev
//! <underlay>`, following the route table (host-gw; and beside the tunnel, vxlan
//! `DirectRouting`'s peers on the underlay's link). No device, no thread, no packet passes
//! through weft: the kernel forwards. The daemon reaches it only through the data plane's
//! front door ([`super::Dataplane`]).
//!
//! Contract:
//! - [`KernelRoutes::repair`] is the one place the kernel is changed: it reads the underlay
//!   (the interface that has the public IP, and its address prefixes) and the main table, asks
//!   [`route_plan`] what the route table wants, applies it, logs it and counts it. It runs when
//!   the route table changes ([`Routes::subscribe`]), when this host's subnet changes, when
//!   the kernel says the underlay's routes changed (drift: someone deleted or changed a route)
//!   and every resync, so a lost notification costs one period at most.
//! - Log lines: a route added or removed because a peer came, moved or left, at INFO (flannel's
//!   "Subnet added"/"Subnet removed"); a route weft had put that someone else removed or changed
//!   and that was put back, at WARN, counted in `weft_dataplane_kernel_route_repairs_total`; a
//!   host-gw peer off the underlay's link, at ERROR once per peer, naming it (its subnet and
//!   `PublicIP`) and the underlay, with the gauge `weft_dataplane_off_link_peers`; a lease of
//!   another subnet naming this host's `PublicIP`, at WARN once, with the gauge
//!   `weft_dataplane_own_public_ip_leases`; a request the kernel refuses, at ERROR once until
//!   it works again (retried every second). A peer of another backend gets no route (flannel
//!   ignores it too) and is told about where every backend's are, [`crate::route::backends`].
//! - Ownership: weft's routes carry [`crate::dataplane::sys::netlink::ROUTE_PROTOCOL`]. The routes are left in
//!   place when weft stops (as flannel leaves them), so a restart or a takeover
//!   ([`KernelRoutes::adopt`]) finds them as they are and changes only what the route table
//!   says changed: nothing flaps. A fresh start removes its old routes only once the route
//!   watcher has published its first listing; an adopted one trusts the handed table at once.
//! - host-gw behind NAT (a public IP that is no address of this host) is refused at start, as
//!   flannel refuses it: the peers could not route to an address nobody here has.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use ipnet::Ipv4Net;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::dataplane::settings::DataplaneError;
use crate::dataplane::sys::host::KernelWatch;
use crate::dataplane::sys::netlink::{Netlink, NetlinkError, PeerRoute, SeenRoute};
use crate::lease::record::LeaseName;
use crate::metrics;
use crate::route::Routes;

mod route_plan;

pub(crate) use route_plan::Reach;
use route_plan::{Change, Me};

/// What the kernel-routes data plane needs to start.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KernelRoutesConfig {
    /// Which peers get routes.
    pub(crate) reach: Reach,
    /// The cluster's IPv4 network: weft's routes outside it are never touched.
    pub(crate) network: Ipv4Net,
    /// Our public IP: the underlay is the interface that has it.
    pub(crate) public_ip: Ipv4Addr,
}

/// The kernel-routes data plane's metrics.
#[derive(Debug, Default)]
pub(crate) struct KernelRouteStats {
    routes: AtomicU64,
    repairs: AtomicU64,
    off_link: AtomicU64,
    own_public_ip: AtomicU64,
}

impl Collector for KernelRouteStats {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        metrics::gauge(
            &mut e,
            "weft_dataplane_kernel_routes",
            "Kernel routes to peers' subnets via their PublicIP (host-gw, DirectRouting) in place.",
            self.routes.load(Ordering::Relaxed),
        )?;
        metrics::counter(
            &mut e,
            "weft_dataplane_kernel_route_repairs_total",
            "Kernel routes to peers put back after someone else removed or changed them.",
            self.repairs.load(Ordering::Relaxed),
        )?;
        metrics::gauge(
            &mut e,
            "weft_dataplane_off_link_peers",
            "host-gw peers whose PublicIP is not on the underlay's link: they get no route.",
            self.off_link.load(Ordering::Relaxed),
        )?;
        metrics::gauge(
            &mut e,
            "weft_dataplane_own_public_ip_leases",
            "Leases of another subnet whose PublicIP is this host's: never a peer, no route.",
            self.own_public_ip.load(Ordering::Relaxed),
        )
    }
}

/// What [`KernelRoutes::repair`] remembers between runs.
#[derive(Debug)]
struct State {
    me: Me,
    /// The routes weft put and believes are in place.
    installed: BTreeSet<PeerRoute>,
    /// Off-link peers already named at ERROR.
    off_link_told: BTreeSet<PeerRoute>,
    /// Leases naming this host's PublicIP already warned about.
    own_public_ip_told: BTreeSet<Ipv4Net>,
    /// Destinations whose change the kernel refused, already said at ERROR.
    failing: BTreeSet<Ipv4Net>,
    /// Reading the underlay or the routes fails, already said.
    read_failing: bool,
}

/// A running kernel-routes data plane (see the module docs).
#[derive(Debug)]
pub(crate) struct KernelRoutes {
    cfg: KernelRoutesConfig,
    netlink: Netlink,
    routes: Arc<Routes>,
    /// The route table's generation: removals wait for the first published table.
    generation: watch::Receiver<u64>,
    /// Adopted: the handed table is trusted from the start.
    adopted: bool,
    /// Handing over ([`KernelRoutes::quiesce`]): the next process changes the routes now.
    quiesced: AtomicBool,
    state: Mutex<State>,
    /// Metrics, for `/metrics`.
    pub(crate) stats: Arc<KernelRouteStats>,
}

impl KernelRoutes {
    /// Starts on `routes`, for this host's `lease` once known. host-gw refuses a public IP that
    /// no interface here has (NAT).
    pub(crate) fn start(
        cfg: KernelRoutesConfig,
        routes: Arc<Routes>,
        lease: Option<LeaseName>,
    ) -> Result<Self, DataplaneError> {
        Self::new(cfg, routes, lease, false)
    }

    /// Takes over from the previous process of this node: the kernel's routes are as it left
    /// them, and the handed route table is trusted at once (see the module docs).
    pub(crate) fn adopt(
        cfg: KernelRoutesConfig,
        routes: Arc<Routes>,
        lease: Option<LeaseName>,
    ) -> Result<Self, DataplaneError> {
        Self::new(cfg, routes, lease, true)
    }

    fn new(
        cfg: KernelRoutesConfig,
        routes: Arc<Routes>,
        lease: Option<LeaseName>,
        adopted: bool,
    ) -> Result<Self, DataplaneError> {
        let netlink = Netlink::open()?;
        let underlay = netlink.link_with_ipv4(cfg.public_ip)?;
        if cfg.reach == Reach::HostGw && underlay.is_none() {
            return Err(DataplaneError::HostGwNat(cfg.public_ip));
        }
        if let Some((_, name, prefixes)) = &underlay {
            let prefixes: Vec<String> = prefixes.iter().map(Ipv4Net::to_string).collect();
            info!(underlay = %name, prefixes = %prefixes.join(", "), reach = ?cfg.reach, "kernel routes to peers via the underlay");
        }
        Ok(Self {
            cfg,
            netlink,
            generation: routes.subscribe(),
            routes,
            adopted,
            quiesced: AtomicBool::new(false),
            state: Mutex::new(State {
                me: Me { subnet: lease.map(|l| l.subnet), public_ip: cfg.public_ip },
                installed: BTreeSet::new(),
                off_link_told: BTreeSet::new(),
                own_public_ip_told: BTreeSet::new(),
                failing: BTreeSet::new(),
                read_failing: false,
            }),
            stats: Arc::default(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A watch of the route table: [`KernelRoutes::repair`] should run when it moves.
    pub(crate) fn route_changes(&self) -> watch::Receiver<u64> {
        self.routes.subscribe()
    }

    /// This host's lease: its own subnet is never routed.
    pub(crate) fn set_subnet(&self, lease: Option<LeaseName>) {
        self.state().me.subnet = lease.map(|l| l.subnet);
    }

    /// The underlay was renumbered: it is now the interface with `public_ip`.
    pub(crate) fn set_public_ip(&self, public_ip: Ipv4Addr) {
        self.state().me.public_ip = public_ip;
    }

    /// The index of the underlay now (for the netlink watch). Blocking.
    pub(crate) fn underlay_index(&self) -> Result<Option<u32>, NetlinkError> {
        let ip = self.state().me.public_ip;
        Ok(self.netlink.link_with_ipv4(ip)?.map(|(index, _, _)| index))
    }

    /// A watch of the underlay's link, addresses and routes. Blocking.
    pub(crate) fn watch_link(&self) -> Result<(KernelWatch, watch::Receiver<u64>), NetlinkError> {
        match self.underlay_index()? {
            Some(index) => KernelWatch::links(&[index]),
            // No underlay now: anything may bring it back.
            None => KernelWatch::host(),
        }
    }

    /// Stops changing the kernel's routes (a handover: the next process changes them now, from
    /// a table that may be newer than this one's). The routes stay.
    pub(crate) fn quiesce(&self) {
        self.quiesced.store(true, Ordering::Relaxed);
    }

    /// Changes them again after [`KernelRoutes::quiesce`] (a handover that failed).
    pub(crate) fn resume(&self) {
        self.quiesced.store(false, Ordering::Relaxed);
    }

    /// Puts the kernel's routes to peers as the route table wants them (see the module docs);
    /// returns whether a read or a change is failing (the caller tries again within a second).
    /// Blocking.
    pub(crate) fn repair(&self) -> bool {
        let mut st = self.state();
        if self.quiesced.load(Ordering::Relaxed) {
            return false;
        }
        let me = st.me;
        let read = self
            .netlink
            .link_with_ipv4(me.public_ip)
            .and_then(|u| Ok((u, self.netlink.seen_routes()?)));
        let ((index, name, prefixes), seen) = match read {
            Ok((Some(underlay), seen)) => {
                if std::mem::take(&mut st.read_failing) {
                    info!("reading the underlay and the routes to peers works again");
                }
                (underlay, seen)
            }
            Ok((None, _)) => {
                if !std::mem::replace(&mut st.read_failing, true) {
                    error!(public_ip = %me.public_ip, "no interface has the public IP: the routes to peers wait for it");
                }
                return true;
            }
            Err(e) => {
                if !std::mem::replace(&mut st.read_failing, true) {
                    warn!(error = %e, "cannot read the underlay and the routes to peers; retrying every second");
                }
                return true;
            }
        };
        let table = self.routes.load();
        let want = route_plan::wanted(table.peers(), me, self.cfg.reach, &prefixes);
        drop(table);
        self.tell_unroutable(&mut st, &want, &name, &prefixes);
        let trusted = self.adopted || *self.generation.borrow() > 0;
        let changes = route_plan::plan(&want.routes, &seen, index, self.cfg.network, trusted);
        let mut failing = false;
        for change in changes {
            match change {
                Change::Put { route, found } => {
                    match self.netlink.put_peer_route(&name, index, route) {
                        Ok(()) => {
                            self.told_put(&mut st, route, &found, &name);
                            st.installed.retain(|r| r.dst != route.dst);
                            st.installed.insert(route);
                        }
                        Err(e) => {
                            failing = true;
                            if st.failing.insert(route.dst) {
                                error!(error = %e, "could not add the route {route} dev {name}; retrying every second");
                            }
                        }
                    }
                }
                Change::Remove(old) => match self.netlink.remove_peer_route(&old) {
                    Ok(()) => {
                        st.failing.remove(&old.dst);
                        st.installed.retain(|r| r.dst != old.dst || Some(r.gw) != old.gw);
                        info!(route = %old, "removed the route to a subnet no peer holds");
                    }
                    Err(e) => {
                        failing = true;
                        if st.failing.insert(old.dst) {
                            error!(error = %e, route = %old, "could not remove the route to a subnet no peer holds; retrying every second");
                        }
                    }
                },
            }
        }
        st.installed.retain(|r| want.routes.contains(r));
        self.stats.routes.store(st.installed.len() as u64, Ordering::Relaxed);
        failing
    }

    /// Says, once each, which host-gw peers get no route because they are off the underlay's
    /// link.
    fn tell_unroutable(
        &self,
        st: &mut State,
        want: &route_plan::Wanted,
        name: &str,
        prefixes: &[Ipv4Net],
    ) {
        self.stats.off_link.store(want.off_link.len() as u64, Ordering::Relaxed);
        st.off_link_told.retain(|r| want.off_link.contains(r));
        let link: Vec<String> = prefixes.iter().map(|p| p.trunc().to_string()).collect();
        for r in &want.off_link {
            if st.off_link_told.insert(*r) {
                error!(
                    subnet = %r.dst,
                    public_ip = %r.gw,
                    underlay = name,
                    "the host-gw peer holding {} has PublicIP {}, which is not on {name}'s link ({}): no route to it (host-gw needs every host on one link; the kernel refuses a gateway off it)",
                    r.dst,
                    r.gw,
                    link.join(", ")
                );
            }
        }
        self.stats.own_public_ip.store(want.own_public_ip.len() as u64, Ordering::Relaxed);
        st.own_public_ip_told.retain(|s| want.own_public_ip.contains(s));
        for subnet in &want.own_public_ip {
            if st.own_public_ip_told.insert(*subnet) {
                warn!(
                    %subnet,
                    public_ip = %st.me.public_ip,
                    "the lease of {subnet} names this host's PublicIP {}: an old lease of this host's not yet expired, or another host misconfigured with this address; it is no peer and gets no route",
                    st.me.public_ip
                );
            }
        }
    }

    /// Logs a route put, as what happened: a peer came or moved (INFO), a route of weft's
    /// that was gone came back, or someone else's route was replaced (WARN).
    fn told_put(&self, st: &mut State, route: PeerRoute, found: &[SeenRoute], dev: &str) {
        let after_failing = st.failing.remove(&route.dst);
        let was_ours = st.installed.contains(&route);
        let foreign: Vec<String> =
            found.iter().filter(|r| !r.ours).map(ToString::to_string).collect();
        if was_ours {
            self.stats.repairs.fetch_add(1, Ordering::Relaxed);
            let what = if found.is_empty() { "was gone" } else { "had changed" };
            warn!(%route, after_failing, "the route {route} dev {dev} {what}: put it back");
        } else if !foreign.is_empty() {
            warn!(%route, found = %foreign.join("; "), "a route to a peer's subnet that is not weft's was in the way: replaced it with {route} dev {dev}");
        } else if let Some(old) = found.first() {
            info!(%route, old = %old, "a peer moved: route {route} dev {dev}");
        } else {
            info!(%route, "route to a peer: {route} dev {dev}");
        }
    }
}
