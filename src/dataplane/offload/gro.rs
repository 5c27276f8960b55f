//! Receive-side coalescing (GRO) of a batch of IP packets into TUN super-packets: the kernel's
//! `tcp_gro_receive`/`udp_gro_receive` rules, as wireguard-go's `handleGRO` applies them.
//!
//! # In place: [`GroTable::coalesce_refs`]
//! The data path's form. Packets are [`PacketRef`]s into the caller's buffers, anywhere (many
//! may share one buffer, as the datagrams of a UDP GRO receive do). Nothing is copied: each
//! [`GroWrite`] is a `virtio_net_hdr`, the chain's first packet (its IP and L4 headers fixed up
//! in place for the merged length) and the payloads of the packets appended to it
//! ([`GroTable::appended`]), for one vectored write. Headers and rules are as below; a chain
//! holds at most [`MAX_CHAIN`] packets.
//!
//! # By copying: buffer contract of [`GroTable::coalesce`]
//! Before: for each `i < min(bufs.len(), lens.len())`, `bufs[i][VIRTIO_HEADROOM..][..lens[i]]`
//! is one IP packet (a decapsulated inner packet). `bufs[i][..VIRTIO_HEADROOM]` is free, and
//! every byte of `bufs[i]` after the packet is spare capacity: the whole slice is usable (for a
//! `Vec<u8>`, its *length*, so size it once to the largest super-packet wanted, e.g.
//! `VIRTIO_HEADROOM + 65535`). Buffers are never reallocated.
//!
//! After: the returned indices (ascending, unique, all `< bufs.len()`) are the packets to
//! write, and `lens[i]` is what to write from `bufs[i][0..]`, one `write()` per index:
//! - a coalesced packet: a `virtio_net_hdr` with `F_NEEDS_CSUM`, `GSO_TCPV4`/`GSO_TCPV6` (or
//!   `GSO_UDP_L4`), `gso_size` = the first segment's payload, `hdr_len` = IP + L4 header,
//!   `csum_start` = IP header length, `csum_offset` = 16 (TCP) or 6 (UDP); then the merged
//!   packet with IP lengths and the IPv4 header checksum fixed, and the pseudo-header sum in the
//!   L4 checksum field (CHECKSUM_PARTIAL: the kernel finishes it);
//! - any other packet (not TCP/UDP, not mergeable, or alone in its flow): a zero header
//!   (`GSO_NONE`, no flags) followed by the packet, unchanged.
//!
//! Every other index has `lens[i] == 0`: its payload was appended to an earlier packet, or it
//! did not fit its buffer (`VIRTIO_HEADROOM + lens[i] > bufs[i].len()`: dropped, counted in
//! [`GroTable::invalid`]). Those buffers' contents are unspecified.
//!
//! # Merge rules
//! A packet joins the newest earlier chain of its flow it can extend (TCP: any chain of the
//! flow, newest first; UDP: only the newest, so datagrams are never reordered) when:
//! - flow key equal: addresses, ports, protocol and, for TCP, the acknowledgment number;
//! - IPv4 without options and not a fragment, IPv4 total length (IPv6 payload length) equal to
//!   the packet's length; IPv4 TOS, TTL and flag bits equal, and the identification
//!   consecutive unless DF is set (RFC 6864: atomic datagrams' IDs carry no meaning); IPv6
//!   version/traffic class/flow label word and hop limit equal;
//! - TCP: flags exactly ACK or ACK|PSH, with PSH only on the last segment of a chain; same
//!   data offset, reserved bits, window, urgent field and option bytes; sequence number equal to
//!   the chain's next; UDP: a nonzero checksum (zero means "none", RFC 768; the kernel does not
//!   aggregate those either);
//! - payload > 0 and no larger than the chain's first payload (`gso_size`); a smaller one ends
//!   the chain;
//! - the merged packet fits the first packet's buffer and stays <= 65535 bytes;
//! - both the chain's first packet and this one have valid IP and L4 checksums (verified
//!   lazily, only when a merge is otherwise possible; a chain with an invalid first packet is
//!   abandoned, and an invalid packet is written alone, for the kernel to drop). A packet
//!   whose [`PacketRef::checksums_trusted`] is set is taken as valid without a look: the
//!   outer UDP checksum the kernel verified covered it.
//!
//! A UDP packet that cannot merge (zero checksum, say) ends its flow's chains, so no later
//! datagram overtakes it. (A TCP packet that cannot merge either carries no data, or occupies
//! the sequence numbers a later segment would need to append.)
//!
//! Only appends are done (no prepend): in-order streams, the case that matters, merge fully.

use super::super::wire::virtio_net::{self, Header};
use super::super::wire::{checksum, ip, ipv4, ipv6, read_u16, read_u32, tcp, udp, write_u16};

/// The bytes reserved in front of each packet given to [`GroTable::coalesce`], for the
/// `virtio_net_hdr`.
pub const VIRTIO_HEADROOM: usize = virtio_net::LEN;

/// The largest IP packet a merge produces (IPv4 total length is 16 bits; kept for IPv6 too).
const MAX_MERGED: usize = u16::MAX as usize;

/// Which coalescing [`GroTable`] does. Every offload is switchable (docs/benchmarks.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroConfig {
    /// Coalesce TCP segments (needs `TUN_F_TSO4 | TUN_F_TSO6` on the device).
    pub tcp: bool,
    /// Coalesce UDP datagrams into `GSO_UDP_L4` (needs `TUN_F_USO4 | TUN_F_USO6`, Linux 6.2+).
    pub udp: bool,
}

impl Default for GroConfig {
    /// TCP on, UDP off (USO is newer and optional on TUN).
    fn default() -> Self {
        Self { tcp: true, udp: false }
    }
}

/// What identifies a flow; packets of different flows never merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FlowKey {
    /// IPv4 addresses in the first 4 bytes, zero-padded.
    src: [u8; 16],
    dst: [u8; 16],
    /// Source port << 16 | destination port.
    ports: u32,
    /// The TCP acknowledgment number (0 for UDP).
    ack: u32,
    /// The IP version and the protocol.
    version: u8,
    proto: u8,
}

impl FlowKey {
    /// A cheap hash to skip most key comparisons in the linear item scan.
    fn hash(&self) -> u32 {
        let w = |b: &[u8]| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        let mut h = self.ports ^ self.ack.rotate_left(7) ^ u32::from(self.proto) << 24;
        for i in (0..16).step_by(4) {
            h = (h ^ w(&self.src[i..]) ^ w(&self.dst[i..]).rotate_left(16))
                .wrapping_mul(0x9e37_79b9);
        }
        h
    }
}

/// A packet that may merge, parsed once.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    key: FlowKey,
    /// IP header length (20 or 40).
    ip_len: usize,
    /// L4 header length.
    l4_len: usize,
    /// The whole packet's length.
    len: usize,
    /// TCP sequence number (0 for UDP).
    seq: u32,
    /// IPv4 identification (0 for IPv6).
    id: u16,
    /// IPv4 DF set (IDs need not be consecutive).
    df: bool,
    /// TCP PSH set.
    psh: bool,
}

impl Candidate {
    fn payload(&self) -> usize {
        self.len - self.ip_len - self.l4_len
    }
}

/// What became of one packet of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Appended to an earlier chain: not written itself.
    Merged,
    /// The first packet of a chain (possibly of one): written once the batch is done.
    Chain,
    /// Written alone, unchanged.
    Alone,
}

/// Where one packet lies: `bufs[buf][start..start + len]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketRef {
    /// The buffer's index.
    pub buf: usize,
    /// The packet's first byte in that buffer.
    pub start: usize,
    /// The packet's length.
    pub len: usize,
    /// Its IP and L4 checksums need no check here: it came in a datagram whose UDP checksum
    /// covered it and was verified by the kernel (a weft peer's, which always carries one).
    /// A merge with it then skips [`checksums_ok`]. A kernel VXLAN peer sends no UDP checksum
    /// (Linux's default), so its packets are verified as before.
    pub checksums_trusted: bool,
}

impl PacketRef {
    /// A packet at `bufs[buf][start..start + len]` whose checksums are to be verified.
    pub fn new(buf: usize, start: usize, len: usize) -> Self {
        Self { buf, start, len, checksums_trusted: false }
    }

    /// The bytes, or `None` if the reference lies outside `bufs`.
    fn bytes<'a, B: AsRef<[u8]>>(&self, bufs: &'a [B]) -> Option<&'a [u8]> {
        let end = self.start.checked_add(self.len)?;
        bufs.get(self.buf)?.as_ref().get(self.start..end)
    }
}

/// One write to TUN from [`GroTable::coalesce_refs`]: [`hdr`](Self::hdr), then the head packet
/// `bufs[head.buf][head.start..][..head.len]` (its headers fixed up in place), then the payload
/// of every packet appended to it, in order ([`GroTable::appended`]).
#[derive(Clone, Copy, Debug)]
pub struct GroWrite {
    /// The `virtio_net_hdr`.
    pub hdr: [u8; VIRTIO_HEADROOM],
    /// The chain's first packet (or a packet written alone).
    pub head: PacketRef,
    /// The merged packet's length: the head packet plus every appended payload.
    pub len: usize,
    /// The first appended packet's index in the batch, or [`NONE`].
    first: usize,
    /// Header plus L4 header length of the chain: what is skipped of each appended packet.
    hdrs: usize,
}

/// "No packet" in the per-packet links.
const NONE: usize = usize::MAX;

/// The most packets one chain holds: bounds a write's iovecs, as the kernel bounds GRO
/// segments (`UDP_GRO`'s 64).
pub const MAX_CHAIN: usize = 64;

/// A chain being built.
#[derive(Clone, Copy, Debug)]
struct Item {
    key: FlowKey,
    hash: u32,
    /// The batch index of the chain's first packet.
    head: usize,
    /// The batch index of the last appended packet ([`NONE`]: none yet).
    tail: usize,
    /// The batch index of the first appended packet ([`NONE`]: none yet).
    first: usize,
    ip_len: usize,
    l4_len: usize,
    /// The first packet's payload length.
    gso_size: usize,
    /// The merged IP packet's length so far.
    len: usize,
    /// The most the merged packet may grow to.
    room: usize,
    /// The TCP sequence number the next appended segment must carry.
    next_seq: u32,
    /// The IPv4 identification the next segment must carry (unless DF).
    next_id: u16,
    /// How many packets are in the chain.
    count: usize,
    /// An appended segment carried PSH (set on the merged packet when finished).
    psh: bool,
    /// A smaller or PSH segment ended the chain.
    closed: bool,
    /// The first packet's checksums have been verified.
    head_checked: bool,
    /// The first packet's checksums were bad: nothing may join this chain.
    dead: bool,
}

/// Reusable state for coalescing batches: create once per worker, call
/// [`coalesce_refs`](Self::coalesce_refs) (or [`coalesce`](Self::coalesce)) per batch. See the
/// module docs for the buffer contract and the rules.
#[derive(Debug)]
pub struct GroTable {
    config: GroConfig,
    items: Vec<Item>,
    /// Per batch index: the next packet of its chain ([`NONE`]: the last).
    next: Vec<usize>,
    /// Per batch index: the item it heads ([`NONE`]: none).
    item_of: Vec<usize>,
    /// Batch indices to write, ascending.
    order: Vec<usize>,
    writes: Vec<GroWrite>,
    /// [`GroTable::coalesce`]'s scratch (test-util only).
    #[cfg(any(test, feature = "test-util"))]
    refs: Vec<PacketRef>,
    #[cfg(any(test, feature = "test-util"))]
    out: Vec<usize>,
    merged: usize,
    invalid: usize,
}

impl GroTable {
    /// A table for batches of up to `batch` packets (larger batches work, but allocate once).
    pub fn new(config: GroConfig, batch: usize) -> Self {
        Self {
            config,
            items: Vec::with_capacity(batch),
            next: Vec::with_capacity(batch),
            item_of: Vec::with_capacity(batch),
            order: Vec::with_capacity(batch),
            writes: Vec::with_capacity(batch),
            #[cfg(any(test, feature = "test-util"))]
            refs: Vec::with_capacity(batch),
            #[cfg(any(test, feature = "test-util"))]
            out: Vec::with_capacity(batch),
            merged: 0,
            invalid: 0,
        }
    }

    /// Packets that the last coalesce appended to another (no write of their own).
    pub fn merged(&self) -> usize {
        self.merged
    }

    /// Packets that the last coalesce dropped because they lay outside their buffer.
    pub fn invalid(&self) -> usize {
        self.invalid
    }

    /// Coalesces the packets `pkts` where they lie, copying nothing, and returns the writes
    /// in batch order (each write's head comes before its appended packets, and writes are
    /// ordered by head). A chain's head packet gets its headers fixed up in place; no other
    /// byte changes. Never panics, whatever the bytes or references; a reference outside
    /// `bufs` is dropped (counted in [`invalid`](Self::invalid)).
    pub fn coalesce_refs<B: AsRef<[u8]> + AsMut<[u8]>>(
        &mut self,
        bufs: &mut [B],
        pkts: &[PacketRef],
    ) -> &[GroWrite] {
        self.run(bufs, pkts, |_, _| MAX_MERGED);
        &self.writes
    }

    /// The writes of the last [`coalesce_refs`](Self::coalesce_refs).
    pub(crate) fn writes(&self) -> &[GroWrite] {
        &self.writes
    }

    /// The payloads appended to `w`'s head, in order, as references into the batch's
    /// buffers: the bytes to write after the head packet.
    pub fn appended<'a>(
        &'a self,
        w: &GroWrite,
        pkts: &'a [PacketRef],
    ) -> impl Iterator<Item = PacketRef> + 'a {
        let hdrs = w.hdrs;
        let mut at = w.first;
        std::iter::from_fn(move || {
            let p = *pkts.get(at)?;
            at = self.next.get(at).copied().unwrap_or(NONE);
            Some(PacketRef::new(p.buf, p.start + hdrs, p.len - hdrs))
        })
    }

    /// Coalesces the batch by copying: packet `i` is `bufs[i][VIRTIO_HEADROOM..][..lens[i]]`
    /// and chains grow in their first packet's buffer. Returns the indices of the buffers to
    /// write to TUN, ascending; `lens` is rewritten to the bytes to write from each buffer's
    /// start (0 for the rest). See the module docs for the exact contract. Never panics,
    /// whatever the bytes; indices past `min(bufs.len(), lens.len())` are ignored (and
    /// untouched).
    ///
    /// Only with the `test-util` feature: the data path coalesces in place
    /// ([`coalesce_refs`](Self::coalesce_refs)); this is the reference the tests, the
    /// benchmark and the fuzz target compare it with.
    #[cfg(any(test, feature = "test-util"))]
    pub fn coalesce<B: AsRef<[u8]> + AsMut<[u8]>>(
        &mut self,
        bufs: &mut [B],
        lens: &mut [usize],
    ) -> &[usize] {
        let n = bufs.len().min(lens.len());
        let mut refs = std::mem::take(&mut self.refs);
        refs.clear();
        for (i, len) in lens.iter_mut().enumerate().take(n) {
            let r = PacketRef::new(i, VIRTIO_HEADROOM, *len);
            if r.bytes(bufs).is_none() {
                *len = 0;
                continue;
            }
            refs.push(r);
        }
        let dropped = n - refs.len();
        // A chain may grow to what its first packet's buffer holds.
        self.run(bufs, &refs, |bufs, head| {
            bufs_len(bufs, head.buf).saturating_sub(VIRTIO_HEADROOM).min(MAX_MERGED)
        });
        self.invalid += dropped;
        self.out.clear();
        for w in &self.writes {
            let head = w.head.buf;
            // Appended packets come later in the batch, so from later buffers.
            let (left, right) = bufs.split_at_mut(head + 1);
            let dst = left[head].as_mut();
            let mut at = VIRTIO_HEADROOM + w.head.len;
            let mut k = w.first;
            while let Some(p) = refs.get(k) {
                let src = &right[p.buf - head - 1].as_ref()[p.start + w.hdrs..p.start + p.len];
                dst[at..at + src.len()].copy_from_slice(src);
                at += src.len();
                lens[p.buf] = 0;
                k = self.next[k];
            }
            dst[..VIRTIO_HEADROOM].copy_from_slice(&w.hdr);
            lens[head] = VIRTIO_HEADROOM + w.len;
            self.out.push(head);
        }
        self.refs = refs;
        &self.out
    }

    /// The shared core: decides every merge (copying nothing), fixes up chain heads in place
    /// and fills `self.writes`. `room(bufs, head)` is the most a chain headed by `head` may grow to.
    fn run<B, F>(&mut self, bufs: &mut [B], pkts: &[PacketRef], room: F)
    where
        B: AsRef<[u8]> + AsMut<[u8]>,
        F: Fn(&[B], &PacketRef) -> usize,
    {
        self.items.clear();
        self.order.clear();
        self.writes.clear();
        self.next.clear();
        self.next.resize(pkts.len(), NONE);
        self.item_of.clear();
        self.item_of.resize(pkts.len(), NONE);
        self.merged = 0;
        self.invalid = 0;
        for (i, r) in pkts.iter().enumerate() {
            let Some(packet) = r.bytes(bufs) else {
                self.invalid += 1;
                continue;
            };
            let candidate = self.candidate(packet);
            let outcome = match candidate {
                Some(c) => self.try_merge(bufs, pkts, i, &c, room(bufs, r)),
                None => Outcome::Alone,
            };
            match outcome {
                Outcome::Merged => self.merged += 1,
                Outcome::Chain | Outcome::Alone => self.order.push(i),
            }
        }
        for &i in &self.order {
            let r = pkts[i];
            let write = match self.item_of[i] {
                NONE => GroWrite {
                    hdr: [0; VIRTIO_HEADROOM],
                    head: r,
                    len: r.len,
                    first: NONE,
                    hdrs: 0,
                },
                k => {
                    let it = self.items[k];
                    let mut hdr = [0; VIRTIO_HEADROOM];
                    // Heads were checked to lie inside their buffer when they arrived.
                    if let Some(p) = bufs
                        .get_mut(r.buf)
                        .and_then(|b| b.as_mut().get_mut(r.start..r.start + r.len))
                    {
                        finish(&mut hdr, p, &it);
                    }
                    GroWrite {
                        hdr,
                        head: r,
                        len: it.len,
                        first: it.first,
                        hdrs: it.ip_len + it.l4_len,
                    }
                }
            };
            self.writes.push(write);
        }
    }

    /// Parses `p` as a packet that may merge (see the module rules that concern one packet),
    /// or `None`.
    ///
    /// A UDP packet of a flow that cannot merge ends that flow's chains: a later datagram
    /// appended to one of them would overtake it.
    fn candidate(&mut self, p: &[u8]) -> Option<Candidate> {
        let mut key = FlowKey {
            src: [0; 16],
            dst: [0; 16],
            ports: 0,
            ack: 0,
            version: ip::version(p)?,
            proto: 0,
        };
        let (ip_len, id, df) = match key.version {
            4 => {
                if p.len() < ipv4::HEADER_LEN
                    || p[0] & 0x0f != 5
                    || usize::from(read_u16(p, 2)) != p.len()
                    // Fragments (MF or an offset) never merge; DF is allowed.
                    || read_u16(p, 6) & 0x3fff != 0
                {
                    return None;
                }
                key.proto = p[9];
                key.src[..4].copy_from_slice(&p[12..16]);
                key.dst[..4].copy_from_slice(&p[16..20]);
                (ipv4::HEADER_LEN, read_u16(p, 4), p[6] & 0x40 != 0)
            }
            6 => {
                if p.len() < ipv6::HEADER_LEN
                    || usize::from(read_u16(p, 4)) + ipv6::HEADER_LEN != p.len()
                {
                    return None;
                }
                key.proto = p[6];
                key.src.copy_from_slice(&p[8..24]);
                key.dst.copy_from_slice(&p[24..40]);
                (ipv6::HEADER_LEN, 0, true)
            }
            _ => return None,
        };
        let l4 = &p[ip_len..];
        let (l4_len, seq, psh) = match key.proto {
            ip::proto::TCP if self.config.tcp => {
                if l4.len() < tcp::HEADER_LEN {
                    return None;
                }
                let doff = usize::from(l4[12] >> 4) * 4;
                let flags = l4[13];
                if doff < tcp::HEADER_LEN
                    || doff >= l4.len()
                    || (flags != tcp::ACK && flags != tcp::ACK | tcp::PSH)
                {
                    return None;
                }
                key.ack = read_u32(l4, 8);
                (doff, read_u32(l4, 4), flags & tcp::PSH != 0)
            }
            ip::proto::UDP if self.config.udp => {
                if l4.len() <= udp::HEADER_LEN
                    || usize::from(read_u16(l4, 4)) != l4.len()
                    || read_u16(l4, 6) == 0
                {
                    if l4.len() >= 4 {
                        key.ports = read_u32(l4, 0);
                        self.close_flow(&key);
                    }
                    return None;
                }
                (udp::HEADER_LEN, 0, false)
            }
            _ => return None,
        };
        key.ports = read_u32(l4, 0);
        Some(Candidate { key, ip_len, l4_len, len: p.len(), seq, id, df, psh })
    }

    /// Ends every chain of the flow `key`.
    fn close_flow(&mut self, key: &FlowKey) {
        for it in self.items.iter_mut().filter(|it| it.key == *key) {
            it.closed = true;
        }
    }

    /// Appends packet `i` (described by `c`) to a chain of its flow if the rules allow, or
    /// starts a chain with it (which may grow to `room` bytes).
    fn try_merge<B: AsRef<[u8]>>(
        &mut self,
        bufs: &[B],
        pkts: &[PacketRef],
        i: usize,
        c: &Candidate,
        room: usize,
    ) -> Outcome {
        let hash = c.key.hash();
        let is_tcp = c.key.proto == ip::proto::TCP;
        for k in (0..self.items.len()).rev() {
            let it = self.items[k];
            if it.hash != hash || it.key != c.key || it.dead {
                continue;
            }
            // Both lie inside their buffers (checked when they arrived).
            let (Some(head), Some(pkt)) = (pkts[it.head].bytes(bufs), pkts[i].bytes(bufs)) else {
                continue;
            };
            if !can_append(&it, head, pkt, c) {
                if is_tcp {
                    continue;
                }
                // UDP: only the newest chain of a flow, or datagrams would be reordered.
                break;
            }
            if it.len + c.payload() > it.room || it.count >= MAX_CHAIN {
                if is_tcp {
                    continue;
                }
                break;
            }
            if !it.head_checked {
                if !checksums_ok(head, it.ip_len) {
                    self.items[k].dead = true;
                    continue;
                }
                self.items[k].head_checked = true;
            }
            if !pkts[i].checksums_trusted && !checksums_ok(pkt, c.ip_len) {
                // Not mergeable, and not worth a chain: written alone for the kernel to drop.
                return Outcome::Alone;
            }
            let payload = c.payload();
            let item = &mut self.items[k];
            if item.tail == NONE {
                item.first = i;
            } else {
                self.next[item.tail] = i;
            }
            item.tail = i;
            item.len += payload;
            item.next_seq = item.next_seq.wrapping_add(payload as u32);
            item.next_id = item.next_id.wrapping_add(1);
            item.count += 1;
            item.psh |= c.psh;
            item.closed = c.psh || payload < item.gso_size;
            return Outcome::Merged;
        }
        let payload = c.payload();
        self.item_of[i] = self.items.len();
        self.items.push(Item {
            key: c.key,
            hash,
            head: i,
            tail: NONE,
            first: NONE,
            ip_len: c.ip_len,
            l4_len: c.l4_len,
            gso_size: payload,
            len: c.len,
            room: room.max(c.len),
            next_seq: c.seq.wrapping_add(payload as u32),
            next_id: c.id.wrapping_add(1),
            count: 1,
            psh: false,
            closed: c.psh,
            head_checked: pkts[i].checksums_trusted,
            dead: false,
        });
        Outcome::Chain
    }
}

#[cfg(any(test, feature = "test-util"))]
fn bufs_len<B: AsRef<[u8]>>(bufs: &[B], i: usize) -> usize {
    bufs.get(i).map_or(0, |b| b.as_ref().len())
}

/// Whether `pkt` (described by `c`) may follow the chain `it`, whose merged packet so far is
/// `head`, as far as headers, sequence and sizes go (capacity and checksums are checked after).
fn can_append(it: &Item, head: &[u8], pkt: &[u8], c: &Candidate) -> bool {
    if it.closed || c.ip_len != it.ip_len || c.l4_len != it.l4_len || c.payload() > it.gso_size {
        return false;
    }
    let ip_ok = if c.key.version == 4 {
        // TOS, the flag bits, TTL; and consecutive IDs unless DF.
        head[1] == pkt[1]
            && head[6] & 0xe0 == pkt[6] & 0xe0
            && head[8] == pkt[8]
            && (c.df || c.id == it.next_id)
    } else {
        // Version, traffic class and flow label; hop limit.
        head[..4] == pkt[..4] && head[7] == pkt[7]
    };
    if !ip_ok {
        return false;
    }
    if c.key.proto != ip::proto::TCP {
        return true;
    }
    let (h, p) = (&head[it.ip_len..], &pkt[c.ip_len..]);
    c.seq == it.next_seq
        // Data offset and reserved bits; window; urgent field; options.
        && h[12] == p[12]
        && h[14..16] == p[14..16]
        && h[18..c.l4_len] == p[18..c.l4_len]
}

/// Whether the IPv4 header checksum (if any) and the L4 checksum of `p` are valid.
fn checksums_ok(p: &[u8], ip_len: usize) -> bool {
    let l4 = &p[ip_len..];
    // Candidates have consistent lengths below 64 KiB, so the casts are exact.
    let ph = if ip_len == ipv4::HEADER_LEN {
        if checksum::data(&p[..ip_len]) != 0xffff {
            return false;
        }
        let ip = ipv4::Packet::new_unchecked(p);
        checksum::pseudo_header_v4(ip.src_addr(), ip.dst_addr(), p[9], l4.len() as u16)
    } else {
        let ip = ipv6::Packet::new_unchecked(p);
        checksum::pseudo_header_v6(ip.src_addr(), ip.dst_addr(), p[6], l4.len() as u32)
    };
    checksum::combine(&[ph, checksum::data(l4)]) == 0xffff
}

/// Writes the `virtio_net_hdr` into `hdr` and fixes the headers of a chain's head packet `p`
/// (its own bytes; the appended payloads follow it in the write) for the merged length.
fn finish(hdr: &mut [u8; VIRTIO_HEADROOM], p: &mut [u8], it: &Item) {
    if it.count == 1 {
        // Alone (or abandoned): the packet is unchanged and complete.
        let _ = Header::NONE.emit(hdr);
        return;
    }
    let is_tcp = it.key.proto == ip::proto::TCP;
    if is_tcp && it.psh {
        p[it.ip_len + 13] |= tcp::PSH;
    }
    let l4_len = it.len - it.ip_len;
    // Merged lengths are <= MAX_MERGED, so the casts are exact.
    let ph = if it.key.version == 4 {
        let mut ip = ipv4::Packet::new_unchecked(&mut p[..]);
        ip.set_total_len(it.len as u16);
        ip.fill_checksum();
        checksum::pseudo_header_v4(ip.src_addr(), ip.dst_addr(), it.key.proto, l4_len as u16)
    } else {
        let mut ip = ipv6::Packet::new_unchecked(&mut p[..]);
        ip.set_payload_len(l4_len as u16);
        checksum::pseudo_header_v6(ip.src_addr(), ip.dst_addr(), it.key.proto, l4_len as u32)
    };
    let (gso_type, csum_offset) = match (is_tcp, it.key.version) {
        (true, 4) => (virtio_net::GSO_TCPV4, tcp::CHECKSUM_OFFSET),
        (true, _) => (virtio_net::GSO_TCPV6, tcp::CHECKSUM_OFFSET),
        (false, _) => (virtio_net::GSO_UDP_L4, udp::CHECKSUM_OFFSET),
    };
    if !is_tcp {
        write_u16(p, it.ip_len + 4, l4_len as u16);
    }
    // CHECKSUM_PARTIAL: the field holds the folded pseudo-header sum, not complemented; the
    // kernel sums from csum_start and stores the complement.
    write_u16(p, it.ip_len + csum_offset, ph);
    let _ = Header {
        flags: virtio_net::F_NEEDS_CSUM,
        gso_type,
        hdr_len: (it.ip_len + it.l4_len) as u16,
        gso_size: it.gso_size as u16,
        csum_start: it.ip_len as u16,
        csum_offset: csum_offset as u16,
    }
    .emit(hdr);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::testutil::{Pkt, batch, checksums_valid};
    use super::super::{finish_checksum, split};
    use super::*;

    const BOTH: GroConfig = GroConfig { tcp: true, udp: true };

    /// Coalesces `pkts` (buffers of `VIRTIO_HEADROOM + cap`) and returns each output's header
    /// and IP packet, checking the output invariants on the way.
    fn gro(pkts: &[Vec<u8>], cap: usize, config: GroConfig) -> Vec<(Header, Vec<u8>)> {
        let (mut bufs, mut lens) = batch(pkts, cap);
        let mut t = GroTable::new(config, 4);
        let out = t.coalesce(&mut bufs, &mut lens).to_vec();
        check_invariants(&out, &bufs, &lens);
        assert_eq!(t.merged() + out.len() + t.invalid(), pkts.len());
        out.iter()
            .map(|&i| {
                let b = &bufs[i][..lens[i]];
                (Header::parse(b).unwrap(), b[VIRTIO_HEADROOM..].to_vec())
            })
            .collect()
    }

    fn check_invariants(out: &[usize], bufs: &[Vec<u8>], lens: &[usize]) {
        assert!(out.windows(2).all(|w| w[0] < w[1]), "ascending and unique: {out:?}");
        for (i, &len) in lens.iter().enumerate() {
            assert!(len <= bufs[i].len());
            assert_eq!(out.contains(&i), len != 0, "index {i}");
            if len != 0 {
                assert!(len >= VIRTIO_HEADROOM);
            }
        }
    }

    /// A merged output's checksum, finished as the kernel would, is valid.
    fn assert_partial_ok(hdr: &Header, p: &[u8]) {
        let mut p = p.to_vec();
        finish_checksum(hdr, &mut p).unwrap();
        assert!(checksums_valid(&p));
    }

    /// Output shapes: (GSO type, segments) per output packet, where segments is the number of
    /// gso_size pieces (1 for unmerged).
    fn shapes(outs: &[(Header, Vec<u8>)]) -> Vec<(u8, usize)> {
        outs.iter()
            .map(|(h, p)| {
                if h.gso_type == virtio_net::GSO_NONE {
                    assert_eq!(*h, Header::NONE);
                    return (virtio_net::GSO_NONE, 1);
                }
                assert_partial_ok(h, p);
                let payload = p.len() - usize::from(h.hdr_len);
                (h.gso_type, payload.div_ceil(usize::from(h.gso_size)))
            })
            .collect()
    }

    const NONE: u8 = virtio_net::GSO_NONE;
    const TCP4: u8 = virtio_net::GSO_TCPV4;

    #[test]
    fn adjacent_tcp4_segments_merge() {
        let pkts = Pkt::tcp4(100).run(3, 60);
        let outs = gro(&pkts, 1000, GroConfig::default());
        assert_eq!(shapes(&outs), [(TCP4, 3)]);
        let (h, p) = &outs[0];
        assert_eq!(
            *h,
            Header {
                flags: virtio_net::F_NEEDS_CSUM,
                gso_type: TCP4,
                hdr_len: 40,
                gso_size: 100,
                csum_start: 20,
                csum_offset: 16,
            }
        );
        assert_eq!(p.len(), 40 + 260);
        assert_eq!(usize::from(read_u16(p, 2)), p.len());
        assert!(ipv4::Packet::new_checked(&p[..]).unwrap().verify_checksum());
    }

    /// One case of the table: packets in, output shapes expected.
    struct Case {
        name: &'static str,
        pkts: Vec<Vec<u8>>,
        cap: usize,
        config: GroConfig,
        want: Vec<(u8, usize)>,
    }

    fn case(name: &'static str, pkts: Vec<Vec<u8>>, want: &[(u8, usize)]) -> Case {
        Case { name, pkts, cap: 65_535, config: BOTH, want: want.to_vec() }
    }

    /// Three 100-byte segments of one flow, the middle one changed by `f`.
    fn middle(base: Pkt, f: impl Fn(&mut Pkt)) -> Vec<Vec<u8>> {
        let mut p = base;
        let mut out = Vec::new();
        for i in 0..3 {
            let mut q = p.clone();
            if i == 1 {
                f(&mut q);
            }
            out.push(q.build());
            p.seq = p.seq.wrapping_add(100);
            p.id = p.id.wrapping_add(1);
        }
        out
    }

    fn flip_l4_checksum(mut p: Vec<u8>) -> Vec<u8> {
        let at = if p[0] >> 4 == 4 { 20 + 16 } else { 40 + 16 };
        p[at] ^= 0x01;
        p
    }

    /// Packets whose checksums the outer UDP checksum covered are merged without a look at
    /// their own (a corrupted TCP checksum proves none was taken); the same packets untrusted
    /// are verified, and the bad one stays alone as before.
    #[test]
    fn trusted_packets_merge_without_their_checksums_being_verified() {
        let mut pkts = Pkt::tcp4(100).run(3, 100);
        pkts[1] = flip_l4_checksum(pkts[1].clone());
        let mut one = Vec::new();
        let mut refs = Vec::new();
        for p in &pkts {
            refs.push(PacketRef::new(0, one.len(), p.len()));
            one.extend_from_slice(p);
        }
        let mut bufs = [one];
        let shapes = |t: &mut GroTable, bufs: &mut [Vec<u8>; 1], refs: &[PacketRef]| {
            let writes = t.coalesce_refs(bufs, refs).to_vec();
            writes
                .iter()
                .map(|w| (Header::parse(&w.hdr).unwrap().gso_type, 1 + t.appended(w, refs).count()))
                .collect::<Vec<_>>()
        };
        let mut t = GroTable::new(BOTH, 4);
        let untrusted = shapes(&mut t, &mut bufs.clone(), &refs);
        assert_eq!(untrusted, [(NONE, 1), (NONE, 1), (NONE, 1)]);
        for r in &mut refs {
            r.checksums_trusted = true;
        }
        let trusted = shapes(&mut t, &mut bufs, &refs);
        assert_eq!(trusted, [(TCP4, 3)]);
    }

    #[test]
    fn table() {
        let t4 = Pkt::tcp4(100);
        let t6 = Pkt::tcp6(100);
        let u4 = Pkt::udp4(100);
        let mut bad_head = t4.run(3, 100);
        bad_head[0] = flip_l4_checksum(bad_head[0].clone());
        let mut bad_mid = t4.run(3, 100);
        bad_mid[1] = flip_l4_checksum(bad_mid[1].clone());
        let mut bad_ip = t4.run(2, 100);
        bad_ip[1][10] ^= 1;
        let mut two_flows = Vec::new();
        let other = Pkt { sport: 40001, ..t4.clone() }.run(2, 100);
        for (a, b) in t4.run(2, 100).into_iter().zip(other) {
            two_flows.push(a);
            two_flows.push(b);
        }
        let cases = vec![
            case("ipv6 merges", t6.run(4, 100), &[(virtio_net::GSO_TCPV6, 4)]),
            case("a smaller last one merges", t4.run(2, 1), &[(TCP4, 2)]),
            case("a single packet stays alone", t4.run(1, 100), &[(NONE, 1)]),
            case(
                "not adjacent: no merge",
                middle(t4.clone(), |p| p.seq += 1),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "different ACK: no merge",
                middle(t4.clone(), |p| p.ack += 1),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "PSH in the middle ends the chain",
                middle(t4.clone(), |p| p.flags |= tcp::PSH),
                &[(TCP4, 2), (NONE, 1)],
            ),
            case(
                "a smaller middle segment ends the chain",
                middle(t4.clone(), |p| p.payload.truncate(50)),
                &[(TCP4, 2), (NONE, 1)],
            ),
            case(
                "a larger second segment does not merge",
                middle(t4.clone(), |p| p.payload.push(0)),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "options differ",
                middle(t4.clone(), |p| p.opts = vec![1, 1, 1, 1]),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "window differs",
                middle(t4.clone(), |p| p.window += 1),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "TTL differs",
                middle(t4.clone(), |p| p.ttl -= 1),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "TOS differs",
                middle(t4.clone(), |p| p.tos = 4),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "IPv6 traffic class differs",
                middle(t6.clone(), |p| p.tos = 4),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "IPv4 fragment never merges",
                middle(t4.clone(), |p| p.mf = true),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "FIN is not merged",
                middle(t4.clone(), |p| p.flags |= tcp::FIN),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "a pure ACK is not merged",
                middle(t4.clone(), |p| p.payload.clear()),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case(
                "no DF: consecutive IDs merge",
                Pkt { df: false, ..t4.clone() }.run(3, 100),
                &[(TCP4, 3)],
            ),
            case(
                "no DF: a skipped ID stops the merge",
                middle(Pkt { df: false, ..t4.clone() }, |p| p.id += 1),
                &[(NONE, 1), (NONE, 1), (NONE, 1)],
            ),
            case("DF: IDs may be anything", middle(t4.clone(), |p| p.id = 7), &[(TCP4, 3)]),
            case("bad checksum in the middle", bad_mid, &[(NONE, 1), (NONE, 1), (NONE, 1)]),
            case("bad checksum on the head", bad_head, &[(NONE, 1), (TCP4, 2)]),
            case("bad IPv4 header checksum", bad_ip, &[(NONE, 1), (NONE, 1)]),
            case("two interleaved flows", two_flows, &[(TCP4, 2), (TCP4, 2)]),
            case("UDP merges", u4.run(3, 10), &[(virtio_net::GSO_UDP_L4, 3)]),
            case("UDP IPv6 merges", Pkt::udp6(100).run(2, 100), &[(virtio_net::GSO_UDP_L4, 2)]),
            Case {
                config: GroConfig::default(),
                ..case("UDP off", u4.run(2, 100), &[(NONE, 1), (NONE, 1)])
            },
            Case {
                config: GroConfig { tcp: false, udp: true },
                ..case("TCP off", t4.run(2, 100), &[(NONE, 1), (NONE, 1)])
            },
            Case {
                cap: 40 + 200,
                ..case("capacity for two", t4.run(3, 100), &[(TCP4, 2), (NONE, 1)])
            },
            Case { cap: 0, ..case("no spare capacity", t4.run(2, 100), &[(NONE, 1), (NONE, 1)]) },
        ];
        for c in cases {
            let outs = gro(&c.pkts, c.cap, c.config);
            assert_eq!(shapes(&outs), c.want, "{}", c.name);
        }
    }

    #[test]
    fn udp_zero_checksum_is_not_merged() {
        let mut pkts = Pkt::udp4(100).run(2, 100);
        for p in &mut pkts {
            p[26] = 0;
            p[27] = 0;
        }
        assert_eq!(shapes(&gro(&pkts, 65_535, BOTH)), [(NONE, 1), (NONE, 1)]);
    }

    #[test]
    fn udp_non_candidate_is_not_overtaken() {
        let mut pkts = Pkt::udp4(100).run(3, 100);
        // The middle datagram has no checksum: it cannot merge, and the third must not be
        // appended to the first past it.
        pkts[1][26] = 0;
        pkts[1][27] = 0;
        assert_eq!(shapes(&gro(&pkts, 65_535, BOTH)), [(NONE, 1), (NONE, 1), (NONE, 1)]);
    }

    #[test]
    fn ipv4_options_are_not_merged() {
        let pkts: Vec<Vec<u8>> = Pkt::tcp4(100)
            .run(2, 100)
            .into_iter()
            .map(|p| {
                // Insert 4 bytes of NOP options and fix IHL, length and checksum.
                let mut q = p[..20].to_vec();
                q.extend_from_slice(&[1, 1, 1, 0]);
                q.extend_from_slice(&p[20..]);
                q[0] = 0x46;
                let len = q.len() as u16;
                write_u16(&mut q, 2, len);
                ipv4::Packet::new_unchecked(&mut q[..]).fill_checksum();
                q
            })
            .collect();
        assert_eq!(shapes(&gro(&pkts, 65_535, BOTH)), [(NONE, 1), (NONE, 1)]);
    }

    #[test]
    fn lengths_past_the_buffer_are_dropped() {
        let pkts = Pkt::tcp4(100).run(3, 100);
        let (mut bufs, mut lens) = batch(&pkts, 0);
        lens[1] = usize::MAX;
        let mut t = GroTable::new(GroConfig::default(), 0);
        let out = t.coalesce(&mut bufs, &mut lens).to_vec();
        assert_eq!(out, [0, 2]);
        assert_eq!(t.invalid(), 1);
        assert_eq!(lens[1], 0);
        // Extra lens or bufs are ignored.
        let (mut bufs, mut lens) = batch(&pkts, 0);
        lens.truncate(2);
        assert_eq!(t.coalesce(&mut bufs, &mut lens), [0, 1]);
        assert_eq!(bufs[2][VIRTIO_HEADROOM..], pkts[2][..]);
    }

    #[test]
    fn a_chain_holds_at_most_max_chain_packets() {
        let mut p = Pkt::tcp4(10);
        let pkts: Vec<Vec<u8>> = (0..MAX_CHAIN + 5)
            .map(|_| {
                let b = p.build();
                p.seq = p.seq.wrapping_add(10);
                p.id = p.id.wrapping_add(1);
                b
            })
            .collect();
        let outs = gro(&pkts, 65_535, BOTH);
        assert_eq!(shapes(&outs), [(virtio_net::GSO_TCPV4, MAX_CHAIN), (virtio_net::GSO_TCPV4, 5)]);
    }

    #[test]
    fn references_outside_the_buffers_are_dropped() {
        let p = Pkt::tcp4(100).build();
        let mut bufs = [p.clone()];
        let refs = [
            PacketRef::new(0, 0, p.len()),
            PacketRef::new(1, 0, 10),
            PacketRef::new(0, 1, p.len()),
            PacketRef::new(0, usize::MAX, 2),
        ];
        let mut t = GroTable::new(BOTH, 4);
        let writes = t.coalesce_refs(&mut bufs, &refs);
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].head, refs[0]);
        assert_eq!(t.invalid(), 3);
    }

    #[test]
    fn table_is_reusable() {
        let mut t = GroTable::new(GroConfig::default(), 8);
        for _ in 0..3 {
            let (mut bufs, mut lens) = batch(&Pkt::tcp4(100).run(4, 100), 1000);
            assert_eq!(t.coalesce(&mut bufs, &mut lens), [0]);
            assert_eq!(t.merged(), 3);
        }
    }

    /// The segments of one flow: payload sizes (each `gso` or smaller) and PSH bits.
    #[derive(Clone, Debug)]
    struct Flow {
        base: Pkt,
        segs: Vec<(usize, bool)>,
    }

    fn flow(id: u16) -> impl Strategy<Value = Flow> {
        let sizes = prop_oneof![4 => Just(None), 1 => (1usize..300).prop_map(Some)];
        (
            0u8..4,
            300usize..1400,
            any::<u32>(),
            any::<u16>(),
            any::<bool>(),
            proptest::collection::vec((sizes, proptest::bool::weighted(0.1)), 1..30),
        )
            .prop_map(move |(kind, gso, seq, ip_id, df, segs)| {
                let mut base = match kind {
                    0 => Pkt::tcp4(0),
                    1 => Pkt::tcp6(0),
                    2 => Pkt::udp4(0),
                    _ => Pkt::udp6(0),
                };
                base.sport = 1000 + id;
                base.seq = seq;
                base.id = ip_id;
                base.df = df;
                let segs = segs
                    .into_iter()
                    .map(|(s, psh)| (s.unwrap_or(gso).min(gso), psh && !base.udp))
                    .collect();
                Flow { base, segs }
            })
    }

    /// The flows' packets, each flow in order, interleaved as `order` says.
    fn interleave(flows: &[Flow], order: &[usize]) -> Vec<Vec<u8>> {
        let mut next: Vec<Pkt> = flows.iter().map(|f| f.base.clone()).collect();
        let mut idx = vec![0; flows.len()];
        let mut out = Vec::new();
        let mut pick = order.iter().cycle();
        let total: usize = flows.iter().map(|f| f.segs.len()).sum();
        while out.len() < total {
            let f = pick.next().copied().unwrap_or(0) % flows.len();
            let Some(&(size, psh)) = flows[f].segs.get(idx[f]) else {
                // This flow is done: take the next one with packets left.
                let f = (0..flows.len()).find(|&g| idx[g] < flows[g].segs.len()).unwrap();
                let (size, psh) = flows[f].segs[idx[f]];
                out.push(emit(&mut next[f], size, psh));
                idx[f] += 1;
                continue;
            };
            out.push(emit(&mut next[f], size, psh));
            idx[f] += 1;
        }
        out
    }

    fn emit(p: &mut Pkt, size: usize, psh: bool) -> Vec<u8> {
        p.payload = (0..size).map(|i| (i as u8) ^ (p.seq as u8)).collect();
        p.flags = if p.udp {
            0
        } else if psh {
            tcp::ACK | tcp::PSH
        } else {
            tcp::ACK
        };
        let b = p.build();
        p.seq = p.seq.wrapping_add(size as u32);
        p.id = p.id.wrapping_add(1);
        b
    }

    /// The packets of each flow (by source port), in order.
    fn per_flow(pkts: impl IntoIterator<Item = Vec<u8>>) -> Vec<(u16, Vec<Vec<u8>>)> {
        let mut flows: Vec<(u16, Vec<Vec<u8>>)> = Vec::new();
        for p in pkts {
            let ip_len = if p[0] >> 4 == 4 { 20 } else { 40 };
            let port = read_u16(&p, ip_len);
            match flows.iter_mut().find(|(f, _)| *f == port) {
                Some((_, v)) => v.push(p),
                None => flows.push((port, vec![p])),
            }
        }
        flows.sort_by_key(|f| f.0);
        flows
    }

    proptest! {
        /// (b) split(coalesce(x)) == x, per flow, for in-order flows, whatever the interleaving
        /// and the buffer capacity.
        #[test]
        fn split_undoes_coalesce(
            flows in proptest::collection::vec(0u16..4, 1..4)
                .prop_flat_map(|ids| ids.into_iter().enumerate()
                    .map(|(i, _)| flow(i as u16)).collect::<Vec<_>>()),
            order in proptest::collection::vec(0usize..4, 1..20),
            cap in prop_oneof![Just(65_535usize), 1000usize..20_000],
        ) {
            let pkts = interleave(&flows, &order);
            let outs = gro(&pkts, cap, BOTH);
            let mut merged_into_fewer = outs.len() <= pkts.len();
            let mut resplit = Vec::new();
            let mut out = vec![0u8; 100_000];
            for (h, p) in &outs {
                let segs = split(h, p, &mut out, 0).unwrap();
                for i in 0..segs.count() {
                    resplit.push(out[segs.packet(i)].to_vec());
                }
            }
            merged_into_fewer &= resplit.len() == pkts.len();
            prop_assert!(merged_into_fewer);
            prop_assert_eq!(per_flow(resplit), per_flow(pkts));
        }

        /// Coalescing in place (the packets back to back in one receive buffer, as UDP GRO
        /// leaves them) writes exactly the bytes that coalescing by copying builds.
        #[test]
        fn coalesce_refs_writes_what_coalesce_builds(
            flows in proptest::collection::vec(0u16..4, 1..4)
                .prop_flat_map(|ids| ids.into_iter().enumerate()
                    .map(|(i, _)| flow(i as u16)).collect::<Vec<_>>()),
            order in proptest::collection::vec(0usize..4, 1..40),
            gap in 0usize..30,
        ) {
            let pkts = interleave(&flows, &order);
            let (mut bufs, mut lens) = batch(&pkts, 65_535);
            let mut copying = GroTable::new(BOTH, 4);
            let want: Vec<Vec<u8>> = copying
                .coalesce(&mut bufs, &mut lens)
                .to_vec()
                .into_iter()
                .map(|i| bufs[i][..lens[i]].to_vec())
                .collect();

            let mut one = vec![0x5au8; gap];
            let mut refs = Vec::new();
            for p in &pkts {
                refs.push(PacketRef::new(0, one.len(), p.len()));
                one.extend_from_slice(p);
                one.extend(std::iter::repeat_n(0x5a, gap));
            }
            let mut bufs = [one];
            let mut t = GroTable::new(BOTH, 4);
            let writes = t.coalesce_refs(&mut bufs, &refs).to_vec();
            let got: Vec<Vec<u8>> = writes
                .iter()
                .map(|w| {
                    let mut b = w.hdr.to_vec();
                    b.extend_from_slice(&bufs[0][w.head.start..][..w.head.len]);
                    for r in t.appended(w, &refs) {
                        b.extend_from_slice(&bufs[0][r.start..][..r.len]);
                    }
                    assert_eq!(b.len(), VIRTIO_HEADROOM + w.len);
                    b
                })
                .collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(t.merged(), copying.merged());
        }

        /// (c) Arbitrary bytes never panic, and the output invariants hold.
        #[test]
        fn coalesce_never_panics(
            pkts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..120), 0..16),
            cap in 0usize..300,
            lens_noise in proptest::collection::vec(any::<u8>(), 16),
        ) {
            let (mut bufs, mut lens) = batch(&pkts, cap);
            for (l, n) in lens.iter_mut().zip(&lens_noise) {
                if *n > 250 {
                    *l = usize::from(*n) * 3;
                }
            }
            let mut t = GroTable::new(BOTH, 16);
            let out = t.coalesce(&mut bufs, &mut lens).to_vec();
            check_invariants(&out, &bufs, &lens);
        }

        /// (c) In place, arbitrary references (overlapping, out of range) over arbitrary bytes
        /// or mangled real flows never panic, and every write stays inside the buffers with its
        /// length adding up.
        #[test]
        fn coalesce_refs_never_panics(
            f in flow(0),
            junk in proptest::collection::vec(any::<u8>(), 0..400),
            refs in proptest::collection::vec((0usize..3, 0usize..3000, 0usize..1600), 0..24),
            flips in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..6),
        ) {
            let mut real: Vec<u8> = interleave(&[f], &[0, 0]).concat();
            for (at, v) in flips {
                if !real.is_empty() {
                    let at = usize::from(at) % real.len();
                    real[at] ^= v;
                }
            }
            let mut bufs = [real, junk];
            let refs: Vec<PacketRef> =
                refs.into_iter().map(|(buf, start, len)| PacketRef::new(buf, start, len)).collect();
            let mut t = GroTable::new(BOTH, 8);
            let writes = t.coalesce_refs(&mut bufs, &refs).to_vec();
            for w in &writes {
                let mut total = w.head.len;
                prop_assert!(w.head.bytes(&bufs).is_some());
                for r in t.appended(w, &refs) {
                    prop_assert!(r.bytes(&bufs).is_some());
                    total += r.len;
                }
                prop_assert_eq!(total, w.len);
            }
            prop_assert_eq!(writes.len() + t.merged() + t.invalid(), refs.len());
        }

        /// (c) Near-valid batches (real flows with bytes flipped) never panic either.
        #[test]
        fn coalesce_never_panics_near_valid(
            f in flow(0),
            g in flow(1),
            flips in proptest::collection::vec((any::<u16>(), any::<u16>(), any::<u8>()), 0..6),
            cap in 0usize..5000,
        ) {
            let mut pkts = interleave(&[f, g], &[0, 1, 1]);
            for (which, at, v) in flips {
                let n = pkts.len();
                let p = &mut pkts[usize::from(which) % n];
                let at = usize::from(at) % p.len();
                p[at] ^= v;
            }
            let (mut bufs, mut lens) = batch(&pkts, cap);
            let mut t = GroTable::new(BOTH, 16);
            let out = t.coalesce(&mut bufs, &mut lens).to_vec();
            check_invariants(&out, &bufs, &lens);
        }
    }
}
