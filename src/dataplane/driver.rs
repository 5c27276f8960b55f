//! The data plane's threads: they own the TUN device and the UDP sockets, and run the
//! [`Forwarder`] on every packet.
//!
//! - The TX thread reads a packet from TUN into the headroom-reserving buffer, loads the current
//!   route table (wait-free), encapsulates, and sends. VXLAN datagrams leave from a small pool of
//!   sockets on ephemeral ports, picked by the inner flow's hash, so the outer source port
//!   varies per flow (RFC 7348 §5) and stays the same within one.
//! - The RX thread receives on the backend port (8472 for vxlan, 8285 for udp), validates and
//!   decapsulates, and writes the inner packet to TUN.
//! - Both threads wake at least every 200 ms to notice a stop. Nothing on the per-packet path
//!   allocates, locks or logs: drops are counted by reason.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use ipnet::Ipv4Net;
use socket2::{Domain, Protocol, Socket, Type};
use tracing::{info, warn};

use super::pipeline::{Counters, Forwarder, HEADROOM, OwnSubnet, Rx, Tx};
use super::sys::{self, Tun, TunError, TunOptions};
use super::wire::vxlan::Vni;
use crate::config::BackendKind;
use crate::lease::record::Subnet;
use crate::route::Routes;

/// How often the threads look at the stop flag.
const WAKE: Duration = Duration::from_millis(200);
/// Sockets in the VXLAN send pool.
const TX_POOL: usize = 8;
/// Socket buffers; the kernel caps them at net.core.{r,w}mem_max.
const SOCKET_BUFFER: usize = 4 << 20;

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
    /// Our public IP: VXLAN datagrams are sent from it when it is a local address.
    pub public_ip: Ipv4Addr,
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
    #[error("UDP socket on port {port}: {source}")]
    Socket {
        /// The port.
        port: u16,
        /// The error.
        #[source]
        source: io::Error,
    },
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

fn udp_socket(addr: SocketAddrV4, reuse: bool) -> io::Result<UdpSocket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    if reuse {
        s.set_reuse_address(true)?;
    }
    // Bigger buffers absorb bursts; failure only costs throughput.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    s.bind(&SocketAddr::V4(addr).into())?;
    Ok(s.into())
}

impl Dataplane {
    /// Creates the TUN device, binds the sockets and starts the threads. The TUN device gets
    /// its address once [`Dataplane::set_subnet`] is called.
    pub fn start(cfg: DataplaneConfig, routes: Arc<Routes>) -> Result<Self, DataplaneError> {
        let tun = Arc::new(Tun::open(&cfg.tun_name, TunOptions::default())?);
        let mtu = cfg.underlay_mtu.saturating_sub(cfg.overhead).max(576);
        sys::set_mtu(tun.name(), mtu)?;
        sys::set_up(tun.name())?;
        let sock_err = |port| move |source| DataplaneError::Socket { port, source };
        let rx_sock = udp_socket(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, cfg.port), true)
            .map_err(sock_err(cfg.port))?;
        rx_sock.set_read_timeout(Some(WAKE)).map_err(sock_err(cfg.port))?;
        let rx_sock = Arc::new(rx_sock);
        let tx_pool: Vec<Arc<UdpSocket>> = match cfg.backend {
            // flannel's udp backend sends from its listening socket; peers expect that port.
            BackendKind::Udp => vec![rx_sock.clone()],
            BackendKind::Vxlan => (0..TX_POOL)
                .map(|_| {
                    udp_socket(SocketAddrV4::new(cfg.public_ip, 0), false)
                        .or_else(|_| udp_socket(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0), false))
                        .map(Arc::new)
                        .map_err(sock_err(0))
                })
                .collect::<Result<_, _>>()?,
        };
        info!(
            tun = tun.name(),
            mtu,
            port = cfg.port,
            backend = cfg.backend.as_str(),
            "data plane up"
        );

        let own = Arc::new(OwnSubnet::default());
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let fwd = Forwarder {
            backend: cfg.backend,
            vni: Vni::new(cfg.vni).map_err(|_| DataplaneError::BadVni(cfg.vni))?,
            port: cfg.port,
            our_mac: cfg.our_mac,
            own: own.clone(),
        };
        let buf_len = HEADROOM + 65536;

        let tx = {
            let (tun, routes, fwd, counters, stop) =
                (tun.clone(), routes.clone(), fwd.clone(), counters.clone(), stop.clone());
            std::thread::Builder::new().name("weft-tx".into()).spawn(move || {
                let mut buf = vec![0u8; buf_len];
                let mut reply = vec![0u8; 1500];
                while !stop.load(Ordering::Relaxed) {
                    match tun.wait_readable(WAKE) {
                        Ok(true) => {}
                        Ok(false) => continue,
                        Err(_) => {
                            counters.io_errors.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(WAKE);
                            continue;
                        }
                    }
                    let n = match tun.read(&mut buf[HEADROOM..]) {
                        Ok(n) => n,
                        Err(_) => continue,
                    };
                    let table = routes.load();
                    match fwd.encap(&table, &mut buf, n, &mut reply) {
                        Tx::Send { peer, range, flow } => {
                            let sock = &tx_pool[flow as usize % tx_pool.len()];
                            if sock.send_to(&buf[range], peer).is_ok() {
                                counters.tx_packets.fetch_add(1, Ordering::Relaxed);
                                counters.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
                            } else {
                                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Tx::Reply { len, reason } => {
                            counters.count_drop(reason);
                            let _ = tun.write(&reply[..len]);
                        }
                        Tx::Drop(reason) => counters.count_drop(reason),
                    }
                }
            })
        };
        let rx = {
            let (tun, routes, counters, stop) =
                (tun.clone(), routes, counters.clone(), stop.clone());
            std::thread::Builder::new().name("weft-rx".into()).spawn(move || {
                let mut buf = vec![0u8; buf_len];
                while !stop.load(Ordering::Relaxed) {
                    let (n, from) = match rx_sock.recv_from(&mut buf) {
                        Ok((n, SocketAddr::V4(from))) => (n, from),
                        Ok(_) => continue,
                        Err(_) => continue,
                    };
                    let table = routes.load();
                    match fwd.decap(&table, from, &mut buf, n) {
                        Rx::Deliver(range) => {
                            let len = range.len();
                            if tun.write(&buf[range]).is_ok() {
                                counters.rx_packets.fetch_add(1, Ordering::Relaxed);
                                counters.rx_bytes.fetch_add(len as u64, Ordering::Relaxed);
                            } else {
                                counters.io_errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Rx::Drop(reason) => counters.count_drop(reason),
                    }
                }
            })
        };
        let threads = [tx, rx]
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| DataplaneError::Socket { port: cfg.port, source })?;
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

    /// Stops the threads and waits for them; the device closes when the last handle goes (a
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
