//! One socket per underlay family, used by the loops as one [`UdpIo`]: on a dual-stack vxlan
//! network a worker sends and receives over IPv4 and over IPv6 (`IPV6_V6ONLY` sockets bound on
//! the host's `PublicIPv6`), and its loops need not know. An IPv4-only network has the IPv4
//! socket alone, an IPv6-only one the IPv6 socket alone.
//!
//! Contract:
//! - Send: a batch's messages keep their order. Each run of consecutive messages of one family
//!   goes to that family's socket in one call; the count sent and a [`UdpError::Send`]'s index
//!   are of the whole batch. A socket that sends less than its run (its buffer is full) ends
//!   the batch there, as one socket would. A message to a family without a socket is refused
//!   as the kernel refuses one (`EAFNOSUPPORT`), which the caller counts and skips.
//! - Receive: both sockets are read without waiting, the first one asked taking turns so that
//!   a busy family cannot starve the other; a batch holds what both had, up to its buffers.
//!   An error of either is returned only when nothing was received.
//! - GSO: the lower limits of the two; GRO: either (the receive buffers are sized for it,
//!   and each message says whether it holds several datagrams).

use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::Duration;

use super::io::UdpIo;
use crate::dataplane::sys::udp::gso_tail::GsoLimits;
use crate::dataplane::sys::udp::{RecvMeta, Transmit, UdpError};
use crate::time::Instant;

/// An IPv4 socket, an IPv6 one, or both; see the module docs.
#[derive(Debug)]
pub struct FamilySockets<U> {
    v4: Option<U>,
    v6: Option<U>,
    /// Which socket `recv_batch` asks first (true: IPv6).
    v6_first: bool,
}

impl<U: UdpIo> FamilySockets<U> {
    /// `v4`, and `v6` when the underlay has IPv6.
    pub fn new(v4: U, v6: Option<U>) -> Self {
        Self { v4: Some(v4), v6, v6_first: false }
    }

    /// The IPv6 socket alone, on an IPv6-only network.
    pub fn ipv6_only(v6: U) -> Self {
        Self { v4: None, v6: Some(v6), v6_first: false }
    }

    /// The IPv4 socket, if there is one.
    pub fn v4(&self) -> Option<&U> {
        self.v4.as_ref()
    }

    /// The IPv6 socket, if there is one.
    pub fn v6(&self) -> Option<&U> {
        self.v6.as_ref()
    }

    fn socket_for(&mut self, dst: SocketAddr) -> Option<&mut U> {
        match dst {
            SocketAddr::V4(_) => self.v4.as_mut(),
            SocketAddr::V6(_) => self.v6.as_mut(),
        }
    }
}

impl<U: UdpIo> UdpIo for FamilySockets<U> {
    fn send_batch(&mut self, msgs: &[Transmit<'_>], now: Instant) -> Result<usize, UdpError> {
        let mut done = 0;
        while done < msgs.len() {
            let v6 = msgs[done].dst.is_ipv6();
            let run = msgs[done..].iter().take_while(|m| m.dst.is_ipv6() == v6).count();
            let Some(sock) = self.socket_for(msgs[done].dst) else {
                let source = io::Error::from_raw_os_error(libc::EAFNOSUPPORT);
                return Err(UdpError::Send { sent: done, source });
            };
            match sock.send_batch(&msgs[done..done + run], now) {
                Ok(n) if n == run => done += n,
                // The socket's buffer is full: the batch ends here, as on one socket.
                Ok(n) => return Ok(done + n),
                Err(UdpError::Send { sent, source }) => {
                    return Err(UdpError::Send { sent: done + sent, source });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn recv_batch(
        &mut self,
        bufs: &mut [Vec<u8>],
        metas: &mut [RecvMeta],
        timeout: Duration,
    ) -> Result<usize, UdpError> {
        let (v4, v6) = match (self.v4.as_mut(), self.v6.as_mut()) {
            (Some(one), None) | (None, Some(one)) => return one.recv_batch(bufs, metas, timeout),
            (None, None) => return Ok(0),
            (Some(v4), Some(v6)) => (v4, v6),
        };
        self.v6_first = !self.v6_first;
        let (first, second) = if self.v6_first { (v6, v4) } else { (v4, v6) };
        // Waiting on one socket would miss the other: both are read without waiting (the
        // loops wait in epoll on both descriptors).
        let got = first.recv_batch(bufs, metas, Duration::ZERO);
        let n = *got.as_ref().unwrap_or(&0);
        let more = match (bufs.get_mut(n..), metas.get_mut(n..)) {
            (Some(b), Some(m)) if !b.is_empty() => second.recv_batch(b, m, Duration::ZERO),
            _ => Ok(0),
        };
        match (got, more) {
            (Ok(a), Ok(b)) => Ok(a + b),
            (Ok(a), Err(e)) | (Err(e), Ok(a)) if a == 0 => Err(e),
            (Ok(a), Err(_)) | (Err(_), Ok(a)) => Ok(a),
            (Err(e), Err(_)) => Err(e),
        }
    }

    fn gso_limits(&self) -> GsoLimits {
        let mut limits = self.v4.iter().chain(self.v6.iter()).map(UdpIo::gso_limits);
        let first = limits.next().unwrap_or(GsoLimits::NONE);
        limits.fold(first, |a, b| GsoLimits {
            segments: a.segments.min(b.segments),
            bytes: a.bytes.min(b.bytes),
        })
    }

    fn gro(&self) -> bool {
        self.v4.iter().chain(self.v6.iter()).any(UdpIo::gro)
    }

    fn poll_fd(&self) -> Option<RawFd> {
        self.v4.as_ref().or(self.v6.as_ref()).and_then(UdpIo::poll_fd)
    }

    fn second_poll_fd(&self) -> Option<RawFd> {
        self.v4.as_ref().and(self.v6.as_ref()).and_then(UdpIo::poll_fd)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

    use super::*;

    /// A socket that records what it sent, has room for `room` messages, refuses messages to
    /// `bad`, and has `queued` datagrams to receive.
    #[derive(Default)]
    struct Rec {
        sent: Vec<SocketAddr>,
        room: Option<usize>,
        bad: Option<SocketAddr>,
        queued: Vec<SocketAddr>,
        fail_recv: bool,
        limits: Option<GsoLimits>,
    }

    impl UdpIo for Rec {
        fn send_batch(&mut self, msgs: &[Transmit<'_>], _: Instant) -> Result<usize, UdpError> {
            for (i, m) in msgs.iter().enumerate() {
                if self.room == Some(0) {
                    return Ok(i);
                }
                if Some(m.dst) == self.bad {
                    let source = io::Error::from_raw_os_error(libc::EHOSTUNREACH);
                    return Err(UdpError::Send { sent: i, source });
                }
                self.room = self.room.map(|r| r - 1);
                self.sent.push(m.dst);
            }
            Ok(msgs.len())
        }
        fn recv_batch(
            &mut self,
            bufs: &mut [Vec<u8>],
            metas: &mut [RecvMeta],
            _: Duration,
        ) -> Result<usize, UdpError> {
            if self.fail_recv {
                return Err(UdpError::Recv(io::Error::from_raw_os_error(libc::ENOMEM)));
            }
            let n = self.queued.len().min(bufs.len()).min(metas.len());
            for (m, src) in metas.iter_mut().zip(self.queued.drain(..n)) {
                m.src = src;
                m.len = 1;
            }
            Ok(n)
        }
        fn gso_limits(&self) -> GsoLimits {
            self.limits.unwrap_or(GsoLimits { segments: 64, bytes: 65507 })
        }
        fn gro(&self) -> bool {
            false
        }
    }

    fn a4(d: u8) -> SocketAddr {
        SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, d), 8472).into()
    }

    fn a6(d: u16) -> SocketAddr {
        SocketAddrV6::new(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, d), 8472, 0, 0).into()
    }

    fn tx(to: &[SocketAddr]) -> Vec<Transmit<'static>> {
        to.iter().map(|&dst| Transmit { dst, contents: &[0u8; 10], segment_size: None }).collect()
    }

    #[test]
    fn each_message_leaves_from_its_familys_socket_in_order() {
        let mut s = FamilySockets::new(Rec::default(), Some(Rec::default()));
        let to = [a4(1), a6(1), a6(2), a4(2), a6(3)];
        assert_eq!(s.send_batch(&tx(&to), Instant::ZERO).unwrap(), 5);
        assert_eq!(s.v4().unwrap().sent, vec![a4(1), a4(2)]);
        assert_eq!(s.v6().unwrap().sent, vec![a6(1), a6(2), a6(3)]);
    }

    #[test]
    fn a_refused_message_is_named_by_its_index_in_the_whole_batch() {
        let v6 = Rec { bad: Some(a6(2)), ..Rec::default() };
        let mut s = FamilySockets::new(Rec::default(), Some(v6));
        let to = [a4(1), a4(2), a6(1), a6(2), a4(3)];
        let Err(UdpError::Send { sent, .. }) = s.send_batch(&tx(&to), Instant::ZERO) else {
            panic!("the refusal is reported");
        };
        assert_eq!(sent, 3, "a4(1), a4(2), a6(1) went; a6(2) is the refused one");
        // Without an IPv6 socket an IPv6 message is refused, never sent over IPv4.
        let mut s = FamilySockets::new(Rec::default(), None);
        let Err(UdpError::Send { sent, source }) = s.send_batch(&tx(&to), Instant::ZERO) else {
            panic!("an IPv6 message without an IPv6 socket is refused");
        };
        assert_eq!((sent, source.raw_os_error()), (2, Some(libc::EAFNOSUPPORT)));
        assert_eq!(s.v4().unwrap().sent, vec![a4(1), a4(2)]);
    }

    #[test]
    fn a_full_socket_ends_the_batch_where_it_stopped() {
        let v4 = Rec { room: Some(1), ..Rec::default() };
        let mut s = FamilySockets::new(v4, Some(Rec::default()));
        let to = [a6(1), a4(1), a4(2), a6(2)];
        assert_eq!(s.send_batch(&tx(&to), Instant::ZERO).unwrap(), 2);
        assert_eq!(s.v6().unwrap().sent, vec![a6(1)], "nothing behind the full socket's run");
    }

    #[test]
    fn both_sockets_are_read_and_take_turns_at_going_first() {
        let v4 = Rec { queued: vec![a4(1), a4(2), a4(3)], ..Rec::default() };
        let v6 = Rec { queued: vec![a6(1), a6(2), a6(3)], ..Rec::default() };
        let mut s = FamilySockets::new(v4, Some(v6));
        let mut bufs = vec![vec![0u8; 16]; 4];
        let mut metas = vec![RecvMeta::default(); 4];
        let n = s.recv_batch(&mut bufs, &mut metas, Duration::ZERO).unwrap();
        let srcs: Vec<SocketAddr> = metas[..n].iter().map(|m| m.src).collect();
        assert_eq!(srcs, vec![a6(1), a6(2), a6(3), a4(1)]);
        let n = s.recv_batch(&mut bufs, &mut metas, Duration::ZERO).unwrap();
        let srcs: Vec<SocketAddr> = metas[..n].iter().map(|m| m.src).collect();
        assert_eq!(srcs, vec![a4(2), a4(3)], "IPv4 first this time; IPv6 is empty");
    }

    #[test]
    fn a_receive_error_is_reported_only_when_nothing_came() {
        let v4 = Rec { fail_recv: true, ..Rec::default() };
        let v6 = Rec { queued: vec![a6(1)], ..Rec::default() };
        let mut s = FamilySockets::new(v4, Some(v6));
        let mut bufs = vec![vec![0u8; 16]; 4];
        let mut metas = vec![RecvMeta::default(); 4];
        assert_eq!(s.recv_batch(&mut bufs, &mut metas, Duration::ZERO).unwrap(), 1);
        assert!(s.recv_batch(&mut bufs, &mut metas, Duration::ZERO).is_err());
    }

    #[test]
    fn gso_takes_the_lower_limits_of_the_two() {
        let v4 = Rec { limits: Some(GsoLimits { segments: 8, bytes: 65507 }), ..Rec::default() };
        let v6 = Rec { limits: Some(GsoLimits { segments: 63, bytes: 9000 }), ..Rec::default() };
        let s = FamilySockets::new(v4, Some(v6));
        assert_eq!(s.gso_limits(), GsoLimits { segments: 8, bytes: 9000 });
        let one = FamilySockets::new(Rec::default(), None).gso_limits();
        assert_eq!(one, GsoLimits { segments: 64, bytes: 65507 });
    }
}
