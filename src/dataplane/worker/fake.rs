//! In-memory fakes of both I/O edges — a TUN queue and a network of UDP sockets — so the whole
//! forwarding path ([`super`]) runs in an unprivileged test, the way wireguard-go's
//! `tuntest` and `bindtest` do. They allocate freely; only the code under test must not.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{TunIo, UdpIo};
use crate::dataplane::sys::udp::gso_tail::{self, GsoLimits, Next, TailRule};
use crate::dataplane::sys::udp::{RecvMeta, Transmit, UdpError};

#[derive(Default)]
struct Queue {
    packets: Mutex<VecDeque<Vec<u8>>>,
    ready: Condvar,
}

impl Queue {
    fn push(&self, p: Vec<u8>) {
        self.packets.lock().unwrap_or_else(PoisonError::into_inner).push_back(p);
        self.ready.notify_all();
    }

    fn pop_wait(&self, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut q = self.packets.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(p) = q.pop_front() {
                return Some(p);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            q = self.ready.wait_timeout(q, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

/// A fake TUN queue: the test [`inject`](FakeTun::inject)s packets the "kernel" routes into
/// the device, and [`take_written`](FakeTun::take_written) packets weft wrote to it.
#[derive(Default)]
pub struct FakeTun {
    inbound: Queue,
    written: Queue,
    vnet_hdr: bool,
}

impl FakeTun {
    /// A fake TUN queue without virtio headers.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A fake TUN queue with offloads: every packet read or written carries a
    /// `virtio_net_hdr`, which the test writes (and reads) itself.
    pub fn with_vnet_hdr() -> Arc<Self> {
        Arc::new(Self { vnet_hdr: true, ..Self::default() })
    }

    /// A packet for weft to read.
    pub fn inject(&self, packet: &[u8]) {
        self.inbound.push(packet.to_vec());
    }

    /// The next packet weft wrote, waiting up to `timeout`.
    pub fn take_written(&self, timeout: Duration) -> Option<Vec<u8>> {
        self.written.pop_wait(timeout)
    }
}

impl TunIo for FakeTun {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let p = self
            .inbound
            .packets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
            .ok_or(io::ErrorKind::WouldBlock)?;
        let n = p.len().min(buf.len());
        buf[..n].copy_from_slice(&p[..n]);
        Ok(n)
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        self.written.push(buf.to_vec());
        Ok(buf.len())
    }

    fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let packet: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        let n = packet.len();
        self.written.push(packet);
        Ok(n)
    }

    fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut q = self.inbound.packets.lock().unwrap_or_else(PoisonError::into_inner);
        while q.is_empty() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(false);
            };
            q = self.inbound.ready.wait_timeout(q, left).unwrap_or_else(PoisonError::into_inner).0;
        }
        Ok(true)
    }

    fn vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }
}

/// A fake underlay: datagrams sent to an address land in the socket bound to it.
#[derive(Clone, Default)]
pub struct FakeNet {
    sockets: Arc<Mutex<HashMap<SocketAddr, Arc<Queue>>>>,
}

impl FakeNet {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// A socket bound to `addr`.
    pub fn bind(&self, addr: impl Into<SocketAddr>) -> FakeUdp {
        let addr = addr.into();
        let q = self
            .sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(addr)
            .or_default()
            .clone();
        FakeUdp {
            local: addr,
            net: self.clone(),
            inbox: q,
            messages: 0,
            pads: 0,
            no_gso: false,
            tail: TailRule::Any,
        }
    }

    /// Sends a datagram from `from` to `to`, as any host (or attacker) on the underlay could.
    pub fn send_raw(
        &self,
        from: impl Into<SocketAddr>,
        to: impl Into<SocketAddr>,
        datagram: &[u8],
    ) {
        let (from, to) = (from.into(), to.into());
        let q = self.sockets.lock().unwrap_or_else(PoisonError::into_inner).get(&to).cloned();
        if let Some(q) = q {
            let mut framed = from.to_string().into_bytes();
            framed.push(0);
            framed.extend_from_slice(datagram);
            q.push(framed);
        }
    }
}

/// A fake UDP socket on a [`FakeNet`]; GSO messages are split on send, no GRO on receive.
/// Under a [`TailRule`] it sends what [`crate::dataplane::sys::udp::BatchSocket`] would put on the
/// wire (datagrams sent alone, the pad as a datagram of its own), and it panics on a GSO
/// message larger than its [`UdpIo::gso_limits`]: the TX path never lays one out.
pub struct FakeUdp {
    local: SocketAddr,
    net: FakeNet,
    inbox: Arc<Queue>,
    messages: usize,
    pads: usize,
    no_gso: bool,
    tail: TailRule,
}

impl FakeUdp {
    /// Turns GSO off (or back on), as a socket does after a GSO send failed with `EIO`.
    pub fn set_gso(&mut self, on: bool) {
        self.no_gso = !on;
    }

    /// How its GSO messages may end (see [`crate::dataplane::sys::udp::gso_tail`]).
    pub fn set_gso_tail(&mut self, tail: TailRule) {
        self.tail = tail;
    }

    /// How many GSO messages went with the pad.
    #[cfg(test)]
    pub(crate) fn pads_sent(&self) -> usize {
        self.pads
    }

    /// How many messages (a GSO message counts once) were sent from this socket.
    #[cfg(test)]
    pub(crate) fn messages_sent(&self) -> usize {
        self.messages
    }
}

impl UdpIo for FakeUdp {
    fn send_batch(
        &mut self,
        msgs: &[Transmit<'_>],
        _now: crate::time::Instant,
    ) -> Result<usize, UdpError> {
        let limits = self.gso_limits();
        for m in msgs {
            self.messages += 1;
            let seg = m.segment_size.map_or(m.contents.len(), usize::from).max(1);
            let datagrams = m.contents.len().div_ceil(seg);
            if datagrams > 1 {
                assert!(
                    datagrams <= limits.segments && m.contents.len() <= limits.bytes,
                    "a GSO message of {datagrams} datagrams and {} bytes, beyond {limits:?}",
                    m.contents.len()
                );
            }
            let mut left = m.contents;
            while !left.is_empty() {
                let pad = match self.tail.next(left.len(), seg) {
                    _ if left.len() <= seg || self.no_gso => false,
                    Next::Gso { pad } => pad,
                    Next::Single => {
                        self.net.send_raw(self.local, m.dst, &left[..seg]);
                        left = &left[seg..];
                        continue;
                    }
                };
                for d in left.chunks(seg) {
                    self.net.send_raw(self.local, m.dst, d);
                }
                if pad {
                    self.pads += 1;
                    self.net.send_raw(self.local, m.dst, &gso_tail::PAD);
                }
                break;
            }
        }
        Ok(msgs.len())
    }

    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        let mut n = 0;
        let mut wait = timeout;
        while n < bufs.len().min(metas.len()) {
            let Some(framed) = self.inbox.pop_wait(wait) else { break };
            wait = Duration::ZERO;
            let Some(split) = framed.iter().position(|b| *b == 0) else { continue };
            let Ok(src) = std::str::from_utf8(&framed[..split]).unwrap_or("").parse() else {
                continue;
            };
            let d = &framed[split + 1..];
            let len = d.len().min(bufs[n].len());
            bufs[n][..len].copy_from_slice(&d[..len]);
            metas[n] = RecvMeta { src, len, segment_size: None, truncated: len < d.len() };
            n += 1;
        }
        Ok(n)
    }

    fn gso_limits(&self) -> GsoLimits {
        self.tail.limits(if self.no_gso { 1 } else { 64 })
    }

    fn gro(&self) -> bool {
        false
    }
}
