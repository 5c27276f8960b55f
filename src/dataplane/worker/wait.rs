//! Where a forwarding thread sleeps when it has nothing to do, and how it is told to stop.
//!
//! Each thread owns one [`Idle`]: a `mio::Poll` (epoll) with the thread's TUN queue and/or
//! socket registered for reading, and a `mio::Waker` that [`StopSignal::stop`] fires, so a
//! thread asleep wakes at once when told to stop (a re-bind of the sockets waits for no timer).
//!
//! # Contract
//! mio registers descriptors edge-triggered: a descriptor is reported when it *becomes*
//! readable. So a loop may call [`Idle::wait`] only after it has seen every descriptor it
//! registered come back empty (`EAGAIN`, or a read of nothing) since its last wait, which is
//! what the run loops in [`super`] do: they wait only after a step that read nothing. The
//! `ceiling` is a safety net, not a clock: a missed edge (a read that failed with another error
//! and left packets queued) costs at most that long.
//!
//! Queues without a file descriptor (the in-memory fakes) are waited on with
//! [`TunIo::wait_readable`], briefly, and then looked at again.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use super::io::TunIo;

const WAKER: Token = Token(usize::MAX);

/// Tells a worker's threads to stop: a flag each loop checks between steps, and a waker per
/// thread for a thread asleep in [`Idle::wait`].
#[derive(Debug, Default)]
pub struct StopSignal {
    stopped: AtomicBool,
    wakers: Mutex<Vec<Arc<Waker>>>,
    /// Where [`StopSignal::sleep`] waits: `stop` notifies it holding the lock, so a sleeper
    /// that saw the flag unset under the lock cannot miss the notification.
    parked: (Mutex<()>, Condvar),
}

impl StopSignal {
    /// A signal not yet given.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Whether [`StopSignal::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The flag alone (for [`super::supervise`]'s wait between restarts).
    pub(crate) fn flag(&self) -> &AtomicBool {
        &self.stopped
    }

    /// Sets the flag and wakes every thread asleep in its [`Idle`] or in
    /// [`StopSignal::sleep`].
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        for w in self.wakers.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            // A waker whose poll is gone (its thread ended) has nothing to wake.
            let _ = w.wake();
        }
        let (lock, parked) = &self.parked;
        let _held = lock.lock().unwrap_or_else(PoisonError::into_inner);
        parked.notify_all();
    }

    /// Sleeps `d`, or less if the signal is given meanwhile (at once if it was already), for
    /// a thread with no descriptor to wait on (the wireguard timers): stopping such a thread
    /// waits for no timer, and a handover's quiesce (during which nobody forwards) is short.
    pub fn sleep(&self, d: Duration) {
        let (lock, parked) = &self.parked;
        let held = lock.lock().unwrap_or_else(PoisonError::into_inner);
        if self.is_stopped() {
            return;
        }
        // A spurious wake-up only ends this sleep early: the caller looks at everything again.
        let _ = parked.wait_timeout(held, d).unwrap_or_else(PoisonError::into_inner);
    }

    fn register(&self, waker: Arc<Waker>) {
        self.wakers.lock().unwrap_or_else(PoisonError::into_inner).push(waker);
    }
}

/// What ended an [`Idle::wait`]: which of the registered descriptors epoll reported readable.
/// A loop reads the one that woke it first: on a socket's wake-up, the datagram is received
/// and its inner packet written before the TUN queue (found empty, most of the time) is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Woken {
    /// The first descriptor (`fds[0]`: the TUN queue, for a one-thread loop).
    pub first: bool,
    /// Any other descriptor (the socket, and its IPv6 twin).
    pub rest: bool,
}

/// One forwarding thread's place to sleep; see the module docs.
pub struct Idle {
    poll: Option<(Poll, Events)>,
    ceiling: Duration,
}

impl Idle {
    /// An `Idle` that wakes when any of `fds` becomes readable, when `stop` is given, or after
    /// `ceiling`. With any `None` among `fds` (a fake without a descriptor) it does not poll:
    /// see [`Idle::wait`].
    pub fn new(fds: &[Option<RawFd>], stop: &StopSignal, ceiling: Duration) -> io::Result<Self> {
        if fds.iter().any(Option::is_none) {
            return Ok(Self { poll: None, ceiling });
        }
        let poll = Poll::new()?;
        for (i, fd) in fds.iter().flatten().enumerate() {
            poll.registry().register(&mut SourceFd(fd), Token(i), Interest::READABLE)?;
        }
        stop.register(Arc::new(Waker::new(poll.registry(), WAKER)?));
        Ok(Self { poll: Some((poll, Events::with_capacity(fds.len() + 1))), ceiling })
    }

    /// Sleeps until a registered descriptor becomes readable, the stop signal is given, or the
    /// ceiling passes; without descriptors, until `tun` has a packet or 1 ms passes. Says which
    /// descriptors were reported (without descriptors: `first` when `tun` has a packet). An
    /// error or a signal just ends the wait early, with nothing reported: the caller looks at
    /// everything again.
    pub fn wait<T: TunIo>(&mut self, tun: &T) -> Woken {
        let mut woken = Woken::default();
        match &mut self.poll {
            Some((poll, events)) => {
                if poll.poll(events, Some(self.ceiling)).is_ok() {
                    for e in events.iter() {
                        match e.token() {
                            Token(0) => woken.first = true,
                            WAKER => {}
                            _ => woken.rest = true,
                        }
                    }
                }
            }
            None => {
                woken.first =
                    tun.wait_readable(self.ceiling.min(Duration::from_millis(1))).unwrap_or(false);
            }
        }
        woken
    }
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;
    use std::time::Instant;

    use super::*;
    use crate::dataplane::worker::fake::FakeTun;

    const CEILING: Duration = Duration::from_secs(10);

    fn socket() -> UdpSocket {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_nonblocking(true).unwrap();
        s
    }

    #[test]
    fn a_thread_asleep_wakes_at_once_when_told_to_stop() {
        let (sock, stop, tun) = (socket(), StopSignal::new(), FakeTun::new());
        let mut idle = Idle::new(&[Some(sock.as_raw_fd())], &stop, CEILING).unwrap();
        let asleep = std::thread::spawn(move || {
            let t = Instant::now();
            idle.wait(&*tun);
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        stop.stop();
        let slept = asleep.join().unwrap();
        assert!(stop.is_stopped());
        assert!(slept < Duration::from_secs(2), "slept {slept:?}: the stop did not wake it");
    }

    #[test]
    fn a_thread_in_sleep_wakes_at_once_when_told_to_stop() {
        let stop = StopSignal::new();
        let asleep = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let t = Instant::now();
                stop.sleep(CEILING);
                t.elapsed()
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        stop.stop();
        let slept = asleep.join().unwrap();
        assert!(slept < Duration::from_secs(2), "slept {slept:?}: the stop did not wake it");
        let t = Instant::now();
        stop.sleep(CEILING);
        assert!(t.elapsed() < Duration::from_secs(2), "a stopped signal sleeps not at all");
    }

    #[test]
    fn a_datagram_wakes_the_thread_and_a_drained_socket_lets_it_sleep_again() {
        let (sock, stop, tun) = (socket(), StopSignal::new(), FakeTun::new());
        let mut idle =
            Idle::new(&[Some(sock.as_raw_fd())], &stop, Duration::from_millis(300)).unwrap();
        let peer = socket();
        peer.send_to(b"x", sock.local_addr().unwrap()).unwrap();
        let t = Instant::now();
        idle.wait(&*tun);
        assert!(t.elapsed() < Duration::from_millis(250), "not woken by the datagram");
        let mut buf = [0u8; 16];
        assert_eq!(sock.recv(&mut buf).unwrap(), 1);
        assert_eq!(
            sock.recv(&mut buf).map_err(|e| e.kind()),
            Err(std::io::ErrorKind::WouldBlock),
            "drained"
        );
        // Nothing new arrived: the next wait lasts until the ceiling.
        let t = Instant::now();
        idle.wait(&*tun);
        assert!(t.elapsed() >= Duration::from_millis(250), "woke with nothing to do");
    }

    /// The wait says which descriptor woke it: a loop then reads that one first.
    #[test]
    fn the_wait_says_which_descriptor_woke_it() {
        let (first, second, stop, tun) = (socket(), socket(), StopSignal::new(), FakeTun::new());
        let fds = [Some(first.as_raw_fd()), Some(second.as_raw_fd())];
        let mut idle = Idle::new(&fds, &stop, CEILING).unwrap();
        let peer = socket();
        peer.send_to(b"x", second.local_addr().unwrap()).unwrap();
        assert_eq!(idle.wait(&*tun), Woken { first: false, rest: true });
        peer.send_to(b"x", first.local_addr().unwrap()).unwrap();
        assert_eq!(idle.wait(&*tun), Woken { first: true, rest: false });
    }

    #[test]
    fn a_stop_given_before_the_thread_sleeps_is_not_missed() {
        let (sock, stop, tun) = (socket(), StopSignal::new(), FakeTun::new());
        let mut idle = Idle::new(&[Some(sock.as_raw_fd())], &stop, CEILING).unwrap();
        stop.stop();
        let t = Instant::now();
        idle.wait(&*tun);
        assert!(t.elapsed() < Duration::from_secs(2), "the waker's event was lost");
    }
}
