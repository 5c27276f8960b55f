//! The data plane: packets move TUN -> route lookup -> VXLAN/UDP encapsulation -> UDP socket,
//! and back, in user space.
//!
//! # The front door
//! The daemon sees [`Dataplane`] (start it, point it at this host's lease and public address,
//! keep its device as it was set up, register its metrics and readiness, stop it), its
//! [`DataplaneConfig`] and [`DataplaneError`], and [`Host`] and [`KernelWatch`] (the host's
//! interfaces, addresses and default routes, and notice when they change, for finding and
//! following the underlay). The syscall and netlink code behind them ([`sys`]) is the data
//! plane's own, and the threads (`tunnel`, [`worker`]) are private.
//!
//! # Backends
//! A backend is how this host's overlay traffic reaches its peers; [`Dataplane`] holds one and
//! dispatches to it. They come in three shapes, each a variant of [`Dataplane`]'s backend:
//! - **A tunnel** (`tunnel`): a TUN device, the route table, and a transport between the
//!   device and the peers. vxlan and udp are transports over batched UDP sockets
//!   (stateless: [`transport`] encapsulates and validates each packet). An encrypting transport
//!   (wireguard) is one more: the worker keeps per-peer sessions keyed by the route table's
//!   peer and driven by `now`, over the same sockets and offloads; ipip is a transport over a
//!   raw IP socket instead of UDP.
//! - **Kernel routes** (`kernel_routes`; host-gw): no TUN device; each peer's subnet is a
//!   kernel route `via <PublicIP> dev <underlay>`, following the route table, and
//!   drift-repaired like the tunnel's device (`kernel_routes::route_plan` plans it).
//! - **A tunnel with direct routes** (vxlan `DirectRouting`): the tunnel, and beside it kernel
//!   routes for the peers whose `PublicIP` is on the underlay's link. Those routes (a peer's
//!   subnet) are more specific than the tunnel's route (the whole Network), so the kernel
//!   sends those peers' traffic straight to them; the others' goes through the tunnel.
//! - **None** (`--dataplane none`, flannel's `alloc`): no [`Dataplane`] at all.
//!
//! Every backend answers the same calls: [`Dataplane::set_subnet`],
//! [`Dataplane::set_public_ip`], [`Dataplane::watch_link`] and [`Dataplane::repair_link`]
//! (what it set up in the kernel, put back when someone changes it), [`Dataplane::register`]
//! (its metrics and its say on `/readyz`) and [`Dataplane::stop`]; and, for an upgrade
//! without loss, [`Dataplane::hand_over`] (its descriptors, for the next process),
//! [`Dataplane::adopt`] (the next process's start on them), [`Dataplane::quiesce`] and
//! [`Dataplane::resume`]. Kernel routes have no descriptors: the next process adopts the
//! routes as they are in the kernel. [`Dataplane::route_changes`] says when a backend that
//! programs the kernel from the route table wants [`Dataplane::repair_link`] run.
//!
//! # Where things are
//! One folder per kind of thing, in layers: a module may use only its own layer or those below
//! (`tests/layers.rs` holds it, tests included). Lowest first:
//! - [`wire`]: packet formats (checked views and emitters), pure, depending on nothing here.
//! - [`sys`]: descriptor and syscall code only: the TUN device ([`sys::tun`]), the batched UDP
//!   and raw ipip sockets with their GSO rules ([`sys::udp`]), netlink with its decoders and the
//!   plain data it reads and writes, netlink notifications, the host's interfaces, a thread's
//!   scheduling slice. It imports no planner.
//! - [`offload`]: TSO split and GRO coalesce, pure; and which kernels' offloads are broken
//!   ([`offload::kernel_bugs`]).
//! - [`transport`]: per-packet decisions, pure: the [`transport::Forwarder`] (route lookup,
//!   encapsulation, receive validation, ICMP errors) and its drop reasons; each transport's
//!   headers and receive checks in a file of its own (vxlan, udp, ipip).
//! - [`worker`]: the forwarding loops, their counters ([`worker::counters`]), send planning
//!   (`worker::plan`, pure), supervision, and the in-memory fakes of both edges for tests.
//! - `settings`: what a backend starts with ([`DataplaneConfig`]) and why a start fails
//!   ([`DataplaneError`]), shared by the backends.
//! - The backends, independent of each other: `tunnel` (the TUN device's driver: its queues,
//!   sockets and threads, and drift repair of its link, planned in `tunnel::drift`) and
//!   `kernel_routes` (host-gw and vxlan `DirectRouting`: kernel routes to peers, planned in
//!   `kernel_routes::route_plan`).
//! - Beside the backends, `masq` (`--ip-masq`): weft's nftables tables, planned in `masq::plan`,
//!   their nf_tables messages encoded in `masq::nft` (both pure), and a driver that speaks them
//!   over NETLINK_NETFILTER.
//! - This file, the front door, above them all.
//!
//! # Contract
//! [`wire`], [`offload`], [`transport`] and the planners (`worker::plan`, `tunnel::drift`,
//! `kernel_routes::route_plan`, `masq::plan` and `masq::nft`, [`offload::kernel_bugs`], the restart policy of
//! `worker::supervise`) are pure (no I/O, no allocation on the per-packet path, never panic on
//! input). Only [`sys`] touches file descriptors (its netlink driver with no `unsafe`), and
//! only `tunnel` creates them and the threads that run [`worker`]'s loops; `worker::fake`
//! stands in for both edges in tests (only with the `test-util` feature or in unit tests).

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use crate::health::Health;
use crate::lease::record::LeaseName;
use crate::route::Routes;

mod kernel_routes;
mod masq;
pub mod offload;
mod settings;
pub mod sys;
pub mod transport;
mod tunnel;
pub mod wire;
pub mod worker;

pub(crate) use masq::plan::Inputs as MasqInputs;
pub(crate) use masq::{MasqConfig, Masquerade};
pub(crate) use settings::{
    DataplaneConfig, DataplaneError, Ipv6Dataplane, UdpGsoConfig, WireguardDataplane,
};
pub(crate) use sys::host::{Host, KernelWatch};
pub(crate) use sys::netlink::NetlinkError;
pub use sys::tun::check_tun_name;

use kernel_routes::{KernelRoutes, KernelRoutesConfig, Reach};
use tunnel::{DriftLog, HandedTunnel, Tunnel, TunnelLayout};

use crate::config::BackendKind;
use crate::route::PeerBackend;

impl DataplaneLayout {
    /// The public IPv4 address the handed sockets are bound for (`None`: no sockets).
    pub(crate) fn public_ip(&self) -> Option<std::net::Ipv4Addr> {
        match self {
            Self::Tunnel(t) => Some(t.public_ip),
            Self::KernelRoutes => None,
        }
    }
}

/// What a data plane's descriptors are, when handed to the next process
/// ([`Dataplane::hand_over`]): written into the handover message beside them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum DataplaneLayout {
    /// A tunnel's TUN queues and sockets.
    Tunnel(TunnelLayout),
    /// Kernel routes: no descriptors (the routes stay in the kernel).
    KernelRoutes,
}

/// A data plane's descriptors (duplicated: the data plane that handed them keeps forwarding
/// until [`Dataplane::quiesce`]), and what they are.
#[derive(Debug)]
pub(crate) struct HandedDataplane {
    /// What the descriptors are.
    pub(crate) layout: DataplaneLayout,
    /// The descriptors, in the layout's order.
    pub(crate) fds: Vec<std::os::fd::OwnedFd>,
}

/// A running data plane: the daemon's one handle on it. Stops on [`Dataplane::stop`] or drop.
#[derive(Debug)]
pub(crate) struct Dataplane {
    backend: Backend,
    /// Kernel routes beside a tunnel: vxlan `DirectRouting`'s peers on the underlay's link.
    direct: Option<KernelRoutes>,
    /// What drift repair has reported, so each drift event is said once.
    drift: Mutex<DriftLog>,
}

/// The backend a [`Dataplane`] runs (see the module docs for the shapes a backend takes).
/// One per process, so a large variant costs nothing.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Backend {
    /// A TUN device and a transport over UDP (vxlan, udp).
    Tunnel(Tunnel),
    /// Kernel routes via the peers' public IPs (host-gw).
    KernelRoutes(KernelRoutes),
}

/// The kernel routes `cfg` asks for, if any: host-gw's, or direct routing's beside a tunnel.
fn kernel_routes_config(cfg: &DataplaneConfig) -> Option<KernelRoutesConfig> {
    let reach = match cfg.backend {
        BackendKind::HostGw => Reach::HostGw,
        BackendKind::Vxlan if cfg.direct_routing => Reach::Direct(PeerBackend::Vxlan),
        BackendKind::Ipip if cfg.direct_routing => Reach::Direct(PeerBackend::Ipip),
        _ => return None,
    };
    Some(KernelRoutesConfig { reach, network: cfg.network?, public_ip: cfg.public_ip })
}

impl Dataplane {
    /// Starts the backend `cfg` names: for a tunnel, creates the TUN device (one queue per
    /// worker), binds the sockets, probes offloads and starts the workers. The device gets its
    /// address once [`Dataplane::set_subnet`] is called.
    pub(crate) fn start(cfg: DataplaneConfig, routes: Arc<Routes>) -> Result<Self, DataplaneError> {
        let kernel = kernel_routes_config(&cfg);
        if cfg.backend == BackendKind::HostGw {
            let kernel = kernel.ok_or(DataplaneError::NoSockets)?;
            let routes = KernelRoutes::start(kernel, routes, None)?;
            return Ok(Self::of(Backend::KernelRoutes(routes), None));
        }
        let direct = kernel.map(|k| KernelRoutes::start(k, routes.clone(), None)).transpose()?;
        Ok(Self::of(Backend::Tunnel(Tunnel::start(cfg, routes)?), direct))
    }

    fn of(backend: Backend, direct: Option<KernelRoutes>) -> Self {
        Self { backend, direct, drift: Mutex::default() }
    }

    /// The kernel routes this data plane programs, if any (host-gw's, or direct routing's).
    fn kernel_routes(&self) -> Option<&KernelRoutes> {
        match &self.backend {
            Backend::KernelRoutes(k) => Some(k),
            Backend::Tunnel(_) => self.direct.as_ref(),
        }
    }

    /// A watch of the route table, when this data plane programs kernel routes from it:
    /// [`Dataplane::repair_link`] should then run whenever it moves.
    pub(crate) fn route_changes(&self) -> Option<watch::Receiver<u64>> {
        self.kernel_routes().map(KernelRoutes::route_changes)
    }

    /// Takes over the data plane another process (or this one's previous image) handed over:
    /// forwards on the same TUN queues and sockets, for `lease`, from its first packet.
    pub(crate) fn adopt(
        cfg: DataplaneConfig,
        routes: Arc<Routes>,
        handed: HandedDataplane,
        lease: Option<LeaseName>,
    ) -> Result<Self, DataplaneError> {
        let kernel = kernel_routes_config(&cfg);
        let adopt_routes = |routes: &Arc<Routes>| {
            kernel.map(|k| KernelRoutes::adopt(k, routes.clone(), lease)).transpose()
        };
        match (handed, cfg.backend) {
            (
                HandedDataplane { layout: DataplaneLayout::KernelRoutes, .. },
                BackendKind::HostGw,
            ) => {
                let routes = adopt_routes(&routes)?.ok_or(DataplaneError::NoSockets)?;
                Ok(Self::of(Backend::KernelRoutes(routes), None))
            }
            (HandedDataplane { layout: DataplaneLayout::Tunnel(layout), fds }, backend)
                if backend.uses_tun() =>
            {
                let direct = adopt_routes(&routes)?;
                let tunnel = Tunnel::adopt(cfg, routes, HandedTunnel { layout, fds }, lease)?;
                Ok(Self::of(Backend::Tunnel(tunnel), direct))
            }
            (handed, backend) => Err(DataplaneError::Handover(format!(
                "the running weft hands over {}, and this one runs the {backend} backend",
                match handed.layout {
                    DataplaneLayout::Tunnel(_) => "a tunnel",
                    DataplaneLayout::KernelRoutes => "kernel routes",
                }
            ))),
        }
    }

    /// The data plane's descriptors, duplicated, for the next process; this one keeps
    /// forwarding on them until [`Dataplane::quiesce`].
    pub(crate) fn hand_over(&self) -> std::io::Result<HandedDataplane> {
        match &self.backend {
            Backend::Tunnel(t) => {
                let HandedTunnel { layout, fds } = t.hand_over()?;
                Ok(HandedDataplane { layout: DataplaneLayout::Tunnel(layout), fds })
            }
            Backend::KernelRoutes(_) => {
                Ok(HandedDataplane { layout: DataplaneLayout::KernelRoutes, fds: Vec::new() })
            }
        }
    }

    /// Stops forwarding after the step each worker is in, leaving what is queued in the kernel
    /// to whoever reads it next. Blocking (joins the threads).
    pub(crate) fn quiesce(&self) {
        if let Some(k) = self.kernel_routes() {
            k.quiesce();
        }
        match &self.backend {
            Backend::Tunnel(t) => t.quiesce(),
            // Nothing to stop: the kernel forwards, and the routes stay as they are.
            Backend::KernelRoutes(_) => {}
        }
    }

    /// The process this one took over from has stopped reading the descriptors, or there is
    /// none (systemd's fd store): see [`Tunnel::predecessor_released`].
    pub(crate) fn predecessor_released(&self) {
        if let Backend::Tunnel(t) = &self.backend {
            t.predecessor_released();
        }
    }

    /// Forwards again after [`Dataplane::quiesce`] (a handover that failed).
    pub(crate) fn resume(&self) -> Result<(), DataplaneError> {
        if let Some(k) = self.kernel_routes() {
            k.resume();
        }
        match &self.backend {
            Backend::Tunnel(t) => t.resume(),
            Backend::KernelRoutes(_) => Ok(()),
        }
    }

    /// Puts the data plane's metrics on `/metrics` and its say (which worker is down) on
    /// `/readyz`.
    pub(crate) fn register(&self, health: &Health) {
        match &self.backend {
            Backend::Tunnel(t) => {
                health.add_collector(t.counters.clone());
                health.add_collector(t.workers.clone());
                let w = t.workers.clone();
                health.add_check(Box::new(move || w.problem().map_or(Ok(None), Err)));
            }
            Backend::KernelRoutes(_) => {}
        }
        if let Some(k) = self.kernel_routes() {
            health.add_collector(k.stats.clone());
        }
    }

    /// Points the data plane at this host's lease (`None`: no subnet is held, so the device's
    /// address and route are withdrawn). Blocking: call it from a blocking thread.
    pub(crate) fn set_subnet(&self, lease: Option<LeaseName>) -> Result<(), NetlinkError> {
        if let Some(k) = self.kernel_routes() {
            k.set_subnet(lease);
        }
        match &self.backend {
            Backend::Tunnel(t) => t.set_subnet(lease),
            Backend::KernelRoutes(_) => Ok(()),
        }
    }

    /// Sends from, and receives on, `public_ip` from now on (the underlay was renumbered). A
    /// failure leaves the data plane as it was. Blocking.
    pub(crate) fn set_public_ip(
        &self,
        public_ip: std::net::Ipv4Addr,
    ) -> Result<(), DataplaneError> {
        match &self.backend {
            Backend::Tunnel(t) => t.set_public_ip(public_ip)?,
            Backend::KernelRoutes(_) => {}
        }
        if let Some(k) = self.kernel_routes() {
            k.set_public_ip(public_ip);
        }
        Ok(())
    }

    /// A watch of the kernel's notifications about what the data plane set up (the TUN device's
    /// link, addresses and routes; the underlay's routes for kernel routes to peers), so drift
    /// is repaired as it happens. Blocking.
    pub(crate) fn watch_link(&self) -> Result<(KernelWatch, watch::Receiver<u64>), NetlinkError> {
        match (&self.backend, &self.direct) {
            (Backend::Tunnel(t), None) => t.watch_link(),
            (Backend::Tunnel(t), Some(k)) => match k.underlay_index()? {
                Some(underlay) => KernelWatch::links(&[t.device_index()?, underlay]),
                None => KernelWatch::host(),
            },
            (Backend::KernelRoutes(k), _) => k.watch_link(),
        }
    }

    /// Drift repair: reads back what the data plane set up in the kernel and puts back what
    /// someone else changed, each drift logged once. Returns whether a read or a repair is
    /// failing (the caller then tries again within a second). Blocking.
    pub(crate) fn repair_link(&self) -> bool {
        let mut drift = self.drift.lock().unwrap_or_else(PoisonError::into_inner);
        match &self.backend {
            Backend::Tunnel(t) => t.repair_link(&mut drift),
            Backend::KernelRoutes(_) => {}
        }
        let routes_failing = self.kernel_routes().is_some_and(KernelRoutes::repair);
        drift.failing() || routes_failing
    }

    /// Resolves once a worker thread has panicked too often to be restarted: weft should then
    /// stop and be restarted.
    pub(crate) fn given_up(&self) -> impl Future<Output = ()> + Send + 'static {
        let workers = match &self.backend {
            Backend::Tunnel(t) => Some(t.workers.clone()),
            // No thread of weft's forwards: nothing can give up.
            Backend::KernelRoutes(_) => None,
        };
        async move {
            match workers {
                Some(w) => w.wait_given_up().await,
                None => std::future::pending().await,
            }
        }
    }

    /// How many times the data plane's descriptors changed (a re-bind opens new sockets):
    /// what was handed out before is stale once this moves.
    pub(crate) fn generation(&self) -> u64 {
        match &self.backend {
            Backend::Tunnel(t) => t.generation.load(std::sync::atomic::Ordering::Relaxed),
            Backend::KernelRoutes(_) => 0,
        }
    }

    /// Every forwarding thread's loop turns so far, by thread: a count that stops moving is a
    /// thread that makes no progress.
    pub(crate) fn progress(&self) -> Vec<(String, u64)> {
        match &self.backend {
            Backend::Tunnel(t) => t.workers.progress(),
            // No forwarding thread: the kernel forwards.
            Backend::KernelRoutes(_) => Vec::new(),
        }
    }

    /// Whether a worker thread has panicked too often (see [`Dataplane::given_up`]).
    pub(crate) fn has_given_up(&self) -> bool {
        match &self.backend {
            Backend::Tunnel(t) => t.workers.has_given_up(),
            Backend::KernelRoutes(_) => false,
        }
    }

    /// Stops the threads and waits for them; the device closes when its last queue goes (a
    /// non-persistent TUN device then disappears). Kernel routes stay as they are (flannel
    /// leaves them too): the next start adopts them. Blocking.
    pub(crate) fn stop(&self) {
        match &self.backend {
            Backend::Tunnel(t) => t.stop(),
            Backend::KernelRoutes(_) => {}
        }
    }
}
