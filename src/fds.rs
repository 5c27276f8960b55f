//! File descriptors that outlive a process: passed to another process over a unix socket
//! (`SCM_RIGHTS`), kept across an `execve` of the same process, or given back by systemd's fd
//! store (`LISTEN_FDS`). The one module that turns a descriptor number into an owned file.
//!
//! # Contract
//! - [`send`] and [`recv`] move one length-prefixed message of at most [`MAX_MESSAGE`] bytes
//!   and at most [`MAX_FDS`] descriptors, which ride on its first `sendmsg`. Descriptors that
//!   arrive cut short (`MSG_CTRUNC`) or a stream that ends mid-message is an error, and every
//!   descriptor that did arrive is closed.
//! - [`inherit`] takes ownership of a descriptor number this process was given by its
//!   previous image or by systemd: it checks the number is open first, and marks it
//!   close-on-exec, so it never leaks into a child.
//! - [`peer`] is the kernel's word on who is at the other end of a unix socket
//!   (`SO_PEERCRED`), which no peer can forge.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sendmsg, sockopt,
};

/// The longest message [`send`] and [`recv`] carry.
pub const MAX_MESSAGE: usize = 16 << 20;
/// The most descriptors one message carries (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS: usize = 250;

/// Sends `message` and `fds` to the other end of `sock`: a 4-byte big-endian length, then the
/// message, the descriptors riding on the first `sendmsg`.
pub fn send(sock: &UnixStream, message: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if message.len() > MAX_MESSAGE || fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "message or fd list too long"));
    }
    let mut framed = Vec::with_capacity(4 + message.len());
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
    framed.extend_from_slice(message);
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut sent = 0;
    while sent < framed.len() {
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !raw.is_empty() { &rights } else { &[] };
        let iov = [IoSlice::new(&framed[sent..])];
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Receives one message sent by [`send`], with the descriptors that came with it
/// (close-on-exec).
///
/// # Errors
/// `UnexpectedEof` when the stream ends before a whole message; `InvalidData` for a message
/// longer than [`MAX_MESSAGE`] or descriptors cut short (those that arrived are closed).
pub fn recv(sock: &UnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    recv_by(sock, None)
}

/// [`recv`], with the whole message due by `deadline` (not each read: a peer that sends a
/// byte at a time cannot stretch it). Sets the socket's read timeout.
///
/// # Errors
/// As [`recv`]; `TimedOut` once `deadline` passed, or `WouldBlock` when a read timed out.
pub fn recv_by(
    sock: &UnixStream,
    deadline: Option<std::time::Instant>,
) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut first = vec![0u8; 64 * 1024];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (got, fds, cut) = loop {
        time_left(sock, deadline)?;
        let mut iov = [IoSliceMut::new(&mut first)];
        let msg = match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                for fd in received {
                    // SAFETY: the kernel has just installed `fd` in this process for this
                    // message (SCM_RIGHTS); nothing else knows the number, so it is owned here.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        break (msg.bytes, fds, msg.flags.contains(MsgFlags::MSG_CTRUNC));
    };
    if cut {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "descriptors arrived cut short"));
    }
    if got == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut message = first[..got].to_vec();
    let mut stream = sock;
    while message.len() < 4 {
        let want = 4 - message.len();
        time_left(sock, deadline)?;
        read_more(&mut stream, &mut message, want)?;
    }
    let len = u32::from_be_bytes([message[0], message[1], message[2], message[3]]) as usize;
    if len > MAX_MESSAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "message too long"));
    }
    while message.len() < 4 + len {
        let want = 4 + len - message.len();
        time_left(sock, deadline)?;
        read_more(&mut stream, &mut message, want)?;
    }
    if message.len() > 4 + len {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more than one message at once"));
    }
    Ok((message.split_off(4), fds))
}

/// Sets `sock`'s read timeout to what is left until `deadline`; `TimedOut` when nothing is.
fn time_left(sock: &UnixStream, deadline: Option<std::time::Instant>) -> io::Result<()> {
    let Some(deadline) = deadline else { return Ok(()) };
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    sock.set_read_timeout(Some(left))
}

fn read_more(stream: &mut &UnixStream, into: &mut Vec<u8>, want: usize) -> io::Result<()> {
    use std::io::Read as _;
    let mut chunk = vec![0u8; want.min(64 * 1024)];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    into.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// Who is at the other end of a unix socket, as the kernel says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its process.
    pub pid: i32,
    /// Its effective user.
    pub uid: u32,
}

/// The credentials of the process at the other end of `sock` (`SO_PEERCRED`: taken when it
/// connected, unforgeable).
pub fn peer(sock: &UnixStream) -> io::Result<Peer> {
    let cred = getsockopt(sock, sockopt::PeerCredentials).map_err(io::Error::from)?;
    Ok(Peer { pid: cred.pid(), uid: cred.uid() })
}

/// Takes ownership of descriptor `fd`, which this process was given at start (by its previous
/// image across `execve`, or by systemd), and marks it close-on-exec.
///
/// # Errors
/// `EBADF` when `fd` is not open, or is one of stdin, stdout and stderr.
pub fn inherit(fd: RawFd) -> io::Result<OwnedFd> {
    if fd <= 2 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: F_GETFD only reads the flags of the number; it fails with EBADF when nothing is
    // open there, and touches nothing either way.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open (just checked) and was handed to this process to own: the handover
    // names each number once, and nothing else in the process uses it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(owned.as_fd(), true)?;
    Ok(owned)
}

/// Sets or clears close-on-exec on `fd` (cleared: it survives an `execve`).
pub fn set_cloexec(fd: BorrowedFd<'_>, on: bool) -> io::Result<()> {
    let flags = FdFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFD).map_err(io::Error::from)?);
    let flags = if on { flags | FdFlag::FD_CLOEXEC } else { flags - FdFlag::FD_CLOEXEC };
    fcntl(fd, FcntlArg::F_SETFD(flags)).map_err(io::Error::from)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read as _, Seek as _, Write as _};

    use super::*;

    fn file_with(text: &str) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    /// Descriptors arrive as the same open files, with the message; the sender's close does not
    /// close the receiver's.
    #[test]
    fn descriptors_and_a_message_cross_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let files = [file_with("one"), file_with("two")];
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(AsFd::as_fd).collect();
        send(&a, b"hello", &fds).unwrap();
        drop(files);
        let (message, got) = recv(&b).unwrap();
        assert_eq!(message, b"hello");
        assert_eq!(got.len(), 2);
        for (fd, want) in got.into_iter().zip(["one", "two"]) {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut text = String::new();
            f.read_to_string(&mut text).unwrap();
            assert_eq!(text, want);
            let flags = fcntl(f.as_fd(), FcntlArg::F_GETFD).unwrap();
            assert!(FdFlag::from_bits_truncate(flags).contains(FdFlag::FD_CLOEXEC));
        }
        assert_eq!(
            peer(&b).unwrap(),
            Peer { pid: std::process::id() as i32, uid: nix::unistd::geteuid().as_raw() }
        );
    }

    /// A message longer than one read arrives whole; a stream that ends early is an error.
    #[test]
    fn a_long_message_arrives_whole_and_a_cut_one_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        let long: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let sender = std::thread::spawn(move || {
            send(&a, &long, &[]).unwrap();
            a.shutdown(std::net::Shutdown::Both).unwrap();
            long
        });
        let (got, fds) = recv(&b).unwrap();
        assert_eq!(got, sender.join().unwrap());
        assert!(fds.is_empty());
        assert_eq!(recv(&b).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&[0, 0, 0, 9, 1, 2]).unwrap();
        drop(a);
        assert_eq!(recv(&b).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn only_an_open_descriptor_is_inherited() {
        assert!(inherit(1).is_err(), "stdout is never taken over");
        let f = file_with("y");
        let raw = f.as_raw_fd();
        // A number nothing is open at.
        let unused = nix::unistd::dup(f.as_fd()).unwrap();
        let unused_raw = unused.as_raw_fd();
        drop(unused);
        assert_eq!(inherit(unused_raw).unwrap_err().raw_os_error(), Some(libc::EBADF));
        let owned = inherit(
            nix::unistd::dup(f.as_fd())
                .map(|d| {
                    let r = d.as_raw_fd();
                    std::mem::forget(d);
                    r
                })
                .unwrap(),
        )
        .unwrap();
        assert_ne!(owned.as_raw_fd(), raw);
    }
}
