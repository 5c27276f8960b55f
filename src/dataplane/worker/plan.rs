//! Send planning, pure: which socket each encapsulated datagram leaves from, which of them go
//! out together as one GSO message, and where each lies, batch by batch. No I/O and no
//! copying: [`super::tx`] copies the runs into its send buffer and sends each batch with one
//! `sendmmsg` per socket (in the spirit of quinn's `TransmitBuf`).
//!
//! # Rules
//! - Order: datagrams leave in the order they were read. A run never skips a datagram, and
//!   a batch's messages are in read order: TCP takes reordering for loss.
//! - Sockets: a datagram leaves from socket `flow % sockets`, so one flow keeps one outer
//!   source port.
//! - Runs: consecutive datagrams to one peer from one socket form a GSO run
//!   ([`coalesce_plan`]: one destination, within the socket's [`GsoLimits`], one segment
//!   size but a shorter last). A run is copied back to back into the send buffer; a run of one
//!   datagram is sent from its read slot, uncopied.
//! - Room: a batch holds at most [`MAX_BATCH`] messages and as many runs as fit in the buffer
//!   together. A run that does not fit ends the batch; as the batch's first message it is sent
//!   as single datagrams instead (the first of them now, the rest in the next batches).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::ops::Range;

use crate::dataplane::sys::udp::gso_tail::GsoLimits;
use crate::dataplane::sys::udp::{self, MAX_BATCH};

/// A datagram encapsulated in its read slot, waiting to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pending {
    /// The read slot it lies in.
    pub(crate) slot: usize,
    /// The peer.
    pub(crate) dst: SocketAddr,
    /// The datagram's bytes within the slot.
    pub(crate) range: Range<usize>,
    /// The inner flow's hash: it picks the socket.
    pub(crate) flow: u32,
}

/// What one planned message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Carries {
    /// `pending[index]` alone, sent from its read slot.
    One {
        /// Its index in the pending list.
        index: usize,
    },
    /// `pending[first..first + count]`, copied back to back into `buf[start..start + bytes]`,
    /// sent as one GSO message of `segment_size`.
    Run {
        /// The first datagram's index in the pending list.
        first: usize,
        /// How many datagrams.
        count: usize,
        /// Where the run starts in the send buffer.
        start: usize,
        /// Its length there.
        bytes: usize,
        /// The GSO segment size.
        segment_size: u16,
    },
}

/// One message of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    /// The socket it leaves from (an index into the pool).
    pub(crate) sock: usize,
    /// The peer.
    pub(crate) dst: SocketAddr,
    /// What it carries.
    pub(crate) what: Carries,
}

/// Plans the batches of one TX pass over `pending`; see the module docs.
pub(crate) struct TxPlan<'a> {
    pending: &'a [Pending],
    next: usize,
}

impl<'a> TxPlan<'a> {
    /// A plan over `pending`, in read order.
    pub(crate) fn new(pending: &'a [Pending]) -> Self {
        Self { pending, next: 0 }
    }

    /// Plans the next batch into `out`: messages from `sockets` sockets, where socket `s` takes
    /// GSO messages within `limits(s)` (one datagram: no GSO), with runs laid out in a
    /// buffer of `buf_len` bytes (each batch reuses it from the start). Returns how many
    /// messages it planned: 0 once every datagram is planned.
    pub(crate) fn next_batch(
        &mut self,
        sockets: usize,
        limits: impl Fn(usize) -> GsoLimits,
        buf_len: usize,
        out: &mut [Planned; MAX_BATCH],
    ) -> usize {
        let pending = self.pending;
        let sockets = sockets.max(1);
        let sock_of = |p: &Pending| p.flow as usize % sockets;
        let (mut n, mut used) = (0, 0);
        while self.next < pending.len() && n < MAX_BATCH {
            let i = self.next;
            let sock = sock_of(&pending[i]);
            let stretch = pending[i..].iter().take_while(|p| sock_of(p) == sock).count();
            let runs =
                coalesce_plan(&pending[i..i + stretch], limits(sock), |p| (p.dst, p.range.len()));
            // A non-empty stretch always has a first run.
            let Some(run) = runs.into_iter().next() else { break };
            let dst = pending[i].dst;
            let what = match run.segment_size {
                Some(segment_size) if used + run.bytes <= buf_len => {
                    let start = used;
                    used += run.bytes;
                    self.next += run.count;
                    Carries::Run {
                        first: i,
                        count: run.count,
                        start,
                        bytes: run.bytes,
                        segment_size,
                    }
                }
                // No room left for the run: send what is planned first.
                Some(_) if n > 0 => break,
                _ => {
                    self.next += 1;
                    Carries::One { index: i }
                }
            };
            out[n] = Planned { sock, dst, what };
            n += 1;
        }
        n
    }
}

/// A run of datagrams that [`coalesce_plan`] puts into one [`udp::Transmit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Coalesced {
    /// Index of the first datagram of the run.
    pub(crate) start: usize,
    /// Datagrams in the run.
    pub(crate) count: usize,
    /// Their total length: the [`udp::Transmit::contents`] length once laid back to back.
    pub(crate) bytes: usize,
    /// The run's [`udp::Transmit::segment_size`]: the first datagram's length, or `None` for a run of
    /// one.
    pub(crate) segment_size: Option<u16>,
}

/// Groups consecutive datagrams into GSO runs, in order: a run has one destination, at most
/// `limits.segments` datagrams and `limits.bytes` in all (pass [`udp::BatchSocket::gso_limits`]);
/// every datagram has the first one's length except possibly the last, which is shorter and
/// ends the run (the wireguard-go rule). `key` gives each item's destination and datagram
/// length. The caller lays each run's datagrams back to back and sends it as one [`udp::Transmit`].
pub(crate) fn coalesce_plan<'a, T, F>(
    items: &'a [T],
    limits: GsoLimits,
    key: F,
) -> impl Iterator<Item = Coalesced> + 'a
where
    F: Fn(&T) -> (SocketAddr, usize) + 'a,
{
    let max_segments = limits.segments.clamp(1, udp::MAX_GSO_SEGMENTS);
    let max_bytes = limits.bytes.min(udp::MAX_GSO_BYTES);
    let mut next = 0;
    std::iter::from_fn(move || {
        let start = next;
        let (dst, seg) = key(items.get(start)?);
        let (mut count, mut bytes) = (1, seg);
        if (1..=max_bytes).contains(&seg) {
            while count < max_segments {
                let Some((d, len)) = items.get(start + count).map(&key) else { break };
                if d != dst || len == 0 || len > seg || bytes + len > max_bytes {
                    break;
                }
                count += 1;
                bytes += len;
                if len < seg {
                    break;
                }
            }
        }
        next = start + count;
        let segment_size = if count > 1 { u16::try_from(seg).ok() } else { None };
        Some(Coalesced { start, count, bytes, segment_size })
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::dataplane::sys::udp::gso_tail::TailRule;

    fn peer(d: u8) -> SocketAddr {
        SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, d), 8472))
    }

    /// Datagrams of `len` bytes to `peers[i]`, each in slot `i`, all of flow `flow`.
    fn pending(peers: &[u8], len: usize, flow: u32) -> Vec<Pending> {
        peers
            .iter()
            .enumerate()
            .map(|(slot, &d)| Pending { slot, dst: peer(d), range: 0..len, flow })
            .collect()
    }

    fn empty() -> [Planned; MAX_BATCH] {
        [Planned { sock: 0, dst: peer(0), what: Carries::One { index: 0 } }; MAX_BATCH]
    }

    /// Every batch of a whole plan.
    fn batches(p: &[Pending], sockets: usize, gso: usize, buf_len: usize) -> Vec<Vec<Planned>> {
        let mut plan = TxPlan::new(p);
        let mut out = empty();
        let mut all = Vec::new();
        loop {
            let n = plan.next_batch(sockets, |_| TailRule::Any.limits(gso), buf_len, &mut out);
            if n == 0 {
                return all;
            }
            all.push(out[..n].to_vec());
        }
    }

    /// The pending indices each message carries, flattened in send order.
    fn order(batches: &[Vec<Planned>]) -> Vec<usize> {
        batches
            .iter()
            .flatten()
            .flat_map(|m| match m.what {
                Carries::One { index } => index..index + 1,
                Carries::Run { first, count, .. } => first..first + count,
            })
            .collect()
    }

    #[test]
    fn a_run_to_one_peer_is_one_gso_message_and_alternating_peers_are_not() {
        let p = pending(&[2, 2, 2, 2], 1000, 7);
        let b = batches(&p, 1, 64, 256 * 1024);
        let run = Carries::Run { first: 0, count: 4, start: 0, bytes: 4000, segment_size: 1000 };
        assert_eq!(b, [vec![Planned { sock: 0, dst: peer(2), what: run }]]);
        let p = pending(&[2, 3, 2, 3], 1000, 7);
        let b = batches(&p, 1, 64, 256 * 1024);
        assert_eq!(b.len(), 1);
        assert!(b[0].iter().all(|m| matches!(m.what, Carries::One { .. })), "{b:?}");
        assert_eq!(order(&b), [0, 1, 2, 3]);
    }

    #[test]
    fn without_gso_every_datagram_is_its_own_message_from_its_slot() {
        let p = pending(&[2; 5], 1000, 7);
        let b = batches(&p, 1, 1, 256 * 1024);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].len(), 5);
        assert_eq!(order(&b), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn each_flow_leaves_from_its_own_socket_and_the_order_holds() {
        let mut p = pending(&[2, 2, 2, 2], 1000, 0);
        p[2].flow = 1;
        p[3].flow = 3;
        let b = batches(&p, 2, 64, 256 * 1024);
        let socks: Vec<usize> = b.iter().flatten().map(|m| m.sock).collect();
        assert_eq!(socks, [0, 1], "flows 1 and 3 share socket 1: {b:?}");
        assert_eq!(order(&b), [0, 1, 2, 3]);
    }

    #[test]
    fn runs_that_do_not_fit_the_buffer_wait_for_the_next_batch() {
        // Two runs of 3 000 bytes (to two peers), a buffer of 4 000: one run per batch.
        let p = pending(&[2, 2, 2, 3, 3, 3], 1000, 7);
        let b = batches(&p, 1, 64, 4000);
        assert_eq!(b.len(), 2, "{b:?}");
        for batch in &b {
            assert!(matches!(batch[..], [Planned { what: Carries::Run { start: 0, .. }, .. }]));
        }
        assert_eq!(order(&b), [0, 1, 2, 3, 4, 5]);
        // A run larger than the whole buffer: single datagrams, one per batch head, in order.
        let b = batches(&p, 1, 64, 1500);
        assert_eq!(order(&b), [0, 1, 2, 3, 4, 5]);
        assert!(b.iter().flatten().any(|m| matches!(m.what, Carries::One { .. })));
    }

    #[test]
    fn a_batch_holds_at_most_max_batch_messages_and_nothing_is_lost() {
        let peers: Vec<u8> = (0..MAX_BATCH * 2 + 3).map(|i| 2 + (i % 2) as u8).collect();
        let p = pending(&peers, 100, 7);
        let b = batches(&p, 1, 64, 256 * 1024);
        assert!(b.iter().all(|batch| batch.len() <= MAX_BATCH));
        assert_eq!(order(&b), (0..p.len()).collect::<Vec<_>>());
    }

    #[test]
    fn a_shorter_datagram_ends_its_run() {
        let mut p = pending(&[2, 2, 2, 2], 1000, 7);
        p[1].range = 0..600;
        let b = batches(&p, 1, 64, 256 * 1024);
        let runs: Vec<Carries> = b.iter().flatten().map(|m| m.what).collect();
        assert_eq!(
            runs,
            [
                Carries::Run { first: 0, count: 2, start: 0, bytes: 1600, segment_size: 1000 },
                Carries::Run { first: 2, count: 2, start: 1600, bytes: 2000, segment_size: 1000 },
            ]
        );
    }

    #[test]
    fn coalesce_plan_follows_the_gso_rules() {
        let a = SocketAddr::from(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1));
        let b = SocketAddr::from(std::net::SocketAddrV4::new(Ipv4Addr::LOCALHOST, 2));
        let plan = |items: &[(SocketAddr, usize)], max| {
            coalesce_plan(items, TailRule::Any.limits(max), |&(d, l)| (d, l))
                .map(|c| (c.start, c.count, c.bytes, c.segment_size))
                .collect::<Vec<_>>()
        };
        // Same destination and size: one run; a shorter one ends it; a longer one starts anew.
        let items = [(a, 100), (a, 100), (a, 60), (a, 100), (a, 200), (a, 200)];
        assert_eq!(
            plan(&items, 64),
            [(0, 3, 260, Some(100)), (3, 1, 100, None), (4, 2, 400, Some(200))]
        );
        // A destination change ends a run.
        assert_eq!(
            plan(&[(a, 10), (b, 10), (b, 10)], 64),
            [(0, 1, 10, None), (1, 2, 20, Some(10))]
        );
        // The segment cap, and 1 (no GSO) means every datagram alone.
        let many = [(a, 10); 70];
        assert_eq!(plan(&many, 64), [(0, 64, 640, Some(10)), (64, 6, 60, Some(10))]);
        assert_eq!(plan(&many[..3], 1).len(), 3);
        // The byte cap: 46 × 1400 = 64400 fits, 47 does not.
        assert_eq!(
            plan(&[(a, 1400); 50], 64),
            [(0, 46, 64_400, Some(1400)), (46, 4, 5600, Some(1400))]
        );
        // Empty datagrams are never coalesced.
        assert_eq!(plan(&[(a, 0), (a, 0)], 64), [(0, 1, 0, None), (1, 1, 0, None)]);
        assert_eq!(plan(&[], 64), []);
        // Limits that leave room for the pad: 63 segments, and 18 bytes fewer: 46 × 1424 =
        // 65504 bytes fit 65507, not 65489.
        let padded = |items: &[(SocketAddr, usize)]| {
            coalesce_plan(items, TailRule::NeverEqual.limits(64), |&(d, l)| (d, l))
                .map(|c| c.count)
                .collect::<Vec<_>>()
        };
        assert_eq!(padded(&many), [63, 7]);
        assert_eq!(padded(&[(a, 1424); 50]), [45, 5]);
        assert_eq!(plan(&[(a, 1424); 50], 64)[0].1, 46);
    }
}
