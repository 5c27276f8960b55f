//! A running weft handed to the next process of this node without losing a packet: an upgrade
//! by `weft run --takeover` (another process, over a unix socket in the state dir) or by
//! `SIGHUP` (the same process re-executes its binary, see [`super::upgrade`]).
//!
//! # What is handed over
//! A [`Handover`] message and, beside it, descriptors: the state dir's lock, the takeover
//! socket's listener, the health port's listener (when there is one), and the data plane's TUN
//! queues and sockets ([`crate::dataplane::Dataplane::hand_over`]). The message carries what the
//! next process cannot read back from them: the lease as the keeper holds it
//! ([`KeeperHandover`]: the next keeper goes on as the same incarnation, so there is no create,
//! no presence clash, no subnet change), the network config (etcd may be unreachable during the
//! upgrade), the published address, and the route table (the next process forwards from its
//! first packet, before its own listing of the store).
//!
//! # The takeover protocol
//! Over `<state-dir>/takeover.sock` (mode 0600, in the 0700 state dir), each message one
//! [`fds::send`] frame of JSON ([`Message`]):
//! 1. the new process connects and sends [`Message::Request`]; the running one checks with
//!    `SO_PEERCRED` that it is of its own user (anyone else is refused, nothing changed);
//! 2. the running one freezes its lease keeper (no store call until the end), and sends
//!    [`Message::Handover`] with the descriptors (duplicates: it keeps forwarding);
//! 3. the new one starts forwarding on them and sends [`Message::Forwarding`];
//! 4. the running one stops reading (what is queued in the kernel is the new one's), ends its
//!    keeper without a store call, sends [`Message::Released`] and exits 0.
//!
//! A failure before step 4 (a refusal, a message that does not parse, the new process gone, no
//! answer within [`STEP_TIMEOUT`]) leaves the running process forwarding and holding the lease:
//! it thaws its keeper and says why; the new one exits non-zero, saying why. After `Released`
//! the new process holds everything.
//!
//! # Contract
//! The message parses as JSON of a known [`VERSION`]; a newer or older build that cannot read
//! it refuses at step 3 and the running process goes on. Nothing in it is secret (no
//! credentials: those come from the next process's own flags and files).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};

use crate::dataplane::DataplaneLayout;
use crate::fds;
use crate::lease::keeper::KeeperHandover;
use crate::lease::record::{Incarnation, LeaseName, NodeId};
use crate::route::{Peer, Peer6, PeerBackend, Wireguard6};
use crate::vocab::{MacAddr, WgPublicKey};

/// The takeover socket's name in the state dir.
pub(crate) const SOCKET_FILE: &str = "takeover.sock";
/// The handover message's format. A process refuses one of another version.
pub(crate) const VERSION: u32 = 1;
/// The longest either side waits for the other's next message, from the wait's start to the
/// message's last byte.
pub(crate) const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest the running process waits for a request, from the accept to its last byte: a
/// request is a few bytes, sent at once by a process that just connected.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// One message of the takeover protocol (see the module docs).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "message")]
pub(crate) enum Message {
    /// From the new process: hand everything over, please.
    Request {
        /// The format the new process reads.
        version: u32,
    },
    /// From the running process: here it is (the descriptors ride with it).
    Handover(Box<Handover>),
    /// From the running process: no, and why. Nothing changed.
    Refused {
        /// Why.
        why: String,
        /// The running process's PID (`SO_PEERCRED` on the takeover socket names whoever
        /// bound it, a process long gone after a handover).
        #[serde(default)]
        pid: Option<u32>,
    },
    /// From the new process: forwarding on the descriptors; stop.
    Forwarding,
    /// From the new process: the handover could not be taken, and why; go on.
    Failed {
        /// Why.
        why: String,
    },
    /// From the running process: stopped; everything is the new process's.
    Released,
}

/// What the next process needs besides the descriptors (see the module docs).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Handover {
    /// [`VERSION`].
    pub(crate) version: u32,
    /// The process that handed over.
    pub(crate) pid: u32,
    /// This node's identity (the next process reads its own from the state dir: they must be
    /// the same).
    pub(crate) node: NodeId,
    /// The network config, as JSON in flannel's schema.
    pub(crate) network: String,
    /// The lease and the presence, as the keeper holds them.
    pub(crate) keeper: KeeperHandover,
    /// The address published as `PublicIP`.
    pub(crate) public_ip: Ipv4Addr,
    /// The address published as `PublicIPv6`, when one is.
    pub(crate) public_ipv6: Option<Ipv6Addr>,
    /// Whether a health port listener is among the descriptors.
    pub(crate) health: bool,
    /// The data plane's descriptors (`None` with `--dataplane none`).
    pub(crate) dataplane: Option<DataplaneLayout>,
    /// The route table's peers.
    pub(crate) routes: Vec<HandedRoute>,
}

/// One route of the handed table: a [`Peer`] in the message's words.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandedRoute {
    /// The lease key's name (both halves).
    pub(crate) key: String,
    /// `PublicIP`.
    pub(crate) public_ip: Ipv4Addr,
    /// `vxlan`, `udp` or `other`.
    pub(crate) backend: String,
    /// The VTEP MAC (vxlan).
    pub(crate) vtep_mac: Option<String>,
    /// The VNI (vxlan, when the lease names one).
    pub(crate) vni: Option<u32>,
    /// The peer's weft node identity.
    pub(crate) node: Option<NodeId>,
    /// Kept past its key's expiry.
    pub(crate) stale: bool,
    /// The IPv6 half's `PublicIPv6` and VTEP MAC.
    pub(crate) ipv6: Option<(Ipv6Addr, String)>,
    /// A wireguard peer's public key (base64) and port (absent from older weft's messages).
    #[serde(default)]
    pub(crate) wireguard: Option<(String, Option<u16>)>,
    /// A wireguard IPv6 half's key (base64) and port (absent from older weft's messages, and
    /// for vxlan).
    #[serde(default)]
    pub(crate) wireguard6: Option<(String, Option<u16>)>,
    /// The lease's `WeftIncarnation` (absent from older weft's messages, and for flannel's).
    #[serde(default)]
    pub(crate) incarnation: Option<Incarnation>,
}

impl HandedRoute {
    /// The message's form of `peer`.
    pub(crate) fn of(peer: &Peer) -> Self {
        let name = LeaseName { subnet: peer.subnet, ipv6: peer.ipv6.map(|p| p.subnet) };
        Self {
            key: name.key_name(),
            public_ip: peer.public_ip,
            backend: match peer.backend {
                PeerBackend::Vxlan => "vxlan",
                PeerBackend::Udp => "udp",
                PeerBackend::HostGw => "host-gw",
                PeerBackend::Ipip => "ipip",
                PeerBackend::Wireguard { .. } => "wireguard",
                PeerBackend::Other => "other",
            }
            .to_owned(),
            vtep_mac: peer.vtep_mac.map(|m| m.to_string()),
            vni: peer.vni,
            node: peer.node.clone(),
            stale: peer.stale,
            ipv6: peer.ipv6.map(|p| (p.public_ip, p.vtep_mac.to_string())),
            wireguard: match peer.backend {
                PeerBackend::Wireguard { key, port } => Some((key.to_string(), port)),
                _ => None,
            },
            wireguard6: peer.ipv6.and_then(|p| p.wireguard).map(|w| (w.key.to_string(), w.port)),
            incarnation: peer.incarnation.clone(),
        }
    }

    /// The peer again; `None` for a route that does not parse (it is then left to the route
    /// watcher's first listing).
    pub(crate) fn peer(&self) -> Option<Peer> {
        let name = LeaseName::parse(&self.key).ok()?;
        let ipv6 = match (&self.ipv6, name.ipv6) {
            (Some((public_ip, mac)), Some(subnet)) => Some(Peer6 {
                subnet,
                public_ip: *public_ip,
                vtep_mac: MacAddr::parse(mac)?,
                wireguard: match &self.wireguard6 {
                    Some((key, port)) => {
                        Some(Wireguard6 { key: WgPublicKey::parse(key).ok()?, port: *port })
                    }
                    None => None,
                },
            }),
            _ => None,
        };
        Some(Peer {
            subnet: name.subnet,
            public_ip: self.public_ip,
            backend: match self.backend.as_str() {
                "vxlan" => PeerBackend::Vxlan,
                "udp" => PeerBackend::Udp,
                "host-gw" => PeerBackend::HostGw,
                "ipip" => PeerBackend::Ipip,
                "wireguard" => {
                    let (key, port) = self.wireguard.as_ref()?;
                    PeerBackend::Wireguard { key: WgPublicKey::parse(key).ok()?, port: *port }
                }
                _ => PeerBackend::Other,
            },
            vtep_mac: match &self.vtep_mac {
                Some(m) => Some(MacAddr::parse(m)?),
                None => None,
            },
            vni: self.vni,
            node: self.node.clone(),
            stale: self.stale,
            incarnation: self.incarnation.clone(),
            ipv6,
        })
    }
}

/// A handover as it arrives: the message and its descriptors, in the order
/// [`Outgoing::fds`] sent them.
#[derive(Debug)]
pub(crate) struct Incoming {
    /// The message.
    pub(crate) handover: Handover,
    /// The state dir's lock.
    pub(crate) lock: Option<OwnedFd>,
    /// The takeover socket's listener.
    pub(crate) takeover: Option<OwnedFd>,
    /// The health port's listener.
    pub(crate) health: Option<OwnedFd>,
    /// The data plane's descriptors, in its layout's order.
    pub(crate) dataplane: Vec<OwnedFd>,
    /// Who to tell that the new process forwards ([`Message::Forwarding`]) and to wait for
    /// ([`Message::Released`]): the running process.
    pub(crate) from: Option<UnixStream>,
}

impl Incoming {
    /// Splits `fds` as [`Outgoing`] laid them out.
    fn new(
        handover: Handover,
        fds: Vec<OwnedFd>,
        from: Option<UnixStream>,
    ) -> anyhow::Result<Self> {
        if handover.version != VERSION {
            bail!(
                "the running weft hands over in format {}; this build reads {VERSION}",
                handover.version
            );
        }
        let mut fds = fds.into_iter();
        let mut next = |what: &str| fds.next().ok_or_else(|| anyhow!("no descriptor for {what}"));
        let lock = next("the state dir's lock")?;
        let takeover = next("the takeover socket")?;
        let health = if handover.health { Some(next("the health port")?) } else { None };
        Ok(Self {
            handover,
            lock: Some(lock),
            takeover: Some(takeover),
            health,
            dataplane: fds.collect(),
            from,
        })
    }

    /// The state dir's lock's descriptor (once).
    pub(crate) fn take_lock(&mut self) -> anyhow::Result<OwnedFd> {
        self.lock.take().ok_or_else(|| anyhow!("the handed lock was taken already"))
    }

    /// The takeover listener's descriptor (once).
    pub(crate) fn take_takeover(&mut self) -> anyhow::Result<OwnedFd> {
        self.takeover.take().ok_or_else(|| anyhow!("the handed takeover socket was taken already"))
    }

    /// Tells the running process the handover failed, so it goes on.
    pub(crate) fn failed(&mut self, why: &str) {
        if let Some(conn) = self.from.take() {
            let _ = send(&conn, &Message::Failed { why: why.to_owned() }, &[]);
        }
    }
}

/// Tells the running process on `from` that this one forwards, and waits until it has stopped
/// and released everything ([`Message::Released`]).
pub(crate) fn forwarding(from: Option<UnixStream>) -> anyhow::Result<()> {
    let Some(conn) = from else { return Ok(()) };
    send(&conn, &Message::Forwarding, &[])?;
    match receive(&conn, STEP_TIMEOUT)?.0 {
        Message::Released => Ok(()),
        other => bail!("the running weft answered {other:?} to Forwarding"),
    }
}

/// A handover to send: the message and the descriptors it names.
#[derive(Debug)]
pub(crate) struct Outgoing {
    /// The message.
    pub(crate) handover: Handover,
    /// The state dir's lock, the takeover listener, the health listener (when
    /// [`Handover::health`]) and the data plane's descriptors, in that order.
    pub(crate) fds: Vec<OwnedFd>,
}

/// Sends one message (and descriptors).
pub(crate) fn send(
    conn: &UnixStream,
    message: &Message,
    fds: &[BorrowedFd<'_>],
) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(message).context("encoding a takeover message")?;
    fds::send(conn, &bytes, fds).context("sending a takeover message")
}

/// Receives one message (and its descriptors), whole within `within`.
pub(crate) fn receive(
    conn: &UnixStream,
    within: Duration,
) -> anyhow::Result<(Message, Vec<OwnedFd>)> {
    let deadline = std::time::Instant::now() + within;
    let (bytes, fds) = fds::recv_by(conn, Some(deadline)).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            anyhow!("no whole message within {within:?}")
        }
        std::io::ErrorKind::UnexpectedEof => anyhow!("the other process closed the connection"),
        _ => anyhow::Error::from(e).context("receiving a takeover message"),
    })?;
    let message = serde_json::from_slice(&bytes)
        .context("a takeover message that does not parse (a build of another format?)")?;
    Ok((message, fds))
}

/// The takeover socket's path for `state_dir`.
pub(crate) fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join(SOCKET_FILE)
}

/// Asks the weft running on `state_dir` to hand over (`weft run --takeover`): `Ok(None)` when
/// none runs there (no socket, or nobody listening on it); an error when it refuses or the
/// handover cannot be read, and then it goes on as before.
pub(crate) fn request(state_dir: &Path) -> anyhow::Result<Option<Incoming>> {
    let path = socket_path(state_dir);
    let conn = match UnixStream::connect(&path) {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to {}", path.display())),
    };
    let me = nix::unistd::geteuid().as_raw();
    // The listener's credentials are those of the process that bound it, which may be long
    // gone (the socket is handed over): its user is the one that matters, not its PID.
    let peer = fds::peer(&conn).context("asking who listens on the takeover socket")?;
    if peer.uid != me {
        bail!(
            "{} was bound by uid {}, not this user's ({me}): not taking over from it",
            path.display(),
            peer.uid
        );
    }
    send(&conn, &Message::Request { version: VERSION }, &[])?;
    let (message, fds) = receive(&conn, STEP_TIMEOUT)?;
    match message {
        Message::Handover(handover) => {
            let mut conn = Some(conn);
            match Incoming::new(*handover, fds, None) {
                Ok(mut incoming) => {
                    incoming.from = conn.take();
                    Ok(Some(incoming))
                }
                Err(e) => {
                    if let Some(conn) = conn {
                        let _ = send(&conn, &Message::Failed { why: format!("{e:#}") }, &[]);
                    }
                    Err(e)
                }
            }
        }
        Message::Refused { why, pid: Some(pid) } => {
            bail!("the running weft (pid {pid}) refused: {why}")
        }
        Message::Refused { why, pid: None } => bail!("the running weft refused: {why}"),
        other => bail!("the running weft answered {other:?} to a takeover request"),
    }
}
