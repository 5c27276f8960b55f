//! The tunnel data plane: a TUN device whose packets travel to peers inside UDP datagrams
//! (vxlan, udp), or behind an outer IPv4 header on raw IP sockets (ipip). It owns the file descriptors and threads: one TUN queue, one receiving UDP
//! socket and a small pool of sending sockets per worker, each worker on one thread for both
//! directions, or one per direction ([`super::worker`]). The daemon reaches it only through
//! the data plane's front door ([`super::Dataplane`]).
//!
//! Start-up probes every offload once and logs what it found: TUN checksum/TSO/USO
//! (`IFF_VNET_HDR` + `TUNSETOFFLOAD`), UDP GSO (`UDP_SEGMENT`) and GRO (`UDP_GRO`). Each can be
//! switched off by a flag. A GSO send that fails (`EIO`, `EINVAL`, `EMSGSIZE`: the path, not
//! the kernel, refuses it) turns GSO off on that socket for now, and it is tried again later
//! (see [`crate::dataplane::sys::udp`] and [`crate::dataplane::sys::udp::gso_retry`]). Each worker socket is a [`MeteredSocket`],
//! which logs every turn-off (WARN) and recovery (INFO) once and keeps the `udp_gso` gauge and
//! the GSO counters in [`Counters`] up to date.
//!
//! Workers share the port with `SO_REUSEPORT`; the kernel spreads
//! flows over TUN queues and sockets by hash, so one flow stays on one worker. The port is
//! bound on the public IP (the wildcard only when that is no local address), without
//! `SO_REUSEADDR`, so that no other user's socket can bind it beside ours. On a dual-stack
//! network every worker has a second set of sockets, `IPV6_V6ONLY`, bound the same way on the
//! public IPv6 address; a [`FamilySockets`] pairs them, so the loops see one socket.
//!
//! Drift repair ([`Tunnel::repair_link`]): the TUN device's MTU, `IFF_UP`, address and Network
//! route are read back over netlink ([`crate::dataplane::sys::netlink`]) and whatever someone else changed is
//! put back ([`drift`]).
//!
//! VXLAN datagrams leave from sockets on ephemeral ports chosen by the inner flow's hash, so the
//! outer source port differs per flow (RFC 7348 §5) and receivers can spread flows too.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use tracing::{debug, info, warn};

use super::settings::{DataplaneConfig, DataplaneError};
use super::wire::vxlan::Vni;
use super::worker::counters::{Counters, Offload};
use super::worker::supervise::WorkerStates;
use super::worker::{self, FamilySockets, StopSignal, TunIo, UdpIo, WorkerConfig};
use crate::config::BackendKind;
use crate::dataplane::sys::host::KernelWatch;
use crate::dataplane::sys::netlink::{Netlink, NetlinkError, TunStatus};
use crate::dataplane::sys::tun::{self, Tun, TunError, TunOptions};
use crate::dataplane::sys::udp::gso_retry::{GsoRetryConfig, GsoState};
use crate::dataplane::sys::udp::gso_tail::{GsoLimits, TailRule};
use crate::dataplane::sys::udp::{BatchSocket, RecvMeta, Transmit, UdpConfig, UdpError};
use crate::dataplane::transport::wireguard::Devices;
use crate::dataplane::transport::{Forwarder, Ipv6Forwarding, OwnSubnet, OwnSubnet6};
use crate::lease::record::{Ipv6Subnet, LeaseName, Subnet};
use crate::route::Routes;
use crate::time::{BootClock, Instant};

mod drift;

pub(crate) use drift::DriftLog;
use drift::{Repair, WantedLink};

/// The longest a forwarding thread sleeps without looking at its queues (a safety net: the
/// queues' readiness and the stop signal wake it at once; see `worker::Idle`).
const WAKE: Duration = Duration::from_millis(200);
/// The fewest sending sockets (outer source ports) a data plane's workers share.
const TX_POOL: usize = 4;
/// Socket buffers (wireguard-go's 7 MiB).
const SOCKET_BUFFER: usize = 7 << 20;
/// VXLAN's overhead over an IPv6 underlay: outer IPv6 (40), UDP (8), VXLAN (8), inner
/// Ethernet (14). The IPv6 network's route through the TUN device carries the underlay MTU
/// minus this as its path MTU (see `netlink::network_route6`).
const VXLAN6_OVERHEAD: u32 = 70;
/// IPv6's minimum link MTU (RFC 8200): no route gets a lower path MTU.
const IPV6_MIN_MTU: u32 = 1280;

impl TunIo for Tun {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        Tun::read(self, buf)
    }
    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        Tun::write(self, buf)
    }
    fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
        Tun::write_vectored(self, parts)
    }
    fn vnet_hdr(&self) -> bool {
        Tun::vnet_hdr(self)
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

/// The worker threads of one socket binding, and how to stop them.
#[derive(Debug)]
struct Running {
    /// The public IP the sockets were opened for (bound on it, or on the wildcard behind NAT).
    public_ip: Ipv4Addr,
    stop: Arc<StopSignal>,
    threads: Vec<JoinHandle<()>>,
    /// A second descriptor of every worker's sockets: the workers can be stopped and started
    /// again on the same sockets ([`Tunnel::quiesce`], [`Tunnel::resume`]), and the sockets
    /// handed to the next process ([`Tunnel::hand_over`]).
    kept: Vec<WorkerFds>,
}

impl Running {
    fn stop(&mut self) {
        self.stop.stop();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                warn!("a data plane thread ended with a panic outside its supervisor");
            }
        }
    }
}

/// One worker's sockets of one family: the one on the backend port and the pool datagrams
/// leave from.
struct FamilySet {
    rx: BatchSocket,
    tx_pool: Vec<BatchSocket>,
}

/// One worker's sockets: IPv4, IPv6 on a dual-stack network, IPv6 alone on an IPv6-only one.
struct WorkerSockets {
    v4: Option<FamilySet>,
    v6: Option<FamilySet>,
}

/// The descriptors of one worker's sockets of one family.
#[derive(Debug)]
struct FamilyFds {
    rx: OwnedFd,
    tx_pool: Vec<OwnedFd>,
}

/// The descriptors of one worker's sockets ([`WorkerSockets`]).
#[derive(Debug)]
struct WorkerFds {
    v4: Option<FamilyFds>,
    v6: Option<FamilyFds>,
}

impl WorkerSockets {
    fn duplicate(&self) -> io::Result<WorkerFds> {
        let family = |f: &FamilySet| -> io::Result<FamilyFds> {
            Ok(FamilyFds {
                rx: f.rx.duplicate()?,
                tx_pool: f.tx_pool.iter().map(BatchSocket::duplicate).collect::<Result<_, _>>()?,
            })
        };
        Ok(WorkerFds {
            v4: self.v4.as_ref().map(family).transpose()?,
            v6: self.v6.as_ref().map(family).transpose()?,
        })
    }
}

impl WorkerFds {
    fn duplicate(&self) -> io::Result<WorkerFds> {
        let family = |f: &FamilyFds| -> io::Result<FamilyFds> {
            Ok(FamilyFds {
                rx: f.rx.try_clone()?,
                tx_pool: f.tx_pool.iter().map(OwnedFd::try_clone).collect::<Result<_, _>>()?,
            })
        };
        Ok(WorkerFds {
            v4: self.v4.as_ref().map(family).transpose()?,
            v6: self.v6.as_ref().map(family).transpose()?,
        })
    }
}

/// How a tunnel's descriptors are laid out when handed to the next process, and what the next
/// one cannot read back from them: in [`HandedTunnel::fds`], per worker its TUN queue, then
/// (when it has them) its IPv4 receiving socket and pool, then its IPv6 ones.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct TunnelLayout {
    /// The TUN device.
    pub(crate) tun_name: String,
    /// The offloads the device was set up with (`TUNSETOFFLOAD` is left as it is).
    pub(crate) tso: bool,
    /// USO among them.
    pub(crate) uso: bool,
    /// The public IP the sockets are bound for.
    pub(crate) public_ip: Ipv4Addr,
    /// Per worker: the size of its IPv4 and IPv6 sending pools (`None`: no socket of that
    /// family).
    pub(crate) workers: Vec<(Option<usize>, Option<usize>)>,
}

/// A tunnel's descriptors, for the next process ([`Tunnel::hand_over`], [`Tunnel::adopt`]).
#[derive(Debug)]
pub(crate) struct HandedTunnel {
    /// What the descriptors are.
    pub(crate) layout: TunnelLayout,
    /// The descriptors, in the layout's order.
    pub(crate) fds: Vec<OwnedFd>,
}

/// A running data plane. Stops its threads on [`Tunnel::stop`] or drop.
#[derive(Debug)]
pub(crate) struct Tunnel {
    cfg: DataplaneConfig,
    /// One TUN queue per worker; kept across a re-bind ([`Tunnel::set_public_ip`]).
    queues: Vec<Arc<Tun>>,
    /// The device's link, address and route are set and read back through it.
    netlink: Netlink,
    fwd: Forwarder,
    wcfg: WorkerConfig,
    routes: Arc<Routes>,
    running: std::sync::Mutex<Running>,
    own: Arc<OwnSubnet>,
    /// Our IPv6 subnet (unset on an IPv4-only network).
    own6: Arc<OwnSubnet6>,
    /// Counters, for `/metrics`.
    pub(crate) counters: Arc<Counters>,
    /// Which worker threads run, for `/readyz` and `/metrics`; says when weft should exit.
    pub(crate) workers: Arc<WorkerStates>,
    /// How many times the sockets were opened anew ([`Tunnel::set_public_ip`]).
    pub(crate) generation: std::sync::atomic::AtomicU64,
    /// Taken over from another process, and its workers not started yet: wireguard then
    /// starts a handshake with every peer at once ([`Sessions::initiate_all`]).
    handed: std::sync::atomic::AtomicBool,
    /// The process this one took over from has stopped reading the sockets
    /// ([`Tunnel::predecessor_released`]): until then a handshake response could reach it
    /// instead of us, so wireguard's handshakes at a takeover wait for this.
    released: Arc<std::sync::atomic::AtomicBool>,
}

impl Tunnel {
    /// Creates the TUN device (one queue per worker), binds the sockets, probes offloads and
    /// starts the workers. The TUN device gets its address once [`Tunnel::set_subnet`] is
    /// called.
    pub(crate) fn start(cfg: DataplaneConfig, routes: Arc<Routes>) -> Result<Self, DataplaneError> {
        let workers = cfg.workers.max(1);
        // Never attach to a device another process has open (a second weft): create it, with
        // IFF_TUN_EXCL so that one created in the meantime is refused too, or take a
        // persistent one nobody holds.
        let netlink = Netlink::open()?;
        let status = netlink.tun_status(&cfg.tun_name)?;
        match status {
            TunStatus::Attached(queues) => {
                return Err(TunError::InUse { name: cfg.tun_name.clone(), queues }.into());
            }
            TunStatus::NotTun => return Err(TunError::NotTun(cfg.tun_name.clone()).into()),
            TunStatus::Absent | TunStatus::Detached => {}
        }
        let opts = TunOptions {
            multi_queue: workers > 1,
            vnet_hdr: cfg.tun_offload,
            exclusive: status == TunStatus::Absent,
        };
        let mut queues = Vec::with_capacity(workers);
        let mut offloads = tun::TunOffloads::default();
        for i in 0..workers {
            let q = Tun::open(
                &cfg.tun_name,
                TunOptions { exclusive: opts.exclusive && i == 0, ..opts },
            )?;
            if cfg.tun_offload {
                offloads = q.enable_offloads(true);
            }
            queues.push(Arc::new(q));
        }
        let name = queues[0].name().to_owned();
        netlink.set_mtu(&name, tun_mtu(&cfg))?;
        netlink.set_up(&name)?;
        let (bound_on, sockets) = open_sockets(&cfg, cfg.public_ip, workers)?;
        Self::build(cfg, routes, netlink, queues, offloads, bound_on, sockets, None)
    }

    /// Takes over a tunnel another process (or this one's previous image) handed over
    /// ([`Tunnel::hand_over`]): its TUN queues and sockets as they are (the device keeps its
    /// MTU, address and routes; drift repair puts back what `cfg` wants otherwise), forwarding
    /// for `lease` from the first packet.
    pub(crate) fn adopt(
        cfg: DataplaneConfig,
        routes: Arc<Routes>,
        handed: HandedTunnel,
        lease: Option<LeaseName>,
    ) -> Result<Self, DataplaneError> {
        let HandedTunnel { layout, fds } = handed;
        let wanted: usize = layout
            .workers
            .iter()
            .map(|(v4, v6)| 1 + v4.map_or(0, |n| n + 1) + v6.map_or(0, |n| n + 1))
            .sum();
        if layout.workers.is_empty() || wanted != fds.len() {
            return Err(DataplaneError::Handover(format!(
                "{} descriptors for a layout of {wanted}",
                fds.len()
            )));
        }
        let netlink = Netlink::open()?;
        let mut fds = fds.into_iter();
        let mut queues = Vec::with_capacity(layout.workers.len());
        let mut sockets = Vec::with_capacity(layout.workers.len());
        for &(v4, v6) in &layout.workers {
            // Counted above: every take below has its descriptor.
            let mut next = || fds.next().ok_or(DataplaneError::NoSockets);
            let tun = Tun::adopt(next()?)?;
            if tun.name() != cfg.tun_name {
                return Err(DataplaneError::Handover(format!(
                    "the handed TUN device is {}, not --tun-name {}",
                    tun.name(),
                    cfg.tun_name
                )));
            }
            if tun.vnet_hdr() != cfg.tun_offload {
                warn!(
                    tun = tun.name(),
                    vnet_hdr = tun.vnet_hdr(),
                    "the handed TUN device's offloads differ from --tun-offload; kept as they are until the device is made again"
                );
            }
            queues.push(Arc::new(tun));
            let mut family = |pool: Option<usize>| {
                pool.map(|n| -> Result<FamilySet, DataplaneError> {
                    let (rx_cfg, tx_cfg) = adopted_configs(&cfg, layout.workers.len());
                    let rx = BatchSocket::adopt(next()?, rx_cfg)?;
                    let tx_pool = (0..n)
                        .map(|_| Ok(BatchSocket::adopt(next()?, tx_cfg)?))
                        .collect::<Result<Vec<_>, DataplaneError>>()?;
                    Ok(FamilySet { rx, tx_pool })
                })
                .transpose()
            };
            let v4 = family(v4)?;
            let v6 = family(v6)?;
            sockets.push(WorkerSockets { v4, v6 });
        }
        let offloads = tun::TunOffloads { tso: layout.tso, uso: layout.uso };
        let bound_on = BoundOn {
            public_ip: layout.public_ip,
            v4: sockets.first().and_then(|w| w.v4.as_ref()).map(|f| f.rx.local_addr().ip()),
            v6: sockets.first().and_then(|w| w.v6.as_ref()).map(|f| f.rx.local_addr().ip()),
        };
        Self::build(cfg, routes, netlink, queues, offloads, bound_on, sockets, lease)
    }

    /// The descriptors of this tunnel, duplicated, for the next process: it forwards on the
    /// same TUN queues and sockets, so nothing queued in them is lost. This tunnel keeps
    /// forwarding until [`Tunnel::quiesce`].
    pub(crate) fn hand_over(&self) -> io::Result<HandedTunnel> {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let mut fds = Vec::new();
        let mut workers = Vec::with_capacity(self.queues.len());
        for (tun, kept) in self.queues.iter().zip(&running.kept) {
            fds.push(tun.duplicate()?);
            let WorkerFds { v4, v6 } = kept.duplicate()?;
            let mut pool = |f: Option<FamilyFds>| {
                f.map(|f| {
                    let n = f.tx_pool.len();
                    fds.push(f.rx);
                    fds.extend(f.tx_pool);
                    n
                })
            };
            let v4 = pool(v4);
            let v6 = pool(v6);
            workers.push((v4, v6));
        }
        Ok(HandedTunnel {
            layout: TunnelLayout {
                tun_name: self.cfg.tun_name.clone(),
                tso: self.wcfg.gro_tcp,
                uso: self.wcfg.gro_udp,
                public_ip: running.public_ip,
                workers,
            },
            fds,
        })
    }

    /// Stops the workers after the step each is in, leaving what is queued in the TUN queues
    /// and sockets to whoever reads them next (the next process, or [`Tunnel::resume`]).
    pub(crate) fn quiesce(&self) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).stop();
    }

    /// Starts the workers again on the same sockets after [`Tunnel::quiesce`] (a handover that
    /// failed).
    pub(crate) fn resume(&self) -> Result<(), DataplaneError> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if !running.threads.is_empty() {
            return Ok(());
        }
        let workers = running.kept.len();
        let mut sockets = Vec::with_capacity(workers);
        for kept in &running.kept {
            let WorkerFds { v4, v6 } = kept.duplicate().map_err(DataplaneError::Thread)?;
            let family = |f: Option<FamilyFds>| {
                f.map(|f| -> Result<FamilySet, DataplaneError> {
                    let (rx_cfg, tx_cfg) = adopted_configs(&self.cfg, workers);
                    Ok(FamilySet {
                        rx: BatchSocket::adopt(f.rx, rx_cfg)?,
                        tx_pool: f
                            .tx_pool
                            .into_iter()
                            .map(|fd| BatchSocket::adopt(fd, tx_cfg))
                            .collect::<Result<_, _>>()?,
                    })
                })
                .transpose()
            };
            sockets.push(WorkerSockets { v4: family(v4)?, v6: family(v6)? });
        }
        *running = self.spawn_workers(running.public_ip, sockets)?;
        Ok(())
    }

    /// The rest of [`Tunnel::start`] and [`Tunnel::adopt`]: the forwarder, the counters, the
    /// log line, the workers.
    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: DataplaneConfig,
        routes: Arc<Routes>,
        netlink: Netlink,
        queues: Vec<Arc<Tun>>,
        offloads: tun::TunOffloads,
        bound_on: BoundOn,
        sockets: Vec<WorkerSockets>,
        lease: Option<LeaseName>,
    ) -> Result<Self, DataplaneError> {
        let vni = Vni::new(cfg.vni).map_err(|_| DataplaneError::BadVni(cfg.vni))?;
        let workers = queues.len();
        let name = queues.first().map_or_else(|| cfg.tun_name.clone(), |q| q.name().to_owned());
        let mtu = tun_mtu(&cfg);
        let wireguard = match (&cfg.wireguard, cfg.backend) {
            (Some(wg), BackendKind::Wireguard) => Some(Arc::new(Devices::new(
                &wg.private_key,
                wg.psk,
                wg.keepalive,
                u16::try_from(mtu).unwrap_or(u16::MAX),
                cfg.port,
                cfg.ipv6.map(|_| wg.port6),
            ))),
            (None, BackendKind::Wireguard) => return Err(DataplaneError::NoWireguardKey),
            _ => None,
        };
        let fwd = Forwarder {
            backend: cfg.backend,
            vni,
            port: cfg.port,
            our_mac: cfg.our_mac,
            own: Arc::new(OwnSubnet::default()),
            // An IPv6-only network routes no IPv4 into the device: nothing to answer for.
            icmp_source: cfg.network.map_or(Ipv4Addr::UNSPECIFIED, |n| n.network()),
            icmp_limit: Arc::default(),
            malformed: Arc::default(),
            wireguard,
            ipv6: match cfg.ipv6 {
                Some(v6) => {
                    Ipv6Forwarding { own: Arc::default(), icmp_source: v6.network.network() }
                }
                None => Ipv6Forwarding::default(),
            },
        };
        let wcfg = WorkerConfig {
            batch: if cfg.batching { crate::dataplane::sys::udp::MAX_BATCH } else { 1 },
            wake: WAKE,
            gro_tcp: cfg.tun_offload && offloads.tso,
            gro_udp: cfg.tun_offload && offloads.uso,
            one_thread: cfg.one_thread,
            spin: cfg.spin,
            slice: cfg.worker_slice,
        };
        let counters = Arc::new(Counters::default());
        if let Some(WorkerSockets { v4, v6 }) = sockets.first()
            && let Some(first) = v4.as_ref().or(v6.as_ref())
        {
            for (offload, on) in [
                (Offload::TunTso, wcfg.gro_tcp),
                (Offload::TunUso, wcfg.gro_udp),
                (Offload::UdpGso, first.tx_pool.first().is_some_and(BatchSocket::gso_enabled)),
                (Offload::UdpGro, first.rx.capabilities().gro),
            ] {
                counters.set_offload(offload, on);
            }
            info!(
                tun = %name,
                mtu,
                workers,
                tun_vnet_hdr = cfg.tun_offload,
                tun_tso = offloads.tso,
                tun_uso = offloads.uso,
                udp_gso = first.tx_pool.first().is_some_and(|s| s.capabilities().gso),
                gso_retry_after = ?cfg.udp_gso.retry_after,
                gso_never_equal_tail = cfg.udp_gso.never_equal_tail,
                udp_gro = first.rx.capabilities().gro,
                batch = wcfg.batch,
                port = cfg.port,
                bound_on = bound_on.v4.map(|a| a.to_string()),
                bound_on_ipv6 = bound_on.v6.map(|a| a.to_string()),
                ipv6_udp_gso = v6.as_ref().map(|s| s.tx_pool.iter().all(BatchSocket::gso_enabled)),
                ipv6_udp_gro = v6.as_ref().map(|s| s.rx.capabilities().gro),
                backend = cfg.backend.as_str(),
                "data plane up"
            );
        }
        let own = fwd.own.clone();
        let own6 = fwd.ipv6.own.clone();
        if let Some(lease) = lease {
            // Handed over: forward for the subnet at once; the device already has its address.
            own.set(Some(lease.subnet).filter(|s| s.v4().is_some()));
            own6.set(lease.ipv6.filter(|_| cfg.ipv6.is_some()));
        }
        let dp = Self {
            cfg,
            queues,
            netlink,
            fwd,
            wcfg,
            routes,
            running: std::sync::Mutex::new(Running {
                public_ip: bound_on.public_ip,
                stop: StopSignal::new(),
                threads: Vec::new(),
                kept: Vec::new(),
            }),
            own,
            own6,
            counters,
            workers: Arc::new(WorkerStates::default()),
            generation: std::sync::atomic::AtomicU64::new(0),
            handed: std::sync::atomic::AtomicBool::new(lease.is_some()),
            released: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        };
        let running = dp.spawn_workers(bound_on.public_ip, sockets)?;
        *dp.running.lock().unwrap_or_else(|e| e.into_inner()) = running;
        Ok(dp)
    }

    /// Starts one supervised worker per TUN queue on `sockets`.
    fn spawn_workers(
        &self,
        bound_on: Ipv4Addr,
        sockets: Vec<WorkerSockets>,
    ) -> Result<Running, DataplaneError> {
        let kept = sockets
            .iter()
            .map(WorkerSockets::duplicate)
            .collect::<io::Result<Vec<_>>>()
            .map_err(DataplaneError::Thread)?;
        let mut running = Running {
            public_ip: bound_on,
            stop: StopSignal::new(),
            threads: Vec::with_capacity(self.queues.len() * 2),
            kept,
        };
        let metered = |sock| MeteredSocket::new(sock, self.counters.clone());
        if let Some(wg) = &self.fwd.wireguard {
            let initiate = self.handed.swap(false, Ordering::Relaxed);
            self.spawn_wireguard_timers(wg, &sockets, &mut running, initiate)?;
        }
        for (i, (tun, sockets)) in self.queues.iter().zip(sockets).enumerate() {
            let WorkerSockets { v4, v6 } = sockets;
            let (rx6, mut pool6) = match v6 {
                Some(s) => (Some(metered(s.rx)), s.tx_pool.into_iter()),
                None => (None, Vec::new().into_iter()),
            };
            // Pool socket k of each family is paired: one flow keeps one socket per family.
            let (tx_pool, rx) = match (v4, rx6) {
                (Some(v4), rx6) => (
                    v4.tx_pool
                        .into_iter()
                        .map(|s| FamilySockets::new(metered(s), pool6.next().map(metered)))
                        .collect(),
                    FamilySockets::new(metered(v4.rx), rx6),
                ),
                (None, Some(rx6)) => (
                    pool6.map(|s| FamilySockets::ipv6_only(metered(s))).collect(),
                    FamilySockets::ipv6_only(rx6),
                ),
                (None, None) => return Err(DataplaneError::NoSockets),
            };
            let spawned = worker::Worker {
                tun: tun.clone(),
                tx_pool,
                rx,
                fwd: self.fwd.clone(),
                routes: self.routes.clone(),
                counters: self.counters.clone(),
                cfg: self.wcfg,
                clock: Arc::new(BootClock),
                states: self.workers.clone(),
            }
            .spawn(&format!("weft-q{i}"), running.stop.clone());
            match spawned {
                Ok(handles) => running.threads.extend(handles),
                Err(e) => {
                    running.stop();
                    return Err(DataplaneError::Thread(e));
                }
            }
        }
        Ok(running)
    }

    /// wireguard: gives the devices the route table's peers now (so that the workers' first
    /// packets find them), and starts the thread that keeps them following the table and ticks
    /// their timers (handshake retries, rekeys, keepalives), sending from second descriptors
    /// of the first worker's sockets on the listen ports (one per underlay family). It stops
    /// with the workers.
    /// The process this one took over from has stopped reading the sockets (or there is none:
    /// descriptors from systemd's fd store): a wireguard takeover's handshakes may start.
    pub(crate) fn predecessor_released(&self) {
        self.released.store(true, Ordering::Release);
    }

    fn spawn_wireguard_timers(
        &self,
        wg: &Arc<Devices>,
        sockets: &[WorkerSockets],
        running: &mut Running,
        initiate: bool,
    ) -> Result<(), DataplaneError> {
        wg.set_peers_of(&self.routes.load());
        let Some(first) = sockets.first() else {
            return Err(DataplaneError::NoSockets);
        };
        let (_, tx_cfg) = adopted_configs(&self.cfg, self.queues.len());
        let second = |family: Option<&FamilySet>| -> Result<Option<BatchSocket>, DataplaneError> {
            let Some(family) = family else { return Ok(None) };
            let fd = family.rx.duplicate().map_err(DataplaneError::Thread)?;
            Ok(Some(BatchSocket::adopt(fd, UdpConfig { gso: false, ..tx_cfg })?))
        };
        let sock = match (second(first.v4.as_ref())?, second(first.v6.as_ref())?) {
            (Some(v4), v6) => FamilySockets::new(v4, v6),
            (None, Some(v6)) => FamilySockets::ipv6_only(v6),
            (None, None) => return Err(DataplaneError::NoSockets),
        };
        let (wg, routes, stop) = (wg.clone(), self.routes.clone(), running.stop.clone());
        let released = self.released.clone();
        let counters = self.counters.clone();
        let thread = std::thread::Builder::new()
            .name("weft-wg-timers".to_owned())
            .spawn(move || {
                let counters = counters.thread("weft-wg-timers");
                let mut sock = sock;
                let initiate = initiate.then_some(&*released);
                worker::run_wireguard_timers(
                    &wg, &routes, &mut sock, &BootClock, &stop, &counters, initiate,
                );
            })
            .map_err(DataplaneError::Thread)?;
        running.threads.push(thread);
        Ok(())
    }

    /// Re-binds every socket on `public_ip` (the underlay address changed): the new sockets
    /// are opened first, so a failure leaves the old ones forwarding; then the workers are
    /// restarted on them, keeping their TUN queues (packets queued meanwhile wait in the TUN
    /// device). Datagrams always leave from the address published as `PublicIP`.
    pub(crate) fn set_public_ip(&self, public_ip: Ipv4Addr) -> Result<(), DataplaneError> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running.public_ip == public_ip {
            return Ok(());
        }
        let (bound_on, sockets) = open_sockets(&self.cfg, public_ip, self.queues.len())?;
        let old = running.public_ip;
        running.stop();
        *running = self.spawn_workers(public_ip, sockets)?;
        self.generation.fetch_add(1, Ordering::Relaxed);
        info!(old = %old, new = ?bound_on.v4, port = self.cfg.port, "data plane sockets re-bound");
        Ok(())
    }

    /// Points the data plane at this host's lease: the TUN device gets `<subnet>.0/32` and a
    /// route for the whole network, and received packets for that subnet are delivered. On a
    /// dual-stack network the same for the IPv6 half: `<v6 subnet>::/128` (the previous half's
    /// address removed) and a route for the IPv6 network, with the path MTU of VXLAN over IPv6.
    pub(crate) fn set_subnet(&self, lease: Option<LeaseName>) -> Result<(), NetlinkError> {
        let dev = self.cfg.tun_name.as_str();
        let old = self.own.get();
        let old6 = self.own6.get();
        // An IPv6-only lease has no IPv4 subnet: no IPv4 address, route or delivery.
        let subnet = lease.map(|l| l.subnet).filter(|s| s.v4().is_some());
        // An IPv6 half is carried only when the underlay has IPv6 (it always has on a
        // dual-stack vxlan network: the daemon refuses to start without it).
        let subnet6 = lease.and_then(|l| l.ipv6).filter(|_| self.cfg.ipv6.is_some());
        // Set before the device is addressed, as for IPv4: should addressing fail, drift
        // repair (which wants what these say) puts the address and route in place later.
        self.own.set(subnet);
        self.own6.set(subnet6);
        // No subnet held any more (an identity clash: another process of this node ID holds
        // it): withdraw the address and the route, so that this host no longer draws the
        // overlay's traffic for a subnet it does not hold.
        if lease.is_none() {
            if let (Some(s), Some(network)) = (old.and_then(Subnet::v4), self.cfg.network) {
                let addr = tun_address(s);
                self.netlink.remove_route(dev, IpNet::V4(network))?;
                self.netlink.remove_address(dev, IpNet::V4(addr))?;
                warn!(tun = %dev, %addr, %network, "withdrew the address and the route: no subnet is held");
            }
            if let (Some(s6), Some(v6)) = (old6, self.cfg.ipv6) {
                let addr = tun_address6(s6);
                self.netlink.remove_route(dev, IpNet::V6(v6.network))?;
                self.netlink.remove_address(dev, IpNet::V6(addr))?;
                warn!(tun = %dev, %addr, network = %v6.network, "withdrew the IPv6 address and route: no subnet is held");
            }
            return Ok(());
        }
        if let (Some(s), Some(network)) = (subnet.and_then(Subnet::v4), self.cfg.network)
            && old != subnet
        {
            let addr = tun_address(s);
            self.netlink.set_ipv4(dev, addr)?;
            self.netlink.set_up(dev)?;
            self.netlink.add_route(dev, network)?;
            info!(tun = %dev, %addr, %network, "TUN addressed");
        }
        if let (Some(s6), Some(v6)) = (subnet6, self.cfg.ipv6)
            && old6 != Some(s6)
        {
            let addr = tun_address6(s6);
            self.netlink.set_ipv6(dev, addr, old6.map(tun_address6))?;
            let mtu = self.route6_mtu();
            self.netlink.add_route6(dev, v6.network, mtu)?;
            info!(tun = %dev, %addr, network = %v6.network, path_mtu = mtu, "TUN addressed (IPv6)");
        }
        Ok(())
    }

    /// The path MTU of the IPv6 network's route: the underlay's minus VXLAN's overhead over
    /// IPv6, at most the TUN device's and never below IPv6's minimum.
    fn route6_mtu(&self) -> u32 {
        let over_ipv6 = self.cfg.underlay_mtu.saturating_sub(VXLAN6_OVERHEAD);
        over_ipv6.min(tun_mtu(&self.cfg)).max(IPV6_MIN_MTU)
    }

    /// Starts a watch of the kernel's notifications about the TUN device (its link, addresses
    /// and the routes through it), so that drift is repaired as it happens
    /// ([`crate::dataplane::sys::link_watch`]). Blocking (one netlink request): call it from a blocking thread.
    pub(crate) fn watch_link(
        &self,
    ) -> Result<(KernelWatch, tokio::sync::watch::Receiver<u64>), NetlinkError> {
        KernelWatch::links(&[self.device_index()?])
    }

    /// The TUN device's interface index. Blocking (one netlink request).
    pub(crate) fn device_index(&self) -> Result<u32, NetlinkError> {
        self.netlink.index_of(&self.cfg.tun_name)
    }

    /// The TUN device's link state as weft set it up: the MTU of [`Tunnel::start`], and
    /// while a subnet is held the address and route of [`Tunnel::set_subnet`].
    pub(crate) fn wanted_link(&self) -> WantedLink {
        let address = self.own.get().and_then(Subnet::v4).map(tun_address);
        let address6 = self.own6.get().map(tun_address6);
        let route6 =
            self.cfg.ipv6.filter(|_| address6.is_some()).map(|v6| (v6.network, self.route6_mtu()));
        WantedLink {
            mtu: tun_mtu(&self.cfg),
            address,
            route: address.and(self.cfg.network),
            address6,
            route6,
        }
    }

    /// Drift repair: reads the TUN device's link state, puts back whatever someone else changed
    /// ([`drift::plan`]), counts each repair in `weft_dataplane_link_repairs_total` and logs it
    /// at WARN, once per drift event as `drift` decides (a failing repair is logged once, then
    /// retried quietly at each call). Blocking (netlink requests, each answered within
    /// [`crate::dataplane::sys::netlink::REPLY_TIMEOUT`]): call it from a blocking thread.
    pub(crate) fn repair_link(&self, drift: &mut DriftLog) {
        let dev = self.cfg.tun_name.as_str();
        let seen = match self.netlink.observe_link(dev, self.cfg.ipv6.is_some()) {
            Ok(seen) => {
                if drift.observed() {
                    info!(tun = %dev, "reading the TUN device's link state works again");
                }
                seen
            }
            Err(e) => {
                if drift.observe_failed() {
                    let why = "cannot read the TUN device's link state to repair drift";
                    warn!(tun = %dev, error = %e, "{why}; retrying every second");
                }
                return;
            }
        };
        let repairs = drift::plan(&self.wanted_link(), &seen);
        for what in drift.settle(&repairs) {
            let what = what.label();
            info!(tun = %dev, what, "a drift weft could not repair was put right by someone else");
        }
        for repair in &repairs {
            let what = repair.kind().label();
            match self.apply_repair(repair) {
                Ok(()) => {
                    self.counters.count_link_repair(repair.kind());
                    let after_failing = drift.repaired(repair.kind());
                    let line = repair.repaired_line(dev);
                    warn!(tun = %dev, what, after_failing, "{line}");
                }
                Err(e) => {
                    if drift.failed(repair.kind()) {
                        let line = repair.failed_line(dev);
                        warn!(tun = %dev, what, error = %e, "{line}; retrying every second");
                    }
                }
            }
        }
    }

    fn apply_repair(&self, repair: &Repair) -> Result<(), NetlinkError> {
        let dev = self.cfg.tun_name.as_str();
        match repair {
            Repair::SetMtu { want, .. } => self.netlink.set_mtu(dev, *want),
            Repair::SetUp => self.netlink.set_up(dev),
            Repair::SetAddress { want, .. } => self.netlink.set_ipv4(dev, *want),
            Repair::AddRoute { network } => self.netlink.add_route(dev, *network),
            Repair::AddAddress6 { want } => self.netlink.set_ipv6(dev, *want, None),
            Repair::AddRoute6 { network, mtu } => self.netlink.add_route6(dev, *network, *mtu),
        }
    }

    /// Stops the threads and waits for them; the device closes when the last queue goes (a
    /// non-persistent TUN device then disappears).
    pub(crate) fn stop(&self) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).stop();
    }
}

/// Where [`open_sockets`] bound: the public IP asked for, and the addresses the sockets are
/// bound on (the public IPs, or the wildcard of their family behind NAT).
#[derive(Clone, Copy, Debug)]
struct BoundOn {
    public_ip: Ipv4Addr,
    v4: Option<IpAddr>,
    v6: Option<IpAddr>,
}

/// Opens `workers` sets of sockets for `public_ip` (and, on a dual-stack network, for the
/// configured public IPv6 address); returns the addresses they are bound on.
///
/// The backend port is bound on the public IP, where peers send, and only when that is no
/// local address (behind NAT, `--public-ip` naming the NAT's address) on the wildcard; the
/// sending sockets are bound on the same address, so that every datagram leaves from the
/// address peers know. Without SO_REUSEADDR no other socket can bind the port beside ours;
/// SO_REUSEPORT joins our workers' sockets into one group, which Linux opens only to sockets of
/// the same effective UID (so run weft under a UID of its own; a root process can always take
/// the port). The IPv6 sockets are bound the same way on the public IPv6 address, and are
/// `IPV6_V6ONLY`, so that the two families' sockets share the port without sharing datagrams.
fn open_sockets(
    cfg: &DataplaneConfig,
    public_ip: Ipv4Addr,
    workers: usize,
) -> Result<(BoundOn, Vec<WorkerSockets>), DataplaneError> {
    // An IPv6-only network opens no IPv4 socket: there is no IPv4 underlay to carry.
    let v4 = cfg.network.map(|_| bind_address(cfg, IpAddr::V4(public_ip)));
    let v6 = cfg.ipv6.map(|v6| bind_address(cfg, IpAddr::V6(v6.public_ip)));
    let mut sockets: Vec<WorkerSockets> = Vec::with_capacity(workers);
    for i in 0..workers {
        let first = sockets.first();
        let v4_pool = first.and_then(|w| w.v4.as_ref()).map(|f| f.tx_pool.as_slice());
        let v6_pool = first.and_then(|w| w.v6.as_ref()).map(|f| f.tx_pool.as_slice());
        let w = WorkerSockets {
            v4: v4.map(|a| open_family(cfg, a, i, workers, v4_pool)).transpose()?,
            v6: v6.map(|a| open_family(cfg, a, i, workers, v6_pool)).transpose()?,
        };
        sockets.push(w);
    }
    Ok((BoundOn { public_ip, v4, v6 }, sockets))
}

/// The address to bind for `public_ip`: itself when it is a local address, else (NAT) the
/// wildcard of its family, said at WARN.
fn bind_address(cfg: &DataplaneConfig, public_ip: IpAddr) -> IpAddr {
    match BatchSocket::open(UdpConfig::new(SocketAddr::new(public_ip, 0))) {
        Err(UdpError::Bind { source, .. }) if source.kind() == io::ErrorKind::AddrNotAvailable => {
            warn!(%public_ip, port = cfg.port, "the public IP is no local address (NAT?): receiving on every address, sending from the one the kernel picks");
            match public_ip {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            }
        }
        _ => public_ip,
    }
}

/// How one worker's sockets of one family are set up, bound on `bind_on`: the backend port's
/// and the sending pool's.
fn family_configs(
    cfg: &DataplaneConfig,
    bind_on: IpAddr,
    workers: usize,
) -> (UdpConfig, UdpConfig) {
    let gso_retry = GsoRetryConfig::new(cfg.udp_gso.retry_after);
    let rx_cfg = UdpConfig {
        bind: SocketAddr::new(bind_on, cfg.port),
        reuse_port: workers > 1,
        gso: false,
        gro: cfg.udp_gro,
        gso_retry,
        gso_tail: TailRule::Any,
        buffer_bytes: SOCKET_BUFFER,
    };
    let tx_cfg = UdpConfig {
        bind: SocketAddr::new(bind_on, 0),
        reuse_port: false,
        gso: cfg.udp_gso.on,
        gro: false,
        gso_retry,
        gso_tail: if cfg.udp_gso.never_equal_tail { TailRule::NeverEqual } else { TailRule::Any },
        buffer_bytes: SOCKET_BUFFER,
    };
    (rx_cfg, tx_cfg)
}

/// [`family_configs`] for sockets that are adopted, not opened: each keeps its own binding
/// and buffers, and the rest (GSO, GRO, the GSO retry) is as for a socket opened now.
fn adopted_configs(cfg: &DataplaneConfig, workers: usize) -> (UdpConfig, UdpConfig) {
    family_configs(cfg, IpAddr::V4(Ipv4Addr::UNSPECIFIED), workers)
}

/// Worker `worker`'s sockets (of `workers`) bound on `bind_on`: the backend port's and the
/// sending pool. For ipip, raw IP sockets: one receiving (protocol 4, spread over the workers
/// by a BPF filter, see [`BatchSocket::open_ipip_rx`]) and one sending, as raw IP has no
/// source port to spread flows by.
///
/// Every worker sends from the same ports (`shared`: the first worker's pool), so a
/// flow's outer source port is the same whichever worker reads it from TUN. With a pool per
/// worker a flow that moved between TUN queues changed its outer 5-tuple, the peer received it
/// on another worker, whose writes moved the reverse flow, which moved this one back: flows
/// that kept moving between workers mid-stream, and reordered every time (docs/dataplane.md).
fn open_family(
    cfg: &DataplaneConfig,
    bind_on: IpAddr,
    worker: usize,
    workers: usize,
    shared: Option<&[BatchSocket]>,
) -> Result<FamilySet, UdpError> {
    if cfg.backend == BackendKind::Ipip {
        let IpAddr::V4(bind) = bind_on else {
            return Err(UdpError::Socket(io::Error::new(
                io::ErrorKind::Unsupported,
                "the ipip backend carries IPv4 only",
            )));
        };
        return Ok(FamilySet {
            rx: BatchSocket::open_ipip_rx(bind, worker, workers, SOCKET_BUFFER)?,
            tx_pool: vec![BatchSocket::open_ipip_tx(bind, SOCKET_BUFFER)?],
        });
    }
    let (rx_cfg, tx_cfg) = family_configs(cfg, bind_on, workers);
    if let (BackendKind::Wireguard, Some(wg)) = (cfg.backend, &cfg.wireguard) {
        // The IPv6 underlay's device listens on ListenPortV6 (flannel's `flannel-wg-v6`).
        let port = if bind_on.is_ipv6() { wg.port6 } else { cfg.port };
        let rx_cfg = UdpConfig { bind: SocketAddr::new(bind_on, port), ..rx_cfg };
        // One socket, on the listen port, both ways: WireGuard peers send to the address a
        // datagram came from (the kernel's and wireguard-go's endpoints roam), so datagrams
        // must leave from the port they are received on. The sending half is a second
        // descriptor of it, with GSO.
        let rx = BatchSocket::open(rx_cfg)?;
        let tx = BatchSocket::adopt(rx.duplicate().map_err(UdpError::Socket)?, tx_cfg)?;
        return Ok(FamilySet { rx, tx_pool: vec![tx] });
    }
    // Sockets of their own on the same ports (SO_REUSEPORT, so same user only), not
    // duplicated descriptors: systemd's fd store keeps one descriptor per open socket and
    // would drop the duplicates, and the next process could not adopt the layout.
    let tx_cfg = UdpConfig { reuse_port: workers > 1, ..tx_cfg };
    let tx_pool = match shared {
        Some(pool) => pool
            .iter()
            .map(|s| BatchSocket::open(UdpConfig { bind: s.local_addr(), ..tx_cfg }))
            .collect::<Result<Vec<_>, _>>()?,
        None => (0..tx_pool_size(workers))
            .map(|_| BatchSocket::open(tx_cfg))
            .collect::<Result<Vec<_>, _>>()?,
    };
    Ok(FamilySet { rx: BatchSocket::open(rx_cfg)?, tx_pool })
}

/// The sending sockets the workers share: two per worker, at least [`TX_POOL`], so that a
/// peer's `SO_REUSEPORT` has source ports enough to spread the flows over all its workers.
fn tx_pool_size(workers: usize) -> usize {
    (2 * workers).max(TX_POOL)
}

/// The TUN device's MTU: the underlay's minus the encapsulation overhead, never below 576.
fn tun_mtu(cfg: &DataplaneConfig) -> u32 {
    cfg.underlay_mtu.saturating_sub(cfg.overhead).max(576)
}

/// The TUN device's address for `subnet`: `<subnet>.0/32`.
fn tun_address(subnet: Ipv4Net) -> Ipv4Net {
    Ipv4Net::new(subnet.network(), 32).unwrap_or(subnet)
}

/// The TUN device's IPv6 address for `subnet`: `<subnet>::/128`, as flannel addresses its
/// `flannel-v6.<VNI>` device.
fn tun_address6(subnet: Ipv6Subnet) -> Ipv6Net {
    Ipv6Net::new(subnet.network(), 128).unwrap_or_else(|_| subnet.net())
}

impl std::ops::Drop for Tunnel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A worker's UDP socket: a [`BatchSocket`] whose GSO turn-offs, retries and recoveries are
/// counted in [`Counters`] (`weft_dataplane_gso_fallbacks_total`, `_gso_reprobes_total`, and
/// the `udp_gso` gauge through [`Counters::gso_off_sockets`]) and logged: each turn-off once at
/// WARN, each recovery once at INFO. After every send it compares three of the socket's
/// counters with what it saw last; everything else runs only when one moved.
#[derive(Debug)]
pub(crate) struct MeteredSocket {
    sock: BatchSocket,
    counters: Arc<Counters>,
    /// The socket's GSO fallbacks, retries and recoveries when last looked at.
    seen: (u64, u64, u64),
    /// Whether this socket is counted in [`Counters::gso_off_sockets`].
    counted_off: bool,
    /// The socket's GSO tail counts (pads, singles, equal tails) when last added to `counters`.
    seen_tails: [u64; 3],
}

impl MeteredSocket {
    /// Wraps `sock`, reporting to `counters`.
    pub(crate) fn new(sock: BatchSocket, counters: Arc<Counters>) -> Self {
        Self { sock, counters, seen: (0, 0, 0), counted_off: false, seen_tails: [0; 3] }
    }

    /// Adds what the socket's GSO tail counts moved since the last look to `counters`.
    fn count_tails(&mut self) {
        let s = self.sock.stats();
        let now = [s.gso_tail_pads, s.gso_tail_singles, s.gso_equal_tails];
        if now != self.seen_tails {
            let t = &self.counters.gso_tails;
            for (i, c) in [&t.pads, &t.singles, &t.equal_tails].into_iter().enumerate() {
                c.fetch_add(now[i].saturating_sub(self.seen_tails[i]), Ordering::Relaxed);
            }
            self.seen_tails = now;
        }
    }

    /// The socket.
    #[cfg(test)]
    pub(crate) fn socket(&self) -> &BatchSocket {
        &self.sock
    }

    fn gso_events(&self) -> (u64, u64, u64) {
        let s = self.sock.stats();
        (s.gso_fallbacks, s.gso_retries, s.gso_recoveries)
    }

    /// Counts and logs what changed in the socket's GSO since the last look, at `now`.
    #[cold]
    fn report(&mut self, now: Instant) {
        let (fallbacks, retries, recoveries) = self.gso_events();
        let (seen_fallbacks, seen_retries, seen_recoveries) = self.seen;
        self.seen = (fallbacks, retries, recoveries);
        let c = &self.counters;
        c.gso_fallbacks.fetch_add(fallbacks.saturating_sub(seen_fallbacks), Ordering::Relaxed);
        c.gso_reprobes.fetch_add(retries.saturating_sub(seen_retries), Ordering::Relaxed);
        let local = self.sock.local_addr();
        let state = self.sock.gso_state();
        if retries > seen_retries {
            debug!(socket = %local, "trying UDP GSO again");
        }
        // After a failure GSO stays off until its retry time, so this logs each turn-off once.
        if fallbacks > seen_fallbacks
            && let Some(GsoState::Off { until }) = state
        {
            let retry_in = humantime::format_duration(until.saturating_since(now));
            let (to, errno) = self
                .sock
                .stats()
                .gso_last_failure
                .map_or((String::from("?"), 0), |f| (f.dst.to_string(), f.errno));
            let error = io::Error::from_raw_os_error(errno);
            let hint = gso_failure_hint(errno);
            if retries > 0 {
                warn!(%error, hint, "UDP GSO still fails from {local} to {to}: single datagrams, GSO tried again in {retry_in}");
            } else {
                warn!(%error, hint, "UDP GSO send from {local} to {to} failed: sending single datagrams, GSO off on this socket for {retry_in}");
            }
        }
        if recoveries > seen_recoveries {
            info!("UDP GSO works again on {local}");
        }
        let off = state.is_some_and(|s| s != GsoState::On);
        if off != self.counted_off {
            self.counted_off = off;
            if off {
                c.gso_off_sockets.fetch_add(1, Ordering::Relaxed);
            } else {
                c.gso_off_sockets.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for MeteredSocket {
    /// A socket replaced by a re-bind ([`Tunnel::set_public_ip`]) no longer holds the
    /// `udp_gso` gauge at 0.
    fn drop(&mut self) {
        if self.counted_off {
            self.counters.gso_off_sockets.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What usually makes a GSO send fail with `errno` (see [`crate::dataplane::sys::udp::gso_retry`]).
fn gso_failure_hint(errno: i32) -> &'static str {
    match errno {
        libc::EMSGSIZE => "a segment is larger than the path MTU",
        libc::EINVAL => "a segment is larger than the path MTU (older kernels)",
        libc::EIO => {
            "an IPsec policy on the route, or (before Linux 6.11) an egress device without tx \
             checksum offload"
        }
        _ => "unexpected",
    }
}

impl UdpIo for MeteredSocket {
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError> {
        let result = self.sock.send_batch(msgs, now);
        if self.gso_events() != self.seen {
            self.report(now);
        }
        self.count_tails();
        result
    }
    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        self.sock.recv_batch(bufs, metas, timeout)
    }
    fn gso_limits(&self) -> GsoLimits {
        self.sock.gso_limits()
    }
    fn gro(&self) -> bool {
        self.sock.capabilities().gro
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(&self.sock))
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddrV4;

    use super::*;

    fn at(secs: u64) -> Instant {
        Instant::from_epoch(Duration::from_secs(secs))
    }

    fn gso_socket(retry_after: u64) -> BatchSocket {
        let cfg = UdpConfig {
            gro: false,
            gso_retry: GsoRetryConfig::new(Duration::from_secs(retry_after)),
            ..UdpConfig::new(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
        };
        BatchSocket::open(cfg).expect("open a loopback socket")
    }

    /// Sends one GSO run of four datagrams from `sock` to `to` at `now`.
    fn send_run(sock: &mut MeteredSocket, to: SocketAddr, now: Instant) {
        let contents = [7u8; 4000];
        let t = Transmit { dst: to, contents: &contents, segment_size: Some(1000) };
        assert_eq!(sock.send_batch(&[t], now).expect("send"), 1);
    }

    fn gauge(c: &Counters) -> (bool, u64, u64, u64) {
        (
            c.offload(Offload::UdpGso),
            c.gso_off_sockets.load(Ordering::Relaxed),
            c.gso_fallbacks.load(Ordering::Relaxed),
            c.gso_reprobes.load(Ordering::Relaxed),
        )
    }

    /// The gauge drops while a socket has GSO off, stays down through a failed retry, and is
    /// back once a retry works; the counters count each failure and each retry.
    #[test]
    fn the_udp_gso_gauge_and_counters_follow_the_sockets() {
        let counters = Arc::new(Counters::default());
        counters.set_offload(Offload::UdpGso, true);
        let sink = gso_socket(1);
        let to = sink.local_addr();
        let mut a = MeteredSocket::new(gso_socket(2), counters.clone());
        let mut b = MeteredSocket::new(gso_socket(2), counters.clone());
        send_run(&mut a, to, at(10));
        assert_eq!(gauge(&counters), (true, 0, 0, 0));

        a.sock.fail_gso_sends(2, libc::EMSGSIZE);
        b.sock.fail_gso_sends(1, libc::EIO);
        send_run(&mut a, to, at(10));
        assert_eq!(gauge(&counters), (false, 1, 1, 0), "a is off");
        send_run(&mut b, to, at(11));
        assert_eq!(gauge(&counters), (false, 2, 2, 0), "both are off");
        send_run(&mut a, to, at(11));
        assert_eq!(gauge(&counters), (false, 2, 2, 0), "a is still off: nothing new");
        // a's retry at 12 fails (off until 16); b's at 13 works.
        send_run(&mut a, to, at(12));
        assert_eq!(gauge(&counters), (false, 2, 3, 1));
        send_run(&mut b, to, at(13));
        assert_eq!(gauge(&counters), (false, 1, 3, 2), "b is on again, a is not");
        assert_eq!(b.socket().gso_state(), Some(GsoState::On));
        send_run(&mut a, to, at(16));
        assert_eq!(gauge(&counters), (true, 0, 3, 3), "both on: the gauge is 1 again");
    }

    /// A retry that has started but not yet been confirmed by a GSO send keeps the gauge at 0.
    #[test]
    fn an_unconfirmed_retry_keeps_the_gauge_down() {
        let counters = Arc::new(Counters::default());
        counters.set_offload(Offload::UdpGso, true);
        let sink = gso_socket(1);
        let mut a = MeteredSocket::new(gso_socket(2), counters.clone());
        a.sock.fail_gso_sends(1, libc::EIO);
        send_run(&mut a, sink.local_addr(), at(0));
        let single = Transmit { dst: sink.local_addr(), contents: &[1], segment_size: None };
        assert_eq!(a.send_batch(&[single], at(5)).expect("send"), 1);
        assert_eq!(a.socket().gso_state(), Some(GsoState::Retrying));
        assert_eq!(gauge(&counters), (false, 1, 1, 1));
        send_run(&mut a, sink.local_addr(), at(5));
        assert_eq!(gauge(&counters), (true, 0, 1, 1));
    }

    /// A data plane on loopback with `workers` workers, `backend`'s sockets only.
    fn loopback_config(backend: BackendKind, workers: usize) -> DataplaneConfig {
        DataplaneConfig {
            tun_name: "weft-test".into(),
            backend,
            direct_routing: false,
            vni: 1,
            port: 0,
            our_mac: crate::vocab::MacAddr::default(),
            underlay_mtu: 1500,
            overhead: 50,
            network: Some("10.244.0.0/16".parse().unwrap()),
            public_ip: Ipv4Addr::LOCALHOST,
            ipv6: None,
            workers,
            tun_offload: false,
            udp_gso: Default::default(),
            udp_gro: false,
            batching: true,
            one_thread: false,
            spin: Duration::ZERO,
            worker_slice: Duration::ZERO,
            wireguard: None,
        }
    }

    /// A flow's outer source port must not depend on the worker that reads it from TUN: the
    /// workers send from one pool. (With a pool each, flows kept moving between workers on both
    /// hosts, and were reordered each time: integration/e2e_order.rs.)
    #[test]
    fn every_worker_sends_from_the_same_source_ports() {
        for backend in [BackendKind::Vxlan, BackendKind::Udp] {
            let cfg = loopback_config(backend, 3);
            let (_, sockets) = open_sockets(&cfg, Ipv4Addr::LOCALHOST, 3).unwrap();
            let ports = |w: &WorkerSockets| -> Vec<SocketAddr> {
                w.v4.as_ref().unwrap().tx_pool.iter().map(BatchSocket::local_addr).collect()
            };
            let first = ports(&sockets[0]);
            assert_eq!(first.len(), 6, "two sending sockets per worker");
            let distinct: std::collections::BTreeSet<_> = first.iter().collect();
            assert_eq!(distinct.len(), first.len(), "{first:?}");
            for w in &sockets[1..] {
                assert_eq!(ports(w), first, "{backend:?}");
            }
        }
    }
}
