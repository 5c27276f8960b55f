//! Owns the data plane's file descriptors and threads: one TUN queue, one receiving UDP socket
//! and a small pool of sending sockets per worker, each worker on one thread for both
//! directions, or one per direction ([`super::worker`]).
//!
//! Start-up probes every offload once and logs what it found: TUN checksum/TSO/USO
//! (`IFF_VNET_HDR` + `TUNSETOFFLOAD`), UDP GSO (`UDP_SEGMENT`) and GRO (`UDP_GRO`). Each can be
//! switched off by a flag, and a GSO send that fails (`EIO`, `EINVAL`, `EMSGSIZE`) turns GSO off
//! on that socket for now: it is tried again later (see [`super::udp`]). Workers share the port with `SO_REUSEPORT`; the kernel spreads
//! flows over TUN queues and sockets by hash, so one flow stays on one worker. The port is
//! bound on the public IP (the wildcard only when that is no local address), without
//! `SO_REUSEADDR`, so that no other user's socket can bind it beside ours.
//!
//! VXLAN datagrams leave from sockets on ephemeral ports chosen by the inner flow's hash, so the
//! outer source port differs per flow (RFC 7348 §5) and receivers can spread flows too.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use ipnet::Ipv4Net;
use tracing::{info, warn};

use super::gso_retry::GsoRetryConfig;
use super::pipeline::{Counters, Forwarder, Offload, OwnSubnet};
use super::sys::{self, Tun, TunError, TunOptions, TunStatus};
use super::udp::{BatchSocket, UdpConfig, UdpError};
use super::wire::vxlan::Vni;
use super::worker::{self, TunIo, WorkerConfig};
use crate::config::BackendKind;
use crate::lease::record::Subnet;
use crate::route::Routes;
use crate::time::BootClock;

/// How often the threads look at the stop flag.
const WAKE: Duration = Duration::from_millis(200);
/// Sending sockets per worker.
const TX_POOL: usize = 4;
/// Socket buffers (wireguard-go's 7 MiB).
const SOCKET_BUFFER: usize = 7 << 20;

/// What the data plane needs to start.
#[derive(Clone, Debug)]
pub struct DataplaneConfig {
    /// TUN device name.
    pub tun_name: String,
    /// vxlan or udp.
    pub backend: BackendKind,
    /// VNI (vxlan).
    pub vni: u32,
    /// The backend's UDP port.
    pub port: u16,
    /// Our VTEP MAC.
    pub our_mac: [u8; 6],
    /// The underlay MTU; the TUN MTU is this minus the encapsulation overhead.
    pub underlay_mtu: u32,
    /// The encapsulation overhead (50 for vxlan, 28 for udp).
    pub overhead: u32,
    /// The cluster network, routed through the TUN device.
    pub network: Ipv4Net,
    /// Our public IP: datagrams are sent from it when it is a local address.
    pub public_ip: Ipv4Addr,
    /// Workers (TUN queues); at least 1.
    pub workers: usize,
    /// TUN offloads (TSO, checksum, USO) with userspace split and GRO.
    pub tun_offload: bool,
    /// UDP GSO on send.
    pub udp_gso: bool,
    /// UDP GRO on receive.
    pub udp_gro: bool,
    /// recvmmsg/sendmmsg batches (off: one packet per syscall).
    pub batching: bool,
    /// One thread per worker for both directions (else one per direction).
    pub one_thread: bool,
}

/// Why the data plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The VNI does not fit in 24 bits.
    #[error("VNI {0} does not fit in 24 bits")]
    BadVni(u32),
    /// The TUN device.
    #[error(transparent)]
    Tun(#[from] TunError),
    /// A UDP socket.
    #[error("UDP socket: {0}")]
    Socket(#[from] UdpError),
    /// A thread.
    #[error("starting a worker thread: {0}")]
    Thread(#[source] io::Error),
}

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
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        Tun::wait_readable(self, timeout)
    }
    fn vnet_hdr(&self) -> bool {
        Tun::vnet_hdr(self)
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

/// A running data plane. Stops its threads on [`Dataplane::stop`] or drop.
#[derive(Debug)]
pub struct Dataplane {
    cfg: DataplaneConfig,
    stop: Arc<AtomicBool>,
    threads: std::sync::Mutex<Vec<JoinHandle<()>>>,
    own: Arc<OwnSubnet>,
    /// Counters, for `/metrics`.
    pub counters: Arc<Counters>,
}

impl Dataplane {
    /// Creates the TUN device (one queue per worker), binds the sockets, probes offloads and
    /// starts the workers. The TUN device gets its address once [`Dataplane::set_subnet`] is
    /// called.
    pub fn start(cfg: DataplaneConfig, routes: Arc<Routes>) -> Result<Self, DataplaneError> {
        let workers = cfg.workers.max(1);
        let vni = Vni::new(cfg.vni).map_err(|_| DataplaneError::BadVni(cfg.vni))?;
        // Never attach to a device another process has open (a second weft): create it, with
        // IFF_TUN_EXCL so that one created in the meantime is refused too, or take a
        // persistent one nobody holds.
        let status = sys::tun_status(&cfg.tun_name)?;
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
        let mut offloads = sys::TunOffloads::default();
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
        let mtu = cfg.underlay_mtu.saturating_sub(cfg.overhead).max(576);
        sys::set_mtu(&name, mtu)?;
        sys::set_up(&name)?;

        let own = Arc::new(OwnSubnet::default());
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let fwd = Forwarder {
            backend: cfg.backend,
            vni,
            port: cfg.port,
            our_mac: cfg.our_mac,
            own: own.clone(),
            icmp_source: cfg.network.network(),
            icmp_limit: Arc::default(),
        };
        let wcfg = WorkerConfig {
            batch: if cfg.batching { super::udp::MAX_BATCH } else { 1 },
            wake: WAKE,
            gro_tcp: cfg.tun_offload && offloads.tso,
            gro_udp: cfg.tun_offload && offloads.uso,
            one_thread: cfg.one_thread,
        };
        // The backend port is bound on the public IP, where peers send, and only when that is
        // no local address (behind NAT) on the wildcard. Without SO_REUSEADDR no other
        // socket can bind the port beside ours; SO_REUSEPORT joins our workers' sockets into
        // one group, which Linux opens only to sockets of the same effective UID (so run weft
        // under a UID of its own; a root process can always take the port).
        let rx_bind = match BatchSocket::open(UdpConfig::new(SocketAddrV4::new(cfg.public_ip, 0))) {
            Err(UdpError::Bind { source, .. })
                if source.kind() == io::ErrorKind::AddrNotAvailable =>
            {
                warn!(public_ip = %cfg.public_ip, port = cfg.port, "the public IP is no local address: receiving on every address");
                Ipv4Addr::UNSPECIFIED
            }
            _ => cfg.public_ip,
        };
        let rx_cfg = UdpConfig {
            bind: SocketAddrV4::new(rx_bind, cfg.port),
            reuse_port: workers > 1,
            gso: false,
            gro: cfg.udp_gro,
            gso_retry: GsoRetryConfig::default(),
            buffer_bytes: SOCKET_BUFFER,
        };
        let tx_cfg = |ip| UdpConfig {
            bind: SocketAddrV4::new(ip, 0),
            reuse_port: false,
            gso: cfg.udp_gso,
            gro: false,
            gso_retry: GsoRetryConfig::default(),
            buffer_bytes: SOCKET_BUFFER,
        };
        let mut threads = Vec::with_capacity(workers * 2);
        let mut caps_logged = false;
        for (i, tun) in queues.into_iter().enumerate() {
            let rx = BatchSocket::open(rx_cfg)?;
            let pool = (0..TX_POOL)
                .map(|_| {
                    BatchSocket::open(tx_cfg(cfg.public_ip))
                        .or_else(|_| BatchSocket::open(tx_cfg(Ipv4Addr::UNSPECIFIED)))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if !caps_logged {
                caps_logged = true;
                for (offload, on) in [
                    (Offload::TunTso, cfg.tun_offload && offloads.tso),
                    (Offload::TunUso, cfg.tun_offload && offloads.uso),
                    (Offload::UdpGso, pool[0].gso_enabled()),
                    (Offload::UdpGro, rx.capabilities().gro),
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
                    udp_gso = pool[0].capabilities().gso,
                    udp_gro = rx.capabilities().gro,
                    batch = wcfg.batch,
                    port = cfg.port,
                    backend = cfg.backend.as_str(),
                    "data plane up"
                );
            }
            let handles = worker::Worker {
                tun,
                tx_pool: pool,
                rx,
                fwd: fwd.clone(),
                routes: routes.clone(),
                counters: counters.clone(),
                cfg: wcfg,
                clock: Arc::new(BootClock),
            }
            .spawn(&format!("weft-q{i}"), stop.clone())
            .map_err(DataplaneError::Thread)?;
            threads.extend(handles);
        }
        Ok(Self { cfg, stop, threads: std::sync::Mutex::new(threads), own, counters })
    }

    /// Points the data plane at this host's subnet: the TUN device gets `<subnet>.0/32` and a
    /// route for the whole network, and received packets for that subnet are delivered.
    pub fn set_subnet(&self, subnet: Option<Subnet>) -> Result<(), TunError> {
        let old = self.own.get();
        self.own.set(subnet);
        if let Some(s) = subnet
            && old != Some(s)
        {
            let addr = Ipv4Net::new(s.network(), 32).unwrap_or_else(|_| s.net());
            sys::set_ipv4(&self.cfg.tun_name, addr)?;
            sys::set_up(&self.cfg.tun_name)?;
            sys::add_route(&self.cfg.tun_name, self.cfg.network)?;
            info!(tun = %self.cfg.tun_name, %addr, network = %self.cfg.network, "TUN addressed");
        }
        Ok(())
    }

    /// Stops the threads and waits for them; the device closes when the last queue goes (a
    /// non-persistent TUN device then disappears).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            if t.join().is_err() {
                warn!("a data plane thread panicked");
            }
        }
    }
}

impl std::ops::Drop for Dataplane {
    fn drop(&mut self) {
        self.stop();
    }
}
