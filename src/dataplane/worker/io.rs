//! The forwarding loops' two I/O edges, as traits: one TUN queue ([`TunIo`]) and one UDP socket
//! ([`UdpIo`]), so the whole path runs in tests over in-memory fakes (`super::fake`,
//! `test-util` feature) and in the daemon over the TUN device and [`udp::BatchSocket`].

use std::io;
use std::time::Duration;

use crate::dataplane::sys::udp::gso_tail::GsoLimits;
use crate::dataplane::sys::udp::{self, RecvMeta, Transmit, UdpError};
use crate::time::Instant;

/// One TUN queue, as the loops need it.
pub trait TunIo: Send + Sync {
    /// Reads one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]); `Ok(0)` or
    /// `WouldBlock` when nothing is queued.
    fn read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes one packet (behind a `virtio_net_hdr` when [`TunIo::vnet_hdr`]).
    fn write(&self, buf: &[u8]) -> io::Result<usize>;
    /// Writes one packet gathered from `parts`, as [`TunIo::write`] would write their
    /// concatenation.
    fn write_vectored(&self, parts: &[io::IoSlice<'_>]) -> io::Result<usize>;
    /// Waits until a packet can be read or `timeout` passes: for queues without a file
    /// descriptor (the test fakes). A queue with one ([`TunIo::poll_fd`]) is waited on in the
    /// thread's epoll ([`super::Idle`]) and never asked; the default just sleeps.
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        std::thread::sleep(timeout);
        Ok(false)
    }
    /// Whether packets carry a `virtio_net_hdr` (TUN offloads on).
    fn vnet_hdr(&self) -> bool;
    /// The file descriptor to wait on for readability, if the queue has one.
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

/// One UDP socket, as the loops need it (see [`udp::BatchSocket`]).
pub trait UdpIo: Send {
    /// Sends messages at `now` (the batch's time); see [`udp::BatchSocket::send_batch`].
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError>;
    /// Receives messages; see [`udp::BatchSocket::recv_batch`].
    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError>;
    /// How big a GSO message to lay out now (one datagram: no GSO); see
    /// [`udp::BatchSocket::gso_limits`].
    fn gso_limits(&self) -> GsoLimits;
    /// Whether received buffers may hold several datagrams (UDP GRO).
    fn gro(&self) -> bool;
    /// The file descriptor to wait on for readability, if the socket has one.
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// A second descriptor to wait on, for a socket made of two (the IPv6 socket of a
    /// [`super::FamilySockets`]).
    fn second_poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

impl UdpIo for udp::BatchSocket {
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError> {
        udp::BatchSocket::send_batch(self, msgs, now)
    }
    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        udp::BatchSocket::recv_batch(self, bufs, metas, timeout)
    }
    fn gso_limits(&self) -> GsoLimits {
        udp::BatchSocket::gso_limits(self)
    }
    fn gro(&self) -> bool {
        self.capabilities().gro
    }
    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}
